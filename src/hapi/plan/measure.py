"""Measuring a model's costs per cut: computation only, on tensors and bytes given.

Both tiers use these: the trainer for its own profile, the server for the `profile`
action. Kept short (a small batch, one or two repeats, the median), in wall-clock time,
and the model is left exactly as it was (modes, `requires_grad`, gradients, buffers, the
RNG). Why wall time: docs/cost-model.md, "Measuring a model's costs per cut".
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from hapi.data import Transforms, load_sample
from hapi.errors import InvalidCut
from hapi.graph import INPUT, ModelGraph
from hapi.plan.profiles import WIRE_ITEMSIZE, ProfileKey, ServerProfile, TrainerProfile

__all__ = [
    "head_segments",
    "measure_decode",
    "measure_heads",
    "measure_server",
    "measure_step",
    "measure_tails",
    "measure_trainer",
    "memory_per_sample",
    "time_per_item",
    "time_segments",
    "wire_bytes",
]

T = TypeVar("T")


def measure_heads(
    graph: ModelGraph, last: int, *, batch_size: int = 4, repeats: int = 3, warm: int | None = None
) -> tuple[float, ...]:
    """Seconds per sample of the frozen head's forward from the input to each cut 0..last.

    Runs in eval mode under `torch.inference_mode()`, as the server and a local chunk do,
    on a random batch of `batch_size` (`time_segments` says how it is timed, and `warm`).
    """
    _check_last(graph, last)
    x = _probe(graph, batch_size)
    with _scratch(graph.model):
        graph.model.eval()
        return time_segments(head_segments(graph, last), x, repeats=repeats, warm=warm)


def head_segments(graph: ModelGraph, last: int) -> list[nn.Module]:
    """The head to `last` in pieces, cut k-1 to cut k for k = 1..last, in eval mode; they
    share the model's weights."""
    _check_last(graph, last)
    return [graph.segment(cut - 1, cut).eval() for cut in range(1, last + 1)]


def time_segments(
    segments: Sequence[nn.Module], x: torch.Tensor, *, repeats: int = 3, warm: int | None = None
) -> tuple[float, ...]:
    """Seconds per sample of the head to each cut 0..len(segments), on the batch `x`.

    Each segment is timed on the activation the segment before it computed, and the head
    to k is the sum: one forward per repeat, not one per cut, so a profile can afford the
    job's own batch size. Per-sample times depend on it (weight-heavy layers pay per
    batch, not per sample): a profile at a quarter of the job's batch over-predicted them
    up to 5x, and the later cuts more than the earlier ones. Entry 0 is 0 (INPUT runs no
    layer).

    Args:
        warm: samples of `x` each segment's warm-up runs on; None: all of them. A warm-up
            pays a segment's first calls (weights laid out, kernels chosen), which do not
            grow with the batch: on the first `warm` samples it costs a job a fraction of
            a full batch's forward (ResNet-18 at batch 64: 1.5 s of a cold job's start).
    """
    seconds, batch, device = [], len(x), x.device
    with torch.inference_mode():
        for segment in segments:
            segment(x if warm is None else x[:warm])
            # The last run's output is the next segment's input: a segment's input and
            # output alone are alive, as in a chunk's batch (the server's budget).
            t, x = _timed_runs(functools.partial(segment, x), repeats, device)
            seconds.append(t / batch)
    return (0.0, *itertools.accumulate(seconds))


def measure_tails(
    graph: ModelGraph,
    freeze: int,
    cuts: Sequence[int] | None = None,
    *,
    batch_size: int = 4,
    repeats: int = 3,
) -> dict[int, float]:
    """Seconds per sample of the tail's forward and backward from each of `cuts`.

    As the job trains: the frozen layers (up to `freeze`) in eval mode without gradients,
    the rest in train mode; the loss is the output's mean, the optimizer step is left out
    (it does not depend on the cut: `measure_step`). `cuts` defaults to 0..freeze.
    """
    _check_last(graph, freeze)
    cuts = range(INPUT, freeze + 1) if cuts is None else cuts
    x = _probe(graph, batch_size)
    result: dict[int, float] = {}
    with _scratch(graph.model):
        frozen = _freeze(graph, freeze)
        for cut in cuts:
            if isinstance(cut, bool) or not isinstance(cut, int) or not INPUT <= cut <= freeze:
                raise InvalidCut(f"cut {cut!r} is not in 0..{freeze} (the freeze point)")
            features = _features(graph, cut, x)
            tail = graph.tail(cut).train()
            # As the job's train mode: the tail trains, its frozen layers stay in eval.
            for module in frozen:
                module.eval()
            step = _train_step(tail, features)
            step()  # warm-up, as in measure_heads
            result[cut] = _median_time(step, repeats, x.device) / batch_size
    return result


