"""Per-cut profile rows: what crosses the network at each cut point, and what it costs."""

from __future__ import annotations

from typing import Any

from hapi.graph._flops import head_flops
from hapi.graph.model_graph import ModelGraph
from hapi.graph.tracing import probe

__all__ = ["profile_rows"]


def profile_rows(graph: ModelGraph, *, flops: bool = True) -> list[dict[str, Any]]:
    """One row per cut 0..n: index, name, shape, bytes per sample (fp32, fp16), ratio,
    parameters and forward FLOPs.

    The ratio compares the activation's fp32 bytes with the fp32 input's: below 1, the
    cut sends less than the decoded input would. `params` counts the parameters the head
    up to the cut uses (what the server holds), `flops` the forward FLOPs of that head per
    sample (what the server computes; torch's FlopCounterMode: 2 per multiply-add of
    matrix products and convolutions); the tail's are the last row's minus these.

    Args:
        graph: the traced model.
        flops: False to leave the FLOPs out (they cost one forward pass).
    """
    per_cut = head_flops(graph, probe(graph.model, graph.input_shape, batch=1)) if flops else []
    base = graph.input_bytes_per_sample
    rows: list[dict[str, Any]] = [
        {
            "cut": 0,
            "name": "input",
            "shape": list(graph.input_shape),
            "bytes_per_sample": base,
            "bytes_fp16": base // 2,
            "ratio": 1.0,
            "params": 0,
        }
    ]
    for p in graph.cut_points:
        rows.append(
            {
                "cut": p.index,
                "name": p.name,
                "shape": list(p.shape),
                "bytes_per_sample": p.bytes_per_sample,
                "bytes_fp16": p.bytes_per_sample // 2,
                "ratio": p.bytes_per_sample / base,
                "params": p.params_before,
            }
        )
    for row, count in zip(rows, per_cut, strict=False):
        row["flops"] = int(count)
    return rows
