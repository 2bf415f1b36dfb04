"""Choosing the wire codec with the cut and share.

A codec (a wire dtype and a buffer compression) changes three costs of every option: the
bytes on the link (its measured size per cut), the server's time (encoding) and the
trainer's (decoding). `CodecProfile` holds those, measured per cut on the job's own
features; `choose_codec` plans once per codec with the profiles it implies and takes the
fastest. A slow link rewards bytes saved; a fast one the CPU not spent, so at 1 Gbit/s
the plan may send raw fp16 while at 10 Mbit/s it sends int8 + ZSTD.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hapi.errors import InvalidRequest
from hapi.plan.choose import PlannerConfig, choose_plan
from hapi.plan.cost import Workload
from hapi.plan.plan import Plan
from hapi.plan.profiles import WIRE_ITEMSIZE, LinkProfile, ServerProfile, TrainerProfile

__all__ = ["CodecChoice", "CodecProfile", "choose_codec", "server_speed"]

CODEC_MIN_GAIN = 0.05
"""A codec is chosen over a simpler one (earlier in the order weighed: lossless before lossy,
no compression before lz4 before zstd) only when its plan is predicted this fraction
faster. A codec's CPU is measured once, on a few samples, on the trainer's core: on a fast
link its predicted gain (0.5-1.3% at 1 Gbit/s in `benchmarks/wire_epochs.py`) is inside
that error. It also keeps codecs off wherever the link does not bind: no codec's plan beats
the simplest codec's with a free link, so where a free link would save less than this, no
codec clears it. Where the link binds, the gains are tens of percent and pass."""

_COMPRESSIONS = ("none", "lz4", "zstd")


@dataclass(frozen=True, kw_only=True)
class CodecProfile:
    """What sending features with one codec costs per sample, at each cut 0..m."""

    wire_dtype: str = "fp32"
    """The dtype features travel in."""
    compression: str = "none"
    """The stream's buffer compression: none, lz4 or zstd."""
    out_bytes: tuple[int, ...]
    """Bytes on the wire per sample at each cut, compressed (measured)."""
    encode_s: tuple[float, ...]
    """CPU seconds per sample to encode each cut's features (cast, quantize, compress),
    beyond an uncompressed fp32 batch's, as the trainer's CPU measured them: `apply`
    charges them to the server at its own speed."""
    decode_s: tuple[float, ...]
    """Trainer CPU seconds per sample to decode them (decompress, dequantize)."""
    lossy: bool = False
    """Whether the features arrive other than the head computed them (int8, fp8, fp16,
    bf16)."""

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_ITEMSIZE:
            raise InvalidRequest(
                f"codec wire_dtype must be one of {sorted(WIRE_ITEMSIZE)}, got {self.wire_dtype!r}"
            )
        if self.compression not in _COMPRESSIONS:
            raise InvalidRequest(
                f"codec compression must be none, lz4 or zstd, got {self.compression!r}"
            )
        if not len(self.out_bytes) == len(self.encode_s) == len(self.decode_s) > 0:
            raise InvalidRequest(
                "codec out_bytes, encode_s and decode_s need one entry per cut 0..m, got "
                f"{len(self.out_bytes)}, {len(self.encode_s)}, {len(self.decode_s)}"
            )
        if min(self.out_bytes) < 0 or min(self.encode_s) < 0 or min(self.decode_s) < 0:
            raise InvalidRequest("codec sizes and times must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (kept with a job's profiles)."""
        return {**dataclasses.asdict(self), **{
            k: list(getattr(self, k)) for k in ("out_bytes", "encode_s", "decode_s")}}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CodecProfile:
        """Read `to_dict` output.

        Raises:
            InvalidRequest: a missing or bad field.
        """
        try:
            return cls(
                wire_dtype=str(data["wire_dtype"]),
                compression=str(data["compression"]),
                out_bytes=tuple(int(b) for b in data["out_bytes"]),
                encode_s=tuple(float(t) for t in data["encode_s"]),
                decode_s=tuple(float(t) for t in data["decode_s"]),
                lossy=bool(data["lossy"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"a codec profile is missing or has a bad field: {exc}") from exc

    @property
    def label(self) -> str:
        """`int8+zstd`, `fp16`: how plans and tables name it."""
        return (
            self.wire_dtype
            if self.compression == "none"
            else (f"{self.wire_dtype}+{self.compression}")
        )

    def apply(
        self, server: ServerProfile, trainer: TrainerProfile
    ) -> tuple[ServerProfile, TrainerProfile]:
        """The profiles of a job that sends features with this codec: its sizes on the
        link, its encoding in the server's head time and its decoding in the trainer's
        tail time, at each cut both cover.

        The encoding runs on the server's CPU: its time measured on the trainer's is
        scaled by how much slower the server decodes the same objects (`server_speed`). A local
        chunk's tail time carries the decoding too, which it does not do (int8's rounding
        it does): an over-charge of the decoding's CPU, small beside the tail's.
        """
        m = min(server.last_cut, trainer.last_cut, len(self.out_bytes) - 1)
        slower = server_speed(server, trainer)
        sized = dataclasses.replace(
            server,
            out_bytes=self.out_bytes[: m + 1],
            head_s=tuple(server.head_s[k] + self.encode_s[k] * slower for k in range(m + 1)),
            memory_bytes=server.memory_bytes[: m + 1],
            wire_dtype=self.wire_dtype,
        )
        decoded = dataclasses.replace(
            trainer,
            head_s=trainer.head_s[: m + 1],
            tail_s=tuple(trainer.tail_s[k] + self.decode_s[k] for k in range(m + 1)),
        )
        return sized, decoded


def server_speed(server: ServerProfile, trainer: TrainerProfile) -> float:
    """How many times slower the server's CPU is than the trainer's: both decode the job's
    objects with its transforms (not their heads: one may run on a GPU, the codec runs on
    the CPU). At least 1: on two cores of one machine this ratio read 0.3-1.2 between
    runs, and a codec's CPU under-counted costs a whole epoch's worth where it binds."""
    if server.decode_s <= 0.0 or trainer.decode_s <= 0.0:
        return 1.0
    return max(1.0, server.decode_s / trainer.decode_s)


@dataclass(frozen=True)
class CodecChoice:
    """The plan with the fastest codec, and every codec's own plan."""

    plan: Plan
    """The chosen plan; its reason starts with the codec."""
    codec: CodecProfile
    """The codec it sends features with."""
    plans: tuple[tuple[CodecProfile, Plan], ...]
    """Each codec weighed and its best plan, in the order given."""


def choose_codec(
    codecs: Sequence[CodecProfile],
    server: ServerProfile,
    trainer: TrainerProfile,
    link: LinkProfile,
    workload: Workload,
    *,
    freeze: int,
    names: Sequence[str] = (),
    lossy: bool = False,
    config: PlannerConfig | None = None,
) -> CodecChoice:
    """Plan with each codec and choose the fastest plan, or a simpler codec's as fast within
    `CODEC_MIN_GAIN`.

    Args:
        codecs: the codecs to weigh, simplest first (uncompressed fp32 usually): one
            within `CODEC_MIN_GAIN` of a later one's plan is chosen over it.
        server, trainer, link, workload: as `choose_plan` takes them; `server`'s sizes are
            replaced by each codec's.
        freeze, names, config: as `choose_plan` takes them.
        lossy: weigh lossy codecs too (`lossy_wire=True`); False leaves them out.

    Raises:
        InvalidRequest: no codec left to weigh.
    """
    weighed = [c for c in codecs if lossy or not c.lossy]
    if not weighed:
        raise InvalidRequest(
            "no codec to weigh: every one given is lossy; pass lossy=True or a lossless one "
            "(fp32 with compression none, lz4 or zstd)"
        )
    plans: list[tuple[CodecProfile, Plan]] = []
    for codec in weighed:
        s, t = codec.apply(server, trainer)
        plans.append((codec, choose_plan(s, t, link, workload, freeze=freeze, names=names,
                                         config=config)))  # fmt: skip
    fastest = min(p.epoch_s for _, p in plans)
    # The simplest codec within CODEC_MIN_GAIN of the fastest: a closer call is noise.
    codec, best = next((c, p) for c, p in plans if p.epoch_s * (1 - CODEC_MIN_GAIN) <= fastest)
    reason = f"{codec.label} features, {best.reason}"
    others = [(c, p) for c, p in plans if c is not codec]
    if others:
        alt = ", ".join(f"{c.label} {p.epoch_s:.2f} s" for c, p in others)
        reason += f"; with {alt}"
    plan = dataclasses.replace(best, reason=reason, compression=codec.compression)
    return CodecChoice(plan, codec, tuple(plans))
