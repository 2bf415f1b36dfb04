"""Measuring what a session's batches cost in memory, and what decoding an image costs.

The head runs at a few batch sizes (`measured_batches`): on CUDA its peak is read from
torch's allocator statistics, on the CPU from `LiveTensors`, a `TorchDispatchMode` that
sums the storages of the tensors torch returns in this thread. The line through the
smallest batch's peak and above the others is the model's `fixed + per_sample * batch`.
Decoding is computed from the image's size (`decode_bytes`), before any image is decoded.
How and why: docs/server.md, "What a session's batches cost in memory".
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hapi._fx_lock import TRACING
from hapi.data import Transforms, decoded_size
from hapi.data.ops import CenterCrop, HorizontalFlip, Normalize, RandomResizedCrop, Resize
from hapi.data.shards.blob import Blob
from hapi.errors import OverBudget, shorten
from hapi.graph import RAW, ModelGraph
from hapi.server.memory.budget import MemoryModel
from hapi.server.memory.scheduler import Demand, Scheduler

__all__ = [
    "LiveTensors",
    "decode_bytes",
    "decoding",
    "device_memory",
    "measure_head",
    "measured_batches",
    "object_decode_bytes",
    "session_memory",
    "session_name",
    "static_bytes",
    "tensor_bytes",
]

MEASURED_BATCHES = (1, 4)
"""Batch sizes the head is measured at: a line through two points, far enough apart that
the per-sample slope is not lost in the fixed part."""
MARGIN = 1.1
"""Measured bytes are scaled by this for what no measurement sees (operators' scratch,
allocator rounding, fragmentation)."""
NOMINAL_IMAGE = (1024, 768)
"""The image size a session expects before it has decoded any: a chunk holds room to
decode one this large, and asks for more when a larger one comes."""

_MEASURED: dict[tuple[str, tuple[int, ...], int, str], MemoryModel] = {}
"""Heads measured so far, by content, input shape, output bytes and device: a cache of
what the measurement gives every time, so reopening a session does not measure again."""
_MEASURED_LOCK = threading.Lock()
_MEASURED_KEPT = 256
_OPENING = "(opening sessions)"
"""The scheduler's name for measurements at `open_session`: they share one fair share."""

# PIL keeps RGB pixels in 32 bits; a tensor of the image is 3 uint8 and then 3 float32.
_PIL_RGB = 4
_UINT8_CHW = 3
_FLOAT_CHW = 12


