"""Heads and tails of exported models, which follow the model's train/eval modes.

An exported graph is one variant of the model per configuration of its modules'
`training` flags. `ExportSource` exports the model once per configuration it meets, and a
`ModalPart` (a head or a tail) runs the variant of the configuration the model is in;
`ModalPart.train(mode)` sets the flags of the modules it runs. It runs any `PartSource`:
`ExportSource`, or `hapi.graph._fx_modes`'s `FxSource`. More: docs/graph.md, "Heads and
tails that follow train and eval modes".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import fx, nn

from hapi._fx_lock import TRACING
from hapi.errors import InvalidCut, InvalidRequest
from hapi.graph._cuts import Cuts, find_cuts
from hapi.graph._split import split

__all__ = ["ExportSource", "ModalPart", "PartSource", "Variant", "owned_modules"]

Modes = tuple[bool, ...]

log = logging.getLogger("hapi.graph")


@dataclass(frozen=True)
class Variant:
    """The model exported in one configuration of modes, with its cut points."""

    gm: fx.GraphModule
    cuts: Cuts
    by_name: dict[str, fx.Node]


class PartSource(Protocol):
    """Where a `ModalPart` finds the graph to run: one variant of the model per set of modes.

    A protocol because the two sources key their variants differently: an exported
    model's operations depend on every module's flag, a torch.fx graph's only on its
    root's (its modules that read theirs are leaves, and run per their own flag).
    """

    model: nn.Module
    first: Variant
    """The variant the cut points were found in (eval mode)."""
    first_modes: Modes
    """The key of `first`."""
    located: tuple[Variant, ...]
    """The variants made up front: they say which modules run where."""

    def variant(self, *, head: bool, training: bool) -> tuple[Modes, Variant]:
        """The variant a head or a tail runs now; `training` is the part's own flag."""
        ...

    def owned(self, cut_name: str | None, head: bool) -> list[nn.Module]:
        """The modules whose flags a head or tail at `cut_name` sets (see the module doc)."""
        ...


