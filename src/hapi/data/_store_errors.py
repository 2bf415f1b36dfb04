"""Mapping obstore's exceptions onto hapi's errors, with messages that say what to do."""

from __future__ import annotations

import re

from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable

__all__ = ["is_not_implemented", "translate"]


def is_not_implemented(exc: Exception) -> bool:
    from obstore.exceptions import NotSupportedError

    return isinstance(exc, NotSupportedError | NotImplementedError)


def translate(exc: Exception, uri: str, key: str) -> Exception:
    """Map obstore's exceptions onto hapi's errors, naming the key and the store."""
    from obstore.exceptions import (
        InvalidPathError,
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    if isinstance(exc, InvalidRequest | ObjectNotFound | StoreUnavailable):
        return exc
    if isinstance(exc, NotFoundError | FileNotFoundError):
        return ObjectNotFound(f"object {key!r} not found in store {uri}")
    if isinstance(exc, InvalidPathError):
        return InvalidRequest(f"invalid object key {key!r} for store {uri}: {_first_line(exc)}")
    code = _s3_code(exc)
    if code == "NoSuchBucket":
        return ObjectNotFound(
            f"the bucket of store {uri} does not exist: create it, or check the URI"
        )
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        return StoreUnavailable(
            f"store {uri} refused the request for {key!r} ({code or 'access denied'}): check "
            "the access key and secret (options, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
        )
    return StoreUnavailable(
        f"store {uri} failed on {key!r}: {code or type(exc).__name__}: {_first_line(exc)}. "
        "Check that the store is running and the endpoint and credentials are right."
    )


def _s3_code(exc: Exception) -> str:
    """The `<Code>` of an S3 error body quoted in obstore's message, or ''."""
    match = re.search(r"<Code>([A-Za-z]+)</Code>", str(exc))
    return match.group(1) if match else ""


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    # obstore quotes the S3 XML body after a colon; the <Code> says it better.
    return line.removesuffix('<?xml version="1.0" encoding="UTF-8"?>').rstrip(": ")
