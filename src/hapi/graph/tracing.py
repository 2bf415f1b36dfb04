"""`trace`: a model into its cut points (the rule is in `hapi.graph._cuts`).

torch.fx first: a ResNet's stem layers and residual blocks, a ViT's encoder blocks, a
DenseNet's dense blocks and transitions, a VGG's layers, without wrappers written per model.
A model torch.fx cannot trace (Hugging Face models, Python control flow on shapes it cannot
follow) is traced with torch.export instead (`hapi.graph._exported`, `hapi.graph._modal`);
one neither can trace falls back to its top-level children run in order, when they compute
its forward.
"""

from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import fx, nn

from hapi.errors import InvalidRequest
from hapi.graph._cuts import find_cuts
from hapi.graph._exported import export_scoped, model_output
from hapi.graph._fx_modes import FxSource
from hapi.graph._modal import ExportSource
from hapi.graph._module_tracer import trace_in_mode, trace_scoped
from hapi.graph.cut_point import CutPoint
from hapi.graph.model_graph import ModelGraph

__all__ = ["probe", "trace"]

log = logging.getLogger("hapi.graph")


def trace(model: nn.Module, input_shape: tuple[int, ...] = (3, 224, 224)) -> ModelGraph:
    """Trace `model` into its cut points, with shapes for one sample of `input_shape`.

    The graph computes the model's output tensor (`model_output`): the output itself, or
    the `logits` of a Hugging Face `ModelOutput` or a dict, or the first element of a tuple.

    A model torch.fx cannot trace is traced with torch.export (`method == "export"`, with a
    note saying why). One neither can trace falls back to its top-level children run in
    order (`traced=False`, with the reason); when those do not compute the model's forward,
    it has no cut points, and only RAW and INPUT are left. The model's train/eval mode and
    `requires_grad` flags are left as they were.

    Raises:
        InvalidRequest: a bad input shape, or one the model cannot run on.
    """
    shape = tuple(input_shape)
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise InvalidRequest(f"input_shape must be positive ints like (3, 224, 224), got {shape}")
    was_training = {m: m.training for m in model.modules()}
    try:
        # Eval mode: shape propagation must not update BatchNorm statistics.
        model.eval()
        try:
            gm, branches = trace_scoped(model)
            train_gm = trace_in_mode(model, True) if branches else None
        except Exception as exc:  # fx raises many types for untraceable code
            return _exported(model, shape, _reason(exc))
        x = probe(model, shape, batch=1)
        _propagate_shapes(gm, x)
        if train_gm is None:
            cuts = find_cuts(model, gm)
            return ModelGraph(model, shape, cuts.points, True, None, gm, cuts.nodes, cuts.param_cut)
        # The train graph's own randomness (noise it adds) must not move the user's seed.
        with torch.random.fork_rng(devices=[x.get_device()] if x.is_cuda else []):
            _propagate_shapes(train_gm, x)
        source = FxSource(model, gm, train_gm)
        first = source.first.cuts
        return ModelGraph(
            model,
            shape,
            first.points,
            True,
            None,
            gm,
            first.nodes,
            source.param_cut,
            notes=(source.note,),
            _source=source,
        )
    finally:
        for m, training in was_training.items():
            m.training = training


def _reason(exc: BaseException) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"


def _exported(model: nn.Module, shape: tuple[int, ...], fx_reason: str) -> ModelGraph:
    def export() -> fx.GraphModule:
        # A fresh probe each time: the model may have moved to another device since.
        return export_scoped(model, probe(model, shape, batch=2))

    try:
        source = ExportSource(model, export)
    except Exception as exc:  # torch.export raises many types for what it cannot export
        reason = f"torch.fx: {fx_reason}; torch.export: {_reason(exc)}"
        log.warning("cannot trace %s (%s); cutting between its children", type(model), reason)
        return _fallback(model, shape, reason)
    cuts = source.first.cuts
    note = f"traced with torch.export, as torch.fx cannot trace it ({fx_reason})"
    return ModelGraph(
        model,
        shape,
        cuts.points,
        True,
        None,
        _param_cut=cuts.param_cut,
        notes=(note,),
        _source=source,
    )


def probe(model: nn.Module, shape: tuple[int, ...], *, batch: int) -> torch.Tensor:
    """A seeded input batch on the model's device and in its float dtype."""
    first: torch.Tensor | None = next(model.parameters(), None)
    if first is None:
        first = next(model.buffers(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    # A generator of its own leaves the global RNG as the user set it.
    gen = torch.Generator().manual_seed(0)
    return torch.rand(batch, *shape, generator=gen).to(device=device, dtype=dtype)


def _propagate_shapes(gm: fx.GraphModule, x: torch.Tensor) -> None:
    # Real tensors, batch 1: on CPU this beats FakeTensorMode, whose copying of the module
    # costs more than running it (resnet50 at 224: 0.3 s real, 1 s fake).
    from torch.fx.passes.shape_prop import ShapeProp

    # ShapeProp prints a traceback before raising; the error below says it in one line.
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        try:
            ShapeProp(gm).propagate(x)
        except Exception as exc:
            cause = exc.__cause__ or exc
            raise InvalidRequest(
                f"cannot run {gm.__class__.__name__} on an input of shape {tuple(x.shape)}: "
                f"{type(cause).__name__}: {cause}; check the input shape (image size)"
            ) from exc


def _fallback(model: nn.Module, shape: tuple[int, ...], reason: str) -> ModelGraph:
    children = list(model.named_children())
    x = probe(model, shape, batch=2)
    with torch.no_grad():
        try:
            expected = model(x)
        except Exception as exc:
            raise InvalidRequest(
                f"cannot run {type(model).__name__} on an input of shape {tuple(x.shape)}: "
                f"{type(exc).__name__}: {exc}; check the input shape (image size)"
            ) from exc
        points: list[CutPoint] = []
        seen: set[int] = set()
        params = 0
        try:
            for i, (name, child) in enumerate(children, 1):
                x = child(x)
                for p in child.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params += p.numel()
                points.append(CutPoint(i, name, tuple(x.shape[1:]), params_before=params))
            same = torch.equal(x, model_output(expected))
        except Exception:  # children that do not chain: no cut points, said below
            same = False
    if not same:
        reason += (
            "; its children run in order do not compute its forward, so it has no cut "
            "points (only RAW and INPUT)"
        )
        points = []
    index = {name: i for i, (name, _) in enumerate(children, 1)} if points else {}
    param_cut = {
        name: index.get(name.partition(".")[0], len(points) + 1)
        for name, _ in model.named_parameters()
    }
    return ModelGraph(model, shape, tuple(points), False, reason, None, (), param_cut)
