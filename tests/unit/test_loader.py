"""The loader's parts without a server: rebatching across cuts, routing, retrying."""

from __future__ import annotations

import threading

import pytest
import tenacity
import torch

from hapi.client.pipeline.fetch import Flow
from hapi.client.pipeline.rebatch import Piece, Rebatcher
from hapi.client.pipeline.routing import PlanCell, Route, Router
from hapi.client.servers.retry import RetryPolicy
from hapi.errors import (
    CorruptObject,
    InvalidCut,
    InvalidRequest,
    ServerUnavailable,
    SessionNotFound,
    StoreUnavailable,
)
from hapi.graph import INPUT, RAW, ModelSpec, build_model, trace
from hapi.plan import (
    LinkProfile,
    ServerProfile,
    TrainerProfile,
    Workload,
    assign,
    choose_plan,
)


def _piece(chunk: int, cut: int, start: int, n: int, width: int = 3) -> Piece:
    keys = [f"k{i}" for i in range(start, start + n)]
    features = torch.arange(start, start + n, dtype=torch.float32)[:, None].repeat(1, width)
    return Piece(chunk, cut, keys, torch.arange(start, start + n), features * (cut + 2))


def test_batches_have_the_training_size_whatever_the_pieces() -> None:
    rebatcher = Rebatcher()
    for chunk, (start, n) in enumerate([(0, 3), (3, 7), (10, 1), (11, 6)]):
        rebatcher.add(_piece(chunk, 5, start, n))
    batches = []
    while len(rebatcher):
        batches.append(rebatcher.take(4))
    assert [len(b) for b in batches] == [4, 4, 4, 4, 1]
    assert [k for b in batches for k in b.keys] == [f"k{i}" for i in range(17)]
    assert batches[0].parts == ((0, 3), (1, 1))
    assert batches[2].parts == ((1, 2), (2, 1), (3, 1))
    assert all(b.cut == 5 for b in batches)


