"""`measure_codec`: what one codec costs on a batch of features - bytes on the wire, and
CPU seconds per sample to encode (server) and decode (trainer) - measured the way a
stream carries them (Arrow IPC with the codec's write options), for planning and
benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa
import torch

from hapi.wire.batches import decode_batch, encode_batch, feature_schema
from hapi.wire.codecs import Compression, ipc_options
from hapi.wire.dtypes import WireDtype

__all__ = ["CodecCost", "measure_codec"]


@dataclass(frozen=True, kw_only=True)
class CodecCost:
    """A codec's cost per sample on one batch of features."""

    wire_dtype: str
    compression: str
    bytes_per_sample: float
    """Bytes on the wire per sample: the IPC message body, compressed."""
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
    so other processes on the machine do not count.
    """
    n = features.shape[0]
    schema = feature_schema(tuple(features.shape[1:]), wire_dtype)
    keys, labels = [str(i) for i in range(n)], [0] * n
    options = ipc_options(compression)
    encode = decode = float("inf")
    body = 0
    for _ in range(max(repeats, 1)):
        t0 = time.thread_time()
        batch = encode_batch(schema, keys, labels, features=features)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema, options=options) as writer:
            start = sink.tell()
            writer.write_batch(batch)
            body = sink.tell() - start
        buf = sink.getvalue()
        t1 = time.thread_time()
        decode_batch(pa.ipc.open_stream(buf).read_next_batch())
        t2 = time.thread_time()
        encode, decode = min(encode, t1 - t0), min(decode, t2 - t1)
    return CodecCost(
        wire_dtype=wire_dtype,
        compression=compression,
        bytes_per_sample=body / n,
        encode_s=encode / n,
        decode_s=decode / n,
    )
