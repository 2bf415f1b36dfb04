"""A head as a content-addressed artifact: a user's own model, run next to the data
without the server running the user's Python or unpickling anything.

`export_head` writes the head at a cut as torch.export's JSON (`program`) and a
safetensors file (`weights`), named by their SHA-256 `digest`. `load_head` never calls
`torch.load`, `torch.export.load` or `ExportedProgram.module()`: the JSON is checked (ATen
operators, plain shape expressions, no custom objects or subgraphs), deserialised with the
weights as tensors and turned into an fx graph module here. What a model must satisfy:
docs/graph.md, "A head as a content-addressed artifact".
"""

from __future__ import annotations

import hashlib
import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from hapi.errors import CorruptObject, IntegrityError, InvalidCut, InvalidRequest
from hapi.graph._program_check import TENSOR_NAME, check_program
from hapi.graph.model_graph import ModelGraph

__all__ = ["HeadArtifact", "export_head", "load_head"]

_FORMAT = "hapi-head-v1"
_STATE, _CONST = "state_dict/", "constants/"


@dataclass(frozen=True, kw_only=True)
class HeadArtifact:
    """A head as bytes: torch.export's JSON program and safetensors weights."""

    program: bytes
    """torch.export's JSON of the head's program (`torch._export.serde` schema)."""
    weights: bytes
    """A safetensors file: `state_dict/<name>` and `constants/<name>` tensors."""
    input_shape: tuple[int, ...]
    """Per-sample input shape the head was exported for, e.g. (3, 224, 224)."""
    digest: str = ""
    """SHA-256 (hex) of the program and weights; computed when left empty."""

    def __post_init__(self) -> None:
        if not isinstance(self.program, bytes) or not isinstance(self.weights, bytes):
            raise InvalidRequest("a head artifact's program and weights must be bytes")
        if not self.input_shape or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.input_shape
        ):
            raise InvalidRequest(
                f"input_shape must be positive ints like (3, 224, 224), got {self.input_shape}"
            )
        digest = head_digest(self.program, self.weights)
        if not self.digest:
            object.__setattr__(self, "digest", digest)
        elif self.digest != digest:
            raise IntegrityError(
                f"head artifact digest {self.digest} does not match its content ({digest}): "
                "the bytes were changed or cut short; send the artifact again"
            )


def head_digest(program: bytes, weights: bytes) -> str:
    """The content address of a head: SHA-256 over its format, program and weights."""
    h = hashlib.sha256()
    h.update(_FORMAT.encode() + b"\0")
    h.update(len(program).to_bytes(8, "big"))
    h.update(program)
    h.update(weights)
    return h.hexdigest()


def export_head(graph: ModelGraph, cut: int | str) -> HeadArtifact:
    """Export the head of `graph`'s model up to `cut` for its input shape, any batch size.

    Raises:
        InvalidCut: `cut` is not a cut point (1..n); INPUT and RAW need no head.
        InvalidRequest: the head cannot be exported; the message names the operation.
    """
    index = graph.resolve_cut(cut)
    if index < 1:
        raise InvalidCut(f"cut {cut!r} needs no head to export: use a cut point 1..n")
    head = graph.head(index).eval()
    x = _example(graph)
    try:
        ep = torch.export.export(
            head, (x,), dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=False
        )
    except Exception as exc:  # torch.export raises many types
        raise InvalidRequest(_not_exportable(graph, index, exc)) from exc
    return _artifact(ep, graph.input_shape, f"{type(graph.model).__name__} up to cut {index}")


def load_head(artifact: HeadArtifact) -> fx.GraphModule:
    """A runnable head from an artifact's bytes, in eval mode, without unpickling anything.

    Raises:
        CorruptObject: bytes that are not a JSON program or safetensors weights.
        InvalidRequest: a program hapi does not run (an operator outside ATen, custom
            objects, subgraphs, guard code, malformed shape expressions).
    """
    from safetensors.torch import load as load_tensors
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

    try:
        tensors = load_tensors(artifact.weights)
        data = json.loads(artifact.program.decode("utf-8"))
    except Exception as exc:
        raise CorruptObject(f"a head artifact that cannot be read: {exc}") from exc
    parameters = check_program(data)
    state: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key.startswith(_STATE):
            name = key[len(_STATE) :]
            is_param = name in parameters
            state[name] = nn.Parameter(value, requires_grad=False) if is_param else value
    constants = {k[len(_CONST) :]: v for k, v in tensors.items() if k.startswith(_CONST)}
    try:
        serialized = _dict_to_dataclass(schema.ExportedProgram, data)
        ep = ExportedProgramDeserializer().deserialize(serialized, state, constants, None)
    except Exception as exc:
        raise InvalidRequest(f"a head program torch cannot read: {exc}") from exc
    return _runnable(ep, artifact.input_shape)


