"""The `hapi` command as a user runs it: real processes, real ports, errors without tracebacks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hapi.cli.demo_run import ACCURACY_TOLERANCE, DemoConfig, run_demo
from hapi.client import connect

from ..cli_runner import hapi
from ..seaweed import free_port

HAPI = [sys.executable, "-m", "hapi.cli"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def hapi_cli():  # type: ignore[no-untyped-def]
    """Run `hapi ARGS...` in this process; output with runs of whitespace made one space."""

    def run(*args: str) -> Result:
        done = hapi(*args)
        return Result(done.code, " ".join(done.stdout.split()), " ".join(done.stderr.split()))

    return run


def test_data_synth_then_ls(hapi_cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    made = hapi_cli(
        "data", "synth", str(tmp_path / "ds"), "--classes", "3", "--per-class", "2", "--size", "32"
    )
    assert made.returncode == 0, made.stderr
    assert "6 images, 3 classes" in made.stdout
    listed = hapi_cli("data", "ls", str(tmp_path / "ds"))
    assert "6 images, 3 classes" in listed.stdout
    assert len(list((tmp_path / "ds").glob("class_*/*.jpg"))) == 6


def test_data_import(hapi_cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert (
        hapi_cli(
            "data", "synth", str(tmp_path / "src"), "--per-class", "1", "--size", "16"
        ).returncode
        == 0
    )
    done = hapi_cli("data", "import", str(tmp_path / "src"), str(tmp_path / "dst"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "dst").rglob("*.jpg")) == sorted(
        p.name for p in (tmp_path / "src").rglob("*.jpg")
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("profile", "no_such_model"), "unknown model 'no_such_model'"),
        (("serve", "--store", "ftp://x"), "unknown store URI scheme"),
        (("serve", "--store", "/nonexistent/hapi-store"), "/nonexistent/hapi-store does not exist"),
        (("serve", "--store", ".", "--port", "0", "--egress-limit", "fast"), "cannot read rate"),
        (("serve", "--store", ".", "--feature-cache-size", "lots"), "cannot read size 'lots'"),
        (("serve", "--store", ".", "--head-compiler", "tvm"), "head_compiler is one of"),
    ],
)
def test_errors_are_one_line_without_traceback(
    hapi_cli,
    args: tuple[str, ...],
    needle: str,  # type: ignore[no-untyped-def]
) -> None:
    result = hapi_cli(*args)
    assert result.returncode == 1
    assert needle in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_port_in_use_is_named(hapi_cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = hapi_cli("serve", "--store", str(tmp_path), "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on grpc://127.0.0.1:{port}" in result.stderr


def test_serve_runs_until_sigterm(hapi_cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    made = hapi_cli("data", "synth", str(tmp_path / "train"), "--per-class", "2", "--size", "32")
    assert made.returncode == 0
    port = free_port()
    scratch = tmp_path / "tmp"  # where the server keeps its uploaded heads
    scratch.mkdir()
    proc = subprocess.Popen(
        [*HAPI, "serve", "--store", str(tmp_path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        conn = connect(f"127.0.0.1:{port}", timeout=5)
        deadline = time.monotonic() + 120
        while True:
            try:
                manifest = conn.manifest("train")
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        assert len(manifest) == 8
        assert len(list(scratch.glob(f"hapi-heads-{proc.pid}-*"))) == 1
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert f"127.0.0.1:{port}" in out and "stopped" in out
    # OpenVINO is in the dev extra: `auto` takes it on a CPU.
    assert "heads compiled by OpenVINO once compiling pays" in out
    assert list(scratch.iterdir()) == []  # its directory went with it


def test_the_demo_plans_caches_and_trains_the_same_model(tmp_path: Path) -> None:
    picture = tmp_path / "run.png"
    config = DemoConfig(
        train_per_class=4,
        val_per_class=2,
        image_size=64,
        batch_size=8,
        picture=str(picture),
    )
    seen: set[str] = set()
    base, push = run_demo(config, lambda phase, done, total: seen.add(phase))
    assert base.mode == "baseline" and push.mode == "hapi" and base.route == "raw bytes"
    # The planner chose among the options it weighed, and the first epoch ran its choice.
    assert push.plan is not None and len(push.plan.options) > 2
    assert push.plan.chosen in push.plan.options
    assert (push.epochs[0].cut, push.epochs[0].share) == (push.plan.cut, push.plan.share)
    # Deterministic transforms: epochs 2-3 came from the trainer's cache, moving nothing;
    # the baseline read every image's bytes again.
    assert [e.bytes_received for e in push.epochs[1:]] == [0, 0]
    assert all(e.cached == e.samples == 16 for e in push.epochs[1:])
    assert all(e.bytes_received == base.epochs[0].bytes_received > 0 for e in base.epochs)
    assert push.whole_s > sum(e.seconds for e in push.epochs)
    assert abs(push.evaluation.accuracy - base.evaluation.accuracy) <= ACCURACY_TOLERANCE
    assert push.picture == picture and picture.read_bytes()[:4] == b"\x89PNG"
    assert {"writing train images", "baseline epoch 3", "hapi evaluate"} <= seen


def test_hapi_demo_prints_the_plan_the_cache_and_the_picture(hapi_cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    picture = tmp_path / "demo.png"
    done = hapi_cli(
        "demo", "--per-class", "2", "--image-size", "64", "--epochs", "2", "--plot", str(picture)
    )
    assert done.returncode == 0, done.stderr
    assert "The planner weighed" in done.stdout and "and chose" in done.stdout
    assert "epoch 2: MB" in done.stdout and "none crossed" in done.stdout
    assert "Epochs 2-2 took 8 of 8 samples from the trainer's feature cache" not in done.stdout
    assert "Epoch 2 took 8 of 8 samples from the trainer's feature cache" in done.stdout
    assert f"Wrote a picture of hapi's run to {picture}" in done.stdout
    assert picture.stat().st_size > 1000
