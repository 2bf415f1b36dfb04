"""The job's wire codec: which codecs its planner weighs, what each costs on the job's own
features, and which one a loop's sessions ask for.

The planner weighs every lossless compression unless the user named one, and lossy dtypes
only when the user opted in (`lossy_wire=True`). A codec is measured on the features of
the planner's probe objects at every cut (bytes on the wire, encode and decode CPU), on
the trainer while the server still measures itself - or after, and only where one could
be chosen (`codecs_may_pay`). A loop takes its codec once, when it
starts: its sessions, its local chunks and the trainer's cache then agree on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hapi.client.config.parts import WireConfig
from hapi.data import Transforms, load_sample
from hapi.graph import ModelGraph
from hapi.plan import (
    LinkProfile,
    Plan,
    PlannerConfig,
    ServerProfile,
    TrainerProfile,
    Workload,
    choose_plan,
)
from hapi.plan.codecs import CODEC_MIN_GAIN, CodecProfile
from hapi.plan.measure import head_segments
from hapi.wire.codec_cost import measure_codec
from hapi.wire.codecs import COMPRESSIONS, Compression, check_compression, is_lossy
from hapi.wire.dtypes import WireDtype, check_wire_dtype

__all__ = [
    "Codec",
    "codec_candidates",
    "codecs_may_pay",
    "job_codecs",
    "loop_codec",
    "measure_codecs",
]

Codec = tuple[WireDtype, Compression]
"""A wire dtype and a buffer compression."""

LOSSY_DTYPES: tuple[WireDtype, ...] = ("fp16", "int8", "fp8")
"""The dtypes `lossy_wire=True` adds to the planner's choice."""

CODEC_SAMPLES = 4
"""Probe objects each codec is measured on: its ratio is the features', not the batch's,
and four samples at every cut cost the planner well under a second."""


def codec_candidates(
    wire_dtype: WireDtype, compression: Compression | str, *, lossy: bool
) -> tuple[Codec, ...]:
    """The codecs a job's planner weighs, simplest first (an exact tie goes to it).

    Args:
        wire_dtype: the job's dtype: always weighed.
        compression: the user's (fixed), or `auto`: none, lz4 and zstd.
        lossy: weigh fp16, int8 and fp8 too (`lossy_wire=True`, and no trainer cache keyed by
            the job's dtype).
    """
    dtypes = [wire_dtype]
    if lossy:
        dtypes += [d for d in LOSSY_DTYPES if d != wire_dtype]
    packs = COMPRESSIONS if compression == "auto" else (check_compression(compression),)
    return tuple((d, c) for d in dtypes for c in packs)


def measure_codecs(
    graph: ModelGraph,
    freeze: int,
    blobs: Sequence[bytes],
    transforms: Transforms,
    codecs: Sequence[Codec],
    *,
    seed: int = 0,
    samples: int = CODEC_SAMPLES,
) -> tuple[CodecProfile, ...]:
    """Each codec's cost at every cut 0..`freeze`, on the features of `blobs` (the probe's
    objects, decoded with the job's transforms): bytes on the wire per sample, and CPU
    beyond an uncompressed fp32 batch's to encode and decode them.

    Encoding is timed on the trainer's CPU and charged to the server: one machine's cores
    against another's, as the planner's scaled heads are (a few percent of a head's time).
    """
    if not codecs:
        return ()
    picked = blobs[:samples]
    x = torch.stack(
        [load_sample(b, f"probe/{i}", transforms, seed + i) for i, b in enumerate(picked)]
    )
    per_cut = [x]
    modes = {m: m.training for m in graph.model.modules()}
    try:
        with torch.inference_mode():
            first = next(graph.model.parameters(), None)
            h = x.to(first.device) if first is not None else x
            for segment in head_segments(graph, freeze):
                h = segment(h)
                per_cut.append(h.cpu())
    finally:
        for m, training in modes.items():
            m.training = training
    base = [measure_codec(f, "fp32", "none", repeats=1) for f in per_cut]
    profiles = []
    for dtype, compression in codecs:
        costs = (
            base  # the baseline itself: it costs nothing beyond itself, not timing noise
            if (dtype, compression) == ("fp32", "none")
            else [measure_codec(f, dtype, compression, repeats=1) for f in per_cut]
        )
        profiles.append(
            CodecProfile(
                wire_dtype=dtype,
                compression=compression,
                out_bytes=tuple(round(c.bytes_per_sample) for c in costs),
                encode_s=tuple(
                    max(0.0, c.encode_s - b.encode_s) for c, b in zip(costs, base, strict=True)
                ),
                decode_s=tuple(
                    max(0.0, c.decode_s - b.decode_s) for c, b in zip(costs, base, strict=True)
                ),
                lossy=is_lossy(dtype),
            )
        )
    return tuple(profiles)


def codecs_may_pay(
    server: ServerProfile,
    trainer: TrainerProfile,
    link: LinkProfile,
    workload: Workload,
    *,
    freeze: int,
    config: PlannerConfig | None = None,
) -> bool:
    """Whether any codec could be chosen over the job's dtype uncompressed: only where a
    free link - no time on it, no CPU sending or receiving - would make the plan at least
    `CODEC_MIN_GAIN` faster. A codec saves at most what the bytes cost and adds CPU, so
    no codec's plan is faster than the free link's; where that is not faster by the
    margin, `choose_codec` would keep the job's dtype whatever the codecs measured, and
    measuring them (0.3-0.4 s of the trainer's core, `benchmarks/startup.py`'s job) is
    left out."""
    here = choose_plan(server, trainer, link, workload, freeze=freeze, config=config)
    free = choose_plan(
        dataclasses.replace(server, send_s=0.0),
        dataclasses.replace(trainer, receive_s=0.0),
        LinkProfile(bytes_per_s=1e18, latency_s=link.latency_s),
        workload,
        freeze=freeze,
        config=config,
    )
    return free.epoch_s < here.epoch_s * (1 - CODEC_MIN_GAIN)


def loop_codec(wire_dtype: WireDtype, compression: Compression | str, plan: Plan | None) -> Codec:
    """The codec a loop's sessions ask for: the plan's when the planner chose one, else
    the job's dtype and its named compression (`auto` without a plan - a fixed cut, or a
    plan not yet measured - sends none)."""
    if plan is not None:
        return check_wire_dtype(plan.wire_dtype), check_compression(plan.compression)
    return wire_dtype, "none" if compression == "auto" else check_compression(compression)


def job_codecs(wire: WireConfig, *, cached: bool) -> tuple[Codec, ...]:
    """The codecs a job's planner weighs: its dtype, and with `lossy_wire` fp16, int8 and fp8
    - unless its training features go to the trainer's cache (`cached`), whose entries are
    keyed by the dtype: it then stays the job's, and the planner chooses the compression
    alone."""
    return codec_candidates(wire.dtype, wire.compression, lossy=wire.lossy and not cached)
