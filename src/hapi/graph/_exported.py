"""Tracing with torch.export: models torch.fx cannot trace (Hugging Face, some timm).

`export_scoped` turns torch.export's program into the same form as an fx trace (one input
`x`, `get_attr` nodes for the model's parameters and buffers, `node.meta["scopes"]`), so
cut points are found and split by the same code. The graph computes the model's output
tensor (`model_output`): `model(x)`, its `.logits`, or a tuple's first element. More:
docs/graph.md, "Tracing with torch.export".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from hapi.errors import InvalidRequest

__all__ = ["export_scoped", "model_output"]

_PREFIX = "model."


def model_output(out: Any) -> torch.Tensor:
    """The tensor a model's output stands for: itself, its `logits`, or its first element.

    Raises:
        InvalidRequest: an output with no such tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise InvalidRequest(
        f"the model returns {type(out).__name__}, not a tensor, logits or a tuple of "
        "tensors; wrap it in a module whose forward returns the tensor to train on"
    )


class _Output(nn.Module):
    """The model, returning `model_output(model(x))`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return model_output(self.model(x))


def export_program(model: nn.Module, x: torch.Tensor) -> ExportedProgram:
    """torch.export's program of `_Output(model)` for inputs like `x`, any batch size.

    Raises:
        Exception: whatever torch.export raises for a model it cannot export.
    """
    dims = ({0: torch.export.Dim.AUTO},)
    return torch.export.export(_Output(model), (x,), dynamic_shapes=dims, strict=False)


def export_scoped(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    """The model exported for inputs like `x` (batch size free), as a scoped fx graph.

    Its `get_attr` nodes read the model's own parameters and buffers, by the model's
    qualified names; each node's `meta["val"]` holds its value's shape.

    Raises:
        InvalidRequest: a program that takes more than the input or mutates it.
        Exception: whatever torch.export raises for a model it cannot export.
    """
    ep = export_program(model, x)
    return unlift(ep, model, name=type(model).__name__)


def unlift(ep: ExportedProgram, model: nn.Module, *, name: str) -> fx.GraphModule:
    """`ep` (of `_Output(model)`) with its lifted inputs read from `model` again."""
    inputs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}
    owner = ep.graph_module
    attrs: dict[str, Any] = {}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            spec = inputs[n.name]
            if spec.kind == InputKind.USER_INPUT:
                env[n] = graph.placeholder("x")
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                target = _strip(str(spec.target))
                attrs[target] = _lookup(model, ep, str(spec.target), target)
                env[n] = graph.get_attr(target)
            else:
                raise InvalidRequest(
                    f"{name} exports with a {spec.kind.name} input ({spec.target}); "
                    "hapi runs programs that take one tensor and the model's own weights"
                )
            env[n].meta = {**n.meta, "scopes": ()}
        elif n.op == "output":
            _output(ep, graph, env, list(n.args[0]), attrs, name)
        else:
            if n.op == "get_attr":  # a nested graph of a higher-order operator
                attrs[str(n.target)] = getattr(owner, str(n.target))
            env[n] = graph.node_copy(n, lambda a: env[a])
            stack = n.meta.get("nn_module_stack") or {}
            env[n].meta["scopes"] = _scopes(stack)
    gm = fx.GraphModule(attrs, graph, name)
    persistent = set(model.state_dict(keep_vars=True))
    for target, value in attrs.items():
        buffer = isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
        if buffer and target not in persistent:  # as in the model: not in a state dict
            owner_name, _, field = target.rpartition(".")
            gm.get_submodule(owner_name)._non_persistent_buffers_set.add(field)
    return gm


def _output(
    ep: ExportedProgram,
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    values: list[Any],
    attrs: dict[str, Any],
    name: str,
) -> None:
    user: list[fx.Node] = []
    for spec, value in zip(ep.graph_signature.output_specs, values, strict=True):
        if spec.kind == OutputKind.USER_OUTPUT:
            user.append(env[value])
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            # What the model assigns to a buffer is written back into the buffer itself.
            buffer = graph.get_attr(_strip(str(spec.target)))
            graph.call_function(torch.ops.aten.copy_.default, (buffer, env[value]))
        else:
            raise InvalidRequest(
                f"{name} exports with a {spec.kind.name} output ({spec.target}); hapi runs "
                "programs that return one tensor and change nothing but their buffers"
            )
    if len(user) != 1:
        raise InvalidRequest(f"{name} exports with {len(user)} outputs; hapi needs one tensor")
    out = graph.output(user[0])
    out.meta["scopes"] = ()


def _lookup(model: nn.Module, ep: ExportedProgram, exported: str, target: str) -> Any:
    # The model's own tensor, so that heads and tails share (and train) its weights.
    for get in (model.get_parameter, model.get_buffer):
        try:
            return get(target)
        except AttributeError:
            continue
    if exported in ep.constants:
        return ep.constants[exported]
    return ep.state_dict[exported]


def _strip(target: str) -> str:
    return target[len(_PREFIX) :] if target.startswith(_PREFIX) else target


def _scopes(stack: Mapping[str, Any]) -> tuple[str, ...]:
    scopes = []
    for path, _ in stack.values():
        path = str(path)
        if path.startswith(_PREFIX):
            scopes.append(path[len(_PREFIX) :])
    return tuple(scopes)
