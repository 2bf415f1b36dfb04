"""The memory budget: sizes, the per-batch model, and its measurements held against reality."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hapi._sizes import format_bytes, parse_bytes
from hapi.data import Transforms
from hapi.data.ops import CenterCrop, Resize
from hapi.errors import InvalidRequest, OverBudget
from hapi.graph import ModelSpec, build_model, trace
from hapi.server.head_cache import HeadCache
from hapi.server.memory.batch_memory import (
    decode_bytes,
    measure_head,
    measured_batches,
    static_bytes,
    tensor_bytes,
)
from hapi.server.memory.budget import MemoryModel, default_budget, give_back_when_quiet
from hapi.server.memory.scheduler import Scheduler

SIZE = 64


def test_sizes_parse_with_their_units() -> None:
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("2GB") == 2_000_000_000
    assert parse_bytes("1.5g") == 3 << 29
    assert parse_bytes(1024) == 1024
    for bad in ("", "4 parsecs", "-1GiB", "0", True):
        with pytest.raises(InvalidRequest):
            parse_bytes(bad)  # type: ignore[arg-type]
    assert format_bytes(3 << 30) == "3.0 GiB" and format_bytes(12) == "12 B"


def test_the_default_budget_is_part_of_the_available_memory() -> None:
    meminfo = Path("/proc/meminfo").read_text()
    available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    assert 0 < default_budget("cpu") <= available


def test_the_batch_is_the_largest_that_fits() -> None:
    model = MemoryModel(fixed=100, per_sample=100)
    assert model.batch_bytes(8) == 900
    assert model.largest_batch(free=900, limit=8) == 8
    assert model.largest_batch(free=899, limit=8) == 4  # powers of two below the limit
    assert model.largest_batch(free=500, limit=6) == 4
    assert model.largest_batch(free=299, limit=8) == 1
    assert model.largest_batch(free=199, limit=8) == 0  # not even one: wait
    assert MemoryModel(fixed=5, per_sample=0).largest_batch(free=5, limit=32) == 32


def test_decoding_is_sized_from_the_image_before_it_is_decoded() -> None:
    eval_ = Transforms.eval(SIZE)
    small, photo = decode_bytes(eval_, 320, 240), decode_bytes(eval_, 4000, 3000)
    assert 2 * 4 * 320 * 240 <= small < 2 * 4 * 4000 * 3000 <= photo
    # Whatever the image, these ops make a side of 100000 or 60000 pixels.
    assert decode_bytes(Transforms((Resize(100_000),)), 1, 1) >= 4 * 100_000**2
    assert decode_bytes(Transforms((CenterCrop(60_000),)), 1, 1) >= 4 * 60_000**2
    assert decode_bytes(eval_, 1, 1) < 1 << 20


_MALLINFO2_FIELDS = (
    *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
    *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
)


class _Mallinfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def _malloc_in_use() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _MallocPeak(TorchDispatchMode):
    """glibc's count of allocated bytes after every operator: torch's CPU allocator is
    malloc, so this is what the process really held (in this quiet test process)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = _malloc_in_use()
        self.peak = 0

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _malloc_in_use() - self.base)
        return out


@pytest.mark.parametrize("name,cut", [("resnet18", 8), ("mobilenet_v3_small", 6)])
def test_the_measured_model_holds_what_the_head_really_allocates(name: str, cut: int) -> None:
    graph = trace(build_model(ModelSpec(name=name, num_classes=3)), (3, SIZE, SIZE))
    head = graph.head(min(cut, graph.num_cuts)).eval().requires_grad_(False)
    out = 4 * graph.cut_point(min(cut, graph.num_cuts)).numel
    model = measure_head(head, graph.input_shape, torch.device("cpu"), out_bytes=out)
    for batch in (2, 8):
        x = torch.rand(batch, *graph.input_shape)
        with torch.inference_mode():
            head(x)  # warm-up: first calls allocate caches of their own
            real = _MallocPeak()
            with real:
                head(x)
        held = real.peak + x.numel() * 4
        # The model covers what was held, and not by more than its stated margins
        # (input and features counted again for stacking and encoding).
        assert held <= model.batch_bytes(batch) <= 2.5 * held
    assert static_bytes(graph, cut) < 4 * model.per_sample


