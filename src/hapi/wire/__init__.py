"""The wire protocol between trainer and server: messages, Arrow batches, errors."""

from hapi.wire.batches import FeatureBatch, decode_batch, encode_batch, feature_schema, raw_schema
from hapi.wire.errors import decode_error, encode_error
from hapi.wire.messages import (
    ChunkTicket,
    ManifestRequest,
    SessionInfo,
    SessionRequest,
    WireDtype,
    parse,
)

__all__ = [
    "ChunkTicket",
    "FeatureBatch",
    "ManifestRequest",
    "SessionInfo",
    "SessionRequest",
    "WireDtype",
    "decode_batch",
    "decode_error",
    "encode_batch",
    "encode_error",
    "feature_schema",
    "parse",
    "raw_schema",
]
