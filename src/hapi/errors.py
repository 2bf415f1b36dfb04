"""hapi's one hierarchy of domain errors.

Every error a user can cause is a `HapiError`. Subclasses also subclass the built-in they
mean (`ObjectNotFound` is a `FileNotFoundError`), so callers that know only the standard
library still catch them. They keep their message in `args` and take no other constructor
arguments, which keeps them safe to pickle into DataLoader workers and lets `hapi.wire`
send them across the network by class name and message alone.
"""

from __future__ import annotations

import re
import secrets

__all__ = [
    "ECHO_LIMIT",
    "CorruptObject",
    "DuplicateDelivery",
    "Forbidden",
    "HapiError",
    "IncompleteEpoch",
    "IntegrityError",
    "InternalError",
    "InvalidCut",
    "InvalidRequest",
    "MemoryBusy",
    "NotDecoded",
    "NothingToTrain",
    "ObjectNotFound",
    "OverBudget",
    "RefNotFound",
    "RepoError",
    "ServerUnavailable",
    "SessionNotFound",
    "StoreUnavailable",
    "StreamRecalled",
    "Unauthenticated",
    "UnknownCodec",
    "UnknownModel",
    "error_class",
    "shorten",
]

ECHO_LIMIT = 200
"""Characters of a request's value an error message repeats: enough to recognise it, and
a 10 MB field cannot make an error too large to send (gRPC caps metadata at 16 KiB)."""


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` cut to about `limit` characters, saying how much was left out.

    Use it wherever a message repeats input: `f"no model {shorten(repr(name))}"`.
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit} more characters)"


class HapiError(Exception):
    """Base of every error hapi raises on purpose."""


class ObjectNotFound(HapiError, FileNotFoundError):
    """An object (image, tensor blob, manifest) is not in the store."""


class StoreUnavailable(HapiError, ConnectionError):
    """The object store cannot be reached or refused the request."""


class CorruptObject(HapiError, ValueError):
    """An object exists but cannot be decoded (not an image, truncated, wrong hash)."""


class UnknownModel(HapiError, LookupError):
    """A model name or weights name hapi does not know."""


class InvalidCut(HapiError, ValueError):
    """A cut outside the model's cut points or past the freeze point."""


class InvalidRequest(HapiError, ValueError):
    """A request or configuration that is malformed."""


class OverBudget(InvalidRequest):
    """A request or object the server's memory budget cannot hold: a sample, an image or a
    head larger than the budget allows (the message names the budget)."""


class MemoryBusy(OverBudget):
    """Memory the budget could hold, but not while other sessions hold theirs: a job
    retries it (`retry_budget_s`) until they close."""


class SessionNotFound(HapiError, KeyError):
    """A chunk or action names a session the server does not hold."""

    def __str__(self) -> str:
        # KeyError quotes its message; a session error should read as a sentence.
        return str(self.args[0]) if self.args else ""


class Unauthenticated(HapiError, PermissionError):
    """A request without a valid token."""


class Forbidden(HapiError, PermissionError):
    """A tenant asked for a key, prefix or session outside what it may use."""


class ServerUnavailable(HapiError, ConnectionError):
    """A hapi server cannot be reached."""


class StreamRecalled(ServerUnavailable):
    """A chunk stream cut on purpose by `Connection.recall`: the server is there, and the
    keys it had not delivered are asked for again at once (no backoff)."""


class InternalError(HapiError, RuntimeError):
    """A server failed in a way it did not expect; the id finds the details in its log.

    The client gets only this message: the traceback, which may show the server's files
    and data, stays in the server's log under the id.
    """

    @classmethod
    def new(cls) -> InternalError:
        """An error with a fresh random id, to log next to the traceback."""
        error_id = secrets.token_hex(6)
        return cls(
            f"internal error {error_id}: the server failed unexpectedly and logged the "
            "details under this id; retry, or give the id to the server's operator"
        )

    @property
    def error_id(self) -> str | None:
        """The id in the message (None for a message `new` did not write)."""
        # The id lives in the message, so the error pickles and crosses the wire as
        # its message alone, like every other hapi error.
        match = re.match(r"internal error ([0-9a-f]+):", str(self))
        return match.group(1) if match else None


class DuplicateDelivery(HapiError, RuntimeError):
    """A key arrived twice in one epoch: a chunk was delivered more than once."""


class IncompleteEpoch(HapiError, RuntimeError):
    """Keys of an epoch were neither delivered nor reported as skipped."""


class NotDecoded(HapiError, TypeError):
    """Raw object bytes reached code that needs features, or features reached the decoder
    of raw bytes: a RAW session's loader needs a decoder, and only it."""


class NothingToTrain(HapiError, ValueError):
    """A model whose parameters are all frozen: `fit` would change nothing."""


class RepoError(HapiError):
    """Base of model repository errors."""


class RefNotFound(RepoError, LookupError):
    """A model name, version or id that the repository does not hold."""


class IntegrityError(RepoError, ValueError):
    """Stored bytes do not match their content hash, or a model does not match its manifest."""


class UnknownCodec(RepoError, ValueError):
    """A tensor blob compressed with a codec this version of hapi cannot read. Not
    corruption: `fsck --repair` keeps such blobs; a newer hapi reads them."""


def error_class(name: str) -> type[HapiError]:
    """Return the error class called `name`, or `HapiError` when there is none.

    Used by `hapi.wire` to raise on the client the error the server raised.
    """
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, HapiError):
        return cls
    return HapiError
