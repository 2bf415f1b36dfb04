"""The cost model and the planner's choice, against epochs computed by hand.

Profiles here have cuts 0..2. Per chunk of c samples a stage costs c times its per-sample
cost; in order, epoch = (m - 1)·max(stage per chunk) + sum(stage per chunk).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from hapi.errors import InvalidRequest
from hapi.graph import INPUT, RAW
from hapi.plan import (
    LinkProfile,
    PlannerConfig,
    ServerProfile,
    TrainerProfile,
    Workload,
    best_share,
    choose_plan,
    estimate,
)

from ._plan_profiles import NAMES, equal_cores, one_cut, server_profile, trainer_profile


def test_link_bound_the_freeze_cut_wins() -> None:
    link = LinkProfile(bytes_per_s=1e6)
    work = Workload(samples=1000, chunk_size=100)  # 10 chunks of 100
    raw = estimate(RAW, 0.0, server_profile(), trainer_profile(), link, work)
    # Per chunk: server 100·0.001 = 0.1, link 100·100 kB / 1 MB/s = 10, trainer 100·0.010 = 1.
    assert raw.server_s == pytest.approx(1.0)
    assert raw.link_s == pytest.approx(100.0)
    assert raw.trainer_s == pytest.approx(10.0)
    assert raw.epoch_s == pytest.approx(9 * 10 + 11.1)
    assert raw.binding == "link"
    plan = choose_plan(server_profile(), trainer_profile(), link, work, freeze=2, names=NAMES)
    # Cut 2 per chunk: server 100·0.008 = 0.8, link 100·2 kB / 1 MB/s = 0.2, trainer 0.3.
    assert (plan.cut, plan.share) == (2, 0.0)
    assert plan.epoch_s == pytest.approx(9 * 0.8 + 1.3)
    assert plan.binding == "server"
    assert plan.chosen.bytes == pytest.approx(1000 * 2_000)
    assert plan.option(RAW) == raw


def test_fast_link_and_a_slow_server_raw_wins() -> None:
    server = server_profile(decode_s=0.2, head_s=(0.0, 0.010, 0.020))
    trainer = trainer_profile(
        decode_s=0.002, head_s=(0.0, 0.0005, 0.001), tail_s=(0.0015, 0.001, 0.0005)
    )
    work = Workload(samples=1000, chunk_size=100)
    plan = choose_plan(server, trainer, LinkProfile(bytes_per_s=1e9), work, freeze=2)
    # RAW per chunk: server 0.1, link 0.01, trainer 100·0.0035 = 0.35.
    assert plan.cut == RAW
    assert plan.local_share == 1.0
    assert plan.epoch_s == pytest.approx(9 * 0.35 + 0.46)
    assert plan.binding == "trainer"
    freeze_cut = plan.option(2)
    assert freeze_cut is not None and freeze_cut.epoch_s > 5 * plan.epoch_s


def test_fast_link_the_server_decodes_a_share_beside_raw() -> None:
    server = server_profile(decode_s=0.010, head_s=(0.0, 0.010, 0.020))
    trainer = trainer_profile(
        decode_s=0.002, head_s=(0.0, 0.0005, 0.001), tail_s=(0.0015, 0.001, 0.0005)
    )
    work = Workload(samples=1000, chunk_size=100)
    plan = choose_plan(server, trainer, LinkProfile(bytes_per_s=1e9), work, freeze=2)
    # INPUT per chunk: server 1.1 - 1.0·f, trainer 0.15 + 0.2·f: they cross at f = 0.79,
    # 0.8 in whole chunks: L L L L P L L L L P. The first chunk is local: the trainer
    # waits for its read (0.1) and raw bytes (0.01). One local chunk is in flight at a
    # time, each requested when the one before is read: chunk 4, the first pushed down,
    # reaches the server after 4 reads and 4 raw chunks' 0.01 s, at 0.43 s, and the link
    # at 1.53 s (to 1.545 s) while the trainer is free at 0.11 + 4·0.35 = 1.51 s. The
    # next 4 local chunks are read by then; chunk 9 (server 1.96 to 3.06, link to 3.075)
    # is in before the trainer is free, at 3.095 s.
    assert (plan.cut, plan.share) == (INPUT, 0.8)
    assert plan.epoch_s == pytest.approx(1.545 + 0.15 + 4 * 0.35 + 0.15)
    raw = plan.option(RAW)
    assert raw is not None and raw.epoch_s == pytest.approx(9 * 0.35 + 0.46)


def test_hybrid_at_half_halves_the_epoch_of_two_equal_cores() -> None:
    server, trainer, link = equal_cores()
    work = Workload(samples=1000, chunk_size=10)  # 100 chunks
    plan = choose_plan(server, trainer, link, work, freeze=1)
    assert (plan.cut, plan.share) == (1, 0.5)
    # Per chunk: server 10·0.004/2 = 0.02, trainer 10·0.004/2 = 0.02, the link ~0. The
    # first chunk is local and the last pushed down, so neither core waits to fill or
    # drain: only the busy time is left.
    assert plan.epoch_s == pytest.approx(100 * 0.02, rel=1e-6)
    pure, raw = plan.option(1), plan.option(RAW)
    assert pure is not None and raw is not None
    assert pure.epoch_s == pytest.approx(99 * 0.04 + 0.04, rel=1e-6)
    assert raw.epoch_s == pytest.approx(99 * 0.04 + 0.04, rel=1e-6)
    assert plan.epoch_s / pure.epoch_s == pytest.approx(2.0 / 4.0, rel=1e-4)
    assert "% local" in plan.chosen.label


def test_fill_and_drain_depend_on_the_chunks_in_flight() -> None:
    link = LinkProfile(bytes_per_s=1e6)

    # Cut 2 per chunk of 100: server 0.8, link 0.2, trainer 0.3; 4 chunks.
    def epoch(**kw: object) -> float:
        work = Workload(samples=400, chunk_size=100, **kw)  # type: ignore[arg-type]
        return estimate(2, 0.0, server_profile(), trainer_profile(), link, work).epoch_s

    assert epoch() == pytest.approx(3 * 0.8 + 1.3)
    in_order = estimate(
        2, 0.0, server_profile(), trainer_profile(), link, Workload(samples=400, chunk_size=100)
    )
    assert in_order.bound_s == pytest.approx(3.2)
    assert in_order.fill_s == pytest.approx(0.5)  # first chunk's link + last chunk's trainer
    # Two in flight: each is read before the server is done with the next, so no wait.
    assert epoch(prefetch=2) == pytest.approx(3 * 0.8 + 1.3)
    # One in flight: the next chunk is requested when one arrives, so server + link add up.
    assert epoch(prefetch=1) == pytest.approx(3 * (0.8 + 0.2) + 1.3)
    # A per-chunk latency: a full one per request, shared by the 4 in flight.
    slow = estimate(
        2,
        0.0,
        server_profile(),
        trainer_profile(),
        LinkProfile(bytes_per_s=1e6, latency_s=0.4),
        Workload(samples=400, chunk_size=100, prefetch=4),
    )
    assert slow.link_s == pytest.approx(4 * (0.2 + 0.1))


def test_back_to_back_an_epoch_fills_while_the_one_before_drains() -> None:
    link = LinkProfile(bytes_per_s=1e6)

    # Cut 2 per chunk of 100: server 0.8, link 0.2, trainer 0.3; 4 chunks.
    def epoch(**kw: object) -> float:
        work = Workload(samples=400, chunk_size=100, back_to_back=True, **kw)  # type: ignore[arg-type]
        return estimate(2, 0.0, server_profile(), trainer_profile(), link, work).epoch_s

    # The next epoch's first chunk is served while this one's last crosses and trains:
    # from step to step, the server's 4 x 0.8 alone (on its own, 3 x 0.8 + 1.3).
    assert epoch() == pytest.approx(4 * 0.8)
    # One in flight: server and link add up, chunk after chunk, epoch after epoch.
    assert epoch(prefetch=1) == pytest.approx(4 * (0.8 + 0.2))
    # A hybrid at 1/4 at cut 1 (the first chunk of each epoch local): back to back, an
    # epoch is what the second of two takes when they run as one epoch of 8 chunks.
    one = Workload(samples=400, chunk_size=100)
    two = Workload(samples=800, chunk_size=100)
    alone = estimate(1, 0.25, server_profile(), trainer_profile(), link, one).epoch_s
    both = estimate(1, 0.25, server_profile(), trainer_profile(), link, two).epoch_s
    ahead = Workload(samples=400, chunk_size=100, back_to_back=True)
    assert estimate(1, 0.25, server_profile(), trainer_profile(), link, ahead).epoch_s < alone
    # Two epochs of 1/4 run as one of 8 chunks have the same local chunks (0 and 4).
    assert estimate(
        1, 0.25, server_profile(), trainer_profile(), link, ahead
    ).epoch_s == pytest.approx(both - alone)


def test_partial_last_chunk_spreads_over_the_chunks() -> None:
    link = LinkProfile(bytes_per_s=1e6)
    est = estimate(
        2, 0.0, server_profile(), trainer_profile(), link, Workload(samples=250, chunk_size=100)
    )
    assert est.server_s == pytest.approx(250 * 0.008)
    assert est.epoch_s == pytest.approx(250 * 0.008 + (250 / 3) * (0.002 + 0.003))


def test_share_rounds_to_whole_chunks() -> None:
    # Server 0.003 per sample pushed down, 0 local; trainer 0 pushed down, 0.007 local:
    # the lines cross at f = 0.3.
    server = one_cut(head_s=0.002, input_bytes=12_288, raw_bytes=1_000)
    trainer = TrainerProfile(decode_s=0.004, head_s=(0.0, 0.003), tail_s=(0.003, 0.0))
    link = LinkProfile(bytes_per_s=1e12)
    assert best_share(1, server, trainer, link, Workload(samples=100, chunk_size=10)) == 0.3
    # 4 chunks of 10: a pushed chunk is 0.03 s on the server, a local one 0.07 s on the
    # trainer. 1/4: the server's 3·0.03 = 0.09 against the trainer's 0.07 (the local chunk
    # first, so no fill; a pushed chunk last, so no drain); 2/4: the trainer's 2·0.07.
    four = Workload(samples=40, chunk_size=10)
    assert best_share(1, server, trainer, link, four) == 0.25
    assert estimate(1, 0.25, server, trainer, link, four).epoch_s == pytest.approx(0.09)
    assert estimate(1, 0.5, server, trainer, link, four).epoch_s == pytest.approx(0.14)
    # One chunk cannot be split.
    assert best_share(1, server, trainer, link, Workload(samples=10, chunk_size=10)) in (0, 1)


def test_a_local_chunk_on_a_slow_link_leaves_the_server_waiting() -> None:
    server = one_cut(head_s=0.02, input_bytes=150_000, raw_bytes=100_000)
    trainer = TrainerProfile(decode_s=0.002, head_s=(0.0, 0.003), tail_s=(0.004, 0.0))
    link = LinkProfile(bytes_per_s=1e6)
    work = Workload(samples=60, chunk_size=10, prefetch=2)  # 6 chunks, 2 in flight a route
    # Per chunk of 10 at cut 1: pushed, server 0.21, link 0.01, trainer 0; local, the
    # server reads (0), the link carries 1.0 s of raw bytes, the trainer decodes and runs
    # the head in 0.05 s. At 1/6 the first chunk is local; chunks 1 and 2 are requested
    # beside it (the pushed-down window) and done by 0.42 s, but they cross only after
    # its raw bytes, at 1.01 and 1.02 s, and chunk 3 is requested when chunk 1 is read:
    # then the server's chunks 3..5 and the last chunk's link.
    hybrid = estimate(1, 1 / 6, server, trainer, link, work)
    assert hybrid.epoch_s == pytest.approx(1.01 + 3 * 0.21 + 0.01)
    # The stages alone bound it at 1.06 (the server's 5 x 0.21 and the last chunk's
    # link): the hybrid looked faster than the pure cut, which the server holds.
    plan = choose_plan(server, trainer, link, work, freeze=1)
    assert (plan.cut, plan.share) == (1, 0.0)
    assert plan.epoch_s == pytest.approx(6 * 0.21 + 0.01)
    # With 4 pushed-down chunks in flight the server works through the raw chunk's turn
    # (4 x 0.21 of 1.0 s) and waits only for chunk 5's request, at 1.01 s; the hybrid wins.
    four = Workload(samples=60, chunk_size=10, prefetch=4)
    assert estimate(1, 1 / 6, server, trainer, link, four).epoch_s == pytest.approx(1.23)
    assert choose_plan(server, trainer, link, four, freeze=1).share == pytest.approx(1 / 6)
    # With every pushed-down chunk in flight at once nothing waits for a request.
    roomy = Workload(samples=60, chunk_size=10, prefetch=5)
    assert estimate(1, 1 / 6, server, trainer, link, roomy).epoch_s == pytest.approx(1.06)


def test_a_long_epoch_is_extrapolated_from_its_steady_state() -> None:
    link = LinkProfile(bytes_per_s=1e6)
    work = Workload(samples=100_000, chunk_size=100)  # 1,000 chunks: past what is run
    # A pure cut by hand: server 0.8 per chunk holds it, after the first chunk's server
    # and before the last chunk's link and trainer.
    pure = estimate(2, 0.0, server_profile(), trainer_profile(), link, work)
    assert pure.epoch_s == pytest.approx(999 * 0.8 + 1.3)
    # A hybrid, against running all 1,000 chunks one by one.
    long = [
        estimate(1, f, server_profile(), trainer_profile(), link, work).epoch_s for f in (0.25, 0.3)
    ]
    every = [
        estimate(1, f, server_profile(), trainer_profile(), link, work, simulated=10_000).epoch_s
        for f in (0.25, 0.3)
    ]
    assert long == pytest.approx(every, rel=1e-9)


def test_the_trainer_pays_for_the_bytes_it_receives() -> None:
    # A fast link; per sample the server's cut 1 costs 0.007 and sends 50 kB, cut 2 costs
    # 0.008 and sends 2 kB; the trainer's tails 0.004 and 0.003. At 20 ns per byte
    # received (20 ms per MB), cut 1's 50 kB are 1 ms more a sample on the trainer, cut
    # 2's 2 kB 0.04 ms.
    link = LinkProfile(bytes_per_s=1e12)
    work = Workload(samples=1000, chunk_size=100)
    receiving = trainer_profile(receive_s=2e-8)
    est = estimate(1, 0.0, server_profile(), receiving, link, work)
    assert est.trainer_s == pytest.approx(1000 * (0.004 + 50_000 * 2e-8))
    raw = estimate(RAW, 0.0, server_profile(), receiving, link, work)
    assert raw.trainer_s == pytest.approx(1000 * (0.004 + 0.006 + 100_000 * 2e-8))
    # A local chunk's raw bytes cost the trainer as much as RAW's.
    hybrid = estimate(2, 0.5, server_profile(), receiving, link, work)
    local = 0.004 + 0.003 + 0.003 + 100_000 * 2e-8
    assert hybrid.trainer_s == pytest.approx(500 * (0.003 + 2_000 * 2e-8) + 500 * local)
    # Per sample, the slowest stage of each pure cut. Receiving for free: INPUT's trainer
    # (0.006) beats cut 1's server (0.007). At 20 ns a byte INPUT's 150 kB make its
    # trainer 0.009, and cut 1 wins; at 100 ns cut 1's trainer is 0.009 too, and cut 2
    # (its server's 0.008) wins.
    pure = PlannerConfig(hybrid=False)

    def chosen(trainer: TrainerProfile) -> int:
        return choose_plan(server_profile(), trainer, link, work, freeze=2, config=pure).cut

    assert chosen(trainer_profile()) == INPUT
    assert chosen(receiving) == 1
    assert chosen(trainer_profile(receive_s=1e-7)) == 2


def test_the_server_pays_for_serving_raw_objects_beside_its_heads() -> None:
    # Serving an object raw - reading it and encoding it onto the wire - costs the server
    # 2 ms, not its 1 ms read: a hybrid's local chunks cost its core that much each.
    link = LinkProfile(bytes_per_s=1e12)
    work = Workload(samples=1000, chunk_size=100)
    server = server_profile(raw_s=0.002)
    hybrid = estimate(2, 0.5, server, trainer_profile(), link, work)
    assert hybrid.server_s == pytest.approx(500 * (0.001 + 0.004 + 0.003) + 500 * 0.002)
    assert estimate(RAW, 0.0, server, trainer_profile(), link, work).server_s == pytest.approx(2.0)
    # Not measured apart: the read stands for it (500 ms for the same local share).
    unmeasured = estimate(2, 0.5, server_profile(), trainer_profile(), link, work)
    assert hybrid.server_s - unmeasured.server_s == pytest.approx(500 * (0.002 - 0.001))
    assert server.scaled(2.0).compute_s(RAW) == pytest.approx(0.004)


def test_the_server_pays_for_every_byte_it_sends() -> None:
    # Sending costs the server's core 10 ms per MB beyond what its chunks report: 1 ms
    # for each 100 KB object served raw, 0.02 ms for each 2 KB feature.
    link = LinkProfile(bytes_per_s=1e12)
    work = Workload(samples=1000, chunk_size=100)
    server = server_profile(raw_s=0.002, send_s=1e-8)
    hybrid = estimate(2, 0.5, server, trainer_profile(), link, work)
    assert hybrid.server_s == pytest.approx(500 * (0.008 + 0.00002) + 500 * (0.002 + 0.001))
    assert estimate(RAW, 0.0, server, trainer_profile(), link, work).server_s == pytest.approx(3.0)
    assert estimate(INPUT, 0.0, server, trainer_profile(), link, work).server_s == pytest.approx(
        1000 * (0.005 + 0.0015)
    )
    # What the chunks report, which the re-planner weighs them against, leaves it out.
    assert server.compute_s(RAW) == 0.002
    assert server.scaled(2.0).serve_s(RAW) == pytest.approx(0.006)


_cost = st.floats(0.0, 0.01)


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(_cost, min_size=8, max_size=8),
    sizes=st.lists(st.integers(0, 200_000), min_size=3, max_size=3),
    bytes_per_s=st.floats(1e4, 1e10),
    samples=st.integers(1, 500),
    chunk_size=st.integers(1, 64),
    prefetch=st.integers(1, 4),
    receive=st.floats(0.0, 1e-7),
)
@pytest.mark.slow
def test_best_share_is_the_best_whole_chunk_share(
    costs: list[float],
    sizes: list[int],
    bytes_per_s: float,
    samples: int,
    chunk_size: int,
    prefetch: int,
    receive: float,
) -> None:
    read, decode, head, tdecode, thead, tail_in, tail_cut, latency = costs
    server = ServerProfile(
        read_s=read,
        decode_s=decode,
        head_s=(0.0, head),
        out_bytes=(sizes[0], sizes[1]),
        memory_bytes=(0, 0),
        raw_bytes=sizes[2],
    )
    trainer = TrainerProfile(
        decode_s=tdecode, head_s=(0.0, thead), tail_s=(tail_in, tail_cut), receive_s=receive
    )
    link = LinkProfile(bytes_per_s=bytes_per_s, latency_s=latency)
    work = Workload(samples=samples, chunk_size=chunk_size, prefetch=prefetch)
    m = work.chunks
    for cut in (INPUT, 1):
        best = best_share(cut, server, trainer, link, work)
        chosen = estimate(cut, best, server, trainer, link, work).epoch_s
        # The trivial reference: every whole-chunk share, tried one by one. Up to 64 chunks
        # best_share tries them all too; beyond, a grid and the best grid point's
        # neighbourhood, held here to the planner's tolerance (a narrow dip between grid
        # points can be missed).
        brute = min(estimate(cut, j / m, server, trainer, link, work).epoch_s for j in range(m + 1))
        if m <= 64:
            assert chosen == pytest.approx(brute, rel=1e-9, abs=1e-12)
        else:
            assert brute <= chosen <= brute * 1.02 + 1e-12
        assert (best * m) == pytest.approx(round(best * m))


def test_a_link_observed_without_its_latency() -> None:
    link = LinkProfile.observed(1_000_000, 1.2, requests=2, latency_s=0.1)
    assert link.bytes_per_s == pytest.approx(1e6)
    assert link.latency_s == 0.1
    with pytest.raises(InvalidRequest, match="transfer more bytes"):
        LinkProfile.observed(1000, 0.1, requests=2, latency_s=0.1)


def test_wire_dtype_scales_feature_bytes_only() -> None:
    half = server_profile().with_wire_dtype("bf16")
    assert half.out_bytes == (75_000, 25_000, 1_000)
    assert half.raw_bytes == server_profile().raw_bytes
    assert half.wire_bytes(RAW) == 100_000


def test_the_model_keeps_the_loaders_local_window() -> None:
    from hapi.client.pipeline.loader import HYBRID_LOCAL_WINDOW

    assert Workload(samples=1).local_window == HYBRID_LOCAL_WINDOW


def test_a_hybrids_local_chunk_waits_for_the_one_before_it_to_be_read() -> None:
    # The hybrid of `test_fast_link_the_server_decodes_a_share_beside_raw` (L L L L P ...)
    # with 4 local chunks in flight: the server reads chunks 0-3 back to back and has
    # chunk 4 at 0.4 s (not 0.43 s), on the link to 1.515 s, while the trainer is free at
    # 1.51 s: 5 ms later than that, then as before. The stages' busy times are the same.
    server = server_profile(decode_s=0.010, head_s=(0.0, 0.010, 0.020))
    trainer = trainer_profile(
        decode_s=0.002, head_s=(0.0, 0.0005, 0.001), tail_s=(0.0015, 0.001, 0.0005)
    )
    link = LinkProfile(bytes_per_s=1e9)
    one = Workload(samples=1000, chunk_size=100)
    four = Workload(samples=1000, chunk_size=100, local_window=4)
    slow, fast = (estimate(INPUT, 0.8, server, trainer, link, w) for w in (one, four))
    assert fast.epoch_s == pytest.approx(1.515 + 0.15 + 4 * 0.35 + 0.15)
    assert slow.epoch_s == pytest.approx(fast.epoch_s + 0.03)
    assert (slow.server_s, slow.link_s, slow.trainer_s) == (
        fast.server_s,
        fast.link_s,
        fast.trainer_s,
    )
