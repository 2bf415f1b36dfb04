"""`CompiledHeads`: a head compiled once it has run long enough to win the compile back.

A head runs eager until its eager seconds, times what compiling saves (`SAVING`), reach
the compile's expected seconds (rent or buy); then a thread compiles it for the tuner's
batch size - OpenVINO on a CPU where it is installed, else `torch.compile` (inductor with
freezing) - and it runs beside eager on `TRIES` batches before it runs alone: kept if it
agrees within `TOLERANCE` and is `BETTER` faster. Otherwise it runs eager, saying why.
Why and figures: docs/server.md, "Compiled heads"."""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from hapi._fx_lock import TRACING
from hapi.errors import InvalidRequest, shorten
from hapi.graph.precision import running_in
from hapi.server.chunks._openvino import compile_openvino, openvino_installed
from hapi.server.memory.scheduler import Scheduler

__all__ = [
    "COMPILE_MODES",
    "HEAD_COMPILERS",
    "CompileMode",
    "CompiledHead",
    "CompiledHeads",
    "HeadCompiler",
    "compile_head",
    "compiler_for",
]

CompileMode = Literal["auto", "always", "off"]
COMPILE_MODES: tuple[CompileMode, ...] = ("auto", "always", "off")
HeadCompiler = Literal["auto", "inductor", "openvino"]
HEAD_COMPILERS: tuple[HeadCompiler, ...] = ("auto", "inductor", "openvino")
SAVING = 0.2
"""The share of eager time a compiled head is expected to save before it is measured
(0.69-0.82x eager measured: `benchmarks/heads.py`)."""
SECONDS_PER_NODE = {"inductor": 0.4, "OpenVINO": 0.1}
"""Compile seconds a graph node is expected to cost, by compiler, until this server has
compiled one: ResNet-18's 71-node head took inductor 29 s cold on one core, and OpenVINO
4 s (ResNet-50's 177 nodes: 8 s)."""
TRIES = 3
BETTER = 0.05
"""How much faster a batch the compiled head must run, as a median of `TRIES`."""
TOLERANCE = 1e-4
"""The largest difference from eager's features allowed, over eager's largest value: fp32
kernels summing in another order differ by about 1e-6; bf16 sessions double it per
rounding step, so theirs is `BF16_TOLERANCE`."""
BF16_TOLERANCE = 5e-2

HeadKey = tuple[str, int, str]
"""The head cache's key, the input size and the dtype: a head as it runs."""
Compiler = Callable[[nn.Module, torch.Tensor, torch.dtype], Callable[[torch.Tensor], torch.Tensor]]
"""Makes a head's compiled callable for batches shaped as the example, computing in the
dtype (the session's: `hapi.graph.precision`)."""


def compiler_for(choice: HeadCompiler, device: torch.device) -> tuple[str, Compiler]:
    """The compiler a server uses (its name, for the head's description): `auto` takes
    OpenVINO on a CPU where it is installed (faster here: `hapi.server.chunks._openvino`),
    else inductor.

    Raises:
        InvalidRequest: OpenVINO asked for where it cannot run, saying why.
    """
    if choice not in HEAD_COMPILERS:
        raise InvalidRequest(
            f"head_compiler is one of {', '.join(HEAD_COMPILERS)}, got {shorten(repr(choice))}"
        )
    if choice == "openvino" and device.type != "cpu":
        raise InvalidRequest(
            f"head_compiler='openvino' runs heads on a CPU, and this server's device is "
            f"{device}: use 'inductor' (or 'auto')"
        )
    if choice == "openvino" and not openvino_installed():
        raise InvalidRequest(
            "head_compiler='openvino' needs OpenVINO: pip install 'hapi[openvino]' "
            "(or use 'inductor')"
        )
    if choice == "openvino" or (choice == "auto" and device.type == "cpu" and openvino_installed()):
        return "OpenVINO", compile_openvino
    return "inductor", _inductor


