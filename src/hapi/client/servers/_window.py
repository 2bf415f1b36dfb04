"""The HTTP/2 receive window of the trainer's connection, sized from its round trip.

A chunk's stream is opened K chunks ahead of its turn, so the server computes while the
trainer trains, and the server sends as far ahead as the trainer's receive window lets it.
gRPC sizes that window with a bandwidth-delay probe, and the probe reads a burst's own
queueing as delay: after a 1 Gbit/s epoch of 393 KB chunks the windows had grown past a
chunk, three chunks' bytes were committed to the connection when the link dropped to
10 Mbit/s, and a re-plan that cancelled their streams still waited 1 s for those bytes to
cross before its first 16 KB chunk came (`benchmarks/RESULTS.md`, the link change). What a
cancel can recall is what the window held back.

A held window is the link's bandwidth-delay product at `PER_STREAM_RATE`, from the round
trip measured when the connection is made, and never under `FLOOR`. Across the same drop
(four streams of 393 KB opened at once, the first read, three cancelled, then a 16 KB
chunk; `benchmarks/window.py`) the whole took 1.32 s with gRPC's probe, 0.51 s with
64 KiB windows and 0.45 s with 32 KiB, where the first chunk's bytes alone need 0.31 s at
10 Mbit/s; at 1 Gbit/s with no drop, 800 KB chunks read in turn moved 105-108 MB/s with a
held window against 110 MB/s with the probe, and hapi's fixed options at 100 Mbit/s and
1 Gbit/s ran 0.97-1.02x their time under the probe - except a hybrid whose link is nearly
full: ResNet-18 to `avgpool+flatten` at 100 Mbit/s with 25% of its chunks local ran 1.11x
(`auto` 1.16x). A stream waiting for its turn can fill only a window ahead, and - most
likely - the next window opens only as the trainer's Python thread reads, which a busy
trainer core delays, where the probe's large windows let gRPC's threads fill the link.

So the probe is the default (`connect`'s `receive_window="grpc"`), and what the windows
let through is recalled another way: a change of plan that moves the chunks in flight
closes their streams' connection (`Connection.recall`), and the server's socket buffer
goes with it. A held window remains an option.
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
