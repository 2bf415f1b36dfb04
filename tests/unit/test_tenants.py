"""Tenants: the tenants file, token lookup, prefix checks on path segments, reload."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hapi.errors import Forbidden, InvalidRequest, Unauthenticated
from hapi.server.security.tenants import Tenant, Tenants, reload_on_sighup

TOKEN_A = "alpha-secret-token-0123456789"
TOKEN_B = "beta-secret-token-9876543210"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def two_tenants(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        f"""
[team-a]
token = "{TOKEN_A}"
prefixes = ["datasets/a/", "shared"]
weight = 2

[team-b]
token_env = "HAPI_TEST_TOKEN_B"
prefixes = ["datasets/b"]
""",
    )


def test_file_maps_tokens_to_tenants(tmp_path: Path) -> None:
    tenants = Tenants.from_file(two_tenants(tmp_path), environ={"HAPI_TEST_TOKEN_B": TOKEN_B})
    a = tenants.authenticate(TOKEN_A)
    b = tenants.authenticate(TOKEN_B)
    assert (a.name, a.prefixes, a.weight) == ("team-a", ("datasets/a", "shared"), 2.0)
    assert (b.name, b.prefixes, b.weight) == ("team-b", ("datasets/b",), 1.0)
    assert tenants.requires_token
    assert [t.name for t in tenants] == ["team-a", "team-b"]
    assert tenants.get("team-b") == b
    assert tenants.get("team-c") is None


def test_token_never_shown(tmp_path: Path) -> None:
    tenants = Tenants.from_file(two_tenants(tmp_path), environ={"HAPI_TEST_TOKEN_B": TOKEN_B})
    shown = repr(tenants) + repr(list(tenants)) + str(list(tenants))
    assert "team-a" in shown
    assert TOKEN_A not in shown and TOKEN_B not in shown


@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN_A[:-1], TOKEN_A + "x"])
def test_bad_token_is_unauthenticated(tmp_path: Path, token: str | None) -> None:
    tenants = Tenants.from_file(two_tenants(tmp_path), environ={"HAPI_TEST_TOKEN_B": TOKEN_B})
    with pytest.raises(Unauthenticated) as info:
        tenants.authenticate(token)
    assert "bearer token" in str(info.value)


def test_authorization_header() -> None:
    tenants = Tenants.single(TOKEN_A)
    assert tenants.authenticate_header([f"Bearer {TOKEN_A}"]).name == "default"
    assert tenants.authenticate_header([f"bearer  {TOKEN_A}"]).name == "default"
    assert tenants.authenticate_header(["Bearer nope", f"Bearer {TOKEN_A}"]).name == "default"
    for values in ([], [TOKEN_A], [f"Basic {TOKEN_A}"], ["Bearer nope"]):
        with pytest.raises(Unauthenticated):
            tenants.authenticate_header(values)


def test_single_and_open() -> None:
    single = Tenants.single(TOKEN_A)
    tenant = single.authenticate(TOKEN_A)
    assert tenant.reads_all and single.requires_token
    with pytest.raises(Unauthenticated):
        single.authenticate(None)
    anyone = Tenants.open()
    assert not anyone.requires_token
    assert anyone.authenticate(None).name == "anonymous"
    assert anyone.authenticate("whatever").reads_all


def test_prefixes_match_whole_segments() -> None:
    tenant = Tenant(name="a", token=TOKEN_A, prefixes=("data/a",))
    assert tenant.allows("data/a/x.jpg")
    assert tenant.allows("data/a/deep/er/x.jpg")
    assert tenant.allows("data/a")
    for key in ["data/ab/x.jpg", "data/a.jpg", "data", "data/b/x", "other/data/a/x"]:
        assert not tenant.allows(key), key
        with pytest.raises(Forbidden, match="outside the prefixes"):
            tenant.check_key(key)
    # Malformed is a bad request whatever the prefixes; not a refusal of a real key.
    assert not tenant.allows("/data/a/x")
    with pytest.raises(InvalidRequest, match="invalid key"):
        tenant.check_key("/data/a/x")
    assert tenant.check_key("data/a/x.jpg") == "data/a/x.jpg"


@pytest.mark.parametrize(
    "key", ["data/a/../b/x", "data/a/./x", "data/a//x", "data/a/x\n", "data/a/\x00", "", ".."]
)
def test_keys_that_could_escape_a_prefix_are_refused(key: str) -> None:
    everything = Tenant(name="all", token=TOKEN_A)
    narrow = Tenant(name="a", token=TOKEN_B, prefixes=("data/a",))
    for tenant in (everything, narrow):
        assert not tenant.allows(key)
        with pytest.raises(InvalidRequest, match="invalid key") as info:
            tenant.check_key(key)
        assert not isinstance(info.value, Forbidden)


def test_a_listing_is_checked_at_once_as_key_by_key() -> None:
    """A tenant that reads everything checks a listing's keys in Arrow: the same answers
    as `allows`, a key at a time; a narrower tenant checks them a key at a time."""
    import pyarrow as pa

    keys = [
        "a", "a/b.jpg", "", "/a", "a/", "a//b", ".", "..", "a/./b", "a/../b", "./a", "a/..",
        "a/.b", "a/..b/c", "...", "a/...", ".hidden", "a/b/.", "a\x01b", "a\x7f", "a\tb",
        "a\nb", "é/ü.jpg", "a b/c",
    ]  # fmt: skip
    everything = Tenant(name="all", token=TOKEN_A)
    at_once = everything.allows_all(pa.array(keys))
    assert at_once is not None
    assert at_once.tolist() == [everything.allows(k) for k in keys]
    assert 0 < sum(at_once) < len(keys)
    assert Tenant(name="a", token=TOKEN_B, prefixes=("a",)).allows_all(pa.array(keys)) is None


def test_refusal_names_key_shortened_and_prefixes() -> None:
    tenant = Tenant(name="team-a", token=TOKEN_A, prefixes=("datasets/a", "shared/x"))
    key = "datasets/b/" + "k" * 10_000
    with pytest.raises(Forbidden) as info:
        tenant.check_key(key)
    message = str(info.value)
    assert "datasets/b/kkk" in message
    assert "'datasets/a', 'shared/x'" in message and "team-a" in message
    assert len(message) < 800


def test_check_prefix() -> None:
    tenant = Tenant(name="a", token=TOKEN_A, prefixes=("data/a",))
    assert tenant.check_prefix("data/a") == "data/a"
    assert tenant.check_prefix("/data/a/train/") == "data/a/train"
    for prefix in ["", "data", "data/ab", "/"]:
        with pytest.raises(Forbidden):
            tenant.check_prefix(prefix)
    with pytest.raises(InvalidRequest, match="invalid prefix"):
        tenant.check_prefix("data/a/../b")
    assert Tenant(name="all", token=TOKEN_A).check_prefix("") == ""


def test_prefixes_are_normalised() -> None:
    tenant = Tenant(name="a", token=TOKEN_A, prefixes=("b/", "a/x", "a", "/c"))
    assert tenant.prefixes == ("a", "b", "c")
    assert Tenant(name="a", token=TOKEN_A, prefixes=("a", "")).prefixes == ("",)
    assert Tenant(name="a", token=TOKEN_A, prefixes=["/"]).reads_all  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"name": "has space"}, "tenant name"),
        ({"name": ""}, "tenant name"),
        ({"token": "two words"}, "printable word"),
        ({"token": ""}, "printable word"),
        ({"weight": 0}, "> 0"),
        ({"weight": -1.0}, "> 0"),
        ({"weight": float("nan")}, "> 0"),
        ({"weight": float("inf")}, "> 0"),
        ({"weight": True}, "number"),
        ({"prefixes": ()}, "empty"),
        ({"prefixes": "data/a"}, "list of strings"),
        ({"prefixes": ("data/../x",)}, "'..'"),
    ],
)
def test_invalid_tenant(fields: dict[str, object], fix: str) -> None:
    values: dict[str, object] = {"name": "a", "token": TOKEN_A, "prefixes": ("x",)} | fields
    with pytest.raises(InvalidRequest, match=fix):
        Tenant(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("", "no tenants"),
        ("[a\n", "not valid TOML"),
        ("a = 1\n", "tenant 'a': is not a table"),
        ('[a]\ntoken = "t"\nprefixes = [""]\ntokn = "x"\n', "tenant 'a': unknown field"),
        ('[a]\nprefixes = [""]\n', "tenant 'a': give exactly one of token_env"),
        ('[a]\ntoken = "t"\ntoken_env = "X"\nprefixes = [""]\n', "exactly one"),
        ('[a]\ntoken = "t"\n', "tenant 'a': no prefixes"),
        ('[a]\ntoken = "t"\nprefixes = "x"\n', "list of strings"),
        ('[a]\ntoken = 5\nprefixes = ["x"]\n', "token must be a string"),
        ('[a]\ntoken = "t"\nprefixes = ["x"]\nweight = 0\n', "tenant 'a': weight"),
        ('[a]\ntoken_env = "HAPI_TEST_UNSET"\nprefixes = ["x"]\n', "export HAPI_TEST_UNSET"),
        ('[a]\ntoken = "t"\nprefixes = ["x"]\n[b]\ntoken = "t"\nprefixes = ["y"]\n', "'a' and 'b'"),
    ],
)
def test_invalid_file_names_file_tenant_and_fix(tmp_path: Path, text: str, fix: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InvalidRequest) as info:
        Tenants.from_file(path, environ={})
    assert f"tenants file {path}" in str(info.value)
    assert fix in str(info.value)


def test_duplicate_token_error_does_not_show_it(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f'[a]\ntoken = "{TOKEN_A}"\nprefixes = ["x"]\n[b]\ntoken_env = "T"\nprefixes = ["y"]\n',
    )
    with pytest.raises(InvalidRequest, match="same token") as info:
        Tenants.from_file(path, environ={"T": TOKEN_A})
    assert TOKEN_A not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot read it"):
        Tenants.from_file(tmp_path / "nope.toml")


def test_reload_swaps_tenants(tmp_path: Path) -> None:
    path = write(tmp_path, f'[a]\ntoken = "{TOKEN_A}"\nprefixes = ["x"]\n')
    tenants = Tenants.from_file(path)
    path.write_text(f'[b]\ntoken = "{TOKEN_B}"\nprefixes = ["y", "z"]\n')
    assert tenants.reload()
    assert tenants.authenticate(TOKEN_B).prefixes == ("y", "z")
    with pytest.raises(Unauthenticated):
        tenants.authenticate(TOKEN_A)
    assert tenants.get("a") is None


def test_bad_reload_keeps_old_tenants(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, f'[a]\ntoken = "{TOKEN_A}"\nprefixes = ["x"]\n')
    tenants = Tenants.from_file(path)
    path.write_text(f'[b]\ntoken = "{TOKEN_B}"\nprefixes = ["../y"]\n')
    with caplog.at_level(logging.ERROR, logger="hapi.server"):
        assert not tenants.reload()
    assert tenants.authenticate(TOKEN_A).name == "a"
    assert "kept the 1 tenants" in caplog.text and "tenant 'b'" in caplog.text
    assert not Tenants.single(TOKEN_A).reload()


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_sighup_reloads(tmp_path: Path) -> None:
    path = write(tmp_path, f'[a]\ntoken = "{TOKEN_A}"\nprefixes = ["x"]\n')
    tenants = Tenants.from_file(path)
    before = signal.getsignal(signal.SIGHUP)
    restore = reload_on_sighup(tenants)
    assert signal.getsignal(signal.SIGHUP) != before
    try:
        path.write_text(f'[b]\ntoken = "{TOKEN_B}"\nprefixes = ["y"]\n')
        os.kill(os.getpid(), signal.SIGHUP)
        # The handler starts the reload in a thread; wait for it (a deadline, not a timing).
        deadline = time.monotonic() + 30
        while tenants.get("b") is None and time.monotonic() < deadline:
            for thread in threading.enumerate():
                if thread.name == "hapi-tenants-reload":
                    thread.join(1)
            time.sleep(0.01)
        assert tenants.authenticate(TOKEN_B).name == "b"
    finally:
        restore()
    assert signal.getsignal(signal.SIGHUP) == before
