"""The `profile` action: a session's costs per cut, measured on its job's own objects.

A profile reads a few objects, decodes and transforms them, and runs the head to its last
candidate cut, a segment at a time, on a batch of them - admitted as a chunk is, by the
same code (`session_memory`, `object_decode_bytes`, one scheduler grant). Profiles are
cached by what they depend on, so every job on the same model asks once. How it is
admitted, timed and cached: docs/server.md, "The profile action".
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from hapi._fx_lock import TRACING
from hapi.data import ObjectStore
from hapi.data.samples import Sample, load_one
from hapi.errors import InvalidCut, shorten
from hapi.graph import INPUT
from hapi.graph.precision import running_in
from hapi.plan import head_segments, time_segments
from hapi.plan.profiles import ProfileKey
from hapi.server.chunks._compiled import CompiledHeads
from hapi.server.chunks.session import Session
from hapi.server.head_cache import HeadCache, LoadedModel
from hapi.server.memory.batch_memory import (
    decoding,
    object_decode_bytes,
    session_memory,
    session_name,
)
from hapi.server.memory.budget import MemoryModel
from hapi.server.memory.scheduler import Demand, Scheduler, never
from hapi.server.uploads import head_graph
from hapi.wire import dtype_width
from hapi.wire.messages import ProfileRequest, UploadedHead
from hapi.wire.replies import ProfileKeyInfo, ProfileReply

__all__ = ["Profiler"]

T = TypeVar("T")
R = TypeVar("R")

BATCH = 4
"""Samples per timed batch when the request names none: enough that per-sample times are
not all overhead, few enough that a profile takes a fraction of a chunk."""
REPEATS = 1
"""Timed runs per cut after the warm-up; the median is kept. One: the profile gives the
cuts' relative costs, the trainer's probe at the freeze cut their level (a real chunk's),
and the re-planner corrects a plan from the chunks' own times; a second run doubled what
the profile cost a cold job's start (ResNet-18 at batch 64: 1.5 s a run) and changed no
plan (benchmarks/startup.py)."""
WARM = 4
"""Samples a segment's warm-up runs on: its first calls' costs do not grow with the batch."""
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
        read_bytes: what a session's batch holds for its chunk's read-ahead (the
            server's): a profile holds its objects instead.
        compiled: the heads the server runs compiled: a profile times those cuts at their
            compiled speed, as the session will run them.
    """

    def __init__(
        self,
        heads: HeadCache,
        scheduler: Scheduler,
        store: ObjectStore,
        *,
        read_bytes: int = 0,
        compiled: CompiledHeads | None = None,
    ) -> None:
        self.heads = heads
        self.compiled = compiled
        self.scheduler = scheduler
        self.store = store
        self.read_bytes = read_bytes
        self._cache: OrderedDict[str, ProfileReply] = OrderedDict()
        self._lock = threading.Lock()

    def profile(
        self,
        session: Session,
        request: ProfileRequest,
        *,
        gone: Callable[[], bool] = never,
    ) -> ProfileReply:
        """Measure `session`'s costs for cuts 0..max(`request.cuts`) (default its freeze).

        Args:
            session: whose model, objects, transforms and wire dtype.
            request: the objects, cuts and batch.
            gone: whether the caller has gone (then a batch still queued leaves).

        Raises:
            InvalidCut: a cut outside 1..freeze, or above 0 for an uploaded head.
            OverBudget: a sample at one of the cuts, or one of the objects, can never fit
                in the budget: refused as `open_session` and a chunk refuse them.
            HapiError: an object that cannot be read or decoded, naming its key.
        """
        loaded, request = self._model(session, request)
        last = _last_cut(request.cuts, session.info.freeze, loaded.graph.num_cuts)
        key = ProfileKey.of(
            head=_digest(self.heads.head_key(loaded, last) if last else loaded.key),
            input_shape=loaded.graph.input_shape,
            transforms=session.request.transforms,
            # A bf16 head is another head to time: `cpu/bfloat16` keeps it apart.
            device=_device_key(self.heads.device, session.head_dtype),
        )
        batch = min(request.batch_size or BATCH, session.batch_size)
        cache_key = _digest(f"{key}|{session.info.wire_dtype}|{last}|{batch}")
        with self._lock:
            cached = self._cache.get(cache_key)
            if cached is not None:
                self._cache.move_to_end(cache_key)
                return self._as_run(cached.model_copy(update={"cached": True}), session, loaded)
        reply = self._measure(session, request, loaded, last, key, batch, gone)
        # A batch cut short by a full budget is not what the next job gets.
        if reply.batch_size == batch:
            with self._lock:
                self._cache[cache_key] = reply
                while len(self._cache) > CACHED:
                    self._cache.popitem(last=False)
        return self._as_run(reply, session, loaded)

    def _as_run(self, reply: ProfileReply, session: Session, loaded: LoadedModel) -> ProfileReply:
        """The profile with each cut whose head runs compiled for `session` timed at the
        compiled head's measured speed (cached profiles stay eager's: heads compile later)."""
        speeds = self.compiled.speeds() if self.compiled is not None else {}
        if not speeds or session.request.exact:
            return reply
        size, dtype = session.request.image_size, str(session.head_dtype)
        times = list(reply.head_s)
        for cut in range(1, len(times)):
            speed = speeds.get((self.heads.head_key(loaded, cut), size, dtype))
            if speed is not None:
                times[cut] *= speed
        return reply.model_copy(update={"head_s": times})

    def _measure(
        self,
        session: Session,
        request: ProfileRequest,
        loaded: LoadedModel,
        last: int,
        key: ProfileKey,
        batch: int,
        gone: Callable[[], bool],
    ) -> ProfileReply:
        """Read, decode and run the head to `last` on `request`'s objects, under one grant."""
        width = dtype_width(session.info.wire_dtype)
        # The batches at the input and at the last cut as sessions at those cuts have
        # them: measured, and refused with the same message, by what `open_session` runs
        # - before any object is read. The head to a cut between runs through less of the
        # model than the head to the last: the last's model bounds it. Measuring each
        # cut's took ResNet-18's profile 1-3 s of a cold job's start, a head built and
        # run twice per cut, for figures the planner does not weigh.
        first = self._cut_memory(session, loaded, INPUT, width)
        final = self._cut_memory(session, loaded, last, width) if last > INPUT else first
        models = [first, *([final] * last)]
        read_s, blobs = _timed(self.store.get, request.keys)
        demand = self._demand(session, request, models, blobs, batch)
        with self.scheduler.run(
            session.id, (-1, 0), demand, weight=session.weight, gone=gone
        ) as grant:
            ran = min(batch, grant.batch)
            decode_s, tensors = self._decode(session, request, blobs, ran)
            x = torch.stack([tensors[i % len(tensors)] for i in range(ran)])
            with running_in(session.head_dtype, self.heads.device):
                head_s = self._head_times(loaded, last, x.to(self.heads.device))
        graph = loaded.graph
        key_bytes = statistics.mean(len(k.encode()) for k in request.keys) + _ROW_OVERHEAD
        shapes = [graph.input_shape, *(graph.cut_point(k).shape for k in range(1, last + 1))]
        return ProfileReply(
            read_s=read_s,
            decode_s=decode_s,
            head_s=list(head_s),
            out_bytes=[int(width * _numel(shape) + key_bytes) for shape in shapes],
            memory_bytes=[m.per_sample for m in models],
            raw_bytes=statistics.mean(len(b) for b in blobs),
            wire_dtype=session.info.wire_dtype,
            batch_size=ran,
            key=ProfileKeyInfo(**key.to_dict()),
            cut_names=["input", *(graph.cut_point(k).name for k in range(1, last + 1))],
            samples=len(blobs),
            memory_fixed=[m.fixed for m in models],
        )

    def _model(
        self, session: Session, request: ProfileRequest
    ) -> tuple[LoadedModel, ProfileRequest]:
        """The model `session` is profiled on, and `request` as it is measured."""
        model, size = session.request.model, session.request.image_size
        if not isinstance(model, UploadedHead):
            return self.heads.model(model, size), request
        # The server holds an uploaded model's head for one cut at most, so it times
        # reading and decoding (cut 0); the trainer estimates the cuts from a chunk at
        # its freeze cut and its own per-cut times (`hapi.client.planning.measuring`).
        if any(cut > INPUT for cut in request.cuts or ()):
            raise InvalidCut(
                "a session of an uploaded head is profiled at the input (cut 0) only: "
                "the server has no head for the other cuts"
            )
        graph = head_graph(torch.nn.Identity(), (3, size, size), ())
        loaded = LoadedModel(graph=graph, key=json.dumps(["uploaded-input", size]))
        return loaded, request.model_copy(update={"cuts": [INPUT]})

    def _cut_memory(
        self, session: Session, loaded: LoadedModel, cut: int, width: int
    ) -> MemoryModel:
        """A batch at `cut` of `session`'s job, as `open_session` measures and checks it
        (one function, so a profile is refused where a session would be, and says so
        alike; the measurement is cached for both)."""
        graph = loaded.graph
        shape = graph.input_shape if cut == INPUT else graph.cut_point(cut).shape
        with self.heads.borrow(loaded, cut) as head:
            return session_memory(
                self.scheduler,
                head=head,
                graph=graph,
                cut=cut,
                device=self.heads.device,
                transforms=session.transforms,
                out_bytes=width * _numel(shape),
                read_bytes=self.read_bytes,
                what=session_name(session.request.model, cut),
                measured_as=self.heads.head_key(loaded, cut) if cut > INPUT else "input",
                max_batch=session.batch_size,
            )

    def _demand(
        self,
        session: Session,
        request: ProfileRequest,
        models: list[MemoryModel],
        blobs: list[bytes],
        batch: int,
    ) -> Demand:
        """What decoding the objects and timing the heads at `batch` holds: the heaviest
        cut's batch, room to decode the largest object (each refused, naming it, where a
        chunk would refuse it), and the objects read in place of a chunk's read-ahead."""
        seed, epoch = session.request.seed, request.epoch
        decodes = [
            object_decode_bytes(blob, session.transforms, session.transforms.seed(seed, epoch, key))
            for key, blob in zip(request.keys, blobs, strict=True)
        ]
        least = min(m.decode for m in models)
        held = max(sum(len(b) for b in blobs) - self.read_bytes, 0)
        # Each cut's model is `fixed = head + read-ahead + decode`: the heads' part is
        # what is left of the largest without its decode.
        heaviest = MemoryModel(
            fixed=max(m.fixed - m.decode for m in models) + held,
            per_sample=max(m.per_sample for m in models),
        )
        for key, decode in zip(request.keys, decodes, strict=True):
            if decode > least:
                self.scheduler.check_fits(
                    decoding(heaviest, decode), f"object {shorten(repr(key))}"
                )
        model = decoding(heaviest, max([least, *decodes]))
        self.scheduler.check_fits(model, f"profiling session {session.id}")
        return Demand(model=model, max_batch=batch)

    def _decode(
        self, session: Session, request: ProfileRequest, blobs: list[bytes], keep: int
    ) -> tuple[float, list[torch.Tensor]]:
        """Seconds per object to decode and transform each, and the first `keep` inputs
        (only those are held: the batch is granted room for them)."""
        kept: list[torch.Tensor] = []
        t0 = time.perf_counter()
        for key, blob in zip(request.keys, blobs, strict=True):
            sample = _sample(session, key, blob, request.epoch)
            if len(kept) < keep:
                kept.append(sample.tensor)
        return (time.perf_counter() - t0) / max(len(blobs), 1), kept

    def _head_times(self, loaded: LoadedModel, last: int, x: torch.Tensor) -> tuple[float, ...]:
        """Seconds per sample of the head to each cut 0..last on the batch `x`."""
        if loaded.version is None:
            with TRACING.exclusive():
                segments = [
                    s.to(x.device).requires_grad_(False) for s in head_segments(loaded.graph, last)
                ]
            with TRACING.shared():
                return time_segments(segments, x, repeats=REPEATS, warm=WARM)
        # A repository version's graph is traced on the meta device (its heads' tensors
        # are read from the repository, `HeadCache`): each head is timed whole.
        times = [0.0]
        for cut in range(1, last + 1):
            with self.heads.borrow(loaded, cut) as head, TRACING.shared():
                assert head is not None  # cut > INPUT
                times.append(
                    max(times[-1], time_segments([head], x, repeats=REPEATS, warm=WARM)[1])
                )
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


def _device_key(device: torch.device, dtype: torch.dtype) -> str:
    """The device a profile's key names: `cpu`, or `cpu/bfloat16` for bf16 heads."""
    if dtype == torch.float32:
        return str(device)
    return f"{device}/{str(dtype).removeprefix('torch.')}"


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
