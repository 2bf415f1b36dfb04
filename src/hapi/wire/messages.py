"""Request and response bodies of the Flight actions and tickets, as pydantic models.

Everything that crosses the wire is JSON validated here, never pickle: a malformed request
is an `InvalidRequest` for that caller, and the server goes on serving everyone else.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hapi.errors import InvalidRequest

__all__ = [
    "ChunkTicket",
    "ManifestRequest",
    "SessionInfo",
    "SessionRequest",
    "WireDtype",
    "parse",
]

WireDtype = Literal["fp32", "fp16", "bf16"]

M = TypeVar("M", bound=BaseModel)


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_bytes(self) -> bytes:
        """The message as compact JSON bytes."""
        return self.model_dump_json().encode()


class SessionRequest(_Message):
    """`open_session`: what a job asks a server to run for it."""

    model: dict[str, Any] | str = Field(
        description="A `ModelSpec` as a dict, or a model repository reference (`repo://name`)."
    )
    cut: int = Field(ge=-1, description="RAW (-1), INPUT (0) or a cut point 1..freeze.")
    freeze: int | str | None = Field(
        default=None, description="The last frozen cut point (index or module name)."
    )
    transforms: dict[str, Any] = Field(description="A `Transforms` spec as a dict.")
    image_size: int = Field(default=224, ge=8, le=4096, description="Input height and width.")
    wire_dtype: WireDtype = "fp32"
    seed: int = Field(default=0, description="The job seed; sample seeds derive from it.")
    on_error: Literal["raise", "skip"] = Field(
        default="raise", description="On a bad object: fail the chunk, or skip and report it."
    )


class SessionInfo(_Message):
    """The reply to `open_session`."""

    session: str
    cut: int
    freeze: int
    num_cuts: int
    feature_shape: list[int]
    wire_dtype: WireDtype
    bytes_per_sample: int = Field(description="Feature bytes per sample on the wire (0 for RAW).")


class ChunkTicket(_Message):
    """A `do_get` ticket: one chunk of a session's keys.

    Chunks are idempotent: the same ticket gives the same features on any server (sample
    seeds depend only on the job seed, the epoch and the key), so it can be retried.
    """

    session: str
    chunk: int = Field(ge=0)
    epoch: int = Field(default=0, ge=0)
    keys: list[str] = Field(min_length=1, max_length=100_000)
    labels: list[int]


class ManifestRequest(_Message):
    """`manifest`: list a dataset (ImageFolder layout) under a prefix of the server's store."""

    prefix: str = ""


def parse(cls: type[M], body: bytes | str) -> M:
    """Validate a JSON body into `cls`, raising `InvalidRequest` that says what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{cls.__name__} is not valid JSON: {exc}") from exc
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(body)'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidRequest(f"malformed {cls.__name__}: {problems}") from exc
