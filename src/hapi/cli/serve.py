"""`hapi serve`: run the storage-side server."""

from __future__ import annotations

import logging
import os
import signal
import threading

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    """Add `serve` to `app`."""
    app.command()(serve)


def serve(
    store: str = typer.Option(..., help="Object store to serve: a directory, s3://bucket/prefix."),
    host: str = typer.Option(
        "127.0.0.1",
        help="Address to listen on. Beyond loopback it needs tokens and TLS, or --insecure.",
    ),
    port: int = typer.Option(8815, help="Port to listen on (0: any free port)."),
    egress_limit: str = typer.Option(
        None, help="Cap on what the server sends, e.g. 50mbit (emulates a storage link)."
    ),
    batch_size: int = typer.Option(32, help="Largest feature-extraction batch."),
    device: str = typer.Option("cpu", help="Where heads run: cpu, cuda, cuda:N."),
    threads: int = typer.Option(None, help="torch threads for heads."),
    memory_budget: str = typer.Option(
        None,
        help="Memory heads and running batches may hold, e.g. 4GiB (default: half the room "
        "left under the tightest of the host's memory and the process's memory cgroups; on "
        "a GPU at most 90% of its free memory).",
    ),
    compute_slots: int = typer.Option(
        None, help="Batches computed at once (default: one per core this process may use)."
    ),
    max_head_bytes: str = typer.Option(
        "2GiB", help="Largest head a trainer may upload (its own model, exported)."
    ),
    token: str = typer.Option(
        None,
        envvar="HAPI_TOKEN",
        help="Bearer token callers must send; best from HAPI_TOKEN (the command line is "
        "visible in the process list).",
    ),
    tenants: str = typer.Option(
        None,
        help="TOML file of tenants (token_env or token, prefixes, weight per tenant); "
        "re-read on SIGHUP.",
    ),
    tls_cert: str = typer.Option(None, help="PEM certificate to serve grpc+tls:// with."),
    tls_key: str = typer.Option(None, help="PEM private key of --tls-cert (unencrypted)."),
    tls_client_ca: str = typer.Option(
        None, help="PEM CA bundle: clients must present a certificate it signed (mutual TLS)."
    ),
    insecure: bool = typer.Option(
        False, help="Bind beyond loopback without a token or without TLS anyway."
    ),
    metrics_port: int = typer.Option(
        None,
        help="Serve Prometheus metrics on this port at /metrics, over HTTPS with --tls-cert "
        "(0: any free port).",
    ),
    metrics_host: str = typer.Option("127.0.0.1", help="Address of the metrics endpoint."),
    repo: str = typer.Option(None, envvar="HAPI_REPO", help="Model repository for repo:// refs."),
    endpoint: str = typer.Option(None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL)."),
    feature_cache: str = typer.Option(
        None,
        help="Directory where computed features are kept and shared by every job whose head "
        "has the same content (deterministic or views=K transforms): later jobs skip the head.",
    ),
    feature_cache_size: str = typer.Option(
        "50GiB", help="Bound on --feature-cache's bytes on disk (least recently used go)."
    ),
    local_prefix: list[str] = typer.Option(
        None,
        help="A prefix of the store local to this server (its storage node); repeat for "
        "several. Trainers with several servers send it the chunks under it.",
    ),
) -> None:
    """Serve features computed next to the data over Arrow Flight, until Ctrl-C."""
    from hapi._sizes import format_bytes
    from hapi.cli._stores import existing_repo, existing_store, store_options
    from hapi.server.memory.budget import bound_allocator

    # Before torch and the server start their threads: see `bound_allocator`.
    bound_allocator()
    from hapi.server import HapiServer, ServerConfig
    from hapi.server.security.tenants import reload_on_sighup

    if token is not None and os.environ.get("HAPI_TOKEN") != token:
        Console(stderr=True, highlight=False).print(
            "[yellow]warning:[/] --token is visible to every user of this machine in the "
            "process list; set HAPI_TOKEN instead, or use --tenants with token_env"
        )
    options = store_options(endpoint)
    config = ServerConfig(
        store=store,
        store_options=options,
        host=host,
        port=port,
        egress_limit=egress_limit,
        batch_size=batch_size,
        device=device,
        threads=threads,
        memory_budget=memory_budget,
        compute_slots=compute_slots,
        max_head_bytes=max_head_bytes,
        token=token,
        tenants=tenants,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        insecure=insecure,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        repo=repo,
        local_prefixes=tuple(local_prefix or ()),
        feature_cache=feature_cache,
        feature_cache_size=feature_cache_size,
    )
    # A server reads its store and repository: refuse a mistyped directory instead of
    # making it, and an unreachable S3 endpoint now instead of at the first chunk.
    hint = f"make a dataset there first (`hapi data synth {store}/train`)"
    existing_store(store, options, hint).check()
    if repo:
        existing_repo(repo, options).check()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = HapiServer(config)
    limit = f", egress limited to {egress_limit}" if egress_limit else ""
    models = f", models from [bold]{repo}[/]" if repo else ""
    who = f", {len(server.tenants)} tenant(s) from {tenants}" if tenants else ""
    if local_prefix:
        who += f", local: {', '.join(local_prefix)}"
    if feature_cache:
        who += f", feature cache {feature_cache} ({feature_cache_size})"
    Console().print(
        f"hapi serving [bold]{store}[/] at [bold]{server.address}[/]{limit}{models}{who}"
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
        _warn_over_limit(room.budget, device)
    # SIGTERM and SIGINT end the server through an exception, and it then stops cleanly;
    # SIGHUP re-reads the tenants file.
    signal.signal(signal.SIGTERM, _interrupt)
    restore = reload_on_sighup(server.tenants) if tenants else None
    serving = threading.Thread(target=server.serve, name="hapi-serve", daemon=True)
    serving.start()
    try:
        # The main thread waits here, in Python, rather than in serve()'s C++: there Python
        # runs no signal handler until serve() returns, so a SIGHUP would wait for the end.
        while serving.is_alive():
            serving.join(timeout=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        if restore is not None:
            restore()
        stopper = threading.Thread(target=server.shutdown, daemon=True)
        stopper.start()
        # Streams cut off by a vanished client can hold shutdown; do not wait forever.
        stopper.join(timeout=10)
    Console().print("hapi server stopped")


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
