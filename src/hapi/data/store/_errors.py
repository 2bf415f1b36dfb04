"""Mapping obstore's exceptions onto hapi's errors, with messages that say what to do."""

from __future__ import annotations

import re

from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable, shorten

__all__ = ["connect_failure", "is_not_implemented", "translate"]


def is_not_implemented(exc: Exception) -> bool:
    from obstore.exceptions import NotSupportedError

    return isinstance(exc, NotSupportedError | NotImplementedError)


def connect_failure(exc: Exception) -> str | None:
    """Why a request never reached the store ('Connection refused', a DNS error, a timeout),
    or None when it did (the store answered, perhaps with an error)."""
    text = str(exc)
    if "kind: Connect" not in text and "kind: Timeout" not in text:
        return None
    # obstore raises a GenericError here with no structured cause; its message, which
    # ends in Rust's debug form of the cause, is all there is. The innermost says it best.
    found = re.findall(r'(?:message|error): "([^"]+)"', text)
    if found:
        return found[-1]
    return "timed out" if "kind: Timeout" in text else "cannot connect"


def translate(exc: Exception, uri: str, key: str, credentials: str) -> Exception:
    """Map obstore's exceptions onto hapi's errors, naming the key and the store;
    `credentials` says where the store's are set (`Scheme.credentials`)."""
    from obstore.exceptions import (
        InvalidPathError,
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    if isinstance(exc, InvalidRequest | ObjectNotFound | StoreUnavailable):
        return exc
    what = shorten(repr(key)) if key else "its listing"
    if isinstance(exc, NotFoundError | FileNotFoundError):
        return ObjectNotFound(f"object {shorten(repr(key))} not found in store {uri}")
    if isinstance(exc, InvalidPathError):
        return InvalidRequest(
            f"invalid object key {shorten(repr(key))} for store {uri}: {_first_line(exc)}"
        )
    code = _s3_code(exc)
    if code in ("NoSuchBucket", "ContainerNotFound"):
        return ObjectNotFound(
            f"the bucket of store {uri} does not exist: create it, or check the URI"
        )
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or code in _AUTH_CODES:
        return StoreUnavailable(
            f"store {uri} refused the request for {what} ({code or 'access denied'}): "
            f"check {credentials}"
        )
    reason = connect_failure(exc)
    if reason is not None:
        return StoreUnavailable(
            f"store {uri} failed on {what}: no answer ({reason}). Check that the store is "
            "running and that the endpoint is right."
        )
    return StoreUnavailable(
        f"store {uri} failed on {what}: {code or type(exc).__name__}: "
        f"{shorten(_first_line(exc))}. Check that the store is running and the endpoint "
        "and credentials are right."
    )


# S3 (and Azure) codes of a refused signature or key; obstore reports some of them as a
# GenericError.
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AuthorizationHeaderMalformed",
        "AuthenticationFailed",
        "AuthorizationFailure",
    }
)


def _s3_code(exc: Exception) -> str:
    """The `<Code>` of an S3 or Azure error body quoted in obstore's message, or ''."""
    match = re.search(r"<Code>([A-Za-z]+)</Code>", str(exc))
    return match.group(1) if match else ""


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    # obstore quotes the S3 XML body after a colon; the <Code> says it better.
    return line.removesuffix('<?xml version="1.0" encoding="UTF-8"?>').rstrip(": ")
