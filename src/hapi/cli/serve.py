"""`hapi serve`: run the storage-side server."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

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
    from hapi.data import StoreOptions
    from hapi.server import HapiServer, ServerConfig

    _check_local_store(store)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = ServerConfig(
        store=store,
        store_options=StoreOptions(endpoint=endpoint) if endpoint else None,
        host=host,
        port=port,
        egress_limit=egress_limit,
        batch_size=batch_size,
        device=device,
        threads=threads,
        token=token,
        repo=repo,
    )
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


def _check_local_store(store: str) -> None:
    """Refuse to serve a local directory that does not exist: it is a typo, not a store."""
    from hapi.errors import InvalidRequest

    if "://" in store and not store.startswith("file://"):
        return
    path = Path(store.removeprefix("file://")).expanduser()
    if not path.is_dir():
        raise InvalidRequest(
            f"store directory {path} does not exist: check the path, or make a dataset "
            f"there first (`hapi data synth {path}/train` or `hapi data import DIR {path}/train`)"
        )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
