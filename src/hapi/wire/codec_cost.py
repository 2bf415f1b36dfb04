"""`measure_codec`: what one codec costs on a batch of features - bytes on the wire, and
CPU seconds per sample to encode (server) and decode (trainer) - measured the way a
stream carries them (`encode_batch`, then `pack`), for planning and benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa
import torch

from hapi.wire.batches import decode_batch, encode_batch, feature_schema
from hapi.wire.codecs import Compression
from hapi.wire.dtypes import WireDtype
from hapi.wire.packed import pack

__all__ = ["CodecCost", "measure_codec"]


@dataclass(frozen=True, kw_only=True)
class CodecCost:
    """A codec's cost per sample on one batch of features."""

    wire_dtype: str
    compression: str
    bytes_per_sample: float
    """Bytes on the wire per sample: the packed batch's, as the server counts them."""
    encode_s: float
    """CPU seconds per sample from the head's fp32 output to the bytes on the wire."""
    decode_s: float
    """CPU seconds per sample from the bytes to the trainer's tensor."""


def measure_codec(
    features: torch.Tensor,
    wire_dtype: WireDtype,
    compression: Compression,
    *,
    repeats: int = 3,
) -> CodecCost:
    """Encode `features` (N, *shape) as a stream would send them and decode them back.

    Times are the best of `repeats` runs of this thread's CPU time (`time.thread_time`),
    so other processes on the machine do not count; `pack` and `unpack` run their codec
    on the calling thread, so it is in them (Arrow's thread pool had hidden it: ZSTD
    measured some 30-70x cheaper than it is).
    """
    n = features.shape[0]
    schema = feature_schema(tuple(features.shape[1:]), wire_dtype)
    keys, labels = [str(i) for i in range(n)], [0] * n
    encode = decode = float("inf")
    body = 0
    for _ in range(max(repeats, 1)):
        t0 = time.thread_time()
        packed = pack(encode_batch(schema, keys, labels, features=features), compression)
        t1 = time.thread_time()
        # Through an IPC stream, as the trainer reads it (uncompressed: packing did that).
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, packed.schema) as writer:
            writer.write_batch(packed)
        t2 = time.thread_time()
        decode_batch(pa.ipc.open_stream(sink.getvalue()).read_next_batch())
        t3 = time.thread_time()
        body = packed.nbytes
        encode, decode = min(encode, t1 - t0), min(decode, t3 - t2)
    return CodecCost(
        wire_dtype=wire_dtype,
        compression=compression,
        bytes_per_sample=body / n,
        encode_s=encode / n,
        decode_s=decode / n,
    )
