"""The codec rules on a real job's profiles (`_codec_profiles`): at the rates of
`benchmarks/wire_epochs.py`, codecs where the link binds and none where it does not, and a
choice that codec CPU measured 2x off does not flip."""

from __future__ import annotations

import dataclasses

import pytest

from hapi.plan import CodecProfile, LinkProfile, Workload, choose_codec, choose_plan
from hapi.plan.codecs import CODEC_MIN_GAIN

from ._codec_profiles import CODECS, LOOPBACK_BYTES_PER_S, NAMES, SERVER, TRAINER

MBIT = 1e6 / 8
FREEZE = 10  # layer3
WORK = Workload(samples=160, chunk_size=64, back_to_back=True)  # the benchmark's epoch


def _choose(bytes_per_s: float, codecs=CODECS, *, lossy: bool = True):  # type: ignore[no-untyped-def]
    return choose_codec(codecs, SERVER, TRAINER, LinkProfile(bytes_per_s=bytes_per_s), WORK,
                        freeze=FREEZE, names=NAMES, lossy=lossy)  # fmt: skip


def _cpu_times(codec: CodecProfile, factor: float) -> CodecProfile:
    return dataclasses.replace(
        codec,
        encode_s=tuple(t * factor for t in codec.encode_s),
        decode_s=tuple(t * factor for t in codec.decode_s),
    )


@pytest.mark.parametrize("bytes_per_s", [1000 * MBIT, LOOPBACK_BYTES_PER_S])
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_a_fast_link_sends_plain_fp32_however_wrong_the_codecs_cpu(
    bytes_per_s: float, factor: float
) -> None:
    codecs = [_cpu_times(c, factor) for c in CODECS]
    choice = _choose(bytes_per_s, codecs)
    assert choice.codec.label == "fp32" and choice.plan.compression == "none"
    # Why: a link that carried everything for free would save less than the margin.
    link = LinkProfile(bytes_per_s=bytes_per_s)
    plain = choose_plan(SERVER, TRAINER, link, WORK, freeze=FREEZE)
    free = choose_plan(SERVER, TRAINER, LinkProfile(bytes_per_s=1e15), WORK, freeze=FREEZE)
    assert free.epoch_s > plain.epoch_s * (1 - CODEC_MIN_GAIN)


def test_a_slow_link_compresses_and_is_predicted_well_clear_of_the_margin() -> None:
    lossless = _choose(3 * MBIT, lossy=False)
    assert lossless.plan.compression in ("lz4", "zstd")
    fp32 = next(p for c, p in lossless.plans if c.label == "fp32")
    assert lossless.plan.epoch_s < fp32.epoch_s * (1 - 2 * CODEC_MIN_GAIN)
    # With lossy dtypes allowed, 8 bits a value: fewer bytes still, and faster.
    lossy = _choose(3 * MBIT)
    assert lossy.codec.wire_dtype == "int8"
    assert lossy.plan.epoch_s < lossless.plan.epoch_s


@pytest.mark.parametrize("mbit", [1, 3, 10, 30, 100, 1000])
def test_the_chosen_plan_is_never_predicted_slower_than_plain_fp32(mbit: float) -> None:
    choice = _choose(mbit * MBIT)
    fp32 = next(p for c, p in choice.plans if c.label == "fp32")
    assert choice.plan.epoch_s <= fp32.epoch_s
    if choice.codec.label != "fp32":  # a codec only when it clears the margin
        assert choice.plan.epoch_s < fp32.epoch_s * (1 - CODEC_MIN_GAIN)