def measure_step(graph: ModelGraph, freeze: int, *, repeats: int = 3) -> float:
    """Seconds of one optimizer step over the parameters trained from `freeze`.

    The job's default optimizer, SGD with momentum, at learning rate 0: the same work
    (momentum, then the update) on the model's own parameters, which stay as they were.
    Per training batch, not per sample, and the same from every cut - but not small: for
    VGG-11 trained from `features.10` (128 M parameters) it took 154 ms a step, 4.8 ms a
    sample at batch 32, and the plan put the trainer at 0.8x what it ran.
    """
    _check_last(graph, freeze)
    params = [p for p in graph.tail(freeze).parameters() if p.requires_grad]
    if not params:
        return 0.0
    with _scratch(graph.model):
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.SGD(params, lr=0.0, momentum=0.9)
        optimizer.step()  # warm-up: allocates the momentum buffers, as the first step does
        return _median_time(optimizer.step, repeats, params[0].device)


def measure_trainer(
    graph: ModelGraph,
    freeze: int,
    *,
    decode_s: float = 0.0,
    batch_size: int = 4,
    repeats: int = 3,
    warm: int | None = None,
    exact: bool = False,
    head_batch: int | None = None,
    step_s: float | None = None,
) -> TrainerProfile:
    """The trainer's profile for cuts 0..freeze.

    The tail from cut k is the frozen layers k..freeze (forward, no gradients) and then
    the training step from the freeze point, which is the same for every k. So by default
    the training step is measured once and the frozen part taken from the heads' times:
    one pass over the cuts instead of one per cut. `exact` measures each tail itself.
    Each tail includes the optimizer's step (`measure_step`) shared by the batch's
    samples: `batch_size` should be the job's training batch.

    Args:
        graph: the traced model, on the trainer's device.
        freeze: the freeze point.
        decode_s: seconds per sample to decode and transform an object here
            (`measure_decode`).
        batch_size: samples per measured batch.
        repeats: timed runs per measurement (the median is kept).
        warm: samples the heads' warm-up runs on (`time_segments`); None: the batch.
        exact: measure the tail from every cut rather than derive it.
        head_batch: samples the heads are timed on; None: `batch_size`.
        step_s: seconds of one optimizer step where known; None: measured (`measure_step`).
    """
    heads = measure_heads(
        graph, freeze, batch_size=head_batch or batch_size, repeats=repeats, warm=warm
    )
    if exact:
        tails_by_cut = measure_tails(graph, freeze, batch_size=batch_size, repeats=repeats)
        tails = tuple(tails_by_cut[k] for k in range(freeze + 1))
    else:
        train = measure_tails(graph, freeze, [freeze], batch_size=batch_size, repeats=repeats)
        tails = tuple(train[freeze] + heads[freeze] - heads[k] for k in range(freeze + 1))
    if step_s is None:
        step_s = measure_step(graph, freeze, repeats=repeats)
    step = step_s / batch_size
    return TrainerProfile(
        decode_s=decode_s,
        head_s=heads,
        tail_s=tuple(t + step for t in tails),
        batch_size=batch_size,
        device=str(_device(graph.model)),
    )


def measure_decode(
    blobs: Sequence[bytes],
    transforms: Transforms,
    *,
    seed: int = 0,
    repeats: int = 3,
    warm: int | None = None,
) -> float:
    """Seconds per sample to decode and transform objects (their bytes, already read):
    the median of `repeats` passes after one that warms up (on the first `warm` objects;
    None: all - the first calls are the codec's, not each object's).

    A job measures this first thing in its process, and the first pass pays for the
    codec's and the transforms' first calls: it took 1.35x a warm pass (2.62 ms a sample
    against 1.93 ms for ResNet-18's 100 KB photos at 64 px), and the plan predicted RAW
    epochs 1.10-1.18x slower than they ran, every hybrid's local share with them.

    Raises:
        CorruptObject: a blob is not a decodable image.
        ValueError: no blobs.
    """
    if not blobs:
        raise ValueError("measure_decode needs at least one object's bytes")

    def decode(i: int, data: bytes) -> None:
        load_sample(data, f"probe/{i}", transforms, seed + i)

    return time_per_item(decode, blobs, repeats=repeats, warm=warm)


def time_per_item(
    fn: Callable[[int, T], object],
    items: Sequence[T],
    *,
    repeats: int = 3,
    warm: int | None = None,
) -> float:
    """Seconds per item of `fn(i, item)` over `items`: the median of `repeats` passes,
    after one that warms up on the first `warm` items (None: all of them)."""

    def run(few: Sequence[T] = items) -> None:
        for i, item in enumerate(few):
            fn(i, item)

    # Warm: a job's first call in its process (a codec's, a transform's) is not its steady cost.
    run(items if warm is None else items[:warm])
    return _median_time(run, repeats, torch.device("cpu")) / len(items)


