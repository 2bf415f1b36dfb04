"""`ModelGraph`: a model as a list of cut points, with a head and a tail for each cut.

A *cut point* is a place in the traced graph where exactly one tensor flows from the nodes
before it to the nodes after it, so the model can be split there and run in two places.
Of those places, hapi keeps the ones that end a *block*: a module that is a child of the
model itself or of a plain container (`nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict`),
and functional steps at the model's top level (`torch.flatten` in a ResNet). That gives a
ResNet's stem layers and residual blocks, a ViT's encoder blocks, a DenseNet's dense blocks
and transitions, and a VGG's layers, without wrappers written per model.

Parameters and buffers (`get_attr` nodes) never count as flowing across a cut: both sides
read them from the shared modules.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from hapi.errors import InvalidCut
from hapi.graph.tracer import is_container, trace_scoped

__all__ = ["INPUT", "RAW", "CutPoint", "ModelGraph", "trace"]

log = logging.getLogger("hapi.graph")

RAW = -1
"""Cut: the store sends the objects' bytes; the trainer does everything."""
INPUT = 0
"""Cut: the store sends transformed input tensors (input-pipeline offload)."""


@dataclass(frozen=True)
class CutPoint:
    """One place a model can be split."""

    index: int
    """1..n; cut k sends the activation after this point."""
    name: str
    """The block this cut follows (`layer2`, `features.3`, `flatten`)."""
    shape: tuple[int, ...]
    """Per-sample shape of the activation (no batch dimension)."""
    aliases: tuple[str, ...] = ()
    """Every module name whose output this is (`layer1` and `layer1.1` end together)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bytes_per_sample(self) -> int:
        """Bytes of the activation per sample in fp32."""
        return 4 * self.numel


@dataclass(eq=False)
class ModelGraph:
    """A model traced into cut points. Build it with `trace`.

    Heads and tails share the model's modules (no copies): training a tail trains the
    model, and a head on the server holds only the modules before its cut.
    """

    model: nn.Module
    input_shape: tuple[int, ...]
    cut_points: tuple[CutPoint, ...]
    traced: bool
    fallback_reason: str | None = None
    _gm: fx.GraphModule | None = field(default=None, repr=False)
    _nodes: tuple[fx.Node, ...] = field(default=(), repr=False)

    @property
    def num_cuts(self) -> int:
        return len(self.cut_points)

    @property
    def input_bytes_per_sample(self) -> int:
        n = 4
        for d in self.input_shape:
            n *= d
        return n

    def cut_point(self, cut: int) -> CutPoint:
        """The cut point with index `cut` (1..n)."""
        self._check_range(cut)
        return self.cut_points[cut - 1]

    def head(self, cut: int) -> nn.Module:
        """The module computing the activation at `cut` from the input (identity at 0)."""
        self._check_range(cut, allow_input=True)
        if cut == INPUT:
            return nn.Identity()
        if self._gm is None:
            return nn.Sequential(*list(self.model.children())[:cut])
        return _split(self._gm, self._nodes[cut - 1], head=True)

    def tail(self, cut: int) -> nn.Module:
        """The module computing the model's output from the activation at `cut`."""
        self._check_range(cut, allow_input=True)
        if cut == INPUT:
            # The traced graph, not the model itself: every tail then runs the same code,
            # whatever Python control flow the model's forward had when it was traced.
            return self._gm if self._gm is not None else self.model
        if self._gm is None:
            return nn.Sequential(*list(self.model.children())[cut:])
        return _split(self._gm, self._nodes[cut - 1], head=False)

    def head_parameters(self, cut: int) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's (qualified name, parameter) pairs the head up to `cut` uses."""
        ids = {id(p) for p in self.head(cut).parameters()}
        for name, p in self.model.named_parameters():
            if id(p) in ids:
                yield name, p

    def resolve_freeze(self, freeze: int | str | None) -> int:
        """The freeze point: the last frozen cut point.

        Args:
            freeze: a cut index; a module name whose output is a cut point (that module
                and everything before it is frozen); or None to read it from the
                parameters: the last cut before which no parameter requires grad.

        Raises:
            InvalidCut: an index out of range, or a name that is not a cut point.
        """
        if freeze is None:
            frozen = 0
            for cut in range(1, self.num_cuts + 1):
                if any(p.requires_grad for _, p in self.head_parameters(cut)):
                    break
                frozen = cut
            return frozen
        if isinstance(freeze, str):
            if freeze.lstrip("-").isdigit():
                return self.resolve_freeze(int(freeze))
            for point in self.cut_points:
                if freeze == point.name or freeze in point.aliases:
                    return point.index
            raise InvalidCut(
                f"{freeze!r} is not a cut point of {type(self.model).__name__}: use a cut "
                f"index 0..{self.num_cuts} or one of {self._names_near(freeze)}"
            )
        if not 0 <= freeze <= self.num_cuts:
            raise InvalidCut(
                f"freeze {freeze} is outside the model's cut points: use 0..{self.num_cuts} "
                "(see `hapi profile`)"
            )
        return int(freeze)

    def check_cut(self, cut: int, freeze: int) -> None:
        """Refuse a cut the server cannot run for a model frozen up to `freeze`.

        Raises:
            InvalidCut: naming the allowed range.
        """
        if cut < RAW or cut > self.num_cuts:
            raise InvalidCut(
                f"cut {cut} is past the model's {self.num_cuts} cut points: use RAW (-1), "
                f"INPUT (0) or 1..{min(freeze, self.num_cuts)}"
            )
        if cut > freeze:
            raise InvalidCut(
                f"cut {cut} is past the freeze point {freeze}: layers after the freeze point "
                f"train, so they must run in the trainer; use a cut of at most {freeze} "
                "or freeze more layers"
            )

    def _check_range(self, cut: int, allow_input: bool = False) -> None:
        low = 0 if allow_input else 1
        if not low <= cut <= self.num_cuts:
            raise InvalidCut(f"cut {cut} is not in {low}..{self.num_cuts}")

    def _names_near(self, name: str) -> list[str]:
        names = [p.name for p in self.cut_points]
        near = [n for n in names if n.startswith(name) or name.startswith(n)]
        return (near or names)[:8]