class ExportSource:
    """A model exported once per configuration of its modules' train/eval modes.

    Exported twice when made: in the modes the model is in (eval, when `trace` makes it),
    which gives the cut points, and with every module in train mode, which shows where the
    operations of modules that do nothing in eval mode (dropout) are.
    """

    def __init__(self, model: nn.Module, export: Callable[[], fx.GraphModule]) -> None:
        self.model = model
        self._export = export
        self._lock = threading.Lock()
        self._variants: dict[Modes, Variant] = {}
        first = _variant(model, export())
        modes = [m.training for m in model.modules()]
        model.train()
        trained: Variant | None = None
        try:
            trained = _variant(model, export())
        except Exception as exc:  # torch.export raises many types
            # Heads still work; a tail in train mode says why it cannot run when called.
            log.warning("cannot export %s in train mode: %s", type(model).__name__, exc)
        finally:
            for m, mode in zip(model.modules(), modes, strict=True):
                m.training = mode
        self.located: tuple[Variant, ...] = (first,) if trained is None else (first, trained)
        scopes = {s for v in self.located for n in v.gm.graph.nodes for s in _scopes(n)}
        # Modules that run no operation in either mode: their flags change nothing.
        self._relevant = [model, *(m for name, m in model.named_modules() if name in scopes)]
        self.first_modes = self.modes()
        """The modes the model was exported in first (all eval, when `trace` did it)."""
        self.first = self._variants.setdefault(self.first_modes, first)
        if trained is not None:
            self._variants.setdefault(tuple(True for _ in self._relevant), trained)

    def modes(self) -> Modes:
        """The `training` flags of the model and of its modules that run operations."""
        return tuple(m.training for m in self._relevant)

    def variant(self, *, head: bool = False, training: bool = False) -> tuple[Modes, Variant]:
        """The variant for the modes the model's modules are in now, exported on first use
        (a part's own flag is not asked: `ModalPart.train` sets the modules' flags)."""
        modes = self.modes()
        with self._lock:
            found = self._variants.get(modes)
        if found is None:
            try:
                # Exclusive: torch.export is not thread-safe, and the caller may be a
                # head running shared beside another part's export (see `hapi._fx_lock`).
                with TRACING.exclusive():
                    found = _variant(self.model, self._export())
            except Exception as exc:  # torch.export raises many types
                raise InvalidRequest(
                    f"cannot export {type(self.model).__name__} in its current train/eval "
                    f"modes: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                ) from exc
            with self._lock:
                found = self._variants.setdefault(modes, found)
        return modes, found

    def owned(self, cut_name: str | None, head: bool) -> list[nn.Module]:
        """The modules whose flags a head or tail at `cut_name` sets (see the module doc)."""
        return owned_modules(self.model, self.located, cut_name, head)


def owned_modules(
    model: nn.Module, located: tuple[Variant, ...], cut_name: str | None, head: bool
) -> list[nn.Module]:
    """The modules whose flags a head or tail at `cut_name` sets: for a head, those whose
    every operation is before the cut in each variant; for a tail, the model and those
    with an operation after it in some variant."""
    before: set[str] = set()
    after: set[str] = set()
    for variant in located:
        nodes = list(variant.gm.graph.nodes)
        node = variant.by_name.get(cut_name) if cut_name is not None else None
        if cut_name is not None and node is None:
            continue  # not a cut point in this variant: it says nothing of this cut
        at = nodes.index(node) if node is not None else -1  # INPUT: all is after
        for i, n in enumerate(nodes):
            (before if i <= at else after).update(_scopes(n))
    names = (before - after) if head else after
    owned = [model.get_submodule(name) for name in sorted(names)]
    return owned if head else [model, *owned]


def _scopes(n: fx.Node) -> tuple[str, ...]:
    return n.meta.get("scopes", ())


def _variant(model: nn.Module, gm: fx.GraphModule) -> Variant:
    cuts = find_cuts(model, gm)
    by_name: dict[str, fx.Node] = {}
    for point, node in zip(cuts.points, cuts.nodes, strict=True):
        for name in (point.name, *point.aliases):
            by_name.setdefault(name, node)
    return Variant(gm, cuts, by_name)


class ModalPart(fx.GraphModule):
    """The head or the tail of an exported model at a cut, in the model's current modes."""

    def __init__(self, source: PartSource, cut: int, *, head: bool) -> None:
        first = source.first
        cut_name = first.cuts.points[cut - 1].name if cut else None
        part = _part(first, cut_name, head)
        super().__init__(part, part.graph, part.__class__.__name__)
        self._source = source
        self._cut_name = cut_name
        self._head = head
        self._modes = source.first_modes
        self._owned = source.owned(cut_name, head)
        # What the other variants made up front run is held from the start, so the part's
        # parameters and state dict are the same whichever mode it has run in (an
        # optimizer made before the first switch still holds them all; a saved state
        # loads into a new part).
        for variant in source.located[1:]:
            if cut_name is None or cut_name in variant.by_name:
                self._hold(_part(variant, cut_name, head))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        modes, variant = self._source.variant(head=self._head, training=self.training)
        if modes != self._modes:
            self._adopt(_part(variant, self._cut_name, self._head))
            self._modes = modes
        return super().__call__(*args, **kwargs)

    def train(self, mode: bool = True) -> ModalPart:
        super().train(mode)
        for module in self._owned:
            module.training = mode
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ModalPart:
        # `.to(device)` moves the model too, and the part reads the model's tensors again:
        # batch-norm statistics the tail updates are the model's, wherever it runs.
        super()._apply(fn, recurse)
        self._source.model._apply(fn, recurse)
        for n in self.graph.nodes:
            if n.op == "get_attr":
                self._link(str(n.target), None)
        return self

    def _link(self, target: str, part: fx.GraphModule | None, *, replace: bool = False) -> None:
        """Point attribute `target` at the model's tensor of that name (else `part`'s,
        replacing one held already only when `replace`: a constant of one variant)."""
        model = self._source.model
        for get in (model.get_parameter, model.get_buffer):
            try:
                value = get(target)
                break
            except AttributeError:
                continue
        else:
            if part is None or (_has(self, target) and not replace):
                return
            value = _fetch(part, target)
        fx.graph_module._assign_attr(value, self, target)

    def _hold(self, part: fx.GraphModule, *, replace: bool = False) -> None:
        """Hold the modules and attributes `part`'s graph reads."""
        for n in part.graph.nodes:
            target = str(n.target)
            if n.op == "get_attr":
                self._link(target, part, replace=replace)
            elif n.op == "call_module" and not _has(self, target):
                fx.graph_module._assign_attr(_fetch(part, target), self, target)

    def _adopt(self, part: fx.GraphModule) -> None:
        # Constants a graph made for itself may share a name with another variant's.
        self._hold(part, replace=True)
        graph = fx.Graph()
        out = graph.graph_copy(part.graph, {})
        graph.output(out)
        self.graph = graph


def _part(variant: Variant, cut_name: str | None, head: bool) -> fx.GraphModule:
    if cut_name is None:
        return variant.gm
    node = variant.by_name.get(cut_name)
    if node is None:
        raise InvalidCut(
            f"{cut_name!r} is not a cut point of the model in its current train/eval modes; "
            "cut at a block boundary"
        )
    return split(variant.gm, node, head=head)


def _fetch(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _has(module: nn.Module, target: str) -> bool:
    value: Any = module
    for part in target.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True
