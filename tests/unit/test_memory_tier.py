"""The feature cache's memory tier: packed rows within the budget, oldest out first,
copies handed out."""

from __future__ import annotations

import torch

from hapi.cache._memory_tier import MemoryTier


def _get(tier: MemoryTier, sid: str, names: list[str]) -> list[torch.Tensor | None]:
    """Each name's row, or None."""
    found, rows = tier.get_batch(sid, names)
    out: list[torch.Tensor | None] = [None] * len(names)
    for i, row in zip(found, rows if rows is not None else [], strict=True):
        out[i] = row
    return out


def _row(value: float, width: int = 8) -> torch.Tensor:
    return torch.full((width,), value, dtype=torch.float16)


def test_entries_come_back_as_copies_and_a_held_name_is_kept_once() -> None:
    tier = MemoryTier(1 << 20)
    tier.put("s", "a", _row(1))
    tier.put("s", "a", _row(9))  # held already: kept as it was
    (got,) = _get(tier, "s", ["a"])
    assert got is not None and torch.equal(got, _row(1))
    got.fill_(5)  # the caller's copy
    assert torch.equal(_get(tier, "s", ["a"])[0], _row(1))  # type: ignore[arg-type]
    assert _get(tier, "s", ["b"]) == [None] and _get(tier, "other", ["a"]) == [None]


def test_the_budget_bounds_the_rows_and_the_oldest_go_first() -> None:
    row_bytes = 8 * 2
    tier = MemoryTier(10 * row_bytes)
    for i in range(25):
        tier.put("s", f"k{i}", _row(i))
    assert tier.held == 10 * row_bytes
    held = _get(tier, "s", [f"k{i}" for i in range(25)])
    assert [t is not None for t in held] == [False] * 15 + [True] * 10  # the last ten
    assert all(torch.equal(t, _row(i + 15)) for i, t in enumerate(held[15:]))  # type: ignore[arg-type]


def test_a_copy_handed_out_survives_its_row_being_overwritten() -> None:
    tier = MemoryTier(2 * 16)
    tier.put("s", "a", _row(1))
    (kept,) = _get(tier, "s", ["a"])
    tier.put("s", "b", _row(2))
    tier.put("s", "c", _row(3))  # overwrites a's row
    assert _get(tier, "s", ["a"]) == [None]
    assert kept is not None and torch.equal(kept, _row(1))


def test_spaces_and_shapes_share_one_budget() -> None:
    tier = MemoryTier(12 * 16)
    for i in range(8):
        tier.put("one", f"k{i}", _row(i))
    for i in range(8):
        tier.put("two", f"k{i}", _row(i, width=4))  # 8 bytes a row: 8 rows of the 64 left
    assert tier.held == 8 * 16 + 8 * 8
    tier.put("three", "x", _row(7))  # 16 bytes: none left for another slab
    assert _get(tier, "three", ["x"]) == [None]
    tier.put("two", "k8", _row(8, width=4))  # a slab with rows wraps to its oldest
    assert _get(tier, "two", ["k0", "k8"])[0] is None
    got = _get(tier, "one", ["k0", "k7"])
    assert [t[0].item() for t in got] == [0, 7]  # type: ignore[index]
    tier.clear()
    assert not tier and tier.held == 0


def test_a_batch_is_kept_in_one_copy_as_its_rows_one_by_one_would_be() -> None:
    row_bytes = 8 * 2
    one, batched = MemoryTier(20 * row_bytes), MemoryTier(20 * row_bytes)
    one.put("s", "k0", _row(0))
    batched.put("s", "k0", _row(0))
    batch = torch.stack([_row(i) for i in range(14)])
    batch[0] = 99  # k0 is held: it is kept as it was, not overwritten
    names = [f"k{i}" for i in range(14)]
    for name, row in zip(names, batch, strict=True):
        one.put("s", name, row)
    batched.put_batch("s", names, batch)
    want = _get(one, "s", names)
    got = _get(batched, "s", names)
    assert all(t is not None for t in got)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # type: ignore[arg-type]
    assert torch.equal(got[0], _row(0))  # type: ignore[arg-type]
    assert batched.held == one.held == 14 * row_bytes
    batch.fill_(-1)  # the tier holds copies
    assert torch.equal(_get(batched, "s", ["k13"])[0], _row(13))  # type: ignore[arg-type]


def test_a_batch_larger_than_the_ring_keeps_its_last_rows() -> None:
    tier = MemoryTier(3 * 16)
    names = [f"k{i}" for i in range(5)]
    tier.put_batch("s", names, torch.stack([_row(i) for i in range(5)]))
    got = _get(tier, "s", names)
    assert [t is not None for t in got] == [False, False, True, True, True]
    assert [t[0].item() for t in got[2:]] == [2, 3, 4]  # type: ignore[index]


def test_a_name_twice_in_a_batch_is_kept_once_and_its_row_reused_later() -> None:
    tier = MemoryTier(4 * 16)
    tier.put_batch("s", ["a", "b", "a"], torch.stack([_row(1), _row(2), _row(3)]))
    assert tier.held == 2 * 16  # a's first row only
    assert [t[0].item() for t in _get(tier, "s", ["a", "b"])] == [1, 2]  # type: ignore[index]
    # Past the budget, a batch crosses from appended rows to the oldest ones.
    tier.put_batch("s", ["c", "d", "e", "f"], torch.stack([_row(i) for i in range(4, 8)]))
    got = _get(tier, "s", ["a", "b", "c", "d", "e", "f"])
    assert [t is not None for t in got] == [False, False, True, True, True, True]
    assert tier.held == 4 * 16


def test_entries_read_back_fill_free_rows_and_push_out_nothing() -> None:
    tier = MemoryTier(3 * 16)
    tier.put_batch("s", ["a", "b"], torch.stack([_row(1), _row(2)]), evict=False)
    # One row left: c takes it, d finds none and is not kept.
    tier.put_batch("s", ["c", "d"], torch.stack([_row(3), _row(4)]), evict=False)
    got = _get(tier, "s", ["a", "b", "c", "d"])
    assert [t is not None for t in got] == [True, True, True, False]
    tier.put("s", "e", _row(5))  # a computed feature still takes the oldest row
    assert [t is not None for t in _get(tier, "s", ["a", "e"])] == [False, True]
    tier.put_batch("s", ["f"], _row(6).unsqueeze(0), evict=False)  # wrapped: none free
    assert _get(tier, "s", ["f"]) == [None] and tier.held == 3 * 16
