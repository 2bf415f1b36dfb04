"""Per-cut profile rows: what crosses the network at each cut point."""

from __future__ import annotations

from typing import Any

from hapi.graph.model_graph import ModelGraph

__all__ = ["profile_rows"]


def profile_rows(graph: ModelGraph) -> list[dict[str, Any]]:
    """One row per cut point: index, name, shape, bytes per sample (fp32, fp16), ratio.

    The ratio compares the activation's fp32 bytes with the fp32 input's: below 1, the
    cut sends less than the decoded input would.
    """
    base = graph.input_bytes_per_sample
    rows: list[dict[str, Any]] = [
        {
            "cut": 0,
            "name": "input",
            "shape": list(graph.input_shape),
            "bytes_per_sample": base,
            "bytes_fp16": base // 2,
            "ratio": 1.0,
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
            }
        )
    return rows
