"""Spreading a plan's local chunks over the epoch (`assign`): evenly, deterministically,
and from the chunk where a change of share took effect."""

from __future__ import annotations

import itertools

import pytest

from hapi.plan import assign


def test_assign_spreads_local_chunks_evenly_and_deterministically() -> None:
    ids = list(range(20))
    local = assign(ids, 0.25)
    assert sum(local) == 5
    positions = [i for i, is_local in enumerate(local) if is_local]
    assert all(b - a == 4 for a, b in itertools.pairwise(positions))
    assert assign(ids, 0.25) == local
    assert assign([f"chunk-{i}" for i in ids], 0.25) == local  # only positions matter
    assert sum(assign(ids, 0.3)) == 6
    assert assign(ids, 0.0) == (False,) * 20
    assert assign(ids, 1.0) == (True,) * 20
    assert assign([], 0.5) == ()
    with pytest.raises(ValueError, match="local share"):
        assign(ids, 1.5)


def test_assign_starts_a_hybrid_local_and_ends_it_pushed_down() -> None:
    # The ends the cost model charges: the trainer starts at once on raw bytes, and after
    # the server's last chunk only a pushed chunk's short tail is left.
    assert assign(range(4), 0.5) == (True, False, True, False)
    assert assign(range(4), 0.25) == (True, False, False, False)
    assert assign(range(4), 0.75) == (True, True, True, False)
    for m in range(2, 30):
        for j in range(1, m):
            local = assign(range(m), j / m)
            assert sum(local) == j and local[0] and not local[-1], (m, j)


def test_assign_after_a_mid_epoch_change_touches_only_the_rest() -> None:
    ids = list(range(40))
    before = assign(ids, 0.5)
    issued = 10
    rest = assign(ids[issued:], 0.2)
    combined = before[:issued] + rest
    assert combined[:issued] == before[:issued]
    assert sum(rest) == round(0.2 * 30)
    # The local chunks of the rest are spread, not bunched at its start or end.
    positions = [i for i, is_local in enumerate(rest) if is_local]
    assert max(b - a for a, b in itertools.pairwise(positions)) <= 5
