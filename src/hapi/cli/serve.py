"""`hapi serve`: run the storage-side server."""

from __future__ import annotations

import logging
import signal
import threading

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    """Add `serve` to `app`."""
    app.command()(serve)


def serve(
    store: str = typer.Option(..., help="Object store to serve: a directory, s3://bucket/prefix."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8815, help="Port to listen on (0: any free port)."),
    egress_limit: str = typer.Option(
        None, help="Cap on what the server sends, e.g. 50mbit (emulates a storage link)."
    ),
    batch_size: int = typer.Option(32, help="Largest feature-extraction batch."),
    device: str = typer.Option("cpu", help="Where heads run: cpu, cuda, cuda:N."),
    threads: int = typer.Option(None, help="torch threads for heads."),
    token: str = typer.Option(None, envvar="HAPI_TOKEN", help="Bearer token callers must send."),
    repo: str = typer.Option(None, envvar="HAPI_REPO", help="Model repository for repo:// refs."),
    endpoint: str = typer.Option(None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL)."),
) -> None:
    """Serve features computed next to the data over Arrow Flight, until Ctrl-C."""
    from hapi.cli._stores import existing_repo, existing_store, store_options
    from hapi.server import HapiServer, ServerConfig

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
        token=token,
        repo=repo,
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
    Console().print(f"hapi serving [bold]{store}[/] at [bold]{server.address}[/]{limit}{models}")
    # serve() blocks in C++ but runs Python signal handlers; SIGTERM and SIGINT end it
    # through an exception, and the server then stops cleanly.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        stopper = threading.Thread(target=server.shutdown, daemon=True)
        stopper.start()
        # Streams cut off by a vanished client can hold shutdown; do not wait forever.
        stopper.join(timeout=10)
    Console().print("hapi server stopped")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
