"""Request bodies of the Flight actions and tickets, as pydantic models.

Everything that crosses the wire is JSON validated here, never pickle: a malformed request
is an `InvalidRequest` for that caller, and the server goes on serving everyone else.
Replies are in `hapi.wire.replies`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from hapi.errors import InvalidRequest, shorten
from hapi.wire.codecs import Compression
from hapi.wire.dtypes import WireDtype

__all__ = [
    "MAX_IMAGE_SIZE",
    "MAX_KEY_LENGTH",
    "MAX_PROFILE_KEYS",
    "MIN_IMAGE_SIZE",
    "ChunkTicket",
    "CloseSessionRequest",
    "HasHeadRequest",
    "KeepaliveRequest",
    "ManifestRequest",
    "OnError",
    "ProfileRequest",
    "SessionRequest",
    "UploadedHead",
    "parse",
]

MIN_IMAGE_SIZE = 8
"""The smallest input side a session accepts."""
MAX_IMAGE_SIZE = 4096
"""The largest input side a session accepts: a decoded 4096 px image is 200 MB in fp32."""

OnError = Literal["raise", "skip"]
"""On a bad object: fail the chunk (`raise`), or leave it out and report it (`skip`)."""

MAX_KEY_LENGTH = 1024
"""S3's limit on an object key; no store hapi reads has longer ones."""

Key = Annotated[str, Field(min_length=1, max_length=MAX_KEY_LENGTH)]
# Labels travel as Arrow int64.
Label = Annotated[int, Field(ge=-(2**63), lt=2**63)]

M = TypeVar("M", bound=BaseModel)


class _Request(BaseModel):
    # Unknown fields are refused: a typo in a request must not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_bytes(self) -> bytes:
        """The message as compact JSON bytes."""
        return self.model_dump_json().encode()


DIGEST_PATTERN = r"^[0-9a-f]{64}$"
"""A head artifact's digest: SHA-256 in lower-case hex."""


class UploadedHead(_Request):
    """A user's own model, as a session names it: the head the trainer exported for the
    session's cut and uploaded (`hapi.wire.heads`). The server runs that program only."""

    module: str = Field(
        min_length=1, max_length=200, description="The model's class name, for logs and errors."
    )
    artifact: str | None = Field(
        default=None,
        pattern=DIGEST_PATTERN,
        description="Digest of the uploaded head up to the session's cut; None at RAW and "
        "INPUT, where no head runs.",
    )


def _model_kind(value: Any) -> str:
    if isinstance(value, UploadedHead) or (isinstance(value, dict) and "module" in value):
        return "uploaded"
    return "reference" if isinstance(value, str) else "spec"


# Tagged, so that a malformed upload's reference is refused as one, not read as a spec.
SessionModel = Annotated[
    Annotated[UploadedHead, Tag("uploaded")]
    | Annotated[dict[str, Any], Tag("spec")]
    | Annotated[str, Tag("reference")],
    Discriminator(_model_kind),
]


class SessionRequest(_Request):
    """`open_session`: what a job asks a server to run for it."""

    model: SessionModel = Field(
        description="A `ModelSpec` as a dict, a model repository reference (`repo://name`), "
        "or a head the trainer uploaded (`UploadedHead`: a dict with `module`)."
    )
    cut: int = Field(ge=-1, description="RAW (-1), INPUT (0) or a cut point 1..freeze.")
    freeze: int | str | None = Field(
        default=None, description="The last frozen cut point (index or module name)."
    )
    transforms: dict[str, Any] = Field(description="A `Transforms` spec as a dict.")
    image_size: int = Field(
        default=224, ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE, description="Input height and width."
    )
    wire_dtype: WireDtype = "fp32"
    seed: int = Field(default=0, description="The job seed; sample seeds derive from it.")
    on_error: OnError = "raise"
    exact: bool = Field(
        default=False,
        description="Run the head per sample (batch 1), so its features are bit for bit "
        "what the trainer computes per sample, whatever batch sizes the server runs.",
    )
    compression: Compression = Field(
        default="none",
        description="Arrow IPC buffer compression of the feature stream (lossless). Sent "
        "only when not none, so a server older than it still opens the session.",
    )
    head_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="bf16: the job allows the head to compute in bf16 where the server's "
        "device has bf16 kernels (`hapi.graph.precision`). Sent only when bf16.",
    )

    @model_validator(mode="after")
    def _exact_is_lossless(self) -> SessionRequest:
        if self.exact and self.wire_dtype in ("int8", "fp8"):
            raise ValueError(
                f"exact=True keeps features bit for bit, and {self.wire_dtype} rounds them: "
                "send fp32 "
                "(compression zstd or lz4 is lossless), or drop exact"
            )
        if self.exact and self.head_dtype != "fp32":
            raise ValueError("exact=True keeps features bit for bit: a bf16 head rounds them")
        return self

    def to_bytes(self) -> bytes:
        """The message as compact JSON bytes (without `compression` when none, nor
        `head_dtype` when fp32: a server older than them still opens the session)."""
        exclude = {"compression"} if self.compression == "none" else set()
        if self.head_dtype == "fp32":
            exclude.add("head_dtype")
        return self.model_dump_json(exclude=exclude or None).encode()


