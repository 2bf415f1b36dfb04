"""Uploading a head artifact: a Flight `do_put` whose descriptor names the head's digest.

The descriptor is the path `["hapi-head", <digest>]`; the stream is record batches of two
columns, `part` (`program`, then `weights`) and `data` (binary pieces of at most
`PIECE_BYTES`), and the schema's metadata carries the per-sample input shape. The server
checks the digest (`IntegrityError`) and its size limit (`InvalidRequest`) and loads the
head only with `load_head`, never pickle; an upload is idempotent (`has_head` first).
Who may use an uploaded head, and why the pieces: `docs/heads.md`, "The upload on the wire".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight

from hapi.errors import InvalidRequest, shorten
from hapi.graph.export import HeadArtifact

__all__ = [
    "HEAD_PATH",
    "PIECE_BYTES",
    "HeadReceiver",
    "head_batches",
    "head_descriptor",
    "head_digest_of",
    "head_schema",
]

HEAD_PATH = "hapi-head"
"""First element of an upload's descriptor path; the second is the head's digest."""
PIECE_BYTES = 1 << 20
"""The most bytes of an artifact one record batch carries."""
DIGEST = re.compile(r"[0-9a-f]{64}")
"""A head's digest: SHA-256 in lower-case hex."""
_PARTS = ("program", "weights")
_SHAPE_KEY = b"hapi.input_shape"


def head_descriptor(digest: str) -> flight.FlightDescriptor:
    """The `do_put` descriptor of the head with `digest`."""
    return flight.FlightDescriptor.for_path(HEAD_PATH, digest)


def head_digest_of(descriptor: flight.FlightDescriptor) -> str:
    """The digest a `do_put` descriptor names.

    Raises:
        InvalidRequest: a descriptor that is not a head upload's (hapi takes no other puts).
    """
    path: list[str] = []
    if descriptor.descriptor_type == flight.DescriptorType.PATH:
        path = [p.decode("utf-8", "replace") for p in descriptor.path or []]
    if len(path) != 2 or path[0] != HEAD_PATH or not DIGEST.fullmatch(path[1]):
        raise InvalidRequest(
            f"hapi servers do not answer do_put but to upload a head, to the descriptor "
            f"path [{HEAD_PATH!r}, <sha256 hex digest>]; got {shorten(repr(path), 200)}: "
            "use TransferJob(model=<your module>) or Connection.put_head"
        )
    return path[1]


def head_schema(input_shape: tuple[int, ...]) -> pa.Schema:
    """The schema of a head upload for inputs of per-sample `input_shape`."""
    return pa.schema(
        [("part", pa.string()), ("data", pa.binary())],
        metadata={_SHAPE_KEY: json.dumps(list(input_shape)).encode()},
    )


def head_batches(artifact: HeadArtifact) -> Iterator[pa.RecordBatch]:
    """The artifact as upload batches: its program, then its weights, in pieces."""
    schema = head_schema(artifact.input_shape)
    for part, data in zip(_PARTS, (artifact.program, artifact.weights), strict=True):
        view = memoryview(data)
        for start in range(0, max(len(view), 1), PIECE_BYTES):
            piece = view[start : start + PIECE_BYTES]
            yield pa.record_batch(
                [pa.array([part], pa.string()), pa.array([piece.tobytes()], pa.binary())],
                schema=schema,
            )


class HeadReceiver:
    """Assembles an uploaded artifact from its batches, checking size and digest.

    Args:
        digest: the digest the descriptor named.
        schema: the upload stream's schema.
        max_bytes: the largest artifact (program and weights) the server keeps.

    Raises:
        InvalidRequest: a schema that is not a head upload's.
    """

    def __init__(self, digest: str, schema: pa.Schema, max_bytes: int) -> None:
        if schema.names != ["part", "data"]:
            raise InvalidRequest(
                f"a head upload has the columns ['part', 'data'], got {shorten(repr(schema.names))}"
            )
        try:
            shape = json.loads((schema.metadata or {})[_SHAPE_KEY])
        except (KeyError, ValueError) as exc:
            raise InvalidRequest(
                f"a head upload's schema must say its input shape ({_SHAPE_KEY.decode()})"
            ) from exc
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise InvalidRequest(
                f"a head's input shape is a list of ints, got {shorten(repr(shape))}"
            )
        self.digest = digest
        self.input_shape = tuple(shape)
        self.max_bytes = max_bytes
        self._parts: dict[str, list[bytes]] = {part: [] for part in _PARTS}
        self._last = 0
        self.nbytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        """Take one batch of the stream.

        Raises:
            InvalidRequest: an unknown part, parts out of order, or more bytes than
                `max_bytes` (nothing more is kept).
        """
        parts, pieces = batch.column(0).to_pylist(), batch.column(1).to_pylist()
        for part, data in zip(parts, pieces, strict=True):
            if part not in _PARTS or _PARTS.index(part) < self._last or data is None:
                raise InvalidRequest(
                    "a head upload sends its program, then its weights; got part "
                    f"{shorten(repr(part))}"
                )
            self._last = _PARTS.index(part)
            self.nbytes += len(data)
            if self.nbytes > self.max_bytes:
                raise InvalidRequest(
                    f"head {self.digest[:12]}... is larger than this server's limit of "
                    f"{self.max_bytes} bytes for an uploaded head: cut earlier (a smaller "
                    "head), or ask the operator to raise the limit"
                )
            self._parts[part].append(data)

    def artifact(self) -> HeadArtifact:
        """The artifact received.

        Raises:
            IntegrityError: its content does not match the digest the descriptor named.
            InvalidRequest: a bad input shape.
        """
        program, weights = (b"".join(self._parts[p]) for p in _PARTS)
        return HeadArtifact(
            program=program, weights=weights, input_shape=self.input_shape, digest=self.digest
        )
