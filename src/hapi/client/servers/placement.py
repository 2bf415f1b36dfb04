"""`Placement`: which of a loop's servers each key's bytes lie beside.

Servers started beside a SeaweedFS volume server (`hapi serve --beside`) answer `locate`:
each key's bytes on their node. A key's *home* is the server holding most of its bytes;
a replicated volume is on several nodes, and its keys' homes are spread over them so
that none gets more than its share. The epoch's order groups keys by home
(`hapi.client.pipeline._home_order`) and a chunk goes to a server its bytes lie beside
(`Servers.pick`). Why: docs/locality.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hapi.client.servers.source import Server
from hapi.errors import InvalidRequest
from hapi.wire import MAX_LOCATE_KEYS

__all__ = ["NO_HOME", "Backlog", "Placement"]

log = logging.getLogger("hapi.client")

NO_HOME = -1
"""The home of a key no server holds bytes of (inline in the filer, or no server beside)."""


class Placement:
    """Each key's bytes beside each server.

    Args:
        local: bytes of key i beside server j, shape (keys, servers).
        total: bytes of each key in all.
    """

    def __init__(self, local: np.ndarray, total: np.ndarray) -> None:
        self.local, self.total = local, total
        self.homes = _homes(local)
        """Each key's home server (its index), or `NO_HOME`."""

    @classmethod
    def find(cls, servers: Sequence[Server], keys: Sequence[str]) -> Placement | None:
        """Ask every server where `keys` lie; None when fewer than two servers know where
        they are (one server gets every chunk anyway) or none of them holds a byte.

        Raises:
            HapiError: a server that knows where it is failed to answer (the caller goes
                on without placement).
        """
        if len(servers) < 2 or not keys:
            return None
        local = np.zeros((len(keys), len(servers)), dtype=np.int64)
        total = np.zeros(len(keys), dtype=np.int64)
        answered = 0
        with ThreadPoolExecutor(len(servers), thread_name_prefix="hapi-locate") as pool:
            found = list(pool.map(lambda s: _locate_all(s, keys), servers))
        for j, result in enumerate(found):
            if result is None:
                continue
            answered += 1
            local[:, j], total = result
        if answered < 2 or not local.any():
            return None
        log.info("keys located beside %d servers: %s", answered, _summary(local, total))
        return cls(local, total)

    def shares(self, indices: np.ndarray) -> list[float]:
        """Each server's share of the bytes of keys `indices` that lie beside it."""
        total = int(self.total[indices].sum())
        if total <= 0:
            return [0.0] * self.local.shape[1]
        return [float(x) / total for x in self.local[indices].sum(axis=0)]


class Backlog:
    """The samples each server is home to in an epoch's chunks not yet issued: the work
    ahead of it, which `Servers.pick` weighs before it sends a chunk away from home.

    Args:
        homes: each manifest key's home (`Placement.homes`).
        order: the epoch's manifest places, in order.
        servers: how many servers there are.
    """

    def __init__(self, homes: np.ndarray, order: np.ndarray, servers: int) -> None:
        self.homes, self.servers = homes, servers
        self.epoch = self._count(order)
        """Per server, its keys in the whole epoch."""
        self.rest = self.epoch.copy()
        """Per server, its keys in the chunks not yet issued."""

    def issue(self, where: np.ndarray) -> None:
        """A chunk of the manifest places `where` is issued."""
        self.rest -= self._count(where)

    def ahead(self, *, more: bool) -> np.ndarray:
        """Per server, the samples it is home to from now on; `more`: another epoch
        follows, whose chunks are issued as this one's end (its keys count too)."""
        return self.rest + self.epoch if more else self.rest

    def _count(self, where: np.ndarray) -> np.ndarray:
        homes = self.homes[where]
        return np.bincount(homes[homes != NO_HOME], minlength=self.servers)


def _locate_all(server: Server, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """A server's local bytes and the keys' total bytes; None if it does not know where
    it is."""
    local, total = np.zeros(len(keys), np.int64), np.zeros(len(keys), np.int64)
    for start in range(0, len(keys), MAX_LOCATE_KEYS):
        part = list(keys[start : start + MAX_LOCATE_KEYS])
        try:
            reply = server.locate(part)
        except InvalidRequest:
            return None  # no --beside, or a server older than `locate`
        local[start : start + len(part)] = reply.local
        total[start : start + len(part)] = reply.total
    return local, total


def _homes(local: np.ndarray) -> np.ndarray:
    """Each key's home: the server holding most of its bytes; among servers holding as
    many (replicas), the one with the fewest bytes homed so far."""
    homes = np.full(local.shape[0], NO_HOME, dtype=np.int64)
    best = local.max(axis=1, keepdims=True)
    holders = (local == best) & (best > 0)
    single = holders.sum(axis=1) == 1
    homes[single] = local[single].argmax(axis=1)
    load = np.bincount(homes[single], weights=best[single, 0], minlength=local.shape[1])
    for i in np.flatnonzero(holders.sum(axis=1) > 1):
        candidates = np.flatnonzero(holders[i])
        home = candidates[np.argmin(load[candidates])]
        homes[i] = home
        load[home] += best[i, 0]
    return homes


def _summary(local: np.ndarray, total: np.ndarray) -> str:
    held = local.sum(axis=0)
    return ", ".join(f"{100 * h / max(1, total.sum()):.0f}%" for h in held)
