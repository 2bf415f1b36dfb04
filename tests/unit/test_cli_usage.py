"""`hapi` answers like a tool: one `error:` line, exit 2 for usage and 1 for refused values."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from hapi.cli._errors import run
from hapi.errors import InvalidRequest

from ..cli_runner import hapi
from ..seaweed import free_port


@pytest.mark.parametrize(
    ("args", "needle", "command"),
    [
        (("serve", "--stor", "X"), "no such option: --stor", "hapi serve"),
        (("profile", "resnet18", "--imagesize", "64"), "--imagesize", "hapi profile"),
        (("serve", "--port", "notaport"), "'--port'", "hapi serve"),
        (("frobnicate",), "no such command 'frobnicate'", "hapi"),
        (("repo", "push", "resnet18"), "missing option '--model'", "hapi repo push"),
        (("data", "ls"), "missing argument", "hapi data ls"),
    ],
)
def test_usage_mistakes_are_one_line_and_a_hint_with_exit_2(
    args: tuple[str, ...], needle: str, command: str
) -> None:
    result = hapi(*args)
    assert result.code == 2
    assert needle in result.error
    assert f"Try '{command} --help' for help." in result.stderr.splitlines()
    assert len(result.stderr.splitlines()) == 2
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_no_arguments_show_the_help() -> None:
    result = hapi("data")
    assert "synth" in result.stdout + result.stderr and not result.error_lines


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--batch-size", "0"), "batch_size"),
        (("--port", "70000"), "port"),
        (("--threads", "0"), "threads"),
        (("--device", "tpu"), "'tpu'"),
        (("--endpoint", "127.0.0.1:9000"), "not an http(s) URL"),
        (("--egress-limit", "50"), "cannot read rate '50'"),
        (("--egress-limit", "12.5 "), "cannot read rate"),
    ],
)
def test_configuration_mistakes_are_one_line_with_exit_1(
    tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    # A store that does not exist: were a value let through, serve still stops, never serves.
    result = hapi("serve", "--store", str(tmp_path / "missing"), *args)
    assert result.code == 1, result.stderr
    assert needle in result.error and "internal error" not in result.error
    assert "Traceback" not in result.stderr


def test_a_rate_without_unit_lists_the_accepted_forms(tmp_path: Path) -> None:
    result = hapi("serve", "--store", str(tmp_path), "--port", "0", "--egress-limit", "50")
    assert result.code == 1
    assert all(form in result.error for form in ("50mbit", "1gbit", "100MB", "64KiB"))
    assert hapi("demo", "--link", "50").code == 1


@pytest.mark.parametrize(
    "args",
    [
        ("data", "ls", "{typo}"),
        ("repo", "ls", "--repo", "{typo}"),
        ("repo", "log", "m", "--repo", "{typo}"),
        ("repo", "show", "m", "--repo", "{typo}"),
        ("repo", "lineage", "--repo", "{typo}"),
        ("repo", "diff", "a", "b", "--repo", "{typo}"),
        ("repo", "find", "--name", "x", "--repo", "{typo}"),
        ("repo", "rm", "m", "--repo", "{typo}"),
        ("repo", "gc", "--repo", "{typo}"),
        ("repo", "reindex", "--repo", "{typo}"),
        ("repo", "fsck", "--repo", "{typo}"),
        ("serve", "--store", "{typo}"),
        ("serve", "--store", "{here}", "--repo", "{typo}"),
    ],
)
def test_readers_never_create_what_they_read(tmp_path: Path, args: tuple[str, ...]) -> None:
    typo = tmp_path / "typo"
    filled = [a.format(typo=typo, here=tmp_path) for a in args]
    result = hapi(*filled)
    assert result.code == 1
    assert f"{typo} does not exist" in result.error and "hapi " in result.error  # what to do
    assert not typo.exists()


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_an_unreachable_s3_endpoint_is_reported_at_start(taken_port: int) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # The port to serve on is taken: without the check at start, serve would fail to bind
    # (another message) rather than serve and wait forever.
    result = hapi(
        "serve", "--store", "s3://bucket/data", "--endpoint", endpoint, "--port", str(taken_port)
    )
    assert result.code == 1
    assert f"cannot reach store s3://bucket/data at {endpoint}" in result.error
    assert "Connection refused" in result.error and "endpoint" in result.error


def _app(fail: BaseException) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def go() -> None:
        raise fail

    @app.command()
    def other() -> None:
        pass

    return app


def test_an_unexpected_exception_is_one_line_naming_hapi_debug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HAPI_DEBUG", raising=False)
    assert run(_app(RuntimeError("boom\nsecond line")), ["go"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: internal error (RuntimeError: boom second line); run with HAPI_DEBUG=1 for "
        "the traceback"
    ]
    monkeypatch.setenv("HAPI_DEBUG", "1")
    assert run(_app(RuntimeError("boom")), ["go"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1].startswith("error: internal error")


def test_a_hapi_error_is_one_literal_line(capsys: pytest.CaptureFixture[str]) -> None:
    long = "x" * 300
    assert run(_app(InvalidRequest(f"bad [red]value[/]\n{long}")), ["go"]) == 1
    assert capsys.readouterr().err == f"error: bad [red]value[/] {long}\n"
