"""The cost model of the overlapped pipeline: server, link and trainer work at once.

An option is a cut `k` and a local share `f`: a share `f` of the epoch's chunks is
computed entirely by the trainer from raw bytes, the rest is pushed down at cut `k`.
Per sample, with the profiles' costs:

    server  = (1-f)·(read + decode + head_k) + f·read
    link    = ((1-f)·bytes_k + f·raw_bytes) / bandwidth     (+ latency per chunk / K)
    trainer = (1-f)·tail_k + f·(decode + head_k + tail_k)

`cut = RAW` is the baseline: the server only reads, the trainer does everything.

The chunks flow through the three stages as through a pipeline. With m chunks of c̄
samples on average, a stage's time per chunk is c̄ times its per-sample cost, and

    epoch = (m - w)·max(stage per chunk) + w·sum(stage per chunk)

where w is how many chunks start together: 1 when the server serves chunks in order
(the first chunk's server and link time fill the pipe, the last chunk's trainer time
drains it: HAPI's `S + max(S, C)·(N-1) + C`), or K (the chunks in flight) when the server
works on all of them at once and none leaves before all are done. The first term is the
steady-state bound `max(server, link, trainer)` over the epoch less w chunks; the rest is
fill and drain. With one chunk in flight (K = 1) the next chunk is requested only when
one arrives, so the server's and the link's times add up inside the max.

In `f` every stage is a line, so the epoch is convex and piecewise linear: for a fixed
cut its minimum is at f = 0, f = 1 or where two stage lines cross, and on the grid of
whole chunks (f = j/m) at one of the two grid points beside it (`best_share`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hapi.errors import InvalidRequest
from hapi.graph.cut_point import INPUT, RAW
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile

__all__ = ["STAGES", "Estimate", "Workload", "best_share", "estimate"]

STAGES = ("server", "link", "trainer")
"""The pipeline's stages, in the order a chunk passes them."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one epoch asks of the pipeline."""

    samples: int
    """Samples in the epoch (this trainer's shard)."""
    chunk_size: int = 64
    """Keys per chunk request."""
    prefetch: int = 4
    """Chunks in flight at once (K)."""
    servers: int = 1
    """Servers the chunks are spread over, each with its own core(s) and link: the
    server's and the link's time per chunk divide among them."""
    in_order: bool = True
    """The server finishes chunks one after another; False: it shares itself (and the
    link) among all chunks in flight, so the first chunk is done only when K are."""

    def __post_init__(self) -> None:
        for name in ("samples", "chunk_size", "prefetch", "servers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be an int >= 1, got {value!r}")

    @property
    def chunks(self) -> int:
        """m: chunks in the epoch."""
        return -(-self.samples // self.chunk_size)

    @property
    def together(self) -> int:
        """w: chunks that fill (and drain) the pipeline together."""
        return 1 if self.in_order else min(self.prefetch, self.chunks)


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The predicted epoch of one option."""

    cut: int
    """Where the pushed-down chunks are cut (RAW: nothing is pushed down)."""
    share: float
    """Share of the chunks the trainer computes from raw bytes (0 for RAW and pure cuts)."""
    name: str
    """The cut's name (`raw`, `input`, `layer3`)."""
    server_s: float
    """The server's busy time over the epoch."""
    link_s: float
    """The link's busy time over the epoch."""
    trainer_s: float
    """The trainer's busy time over the epoch."""
    epoch_s: float
    """Predicted epoch time: the steady-state bound plus fill and drain."""
    bytes: float
    """Bytes over the link in the epoch."""

    @property
    def stages(self) -> dict[str, float]:
        """Busy time of each stage, by name."""
        return {"server": self.server_s, "link": self.link_s, "trainer": self.trainer_s}

    @property
    def bound_s(self) -> float:
        """The pipeline bound: the slowest stage's busy time."""
        return max(self.server_s, self.link_s, self.trainer_s)

    @property
    def fill_s(self) -> float:
        """What the epoch takes beyond the bound: filling and draining the pipeline."""
        return self.epoch_s - self.bound_s

    @property
    def binding(self) -> str:
        """The stage that holds the epoch (`server`, `link` or `trainer`)."""
        stages = self.stages
        return max(STAGES, key=lambda s: stages[s])

    @property
    def hybrid(self) -> bool:
        """Both tiers compute: some chunks are local, the rest pushed down."""
        return self.share > 0.0

    @property
    def label(self) -> str:
        """How a table names the option: `RAW`, `INPUT`, `cut 14 flatten`, `... + 40% local`."""
        if self.cut == RAW:
            base = "RAW"
        elif self.cut == INPUT:
            base = "INPUT"
        else:
            base = f"cut {self.cut} {self.name}"
        return f"{base} + {self.share:.0%} local" if self.hybrid else base


def estimate(
    cut: int,
    share: float,
    server: ServerProfile,
    trainer: TrainerProfile,
    link: LinkProfile,
    workload: Workload,
    *,
    name: str = "",
) -> Estimate:
    """Predict the epoch of option (`cut`, `share`).

    Raises:
        InvalidRequest: a cut the profiles have no entry for, or a share outside [0, 1].
    """
    _check_option(cut, share, server, trainer)
    lines = _stage_lines(cut, server, trainer, link, workload)
    per_chunk = [a + b * share for a, b in lines]
    m = workload.chunks
    epoch = _epoch(lines, share, workload)
    mean_bytes = (1 - share) * server.wire_bytes(cut) + share * server.raw_bytes
    return Estimate(
        cut=cut,
        share=share,
        name=name or _default_name(cut),
        server_s=m * per_chunk[0],
        link_s=m * per_chunk[1],
        trainer_s=m * per_chunk[2],
        epoch_s=epoch,
        bytes=workload.samples * mean_bytes,
    )


def best_share(
    cut: int,
    server: ServerProfile,
    trainer: TrainerProfile,
    link: LinkProfile,
    workload: Workload,
) -> float:
    """The local share that minimises the epoch at `cut >= INPUT`, in whole chunks (j/m).

    Solved in closed form: the continuous optimum lies at 0, 1 or where two stage lines
    cross; the epoch is convex in the share, so the best whole-chunk share is one of the
    two grid points around it (the lower on a tie: fewer local chunks, less to go wrong).
    A result of 1 means "all local": the caller has RAW for that.
    """
    if cut < INPUT:
        raise InvalidRequest(f"a local share needs a cut >= INPUT (0), got {cut}")
    lines = _stage_lines(cut, server, trainer, link, workload)
    m = workload.chunks

    def epoch(f: float) -> float:
        return _epoch(lines, f, workload)

    kinks = [0.0, 1.0]
    period = _period_lines(lines, workload)
    for i, (a1, b1) in enumerate(period):
        for a2, b2 in period[i + 1 :]:
            if b1 != b2:
                f = (a2 - a1) / (b1 - b2)
                if 0.0 < f < 1.0:
                    kinks.append(f)
    f_star = min(kinks, key=epoch)
    low = math.floor(f_star * m)
    return min((low / m, min(low + 1, m) / m), key=lambda f: (epoch(f), f))


def _epoch(lines: list[tuple[float, float]], f: float, workload: Workload) -> float:
    """(m - w)·(the period per chunk) + w·(the three stages of a chunk, one after another)."""
    m, w = workload.chunks, workload.together
    period = max(a + b * f for a, b in _period_lines(lines, workload))
    return (m - w) * period + w * sum(a + b * f for a, b in lines)


def _period_lines(
    lines: list[tuple[float, float]], workload: Workload
) -> list[tuple[float, float]]:
    """The lines whose max is the pipeline's period per chunk (K = 1: server + link)."""
    if workload.prefetch > 1:
        return lines
    (sa, sb), (la, lb), trainer = lines
    return [(sa + la, sb + lb), trainer]


def _stage_lines(
    cut: int,
    server: ServerProfile,
    trainer: TrainerProfile,
    link: LinkProfile,
    workload: Workload,
) -> list[tuple[float, float]]:
    """Each stage's time per chunk as a line a + b·f in the local share f."""
    c = workload.samples / workload.chunks
    per_request = link.latency_s / min(workload.prefetch, workload.chunks)
    if cut == RAW:
        pushed = (server.compute_s(RAW), server.raw_bytes, trainer.remote_s(RAW))
    else:
        pushed = (server.compute_s(cut), server.wire_bytes(cut), trainer.remote_s(cut))
    local = (server.read_s, server.raw_bytes, trainer.local_s(max(cut, INPUT)))
    n = workload.servers
    server_line = (c * pushed[0] / n, c * (local[0] - pushed[0]) / n)
    link_line = (
        c * pushed[1] / (n * link.bytes_per_s) + per_request / n,
        c * (local[1] - pushed[1]) / (n * link.bytes_per_s),
    )
    trainer_line = (c * pushed[2], c * (local[2] - pushed[2]))
    return [server_line, link_line, trainer_line]


def _check_option(cut: int, share: float, server: ServerProfile, trainer: TrainerProfile) -> None:
    last = min(server.last_cut, trainer.last_cut)
    if isinstance(cut, bool) or not isinstance(cut, int) or not RAW <= cut <= last:
        raise InvalidRequest(f"cut {cut!r} is not profiled: the profiles cover RAW..{last}")
    if not 0.0 <= share <= 1.0 or (cut == RAW and share != 0.0):
        raise InvalidRequest(
            f"local share must be in [0, 1] (0 for RAW, which is all local already), got {share}"
        )


def _default_name(cut: int) -> str:
    return {RAW: "raw", INPUT: "input"}.get(cut, str(cut))
