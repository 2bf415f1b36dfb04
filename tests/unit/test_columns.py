"""Compact columns: read as tuples, found by key, built in bounded batches."""

from __future__ import annotations

import numpy as np
import pytest

from hapi.data.columns import Column, KeyIndex, Versions, string_columns


def test_a_column_reads_as_the_tuple_it_holds() -> None:
    values = ("b", "a", "c", "é")
    col = Column.strings(iter(values))
    assert col == values and list(col) == list(values) and len(col) == 4
    assert col[0] == "b" and col[-1] == "é" and col[1:3] == ("a", "c") and col[::2] == ("b", "c")
    assert col.take(np.array([3, 0])) == ["é", "b"] and col.subset([2]) == ("c",)
    assert col != ("b", "a") and col != ("b", "a", "c", "e")
    with pytest.raises(IndexError):
        col[4]
    ints = Column.ints(np.array([3, 1, 2]))
    assert ints == (3, 1, 2) and ints.numpy().tolist() == [3, 1, 2]
    assert Column.ints([]) == () and "3 values" in repr(ints)


def test_string_columns_are_built_in_batches_of_any_length() -> None:
    rows = ((f"k{i}", f"v{i}") for i in range(70_000))  # over one batch of 65,536
    keys, versions = string_columns(rows, 2)
    assert len(keys) == len(versions) == 70_000 and keys[69_999] == "k69999"
    empty = string_columns(iter(()), 3)
    assert [len(c) for c in empty] == [0, 0, 0]


def test_the_key_index_finds_keys_and_misses_the_rest() -> None:
    keys = Column.strings(f"x/{i}" for i in range(10_000))
    index = KeyIndex(keys)
    assert index.find(["x/5", "x/9999", "y", "x/0"]).tolist() == [5, 9999, -1, 0]
    assert KeyIndex(Column.strings(())).find(["a"]).tolist() == [-1]


def test_versions_are_a_mapping_over_two_columns() -> None:
    v = Versions(Column.strings(["a", "b"]), Column.strings(["1", "2"]))
    assert dict(v) == {"a": "1", "b": "2"} and v.get("c", "-") == "-" and len(v) == 2
    assert v.of(["b", "c"], "none") == ["2", "none"]
    with pytest.raises(ValueError, match="2 keys but 1 versions"):
        Versions(Column.strings(["a", "b"]), Column.strings(["1"]))


def test_versions_at_places_take_them_by_place_only_in_their_own_key_column() -> None:
    keys = Column.strings(["a", "b", "c"])
    v = Versions(keys, Column.strings(["1", "2", "3"]))
    assert v.at(keys, np.array([2, 0])) == ["3", "1"]
    # Another column of keys (a listing that changed since): looked up by key.
    other = Column.strings(["c", "z", "a"])
    assert v.at(other, np.array([0, 1, 2]), "none") == ["3", "none", "1"]
    # An equal column that is not the map's own is looked up too, with the same answer.
    assert v.at(Column.strings(["a", "b", "c"]), np.array([1])) == ["2"]
