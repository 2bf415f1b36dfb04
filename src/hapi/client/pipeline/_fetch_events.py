"""The events fetching records in a job's history: one line for a person, and details."""

from __future__ import annotations

from hapi.client.pipeline._flow import Flow
from hapi.client.pipeline.history import Event
from hapi.client.pipeline.routing import Route
from hapi.client.servers.pool import Member
from hapi.data import ObjectStore
from hapi.errors import shorten

__all__ = ["failover", "fallback", "reroute", "retry"]


def reroute(epoch: int, flow: Flow, old: Route) -> Event:
    """`flow` follows a change of the plan's cut with its keys not yet delivered."""
    left = len(flow.remaining)
    return Event(
        "reroute",
        epoch,
        flow.index,
        f"chunk {flow.index}: the plan's cut changed; its {left} keys not yet delivered go "
        f"at {_cut_name(flow.route)} (were {_cut_name(old)})",
        {"from": old.wire_cut, "to": flow.route.wire_cut, "keys_left": left},
    )


def failover(epoch: int, flow: Flow, old: Member, why: str) -> Event:
    """`flow` moved from `old`, which failed, to its new server."""
    left, new = len(flow.remaining), flow.member
    return Event(
        "failover",
        epoch,
        flow.index,
        f"chunk {flow.index}: {old.address} failed ({why}); its {left} keys not yet "
        f"delivered go to {new.address}",
        {"error": why, "from": old.address, "to": new.address, "keys_left": left},
    )


def fallback(epoch: int, flow: Flow, store: ObjectStore) -> Event:
    """`flow`'s keys read from the store and computed in the trainer: no server answers."""
    left = len(flow.remaining)
    return Event(
        "fallback",
        epoch,
        flow.index,
        f"chunk {flow.index}: no server answers; its {left} keys not yet delivered were "
        f"read from {store} and computed here",
        {"keys_left": left, "store": str(store)},
    )


def retry(epoch: int, flow: Flow, error: BaseException | None, attempt: int, wait: float) -> Event:
    """`flow` asked for again after `error`, in `wait` seconds."""
    name, left = type(error).__name__, len(flow.remaining)
    return Event(
        "retry",
        epoch,
        flow.index,
        f"chunk {flow.index}: {name}, retry {attempt} in {wait:.2f} s for its {left} keys "
        "not yet delivered",
        {
            "error": name,
            "message": shorten(str(error)),
            "attempt": attempt,
            "wait_s": wait,
            "keys_left": left,
        },
    )


def _cut_name(route: Route) -> str:
    return "raw bytes (local)" if route.local else f"cut {route.cut}"
