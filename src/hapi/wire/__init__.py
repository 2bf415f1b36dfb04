"""The wire protocol between trainer and server: actions, messages, Arrow batches, errors."""

from hapi.wire.actions import ActionType
from hapi.wire.batches import FeatureBatch, decode_batch, encode_batch, feature_schema, raw_schema
from hapi.wire.dtypes import WIRE_DTYPES, WireDtype, check_wire_dtype, dtype_width
from hapi.wire.errors import MAX_ERROR_MESSAGE, decode_error, encode_error
from hapi.wire.messages import (
    MAX_IMAGE_SIZE,
    MAX_KEY_LENGTH,
    MAX_PROFILE_KEYS,
    MIN_IMAGE_SIZE,
    ChunkTicket,
    CloseSessionRequest,
    HasHeadRequest,
    ManifestRequest,
    OnError,
    ProfileRequest,
    SessionRequest,
    UploadedHead,
    parse,
)
from hapi.wire.replies import (
    ChunkReport,
    HasHeadReply,
    ProfileKeyInfo,
    ProfileReply,
    ServerStats,
    SessionInfo,
    SessionStats,
    SkippedKey,
)

__all__ = [
    "MAX_ERROR_MESSAGE",
    "MAX_IMAGE_SIZE",
    "MAX_KEY_LENGTH",
    "MAX_PROFILE_KEYS",
    "MIN_IMAGE_SIZE",
    "WIRE_DTYPES",
    "ActionType",
    "ChunkReport",
    "ChunkTicket",
    "CloseSessionRequest",
    "FeatureBatch",
    "HasHeadReply",
    "HasHeadRequest",
    "ManifestRequest",
    "OnError",
    "ProfileKeyInfo",
    "ProfileReply",
    "ProfileRequest",
    "ServerStats",
    "SessionInfo",
    "SessionRequest",
    "SessionStats",
    "SkippedKey",
    "UploadedHead",
    "WireDtype",
    "check_wire_dtype",
    "decode_batch",
    "decode_error",
    "dtype_width",
    "encode_batch",
    "encode_error",
    "feature_schema",
    "parse",
    "raw_schema",
]
