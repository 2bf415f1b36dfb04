"""The job's codec plumbing: which codecs its planner weighs, what each costs on real
features, which one a loop asks for, and that plans and re-plans carry it."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from hapi.client.config.job import JobConfig
from hapi.client.job._plan import trains_cached
from hapi.client.planning.codec_choice import (
    codec_candidates,
    codecs_may_pay,
    job_codecs,
    loop_codec,
    measure_codecs,
)
from hapi.data import Transforms, synth_image
from hapi.errors import InvalidRequest
from hapi.graph import ModelSpec, build_model, trace
from hapi.plan import (
    CodecProfile,
    LinkProfile,
    ServerProfile,
    TrainerProfile,
    Workload,
    choose_codec,
    choose_plan,
)
from hapi.wire import ChunkReport

MBIT = 1e6 / 8


def _config(**options: object) -> JobConfig:
    return JobConfig.from_options(model=ModelSpec(name="resnet18"), dataset="train",
                                  server="grpc://h:1", **options)  # type: ignore[arg-type]  # fmt: skip


def test_auto_weighs_every_lossless_compression_of_the_jobs_dtype() -> None:
    assert codec_candidates("fp32", "auto", lossy=False) == (
        ("fp32", "none"),
        ("fp32", "lz4"),
        ("fp32", "zstd"),
    )
    # A named compression is the user's: the planner does not override it.
    assert codec_candidates("fp32", "none", lossy=False) == (("fp32", "none"),)
    assert codec_candidates("int8", "zstd", lossy=False) == (("int8", "zstd"),)


def test_lossy_wire_adds_fp16_int8_and_fp8_after_the_jobs_dtype() -> None:
    both = codec_candidates("fp32", "zstd", lossy=True)
    assert both == (("fp32", "zstd"), ("fp16", "zstd"), ("int8", "zstd"), ("fp8", "zstd"))
    dtypes = [d for d, _ in codec_candidates("int8", "auto", lossy=True)]
    assert dtypes == ["int8"] * 3 + ["fp16"] * 3 + ["fp8"] * 3


def _codecs(**options: object) -> tuple[tuple[str, str], ...]:
    config = _config(**options)
    return job_codecs(config.wire, cached=trains_cached(config))


def test_a_cached_training_loop_keeps_the_jobs_dtype_under_lossy_wire() -> None:
    # Random augmentation: nothing is cached, so lossy dtypes are weighed.
    assert {d for d, _ in _codecs(lossy_wire=True)} == {
        "fp32",
        "fp16",
        "int8",
        "fp8",
    }
    # Deterministic features go to the trainer's cache, whose entries are keyed by dtype.
    assert {d for d, _ in _codecs(lossy_wire=True, augment=False)} == {"fp32"}
    assert {d for d, _ in _codecs(lossy_wire=True, augment=False, cache=False)} == {
        "fp32",
        "fp16",
        "int8",
        "fp8",
    }
    assert {d for d, _ in _codecs()} == {"fp32"}


def test_the_config_defaults_to_auto_and_refuses_lossy_with_exact() -> None:
    config = _config()
    assert (config.wire.compression, config.wire.lossy) == ("auto", False)
    assert _config(exact=True).wire.compression == "auto"  # lossless: allowed
    with pytest.raises(InvalidRequest, match="exact=True refuses lossy_wire=True"):
        _config(exact=True, lossy_wire=True)
    with pytest.raises(InvalidRequest, match="unknown wire_compression 'gzip': use auto"):
        _config(wire_compression="gzip")


def _server() -> ServerProfile:
    return ServerProfile(
        read_s=0.001,
        decode_s=0.004,
        head_s=(0.0, 0.002, 0.003),
        out_bytes=(600_000, 200_000, 8_000),
        memory_bytes=(150_000, 350_000, 400_000),
        raw_bytes=100_000,
    )


def _trainer() -> TrainerProfile:
    return TrainerProfile(decode_s=0.004, head_s=(0.0, 0.002, 0.003), tail_s=(0.006, 0.004, 0.003))


def _zstd() -> CodecProfile:
    return CodecProfile(
        compression="zstd",
        out_bytes=(400_000, 90_000, 3_000),
        encode_s=(0.003, 0.001, 0.0001),
        decode_s=(0.001, 0.0004, 0.00003),
    )


def test_the_chosen_plan_carries_its_codec_and_a_replan_keeps_it() -> None:
    plain = CodecProfile(out_bytes=(600_000, 200_000, 8_000), encode_s=(0,) * 3, decode_s=(0,) * 3)
    choice = choose_codec(
        [plain, _zstd()],
        _server(),
        _trainer(),
        LinkProfile(bytes_per_s=3 * MBIT),
        Workload(samples=1000),
        freeze=2,
    )
    plan = choice.plan
    assert (plan.wire_dtype, plan.compression, plan.codec) == ("fp32", "zstd", "fp32+zstd")
    assert plan.to_dict()["codec"] == "fp32+zstd"
    assert plan.explain().startswith("fp32+zstd features")
    # A re-plan plans from the plan's profiles (the codec's sizes): it keeps the codec,
    # and its explanation still names it.
    again = choose_plan(plan.server, plan.trainer, plan.link, plan.workload, freeze=2,
                        current=plan)  # fmt: skip
    assert again.codec == "fp32+zstd"
    assert "features cross as fp32+zstd" in again.explain()
    assert plan.with_choice(1, 0.0, reason="set").codec == "fp32+zstd"


@pytest.mark.parametrize("mbit", [0.3, 3, 30, 1000, 100_000])
def test_codecs_are_measured_only_where_one_could_be_chosen(mbit: float) -> None:
    """Where a free link would not make the plan CODEC_MIN_GAIN faster, no codec could be
    chosen, whatever it measured: measuring them is left out. Checked against the choice
    itself: a codec that sends nothing and costs no CPU - the best any codec can be."""
    link = LinkProfile(bytes_per_s=mbit * MBIT)
    plain = CodecProfile(out_bytes=(600_000, 200_000, 8_000), encode_s=(0,) * 3, decode_s=(0,) * 3)
    perfect = CodecProfile(compression="zstd", out_bytes=(1,) * 3, encode_s=(0,) * 3,
                           decode_s=(0,) * 3)  # fmt: skip
    server = dataclasses.replace(_server(), send_s=2e-9)
    trainer = dataclasses.replace(_trainer(), receive_s=2e-9)
    workload = Workload(samples=1000)
    chosen = choose_codec([plain, perfect], server, trainer, link, workload, freeze=2).codec
    may = codecs_may_pay(server, trainer, link, workload, freeze=2)
    assert may == (chosen is perfect)
    assert may == (mbit <= 30)  # the slow links bind here, the fast ones do not


def test_a_loop_asks_for_the_plans_codec_or_the_jobs_own() -> None:
    choice = choose_codec(
        [_zstd()], _server(), _trainer(), LinkProfile(bytes_per_s=10 * MBIT),
        Workload(samples=100), freeze=2,
    )  # fmt: skip
    assert loop_codec("fp32", "auto", choice.plan) == ("fp32", "zstd")
    # No plan (a fixed cut, or none measured yet): auto sends none, a named one is kept.
    assert loop_codec("fp32", "auto", None) == ("fp32", "none")
    assert loop_codec("int8", "lz4", None) == ("int8", "lz4")


def test_codec_profiles_round_trip_through_json() -> None:
    codec = _zstd()
    assert CodecProfile.from_dict(codec.to_dict()) == codec
    with pytest.raises(InvalidRequest, match="codec profile"):
        CodecProfile.from_dict({"wire_dtype": "fp32"})


def test_codecs_are_measured_at_every_cut_on_the_jobs_features() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18")), (3, 64, 64))
    freeze = graph.resolve_freeze("layer2")
    rng = np.random.default_rng(0)
    blobs = []
    for i in range(4):
        buf = io.BytesIO()
        synth_image(i, 4, 80, rng).save(buf, "JPEG")
        blobs.append(buf.getvalue())
    training = {m: m.training for m in graph.model.modules()}
    fp32, zstd, int8 = measure_codecs(
        graph, freeze, blobs, Transforms.eval(64), [("fp32", "none"), ("fp32", "zstd"),
                                                    ("int8", "zstd")]
    )  # fmt: skip
    assert {m: m.training for m in graph.model.modules()} == training  # modes come back
    assert len(fp32.out_bytes) == len(zstd.out_bytes) == freeze + 1
    # INPUT: 3 x 64 x 64 floats a sample, and its key, label and Arrow's buffers beside.
    assert 3 * 64 * 64 * 4 <= fp32.out_bytes[0] < 3 * 64 * 64 * 4 + 400
    # After a ReLU, many zeros: ZSTD saves bytes losslessly, int8 quarters them.
    assert zstd.out_bytes[freeze] < 0.95 * fp32.out_bytes[freeze]
    assert int8.out_bytes[freeze] < 0.3 * fp32.out_bytes[freeze]
    assert not zstd.lossy and int8.lossy
    # CPU times are measured, not asserted against a figure (a loaded machine moves them).
    assert fp32.encode_s[freeze] >= 0 and zstd.encode_s[freeze] > 0


def test_a_chunk_report_carries_the_bytes_its_stream_sent() -> None:
    report = ChunkReport(chunk=3, server_s=0.5).to_bytes()
    assert ChunkReport.model_validate_json(report).sent_bytes is None  # an older server's
    stamped = ChunkReport.model_validate_json(ChunkReport.with_sent_bytes(report, 1234))
    assert (stamped.chunk, stamped.server_s, stamped.sent_bytes) == (3, 0.5, 1234)
