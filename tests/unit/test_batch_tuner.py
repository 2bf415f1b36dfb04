"""The server's batch size, chosen by the head's measured time a sample."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hapi.server.chunks._batch_tuner import START, TRIES, BatchTuner


def _run(tuner: BatchTuner, per_sample: Callable[[int], float], chunk: int = 256) -> list[int]:
    """Feed the tuner full batches timed by `per_sample` until it settles; the sizes it
    asked for, in order."""
    asked = []
    for _ in range(100):
        tuner.chunk(chunk)
        if tuner.settled:
            break
        size = min(tuner.size, chunk)
        asked.append(tuner.size)
        tuner.record(size, per_sample(size) * size)
    assert tuner.settled
    return asked


def test_it_climbs_while_larger_batches_are_faster_and_stops_past_the_best() -> None:
    # A small input: a batch's fixed cost dominates up to 128, then caches spill.
    cost = {8: 3.0, 16: 2.0, 32: 1.4, 64: 1.1, 128: 1.0, 256: 1.2}
    tuner = BatchTuner(most=256)
    asked = _run(tuner, cost.__getitem__)
    assert tuner.size == 128
    assert asked[0] == START and set(asked) == {32, 64, 128, 256}
    assert tuner.seconds_per_sample()[128] == pytest.approx(1.0)


def test_it_goes_down_where_smaller_batches_are_faster() -> None:
    cost = {8: 1.2, 16: 1.0, 32: 1.1, 64: 1.2, 128: 1.3, 256: 1.4}
    tuner = BatchTuner(most=256)
    _run(tuner, cost.__getitem__)
    assert tuner.size == 16


def test_differences_within_noise_keep_the_size_found_first() -> None:
    tuner = BatchTuner(most=256)
    _run(tuner, lambda size: 1.0 - 0.01 * (size == 64))  # 64 is 1% faster: noise
    assert tuner.size == START


def test_it_never_asks_past_the_servers_batch_size_nor_the_longest_chunk() -> None:
    capped = BatchTuner(most=48)
    asked = _run(capped, lambda size: 1.0 / size)  # larger is always faster
    assert max(asked) == 48 and capped.size == 48  # not 64: past the server's bound

    short = BatchTuner(most=256)
    asked = _run(short, lambda size: 1.0 / size, chunk=40)
    assert max(asked) == 40 and short.size == 40  # the chunk, whole


def test_a_short_first_chunk_does_not_stand_for_the_size() -> None:
    tuner = BatchTuner(most=256)
    tuner.chunk(8)
    tuner.record(8, 8 * 5.0)  # 8 keys, whole: a batch of 8, slow a sample
    cost = {8: 5.0, 16: 2.0, 32: 1.0, 64: 1.2, 128: 1.3, 256: 1.4}
    _run(tuner, cost.__getitem__)
    assert tuner.size == 32 and tuner.seconds_per_sample()[32] == pytest.approx(1.0)


def test_longer_chunks_after_short_ones_let_the_walk_go_on() -> None:
    # A planner's probe chunks (8 keys) come first; the job's chunks of 256 after them.
    cost = {8: 3.0, 16: 2.0, 32: 1.4, 64: 1.1, 128: 1.0, 256: 1.2}
    tuner = BatchTuner(most=256)
    _run(tuner, cost.__getitem__, chunk=8)
    assert tuner.size == 8
    _run(tuner, cost.__getitem__, chunk=256)
    assert tuner.size == 128


def test_batches_that_are_not_full_say_nothing() -> None:
    tuner = BatchTuner(most=256)
    tuner.chunk(256)
    for _ in range(TRIES * 3):
        tuner.record(17, 1.0)  # a chunk's last, or a smaller grant
    assert tuner.size == START and not tuner.seconds_per_sample()
