"""Errors across the wire: a `HapiError` raised by the server is raised again on the client.

The server sends the error's class name and message as JSON after a fixed marker inside a
Flight error; the client finds the marker, and raises the same `hapi.errors` class. Nothing
else of the server's exception (no traceback, no pickle) leaves the server.
"""

from __future__ import annotations

import json

import pyarrow.flight as flight

from hapi.errors import HapiError, ServerUnavailable, Unauthenticated, error_class

__all__ = ["decode_error", "encode_error"]

_MARKER = "hapi-error:"


def encode_error(exc: HapiError) -> flight.FlightError:
    """The Flight error to raise in a server handler for `exc`."""
    body = _MARKER + json.dumps({"type": type(exc).__name__, "message": str(exc)})
    if isinstance(exc, Unauthenticated):
        return flight.FlightUnauthenticatedError(body)
    return flight.FlightServerError(body)


def decode_error(exc: Exception, address: str = "") -> Exception:
    """The `HapiError` a Flight client error stands for (or `exc` itself if none)."""
    text = str(exc)
    start = text.find(_MARKER)
    if start >= 0:
        try:
            body, _ = json.JSONDecoder().raw_decode(text, start + len(_MARKER))
            return error_class(body["type"])(body["message"])
        except (ValueError, KeyError, TypeError):
            pass
    if isinstance(exc, flight.FlightUnavailableError | flight.FlightTimedOutError):
        return ServerUnavailable(
            f"hapi server {address or ''} is unreachable ({_first_line(text)}); "
            "check that `hapi serve` is running there and the address is right"
        )
    if isinstance(exc, flight.FlightUnauthenticatedError):
        return Unauthenticated(f"server {address} refused the request: {_first_line(text)}")
    return exc


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