class LiveTensors(TorchDispatchMode):
    """Bytes of the tensors torch's operators return in this thread, alive now and at peak.

    Args:
        ignore: tensors whose storages never count (a module's parameters and buffers:
            an operator that returns a view of a weight allocates nothing).
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._ignore = {_storage_key(t) for t in ignore}
        self._live: dict[tuple[str, int], tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def add(self, tensor: torch.Tensor) -> None:
        """Count a tensor made outside the mode (the input batch)."""
        key = _storage_key(tensor)
        if key in self._ignore or key in self._live:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes():
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            self._update()

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.add(t)
        self._update()
        return out

    def _update(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.current = sum(n for _, n in self._live.values())
        self.peak = max(self.peak, self.current)


def measure_head(
    head: nn.Module | None,
    input_shape: tuple[int, ...],
    device: torch.device,
    *,
    out_bytes: int,
    batches: tuple[int, ...] = MEASURED_BATCHES,
) -> MemoryModel:
    """The memory model of a session's batches, from its head run at a few batch sizes.

    Args:
        head: the head on `device`, in eval mode; None for INPUT (no layer runs).
        input_shape: per-sample input shape (C, H, W).
        device: where the head runs.
        out_bytes: encoded feature bytes per sample on the wire.
        batches: the batch sizes, smallest first (`measured_batches`); one alone counts
            all it measures per sample.

    Returns:
        `fixed` and `per_sample` for the head; the caller adds decoding (`decode_bytes`).
    """
    peaks = [_peak(head, input_shape, device, b) for b in batches]
    if len(set(batches)) < 2:
        fixed, per_sample = 0.0, peaks[0] / batches[0]
    else:
        # The line through the smallest batch's peak and above every other one.
        b1, p1 = batches[0], peaks[0]
        slopes = [(p - p1) / (b - b1) for b, p in zip(batches, peaks, strict=True) if b > b1]
        per_sample = max(*slopes, 0.0)
        fixed = max(p1 - per_sample * b1, 0.0)
    # Each sample's input exists twice while a batch is stacked (the list and the batch),
    # and its features once more when encoded for the wire.
    input_bytes = 4 * math.prod(input_shape)
    per_sample += input_bytes + out_bytes
    return MemoryModel(fixed=int(fixed * MARGIN), per_sample=int(per_sample * MARGIN))


def measured_batches(device: torch.device, most: int) -> tuple[int, ...]:
    """The batch sizes a head is measured at, for batches of up to `most` samples.

    On the CPU, 1 and 4 (`MEASURED_BATCHES`): the tensors an operator returns grow with
    the batch, and running the largest batch when a session opens would cost a second.
    On CUDA the peak is no line: cuDNN chooses its algorithms, and their workspaces, by
    batch size (ResNet-18 to `layer3` at 64 px on an H200: a line through batches 1 and 4
    gave 14.1 MB for 32 samples, which allocated 20.0 MB), and a forward costs
    milliseconds, so the head runs at each power of two up to `most`, and `most` itself.
    """
    if device.type != "cuda":
        return tuple(sorted({1, min(most, MEASURED_BATCHES[-1])}))
    powers = itertools.takewhile(lambda b: b < most, (1 << i for i in itertools.count()))
    return (*powers, most)


def static_bytes(graph: ModelGraph, cut: int) -> int:
    """Bytes per sample to compute the head up to `cut`, from shapes alone: the input and
    the largest two consecutive activations, twice over for what runs inside a block
    (a bottleneck's wider middle). What a session is checked against before its head
    runs at all, and what tracing a model needs."""
    sizes = [graph.input_bytes_per_sample]
    sizes += [graph.cut_point(k).bytes_per_sample for k in range(1, min(cut, graph.num_cuts) + 1)]
    pairs = [a + b for a, b in itertools.pairwise(sizes)]
    return graph.input_bytes_per_sample + 2 * max(pairs, default=0)


def session_memory(
    scheduler: Scheduler,
    *,
    head: nn.Module | None,
    graph: ModelGraph,
    cut: int,
    device: torch.device,
    transforms: Transforms,
    out_bytes: int,
    read_bytes: int,
    what: str,
    measured_as: str | None = None,
    max_batch: int = MEASURED_BATCHES[-1],
) -> MemoryModel:
    """A new session's memory model, measured within the budget; refused when no batch
    of it could ever fit.

    The order matters: what can be computed from sizes (decoding the smallest image, the
    head's activations from its shapes) is checked first, so a `resize 100000` or a
    4096-pixel input is refused before anything is allocated; the head then runs under a
    grant of the scheduler, at the batch sizes the budget allows.

    Args:
        scheduler: whose budget the session runs in.
        head: its head (None for INPUT and RAW).
        graph: its model.
        cut: its cut.
        device: where the head runs.
        transforms: its transforms.
        out_bytes: encoded bytes per sample (for RAW: bytes of one encoded batch).
        read_bytes: what a chunk's read-ahead holds.
        what: names the session in a refusal.
        measured_as: a key naming the head's content (the head cache's): sessions with
            equal keys reuse one measurement (each epoch of a job opens a session).
        max_batch: the largest batch the server runs (on CUDA the head is measured up
            to it: `measured_batches`).

    Raises:
        OverBudget: one sample cannot fit, naming the budget.
    """
    if cut == RAW:
        # A RAW batch is read into a list and encoded once: about twice its bytes.
        raw = MemoryModel(fixed=read_bytes + 2 * out_bytes, per_sample=0)
        scheduler.check_fits(raw, what)
        return raw
    static = static_bytes(graph, cut) + out_bytes
    least_decode = decode_bytes(transforms, 1, 1)
    scheduler.check_fits(MemoryModel(fixed=read_bytes + least_decode, per_sample=static), what)
    model = _measured_head(
        scheduler, head, graph, device, out_bytes, static, max_batch, measured_as
    )
    return _with_decoding(scheduler, model, transforms, read_bytes, least_decode, what)


def _measured_head(
    scheduler: Scheduler,
    head: nn.Module | None,
    graph: ModelGraph,
    device: torch.device,
    out_bytes: int,
    static: int,
    max_batch: int,
    measured_as: str | None,
) -> MemoryModel:
    """The head's memory model: measured, or as measured before for the same key."""
    # Room for the measurement: three times the static estimate per sample.
    key = (measured_as, graph.input_shape, out_bytes, str(device)) if measured_as else None
    with _MEASURED_LOCK:
        model = _MEASURED.get(key) if key is not None else None
    if model is None:
        model = _measure_within(
            scheduler, head, graph.input_shape, device, out_bytes, static, max_batch
        )
        if key is not None:
            with _MEASURED_LOCK:
                _MEASURED[key] = model
                while len(_MEASURED) > _MEASURED_KEPT:
                    _MEASURED.pop(next(iter(_MEASURED)))
    return model


def _with_decoding(
    scheduler: Scheduler,
    model: MemoryModel,
    transforms: Transforms,
    read_bytes: int,
    least_decode: int,
    what: str,
) -> MemoryModel:
    """`model` with the read-ahead and decoding added: for an image of the nominal size
    when that fits, else for the smallest (larger ones ask for room as they come).

    Raises:
        OverBudget: not even the smallest image's decoding fits.
    """

    def with_decode(decode: int) -> MemoryModel:
        decode = int(decode * MARGIN)
        return MemoryModel(
            fixed=model.fixed + read_bytes + decode, per_sample=model.per_sample, decode=decode
        )

    least = with_decode(least_decode)
    scheduler.check_fits(least, what)
    nominal = with_decode(decode_bytes(transforms, *NOMINAL_IMAGE))
    try:
        scheduler.check_fits(nominal, what)
    except OverBudget:
        # Fits for small images only: larger ones ask for room as they come.
        return least
    return nominal


def _measure_within(
    scheduler: Scheduler,
    head: nn.Module | None,
    input_shape: tuple[int, ...],
    device: torch.device,
    out_bytes: int,
    static: int,
    max_batch: int,
) -> MemoryModel:
    """`measure_head` under a grant with room for three times the static estimate."""
    room = MemoryModel(fixed=0, per_sample=3 * static)
    most = max(measured_batches(device, max_batch))
    probe = Demand(model=room, max_batch=most)
    with scheduler.run(_OPENING, (0, 0), probe) as grant:
        batches = measured_batches(device, grant.batch)
        # On a GPU the allocator's peak counts every thread's tensors: measure alone.
        lock = TRACING.exclusive() if device.type == "cuda" else TRACING.shared()
        with lock:
            return measure_head(head, input_shape, device, out_bytes=out_bytes, batches=batches)


def _peak(head: nn.Module | None, shape: tuple[int, ...], device: torch.device, b: int) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            x = torch.zeros(b, *shape, device=device)
            if head is not None:
                head(x)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    weights = [*head.parameters(), *head.buffers()] if head is not None else []
    tracker = LiveTensors(ignore=weights)
    with torch.inference_mode():
        x = torch.zeros(b, *shape, device=device)
        tracker.add(x)
        if head is not None:
            with tracker:
                head(x)
    return tracker.peak


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """What the CUDA allocator holds on `device`: bytes handed out for tensors, and bytes
    reserved from the device (its cache included: what the process takes from the GPU,
    less the CUDA context). None on the CPU, whose allocator keeps no such count."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once."""
    seen: dict[tuple[str, int], int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def decode_bytes(transforms: Transforms, width: int, height: int) -> int:
    """Peak bytes to decode a `width` x `height` image and transform it into a tensor.

    Computed from the sizes each op produces (PIL keeps RGB in 4 bytes a pixel; the
    decoded image stays referenced until the tensor is made), so it is known from the
    image's header before anything is decoded. `width = height = 1` gives what any image
    needs at least: an op that makes a 100000-pixel side is refused without an image.
    """
    w, h = max(width, 1), max(height, 1)
    original = _PIL_RGB * w * h
    # Decoding: the decoder's image and its RGB conversion are alive together.
    peak = 2 * original
    current = 0  # bytes of the newest intermediate image, 0 while it is the original
    for op in transforms.ops:
        if isinstance(op, Normalize):
            break
        ow, oh = _output_size(op, w, h)
        out = _PIL_RGB * ow * oh
        # Resampling passes through an image as wide as the wider and as tall as the taller.
        scratch = _PIL_RGB * max(w, ow) * max(h, oh) if isinstance(op, Resize) else 0
        crop = _PIL_RGB * w * h if isinstance(op, RandomResizedCrop) else 0
        peak = max(peak, original + current + out + scratch + crop)
        current, w, h = out, ow, oh
    pixels = w * h
    tensor = original + current + (_UINT8_CHW + _FLOAT_CHW) * pixels
    normalized = original + current + 2 * _FLOAT_CHW * pixels
    return max(peak, tensor, normalized)


def object_decode_bytes(data: Blob, transforms: Transforms, seed: int) -> int:
    """What decoding the object `data` into a sample of `seed` holds in the budget, from
    its header alone; 0 when it is no image (decoding it fails at once, allocating little).

    As large as it is decoded: a 12-megapixel JPEG cropped to 64 px decodes at 1/8.
    """
    size = decoded_size(data, transforms, seed)
    return int(decode_bytes(transforms, *size) * MARGIN) if size is not None else 0


def decoding(model: MemoryModel, decode: int) -> MemoryModel:
    """`model` with room to decode `decode` bytes instead of what it expected: what a
    batch asks for, and is checked against, when its largest image is known."""
    return dataclasses.replace(model, fixed=model.fixed - model.decode + decode, decode=decode)


def session_name(model: object, cut: int) -> str:
    """How a refusal names a session's work at `cut`: `open_session`'s and `profile`'s
    say the same, so a job is told the same thing whichever asked first."""
    return f"a session of {shorten(repr(model), 100)} at cut {cut}"


def _output_size(op: object, w: int, h: int) -> tuple[int, int]:
    if isinstance(op, Resize):
        short, long = min(w, h), max(w, h)
        scaled = max(int(op.size * long / short), 1)
        return (op.size, scaled) if w <= h else (scaled, op.size)
    if isinstance(op, CenterCrop | RandomResizedCrop):
        return op.size, op.size
    if isinstance(op, HorizontalFlip):
        return w, h
    raise TypeError(f"no size rule for transform {op!r}")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()
