"""Compressed feature batches, encoded once: `pack` on the server, `unpack` on the trainer.

A compressed stream's batch is compressed by the server itself, as one Arrow IPC record
batch message with ZSTD or LZ4 buffers, and sent as the one value of a binary column; the
feature schema rides in the packed schema's metadata, so the message carries none. Flight
used to compress each batch as it wrote it, and the server compressed it a second time only
to count the bytes that would cross (its shaper and its counters must charge what crosses):
packing once gives both from one encoding. Any Arrow IPC reader undoes the message.
"""

from __future__ import annotations

import base64
import functools
import time

import numpy as np
import pyarrow as pa

from hapi.errors import InvalidRequest
from hapi.wire.codecs import Compression, check_compression, ipc_options

__all__ = ["PACKED", "Packer", "pack", "packed_schema", "unpack"]

PACKED = b"hapi.packed"
"""Schema metadata key of a packed stream: its value names the compression."""
_INNER = b"hapi.schema"


def packed_schema(schema: pa.Schema, compression: Compression) -> pa.Schema:
    """The schema a stream of `schema`'s batches has when packed with `compression` (the
    schema itself when none)."""
    if check_compression(compression) == "none":
        return schema
    return _packed_schema(schema, compression)


@functools.lru_cache(maxsize=64)
def _packed_schema(schema: pa.Schema, compression: Compression) -> pa.Schema:
    inner = base64.b64encode(schema.serialize().to_pybytes())
    return pa.schema(
        [("packed", pa.binary())],
        metadata={PACKED: compression.encode(), _INNER: inner},
    )


def pack(batch: pa.RecordBatch, compression: Compression) -> pa.RecordBatch:
    """`batch` compressed with `compression`, as one row of its packed schema (`batch`
    itself when none; an empty batch packs to no rows). Its `nbytes` are what crosses."""
    schema = packed_schema(batch.schema, compression)
    if schema is batch.schema:
        return batch
    if batch.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream(sink, batch.schema, options=ipc_options(compression))
    writer.write_batch(batch)
    end = sink.tell()
    stream = sink.getvalue()
    reader = pa.BufferReader(stream)
    pa.ipc.read_message(reader)  # the schema's message: the packed schema carries it
    start = reader.tell()
    message = stream.slice(start, end - start)
    offsets = pa.py_buffer(np.array([0, message.size], dtype=np.int32).tobytes())
    column = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, message])
    return pa.record_batch([column], schema=schema)


class Packer:
    """`pack` for one stream, keeping the seconds it took: compressing is the server's
    encoding, which its chunk report's `server_s` counts (the planner charges it there)."""

    def __init__(self, compression: Compression) -> None:
        self.compression = check_compression(compression)
        self.seconds = 0.0

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        t0 = time.perf_counter()
        packed = pack(batch, self.compression)
        self.seconds += time.perf_counter() - t0
        return packed


def unpack(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The feature batch a packed `batch` holds (`batch` itself when not packed).

    Raises:
        InvalidRequest: a packed batch that is not one message of its schema's batches.
    """
    meta = batch.schema.metadata or {}
    if PACKED not in meta:
        return batch
    schema = _inner_schema(meta[_INNER])
    if batch.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    if batch.num_rows != 1:
        raise InvalidRequest(
            f"a packed feature batch holds one message, got {batch.num_rows}: the server "
            "and the trainer disagree on the wire format; upgrade the older one"
        )
    # Read as a stream (the schema's message, then the batch's) on this thread: Arrow's
    # own reader of one message decompresses on its thread pool, where a thread's CPU
    # clock - the planner's measure of decoding - missed 97% of it.
    sink = pa.BufferOutputStream()
    sink.write(_schema_message(meta[_INNER]))
    sink.write(batch.column(0)[0].as_buffer())  # one copy of the compressed bytes
    return pa.ipc.open_stream(sink.getvalue(), options=_READ).read_next_batch()


_READ = pa.ipc.IpcReadOptions(use_threads=False)


@functools.lru_cache(maxsize=64)
def _inner_schema(encoded: bytes) -> pa.Schema:
    return pa.ipc.read_schema(_schema_message(encoded))


@functools.lru_cache(maxsize=64)
def _schema_message(encoded: bytes) -> pa.Buffer:
    return pa.py_buffer(base64.b64decode(encoded))
