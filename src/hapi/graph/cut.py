"""`Cut`: where a model is split, as a user names it - on the command line, in a job file
or in Python - until a traced model turns it into the index the wire carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hapi.errors import InvalidCut, InvalidRequest
from hapi.graph.cut_point import INPUT, RAW

if TYPE_CHECKING:
    from hapi.graph.model_graph import ModelGraph

__all__ = ["Cut", "CutLike"]

_WORDS = ("auto", "freeze", "raw", "input")


@dataclass(frozen=True)
class Cut:
    """Where a model is split: `auto` (the planner chooses), `freeze` (the freeze point),
    `raw` (raw bytes to the trainer), `input` (transformed inputs), or a cut point by its
    index or name (`layer3`, `avgpool+flatten`). Build one with `Cut.of`."""

    spec: int | str

    @classmethod
    def of(cls, value: CutLike) -> Cut:
        """A cut from any form a user writes: a `Cut`; None (the freeze point); a word of
        `auto`, `freeze`, `raw`, `input`; RAW (-1), INPUT (0) or a cut point's index, as a
        number or as text; or a cut point's name.

        Raises:
            InvalidRequest: a bool, a number below RAW, an empty name, or another type.
        """
        if isinstance(value, Cut):
            return value
        if value is None:
            return cls("freeze")
        if isinstance(value, str):
            text = value.strip()
            if text.lstrip("-").isdigit():
                return cls.of(int(text))
            if text.lower() in _WORDS:
                return cls(text.lower())
            if text:
                return cls(text)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= RAW:
            return cls(value)
        raise InvalidRequest(
            f"cut must be 'auto', 'freeze', 'raw', 'input', a cut point's index (RAW -1, "
            f"INPUT 0, 1..n) or its name, got {value!r}"
        )

    @property
    def auto(self) -> bool:
        """The planner chooses the cut (and the local share)."""
        return self.spec == "auto"

    def index(self, graph: ModelGraph, freeze: int) -> int:
        """The cut's index in `graph` - RAW (-1), INPUT (0) or a cut point 1..freeze -
        what the wire carries.

        Raises:
            InvalidCut: `auto` (the planner's to choose), a name of no cut point, or a cut
                past the freeze point.
        """
        if self.auto:
            raise InvalidCut("cut 'auto' is the planner's to choose: give a cut point")
        if self.spec == "freeze":
            return freeze
        index = {"raw": RAW, "input": INPUT}.get(str(self.spec))
        if index is None:
            index = graph.resolve_cut(self.spec)
        if index != RAW:
            graph.check_cut(index, freeze)
        return index

    def __str__(self) -> str:
        return str(self.spec)


CutLike = Cut | int | str | None
"""What a user may write for a cut (`Cut.of` reads each)."""
