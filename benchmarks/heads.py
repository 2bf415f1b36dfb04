"""A frozen head's speed and its features' error in each way the server could run it.

The ways: eager fp32, channels_last, `torch.compile` (inductor, fp32), compiled with
inductor's freezing (`compile_head`: what the server runs once compiling pays,
`hapi.server.chunks._compiled`), bf16 under autocast (`hapi.graph.precision`: a job with
`head_dtype="bf16"` on a CPU with bf16 kernels), and bf16 compiled with freezing. Speed: ResNet-18
and ResNet-50 frozen to `avgpool+flatten` at 112 px, batches of 32, one pinned core, one
torch thread; the ways interleaved within each repeat, medians; compile time apart and
cold (an empty inductor cache: what a server's first job would wait for). Error: five
models (torchvision, timm, Hugging Face, EfficientNet-Lite0 with its ImageNet
weights) at their last frozen cut, the largest difference from the eager fp32 features
over the largest fp32 value, on photo-like inputs.

    python benchmarks/heads.py                 # writes benchmarks/out/heads.{json,png}
    python benchmarks/heads.py --results       # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _host import machine, pin
from _results import write_section

OUT = Path(__file__).resolve().parent / "out"
SPEED_MODELS = ("resnet18", "resnet50")
ERROR_MODELS = {
    # name: (spec, image side)
    "resnet18": ({"name": "resnet18"}, 112),
    "resnet50": ({"name": "resnet50"}, 112),
    "efficientnet_lite0": ({"name": "efficientnet_lite0", "weights": "imagenet"}, 112),
    "timm:mobilenetv3_small_100": ({"name": "timm:mobilenetv3_small_100"}, 112),
    "hf:ViTConfig (base)": ({"name": "hf:ViTConfig"}, 224),
}
TORCH_WAYS = ("eager", "channels_last", "compiled", "compiled, frozen", "bf16", "bf16 frozen")
RUNTIME_WAYS = {  # way: the package it needs
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "openvino bf16": "openvino",
}
COMPILED = ("compiled", "compiled, frozen", "bf16 frozen", *RUNTIME_WAYS)
FP32 = ("eager", "channels_last", "compiled", "compiled, frozen", "onnxruntime", "openvino")
BATCH = 32
RUNS = 5
GOAL = 0.75


def _installed(way: str) -> bool:
    package = RUNTIME_WAYS.get(way)
    return package is None or importlib.util.find_spec(package) is not None


def _head(spec: dict[str, Any], side: int) -> torch.nn.Module:
    from hapi.graph import ModelSpec, build_model, trace

    graph = trace(build_model(ModelSpec.from_dict({"seed": 0, **spec})), (3, side, side))
    return graph.head(graph.num_cuts - 1).eval()


def _inputs(n: int, side: int) -> torch.Tensor:
    """Photo-like inputs: smooth fields with some texture, normalised as ImageNet's."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand((n, 3, 8, 8), generator=g)
    x = torch.nn.functional.interpolate(coarse, size=(side, side), mode="bicubic")
    x = x + 0.05 * torch.randn((n, 3, side, side), generator=g)
    return (x - 0.45) / 0.225