def trace(model: nn.Module, input_shape: tuple[int, ...] = (3, 224, 224)) -> ModelGraph:
    """Trace `model` into its cut points, with shapes for a batch of `input_shape`.

    A model torch.fx cannot trace falls back to its top-level children run in order
    (`traced=False`, with the reason); that is right for sequential models only.
    The model's train/eval mode and `requires_grad` flags are left as they were.
    """
    was_training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        try:
            gm = trace_scoped(model)
        except Exception as exc:  # fx raises many types for untraceable code
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("cannot trace %s (%s); cutting between its children", type(model), reason)
            return _fallback(model, input_shape, reason)
        return _from_graph(model, gm, input_shape)
    finally:
        for m, training in was_training.items():
            m.training = training


def _from_graph(model: nn.Module, gm: fx.GraphModule, input_shape: tuple[int, ...]) -> ModelGraph:
    from torch.fx.passes.shape_prop import ShapeProp

    with torch.no_grad():
        ShapeProp(gm).propagate(torch.zeros(1, *input_shape))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_use = {n: max((order[u] for u in n.users), default=-1) for n in gm.graph.nodes}
    scope_end: dict[str, fx.Node] = {}
    for n in nodes:
        for scope in n.meta.get("scopes", ()):
            scope_end[scope] = n
    ends: dict[fx.Node, list[str]] = {}
    for scope, n in scope_end.items():
        if _is_block(model, scope):
            ends.setdefault(n, []).append(scope)
    live: set[fx.Node] = set()
    points: list[CutPoint] = []
    cut_nodes: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op == "output":
            break
        if n.op != "get_attr" and not _is_batch_size(n):
            live.add(n)
        live = {v for v in live if last_use[v] > order[n]}
        meta = n.meta.get("tensor_meta")
        if n.op in ("placeholder", "get_attr") or live != {n} or not isinstance(
            meta, torch.fx.passes.shape_prop.TensorMetadata
        ):
            continue
        top_level = not n.meta.get("scopes")
        if n not in ends and not top_level:
            continue
        names = sorted(ends.get(n, []), key=lambda s: (s.count("."), s)) or [n.name]
        points.append(
            CutPoint(len(points) + 1, names[0], tuple(meta.shape[1:]), tuple(names[1:]))
        )
        cut_nodes.append(n)
    return ModelGraph(model, tuple(input_shape), tuple(points), True, None, gm, tuple(cut_nodes))


def _is_block(model: nn.Module, scope: str) -> bool:
    """A block is a child of the model or of a plain container, at any depth."""
    parent = scope.rpartition(".")[0]
    return parent == "" or is_container(model.get_submodule(parent))


def _is_batch_size(n: fx.Node) -> bool:
    """`x.size(0)`: the batch size, which the tail can read off its own input."""
    if n.op != "call_method" or n.target != "size":
        return False
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return dim == 0


def _split(gm: fx.GraphModule, at: fx.Node, *, head: bool) -> fx.GraphModule:
    """A GraphModule with the nodes up to `at` (head) or after it (tail)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    batch_sizes: list[fx.Node] = []
    before = True
    for n in gm.graph.nodes:
        if head:
            env[n] = graph.node_copy(n, lambda a: env[a])
            if n is at:
                graph.output(env[n])
                break
            continue
        if before:
            if n.op == "get_attr":
                env[n] = graph.node_copy(n, lambda a: env[a])
            elif _is_batch_size(n):
                batch_sizes.append(n)
            if n is at:
                env[n] = graph.placeholder("x")
                for b in batch_sizes:
                    env[b] = graph.call_method("size", (env[n], 0))
                before = False
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    part = fx.GraphModule(gm, graph, f"{gm.__class__.__name__}{'Head' if head else 'Tail'}")
    # Drop parameters read only on the other side, so a head holds only what it uses.
    part.graph.eliminate_dead_code()
    part.delete_all_unused_submodules()
    part.recompile()
    return part


def _fallback(model: nn.Module, input_shape: tuple[int, ...], reason: str) -> ModelGraph:
    points: list[CutPoint] = []
    x = torch.zeros(1, *input_shape)
    with torch.no_grad():
        for i, (name, child) in enumerate(model.named_children(), 1):
            x = child(x)
            points.append(CutPoint(i, name, tuple(x.shape[1:])))
    return ModelGraph(model, tuple(input_shape), tuple(points), False, reason)
