"""The server's model loaded while the trainer builds its own.

A job's first session has its server build and trace the model (ResNet-18 at 112 px:
0.5 s of the server's core), and the trainer builds and traces its own first (0.4 s of
the other): one after the other, a job's start waited for both. A job whose model both
sides build from a spec opens a RAW session on its first server as it builds, in a
thread, and closes it at once: the server keeps an idle model for the next session
(`HeadCache`), and a session asked for meanwhile waits on the same load, not a second.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from hapi.client.config.job import JobConfig
from hapi.client.job._model import JobModel
from hapi.client.servers.source import Server
from hapi.errors import HapiError
from hapi.graph import RAW
from hapi.wire import SessionRequest

__all__ = ["server_warmed", "warmup_request"]

JOIN_S = 5.0
"""The longest the job's build waits for the warm-up after its own: a server that does
not answer is the job's first real call's to report (and retry), not the warm-up's."""


@contextlib.contextmanager
def server_warmed(connection: Server, request: SessionRequest | None) -> Iterator[None]:
    """Within the block, `connection`'s server loads the model of `request` (a RAW
    session's, opened and closed); None: nothing to warm (a model the server cannot load
    before the trainer has built it: a module of the user's own, a repository version
    not yet resolved). Best effort: a failure is left to the job's own calls."""
    if request is None or request.cut != RAW:
        yield
        return

    def warm() -> None:
        with contextlib.suppress(HapiError):
            connection.close_session(connection.open_session(request).session)

    # A daemon: a server that never answers holds neither the build nor the process.
    thread = threading.Thread(target=warm, name="hapi-warm-server", daemon=True)
    thread.start()
    yield
    # Not joined where the build failed: its error (a bad freeze, say) is the job's
    # answer, whatever the server does.
    thread.join(JOIN_S)


def warmup_request(config: JobConfig) -> SessionRequest | None:
    """The RAW session that has the server load `config`'s model as the job's sessions
    name it, or None where it cannot be named before the trainer builds it."""
    spec = JobModel.spec_of(config)
    if spec is None:
        return None
    return SessionRequest(
        model=spec.to_dict(),  # as `JobModel.wire_name`: the server's key for the model
        cut=RAW,
        freeze=config.training.freeze,
        transforms=config.train_transforms.to_dict(),
        image_size=config.data.image_size,
        seed=config.training.seed,
        on_error=config.fetch.on_error,
    )