def _bf16(head: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return head(x)

    return run


def _onnxruntime(head: torch.nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """The head exported to ONNX and run by ONNX Runtime on one thread, all graph
    optimizations on (its fusions fold batch norm into the convolutions)."""
    import onnxruntime as ort

    path = Path(tempfile.mkdtemp(prefix="hapi-onnx-")) / "head.onnx"
    torch.onnx.export(
        head, (x,), str(path), input_names=["x"], output_names=["y"],
        dynamic_axes={"x": {0: "n"}}, dynamo=False,
    )  # fmt: skip
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda batch: session.run(None, {"x": batch.numpy()})[0]


def _runtime(way: str, head: torch.nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """A runtime's way; OpenVINO's as the server runs it (`hapi.server.chunks._openvino`:
    one shape, the process's threads, no telemetry)."""
    from hapi.server.chunks._openvino import compile_openvino

    if way == "onnxruntime":
        return _onnxruntime(head, x)
    return compile_openvino(head, x, torch.bfloat16 if way.endswith("bf16") else torch.float32)


def _ways(
    head: torch.nn.Module, x: torch.Tensor
) -> dict[str, tuple[Callable[[], Callable[[torch.Tensor], Any]], bool]]:
    """Each way as (a function that builds it, whether it takes channels_last inputs).
    Built when first timed, so the first call's time holds a runtime's conversion, as it
    holds inductor's compile."""
    from hapi.server.chunks._compiled import compile_head

    def copied() -> torch.nn.Module:
        return copy.deepcopy(head)

    ways: dict[str, tuple[Callable[[], Callable[[torch.Tensor], Any]], bool]] = {
        "eager": (lambda: head, False),
        "channels_last": (lambda: copied().to(memory_format=torch.channels_last), True),
        "compiled": (lambda: torch.compile(copied()), False),
        "compiled, frozen": (lambda: compile_head(copied()), False),
        "bf16": (lambda: _bf16(head), False),
        # As the server runs it: the compiled head called under autocast.
        "bf16 frozen": (lambda: _bf16(compile_head(copied())), False),
    }
    for way in RUNTIME_WAYS:
        if _installed(way):
            ways[way] = (functools.partial(lambda w: _runtime(w, copied(), x), way), False)
    return ways


def flops(head: torch.nn.Module, x: torch.Tensor) -> float:
    """FLOPs a sample (torch's counter: a multiply-add is two)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        head(x)
    return counter.get_total_flops() / len(x)


def _time(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> float:
    """Milliseconds a sample: the median of `RUNS` runs."""
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(x) * 1e3


def speed(model: str, repeats: int) -> dict[str, Any]:
    head = _head({"name": model}, 112)
    x = _inputs(BATCH, 112)
    xl = x.contiguous(memory_format=torch.channels_last)
    first: dict[str, float] = {}
    built: dict[str, tuple[Callable[[torch.Tensor], Any], bool]] = {}
    with torch.inference_mode():
        for name, (build, last) in _ways(head, x).items():
            t0 = time.perf_counter()
            fn = build()
            fn(xl if last else x)  # compiles the compiled ways; warms the others
            first[name] = time.perf_counter() - t0
            built[name] = (fn, last)
        per_way: dict[str, list[float]] = {name: [] for name in built}
        for _ in range(repeats):
            for name, (fn, last) in built.items():
                per_way[name].append(_time(fn, xl if last else x))
    ms = {name: statistics.median(v) for name, v in per_way.items()}
    gflop = flops(head, x) / 1e9
    return {
        "ms": ms,
        "ratio": {name: ms[name] / ms["eager"] for name in built},
        "first_call_s": first,
        "gflop_per_sample": gflop,
        "gflops": {name: gflop / (ms[name] / 1e3) for name in built},
    }


def error(spec: dict[str, Any], side: int) -> dict[str, float | str]:
    """The largest difference from eager fp32, over the largest fp32 value, per way."""
    from hapi.server.chunks._compiled import compile_head

    head = _head(spec, side)
    x = _inputs(8, side)
    with torch.inference_mode():
        ref = head(x).float()
        scale = ref.abs().max().item()
        got = {
            "bf16": _bf16(head)(x).float(),
            # Fresh copies (the same seed): a traced head that has run does not deepcopy.
            "compiled": torch.compile(_head(spec, side))(x).float(),
            "compiled, frozen": compile_head(_head(spec, side))(x).float(),
        }
    errors: dict[str, float | str] = {
        name: (y - ref).abs().max().item() / scale for name, y in got.items()
    }
    for way in RUNTIME_WAYS:
        if not _installed(way):
            continue
        try:  # a runtime that cannot take a model is a finding, not the run's end
            out = torch.as_tensor(_runtime(way, _head(spec, side), x)(x)).float()
            errors[way] = (out - ref).abs().max().item() / scale
        except Exception as exc:  # each runtime raises its own kinds
            errors[way] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return errors


def _measured(data: dict[str, Any]) -> list[str]:
    """The ways this run measured, in `WAYS`' order (a runtime not installed is absent)."""
    first = next(iter(data["speed"].values()))
    return [w for w in (*TORCH_WAYS, *RUNTIME_WAYS) if w in first["ms"]]


def _error(value: float | str, fmt: str) -> str:
    return value if isinstance(value, str) else format(value, fmt)


def report(data: dict[str, Any]) -> str:
    ways = _measured(data)
    lines = [
        "Milliseconds a sample (batches of 32, 112 px, one pinned core, one torch thread; "
        f"medians of {data['repeats']} interleaved repeats of {RUNS} runs), and each way "
        f"against eager fp32 (goal for a compiled or bf16 head: <= {GOAL}x):",
        "",
        "| model | " + " | ".join(ways) + " |",
        "|---|" + "---|" * len(ways),
    ]
    for model, row in data["speed"].items():
        cells = [f"{row['ms'][w]:.2f} ({row['ratio'][w]:.2f}x)" for w in ways]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "GFLOP/s of each fp32 way (the head's FLOPs, torch's counter, over its time), and "
        "what the goal asks of it:",
        "",
        "| model | GFLOP a sample | "
        + " | ".join(w for w in ways if w in FP32)
        + f" | fp32 at {GOAL}x of eager |",
        "|---|---|" + "---|" * (len([w for w in ways if w in FP32]) + 1),
    ]
    for model, row in data["speed"].items():
        cells = [f"{row['gflops'][w]:.0f}" for w in ways if w in FP32]
        needed = row["gflops"]["eager"] / GOAL
        lines.append(
            f"| {model} | {row['gflop_per_sample']:.2f} | " + " | ".join(cells)
            + f" | {needed:.0f} |"
        )  # fmt: skip
    compiles = "; ".join(
        f"{model} "
        + ", ".join(f"{w} {row['first_call_s'][w]:.0f} s" for w in COMPILED if w in ways)
        for model, row in data["speed"].items()
    )
    errors = data["error"]
    bf16 = ", ".join(f"{model} {row['bf16']:.2%}" for model, row in errors.items())
    frozen = ", ".join(f"{model} {row['compiled, frozen']:.1e}" for model, row in errors.items())
    worst = max(row["compiled"] for row in errors.values())
    lines += [
        "",
        "The first call of each compiled way, which compiles it (cold, one core; a "
        f"runtime's holds its export or conversion): {compiles}.",
        "",
        "Features against eager fp32 (the largest difference over the largest value, at each "
        f"model's last frozen cut, 8 photo-like inputs): bf16 {bf16}; compiled fp32 at most "
        f"{worst:.1e}; compiled with freezing {frozen} (`TOLERANCE`: 1e-4).",
    ]
    for way in (w for w in RUNTIME_WAYS if w in ways):
        each = ", ".join(
            f"{model} {_error(row[way], '.1e')}" for model, row in errors.items() if way in row
        )
        lines[-1] += f" {way}: {each}."
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = _measured(data)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    models = list(data["speed"])
    width = 0.8 / len(ways)
    for i, way in enumerate(ways):
        values = [data["speed"][m]["ratio"][way] for m in models]
        bars = ax.bar([j + i * width for j in range(len(models))], values, width, label=way)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.axhline(GOAL, color="gray", linestyle="--", linewidth=1, label=f"goal ({GOAL}x)")
    ax.set_xticks([j + width * (len(ways) - 1) / 2 for j in range(len(models))], models)
    ax.set_ylabel("time a sample / eager fp32")
    ax.set_title("a frozen head at 112 px, batch 32, one core", fontsize=10)
    ax.set_ylim(0, 1.5)  # room for the legend above the bars
    ax.legend(fontsize=6, ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", action="store_true", help="write RESULTS.md's section")
    args = parser.parse_args()
    # A cold compile, as a fresh server's: inductor keeps what it compiled on disk.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hapi-inductor-")
    pin(1)
    torch.set_num_threads(1)
    data: dict[str, Any] = {"machine": machine(), "repeats": args.repeats}
    data["speed"] = {m: speed(m, args.repeats) for m in SPEED_MODELS}
    data["error"] = {name: error(spec, side) for name, (spec, side) in ERROR_MODELS.items()}
    OUT.mkdir(exist_ok=True)
    (OUT / "heads.json").write_text(json.dumps(data, indent=1))
    plot(data, OUT / "heads.png")
    text = report(data)
    print(text)
    if args.results:
        write_results(data, text)


def write_results(data: dict[str, Any], text: str) -> None:
    """This benchmark's section of RESULTS.md."""
    write_section(
        "heads",
        "## A frozen head: eager, compiled, bf16, runtimes (`benchmarks/heads.py`)\n\n"
        "`pip install -e '.[bench,runtimes]' && python benchmarks/heads.py --results` on "
        f"{data['machine']}.\n\n{text}\n\n"
        "![each way against eager](out/heads.png)",
    )


if __name__ == "__main__":
    main()
