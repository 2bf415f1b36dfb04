"""The freeze point a user can trust when they name none, and the check that it trains.

Transfer learning's usual default is everything frozen but the classifier. On a graph of
cut points that is the cut just before the last one that brings parameters in (ResNet:
`flatten`, before `fc`) - or, when parameters are used only after the last cut point (a
model that ends in something other than one tensor), the last cut point itself.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from hapi.errors import InvalidCut
from hapi.graph import INPUT, ModelGraph

__all__ = ["FreezeChoice", "check_trainable", "choose_freeze", "default_freeze"]


class FreezeChoice(NamedTuple):
    """A freeze point and why it was chosen (for the job's summary)."""

    freeze: int
    """The last frozen cut point."""
    reason: str
    """One line for the job's summary."""


def default_freeze(graph: ModelGraph) -> FreezeChoice:
    """Everything frozen but the classifier: the cut before the last layer with parameters.

    Raises:
        InvalidCut: the model has no parameters after its first cut, so nothing could train.
    """
    n = graph.num_cuts
    after = _trainable_after(graph, n, require_grad=False)
    if after and n == INPUT:
        return FreezeChoice(
            INPUT, "freeze=0, the default for a model without cut points: all of it trains"
        )
    if after:
        name = graph.cut_point(n).name
        return FreezeChoice(
            n,
            f"freeze={n} ({name}), the default: everything frozen but the layers after the "
            f"last cut point ({_count(after)} parameters train); pass freeze= to train more",
        )
    last = max(
        (p.index for p in graph.cut_points if p.params_before > _params_before(graph, p.index - 1)),
        default=None,
    )
    if last is None:
        raise InvalidCut(
            f"{type(graph.model).__name__} has no parameters to train: transfer learning "
            "needs a layer with parameters after the freeze point"
        )
    freeze = last - 1
    head = "the input" if freeze == INPUT else graph.cut_point(freeze).name
    trained = graph.cut_point(last).params_before - _params_before(graph, freeze)
    return FreezeChoice(
        freeze,
        f"freeze={freeze} ({head}), the default: everything frozen but the classifier "
        f"{graph.cut_point(last).name!r} ({trained:,} parameters train); pass freeze= to "
        "train more",
    )


def choose_freeze(graph: ModelGraph, freeze: int | str | None) -> FreezeChoice:
    """The job's freeze point: as given, else from `requires_grad`, else the default.

    `requires_grad` decides only when the user froze something: a model whose parameters
    all require gradients (every model as built) gets the default instead of freeze 0,
    which would train all of it and send the inputs, larger than the objects, over the wire.

    Raises:
        InvalidCut: a freeze that is not a cut point, or one that leaves nothing to train.
    """
    if freeze is not None:
        index = graph.resolve_freeze(freeze)
        choice = FreezeChoice(index, f"freeze={index} ({_name(graph, index)}), as given")
    else:
        index = graph.resolve_freeze(None)
        if index > INPUT:
            choice = FreezeChoice(
                index,
                f"freeze={index} ({_name(graph, index)}), from the parameters that do not "
                "require gradients",
            )
        else:
            choice = default_freeze(graph)
    check_trainable(graph, choice.freeze)
    return choice


def check_trainable(graph: ModelGraph, freeze: int) -> None:
    """Refuse a freeze point that leaves nothing to train (call it when the job is built).

    Raises:
        InvalidCut: no parameter after `freeze` requires gradients, naming a freeze that
            would train something.
    """
    if _trainable_after(graph, freeze, require_grad=True):
        return
    if _trainable_after(graph, freeze, require_grad=False):
        raise InvalidCut(
            f"freeze={freeze} ({_name(graph, freeze)}) leaves nothing to train: every "
            "parameter after it has requires_grad=False; set requires_grad on the layers to "
            "train, or lower freeze"
        )
    try:
        hint = f"; the default is freeze={default_freeze(graph).freeze} (omit freeze)"
    except InvalidCut:
        hint = ""
    raise InvalidCut(
        f"freeze={freeze} ({_name(graph, freeze)}) leaves nothing to train: no layer after "
        f"it has parameters; lower freeze so the last layers train{hint}"
    )


def _trainable_after(graph: ModelGraph, freeze: int, *, require_grad: bool) -> list[nn.Parameter]:
    """Parameters the tail after `freeze` uses and the head up to it does not."""
    head = {id(p) for _, p in graph.head_parameters(freeze)}
    # The tail holds only the modules it runs, so unused parameters do not count.
    return [
        p
        for p in graph.tail(freeze).parameters()
        if id(p) not in head and (p.requires_grad or not require_grad)
    ]


def _params_before(graph: ModelGraph, cut: int) -> int:
    return 0 if cut <= INPUT else graph.cut_point(cut).params_before


def _name(graph: ModelGraph, cut: int) -> str:
    return "the input" if cut == INPUT else graph.cut_point(cut).name


def _count(params: list[nn.Parameter]) -> str:
    return f"{sum(p.numel() for p in params):,}"