class _Workspace(torch.nn.Module):
    """A head whose scratch is no line in the batch: 1 MB more for batches of 8, as
    cuDNN's workspace for one algorithm that it chooses for some batch sizes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8:
            torch.empty(1 << 20, dtype=torch.uint8).fill_(0)
        return x * 2


def test_the_measured_model_is_above_every_batch_it_measured() -> None:
    batches = measured_batches(torch.device("cuda"), 16)
    assert batches == (1, 2, 4, 8, 16) and measured_batches(torch.device("cuda"), 6)[-1] == 6
    assert measured_batches(torch.device("cpu"), 32) == (1, 4)
    assert measured_batches(torch.device("cpu"), 1) == (1,)
    model = measure_head(_Workspace(), (3, 8, 8), torch.device("cpu"), out_bytes=0, batches=batches)
    assert model.batch_bytes(8) >= 1 << 20  # not the line through batches 1 and 16 alone
    line = measure_head(_Workspace(), (3, 8, 8), torch.device("cpu"), out_bytes=0)
    assert line.batch_bytes(16) <= model.batch_bytes(16)


def test_heads_of_one_model_count_once_and_idle_ones_are_evicted_for_memory() -> None:
    scheduler = Scheduler(1 << 30, 1)
    cache = HeadCache(scheduler=scheduler, idle=4)
    scheduler.reclaimer = cache
    spec = ModelSpec(name="resnet18", num_classes=3).to_dict()
    loaded = cache.model(spec, SIZE)
    weights = tensor_bytes(loaded.graph.model)
    assert scheduler.stats().reserved == weights == cache.budget_bytes
    a, b = cache.acquire(loaded, 3), cache.acquire(loaded, 6)
    # Heads share the model's tensors: nothing more is held.
    assert scheduler.stats().reserved == weights
    assert cache.nbytes == tensor_bytes(b.module) < weights
    cache.release(a)
    assert cache.idle_bytes() == weights - cache.nbytes  # the model; head 3 is inside 6's
    freed = cache.reclaim(1)
    assert freed > 0 and scheduler.stats().reserved == weights - freed == cache.budget_bytes
    cache.release(b)
    cache.reclaim(1 << 40)
    assert scheduler.stats().reserved == 0 == cache.budget_bytes and len(cache) == 0


def test_a_model_too_large_for_the_budget_is_refused_and_not_cached() -> None:
    scheduler = Scheduler(8 << 20, 1)  # resnet18's weights are 45 MB
    cache = HeadCache(scheduler=scheduler)
    scheduler.reclaimer = cache
    with pytest.raises(OverBudget, match="memory budget is 8.0 MiB"):
        cache.model(ModelSpec(name="resnet18", num_classes=3).to_dict(), SIZE)
    assert cache.budget_bytes == 0 == scheduler.stats().used


_ALLOCATOR_SCRIPT = """
import json, torch
from hapi.server.memory.budget import bound_allocator, give_back
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
assert bound_allocator()
torch.ones(1)
base = anon()
held = [torch.ones(256 * 1024) for _ in range(24)]  # 24 MiB in 1 MiB tensors: on the heap
used = anon()
del held
kept = anon()
gave = give_back()
print(json.dumps({"used": used - base, "kept": kept - base, "after": anon() - base}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_allocator_keeps_freed_batches_for_the_next_and_gives_them_back_when_asked() -> None:
    # In a process of its own: `bound_allocator` sets the whole process's allocator.
    done = subprocess.run(
        [sys.executable, "-c", _ALLOCATOR_SCRIPT], capture_output=True, text=True, check=True
    )
    rss = json.loads(done.stdout)
    assert rss["used"] >= 20 << 20
    assert rss["kept"] >= rss["used"] - (1 << 20)  # under RETAINED_BYTES: not trimmed
    assert rss["after"] < 4 << 20  # given back


def test_the_allocator_is_given_back_once_each_quiet_spell() -> None:
    state = {"since": None, "now": 0.0}
    trims: list[float] = []
    stopped = threading.Event()
    thread = threading.Thread(
        target=give_back_when_quiet,
        args=(lambda: state["since"], stopped),
        kwargs={
            "after_s": 0.02,
            "clock": lambda: state["now"],
            "trim": lambda: trims.append(state["now"]),
        },
    )
    thread.start()
    try:

        def spell(since: float | None, now: float) -> None:
            state["since"], state["now"] = since, now
            time.sleep(0.2)  # ten of the loop's turns

        spell(None, 5.0)  # a batch runs
        spell(5.0, 5.01)  # ended, not long enough
        assert trims == []
        spell(5.0, 6.0)  # quiet: once, not each turn
        spell(7.0, 7.5)  # another batch ran and ended
        assert trims == [6.0, 7.5]
    finally:
        stopped.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