class HasHeadRequest(_Request):
    """`has_head`: whether the server holds the uploaded head with this digest."""

    digest: str = Field(pattern=DIGEST_PATTERN)


class CloseSessionRequest(_Request):
    """`close_session`: forget a session; the reply is its `SessionStats`."""

    session: str = Field(max_length=64)


class KeepaliveRequest(_Request):
    """`keepalive`: the job that opened this session is alive; keep it open (a session
    neither a chunk nor a keepalive used for the server's `session_idle_s` is closed)."""

    session: str = Field(max_length=64)


class ChunkTicket(_Request):
    """A `do_get` ticket: one chunk of a session's keys.

    Chunks are idempotent: the same ticket gives the same features on any server (sample
    seeds depend only on the job seed, the epoch and the key), so it can be retried.
    (`epoch`, `chunk`) orders the streams of one connection: the server sends them
    lowest first, whatever their session, so a client reads them in that order.
    """

    session: str = Field(max_length=64)
    chunk: int = Field(ge=0)
    epoch: int = Field(default=0, ge=0)
    keys: list[Key] = Field(min_length=1, max_length=100_000)
    labels: list[Label]
    versions: list[str] | None = Field(
        default=None,
        description="Each key's object version as the client listed it (`DatasetManifest."
        "versions`): a server's feature cache keys entries by it. None: not cached.",
    )

    @model_validator(mode="after")
    def _versions_match_keys(self) -> ChunkTicket:
        if self.versions is not None and len(self.versions) != len(self.keys):
            raise ValueError(f"{len(self.keys)} keys but {len(self.versions)} versions")
        return self


MAX_PROFILE_KEYS = 32
"""The most objects a profile reads: a probe, not a chunk."""
MAX_PROFILE_BATCH = 1024
"""The largest head batch a profile asks for (its objects are repeated to fill it)."""


class ProfileRequest(_Request):
    """`profile`: measure a session's costs per cut on a few of its job's objects.

    The reply (`ProfileReply`) has an entry for every cut from INPUT (0) to the largest
    of `cuts`: timing the head to the last cut times every cut before it at little cost.
    """

    session: str = Field(max_length=64)
    keys: list[Key] = Field(
        min_length=1, max_length=MAX_PROFILE_KEYS, description="Objects of the job to time."
    )
    cuts: list[int] | None = Field(
        default=None,
        description="Candidate cuts (1..freeze); None: every cut up to the session's freeze.",
    )
    epoch: int = Field(default=0, ge=0, description="Seeds the transforms as a chunk's would.")
    batch_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_PROFILE_BATCH,
        description=(
            "Samples per timed head batch: the batches the job's chunks will run (a head's "
            "time per sample depends on it). None: the server's small default. The server "
            "runs at most the session's batch size and what its memory budget grants."
        ),
    )


MAX_LOCATE_KEYS = 10_000
"""The most keys one `locate` asks about (a million keys take a hundred requests)."""


class LocateRequest(_Request):
    """`locate`: which bytes of these objects lie on the server's own storage node."""

    keys: list[Key] = Field(min_length=1, max_length=MAX_LOCATE_KEYS)


class ManifestRequest(_Request):
    """`manifest`: list a dataset (ImageFolder layout) under a prefix of the server's store."""

    prefix: str = Field(default="", max_length=MAX_KEY_LENGTH)
    format: Literal["json", "arrow"] = "json"
    """How the reply comes: a JSON object (`DatasetManifest.to_dict`), or an Arrow IPC
    stream of one table (`DatasetManifest.to_arrow`) - a million keys in about 60 MB
    against 100 MB of JSON, and read without a Python object a key. A server older than
    the field refuses it; the client then asks for JSON."""

    def to_bytes(self) -> bytes:
        """The message as compact JSON bytes (without `format` when JSON, which an older
        server refuses)."""
        exclude = {"format"} if self.format == "json" else None
        return self.model_dump_json(exclude=exclude).encode()


def parse(cls: type[M], body: bytes | str) -> M:
    """Validate a JSON body into `cls`, raising `InvalidRequest` that says what is wrong.

    The message repeats no more than a few hundred characters of the body, however large.
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(f"{cls.__name__} is not valid JSON: {shorten(str(exc))}") from None
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        problems = "; ".join(
            f"{shorten('.'.join(map(str, e['loc'])) or '(body)', 100)}: {shorten(e['msg'])}"
            for e in errors[:5]
        )
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise InvalidRequest(f"malformed {cls.__name__}: {problems}{more}") from None