def _inductor(
    head: nn.Module, example: torch.Tensor, dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    del example, dtype  # compiled on its first call, for that shape; autocast gives the dtype
    return compile_head(head)


def compile_head(head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Inductor with freezing, one graph (a head that breaks into pieces is not worth
    it), one batch shape; compiled on its first call."""
    import torch._inductor.config as inductor

    # Compile in this thread: a pool of compile workers would take the server's cores.
    inductor.compile_threads = 1
    # A traced head's own forward: an exported model's head picks its train/eval variant
    # in `__call__` under a lock (`hapi.graph._modal`), which dynamo cannot trace, and a
    # server's heads stay in eval mode.
    fn = head.forward if isinstance(head, torch.fx.GraphModule) else head
    return torch.compile(fn, fullgraph=True, dynamic=False, options={"freezing": True})


class CompiledHead:
    """One head as it runs (module, input size, dtype) and its compiled form; shared by
    the sessions of that head, thread-safe.

    Args:
        head: the eager head.
        mode: `auto` (rent or buy; kept if faster), `always` (compiled once the batch size
            settles, kept if its features agree, whatever its speed), `off`.
        dtype: what the head computes in (`hapi.graph.precision`).
        nbytes: bytes a compiled copy holds (its folded weights), held in the budget.
        expected_s: the compile's expected seconds.
        scheduler: whose budget holds the copy; None: no budget.
        compiler: makes the compiled callable (`compiler_for`).
        runtime: the compiler's name, for `describe`.
        on_compiled: told the compile's seconds and the head, after a compile.
    """

    def __init__(
        self,
        head: nn.Module,
        *,
        mode: CompileMode,
        device: torch.device,
        dtype: torch.dtype,
        nbytes: int,
        expected_s: float,
        scheduler: Scheduler | None = None,
        compiler: Compiler = _inductor,
        runtime: str = "inductor",
        on_compiled: Callable[[float], None] | None = None,
    ) -> None:
        self.head, self.mode, self.device, self.dtype = head, mode, device, dtype
        self.runtime = runtime
        self.nbytes, self.expected_s, self.scheduler = nbytes, expected_s, scheduler
        self.state = "off" if mode == "off" else "eager"
        """eager (renting), compiling, checking, compiled, or refused (see `note`)."""
        self.note = "compilation is off" if mode == "off" else ""
        self.batch = 0
        """The batch size it is compiled for; others run eager."""
        self.eager_s = 0.0
        """Eager seconds at the settled batch size, before compiling."""
        self.compile_s = 0.0
        self.speed: float | None = None
        """Compiled time over eager's, as the checks measured it."""
        self._compiler, self._on_compiled = compiler, on_compiled
        self._fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._pairs: list[tuple[float, float]] = []
        self._held = 0
        self._lock = threading.Lock()

    def __call__(self, x: torch.Tensor, settled: int | None) -> tuple[torch.Tensor, bool]:
        """The head's features for `x` (called in `running_in` and inference mode), and
        whether the compiled head gave them. `settled`: the tuner's chosen batch, if it
        has chosen."""
        state, fn = self.state, self._fn
        if state == "compiled" and fn is not None and len(x) == self.batch:
            return fn(x), True
        if state == "checking" and fn is not None and len(x) == self.batch:
            return self._check(fn, x), False
        y, seconds = self._timed(self.head, x)
        if state == "eager" and settled is not None and len(x) == settled:
            self._rent(seconds, settled, x)
        return y, False

    def _timed(
        self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        y = fn(x)
        if self.device.type == "cuda":  # kernels run asynchronously: wait for them
            torch.cuda.synchronize(self.device)
        return y, time.perf_counter() - t0

    def describe(self) -> str:
        """One line: how the head runs, and why."""
        if self.state == "compiled":
            return (
                f"compiled for batches of {self.batch}: {self.speed:.2f}x eager's time, "
                f"compiled in {self.compile_s:.1f} s ({self.runtime})"
            )
        return f"{self.state}: {self.note}" if self.note else self.state

    def forget(self) -> None:
        """The head left the server: the compiled copy goes, and its bytes with it."""
        self._refuse("the head was unloaded")

    def _rent(self, seconds: float, batch: int, x: torch.Tensor) -> None:
        with self._lock:
            if self.state != "eager":
                return
            self.eager_s += seconds
            if self.mode == "auto" and self.eager_s * SAVING < self.expected_s:
                return
            self.state, self.batch = "compiling", batch
        example = torch.zeros_like(x)
        threading.Thread(
            target=self._compile, args=(example,), name="hapi-compile", daemon=True
        ).start()

    def _compile(self, example: torch.Tensor) -> None:
        """The compile thread: reserve the copy's bytes, compile, run it once."""
        t0 = time.perf_counter()
        try:
            if self.nbytes and self.scheduler is not None:
                self.scheduler.reserve(self.nbytes, "a compiled head's weights")
                with self._lock:
                    self._held = self.nbytes
            # A trace elsewhere must not patch modules while a compiler reads them.
            with TRACING.shared():
                fn = self._compiler(self.head, example, self.dtype)
                with torch.inference_mode(), running_in(self.dtype, self.device):
                    fn(example)
        except Exception as exc:  # OverBudget included: the head runs eager, saying why
            self._refuse(f"compile failed: {type(exc).__name__}: {shorten(str(exc), 300)}")
            return
        self.compile_s = time.perf_counter() - t0
        if self._on_compiled is not None:
            self._on_compiled(self.compile_s)
        with self._lock:
            if self.state == "compiling":
                self._fn, self.state = fn, "checking"
                return
        self._refuse(self.note)  # forgotten while it compiled: give its bytes back

    def _check(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Run both on the batch: features compared, times paired (in turn first, so
        neither gains from the caches the other warmed); eager's is returned."""
        if len(self._pairs) % 2 == 0:
            y, eager_s = self._timed(self.head, x)
            z, compiled_s = self._timed(fn, x)
        else:
            z, compiled_s = self._timed(fn, x)
            y, eager_s = self._timed(self.head, x)
        scale = y.float().abs().max().item() or 1.0
        off = (z.float() - y.float()).abs().max().item() / scale
        bound = TOLERANCE if self.dtype == torch.float32 else BF16_TOLERANCE
        if not off <= bound:
            self._refuse(f"its features differ from eager's by {off:.1e} of their largest value")
            return y
        with self._lock:
            self._pairs.append((compiled_s, eager_s))
            if len(self._pairs) < TRIES or self.state != "checking":
                return y
            self.speed = statistics.median(c / e for c, e in self._pairs)
            if self.speed <= 1 - BETTER or self.mode == "always":
                self.state = "compiled"
                return y
        self._refuse(f"not faster: {self.speed:.2f}x eager's time a batch")
        return y

    def _refuse(self, why: str) -> None:
        with self._lock:
            self._fn, self.state, self.note = None, "refused", why
            held, self._held = self._held, 0
        if held and self.scheduler is not None:
            self.scheduler.release(held)


class CompiledHeads:
    """Each head's `CompiledHead`, by (head, input size, dtype): compiled once for every
    session of it. Expected compile times learn from this server's compiles.

    Args:
        mode: `auto`, `always` or `off` (`ServerConfig.compile_heads`).
        device: where heads run.
        scheduler: whose budget holds compiled copies.
        keep: entries kept, the least recently used forgotten past it.
        compiler: which compiler (`compiler_for`); or a (name, compiler) of a test's own.
    """

    def __init__(
        self,
        mode: CompileMode,
        device: torch.device,
        scheduler: Scheduler | None = None,
        keep: int = 16,
        compiler: HeadCompiler | tuple[str, Compiler] = "auto",
    ) -> None:
        self.mode, self.device, self.scheduler, self.keep = mode, device, scheduler, keep
        self.compiles = 0
        self.runtime, self._compiler = (
            compiler if isinstance(compiler, tuple) else compiler_for(compiler, device)
        )
        self.seconds_per_node = SECONDS_PER_NODE.get(self.runtime, SECONDS_PER_NODE["inductor"])
        self._heads: OrderedDict[HeadKey, CompiledHead] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: HeadKey, head: nn.Module, dtype: torch.dtype) -> CompiledHead:
        """The entry of `head` as it runs; `key`'s first item is the head cache's key."""
        dropped = []
        with self._lock:
            entry = self._heads.pop(key, None)
            if entry is None or entry.head is not head:
                if entry is not None:  # the head was loaded again: a new module
                    dropped.append(entry)
                entry = self._new(head, dtype)
            self._heads[key] = entry
            while len(self._heads) > self.keep:
                dropped.append(self._heads.popitem(last=False)[1])
        for old in dropped:  # outside the lock: forgetting gives budget back
            old.forget()
        return entry

    def forget(self, head_key: str) -> None:
        """The head cache dropped `head_key`: its compiled copies go too."""
        with self._lock:
            gone = [k for k in self._heads if k[0] == head_key]
            entries = [self._heads.pop(k) for k in gone]
        for entry in entries:
            entry.forget()

    def speeds(self) -> dict[HeadKey, float]:
        """The heads that run compiled, and their time over eager's."""
        with self._lock:
            entries = list(self._heads.items())
        return {k: e.speed for k, e in entries if e.state == "compiled" and e.speed is not None}

    def describe(self) -> dict[str, str]:
        """Each head's state in one line, by a digest of its key (which names the model:
        not for other tenants' eyes), its input size and dtype."""
        with self._lock:
            entries = list(self._heads.items())
        return {_label(k): e.describe() for k, e in entries}

    def _new(self, head: nn.Module, dtype: torch.dtype) -> CompiledHead:
        graph = getattr(head, "graph", None)
        nodes = len(graph.nodes) if isinstance(graph, torch.fx.Graph) else len(list(head.modules()))
        nbytes = sum(t.numel() * t.element_size() for t in (*head.parameters(), *head.buffers()))
        return CompiledHead(
            head,
            mode=self.mode,
            device=self.device,
            dtype=dtype,
            nbytes=nbytes,
            expected_s=self.seconds_per_node * nodes,
            scheduler=self.scheduler,
            compiler=self._compiler,
            runtime=self.runtime,
            on_compiled=lambda s: self._learn(s, nodes),
        )

    def _learn(self, seconds: float, nodes: int) -> None:
        with self._lock:
            self.compiles += 1
            self.seconds_per_node = seconds / max(nodes, 1)


def _label(key: HeadKey) -> str:
    head, size, dtype = key
    digest = hashlib.sha256(str(head).encode()).hexdigest()[:12]
    return f"{digest} at {size} px, {str(dtype).removeprefix('torch.')}"
