"""hapi's one hierarchy of domain errors.

Every error a user can cause is a `HapiError`. Subclasses also subclass the built-in they
mean (`ObjectNotFound` is a `FileNotFoundError`), so callers that know only the standard
library still catch them. They keep their message in `args` and take no other constructor
arguments, which keeps them safe to pickle into DataLoader workers and lets `hapi.wire`
send them across the network by class name and message alone.
"""

from __future__ import annotations

__all__ = [
    "CorruptObject",
    "HapiError",
    "IntegrityError",
    "InvalidCut",
    "InvalidRequest",
    "ObjectNotFound",
    "RefNotFound",
    "RepoError",
    "ServerUnavailable",
    "SessionNotFound",
    "StoreUnavailable",
    "Unauthenticated",
    "UnknownModel",
    "error_class",
]


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


class SessionNotFound(HapiError, KeyError):
    """A chunk or action names a session the server does not hold."""

    def __str__(self) -> str:
        # KeyError quotes its message; a session error should read as a sentence.
        return str(self.args[0]) if self.args else ""


class Unauthenticated(HapiError, PermissionError):
    """A request without a valid token."""


class ServerUnavailable(HapiError, ConnectionError):
    """A hapi server cannot be reached."""


class RepoError(HapiError):
    """Base of model repository errors."""


class RefNotFound(RepoError, LookupError):
    """A model name, version or id that the repository does not hold."""


class IntegrityError(RepoError, ValueError):
    """Stored bytes do not match their content hash, or a model does not match its manifest."""


def error_class(name: str) -> type[HapiError]:
    """Return the error class called `name`, or `HapiError` when there is none.

    Used by `hapi.wire` to raise on the client the error the server raised.
    """
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, HapiError):
        return cls
    return HapiError
