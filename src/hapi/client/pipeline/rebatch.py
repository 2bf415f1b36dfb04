"""Rebatching: pieces as they arrive, training batches of one cut as the tail needs them.

Pieces are cut and joined into batches of exactly `batch_size` samples in delivery order,
whatever the server's batch and the request's size; when a re-plan moved the cut, the
pieces at the lower cut of a batch that straddles the change are carried forward through
the frozen segment between the cuts (`ModelGraph.segment`) rather than flushed as a short
batch. Why: `docs/loader.md`, "Rebatching".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hapi.errors import InvalidCut

__all__ = ["Batch", "Piece", "Rebatcher"]

# Carries features from one cut to a later one: (features, from, to) -> features.
Convert = Callable[[torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """Consecutive samples of one chunk, computed to one cut."""

    chunk: int
    cut: int
    """The cut the features are at (INPUT: model inputs)."""
    keys: list[str]
    labels: torch.Tensor
    features: torch.Tensor

    def __len__(self) -> int:
        return len(self.keys)

    def split(self, n: int) -> tuple[Piece, Piece]:
        """The first `n` samples, and the rest."""
        a = Piece(self.chunk, self.cut, self.keys[:n], self.labels[:n], self.features[:n])
        b = Piece(self.chunk, self.cut, self.keys[n:], self.labels[n:], self.features[n:])
        return a, b


@dataclass(frozen=True)
class Batch:
    """A training batch: features at one cut, and which chunks its samples came from."""

    features: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    cut: int
    """The cut the features are at: train it through the tail from here."""
    parts: tuple[tuple[int, int], ...]
    """(chunk, samples) in order."""
    convert_s: float = 0.0
    """Time spent carrying pieces to `cut` (trainer work)."""

    def __len__(self) -> int:
        return len(self.keys)


class Rebatcher:
    """Pieces in, training batches out, in order.

    Args:
        convert: carries features to a later cut; None when every piece has one cut
            (a batch mixing cuts is then an error).
        clock: the trainer's clock for `Batch.convert_s`.
    """

    def __init__(
        self, convert: Convert | None = None, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._convert = convert
        self._clock = clock
        self._pieces: deque[Piece] = deque()
        self._buffered = 0

    def __len__(self) -> int:
        """Samples buffered."""
        return self._buffered

    def add(self, piece: Piece) -> None:
        """Buffer a piece (empty ones are dropped)."""
        if len(piece):
            self._pieces.append(piece)
            self._buffered += len(piece)

    def take(self, n: int) -> Batch:
        """The next `n` buffered samples (fewer if fewer are buffered) as one batch.

        Raises:
            InvalidCut: the samples are at several cuts and there is no `convert`.
        """
        taken: list[Piece] = []
        need = min(n, self._buffered)
        while need:
            piece = self._pieces.popleft()
            if len(piece) > need:
                piece, rest = piece.split(need)
                self._pieces.appendleft(rest)
            taken.append(piece)
            need -= len(piece)
            self._buffered -= len(piece)
        return self._join(taken)

    def _join(self, pieces: list[Piece]) -> Batch:
        cut = max(p.cut for p in pieces)
        t0 = self._clock()
        features = [self._carry(p, cut) for p in pieces]
        convert_s = self._clock() - t0 if any(p.cut != cut for p in pieces) else 0.0
        if len({f.dtype for f in features}) > 1:
            features = [f.float() for f in features]
        parts: list[tuple[int, int]] = []
        for p in pieces:
            if parts and parts[-1][0] == p.chunk:
                parts[-1] = (p.chunk, parts[-1][1] + len(p))
            else:
                parts.append((p.chunk, len(p)))
        return Batch(
            features=features[0] if len(features) == 1 else torch.cat(features),
            labels=pieces[0].labels if len(pieces) == 1 else torch.cat([p.labels for p in pieces]),
            keys=[k for p in pieces for k in p.keys],
            cut=cut,
            parts=tuple(parts),
            convert_s=convert_s,
        )

    def _carry(self, piece: Piece, cut: int) -> torch.Tensor:
        if piece.cut == cut:
            return piece.features
        if self._convert is None:
            raise InvalidCut(
                f"a batch mixes cuts {piece.cut} and {cut} and this loader cannot carry "
                "features between cuts: give it a convert (TransferJob does)"
            )
        return self._convert(piece.features, piece.cut, cut)
