"""What a job did: per-step losses, per-epoch stage times, and every event on the way.

An epoch's `server_s`, `transfer_s` and `trainer_s` are the busy times of the pipeline's
three stages, so `binding` - the largest - names the stage that held the epoch. Events
are the plan and each change of it, every retry of a chunk and every session re-opened:
what a user reads to see why an epoch took the time it did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hapi.wire import SkippedKey

__all__ = ["EpochStats", "Event", "EventKind", "History", "ignore_event"]

EventKind = Literal[
    "plan",
    "plan-aside",
    "plan-deferred",
    "plan-failed",
    "replan",
    "reroute",
    "recall",
    "retry",
    "reopen",
    "failover",
    "fallback",
]


@dataclass(frozen=True)
class Event:
    """Something that happened to the job, in order."""

    kind: EventKind
    """`plan` (the first choice), `plan-aside` (nothing measured before for the job:
    training started on the freeze cut, and the plan is measured beside it from its own
    chunks), `plan-deferred` (no server could be measured: training started, or goes on,
    on the freeze cut, and the plan is measured while it trains), `plan-failed`
    (none could be within the retry budget: the freeze cut stays), `replan` (a change of
    cut or share), `reroute` (a chunk in flight following a change of cut with its keys
    not yet delivered), `recall` (the streams in flight cut with what the server had sent
    ahead on them, so the chunks could follow a change of plan at once), `retry` (a chunk
    asked for again), `reopen` (a session the server had lost, opened again), `failover`
    (a chunk whose server failed, moved to another server), `fallback` (a chunk read from
    the store and computed in the trainer: no server answered)."""
    epoch: int | None
    """The epoch it happened in (None: before the first)."""
    chunk: int | None
    """The chunk it concerns, or after which a re-plan took effect."""
    message: str
    """One line for a person."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """JSON-safe details (the plans, the error class, the backoff)."""


@dataclass(frozen=True)
class EpochStats:
    """One training epoch, as the trainer saw it."""

    epoch: int
    loss: float
    accuracy: float
    seconds: float
    """Wall time from the end of the epoch before it in the same `fit` (the first: from
    the start of its loop) to its last step: the epochs of a `fit` add up to its time."""
    samples: int
    bytes_received: int
    wait_s: float
    """Time the trainer waited for data: the part of the epoch the pipeline did not hide."""
    compute_s: float
    """CPU time of the tail's forward, backward and optimizer steps (the training thread)."""
    decode_s: float
    """CPU time the trainer spent on local chunks: decoding, transforming, the head."""
    skipped: tuple[SkippedKey, ...] = ()
    """Keys left out under `on_error="skip"`, each with its error."""
    server_s: float = 0.0
    """The server's busy time on this epoch's chunks (as it reported them)."""
    transfer_s: float = 0.0
    """The link's busy time: each chunk's stream while it had the link."""
    trainer_s: float = 0.0
    """The trainer's busy time: `compute_s + decode_s`, carrying features across a
    change of cut and, on a trainer confined to one core, `receive_s`."""
    receive_s: float = 0.0
    """The trainer process's CPU time besides those: receiving the streams (decoding
    their bytes into tensors), which grows with the bytes a cut sends."""
    cut: int | None = None
    """The cut at the epoch's end (RAW: the baseline)."""
    share: float = 0.0
    """The local share at the epoch's end."""
    chunks_local: int = 0
    """Chunks the trainer computed from raw bytes."""
    chunks_pushed: int = 0
    """Chunks the server computed to the cut."""
    retries: int = 0
    """Chunk retries in the epoch (`History.events` has each)."""
    failovers: int = 0
    """Chunks moved to another server in the epoch (`History.failovers` has each)."""
    fallbacks: int = 0
    """Chunks computed in the trainer from the store's bytes (`History.fallbacks`)."""
    cached: int = 0
    """Samples the trainer's feature cache gave: no server, no link, only the tail."""
    server_cached: int = 0
    """Samples a server's feature cache gave: no read, no decode, no head."""
    server_compiled: int = 0
    """Samples a server's compiled head computed (`hapi serve --compile-heads`)."""
    server_head: str = ""
    """How the server said it runs the head, when more than eager: compiling, compiled
    (how much faster), or why it stays eager (the compile failed, disagreed, was slower)."""
    cache_write_failures: int = 0
    """Features the trainer's cache could not keep: its directory refused the writes (a
    full or read-only disk), so it stopped writing and the job went on without it."""

    read_bytes: int = 0
    """Object bytes the servers read from the store for this epoch's chunks."""
    placed_bytes: int = 0
    """Of those, the bytes read by servers that know where they are (`--beside`)."""
    local_bytes: int = 0
    """Of `placed_bytes`, the bytes read from the reading server's own storage node."""

    @property
    def local_fraction(self) -> float | None:
        """Bytes read from the reading server's own node over all bytes its servers read
        (docs/locality.md); None where no server knows where it is."""
        return self.local_bytes / self.placed_bytes if self.placed_bytes else None

    @property
    def computed(self) -> int:
        """Samples whose features were computed this epoch (on either tier)."""
        return max(0, self.samples - self.cached - self.server_cached)

    @property
    def stages(self) -> dict[str, float]:
        """Busy time of each stage, by name."""
        return {"server": self.server_s, "link": self.transfer_s, "trainer": self.trainer_s}

    @property
    def binding(self) -> str:
        """The stage that held the epoch: `server`, `link` or `trainer`."""
        stages = self.stages
        return max(stages, key=lambda s: stages[s])


