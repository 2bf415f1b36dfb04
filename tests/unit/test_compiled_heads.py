"""`CompiledHead`: a head compiled only once its eager time would have paid for the
compile, checked against eager before it runs alone, and eager with the reason whenever
compiling fails, disagrees or is not faster; its copy's bytes are held in the budget."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.errors import InvalidRequest
from hapi.server.chunks._compiled import (
    SAVING,
    TOLERANCE,
    TRIES,
    CompiledHead,
    CompiledHeads,
    Compiler,
    compiler_for,
)
from hapi.server.chunks._openvino import compile_openvino
from hapi.server.memory.scheduler import Scheduler

CPU = torch.device("cpu")
BATCH = 4


class _Slow(nn.Module):
    """A head whose batch takes `seconds`: eager time that adds up predictably."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def _same(module: nn.Module, example: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """A compiler that compiles nothing: the head itself."""
    return module


def _head(
    compiler: Compiler,
    *,
    mode: str = "always",
    head: nn.Module | None = None,
    expected_s: float = 0.0,
    scheduler: Scheduler | None = None,
) -> CompiledHead:
    return CompiledHead(
        (head or _Slow()).eval(),
        mode=mode,  # type: ignore[arg-type]
        device=CPU,
        dtype=torch.float32,
        nbytes=1000,
        expected_s=expected_s,
        scheduler=scheduler,
        compiler=compiler,
    )


def _run_until_settled(head: CompiledHead, batches: int = 40, x: torch.Tensor | None = None) -> int:
    """Feed batches of the settled size (`x`; default 8 features a sample) until the head
    leaves compiling and checking; the batches the compiled head gave."""
    x = torch.randn(BATCH, 8) if x is None else x
    fast = 0
    for _ in range(batches):
        with torch.inference_mode():
            _, compiled = head(x, BATCH)
        fast += compiled
        deadline = time.monotonic() + 60
        while head.state == "compiling" and time.monotonic() < deadline:
            time.sleep(0.01)
    return fast


def test_auto_rents_eager_until_its_time_would_pay_for_the_compile() -> None:
    compiles: list[nn.Module] = []

    def compiler(
        module: nn.Module, example: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        compiles.append(module)
        return module

    head = _head(compiler, mode="auto", head=_Slow(0.01), expected_s=0.02)
    x = torch.randn(BATCH, 8)
    with torch.inference_mode():
        head(x, None)  # the tuner has not settled: nothing counts yet
        assert head.eager_s == 0
        while head.state == "eager":
            head(x, BATCH)
            assert head.state != "eager" or head.eager_s * SAVING < 0.02
    assert head.eager_s * SAVING >= 0.02
    assert head.batch == BATCH


def test_a_compiled_head_that_agrees_runs_after_its_checks() -> None:
    head = _head(_same)
    fast = _run_until_settled(head, batches=TRIES + 10)
    assert head.state == "compiled", head.describe()
    assert fast >= 5
    assert "compiled for batches of 4" in head.describe()
    with torch.inference_mode():
        _, compiled = head(torch.randn(BATCH + 1, 8), BATCH)
    assert not compiled  # another batch size runs eager: no recompile


def test_a_compiled_head_whose_features_differ_is_refused() -> None:
    head = _head(lambda m, example, dtype: lambda x: m(x) * 1.01)
    assert _run_until_settled(head) == 0
    assert head.state == "refused"
    assert "differ from eager's" in head.note


def test_auto_refuses_a_compiled_head_that_is_not_faster() -> None:
    def slower(
        module: nn.Module, example: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return module(x)

        return run

    head = _head(slower, mode="auto", head=_Slow(0.002), expected_s=0.0)
    assert _run_until_settled(head) == 0
    assert head.state == "refused"
    assert "not faster" in head.note


def test_a_head_that_does_not_compile_runs_eager_saying_why() -> None:
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()  # one graph is all a compiled head may be
            return self.linear(x)

    head = _head(compiler_for("inductor", CPU)[1], head=Breaks())
    assert _run_until_settled(head) == 0
    assert head.state == "refused"
    assert head.note.startswith("compile failed:"), head.note


def test_the_compiled_copy_is_held_in_the_budget_until_the_head_goes() -> None:
    scheduler = Scheduler(1 << 20, 1)
    head = _head(_same, scheduler=scheduler)
    _run_until_settled(head, batches=TRIES + 2)
    assert head.state == "compiled"
    assert scheduler.stats().used == 1000
    head.forget()
    assert scheduler.stats().used == 0
    assert head.state == "refused" and "unloaded" in head.note


def test_a_compile_the_budget_cannot_hold_runs_eager() -> None:
    head = _head(_same, scheduler=Scheduler(100, 1))
    assert _run_until_settled(head) == 0
    assert head.note.startswith("compile failed: OverBudget"), head.note


def test_sessions_of_one_head_share_its_compiled_form_and_a_dropped_head_frees_it() -> None:
    scheduler = Scheduler(1 << 20, 1)
    heads = CompiledHeads("always", CPU, scheduler, compiler=("fake", _same))
    module = _Slow().eval()
    key = ("head-a", 64, "torch.float32")
    first = heads.get(key, module, torch.float32)
    assert heads.get(key, module, torch.float32) is first
    _run_until_settled(first, batches=TRIES + 2)
    assert heads.compiles == 1
    assert list(heads.describe().values()) == [first.describe()]
    assert scheduler.stats().used > 0
    heads.forget("head-a")
    assert scheduler.stats().used == 0
    assert heads.get(key, module, torch.float32) is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_compiles_a_conv_head_that_agrees_with_eager(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        from hapi.graph.precision import bf16_native

        if not bf16_native("cpu"):
            pytest.skip("this CPU has no bf16 kernels: bf16 heads run fp32 here")
    head = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
    entry = CompiledHead(
        head.eval().requires_grad_(False),
        mode="always",
        device=CPU,
        dtype=dtype,
        nbytes=0,
        expected_s=0.0,
    )
    x = torch.randn(BATCH, 3, 16, 16)
    fast = 0
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for _ in range(TRIES + 4):
            y, compiled = entry(x, BATCH)
            fast += compiled
            while entry.state == "compiling":
                time.sleep(0.05)
        reference = head(x)
    assert entry.state == "compiled", entry.describe()
    assert fast >= 1
    assert (y.float() - reference.float()).abs().max() <= 5e-2 * reference.float().abs().max()


def test_a_server_refuses_an_unknown_compile_mode_or_compiler() -> None:
    from hapi.server import ServerConfig

    with pytest.raises(InvalidRequest, match="compile_heads is one of auto, always, off"):
        ServerConfig(store="/tmp", compile_heads="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="head_compiler is one of auto, inductor, openvino"):
        ServerConfig(store="/tmp", head_compiler="tvm")  # type: ignore[arg-type]


def test_auto_compiles_with_openvino_on_a_cpu_and_inductor_on_a_gpu() -> None:
    # OpenVINO is in the dev extra, so these tests run it: it ran ResNet heads faster here.
    assert compiler_for("auto", CPU)[0] == "OpenVINO"
    assert compiler_for("inductor", CPU)[0] == "inductor"
    assert compiler_for("auto", torch.device("cuda"))[0] == "inductor"
    with pytest.raises(InvalidRequest, match="runs heads on a CPU.*use 'inductor'"):
        compiler_for("openvino", torch.device("cuda"))


def _conv_head() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    ).eval()


def test_an_openvino_head_agrees_with_eager_from_every_thread_and_in_bf16() -> None:
    import threading

    head = _conv_head()
    x = torch.randn(BATCH, 3, 16, 16)
    with torch.inference_mode():
        reference = head(x)
    fn = compile_openvino(head, x, torch.float32)
    scale = reference.abs().max().item()
    errors: list[float] = []

    def run() -> None:  # each thread its own infer request: calls at once must not mix
        for _ in range(3):
            errors.append((fn(x) - reference).abs().max().item())

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 9 and max(errors) <= TOLERANCE * scale
    first = fn(x)
    fn(x + 1)  # the next call writes the request's output again: the first is a copy
    assert (first - reference).abs().max() <= TOLERANCE * scale
    bf16 = compile_openvino(head, x, torch.bfloat16)(x)
    assert bf16.dtype == torch.float32
    assert (bf16 - reference).abs().max() <= 5e-2 * scale


def test_openvino_compiles_without_its_telemetry(tmp_path: Path) -> None:
    # Its telemetry, on unless a user opted out, writes an id under the home directory
    # and sends events to Google Analytics: a server must do neither.
    script = (
        "import sys, torch\n"
        "from hapi.server.chunks._openvino import compile_openvino\n"
        "head = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten()).eval()\n"
        "x = torch.randn(2, 3, 8, 8)\n"
        "assert (compile_openvino(head, x, torch.float32)(x) - head(x)).abs().max() < 1e-4\n"
        "assert sys.modules['openvino_telemetry'] is None\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    assert list(tmp_path.iterdir()) == []  # no ~/intel/openvino_ga_cid


def test_a_head_compiled_by_openvino_says_so_once_it_runs_alone() -> None:
    head = CompiledHead(
        _conv_head(), mode="always", device=CPU, dtype=torch.float32, nbytes=0,
        expected_s=0.0, compiler=compile_openvino, runtime="OpenVINO",
    )  # fmt: skip
    fast = _run_until_settled(head, x=torch.randn(BATCH, 3, 16, 16))
    assert head.state == "compiled" and fast >= 1, head.describe()
    assert head.describe().endswith("(OpenVINO)")


def test_an_exported_models_head_compiles_and_agrees() -> None:
    from hapi.graph import trace

    class Branchy(nn.Module):
        """fx cannot trace its `if`, so hapi exports it: its head picks its train/eval
        variant under a lock each call, which dynamo cannot trace."""

        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 4:
                x = self.bn(self.conv(x))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    graph = trace(Branchy().eval(), (3, 16, 16))
    head = graph.head(graph.num_cuts - 1).eval().requires_grad_(False)
    x = torch.randn(BATCH, 3, 16, 16)
    with torch.inference_mode():
        reference = head(x)
    for name in ("inductor", "openvino"):
        fn = compiler_for(name, CPU)[1](head, x, torch.float32)  # type: ignore[arg-type]
        with torch.inference_mode():
            assert (fn(x) - reference).abs().max() <= 1e-5, name
