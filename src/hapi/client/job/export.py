"""`UploadedHeads`: a job's own module as the server runs it - its heads, exported and uploaded.

The server never runs the user's Python: for each cut a session needs, the trainer exports
the head with torch.export (`hapi.graph.export_head`) when the cut is first used, uploads
it once to each server a session opens on (`Connection.put_head`, which asks `has_head`
first) and names it by digest in the session request. Exporting holds the process's
`TRACING` lock exclusively; the job runs its modules under the shared lock, so a cut first
used mid-epoch is exported between two batches. Why: `docs/heads.md`.
"""

from __future__ import annotations

import threading

from hapi._fx_lock import TRACING
from hapi.client.servers.source import Server
from hapi.graph import INPUT, ModelGraph, export_head
from hapi.graph.export import HeadArtifact
from hapi.wire.messages import UploadedHead

__all__ = ["UploadedHeads"]


class UploadedHeads:
    """The heads of a job's own module, one artifact per cut, exported once each.

    Args:
        graph: the module, traced (its heads are exported for `graph.input_shape`).
    """

    def __init__(self, graph: ModelGraph) -> None:
        self.graph = graph
        self.module = type(graph.model).__name__
        self._artifacts: dict[int, HeadArtifact] = {}
        self._lock = threading.Lock()

    def artifact(self, cut: int) -> HeadArtifact:
        """The head up to `cut` (1..n), exported on first use.

        Raises:
            InvalidRequest: the head cannot be exported; the message names the line.
        """
        with self._lock:
            if cut not in self._artifacts:
                with TRACING.exclusive():
                    self._artifacts[cut] = export_head(self.graph, cut)
            return self._artifacts[cut]

    def model(self, cut: int, connection: Server) -> UploadedHead:
        """How a session at `cut` on `connection`'s server names the model: the uploaded
        head's digest (uploaded now if the server lacks it), or no head at RAW and INPUT.

        Raises:
            InvalidRequest: the head cannot be exported, or is over the server's limit.
            IntegrityError: the server received other bytes than were sent.
        """
        if cut <= INPUT:
            return UploadedHead(module=self.module)
        artifact = self.artifact(cut)
        connection.put_head(artifact)
        return UploadedHead(module=self.module, artifact=artifact.digest)
