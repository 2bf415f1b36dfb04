"""Profiles: what each tier and the link cost, per sample, as measured.

Times are seconds per sample and sizes bytes per sample; per-cut tuples are indexed by
cut, `INPUT` (0) first, up to the last cut measured. Every profile has `to_dict` /
`from_dict`, and `from_dict` validates as `hapi.wire` does. More: docs/cost-model.md,
"Profiles".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hapi.errors import InvalidRequest
from hapi.graph.cut_point import INPUT, RAW

__all__ = [
    "WIRE_ITEMSIZE",
    "LinkProfile",
    "ProfileKey",
    "ServerProfile",
    "TrainerProfile",
]

WIRE_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}
"""Bytes per element of each wire dtype (int8's and fp8's scales per channel aside)."""

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class ProfileKey:
    """What a server profile depends on: equal keys may share one measurement."""

    head: str
    """Content digest of the head's weights and graph (the head cache's key)."""
    input_shape: tuple[int, ...]
    """Per-sample input shape, e.g. (3, 112, 112)."""
    transforms: str
    """Digest of the transforms' JSON (`digest_transforms`)."""
    device: str
    """Where the head runs: `cpu`, `cuda:0`."""

    @classmethod
    def of(
        cls,
        head: str,
        input_shape: Sequence[int],
        transforms: Mapping[str, Any],
        device: str,
    ) -> ProfileKey:
        """A key from the transforms' `to_dict()` form rather than its digest."""
        canonical = json.dumps(transforms, sort_keys=True, separators=(",", ":"))
        digest = hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
        return cls(head=head, input_shape=tuple(input_shape), transforms=digest, device=device)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form."""
        return {**dataclasses.asdict(self), "input_shape": list(self.input_shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileKey:
        """Read `to_dict` output. Raises: InvalidRequest: a missing or bad field."""
        fields = _fields(cls, data)
        shape = fields["input_shape"]
        if not isinstance(shape, list | tuple) or not all(_is_int(d) and d > 0 for d in shape):
            raise InvalidRequest(f"profile key input_shape must be positive ints, got {shape!r}")
        for name in ("head", "transforms", "device"):
            if not isinstance(fields[name], str):
                raise InvalidRequest(f"profile key {name} must be a string, got {fields[name]!r}")
        return cls(**{**fields, "input_shape": tuple(shape)})


@dataclass(frozen=True, kw_only=True)
class ServerProfile:
    """The storage side's costs, measured by the server on the job's own objects."""

    read_s: float
    """Reading one object from the store (once levelled on a probe chunk, what a chunk
    waits for it beside its decoding: `hapi.client.planning.measuring`)."""
    decode_s: float
    """Decoding and transforming one object into the input tensor (once levelled, with
    the rest of a chunk's cost per sample beside its reads and its head: encoding)."""
    head_s: tuple[float, ...]
    """The head from the input up to each cut (`head_s[0]` = 0: INPUT runs no layer)."""
    out_bytes: tuple[int, ...]
    """Bytes on the wire per sample at each cut, in `wire_dtype` (encoding included)."""
    memory_bytes: tuple[int, ...]
    """Memory per sample while computing each cut (the scheduler's batch sizing)."""
    raw_bytes: float
    """Mean object size: what RAW and a hybrid's local share carry per sample."""
    wire_dtype: str = "fp32"
    """Dtype of features in `out_bytes`: fp32, fp16, bf16, int8 or fp8."""
    batch_size: int = 1
    """The head's batch size in the measurement (per-sample cost falls as it grows)."""
    key: ProfileKey | None = None
    """What the measurement depends on; None when it was not measured by a server."""
    raw_s: float | None = None
    """Serving one object raw: reading it and encoding it onto the wire, as the server
    reported a RAW chunk's time - what each sample of a RAW or local chunk costs it, which
    is more than `read_s` alone (ResNet-50's RAW epochs: 1.3 ms a sample against a read of
    0.1 ms). None: not measured apart, `read_s`."""
    send_s: float = 0.0
    """The server's core seconds per byte it sends beyond what its chunks report: gRPC's
    threads and the kernel handing the bytes to the network (the RAW probe's process CPU
    less its chunk threads'). Charged to the server for every byte on the wire, as the
    trainer's `receive_s` is to the trainer: 100 KB photos served raw beside pushed chunks
    cost a server core 0.65-0.88 ms each where their chunks reported 0.16 ms (2.5-2.8 ms
    per MB of it shows in the process's CPU; the rest is the kernel's, outside it), and
    hybrids' servers ran 1.08-1.17x the time predicted without it."""

    def __post_init__(self) -> None:
        if self.raw_s is not None:
            _check_seconds("raw_s", self.raw_s)
        _check_seconds("send_s", self.send_s)
        object.__setattr__(self, "head_s", _seconds("head_s", self.head_s))
        object.__setattr__(self, "out_bytes", _sizes("out_bytes", self.out_bytes))
        object.__setattr__(self, "memory_bytes", _sizes("memory_bytes", self.memory_bytes))
        _check_seconds("read_s", self.read_s)
        _check_seconds("decode_s", self.decode_s)
        _check_seconds("raw_bytes", self.raw_bytes)
        if not len(self.head_s) == len(self.out_bytes) == len(self.memory_bytes):
            raise InvalidRequest(
                "server profile head_s, out_bytes and memory_bytes must have one entry per "
                f"cut 0..m, got {len(self.head_s)}, {len(self.out_bytes)}, "
                f"{len(self.memory_bytes)}"
            )
        if self.wire_dtype not in WIRE_ITEMSIZE:
            raise InvalidRequest(
                f"wire_dtype must be one of {sorted(WIRE_ITEMSIZE)}, got {self.wire_dtype!r}"
            )
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise InvalidRequest(f"batch_size must be an int >= 1, got {self.batch_size!r}")

    @property
    def last_cut(self) -> int:
        """The last cut measured (m): cuts 0..m have entries."""
        return len(self.head_s) - 1

    def compute_s(self, cut: int) -> float:
        """The server's work per sample to send `cut` (RAW: reading and encoding only)."""
        if cut == RAW:
            return self.read_s if self.raw_s is None else self.raw_s
        return self.read_s + self.decode_s + self.head_s[cut]

    def wire_bytes(self, cut: int) -> float:
        """Bytes per sample on the wire at `cut` (RAW: the object itself)."""
        return self.raw_bytes if cut == RAW else float(self.out_bytes[cut])

    def serve_s(self, cut: int) -> float:
        """The server core's time per sample at `cut`: its work (`compute_s`, what its
        chunks report) and sending the sample's bytes."""
        return self.compute_s(cut) + self.send_s * self.wire_bytes(cut)

    def with_wire_dtype(self, dtype: str) -> ServerProfile:
        """The same profile with features sent in `dtype` (sizes scaled by element size)."""
        if dtype not in WIRE_ITEMSIZE:
            raise InvalidRequest(
                f"wire_dtype must be one of {sorted(WIRE_ITEMSIZE)}, got {dtype!r}"
            )
        ratio = WIRE_ITEMSIZE[dtype] / WIRE_ITEMSIZE[self.wire_dtype]
        sizes = tuple(round(b * ratio) for b in self.out_bytes)
        return dataclasses.replace(self, out_bytes=sizes, wire_dtype=dtype)

    def scaled(self, factor: float) -> ServerProfile:
        """Every time multiplied by `factor` (a server measured slower or faster)."""
        return dataclasses.replace(
            self,
            read_s=self.read_s * factor,
            raw_s=None if self.raw_s is None else self.raw_s * factor,
            send_s=self.send_s * factor,
            decode_s=self.decode_s * factor,
            head_s=tuple(t * factor for t in self.head_s),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (the `profile` action's reply)."""
        data = dataclasses.asdict(self)
        data.update(
            head_s=list(self.head_s),
            out_bytes=list(self.out_bytes),
            memory_bytes=list(self.memory_bytes),
            key=None if self.key is None else self.key.to_dict(),
        )
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerProfile:
        """Read `to_dict` output. Raises: InvalidRequest: a missing or bad field."""
        fields = _fields(cls, data)
        key = fields.get("key")
        if key is not None:
            if not isinstance(key, Mapping):
                raise InvalidRequest(f"server profile key must be an object, got {key!r}")
            fields["key"] = ProfileKey.from_dict(key)
        return _build(cls, fields)


@dataclass(frozen=True, kw_only=True)
class TrainerProfile:
    """The compute side's costs, measured by the trainer on its own model and device."""

    decode_s: float
    """Decoding and transforming one object, when the trainer does it (RAW, local share)."""
    head_s: tuple[float, ...]
    """Forward of the frozen head from the input to each cut (a local chunk's features)."""
    tail_s: tuple[float, ...]
    """Forward and backward from each cut: the frozen rest under no grad, then training,
    and the sample's share of the optimizer's step."""
    batch_size: int = 1
    """The training batch size in the measurement."""
    device: str = "cpu"
    """Where the tail trains."""
    receive_s: float = 0.0
    """CPU seconds per byte received: the stream's protocol and copies, on the cores that
    also train. Measured 5-6 ms per MB here; a cut that sends 67 MB an epoch cost the
    trainer 0.35 s beyond its compute, and one core does both."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_s", _seconds("head_s", self.head_s))
        object.__setattr__(self, "tail_s", _seconds("tail_s", self.tail_s))
        _check_seconds("decode_s", self.decode_s)
        _check_seconds("receive_s", self.receive_s)
        if len(self.head_s) != len(self.tail_s):
            raise InvalidRequest(
                f"trainer profile head_s and tail_s must have one entry per cut 0..m, got "
                f"{len(self.head_s)} and {len(self.tail_s)}"
            )
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise InvalidRequest(f"batch_size must be an int >= 1, got {self.batch_size!r}")

    @property
    def last_cut(self) -> int:
        """The last cut measured (m): cuts 0..m have entries."""
        return len(self.tail_s) - 1

    def remote_s(self, cut: int) -> float:
        """The trainer's work per sample that arrives at `cut` (RAW: it does everything)."""
        if cut == RAW:
            return self.decode_s + self.tail_s[INPUT]
        return self.tail_s[cut]

    def local_s(self, cut: int) -> float:
        """The trainer's work per sample of a local chunk that joins the stream at `cut`."""
        if cut <= INPUT:
            return self.decode_s + self.tail_s[INPUT]
        return self.decode_s + self.head_s[cut] + self.tail_s[cut]

    def scaled(self, factor: float, *, front: float | None = None) -> TrainerProfile:
        """Every time multiplied by `factor` (a trainer measured slower or faster), or
        decoding and the fronts by `front` (a local chunk's own work,
        `hapi.plan.trainer_split`) and the tails and receiving by `factor`."""
        front = factor if front is None else front
        return dataclasses.replace(
            self,
            decode_s=self.decode_s * front,
            head_s=tuple(t * front for t in self.head_s),
            tail_s=tuple(t * factor for t in self.tail_s),
            receive_s=self.receive_s * factor,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form."""
        return {
            **dataclasses.asdict(self),
            "head_s": list(self.head_s),
            "tail_s": list(self.tail_s),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerProfile:
        """Read `to_dict` output. Raises: InvalidRequest: a missing or bad field."""
        return _build(cls, _fields(cls, data))


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """The network between the tiers, as observed on the stream."""

    bytes_per_s: float
    """Throughput of the link (all chunks in flight together)."""
    latency_s: float = 0.0
    """Fixed cost per chunk: the request's round trip and the stream's set-up."""

    def __post_init__(self) -> None:
        if not _is_number(self.bytes_per_s) or not 0 < self.bytes_per_s < math.inf:
            raise InvalidRequest(
                f"link bytes_per_s must be a positive finite number, got {self.bytes_per_s!r}"
            )
        _check_seconds("latency_s", self.latency_s)

    @classmethod
    def observed(
        cls, nbytes: int, seconds: float, *, requests: int = 1, latency_s: float = 0.0
    ) -> LinkProfile:
        """The link as one transfer showed it: `nbytes` in `seconds` over `requests` requests.

        The requests' fixed cost is taken out of the time before dividing, so a probe of a
        few small objects does not read as a slow link.

        Raises:
            InvalidRequest: no bytes, or no time left once the latency is taken out.
        """
        busy = seconds - requests * latency_s
        if nbytes <= 0 or not busy > 0:
            raise InvalidRequest(
                f"cannot tell a link's rate from {nbytes} bytes in {seconds} s with "
                f"{requests} x {latency_s} s of latency: transfer more bytes"
            )
        return cls(bytes_per_s=nbytes / busy, latency_s=latency_s)

    def scaled(self, factor: float) -> LinkProfile:
        """The link taking `factor` times as long per byte and per chunk."""
        return LinkProfile(bytes_per_s=self.bytes_per_s / factor, latency_s=self.latency_s * factor)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinkProfile:
        """Read `to_dict` output. Raises: InvalidRequest: a missing or bad field."""
        return _build(cls, _fields(cls, data))


def _fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise InvalidRequest(f"{cls.__name__} must be a JSON object, got {data!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise InvalidRequest(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return dict(data)


def _build(cls: type[_T], fields: dict[str, Any]) -> _T:
    try:
        return cls(**fields)
    except TypeError as exc:  # a missing field
        raise InvalidRequest(f"{cls.__name__}: {exc}") from exc


def _seconds(name: str, values: Sequence[float]) -> tuple[float, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
        raise InvalidRequest(f"{name} must be a non-empty list, one entry per cut, got {values!r}")
    for v in values:
        _check_seconds(name, v)
    return tuple(float(v) for v in values)


def _sizes(name: str, values: Sequence[int]) -> tuple[int, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
        raise InvalidRequest(f"{name} must be a non-empty list, one entry per cut, got {values!r}")
    if not all(_is_int(v) and v >= 0 for v in values):
        raise InvalidRequest(f"{name} must be ints >= 0, got {list(values)!r}")
    return tuple(int(v) for v in values)


def _check_seconds(name: str, value: object) -> None:
    if not _is_number(value) or not 0 <= value < math.inf:  # type: ignore[operator]
        raise InvalidRequest(f"{name} must be a finite number >= 0, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