def ignore_event(event: Event) -> None:
    """The event sink of a loop nobody records (instead of checking for None)."""


@dataclass
class History:
    """What `fit` did: per-step losses, per-epoch stats, and the events on the way."""

    losses: list[float] = field(default_factory=list)
    epochs: list[EpochStats] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @property
    def local_fraction(self) -> float | None:
        """Over every epoch, bytes read from the reading server's own storage node over
        all bytes its servers read (`EpochStats.local_fraction` per epoch); None where
        no server knows where it is (`hapi serve --beside`)."""
        placed = sum(e.placed_bytes for e in self.epochs)
        return sum(e.local_bytes for e in self.epochs) / placed if placed else None

    def of_kind(self, kind: EventKind) -> list[Event]:
        """The events of one kind, in order."""
        return [e for e in self.events if e.kind == kind]

    @property
    def retries(self) -> list[Event]:
        """Every chunk retry."""
        return self.of_kind("retry")

    @property
    def reopens(self) -> list[Event]:
        """Every session re-opened."""
        return self.of_kind("reopen")

    @property
    def failovers(self) -> list[Event]:
        """Every chunk moved to another server after its own failed."""
        return self.of_kind("failover")

    @property
    def fallbacks(self) -> list[Event]:
        """Every chunk computed in the trainer from the store's bytes, no server answering."""
        return self.of_kind("fallback")

    @property
    def reroutes(self) -> list[Event]:
        """Every chunk in flight that followed a change of cut."""
        return self.of_kind("reroute")

    @property
    def recalls(self) -> list[Event]:
        """Every time the streams in flight were cut for a change of plan."""
        return self.of_kind("recall")

    @property
    def plan_changes(self) -> list[Event]:
        """Every change of plan while training."""
        return self.of_kind("replan")

    def plot(self, path: str | Path, *, title: str = "") -> Path:
        """Write a picture of the run at `path` (PNG): per epoch, its seconds and each
        stage's, where its samples came from (computed, the server's cache, the
        trainer's), the bytes that crossed the link with the cut and share in force, and
        its re-plans and failovers. Returns the path.

        Raises:
            InvalidRequest: no epoch yet.
        """
        from hapi.client.pipeline.run_picture import plot_run

        return plot_run(self, path, title=title)

    def explain(self) -> str:
        """One line per epoch for a person: its time, loss, bytes, cut, and where its
        features came from (computed, or which tier's cache)."""
        lines = []
        for e in self.epochs:
            where = "raw bytes" if e.cut == -1 else f"cut {e.cut}"
            if e.share and e.cut != -1:
                where += f" + {e.share:.0%} local"
            sources = [f"{e.computed} computed"]
            if e.server_compiled:
                sources[0] += f" ({e.server_compiled} by the server's compiled head)"
            if e.cached:
                sources.append(f"{e.cached} from the trainer's cache")
            if e.server_cached:
                sources.append(f"{e.server_cached} from the server's")
            if e.cache_write_failures:
                sources.append(f"{e.cache_write_failures} not cached (the cache's disk refused)")
            lines.append(
                f"epoch {e.epoch + 1}: {e.seconds:.1f} s, loss {e.loss:.4f}, "
                f"{e.bytes_received / 1e6:.2f} MB, {where}; {e.samples} samples: "
                f"{', '.join(sources)}"
                + (f"; the server's head: {e.server_head}" if e.server_head else "")
            )
        return "\n".join(lines)
