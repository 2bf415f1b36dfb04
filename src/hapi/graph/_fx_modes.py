"""A torch.fx model whose root branches on `self.training` in Python: one graph per mode.

Such a root is traced twice (its flag False: the eval graph; True: the train graph). A
tail is a `ModalPart` over both and runs the graph of its mode; a head is frozen and runs
the eval graph. The cut points kept are the eval graph's that the train graph also has,
by name, in order and with the same shape; a functional step is matched only where the
operations up to the nearest module are the same in both. More: docs/graph.md, "A root
that branches on self.training".
"""

from __future__ import annotations

from collections import Counter

from torch import fx, nn

from hapi.graph._cuts import Cuts, find_cuts, keep_cuts
from hapi.graph._modal import Modes, Variant, owned_modules

__all__ = ["FxSource"]


class FxSource:
    """The eval graph and the train graph of a root that branches on `self.training`.

    Args:
        model: the model.
        eval_gm: its scoped graph traced with the root in eval mode, shapes propagated.
        train_gm: the same with the root in train mode.
    """

    first_modes: Modes = (False,)

    def __init__(self, model: nn.Module, eval_gm: fx.GraphModule, train_gm: fx.GraphModule):
        self.model = model
        evals, trains = find_cuts(model, eval_gm), find_cuts(model, train_gm)
        pairs = _pairs(evals, trains)
        kept = keep_cuts(
            model,
            eval_gm,
            [evals.points[i] for i, _ in pairs],
            [evals.nodes[i] for i, _ in pairs],
        )
        train_kept = keep_cuts(
            model,
            train_gm,
            [evals.points[i] for i, _ in pairs],  # named as the eval graph's
            [trains.nodes[j] for _, j in pairs],
        )
        self.first = _variant(eval_gm, kept)
        self.located: tuple[Variant, ...] = (self.first, _variant(train_gm, train_kept))
        # A parameter only the train graph reads (an auxiliary branch) has its first cut
        # there; the others as the eval graph, which heads run, says.
        self.param_cut = {**train_kept.param_cut, **kept.param_cut}
        self.note = _note(model, kept, train_kept)
        """Says the graphs were traced per mode, and from which cut on training-only steps
        of the root fall in the head (so do not run)."""

    def variant(self, *, head: bool, training: bool) -> tuple[Modes, Variant]:
        """A head runs the eval graph; a tail the graph of its own flag."""
        train = training and not head
        return (train,), self.located[1] if train else self.first

    def owned(self, cut_name: str | None, head: bool) -> list[nn.Module]:
        """The modules whose flags a head or tail at `cut_name` sets (see `ModalPart`)."""
        return owned_modules(self.model, self.located, cut_name, head)


def _variant(gm: fx.GraphModule, cuts: Cuts) -> Variant:
    by_name: dict[str, fx.Node] = {}
    for point, node in zip(cuts.points, cuts.nodes, strict=True):
        for name in (point.name, *point.aliases):
            by_name.setdefault(name, node)
    return Variant(gm, cuts, by_name)


def _pairs(evals: Cuts, trains: Cuts) -> list[tuple[int, int]]:
    """(eval index, train index) of the cut points the two graphs share, in order."""
    in_train = {p.name: j for j, p in enumerate(trains.points)}
    pairs: list[tuple[int, int]] = []
    for i, point in enumerate(evals.points):
        j = in_train.get(point.name)
        if (
            j is None
            or (pairs and j <= pairs[-1][1])
            or trains.points[j].shape != point.shape
            or not _same_step(evals.nodes[i], trains.nodes[j])
        ):
            continue
        pairs.append((i, j))
    return pairs


def _same_step(a: fx.Node, b: fx.Node) -> bool:
    """Whether two cut nodes of the same name are the same place: the operations before
    them since the last module, or those after them up to the next, are the same. A
    block's cut ran in its block: nothing lies between it and the module."""
    return any(_steps(a, before=side) == _steps(b, before=side) for side in (True, False))


def _steps(n: fx.Node, *, before: bool) -> list[tuple[str, object]]:
    """The operations from `n` back to the last node that ran in a module (`before`), or
    after `n` up to the next one; empty for a node that ran in a module."""
    steps: list[tuple[str, object]] = []
    if n.meta.get("scopes"):
        return steps
    if not before:
        n = n.next
    while n.op not in ("placeholder", "output") and not n.meta.get("scopes"):
        steps.append((n.op, n.target))
        n = n.prev if before else n.next
    return steps


def _note(model: nn.Module, evals: Cuts, trains: Cuts) -> str:
    note = (
        f"{type(model).__name__}.forward branches on self.training in Python: traced in "
        "train and in eval mode; a tail runs the graph of its mode, and the cut points are "
        "those of both graphs"
    )
    for point, e, t in zip(evals.points, evals.nodes, trains.nodes, strict=True):
        extra = _ops_to(t) - _ops_to(e)
        if extra:
            ops = sorted({_op_name(target) for _, target in extra})
            return (
                f"{note}. From cut {point.index} ({point.name}) on, the head holds steps the "
                f"root runs in training only ({', '.join(ops)}); heads run in eval mode, so "
                "with such a cut they do not run: freeze before it to train with them"
            )
    return note


def _ops_to(n: fx.Node) -> Counter[tuple[str, object]]:
    """The operations of the graph up to `n`, counted."""
    ops: Counter[tuple[str, object]] = Counter()
    while n.op != "root":
        if n.op not in ("placeholder", "get_attr"):
            ops[(n.op, n.target)] += 1
        n = n.prev
    return ops


def _op_name(target: object) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))