def test_a_batch_across_a_change_of_cut_is_carried_to_the_later_cut() -> None:
    calls: list[tuple[int, int, int]] = []

    def convert(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        calls.append((len(x), start, end))
        return x / (start + 2) * (end + 2)  # _piece scales features by (cut + 2)

    rebatcher = Rebatcher(convert)
    rebatcher.add(_piece(0, 7, 0, 3))  # before the re-plan: cut 7
    rebatcher.add(_piece(1, 4, 3, 3))  # after it: cut 4, lower
    mixed = rebatcher.take(4)
    assert mixed.cut == 7 and calls == [(1, 4, 7)]
    torch.testing.assert_close(mixed.features, _piece(0, 7, 0, 4).features)
    rest = rebatcher.take(4)
    assert rest.cut == 4 and len(rest) == 2 and len(calls) == 1  # no mix, no conversion


def test_mixed_cuts_without_a_converter_are_refused() -> None:
    rebatcher = Rebatcher()
    rebatcher.add(_piece(0, 2, 0, 2))
    rebatcher.add(_piece(1, 3, 2, 2))
    with pytest.raises(InvalidCut, match="mixes cuts"):
        rebatcher.take(4)


def test_the_frozen_segment_carries_features_exactly_between_cuts() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18", num_classes=3)).eval(), (3, 32, 32))
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        for start, end in [(0, 5), (3, 10), (5, 14), (6, 6)]:
            at_start = graph.head(start)(x) if start else x
            torch.testing.assert_close(graph.segment(start, end)(at_start), graph.head(end)(x))
    with pytest.raises(InvalidCut, match="forward"):
        graph.segment(5, 3)


def test_a_hybrid_router_spreads_local_chunks_as_assign_does() -> None:
    router = Router(9, 0.25)
    router.start(epoch=0, chunks=12)
    routes = [router.route(i) for i in range(12)]
    assert tuple(r.local for r in routes) == assign(range(12), 0.25)
    assert sum(r.local for r in routes) == 3
    assert {r.wire_cut for r in routes} == {RAW, 9} and {r.cut for r in routes} == {9}


def test_a_change_of_plan_applies_to_chunks_not_yet_issued() -> None:
    events = []
    router = Router(9, 0.0, record=events.append)
    router.start(epoch=3, chunks=8)
    first = [router.route(i) for i in range(3)]
    router.cell.publish(6, 0.5, reason="test")
    assert router.in_force == (6, 0.5)
    rest = [router.route(i) for i in range(3, 8)]
    assert all(not r.local and r.cut == 9 for r in first)
    assert all(r.cut == 6 for r in rest)
    # The share is spread over the chunks from the change on.
    assert tuple(r.local for r in rest) == assign(range(5), 0.5)
    (event,) = events
    assert (event.kind, event.epoch, event.chunk) == ("replan", 3, 3)
    assert event.data["to"] == {"cut": 6, "share": 0.5}


def test_a_change_made_after_the_last_chunk_is_recorded_for_the_next_loop() -> None:
    events = []
    router = Router(9, 0.0, record=events.append)
    router.start(epoch=1, chunks=2)
    [router.route(i) for i in range(2)]
    router.cell.publish(6, 0.0, reason="test")
    assert router.applied == (9, 0.0) and router.in_force == (6, 0.0)
    assert not events
    router.settle()
    (event,) = events
    assert event.kind == "replan" and event.message.startswith("for the next loop")
    assert router.applied == router.in_force == (6, 0.0)


def test_a_chunk_routed_but_not_yet_issued_takes_a_change_made_meanwhile() -> None:
    # The loader routes chunk 2 when chunk 1 is issued, and issues it when its window has
    # room; a re-plan in between applies from chunk 2, not from chunk 3.
    events = []
    router = Router(9, 0.0, record=events.append)
    router.start(epoch=0, chunks=6)
    assert [router.route(i).cut for i in range(3)] == [9, 9, 9]
    assert not router.changing
    router.cell.publish(6, 0.0, reason="test")
    assert router.changing
    assert router.route(2) == Route(local=False, cut=6)
    assert not router.changing
    assert [router.route(i).cut for i in range(3, 6)] == [6, 6, 6]
    (event,) = events
    assert event.chunk == 2


def test_a_chunk_in_flight_follows_a_change_of_cut_or_a_fall_of_the_share() -> None:
    router = Router(9, 0.5)
    router.start(epoch=0, chunks=4)
    routes = [router.route(i) for i in range(2)]
    local, pushed = sorted(routes, key=lambda r: not r.local)
    assert (local, pushed) == (Route(local=True, cut=9), Route(local=False, cut=9))
    assert router.reroute(pushed) == pushed and router.reroute(local) == local  # no change
    router.cell.publish(12, 0.75, reason="test")  # a later cut, a larger share
    assert router.reroute(pushed) == Route(local=False, cut=12)
    assert router.reroute(local) == local  # the share rose: the next chunks carry it
    router.cell.publish(12, 0.25, reason="test")  # the share fell: raw bytes in flight go pushed
    assert router.reroute(local) == Route(local=False, cut=12)
    router.cell.publish(RAW, reason="test")
    assert router.reroute(pushed) == Route(local=True, cut=INPUT)
    assert router.reroute(local) == local


def test_a_change_of_plan_recalls_the_streams_in_flight_only_when_it_moves_them() -> None:
    recalls: list[tuple[int, float]] = []

    def recall() -> list[str]:
        recalls.append(router.in_force)
        return []

    router = Router(9, 0.5, recall=recall)
    router.start(epoch=0, chunks=4)
    router.route(0)
    router.cell.publish(9, 0.75, reason="test")  # the share rose: the chunks in flight stay
    router.cell.publish(12, 0.75, reason="test")  # a new cut: the pushed-down chunks move
    assert recalls == [(12, 0.75)]
    router.route(1)  # (12, 0.75) applies
    router.cell.publish(12, 0.5, reason="test")  # the share fell: the local chunks move
    router.route(2)
    router.cell.publish(RAW, reason="test")  # every chunk goes local
    router.route(3)
    router.cell.publish(RAW, reason="test")  # no change
    assert recalls == [(12, 0.75), (12, 0.5), (RAW, 0.0)]


@pytest.mark.parametrize("link_bytes_per_s, moves", [(1e6, True), (1e7, False)])
def test_under_a_plan_a_chunk_in_flight_moves_only_when_the_bytes_saved_pay(
    link_bytes_per_s: float, moves: bool
) -> None:
    # From cut 1 (50 KB a sample) to cut 2 (2 KB) the server computes the keys again
    # (31 ms a sample): worth it where 48 KB take 48 ms on the link, not where they take
    # 4.8 ms - the chunk's bytes at cut 1 cross faster than its recompute at cut 2.
    server = ServerProfile(
        read_s=0.001, decode_s=0.010, head_s=(0.0, 0.010, 0.020),
        out_bytes=(150_000, 50_000, 2_000), memory_bytes=(0, 0, 0), raw_bytes=100_000,
    )  # fmt: skip
    trainer = TrainerProfile(decode_s=0.002, head_s=(0.0, 0.0, 0.0), tail_s=(0.0, 0.0, 0.0))
    link = LinkProfile(bytes_per_s=link_bytes_per_s)
    plan = choose_plan(server, trainer, link, Workload(samples=640, chunk_size=64), freeze=2)
    plan = plan.with_choice(1, 0.0, reason="test")
    router = Router(PlanCell(1, plan=plan))
    router.start(epoch=0, chunks=4)
    pushed = router.route(0)
    router.cell.publish(2, 0.0, reason="test", plan=plan.with_choice(2, 0.0, reason="test"))
    assert router.reroute(pushed) == (Route(local=False, cut=2) if moves else pushed)


def test_the_baseline_routes_every_chunk_local_at_the_input() -> None:
    router = Router(RAW)
    router.start(epoch=0, chunks=4)
    assert {router.route(i) for i in range(4)} == {router.route(0)}
    assert router.route(0).local and router.route(0).cut == INPUT


@pytest.mark.parametrize(("cut", "share"), [(RAW, 0.5), (3, 1.5), (3, -0.1), (-2, 0.0)])
def test_bad_plans_are_refused(cut: int, share: float) -> None:
    with pytest.raises(InvalidRequest):
        Router(cut, share)


def _failing(errors: list[Exception]):  # type: ignore[no-untyped-def]
    calls = []

    def attempt() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "done"

    return attempt, calls


def test_transient_failures_are_retried_and_reported() -> None:
    attempt, calls = _failing(
        [ServerUnavailable("down"), StoreUnavailable("store"), SessionNotFound("gone")]
    )
    seen: list[tuple[str, float]] = []

    def on_retry(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        seen.append((type(state.outcome.exception()).__name__, state.next_action.sleep))

    policy = RetryPolicy(budget_s=30, initial_s=0.001, max_wait_s=0.002)
    assert policy.retrying(on_retry=on_retry)(attempt) == "done"
    assert len(calls) == 4
    assert [name for name, _ in seen] == [
        "ServerUnavailable",
        "StoreUnavailable",
        "SessionNotFound",
    ]
    assert seen[-1][1] == 0.0  # a re-opened session is retried at once


def test_a_bad_object_is_not_retried() -> None:
    attempt, calls = _failing([CorruptObject("bad jpeg")])
    with pytest.raises(CorruptObject):
        RetryPolicy(budget_s=30).retrying()(attempt)
    assert len(calls) == 1


def test_retries_stop_at_the_cap_and_a_zero_budget_never_retries() -> None:
    attempt, calls = _failing([ServerUnavailable(str(i)) for i in range(5)])
    with pytest.raises(ServerUnavailable, match="2"):
        RetryPolicy(retries=2, initial_s=0.0, max_wait_s=0.0).retrying()(attempt)
    assert len(calls) == 3
    attempt, calls = _failing([ServerUnavailable("down")])
    with pytest.raises(ServerUnavailable):
        RetryPolicy(budget_s=0).retrying()(attempt)
    assert len(calls) == 1


def test_a_stopped_epoch_cuts_a_backoff_short() -> None:
    stop = threading.Event()
    stop.set()
    attempt, calls = _failing([ServerUnavailable("down")] * 3)
    # A 1000 s backoff returns at once once the epoch is over (the caller then gives up).
    policy = RetryPolicy(budget_s=3000, retries=1, initial_s=1000, max_wait_s=1000)
    with pytest.raises(ServerUnavailable):
        policy.retrying(stop=stop)(attempt)
    assert len(calls) == 2


def test_a_released_flow_wakes_its_waiters_and_keeps_no_events_of_its_own() -> None:
    flows = [Flow(i, [f"k{i}"], [0], Route(local=False, cut=5), None, None)  # type: ignore[arg-type]
             for i in range(2)]  # fmt: skip
    # The next chunk on its server waits for its read; the chunk is trained and kept
    # before its reading thread says the read is over.
    waiting = flows[0].read_done
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: waiting.wait() and woke.set(), daemon=True)
    waiter.start()
    for flow in flows:
        flow.kept.set()
        flow.release()
    assert woke.wait(10)
    waiter.join()
    flows[0].read_done.set()  # the reading thread's own word, after: harmless
    # An epoch keeps its flows to the end: released, they share one Event (an Event of
    # their own was ten objects each full garbage collection walked).
    assert flows[0].kept is flows[1].kept is flows[1].read_done
    assert flows[0].kept.is_set() and flows[0].keys == [] and not flows[0].remaining


def test_a_chunks_link_time_is_a_lower_bound_when_the_server_was_done_first() -> None:
    flow = Flow(0, ["k0"], [0], Route(local=False, cut=5), None, None)  # type: ignore[arg-type]
    flow.bytes, flow.server_s, flow.queue_s = 1000, 0.2, 0.05
    # Its turn came 0.1 s after it was issued, with 0.15 s of the server's work left: its
    # bytes were made during its turn, and its stream's time less that wait is the link's.
    flow.turn, flow.read_end = flow.issued + 0.1, flow.issued + 0.5
    assert not flow.link_buffered
    assert flow.link_s == pytest.approx(0.4 - 0.15)
    # Its turn came after the server was done: its bytes could wait in the buffers while
    # the chunk before it was read, so the link's time on it is only a lower bound.
    flow.turn, flow.read_end = flow.issued + 0.5, flow.issued + 0.51
    assert flow.link_buffered
    assert flow.link_s == pytest.approx(0.01)
    read = flow.read_measurement()
    assert read.transfer_buffered and read.transfer_s == pytest.approx(0.01)


def test_a_new_plan_is_heard_applied_once_when_its_first_chunk_is_routed() -> None:
    heard: list[tuple[int, float]] = []
    router = Router(PlanCell(9, 0.0), applied=lambda v: heard.append((v.cut, v.share)))
    router.start(epoch=0, chunks=6)
    router.route(0)
    router.cell.publish(6, 0.5, reason="test")
    assert heard == []  # published, no chunk issued by it yet
    router.route(1)
    router.route(2)
    assert heard == [(6, 0.5)]
    router.cell.publish(7, 0.0, reason="test")
    router.settle()  # the loop ended before a chunk went by it: the next loop's
    assert heard == [(6, 0.5), (7, 0.0)]
