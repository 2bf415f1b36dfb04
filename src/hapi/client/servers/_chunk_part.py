"""`ChunkPart` and `ChunkResult`: what a chunk's stream brings back (`Connection.stream`,
`Connection.chunk`), with its bytes as they crossed the wire."""

from __future__ import annotations

from dataclasses import dataclass

from hapi.wire import ChunkReport, FeatureBatch, SkippedKey

__all__ = ["ChunkPart", "ChunkResult"]


@dataclass(frozen=True)
class ChunkResult:
    """What one chunk brought back: its batches, the keys the server skipped, bytes moved."""

    batches: list[FeatureBatch]
    skipped: list[SkippedKey]
    nbytes: int


@dataclass(frozen=True)
class ChunkPart:
    """One message of a chunk's stream: a batch, its bytes on the wire, and the report
    that comes with the last one. Batches count decompressed; the last part's bytes make
    the sum what the server sent (`ChunkReport.sent_bytes`): negative when compressed."""

    batch: FeatureBatch | None
    nbytes: int
    report: ChunkReport | None = None
