"""A head compiled by OpenVINO for the server's CPU (`hapi[openvino]`).

Side by side with inductor with freezing (`benchmarks/heads.py`, two runs), OpenVINO ran
ResNet-18 and ResNet-50 heads at 112 px in 0.74-0.75x and 0.71-0.74x of eager's time,
inductor 0.79-0.80x and 0.79-0.81x; it converts in 2-6 s where inductor compiles in 7-11 s.
Why it is the server's choice where it is installed: docs/server.md, "Compiled heads".
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["compile_openvino", "openvino_installed"]


def openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


def compile_openvino(
    head: nn.Module, example: torch.Tensor, dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`head` converted from torch for batches shaped as `example` and compiled for this
    CPU: on as many threads as torch runs, in bf16 where `dtype` is (and the CPU has bf16
    instructions; fp32 elsewhere).

    Raises:
        Exception: whatever OpenVINO raises for a head it cannot convert.
    """
    ov = _openvino()
    with torch.no_grad():  # converting traces the module: no graph for gradients
        model = ov.convert_model(head, example_input=example)
    model.reshape({0: list(example.shape)})  # one shape: kernels chosen for it
    config = {
        "INFERENCE_NUM_THREADS": torch.get_num_threads(),
        "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "bf16" if dtype == torch.bfloat16 else "f32",
        # The server's cores are the operator's to pin (taskset), not OpenVINO's.
        "ENABLE_CPU_PINNING": False,
    }
    return _Infer(ov.Core().compile_model(model, "CPU", config))


def _openvino() -> Any:
    """OpenVINO, imported without its telemetry. Its converter's package counts uses and,
    unless a user opted out in their home directory, sends them to Google Analytics - a DNS
    lookup at import, events at each conversion. A server beside the storage reaches no
    one it was not told to; without the telemetry package OpenVINO takes its own stub.
    A process that imported either first made its own choice, and keeps it."""
    if "openvino" not in sys.modules:
        # A module of None in `sys.modules`: importing it raises ImportError.
        sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
    import openvino

    return openvino


class _Infer:
    """Runs a compiled model from any thread: an infer request each thread (a request
    serves one call at a time, and sessions run heads in threads of their own)."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled
        self._requests = threading.local()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        request = getattr(self._requests, "request", None)
        if request is None:
            request = self._requests.request = self._compiled.create_infer_request()
        out = request.infer({0: x.detach().cpu().numpy()})[0]
        # A copy: the request's output buffer is written again by its next call.
        return torch.from_numpy(out.copy())