def measure_server(
    graph: ModelGraph,
    last: int,
    *,
    read_s: float,
    decode_s: float,
    raw_bytes: float,
    wire_dtype: str = "fp32",
    batch_size: int = 4,
    repeats: int = 3,
    key: ProfileKey | None = None,
) -> ServerProfile:
    """The server's profile for cuts 0..last, given what it measured reading the objects.

    Args:
        graph: the traced model on the server's device.
        last: the last cut to profile (the session's freeze point).
        read_s: seconds per sample to read an object (measured by the server).
        decode_s: seconds per sample to decode and transform one (`measure_decode`).
        raw_bytes: the objects' mean size.
        wire_dtype: the dtype features travel in.
        batch_size: the head's batch size.
        repeats: timed runs per cut.
        key: what the profile depends on, for the server's cache.
    """
    heads = measure_heads(graph, last, batch_size=batch_size, repeats=repeats)
    return ServerProfile(
        read_s=read_s,
        decode_s=decode_s,
        head_s=heads,
        out_bytes=tuple(wire_bytes(graph, k, wire_dtype) for k in range(last + 1)),
        memory_bytes=tuple(memory_per_sample(graph, k) for k in range(last + 1)),
        raw_bytes=raw_bytes,
        wire_dtype=wire_dtype,
        batch_size=batch_size,
        key=key,
    )


def wire_bytes(graph: ModelGraph, cut: int, dtype: str = "fp32", *, overhead: int = 0) -> int:
    """Bytes per sample of the features at `cut` (0: the input tensor) in `dtype`.

    Args:
        overhead: bytes per sample the encoding adds (key, label, offsets).
    """
    numel = graph.cut_point(cut).numel if cut > INPUT else graph.input_bytes_per_sample // 4
    return numel * WIRE_ITEMSIZE[dtype] + overhead


def memory_per_sample(graph: ModelGraph, cut: int) -> int:
    """Estimated fp32 bytes per sample to compute the head up to `cut`.

    HAPI's estimate: the input plus the largest pair of consecutive activations up to the
    cut (a layer's input and output are alive together). Activations inside a block that
    are larger than its ends are not seen; the scheduler keeps a margin for them.
    """
    sizes = [graph.input_bytes_per_sample]
    sizes += [graph.cut_point(k).bytes_per_sample for k in range(1, cut + 1)]
    pairs = [a + b for a, b in itertools.pairwise(sizes)]
    return graph.input_bytes_per_sample + max(pairs, default=0)


def _check_last(graph: ModelGraph, cut: int) -> None:
    if isinstance(cut, bool) or not isinstance(cut, int) or not INPUT <= cut <= graph.num_cuts:
        raise InvalidCut(f"cut {cut!r} is not in 0..{graph.num_cuts}")


def _device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _probe(graph: ModelGraph, batch_size: int) -> torch.Tensor:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    gen = torch.Generator().manual_seed(0)
    return torch.rand(batch_size, *graph.input_shape, generator=gen).to(_device(graph.model))


def _freeze(graph: ModelGraph, freeze: int) -> list[nn.Module]:
    """No gradients for the frozen part, as the job sets them; returns its modules."""
    for _, p in graph.head_parameters(freeze):
        p.requires_grad_(False)
    return list(graph.head(freeze).modules()) if freeze > INPUT else []


def _features(graph: ModelGraph, cut: int, x: torch.Tensor) -> Any:
    """The features at `cut` of a batch like `x`: the head runs on its first sample, and
    that sample's features stand for the batch's. A tail's cost is its shapes', not its
    values', and the head's forward on the whole batch cost a job's start as much as
    timing the tail did."""
    if cut == INPUT:
        return x
    head = graph.head(cut).eval()  # frozen, as the job runs it (and one sample is no batch)
    with torch.no_grad():
        one = head(x[:1])
        if not isinstance(one, torch.Tensor):  # a structured output: computed whole
            return head(x)
    return one.expand(len(x), *one.shape[1:]).contiguous()


def _train_step(tail: nn.Module, features: torch.Tensor) -> Callable[[], None]:
    params = [p for p in tail.parameters() if p.requires_grad]

    def step() -> None:
        # As the job's zero_grad(set_to_none=True): each step allocates its gradients.
        for p in params:
            p.grad = None
        loss = _scalar(tail(features))
        if loss is not None and loss.requires_grad:
            loss.backward()

    return step


def _scalar(out: Any) -> torch.Tensor | None:
    """The mean of every tensor in the output, summed: a loss that reaches all of them."""
    if isinstance(out, torch.Tensor):
        return out.float().mean() if out.is_floating_point() else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, list | tuple) else ()
    parts = [s for s in (_scalar(o) for o in items) if s is not None]
    return torch.stack(parts).sum() if parts else None


def _median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    return _timed_runs(fn, repeats, device)[0]


def _timed_runs(fn: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, Any]:
    """The median wall time of `repeats` runs of `fn`, and the last run's result."""
    times = []
    out = None
    for _ in range(max(repeats, 1)):
        out = None  # free the last result before the next run makes its own
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _scratch(model: nn.Module) -> Iterator[None]:
    """Measure on `model` freely: its modes, flags, gradients, buffers and RNG come back."""
    modes = {m: m.training for m in model.modules()}
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    tensors = [*params, *(b for b, _ in buffers)]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for m, training in modes.items():
                m.training = training
            with torch.no_grad():
                for p, flag, grad in zip(params, flags, grads, strict=True):
                    p.requires_grad_(flag)
                    p.grad = grad
                for b, saved in buffers:
                    b.copy_(saved)
