"""`ModelGraph`: a model as a list of cut points, with a head and a tail for each cut.

`hapi.graph.tracing.trace` builds one: with torch.fx, with torch.export for what fx cannot
trace, or from the model's top-level children.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import fx, nn

from hapi.errors import InvalidCut
from hapi.graph._modal import ModalPart, PartSource
from hapi.graph._split import split
from hapi.graph.cut_point import INPUT, RAW, CutPoint

__all__ = ["INPUT", "RAW", "CutPoint", "ModelGraph"]


@dataclass(eq=False)
class ModelGraph:
    """A model traced into cut points. Build it with `hapi.graph.trace`.

    Heads and tails share the model's modules (no copies): training a tail trains the
    model, and a head on the server holds only the modules before its cut.
    """

    model: nn.Module
    """The model itself; heads and tails share its modules."""
    input_shape: tuple[int, ...]
    """Per-sample input shape the shapes were computed for, e.g. (3, 224, 224)."""
    cut_points: tuple[CutPoint, ...]
    """Cut point k at position k-1."""
    traced: bool
    """False when tracing failed and the cuts fall between top-level children."""
    fallback_reason: str | None = None
    """Why tracing failed, when it did."""
    _gm: fx.GraphModule | None = field(default=None, repr=False)
    _nodes: tuple[fx.Node, ...] = field(default=(), repr=False)
    _param_cut: dict[str, int] = field(default_factory=dict, repr=False)
    notes: tuple[str, ...] = ()
    """How it was traced when not by torch.fx alone in one mode (by torch.export, or in
    train and eval mode for a root branching on `self.training` in Python)."""
    _source: PartSource | None = field(default=None, repr=False)
    """Where tails find the graph of their mode: an exported model's variants, or the
    train and eval graphs of a torch.fx root that branches on `self.training`."""

    @property
    def method(self) -> str:
        """`fx` (torch.fx), `export` (torch.export) or `children` (the fallback)."""
        if self._gm is not None:
            return "fx"
        return "export" if self._source is not None else "children"

    @property
    def num_cuts(self) -> int:
        """n: the cut points are 1..n."""
        return len(self.cut_points)

    @property
    def input_bytes_per_sample(self) -> int:
        """Bytes of one fp32 input sample."""
        n = 4
        for d in self.input_shape:
            n *= d
        return n

    def names(self) -> tuple[str, ...]:
        """The cut points' names, cut k at position k-1."""
        return tuple(p.name for p in self.cut_points)

    def cut_point(self, cut: int) -> CutPoint:
        """The cut point with index `cut` (1..n)."""
        self._check_range(cut)
        return self.cut_points[cut - 1]

    def head(self, cut: int) -> nn.Module:
        """The module computing the activation at `cut` from the input (identity at 0)."""
        self._check_range(cut, allow_input=True)
        if cut == INPUT:
            return nn.Identity()
        if self._gm is not None:
            # The eval graph also when traced per mode: a head is frozen, so runs eval.
            return split(self._gm, self._nodes[cut - 1], head=True)
        if self._source is not None:
            return ModalPart(self._source, cut, head=True)
        return nn.Sequential(*list(self.model.children())[:cut])

    def tail(self, cut: int) -> nn.Module:
        """The module computing the model's output from the activation at `cut`."""
        self._check_range(cut, allow_input=True)
        if self._source is not None:
            return ModalPart(self._source, cut, head=False)
        if self._gm is None:
            return self.model if cut == INPUT else nn.Sequential(*list(self.model.children())[cut:])
        if cut == INPUT:
            # The traced graph, not the model itself: every tail then runs the same code,
            # whatever Python control flow the model's forward had when it was traced.
            return self._gm
        return split(self._gm, self._nodes[cut - 1], head=False)

    def segment(self, start: int, end: int) -> nn.Module:
        """The frozen part between two cuts: the activation at `end` from the one at `start`.

        `tail(start)` computes what `tail(end)` computes after it, so features that arrived
        at one cut can join a batch at a later one (a plan that changed its cut mid-epoch).
        Run it in eval mode, as every frozen part runs.

        Raises:
            InvalidCut: a cut out of range, or `start` after `end`.
        """
        self._check_range(start, allow_input=True)
        self._check_range(end, allow_input=True)
        if start > end:
            raise InvalidCut(f"a segment runs forward: cut {start} is after cut {end}")
        if start == end:
            return nn.Identity()
        if start == INPUT:
            return self.head(end)
        if self._gm is None and self._source is None:
            return nn.Sequential(*list(self.model.children())[start:end])
        # The head up to `end`, split again at `start`. An exported model's first variant
        # is the one in eval mode, the mode frozen layers run in.
        gm, nodes = (
            (self._gm, self._nodes)
            if self._gm is not None
            else (self._source.first.gm, self._source.first.cuts.nodes)  # type: ignore[union-attr]
        )
        head = split(gm, nodes[end - 1], head=True)
        at = next(n for n in head.graph.nodes if n.name == nodes[start - 1].name)
        return split(head, at, head=False)

    def _traced_graph(self) -> tuple[fx.GraphModule | None, tuple[fx.Node, ...]]:
        """The graph the cut points are nodes of (in eval mode), or None for the fallback."""
        if self._source is not None:
            return self._source.first.gm, self._source.first.cuts.nodes
        return self._gm, self._nodes

    def head_parameters(self, cut: int) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's (qualified name, parameter) pairs the head up to `cut` uses."""
        self._check_range(cut, allow_input=True)
        for name, p in self.model.named_parameters():
            if self._param_cut.get(name, self.num_cuts + 1) <= cut:
                yield name, p

    def resolve_freeze(self, freeze: int | str | None) -> int:
        """The freeze point: the last frozen cut point.

        Args:
            freeze: a cut index 0..n; a cut point's name or alias, a module name whose
                output is a cut point (that module and everything before it is frozen) or
                a step after one (`avgpool+flatten`); `"input"` (0); or None to read it from
                the parameters: the last cut whose head uses no parameter that requires grad.

        Raises:
            InvalidCut: an index out of range; a name of no module (the message names the
                closest real ones); or a module that is not a cut point.
        """
        if freeze is None:
            trainable = [
                self._param_cut[name]
                for name, p in self.model.named_parameters()
                if p.requires_grad and name in self._param_cut
            ]
            return min(trainable, default=self.num_cuts + 1) - 1
        if isinstance(freeze, str):
            return self.resolve_freeze(self._index_of(freeze, "freeze"))
        if isinstance(freeze, bool) or not isinstance(freeze, int):
            raise InvalidCut(f"freeze must be a cut index, a module name or None, got {freeze!r}")
        if not 0 <= freeze <= self.num_cuts:
            raise InvalidCut(
                f"freeze {freeze} is outside the model's cut points: use 0..{self.num_cuts} "
                "(see `hapi profile`)"
            )
        return freeze

    def resolve_cut(self, cut: int | str) -> int:
        """A cut as an index: RAW (-1), INPUT (0) or a cut point 1..n.

        Args:
            cut: an index; `"raw"` or `"input"`; a cut point's name or alias (`layer3`,
                `avgpool+flatten`, `encoder+getitem`); or an index written as a string.

        Raises:
            InvalidCut: an index out of range; a name of no module (the message names the
                closest real ones); or a module that is not a cut point.
        """
        if isinstance(cut, str):
            return self.resolve_cut(self._index_of(cut, "cut"))
        if isinstance(cut, bool) or not isinstance(cut, int):
            raise InvalidCut(f"cut must be a cut index or a cut point's name, got {cut!r}")
        if not RAW <= cut <= self.num_cuts:
            raise InvalidCut(
                f"cut {cut} is outside the model's cut points: use RAW (-1), INPUT (0) or "
                f"1..{self.num_cuts} (see `hapi profile`)"
            )
        return cut

    def _index_of(self, name: str, what: str) -> int:
        text = name.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        if text.lower() == "raw" and what == "freeze":
            raise InvalidCut("freeze cannot be 'raw': use a cut point 0..n, 'input' (0) or None")
        special = {"raw": RAW, "input": INPUT}
        if text.lower() in special and (what == "cut" or text.lower() == "input"):
            return special[text.lower()]
        for point in self.cut_points:
            if text == point.name or text in point.aliases:
                return point.index
        model = type(self.model).__name__
        if text not in {n for n, _ in self.model.named_modules() if n}:
            # Most often a path from another release of the model's library (Hugging
            # Face's ViT blocks are `vit.layers.N` in transformers 5, `vit.encoder.layer.N`
            # in 4): the closest real names say which spelling this one uses.
            raise InvalidCut(
                f"{name!r} names no module of {model} and no cut point; "
                f"{self._modules_near(text)}. Module paths differ between releases of a "
                f"model's library; use a {what} index 0..{self.num_cuts} or a cut point's "
                "name (see `hapi profile`)"
            )
        raise InvalidCut(
            f"{name!r} is not a cut point of {model}: its output is not "
            f"the only tensor flowing on; use a {what} index 0..{self.num_cuts} or one of "
            f"{self._names_near(text)} (see `hapi profile`)"
        )

    def check_cut(self, cut: int, freeze: int) -> None:
        """Refuse a cut the server cannot run for a model frozen up to `freeze`.

        Raises:
            InvalidCut: naming the allowed range.
        """
        last = min(freeze, self.num_cuts)
        allowed = f"RAW (-1), INPUT (0) or 1..{last}" if last >= 1 else "RAW (-1) or INPUT (0)"
        if isinstance(cut, bool) or not isinstance(cut, int) or cut < RAW:
            raise InvalidCut(f"cut {cut!r} is not a cut: use {allowed}")
        if cut > self.num_cuts:
            raise InvalidCut(
                f"cut {cut} is past the model's {self.num_cuts} cut points: use {allowed}"
            )
        if cut > freeze:
            raise InvalidCut(
                f"cut {cut} is past the freeze point {freeze}: layers after the freeze point "
                f"train, so they must run in the trainer; use {allowed}, or freeze more layers"
            )

    def _check_range(self, cut: int, allow_input: bool = False) -> None:
        low = INPUT if allow_input else 1
        if isinstance(cut, bool) or not isinstance(cut, int) or not low <= cut <= self.num_cuts:
            raise InvalidCut(f"cut {cut!r} is not in {low}..{self.num_cuts}")

    def _modules_near(self, name: str) -> str:
        """A clause naming the cut points and modules closest to `name`, each saying which."""
        cuts = {n: p.index for p in self.cut_points for n in (p.name, *p.aliases)}
        names = list(cuts) + [n for n, _ in self.model.named_modules() if n and n not in cuts]
        near = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
        if not near:
            return f"no name is close to it; the cut points are {list(self.names())[:8]}"
        return "the closest names are " + ", ".join(
            f"{n!r} (cut {cuts[n]})" if n in cuts else f"{n!r} (a module, not a cut point)"
            for n in near
        )

    def _names_near(self, name: str) -> list[str]:
        names = list(self.names())
        near = [n for n in names if n.startswith(name) or name.startswith(n)]
        near = near or difflib.get_close_matches(name, names, n=8, cutoff=0.5)
        return (near or names)[:8]
