"""The planner's choice among options: ties, a re-plan's stability, the freeze point, and
profiles that round-trip and refuse bad values."""

from __future__ import annotations

import json

import pytest

from hapi.errors import InvalidRequest
from hapi.graph import INPUT, RAW
from hapi.plan import (
    LinkProfile,
    PlannerConfig,
    ProfileKey,
    ServerProfile,
    TrainerProfile,
    Workload,
    choose_plan,
    estimate,
)

from ._plan_profiles import NAMES, server_profile, trainer_profile


def test_a_first_plan_takes_the_fastest_and_a_replan_keeps_the_plan_in_force_among_ties() -> None:
    # Server-bound; cut 2's head costs 0.1% more than cut 1's, so cut 1 is a hair faster.
    server = server_profile(read_s=0.0, decode_s=0.0, head_s=(0.0, 0.002, 0.002002))
    trainer = trainer_profile(decode_s=0.01, head_s=(0.0, 0.004, 0.004), tail_s=(0.004, 0.0, 0.0))
    work = Workload(samples=1000, chunk_size=100)
    link = LinkProfile(bytes_per_s=1e12)
    pure = PlannerConfig(hybrid=False)
    first = choose_plan(server, trainer, link, work, freeze=2, config=pure)
    assert first.cut == 1 and "chosen over" not in first.reason
    # Re-planning keeps the plan in force among ties, though another is a hair faster.
    slower = server_profile(read_s=0.0, decode_s=0.0, head_s=(0.0, 0.002002, 0.002))
    kept = choose_plan(slower, trainer, link, work, freeze=2, config=pure, current=first)
    assert kept.cut == 1
    assert "chosen over cut 2 2" in kept.reason and "within tolerance, the plan in force" in (
        kept.reason
    )
    # Beyond the tolerance it moves.
    much = server_profile(read_s=0.0, decode_s=0.0, head_s=(0.0, 0.0024, 0.002))
    assert choose_plan(much, trainer, link, work, freeze=2, config=pure, current=first).cut == 2
    # An exact tie goes to the simpler option (the higher cut), whatever the order.
    tie = server_profile(read_s=0.0, decode_s=0.0, head_s=(0.0, 0.002, 0.002))
    assert choose_plan(tie, trainer, link, work, freeze=2, config=pure).cut == 2


def test_a_hybrid_one_percent_faster_wins_a_first_plan_not_a_replan() -> None:
    server = ServerProfile(
        read_s=0.0,
        decode_s=0.001,
        head_s=(0.0, 0.003),
        out_bytes=(12_288, 1_000),
        memory_bytes=(0, 0),
        raw_bytes=1_000,
    )
    trainer = TrainerProfile(decode_s=0.001, head_s=(0.0, 0.003), tail_s=(0.0079, 0.0039))
    link = LinkProfile(bytes_per_s=1e12)
    work = Workload(samples=100_000, chunk_size=100)  # 1000 chunks: shares of 0.1%
    first = choose_plan(server, trainer, link, work, freeze=1)
    assert first.cut == 1 and 0.0 < first.share < 0.02
    pure = choose_plan(server, trainer, link, work, freeze=1, config=PlannerConfig(hybrid=False))
    assert (pure.cut, pure.share) == (1, 0.0)
    assert pure.epoch_s * 0.98 < first.epoch_s < pure.epoch_s
    # The pure cut in force, within tolerance of the hybrid, is kept when re-planning.
    kept = choose_plan(server, trainer, link, work, freeze=1, current=pure)
    assert (kept.cut, kept.share) == (1, 0.0)


def test_the_plan_explains_itself() -> None:
    plan = choose_plan(
        server_profile(),
        trainer_profile(),
        LinkProfile(bytes_per_s=1e6),
        Workload(samples=1000),
        freeze=2,
        names=NAMES,
    )
    text = plan.explain()
    assert text.splitlines()[0] == plan.reason
    assert plan.reason.startswith("cut 2 pool: predicted")
    assert "held by the server" in plan.reason and "RAW" in plan.reason
    assert "* cut 2 pool" in text
    rows = plan.rows()
    assert [r["chosen"] for r in rows].count(True) == 1
    assert {r["option"] for r in rows} >= {"RAW", "INPUT", "cut 1 block1", "cut 2 pool"}
    assert [r["epoch_s"] for r in rows] == sorted(r["epoch_s"] for r in rows)
    assert json.loads(json.dumps(plan.to_dict()))["cut"] == 2


def test_freeze_limits_the_cuts_weighed() -> None:
    plan = choose_plan(
        server_profile(),
        trainer_profile(),
        LinkProfile(bytes_per_s=1e6),
        Workload(samples=1000),
        freeze=1,
    )
    assert max(o.cut for o in plan.options) == 1
    assert plan.cut in (RAW, INPUT, 1)
    assert plan.option(2) is None


def test_profiles_round_trip_through_json() -> None:
    key = ProfileKey.of("sha256:ab", (3, 32, 32), {"ops": [{"op": "resize", "size": 32}]}, "cpu")
    server = server_profile(key=key, wire_dtype="fp16", batch_size=8, raw_s=0.002, send_s=3e-9)
    trainer = trainer_profile(batch_size=32, device="cuda:0")
    link = LinkProfile(bytes_per_s=12.5e6, latency_s=0.002)
    for profile in (server, trainer, link, key):
        data = json.loads(json.dumps(profile.to_dict()))
        assert type(profile).from_dict(data) == profile
    same = ProfileKey.of("sha256:ab", [3, 32, 32], {"ops": [{"size": 32, "op": "resize"}]}, "cpu")
    assert same == key


def test_profiles_refuse_bad_values() -> None:
    with pytest.raises(InvalidRequest, match="one entry per cut"):
        server_profile(out_bytes=(1, 2))
    with pytest.raises(InvalidRequest, match="read_s"):
        server_profile(read_s=-1.0)
    with pytest.raises(InvalidRequest, match="raw_s"):
        server_profile(raw_s=float("nan"))
    with pytest.raises(InvalidRequest, match="send_s"):
        server_profile(send_s=-1e-9)
    with pytest.raises(InvalidRequest, match="wire_dtype"):
        server_profile(wire_dtype="int4")
    with pytest.raises(InvalidRequest, match="no field"):
        ServerProfile.from_dict({**server_profile().to_dict(), "extra": 1})
    with pytest.raises(InvalidRequest, match="missing"):
        TrainerProfile.from_dict({"decode_s": 0.0})
    with pytest.raises(InvalidRequest, match="bytes_per_s"):
        LinkProfile(bytes_per_s=0)
    with pytest.raises(InvalidRequest, match="not profiled"):
        estimate(
            3,
            0.0,
            server_profile(),
            trainer_profile(),
            LinkProfile(bytes_per_s=1),
            Workload(samples=1),
        )
