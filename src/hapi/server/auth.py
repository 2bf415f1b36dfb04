"""Bearer-token authentication for the Flight server."""

from __future__ import annotations

import hmac

import pyarrow.flight as flight

from hapi.errors import Unauthenticated
from hapi.wire import encode_error

__all__ = ["TokenMiddlewareFactory"]


class TokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Refuses every call that does not carry `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def start_call(
        self, info: flight.CallInfo, headers: dict[str, list[str]]
    ) -> flight.ServerMiddleware | None:
        values = headers.get("authorization", [])
        if not any(hmac.compare_digest(v.encode(), self._expected) for v in values):
            raise encode_error(
                Unauthenticated(
                    "missing or wrong bearer token: pass the server's token "
                    "(hapi.connect(address, token=...) or --token)"
                )
            )
        return None