def _example(graph: ModelGraph) -> torch.Tensor:
    first = next(graph.model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(0)
    # Batch 2: torch.export treats a dimension of size 1 as a constant.
    return torch.rand(2, *graph.input_shape, generator=gen).to(device=device, dtype=dtype)


def _not_exportable(graph: ModelGraph, cut: int, exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    where = _user_frame(exc)
    at = f" at {where}" if where else ""
    return (
        f"the head of {type(graph.model).__name__} up to cut {cut} cannot be exported for "
        f"input shape {graph.input_shape}{at}: {type(exc).__name__}: {first}. A head that runs "
        "next to the data must be exportable by torch.export: no Python branch on tensor "
        "values and no data-dependent shapes before the cut; cut earlier, or train locally"
    )


def _user_frame(exc: BaseException) -> str | None:
    # The innermost frame outside torch: the model's line that torch.export could not follow.
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if torch_dir not in f.filename]
    frames = [f for f in frames if not f.filename.endswith(("hapi/graph/export.py",))]
    if not frames:
        return None
    f = frames[-1]
    code = f" ({f.line.strip()})" if f.line else ""
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}{code}"


def _artifact(ep: Any, input_shape: tuple[int, ...], what: str) -> HeadArtifact:
    from safetensors.torch import save as save_tensors
    from torch._export.serde.serialize import serialize

    tensors: dict[str, torch.Tensor] = {}
    for name, value in ep.state_dict.items():
        tensors[_STATE + name] = _plain(value)
    for name, value in ep.constants.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidRequest(
                f"{what} has a constant {name!r} of type {type(value).__name__}; hapi ships "
                "only tensors (no script objects)"
            )
        tensors[_CONST + name] = _plain(value)
    for node in ep.graph.nodes:
        # Shapes only: stack traces name the trainer's files and change from run to run.
        kept = {k: node.meta[k] for k in ("val", "tensor_meta") if k in node.meta}
        node.meta.clear()
        node.meta.update(kept)
    ep._guards_code = []
    try:
        program = serialize(
            ep,
            serialize_state_dict=False,
            serialize_constants=False,
            serialize_example_inputs=False,
        ).exported_program
    except Exception as exc:
        raise InvalidRequest(f"{what} cannot be serialized: {type(exc).__name__}: {exc}") from exc
    check_program(json.loads(program.decode("utf-8")))
    weights = save_tensors(tensors, metadata={"format": _FORMAT})
    return HeadArtifact(program=program, weights=weights, input_shape=tuple(input_shape))


def _plain(t: torch.Tensor) -> torch.Tensor:
    # Its own contiguous CPU memory: safetensors refuses views and shared storage.
    return t.detach().to("cpu").contiguous().clone()


def _check_input(x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape[1:]) != shape:
        raise InvalidRequest(
            f"this head takes inputs of shape (N, {', '.join(map(str, shape))}), "
            f"got {tuple(x.shape)}"
        )


def _runnable(ep: Any, input_shape: tuple[int, ...]) -> fx.GraphModule:
    """An fx graph module running `ep`, reading its weights as attributes."""
    from torch.export.graph_signature import InputKind, OutputKind

    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}
    attrs: dict[str, Any] = {}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            spec = specs[n.name]
            if spec.kind == InputKind.USER_INPUT:
                env[n] = graph.placeholder("x")
                graph.call_function(_check_input, (env[n], tuple(input_shape)))
                continue
            target = str(spec.target)
            if not TENSOR_NAME.match(target):
                raise InvalidRequest(f"a head program names a tensor {target!r}")
            # Non-persistent buffers travel with the constants, as torch.export keeps them.
            value = ep.state_dict.get(target, ep.constants.get(target))
            if not isinstance(value, torch.Tensor):
                raise InvalidRequest(f"a head artifact lacks the tensor {target!r}")
            attrs[target] = value
            env[n] = graph.get_attr(target)
        elif n.op == "output":
            outs = [
                env[v]
                for spec, v in zip(ep.graph_signature.output_specs, n.args[0], strict=True)
                if spec.kind == OutputKind.USER_OUTPUT
            ]
            if len(outs) != 1 or len(outs) != len(ep.graph_signature.output_specs):
                raise InvalidRequest("a head program must return one tensor and nothing else")
            graph.output(outs[0])
        elif n.op == "call_function":
            env[n] = graph.node_copy(n, env.__getitem__)
        else:
            raise InvalidRequest(f"a head program holds a {n.op} node; hapi runs ATen calls")
    for value in attrs.values():
        if isinstance(value, nn.Parameter):
            value.requires_grad_(False)
    return fx.GraphModule(attrs, graph, "ExportedHead").eval()
