"""The `profile` action: a session's costs per cut, measured on its job's own objects.

The planner chooses the cut and the local share from these (issue: the planner). A
profile reads a few objects (timing the store), decodes and transforms them (timing the
sample pipeline the chunks run), and runs the head to its last candidate cut on a batch
of them, with the memory each cut's batches need measured as at `open_session`. It runs
under grants of the scheduler like a chunk's batches, so it neither breaks the budget nor
jumps the queue: a small one to read, decode and measure memory, then one for a batch of
the heaviest cut to time the heads in.

The batch is the size the request asks for (the job's chunks' batches: a head's time
per sample depends on its batch, weight-heavy layers most), else `BATCH`. The head is
timed a segment at a time, cut k-1 to cut k (`hapi.plan.time_segments`), the median of
`REPEATS` runs after a warm-up: one forward per run, not one per cut, and the head to k
is the sum, non-decreasing in k as the work is. Segments share the traced model's weights.
A repository version's traced model has none (it is traced on the meta device): its
heads are timed whole, one cut at a time.

Profiles are cached by what they depend on (head content, input shape, transforms,
device, wire dtype, last cut, batch), so every job on the same model asks once.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from hapi._tracing import TRACING
from hapi.data import ObjectStore
from hapi.data.samples import Sample, load_one
from hapi.errors import InvalidCut
from hapi.graph import INPUT
from hapi.plan import head_segments, time_segments
from hapi.plan.profiles import ProfileKey
from hapi.server.budget import MemoryModel
from hapi.server.head_cache import HeadCache, LoadedModel
from hapi.server.memory import measure_head
from hapi.server.scheduler import Demand, Scheduler
from hapi.server.session import Session
from hapi.wire import dtype_width
from hapi.wire.messages import ProfileRequest
from hapi.wire.replies import ProfileKeyInfo, ProfileReply

__all__ = ["Profiler"]

T = TypeVar("T")
R = TypeVar("R")

BATCH = 4
"""Samples per timed batch when the request names none: enough that per-sample times are
not all overhead, few enough that a profile takes a fraction of a chunk."""
REPEATS = 2
"""Timed runs per cut after the warm-up; the median is kept."""
CACHED = 64
"""Profiles kept."""
_ROW_OVERHEAD = 12
"""Wire bytes per sample besides the key and the features: the label and two offsets."""


class Profiler:
    """Measures and caches sessions' profiles.

    Args:
        heads: where heads for each cut come from.
        scheduler: grants the measurement its compute slot and memory.
        store: where the objects are read.
    """

    def __init__(self, heads: HeadCache, scheduler: Scheduler, store: ObjectStore) -> None:
        self.heads = heads
        self.scheduler = scheduler
        self.store = store
        self._cache: OrderedDict[str, ProfileReply] = OrderedDict()
        self._lock = threading.Lock()

    def profile(
        self, session: Session, loaded: LoadedModel, request: ProfileRequest
    ) -> ProfileReply:
        """Measure `session`'s costs for cuts 0..max(`request.cuts`) (default its freeze).

        Raises:
            InvalidCut: a cut outside 1..freeze.
            HapiError: an object that cannot be read or decoded, naming its key.
        """
        last = _last_cut(request.cuts, session.info.freeze, loaded.graph.num_cuts)
        key = ProfileKey.of(
            head=_digest(self.heads.head_key(loaded, last) if last else loaded.key),
            input_shape=loaded.graph.input_shape,
            transforms=session.request.transforms,
            device=str(self.heads.device),
        )
        batch = min(request.batch_size or BATCH, session.batch_size)
        cache_key = _digest(f"{key}|{session.info.wire_dtype}|{last}|{batch}")
        with self._lock:
            cached = self._cache.get(cache_key)
            if cached is not None:
                self._cache.move_to_end(cache_key)
                return cached.model_copy(update={"cached": True})
        demand = Demand(model=session.memory, max_batch=BATCH)
        with self.scheduler.run(session.id, (-1, 0), demand, weight=session.weight):
            reply, tensors = self._measure(session, loaded, request, last, key)
        # Timing at the job's batch holds a segment's input and output at once: ask for
        # what a batch of the heaviest cut holds, and time the batch that is granted.
        heaviest = MemoryModel(
            fixed=max([session.memory.fixed, *reply.memory_fixed]),
            per_sample=max([session.memory.per_sample, *reply.memory_bytes]),
        )
        demand = Demand(model=heaviest, max_batch=batch)
        with self.scheduler.run(session.id, (-1, 0), demand, weight=session.weight) as grant:
            ran = min(batch, grant.batch)
            x = torch.stack([tensors[i % len(tensors)] for i in range(ran)])
            head_s = self._head_times(loaded, last, x.to(self.heads.device))
        reply = reply.model_copy(update={"head_s": list(head_s), "batch_size": ran})
        if ran == batch:  # a batch cut short by a full budget is not what the next job gets
            with self._lock:
                self._cache[cache_key] = reply
                while len(self._cache) > CACHED:
                    self._cache.popitem(last=False)
        return reply

    def _measure(
        self,
        session: Session,
        loaded: LoadedModel,
        request: ProfileRequest,
        last: int,
        key: ProfileKey,
    ) -> tuple[ProfileReply, list[torch.Tensor]]:
        """Everything but the heads' times (left at 0), and the decoded objects."""
        read_s, blobs = _timed(lambda k: self.store.get(k), request.keys)
        decode_s, samples = _timed(
            lambda i: _sample(session, request.keys[i], blobs[i], request.epoch),
            range(len(blobs)),
        )
        tensors = [s.tensor for s in samples]
        device = self.heads.device
        graph = loaded.graph
        width = dtype_width(session.info.wire_dtype)
        key_bytes = statistics.mean(len(k.encode()) for k in request.keys) + _ROW_OVERHEAD
        out_bytes: list[int] = []
        memory: list[int] = []
        fixed: list[int] = []
        for cut in range(INPUT, last + 1):
            shape = graph.input_shape if cut == INPUT else graph.cut_point(cut).shape
            out = width * _numel(shape)
            out_bytes.append(int(out + key_bytes))
            with self.heads.borrow(loaded, cut) as head, TRACING.shared():
                model = measure_head(head, graph.input_shape, device, out_bytes=out)
            memory.append(model.per_sample)
            fixed.append(model.fixed)
        reply = ProfileReply(
            read_s=read_s,
            decode_s=decode_s,
            head_s=[0.0] * (last + 1),
            out_bytes=out_bytes,
            memory_bytes=memory,
            raw_bytes=statistics.mean(len(b) for b in blobs),
            wire_dtype=session.info.wire_dtype,
            batch_size=BATCH,
            key=ProfileKeyInfo(**key.to_dict()),
            cut_names=["input", *(graph.cut_point(k).name for k in range(1, last + 1))],
            samples=len(blobs),
            memory_fixed=fixed,
        )
        return reply, tensors

    def _head_times(self, loaded: LoadedModel, last: int, x: torch.Tensor) -> tuple[float, ...]:
        """Seconds per sample of the head to each cut 0..last on the batch `x`."""
        if loaded.version is None:
            with TRACING.exclusive():
                segments = [
                    s.to(x.device).requires_grad_(False) for s in head_segments(loaded.graph, last)
                ]
            with TRACING.shared():
                return time_segments(segments, x, repeats=REPEATS)
        # A repository version's graph is traced on the meta device (its heads' tensors
        # are read from the repository, `HeadCache`): each head is timed whole.
        times = [0.0]
        for cut in range(1, last + 1):
            with self.heads.borrow(loaded, cut) as head, TRACING.shared():
                assert head is not None  # cut > INPUT
                times.append(max(times[-1], time_segments([head], x, repeats=REPEATS)[1]))
        return tuple(times)


def _sample(session: Session, key: str, data: bytes, epoch: int) -> Sample:
    request = session.request
    loaded = load_one(key, 0, data, session.transforms, seed=request.seed, epoch=epoch, skip=False)
    assert isinstance(loaded, Sample)  # skip=False raises instead of skipping
    return loaded


def _timed(fn: Callable[[T], R], items: Sequence[T]) -> tuple[float, list[R]]:
    """Mean seconds per item of `fn`, and its results."""
    results: list[R] = []
    t0 = time.perf_counter()
    for item in items:
        results.append(fn(item))
    return (time.perf_counter() - t0) / max(len(results), 1), results


def _last_cut(cuts: list[int] | None, freeze: int, num_cuts: int) -> int:
    last = min(freeze, num_cuts)
    if not cuts:
        return last
    for cut in cuts:
        if isinstance(cut, bool) or not INPUT <= cut <= last:
            raise InvalidCut(
                f"cut {cut!r} cannot be profiled: the session's cuts are 0..{last} (its "
                "freeze point); leave cuts out to profile them all"
            )
    return max(cuts)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
