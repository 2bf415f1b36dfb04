"""The cost model of the overlapped pipeline: server, link and trainer work at once.

An option is a cut `k` and a local share `f` of chunks the trainer computes from raw
bytes. Its epoch is simulated chunk by chunk through the three stages as the loader issues
them (a flow shop with a window per route); why a simulation and not the slowest stage is
in `docs/cost-model.md`, with the per-sample formulas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from hapi.errors import InvalidRequest
from hapi.graph.cut_point import INPUT, RAW
from hapi.plan.profiles import LinkProfile, ServerProfile, TrainerProfile

__all__ = [
    "HYBRID_LOCAL_WINDOW",
    "STAGES",
    "Estimate",
    "Workload",
    "best_share",
    "estimate",
    "locals_before",
]

STAGES = ("server", "link", "trainer")
"""The pipeline's stages, in the order a chunk passes them."""

HYBRID_LOCAL_WINDOW = 1
"""A hybrid's local chunks in flight per server; the loader keeps it (RAW keeps K). Raw
bytes go into the network's buffers as soon as their turn on the connection comes, and
after a drop from 1 Gbit/s to 10 Mbit/s 4 of them in flight left 3 MB (2.4 s) to cross
before the re-plan's first chunk. One is enough where pushed-down chunks cross between
them while the next is read."""

SIMULATED_CHUNKS = 256
"""Chunks an epoch is run for one by one; a longer one is extrapolated."""
_EVERY_SHARE = 64
"""Epochs of up to this many chunks have every whole-chunk share weighed."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one epoch asks of the pipeline."""

    samples: int
    """Samples in the epoch (this trainer's shard)."""
    chunk_size: int = 64
    """Keys per chunk request."""
    prefetch: int = 4
    """Chunks in flight at once (K) per server: K pushed down, or K raw in RAW."""
    local_window: int = HYBRID_LOCAL_WINDOW
    """A hybrid's local chunks in flight per server."""
    servers: int = 1
    """Servers the chunks are spread over, each with its own core(s) and link: the
    server's and the link's time per chunk divide among them."""
    back_to_back: bool = False
    """Predict an epoch of a longer fit, which the loader fetches while the one before it
    drains (`FeatureLoader.batches(then=)`): its fill overlaps that epoch's drain. False:
    an epoch on its own, or a fit's first, which fills from empty."""

    def __post_init__(self) -> None:
        for name in ("samples", "chunk_size", "prefetch", "local_window", "servers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be an int >= 1, got {value!r}")

    @property
    def chunks(self) -> int:
        """m: chunks in the epoch."""
        return -(-self.samples // self.chunk_size)


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
    """Predicted epoch time: the epoch's chunks run through the pipeline one by one."""
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
        """What the epoch takes beyond the bound: filling and draining the pipeline, and
        stages waiting on each other (a server waiting for a request, say)."""
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
    simulated: int = SIMULATED_CHUNKS,
) -> Estimate:
    """Predict the epoch of option (`cut`, `share`); an epoch of more than `simulated`
    chunks is extrapolated from its steady state.

    Raises:
        InvalidRequest: a cut the profiles have no entry for, or a share outside [0, 1].
    """
    _check_option(cut, share, server, trainer)
    lines = _stage_lines(cut, server, trainer, link, workload)
    per_chunk = [a + b * share for a, b in lines]
    m = workload.chunks
    epoch = _epoch(lines, share, workload, simulated)
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

    Up to `_EVERY_SHARE` chunks every share is run; beyond, a grid of that many shares is,
    and then every share between the best grid point's neighbours. Ties go to the lower
    share: fewer local chunks, less to go wrong. A result of 1 means "all local": the
    caller has RAW for that.
    """
    if cut < INPUT:
        raise InvalidRequest(f"a local share needs a cut >= INPUT (0), got {cut}")
    lines = _stage_lines(cut, server, trainer, link, workload)
    m = workload.chunks
    cache: dict[int, float] = {}

    def epoch(j: int) -> float:
        if j not in cache:
            cache[j] = _epoch(lines, j / m, workload)
        return cache[j]

    def best(shares: Iterable[int]) -> int:
        return min(shares, key=lambda j: (epoch(j), j))

    if m <= _EVERY_SHARE:
        return best(range(m + 1)) / m
    grid = sorted({round(g * m / _EVERY_SHARE) for g in range(_EVERY_SHARE + 1)})
    at = grid.index(best(grid))
    low, high = grid[max(at - 1, 0)], grid[min(at + 1, len(grid) - 1)]
    return best([*range(low, high + 1), 0, m]) / m


def locals_before(share: float, i: int) -> int:
    """How many of the first `i` chunks are local at `share`: ceil(f·i).

    Rounding up makes the first chunk of any hybrid local and, when f·m is whole, its
    last pushed down: the trainer starts at once on bytes that need no server compute,
    and after the server's last chunk only a short tail is left. The small tolerance
    keeps f = j/m from rounding a whole j·i/m up through float error.
    """
    return math.ceil(share * i - 1e-9)


def _epoch(
    lines: list[tuple[float, float]],
    f: float,
    workload: Workload,
    simulated: int = SIMULATED_CHUNKS,
) -> float:
    """Run the epoch's chunks through the pipeline one by one (see the module's note)."""
    m = workload.chunks
    # Back to back, the epoch before it is run first; past `simulated` chunks its fill is
    # a small part of it, and the steady-state extrapolation below stands.
    before = m if workload.back_to_back and 2 * m <= simulated else 0
    n = before + min(m, simulated)
    windows = {
        False: workload.prefetch * workload.servers,
        # The loader's: one local chunk in flight per server in a hybrid, K in RAW.
        True: (workload.local_window if f < 1.0 else workload.prefetch) * workload.servers,
    }
    (sa, sb), (la, lb), (ta, tb) = lines
    reads: dict[bool, list[float]] = {False: [], True: []}  # each route's chunks' reads
    trained: list[float] = []
    issued = server = link = trainer = 0.0
    for i in range(n):
        j = i % m  # its place in its epoch
        local = locals_before(f, j + 1) > locals_before(f, j)
        mine, window = reads[local], windows[local]
        if len(mine) >= window:
            issued = max(issued, mine[-window])
        server = max(issued, server) + sa + sb * local
        link = max(link, server) + la + lb * local
        trainer = max(trainer, link) + ta + tb * local
        mine.append(link)
        trained.append(trainer)
    if before:
        return trainer - trained[before - 1]
    if n == m:
        return trainer
    # The rest at the pace of the second half: its time per second of work of the stage
    # busiest in it, times that stage's work on the chunks not run (counted from the
    # pattern, which need not repeat within the half).
    half = n // 2
    ran = (n - half, locals_before(f, n) - locals_before(f, half))
    rest = (m - n, locals_before(f, m) - locals_before(f, n))
    a, b = max(lines, key=lambda line: ran[0] * line[0] + ran[1] * line[1])
    busy = ran[0] * a + ran[1] * b
    if busy <= 0.0:
        return trainer
    return trainer + (trained[-1] - trained[half - 1]) / busy * (rest[0] * a + rest[1] * b)


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
