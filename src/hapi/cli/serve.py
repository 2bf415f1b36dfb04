"""`hapi serve`: run the storage-side server."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from hapi._gc import freeze_long_lived

if TYPE_CHECKING:
    from hapi.server import HapiServer, ServerConfig


def register(app: typer.Typer) -> None:
    """Add `serve` to `app`."""
    app.command()(serve)


_STORE = typer.Option(..., help="Object store to serve: a directory, s3://bucket/prefix.")
_HOST = typer.Option(
    "127.0.0.1",
    help="Address to listen on. Beyond loopback it needs tokens and TLS, or --insecure.",
)
_PORT = typer.Option(8815, help="Port to listen on (0: any free port).")
_EGRESS_LIMIT = typer.Option(
    None, help="Cap on what the server sends, e.g. 50mbit (emulates a storage link)."
)
_BATCH_SIZE = typer.Option(
    256, help="Largest feature-extraction batch (each session's is chosen by measured speed)."
)
_DEVICE = typer.Option("cpu", help="Where heads run: cpu, cuda, cuda:N.")
_THREADS = typer.Option(None, help="torch threads for heads.")
_MEMORY_BUDGET = typer.Option(
    None,
    help="Memory heads and running batches may hold, e.g. 4GiB (default: half the room "
    "left under the tightest of the host's memory and the process's memory cgroups; on "
    "a GPU at most 90% of its free memory).",
)
_COMPUTE_SLOTS = typer.Option(
    None, help="Batches computed at once (default: one per core this process may use)."
)
_MAX_HEAD_BYTES = typer.Option(
    "2GiB", help="Largest head a trainer may upload (its own model, exported)."
)
_TOKEN = typer.Option(
    None,
    envvar="HAPI_TOKEN",
    help="Bearer token callers must send; best from HAPI_TOKEN (the command line is "
    "visible in the process list).",
)
_TENANTS = typer.Option(
    None,
    help="TOML file of tenants (token_env or token, prefixes, weight per tenant); "
    "re-read on SIGHUP.",
)
_TLS_CERT = typer.Option(None, help="PEM certificate to serve grpc+tls:// with.")
_TLS_KEY = typer.Option(None, help="PEM private key of --tls-cert (unencrypted).")
_TLS_CLIENT_CA = typer.Option(
    None, help="PEM CA bundle: clients must present a certificate it signed (mutual TLS)."
)
_INSECURE = typer.Option(False, help="Bind beyond loopback without a token or without TLS anyway.")
_METRICS_PORT = typer.Option(
    None,
    help="Serve Prometheus metrics on this port at /metrics, over HTTPS with --tls-cert "
    "(0: any free port).",
)
_METRICS_HOST = typer.Option("127.0.0.1", help="Address of the metrics endpoint.")
_REPO = typer.Option(None, envvar="HAPI_REPO", help="Model repository for repo:// refs.")
_ENDPOINT = typer.Option(None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL).")
_FEATURE_CACHE = typer.Option(
    None,
    help="Directory where computed features are kept and shared by every job whose head "
    "has the same content (deterministic or views=K transforms): later jobs skip the head.",
)
_FEATURE_CACHE_SIZE = typer.Option(
    "50GiB", help="Bound on --feature-cache's bytes on disk (least recently used go)."
)
_BF16_HEADS = typer.Option(
    True,
    help="Run the heads of jobs that allow it (head_dtype='bf16') in bf16 where the device "
    "has bf16 kernels (--no-bf16-heads: every head in fp32).",
)
_COMPILE_HEADS = typer.Option(
    "auto",
    help="auto: compile a head (torch.compile) once its eager time would have paid for the "
    "compile, and keep it if it is faster and agrees; always: as soon as its batch size "
    "settles; off: every head eager.",
)
_HEAD_COMPILER = typer.Option(
    "auto",
    help="What compiles heads: openvino (hapi's openvino extra; CPU only), inductor "
    "(torch.compile), or auto: OpenVINO on a CPU where it is installed, else inductor.",
)
_LOCAL_PREFIX = typer.Option(
    None,
    help="A prefix of the store local to this server (its storage node); repeat for "
    "several. Trainers with several servers send it the chunks under it.",
)
_BESIDE = typer.Option(
    None,
    help="URL of the SeaweedFS volume server on this machine (e.g. http://127.0.0.1:8080), "
    "or 'auto' to find the one running here: trainers send this server the chunks whose "
    "bytes lie there. Needs --filer.",
)
_FILER = typer.Option(
    None, help="URL of the SeaweedFS filer, which says on which volumes each object lies."
)


def serve(
    store: str = _STORE,
    host: str = _HOST,
    port: int = _PORT,
    egress_limit: str = _EGRESS_LIMIT,
    batch_size: int = _BATCH_SIZE,
    device: str = _DEVICE,
    threads: int = _THREADS,
    memory_budget: str = _MEMORY_BUDGET,
    compute_slots: int = _COMPUTE_SLOTS,
    max_head_bytes: str = _MAX_HEAD_BYTES,
    token: str = _TOKEN,
    tenants: str = _TENANTS,
    tls_cert: str = _TLS_CERT,
    tls_key: str = _TLS_KEY,
    tls_client_ca: str = _TLS_CLIENT_CA,
    insecure: bool = _INSECURE,
    metrics_port: int = _METRICS_PORT,
    metrics_host: str = _METRICS_HOST,
    repo: str = _REPO,
    endpoint: str = _ENDPOINT,
    feature_cache: str = _FEATURE_CACHE,
    feature_cache_size: str = _FEATURE_CACHE_SIZE,
    local_prefix: list[str] = _LOCAL_PREFIX,
    beside: str = _BESIDE,
    filer: str = _FILER,
    bf16_heads: bool = _BF16_HEADS,
    compile_heads: str = _COMPILE_HEADS,
    head_compiler: str = _HEAD_COMPILER,
) -> None:
    """Serve features computed next to the data over Arrow Flight, until Ctrl-C."""
    given = dict(locals())  # the options, by ServerConfig's names but for two
    from hapi.cli._stores import store_options
    from hapi.server.memory.budget import bound_allocator

    bound_allocator()  # Before torch and the server start their threads: see its docstring.
    from hapi.server import ServerConfig

    _warn_token_in_process_list(token)
    config = ServerConfig(
        store_options=store_options(given.pop("endpoint")),
        local_prefixes=tuple(given.pop("local_prefix") or ()),
        **given,
    )
    _check_store_and_repo(config)
    _serve_until_stopped(config)


def _warn_token_in_process_list(token: str | None) -> None:
    """Warn when the token came from the command line, which every user can read."""
    if token is not None and os.environ.get("HAPI_TOKEN") != token:
        Console(stderr=True, highlight=False).print(
            "[yellow]warning:[/] --token is visible to every user of this machine in the "
            "process list; set HAPI_TOKEN instead, or use --tenants with token_env"
        )


def _check_store_and_repo(config: ServerConfig) -> None:
    """Refuse a store or repository the server could not read, before it binds.

    A server reads its store and repository: refuse a mistyped directory instead of
    making it, and an unreachable S3 endpoint now instead of at the first chunk.
    """
    from hapi.cli._stores import existing_repo, existing_store

    hint = f"make a dataset there first (`hapi data synth {config.store}/train`)"
    existing_store(config.store, config.store_options, hint).check()
    if config.repo:
        existing_repo(config.repo, config.store_options).check()


def _serve_until_stopped(config: ServerConfig) -> None:
    """Run the server until SIGTERM or Ctrl-C; SIGHUP meanwhile re-reads the tenants file."""
    from hapi.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM and SIGINT end the server through an exception, and it then stops cleanly;
    # `serve` re-reads the tenants file on SIGHUP.
    signal.signal(signal.SIGTERM, _interrupt)
    with serve(config) as server:
        _announce(server, config)
        freeze_long_lived()  # loaded: a full collection no longer stops every thread
        try:
            # The main thread waits here, in Python, rather than in the server's C++: there
            # Python runs no signal handler until it returns, so a SIGHUP would wait for the end.
            while not server.stopped:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    Console().print("hapi server stopped")


def _announce(server: HapiServer, config: ServerConfig) -> None:
    """Print where the server listens, what it serves and the memory it may use."""
    from hapi._sizes import format_bytes

    limit = f", egress limited to {config.egress_limit}" if config.egress_limit else ""
    models = f", models from [bold]{config.repo}[/]" if config.repo else ""
    who = f", {len(server.tenants)} tenant(s) from {config.tenants}" if config.tenants else ""
    if config.local_prefixes:
        who += f", local: {', '.join(config.local_prefixes)}"
    if server.locality is not None:
        who += f", beside {server.locality.beside}"
    if config.feature_cache:
        who += f", feature cache {config.feature_cache} ({config.feature_cache_size})"
    Console().print(
        f"hapi serving [bold]{config.store}[/] at [bold]{server.address}[/]{limit}{models}{who}"
    )
    if server.metrics.url:
        Console().print(f"metrics at [bold]{server.metrics.url}[/]")
    room = server.scheduler.stats()
    basis = server.memory_limit if server.memory_limit is not None else "--memory-budget"
    # One line, however narrow the terminal: operators and tests grep for it.
    Console(highlight=False, soft_wrap=True).print(
        f"memory budget {format_bytes(room.budget)}: {basis}; "
        f"{room.slots} batch(es) computed at once"
    )
    if server.memory_limit is None:
        _warn_over_limit(room.budget, config.device)  # right under the budget it is about
    Console(highlight=False, soft_wrap=True).print(_heads_line(server, config))


def _heads_line(server: HapiServer, config: ServerConfig) -> str:
    """How the server will run heads: eager, or compiled by which compiler and when."""
    if config.compile_heads == "off":
        return "heads run eager (--compile-heads off)"
    when = "once compiling pays" if config.compile_heads == "auto" else "as soon as they settle"
    return (
        f"heads compiled by {server.opener.compiled.runtime} {when}, exact sessions eager "
        f"(--compile-heads {config.compile_heads})"
    )


def _warn_over_limit(budget: int, device: str) -> None:
    """Warn when a configured budget leaves no room under the tightest memory limit."""
    from hapi._sizes import format_bytes
    from hapi.server.memory.limits import tightest_room

    limit = tightest_room(device)
    if budget > limit.room:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[yellow]warning:[/] --memory-budget {format_bytes(budget)} is more than the "
            f"{format_bytes(limit.room)} left under {limit.what}"
            f"{' of ' + limit.where if limit.where else ''} "
            f"({format_bytes(limit.limit)}, {format_bytes(limit.used)} in use): the kernel "
            "may kill the server before the budget stops it; lower --memory-budget"
        )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
