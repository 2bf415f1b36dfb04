"""A stage too idle to tell keeps its profiled rate: fixed costs are not a slower stage."""

from __future__ import annotations

from hapi.plan import (
    LinkProfile,
    PlannerConfig,
    ReadMeasurement,
    ReplanConfig,
    Replanner,
    ServerProfile,
    TrainerProfile,
    TrainMeasurement,
    Workload,
    choose_plan,
)

# A server-bound plan at the last cut: 2 KB per sample on the link, one layer to train.
SERVER = ServerProfile(
    read_s=0.0005,
    decode_s=0.005,
    head_s=(0.0, 0.01, 0.02),
    out_bytes=(150_000, 50_000, 2_000),
    memory_bytes=(0, 0, 0),
    raw_bytes=100_000,
)
TRAINER = TrainerProfile(decode_s=0.004, head_s=(0.0, 0.008, 0.015), tail_s=(0.015, 0.007, 1e-5))
LINK = LinkProfile(bytes_per_s=1.25e6)  # 10 Mbit/s
WORK = Workload(samples=1024, chunk_size=16)
PURE = PlannerConfig(hybrid=False)


def _chunk(
    plan_cut: int, *, trainer_s: float, transfer_s: float
) -> tuple[ReadMeasurement, TrainMeasurement]:
    """A chunk's read and its training, observed together."""
    n = 16
    read = ReadMeasurement(
        samples=n,
        bytes=n * SERVER.out_bytes[plan_cut],
        cut=plan_cut,
        server_s=n * SERVER.compute_s(plan_cut),
        transfer_s=transfer_s,
    )
    return read, TrainMeasurement(samples=n, cut=plan_cut, trainer_s=trainer_s)


def test_an_idle_trainer_measuring_its_fixed_costs_changes_nothing() -> None:
    plan = choose_plan(SERVER, TRAINER, LINK, WORK, freeze=2, config=PURE)
    assert (plan.cut, plan.share, plan.binding) == (2, 0.0, "server")
    replanner = Replanner(plan, ReplanConfig(min_chunks=1, planner=PURE))
    # The tail of one layer costs 0.16 ms per chunk in the profile; the job's step (loss,
    # optimizer, bookkeeping) measures 1 ms: 6x, and still 0.2% of the server's 0.4 s.
    for _ in range(10):
        change = replanner.observe(*_chunk(2, trainer_s=0.001, transfer_s=0.026))
        assert change is None
    assert replanner.scales()["trainer"] == 1.0


def test_a_stage_that_grows_busy_is_watched_again() -> None:
    plan = choose_plan(SERVER, TRAINER, LINK, WORK, freeze=2, config=PURE)
    replanner = Replanner(plan, ReplanConfig(min_chunks=2, planner=PURE))
    # The link drops to a tenth: 0.26 s per chunk, 60% of the server's time, and moves.
    changes = [replanner.observe(*_chunk(2, trainer_s=0.0002, transfer_s=0.26)) for _ in range(4)]
    assert replanner.scales()["link"] > 5
    assert any(c is not None for c in changes)
