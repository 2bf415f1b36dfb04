"""The cost model of the overlapped pipeline: server, link and trainer work at once.

An option is a cut `k` and a local share `f`: a share `f` of the epoch's chunks is
computed entirely by the trainer from raw bytes, the rest is pushed down at cut `k`.
Per sample, with the profiles' costs:

    server  = (1-f)·(read + decode + head_k) + f·raw + send·((1-f)·bytes_k + f·raw_bytes)
    link    = ((1-f)·bytes_k + f·raw_bytes) / bandwidth     (+ latency per chunk / K)
    trainer = (1-f)·tail_k + f·(decode + head_k + tail_k) + receive·((1-f)·bytes_k + f·raw_bytes)

(raw: the server's time to read an object and encode it onto the wire; send and receive:
each end's CPU per byte on the wire, which its core spends beside its compute.)

`cut = RAW` is the baseline: the server only reads, the trainer does everything.

The chunks flow through the three stages as through a pipeline (a flow shop). A stage
cannot start before the first chunk has passed the stages ahead of it, and the epoch ends
only when the last chunk has passed the stages after it, so stage j bounds the epoch by

    epoch_j = w·(first chunk's stages before j) + (j's busy time) + w·(last chunk's after j)

and the epoch is the largest of them. w is how many chunks start together: 1 when the
server serves chunks in order (for m equal chunks this is HAPI's `S + max(S, C)·(N-1) + C`),
or K (the chunks in flight) when the server works on all of them at once and none leaves
before all are done. With one chunk in flight (K = 1) the next chunk is requested only
when one arrives, so the server's and the link's times add up into one stage.

The loader also holds a *window*: K chunks in flight per server, and chunk j+K is
requested only when chunk j has been read (a local chunk is decoded afterwards, beside
the next chunks' reads). So the epoch is also bounded by

    window = first chunk's (server + link)
             + the server's time for chunks K..m-1 + the last chunk's link and trainer

A hybrid's local chunk over a slow link is where it binds: its raw bytes hold the link
and the window while the server, done with the K-1 chunks behind it, waits for the next
request. Without it the model predicted a 25% hybrid at 10 Mbit/s 1.35x too fast (1.68 s
against 2.26 s measured), and chose it over the pure cut that measured 1.67 s.

The first and last chunk are not an average chunk: `assign` makes the first chunk of a
hybrid local (the trainer starts at once, on raw bytes that need no server compute) and
its last pushed down (after the server's last chunk only a short tail is left). A model
that charged a hybrid an average chunk's fill and drain over-predicted it by 20-30% on
four-chunk epochs, and chose smaller shares than the best.

For 0 < f < 1 the ends are fixed and every stage is a line in `f`, so the epoch is convex
and piecewise linear there: its minimum is at a share where two stage lines cross, or at
the ends of that range, and on the grid of whole chunks (f = j/m) at one of the grid
points beside it (`best_share`); f = 0 and f = 1 are weighed apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hapi.errors import InvalidRequest
from hapi.graph.cut_point import INPUT, RAW
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile

__all__ = ["STAGES", "Estimate", "Workload", "best_share", "estimate", "locals_before"]

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

    Solved in closed form: between 1/m and (m-1)/m the first chunk is local and the last
    pushed down, each stage's bound is a line in the share and the epoch their convex
    maximum, so the best whole-chunk share there is a grid point beside a crossing of
    two lines or an end of the range; 0 and 1 (other ends) are weighed beside it. Ties go
    to the lower share: fewer local chunks, less to go wrong. A result of 1 means "all
    local": the caller has RAW for that.
    """
    if cut < INPUT:
        raise InvalidRequest(f"a local share needs a cut >= INPUT (0), got {cut}")
    lines = _stage_lines(cut, server, trainer, link, workload)
    m = workload.chunks

    def epoch(f: float) -> float:
        return _epoch(lines, f, workload)

    candidates = {0.0, 1.0}
    if m > 1:
        low, high = 1 / m, (m - 1) / m
        candidates |= {low, high}
        inner = _bounds(lines, workload, first=True, last=False)
        for i, (a1, b1) in enumerate(inner):
            for a2, b2 in inner[i + 1 :]:
                if b1 != b2:
                    f = min(max((a2 - a1) / (b1 - b2), low), high)
                    j = math.floor(f * m + 1e-9)
                    candidates |= {max(j, 1) / m, min(j + 1, m - 1) / m}
    return min(candidates, key=lambda f: (epoch(f), f))


def locals_before(share: float, i: int) -> int:
    """How many of the first `i` chunks are local at `share`: ceil(f·i).

    Rounding up makes the first chunk of any hybrid local and, when f·m is whole, its
    last pushed down: the ends the cost model charges (`_epoch`). The small tolerance
    keeps f = j/m from rounding a whole j·i/m up through float error.
    """
    return math.ceil(share * i - 1e-9)


def _epoch(lines: list[tuple[float, float]], f: float, workload: Workload) -> float:
    """The epoch: the largest over the stages' and the window's bounds."""
    m = workload.chunks
    first = locals_before(f, 1) > 0
    last = locals_before(f, m) > locals_before(f, m - 1)
    bounds = _bounds(lines, workload, first=first, last=last)
    return max(c + s * f for c, s in bounds)


def _bounds(
    lines: list[tuple[float, float]],
    workload: Workload,
    *,
    first: bool,
    last: bool,
) -> list[tuple[float, float]]:
    """Each bound on the epoch as a line c + s·f, given whether the first and the last
    chunk are local: per stage, w·(first's stages before it) + busy + w·(last's after
    it); and the window's, when the epoch has more chunks than are in flight at once."""
    m, w = workload.chunks, workload.together
    stages = _period_lines(lines, workload)
    head = [a + b * first for a, b in stages]
    tail = [a + b * last for a, b in stages]
    bounds = [
        (w * sum(head[:j]) + m * a + w * sum(tail[j + 1 :]), m * b)
        for j, (a, b) in enumerate(stages)
    ]
    ahead = workload.prefetch * workload.servers
    if m > ahead:
        (sa, sb), (la, lb), (ta, tb) = lines
        read = sa + sb * first + la + lb * first
        after = la + lb * last + ta + tb * last
        # Chunks K..m-1 are requested one by one as chunks 1.. are read; their local
        # share is taken as f, which keeps the bound a line in f.
        bounds.append((read + (m - ahead) * sa + after, (m - ahead) * sb))
    return bounds


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
    wire = server.wire_bytes(cut)
    receive = trainer.receive_s
    pushed = (server.serve_s(cut), wire, trainer.remote_s(cut) + receive * wire)
    local = (
        server.serve_s(RAW),
        server.raw_bytes,
        trainer.local_s(max(cut, INPUT)) + receive * server.raw_bytes,
    )
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
