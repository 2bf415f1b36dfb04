"""The Arrow schema of what a server streams, and its encoding to and from torch.

A feature batch has columns `key` (string), `label` (int64) and `features`, a
`fixed_shape_tensor` column, so the receiver gets a zero-copy numpy view of the batch.
Arrow has no bfloat16, so bf16 travels as its raw 16 bits (uint16) and the schema's
metadata says how to read them back. int8 features travel as uint8 with two more columns,
`scale` and `offset` per sample and channel (`hapi.wire.codecs`), fp8 features as E4M3's
bits (uint8) with `scale`; both are decoded to float32. A RAW batch carries `data`
(binary object bytes, gathered into one buffer: `binary_array`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from hapi.errors import InvalidRequest
from hapi.graph.strides import standard_layout
from hapi.wire.codecs import (
    Fp8,
    Quantized,
    dequantize,
    dequantize_fp8,
    int8_groups,
    quantize,
    quantize_fp8,
)
from hapi.wire.dtypes import WireDtype, arrow_type, check_wire_dtype, torch_dtype
from hapi.wire.packed import unpack

__all__ = [
    "FeatureBatch",
    "binary_array",
    "decode_batch",
    "encode_batch",
    "feature_schema",
    "raw_schema",
]


@dataclass(frozen=True)
class FeatureBatch:
    """One decoded batch: keys, labels, and features (a tensor) or raw object bytes."""

    keys: list[str]
    labels: torch.Tensor
    features: torch.Tensor | None = None
    data: list[bytes] | None = None

    def __len__(self) -> int:
        return len(self.keys)


def feature_schema(shape: tuple[int, ...] | list[int], wire_dtype: WireDtype) -> pa.Schema:
    """The schema of a feature batch of per-sample `shape` sent as `wire_dtype`.

    Raises:
        InvalidRequest: `wire_dtype` is not a `WireDtype`.
    """
    wire_dtype = check_wire_dtype(wire_dtype)
    fields = [
        ("key", pa.string()),
        ("label", pa.int64()),
        ("features", pa.fixed_shape_tensor(arrow_type(wire_dtype), list(shape))),
    ]
    if wire_dtype in ("int8", "fp8"):
        groups = [int8_groups(tuple(shape))]
        fields.append(("scale", pa.fixed_shape_tensor(pa.float32(), groups)))
    if wire_dtype == "int8":
        fields.append(("offset", pa.fixed_shape_tensor(pa.float32(), groups)))
    return pa.schema(fields, metadata={"hapi.wire_dtype": wire_dtype})


def raw_schema() -> pa.Schema:
    """The schema of a RAW batch: object bytes instead of features."""
    return pa.schema([("key", pa.string()), ("label", pa.int64()), ("data", pa.binary())])


def binary_array(parts: Sequence[bytes | memoryview]) -> pa.BinaryArray:
    """A binary array of `parts`, each copied once into one buffer sized up front.

    `pa.array` grows its buffer as it goes (copying what it holds at each doubling) and
    cost a RAW batch's server twice this per sample; a part may be a view (a shard's
    member, `hapi.data.shards.blob`), copied here and nowhere else.
    """
    sizes = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise InvalidRequest(
            f"a RAW batch of {offsets[-1]} bytes is over Arrow's 2 GiB: send smaller batches"
        )
    data = np.empty(int(offsets[-1]), np.uint8)
    for part, start, end in zip(parts, offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        data[start:end] = np.frombuffer(part, np.uint8)
    buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.binary(), len(parts), buffers)  # type: ignore[return-value]


def encode_batch(
    schema: pa.Schema,
    keys: list[str],
    labels: list[int],
    features: torch.Tensor | None = None,
    data: Sequence[bytes | memoryview] | None = None,
) -> pa.RecordBatch:
    """Encode one batch for `schema` (from `feature_schema` or `raw_schema`)."""
    columns: list[pa.Array] = [pa.array(keys, pa.string()), pa.array(labels, pa.int64())]
    if data is not None:
        columns.append(binary_array(data))
    else:
        if features is None:
            raise InvalidRequest("a feature batch needs features")
        wire_dtype = check_wire_dtype(schema.metadata[b"hapi.wire_dtype"].decode())
        if wire_dtype in ("int8", "fp8"):
            q = quantize(features) if wire_dtype == "int8" else quantize_fp8(features)
            for t in q:
                columns.append(pa.FixedShapeTensorArray.from_numpy_ndarray(t.numpy()))
            return pa.record_batch(columns, schema=schema)
        # Standard strides, not just `.contiguous()`: that keeps the strides of size-1
        # dimensions (ConvNeXt's (N, 768, 1, 1) with strides (768, 1, 768, 768)), which
        # numpy reads as a permutation that Arrow refuses to encode.
        t = standard_layout(features.detach().to(device="cpu", dtype=torch_dtype(wire_dtype)))
        if wire_dtype == "bf16":
            t = t.view(torch.int16)
        array = t.numpy()
        if wire_dtype == "bf16":
            array = array.view(np.uint16)
        columns.append(pa.FixedShapeTensorArray.from_numpy_ndarray(array))
    return pa.record_batch(columns, schema=schema)


def decode_batch(batch: pa.RecordBatch) -> FeatureBatch:
    """Decode a batch from the wire (packed or not, `hapi.wire.packed`); features come back
    as a torch tensor in their wire dtype (int8's dequantized, as float32)."""
    batch = unpack(batch)
    keys = batch.column("key").to_pylist()
    labels = torch.from_numpy(batch.column("label").to_numpy(zero_copy_only=False).copy())
    if "data" in batch.schema.names:
        # One call, not a scalar per value: 40 us a sample less in the trainer (100 KB).
        return FeatureBatch(keys, labels, data=batch.column("data").to_pylist())
    meta = batch.schema.metadata or {}
    wire_dtype = check_wire_dtype(meta.get(b"hapi.wire_dtype", b"fp32").decode())
    array = batch.column("features").to_numpy_ndarray()
    if wire_dtype == "int8":
        scale, offset = (batch.column(c).to_numpy_ndarray() for c in ("scale", "offset"))
        q = Quantized(*(torch.from_numpy(a.copy()) for a in (array, scale, offset)))
        # Copies: torch wants writable memory, and the buffers belong to the stream.
        return FeatureBatch(keys, labels, features=dequantize(q))
    if wire_dtype == "fp8":
        scale = batch.column("scale").to_numpy_ndarray()
        f8 = Fp8(*(torch.from_numpy(a.copy()) for a in (array, scale)))
        return FeatureBatch(keys, labels, features=dequantize_fp8(f8))
    if wire_dtype == "bf16":
        features = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    else:
        # Copy: the Arrow buffer belongs to the stream and torch wants writable memory.
        features = torch.from_numpy(array.copy())
    return FeatureBatch(keys, labels, features=features)
