"""Errors across the wire: a `HapiError` raised by the server is raised again on the client.

The server puts the error's class name and message as JSON in the Flight error's
`extra_info` bytes; the client reads them from there (never from the message text) and
raises the same `hapi.errors` class. Nothing else of the server's exception (no traceback,
no pickle) leaves the server: `hapi.server` turns any other exception into an
`InternalError` first.
"""

from __future__ import annotations

import json
import re

import pyarrow.flight as flight

from hapi.errors import HapiError, ServerUnavailable, Unauthenticated, error_class, shorten

__all__ = ["MAX_ERROR_MESSAGE", "decode_error", "encode_error"]

MAX_ERROR_MESSAGE = 1000
"""Characters of a message that cross the wire. gRPC sends errors in metadata, refused
beyond 16 KiB, and the message travels twice (text and JSON), up to 4 bytes a character
and escaped: a longer message would turn the error into a transport failure."""


def encode_error(exc: HapiError) -> flight.FlightError:
    """The Flight error to raise in a server handler for `exc`."""
    name = type(exc).__name__
    message = shorten(str(exc), MAX_ERROR_MESSAGE)
    info = json.dumps({"type": name, "message": message}, ensure_ascii=False).encode()
    # The text is for Flight clients that are not hapi; hapi reads only `extra_info`.
    text = f"{name}: {shorten(message, MAX_ERROR_MESSAGE // 2)}"
    if isinstance(exc, Unauthenticated):
        return flight.FlightUnauthenticatedError(text, extra_info=info)
    return flight.FlightServerError(text, extra_info=info)


def decode_error(exc: Exception, address: str = "") -> Exception:
    """The `HapiError` a Flight client error stands for (or `exc` itself if none).

    A server's error comes back as its own class and message; an unknown class name (a
    newer server's) as a plain `HapiError`. A failed TLS handshake, which Flight reports
    as an unreachable server, says so, with what to check.
    """
    body = _error_body(exc)
    if body is not None:
        return error_class(body[0])(body[1])
    text = str(exc)
    if isinstance(exc, flight.FlightUnavailableError | flight.FlightTimedOutError):
        tls = address.startswith("grpc+tls://")
        if tls or _SSL.search(text):
            return ServerUnavailable(
                f"TLS handshake with {address} failed ({_first_line(text)}): check tls_ca (the "
                "CA that signed the server's certificate), that the address's host name is in "
                "the server's certificate, that the server uses TLS (`hapi serve --tls-cert`), "
                "and tls_cert/tls_key if it asks for a client certificate"
            )
        hint = ""
        if "socket closed" in text.lower():
            # What a plain-text client gets from a TLS server: the server hangs up.
            secure = address.replace("grpc://", "grpc+tls://", 1)
            hint = f"; if the server uses TLS, connect to {secure} with tls_ca="
        return ServerUnavailable(
            f"hapi server {address} is unreachable ({_first_line(text)}); "
            f"check that `hapi serve` is running there and the address is right{hint}"
        )
    if isinstance(exc, flight.FlightUnauthenticatedError):
        return Unauthenticated(f"server {address} refused the request: {_first_line(text)}")
    return exc


# gRPC's words for a TLS failure ("Ssl handshake failed", "SSL_ERROR_SSL", "certificate
# verify failed", "wrong version number"): the only sign of it Flight gives.
_SSL = re.compile(r"\bssl|certificate|handshake|wrong version number", re.IGNORECASE)


def _error_body(exc: Exception) -> tuple[str, str] | None:
    """The (class name, message) a hapi server put in the error, or None."""
    info = getattr(exc, "extra_info", None)
    if not info:
        return None
    try:
        body = json.loads(info)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    name, message = body.get("type"), body.get("message")
    if not isinstance(name, str) or not isinstance(message, str):
        return None
    return name, message


def _first_line(text: str) -> str:
    return shorten(text.strip().splitlines()[0], 300) if text.strip() else ""
