"""Models as cut points: tracing, heads and tails, and named models."""

from hapi.graph._exported import model_output
from hapi.graph.cut import Cut, CutLike
from hapi.graph.cut_point import INPUT, RAW, CutPoint
from hapi.graph.cut_rows import profile_rows
from hapi.graph.export import HeadArtifact, export_head, load_head
from hapi.graph.model_graph import ModelGraph
from hapi.graph.strides import standard_layout
from hapi.graph.tracing import trace
from hapi.graph.zoo import ModelSpec, build_model, known_models

__all__ = [
    "INPUT",
    "RAW",
    "Cut",
    "CutLike",
    "CutPoint",
    "HeadArtifact",
    "ModelGraph",
    "ModelSpec",
    "build_model",
    "export_head",
    "known_models",
    "load_head",
    "model_output",
    "profile_rows",
    "standard_layout",
    "trace",
]
