"""The HTTP/2 receive window of the trainer's connection, sized from its round trip.

A held window is the link's bandwidth-delay product at `PER_STREAM_RATE`, from the round
trip measured when the connection is made, and never under `FLOOR`: a re-plan's cancel
then recalls what the window held back. gRPC's own bandwidth-delay probe stays the default
(`connect`'s `receive_window="grpc"`): what its windows let through is recalled by closing
the streams' connection (`Connection.recall`). Measurements and why:
`docs/loader.md`, "The receive window".
"""

from __future__ import annotations

import socket
import time
from typing import Literal
from urllib.parse import urlsplit

from hapi.errors import InvalidRequest

__all__ = [
    "FLOOR",
    "PER_STREAM_RATE",
    "Window",
    "check_window",
    "grpc_options",
    "held_window",
    "receive_window",
    "round_trip",
]

Window = int | Literal["auto", "grpc"]
"""A connection's receive window: sized from the round trip, gRPC's probe, or bytes."""

FLOOR = 64 * 1024
"""Bytes: the window on a short link (a storage network, a namespace's veth)."""

PER_STREAM_RATE = 500e6
"""Bytes a second a stream's window must carry at the measured round trip (4 Gbit/s):
on a 10 ms link that is a 5 MB window, and K streams in turn keep the link full."""

_PROBES = 3


def round_trip(address: str, *, timeout: float = 1.0) -> float | None:
    """Seconds of the fastest of three TCP handshakes with `address`'s host and port
    (a handshake is one round trip, answered by the server's kernel); None when the
    address has no port or the server does not answer."""
    parts = urlsplit(address)
    if parts.hostname is None or parts.port is None:
        return None
    best: float | None = None
    for _ in range(_PROBES):
        started = time.perf_counter()
        try:
            with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
                took = time.perf_counter() - started
        except OSError:
            return None
        best = took if best is None else min(best, took)
    return best


def check_window(window: object) -> None:
    """Raises:
    InvalidRequest: `window` is not "auto", "grpc" or a positive number of bytes."""
    if window in ("auto", "grpc"):
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1024:
        raise InvalidRequest(
            f"receive_window={window!r} is not a window: give 'auto' (sized from the round "
            "trip), 'grpc' (gRPC's own probe) or a number of bytes of at least 1024"
        )


def held_window(address: str, window: Window) -> int | None:
    """The bytes to hold each stream's window at for `window`; None: gRPC's probe (asked
    for, or the round trip could not be measured)."""
    if window == "grpc":
        return None
    if window == "auto":
        rtt = round_trip(address)
        return None if rtt is None else receive_window(rtt)
    return window


def receive_window(rtt_s: float) -> int:
    """The window, in bytes, for a link with round trip `rtt_s`."""
    return max(FLOOR, int(rtt_s * PER_STREAM_RATE))


def grpc_options(window: int | None) -> list[tuple[str, int]]:
    """`flight.connect`'s `generic_options` that hold each stream's window at `window`
    bytes (gRPC's own probe when None)."""
    if window is None:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window)]
