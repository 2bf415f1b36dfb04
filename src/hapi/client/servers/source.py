"""`Server`: everything the trainer asks of a server, data and control alike - the seam
between a `hapi serve` and the trainer's loader, planner and job.

`Connection` (Arrow Flight) implements it for a real server, `MemorySource` in memory, so
the loader's concurrency (windows, recall, failover, exactly once) is tested in
milliseconds. The trainer's own tiers - computing raw bytes locally, the feature cache -
sit in front of a server, per chunk (`hapi.client.pipeline.fetch`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from hapi.client.servers.connection import ChunkPart
    from hapi.data import DatasetManifest
    from hapi.graph import HeadArtifact
    from hapi.wire import (
        ChunkTicket,
        LocateReply,
        ProfileReply,
        ProfileRequest,
        ServerStats,
        SessionInfo,
        SessionRequest,
        SessionStats,
    )

__all__ = ["PartStream", "Server", "recall_all"]


class PartStream(Protocol):
    """One chunk's stream: its parts as they arrive, the report with the last."""

    def __iter__(self) -> Iterator[ChunkPart]:
        """Raises: `ServerUnavailable` when cut, `StreamRecalled` when recalled, or the
        server's error for the chunk."""
        ...

    def cancel(self) -> None:
        """Stop the stream, from any thread; a read in progress fails."""
        ...


@runtime_checkable
class Server(Protocol):
    """A server, as the trainer sees it."""

    address: str

    def open_session(self, request: SessionRequest) -> SessionInfo:
        """Open a session (a model cut, its transforms) for the chunks of a loop."""
        ...

    def close_session(self, session: str) -> SessionStats:
        """Close a session; its statistics."""
        ...

    def keepalive(self, session: str) -> None:
        """Renew a session's lease (`SessionNotFound` once it is gone)."""
        ...

    def stream(self, ticket: ChunkTicket) -> PartStream:
        """Start one chunk: the request goes out now, the parts are read from the stream."""
        ...

    def recall(self) -> bool:
        """Cut every stream open now, with what was sent ahead; whether any was open."""
        ...

    def stats(self) -> ServerStats:
        """The server's counters (per session: for servers that report no time per chunk)."""
        ...

    def manifest(self, prefix: str = "") -> DatasetManifest:
        """The dataset under `prefix` in the server's store: its keys, labels, versions."""
        ...

    def profile(self, request: ProfileRequest) -> ProfileReply:
        """The server's own timing of a session's cuts on some of its keys.

        Raises:
            InvalidRequest: a server without the action (an older one): profile it another
                way. OverBudget: the keys do not fit its memory.
        """
        ...

    def put_head(self, artifact: HeadArtifact) -> None:
        """Give the server a head it does not have (the job's own model), once."""
        ...

    def locate(self, keys: Sequence[str]) -> LocateReply:
        """Each key's bytes on the server's own storage node, and in all.

        Raises:
            InvalidRequest: a server that does not know where it is (no `--beside`).
        """
        ...


def recall_all(sources: Sequence[Server]) -> list[str]:
    """Cut the streams in flight of every source in `sources` (a router's `recall`); the
    addresses of those that had some."""
    return [source.address for source in sources if source.recall()]
