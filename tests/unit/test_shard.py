"""Data-parallel shards against the trivial reference: one process's batches of B x W."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from hapi.client.pipeline.distributed import Shard, pad
from hapi.errors import InvalidRequest


@given(
    samples=st.integers(0, 200),
    batch=st.integers(1, 9),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_the_ranks_slices_of_each_step_are_the_combined_batch(
    samples: int, batch: int, world: int, seed: int
) -> None:
    order = np.random.default_rng(seed).permutation(samples)
    shards = [Shard(rank=r, world=world).take(order, batch) for r in range(world)]
    steps = Shard(rank=0, world=world).steps(samples, batch)
    combined = [order[i : i + batch * world] for i in range(0, samples, batch * world)]
    assert len(combined) == steps
    for k, global_batch in enumerate(combined):
        # Rank r's k-th training batch (as the loader rebatches its order to `batch`).
        slices = [shard[k * batch : (k + 1) * batch] for shard in shards]
        assert np.array_equal(np.concatenate(slices), global_batch)
        # Never more than one sample apart, so a short last batch spreads over the ranks.
        sizes = [len(s) for s in slices]
        assert max(sizes) - min(sizes) <= 1
    # Every rank's batches before its last are whole: its batches are its slices.
    for shard in shards:
        assert len(shard) <= steps * batch
        assert len(shard) >= (steps - 1) * batch
    assert sorted(np.concatenate(shards).tolist()) == list(range(samples))


def test_a_short_last_global_batch_leaves_later_ranks_empty() -> None:
    order = np.arange(9)
    a, b = (Shard(rank=r, world=2).take(order, 4) for r in range(2))
    assert a.tolist() == [0, 1, 2, 3, 8] and b.tolist() == [4, 5, 6, 7]
    # Both ranks take two steps: the second rank steps on an empty batch.
    batches = list(pad([b[:4]], Shard(rank=1, world=2).steps(9, 4), list))
    assert [len(x) for x in batches] == [4, 0]


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="rank"):
        Shard(rank=2, world=2)
