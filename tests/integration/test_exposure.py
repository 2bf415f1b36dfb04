"""Which addresses a server binds: loopback freely, beyond it only with tokens and TLS (or
`--insecure`); the refusal comes before binding. Nothing here listens beyond loopback."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hapi.client import connect
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidRequest, Unauthenticated
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server._listen import Listener

from ..certs import make_certs
from ..cli_runner import hapi
from ..seaweed import free_port

TOKEN = "exposure-test-token-0123456789"
HAPI = [sys.executable, "-m", "hapi.cli"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=2, per_class=2, size=32, seed=0)
    return root


@pytest.mark.parametrize(
    ("options", "exposed"),
    [
        ({}, "without a token: anyone who reaches its port can read every key"),
        ({"token": TOKEN}, "without TLS: the token (and with it the store)"),
    ],
)
def test_beyond_loopback_is_refused_before_binding(
    store: Path, options: dict[str, str], exposed: str
) -> None:
    port = free_port()
    config = ServerConfig(store=str(store), host="0.0.0.0", port=port, **options)
    with pytest.raises(InvalidRequest, match="--insecure") as refused:
        HapiServer(config)
    assert exposed in str(refused.value)
    # Nothing listens on the port: a server on 0.0.0.0 would hold it on 127.0.0.1 too.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_insecure_accepts_with_warnings_and_tls_with_tokens_needs_none(
    store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Checked through the listener HapiServer builds, which binds nothing itself.
    with caplog.at_level(logging.WARNING, logger="hapi.server"):
        listener = Listener.from_config(
            ServerConfig(store=str(store), host="0.0.0.0", insecure=True)
        )
    assert listener.location == "grpc://0.0.0.0:0" and listener.tls is None
    assert "without a token" in caplog.text and "without TLS" in caplog.text
    caplog.clear()
    certs = make_certs(tmp_path)
    secure = ServerConfig(
        store=str(store),
        host="0.0.0.0",
        token=TOKEN,
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
    )
    with caplog.at_level(logging.WARNING, logger="hapi.server"):
        listener = Listener.from_config(secure)
    assert listener.location == "grpc+tls://0.0.0.0:0" and listener.tenants.requires_token
    assert caplog.text == ""


def test_any_loopback_address_is_served_without_a_token(store: Path) -> None:
    with serve(ServerConfig(store=str(store), host="127.0.0.2")) as server:
        assert server.address.startswith("grpc://127.0.0.2:")
        with connect(server.address, timeout=30) as conn:
            assert len(conn.manifest("train")) == 4


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"token": TOKEN, "tenants": "t.toml"}, "not both"),
        ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key together"),
        ({"tls_key": "k.pem"}, "--tls-cert and --tls-key together"),
        ({"tls_client_ca": "ca.pem"}, "pass --tls-cert and --tls-key as well"),
        ({"metrics_port": 70000}, "metrics_port must be 0..65535"),
    ],
)
def test_config_refuses_half_settings(store: Path, options: dict[str, object], fix: str) -> None:
    with pytest.raises(InvalidRequest, match=fix):
        ServerConfig(store=str(store), **options)  # type: ignore[arg-type]


def test_a_token_on_the_command_line_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HAPI_TOKEN", raising=False)
    missing = str(tmp_path / "no-such-store")
    typed = hapi("serve", "--store", missing, "--token", TOKEN)
    assert typed.code == 1 and "process list" in typed.stderr
    monkeypatch.setenv("HAPI_TOKEN", TOKEN)
    from_env = hapi("serve", "--store", missing)
    assert from_env.code == 1 and "process list" not in from_env.stderr


def test_sighup_reloads_the_tenants_of_hapi_serve(store: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[ops]\ntoken = "{TOKEN}"\nprefixes = ["train"]\n')
    port = free_port()
    proc = subprocess.Popen(
        [*HAPI, "serve", "--store", str(store), "--port", str(port), "--tenants", str(tenants)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = f"grpc://127.0.0.1:{port}"
        manifest = until_answered(
            proc, lambda: connect(address, token=TOKEN, timeout=5).manifest("train")
        )
        assert len(manifest) == 4
        rotated = "rotated-" + TOKEN
        tenants.write_text(f'[ops]\ntoken = "{rotated}"\nprefixes = ["train"]\n')
        os.kill(proc.pid, signal.SIGHUP)
        until_answered(proc, lambda: connect(address, token=rotated, timeout=5).stats())
        with pytest.raises(Unauthenticated):
            connect(address, token=TOKEN, timeout=5).stats()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "tenants: reloaded" in err


def until_answered(proc: subprocess.Popen[str], call):  # type: ignore[no-untyped-def]
    """`call()`'s result once it stops failing (the server starting, or reloading)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.3)
