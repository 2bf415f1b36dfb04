"""`Servers`: the servers a loop spreads its chunks over, and which one takes each chunk.

Any server can read any object; one beside the storage node that holds a chunk's bytes
(`hapi serve --beside`, `Placement`) or that says the chunk's prefix is local to it
(`--local-prefix`) is preferred for it. A chunk goes
to the server expected to finish it first, by its samples in flight and measured rate; a
server that fails is set aside for a cool-down that doubles with each failure in a row,
up to `MAX_COOLDOWN_S`. The reasons: `docs/loader.md`, "Several servers".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from hapi.client.servers.placement import Placement
from hapi.client.servers.sessions import Sessions
from hapi.client.servers.source import Server
from hapi.data.store.keys import key_under
from hapi.errors import HapiError, InvalidRequest

__all__ = ["LOCAL_GAIN", "MAX_COOLDOWN_S", "REMOTE_MARGIN", "REMOTE_PRIOR", "Member", "Servers"]

LOCAL_GAIN = 0.5
"""How much sooner a server is expected to finish a chunk whose keys are all local to it:
its expected time is multiplied by `1 - LOCAL_GAIN x (the local share of the keys)`."""

REMOTE_PRIOR = 0.5
"""A server's rate on chunks whose bytes lie on other nodes (`Placement`), as a share of
its rate on its own, until it has read one. Measured after that, per server."""

REMOTE_MARGIN = 2.0
"""How many times the time its rate says another node's chunk is counted to keep a
server: such a read crosses the storage network - the cost pushdown exists to
remove - and loads the home node's link and disks besides, which the reader's rate does
not see. So where the links between nodes are fast and a node holds more than its
share, the others take its chunks; where those links bind, they take few
(`benchmarks/locality.py`)."""

MAX_COOLDOWN_S = 8.0
"""Longest time a failed server is set aside before a chunk tries it again."""

log = logging.getLogger("hapi.client")

_FIRST_COOLDOWN_S = 0.5
_DECAY = 0.85
"""Weight of the past in a server's rate, at each chunk it finishes: about the last 7
chunks count. A server's streams are read in order, so chunks it made while the one
before was read finish in bursts, a few ms apart; at 0.7 (3 chunks) servers held to
the same share of a core measured 36 to 90 samples/s, and the fast-seeming ones took
the others' chunks away from home (`benchmarks/locality.py`)."""
_MIN_RATE_S = 1.0
"""Busy seconds a rate needs (decayed) before it counts, for the same reason: a first
gap of 5 ms made a server seem 1,700 samples/s against its 50."""


class _Rate:
    """Samples per second while busy: decayed sums of samples and of busy seconds."""

    def __init__(self) -> None:
        self.samples = self.seconds = 0.0
        self.value: float | None = None

    def add(self, samples: int, seconds: float) -> None:
        self.samples = _DECAY * self.samples + samples
        self.seconds = _DECAY * self.seconds + max(0.0, seconds)
        if self.seconds >= _MIN_RATE_S:
            self.value = self.samples / self.seconds


class Member:
    """One server of the loop: its sessions and what the loop knows of it."""

    def __init__(self, index: int, sessions: Sessions) -> None:
        self.index = index
        self.sessions = sessions
        self._rates = {False: _Rate(), True: _Rate()}
        """Its rate on chunks read on its own node (or anywhere, without a placement),
        and on chunks read mostly from other nodes."""
        self._since = 0.0
        """When its last chunk finished, or it got work after none."""
        self.inflight = 0
        """Samples of chunks given to it and not yet finished or moved away."""
        self.failures = 0
        """Failures in a row (reset by a chunk it finishes)."""
        self.down_until = 0.0
        """Monotonic time until which it is set aside."""
        self._first = True

    def _busy(self, now: float) -> None:
        """It gets work: after an idle spell its busy time starts now."""
        if self.inflight == 0:
            self._since = now

    @property
    def rate(self) -> float | None:
        """Samples per second while it has work (decayed sums); None before its first."""
        return self._rates[False].value

    @property
    def remote_rate(self) -> float | None:
        """Its rate on chunks whose bytes lie mostly on other nodes; None before one."""
        return self._rates[True].value

    def _finished(self, now: float, samples: int, measured: bool, remote: bool) -> None:
        """A chunk of `samples` finished at `now`; `measured`: it counts toward the rate
        (`remote`: the one of chunks read mostly on other nodes).

        A server's first chunk does not count: its time holds the session's opening (the
        head loaded, traced) - seconds that made a server seem a tenth as fast as it is,
        and chunks went to the others, away from the node their bytes lie on."""
        first, self._first = self._first, False
        if measured and samples > 0 and not first:
            self._rates[remote].add(samples, now - self._since)
        self._since = now

    @property
    def connection(self) -> Server:
        return self.sessions.connection

    @property
    def address(self) -> str:
        return self.connection.address

    def local_share(self, keys: Sequence[str]) -> float:
        """The share of `keys` under a prefix this server says is local to it (0 while it
        has said nothing: it says so when a session opens)."""
        prefixes = self.sessions.local_prefixes
        if not prefixes or not keys:
            return 0.0
        local = sum(any(key_under(key, p) for p in prefixes) for key in keys)
        return local / len(keys)


class Servers:
    """The servers of one loop; picks a server for each chunk and sets failed ones aside.

    Args:
        sessions: each server's sessions (their connections name the servers).
        clock: monotonic seconds (tests pass a fake).

    Raises:
        InvalidRequest: no server, or one server twice.
    """

    def __init__(
        self, sessions: Sequence[Sessions], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not sessions:
            raise InvalidRequest("a loop needs at least one server")
        addresses = [s.connection.address for s in sessions]
        if len(set(addresses)) != len(addresses):
            raise InvalidRequest(f"a server is listed twice: {addresses}")
        self.members = [Member(i, s) for i, s in enumerate(sessions)]
        self._clock = clock
        self._lock = threading.Lock()
        self.placement: Placement | None = None
        """Where each of the manifest's keys lies (`place`), if the servers can say."""
        self._placed = threading.Lock()
        self._placed_keys: object = None

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members)

    def place(self, keys: Sequence[str]) -> Placement | None:
        """Where `keys` (the manifest's, once per loop) lie beside the servers, found on
        the first call; None where the servers cannot say (a store that cannot, one
        server, a failure: chunks then go by rate alone)."""
        with self._placed:
            if self._placed_keys is not keys:
                self._placed_keys = keys
                try:
                    found = Placement.find([m.connection for m in self.members], keys)
                except HapiError as exc:
                    log.warning("where the keys lie is unknown, chunks go by rate: %s", exc)
                    found = None
                self.placement = found
            return self.placement

    def pick(
        self,
        keys: Sequence[str],
        *,
        avoid: Member | None = None,
        where: np.ndarray | None = None,
        ahead: np.ndarray | None = None,
    ) -> Member:
        """The server for a chunk of `keys`, which are counted as in flight there.

        Args:
            keys: the chunk's keys not yet delivered.
            avoid: the server the chunk failed on; chosen again only if every other
                server is set aside for longer.
            where: the chunk's places in the manifest, for `placement`.
            ahead: per server, the samples it is home to in the chunks still to issue
                (`Backlog.ahead`), with `placement`: a server that is idle now but has
                as much of its own work ahead does not take the chunk from its home.
        """
        with self._lock:
            now = self._clock()
            up = [m for m in self.members if m.down_until <= now and m is not avoid]
            if not up and avoid is not None and avoid.down_until <= now:
                up = [avoid]
            if not up:
                chosen = min(self.members, key=lambda m: m.down_until)
            else:
                rates = [m.rate for m in up if m.rate is not None]
                default = sum(rates) / len(rates) if rates else 1.0
                local = self._local(keys, up, where)
                # On a tie, the server the keys are local to.
                chosen = min(
                    up,
                    key=lambda m: (
                        self._finish_s(m, keys, default, local[m.index], ahead),
                        -local[m.index],
                    ),
                )
                if self.placement is not None and local[chosen.index] < 0.5:
                    self._log_away(chosen, keys, default, local, ahead)
            chosen._busy(now)
            chosen.inflight += len(keys)
            return chosen

    def _log_away(
        self,
        chosen: Member,
        keys: Sequence[str],
        default: float,
        local: dict[int, float],
        ahead: np.ndarray | None,
    ) -> None:
        """Say why a chunk went to a server its bytes do not lie beside (debug)."""
        if not log.isEnabledFor(logging.DEBUG):
            return
        log.debug(
            "a chunk of %d keys to server %d, away from its bytes: %s",
            len(keys),
            chosen.index,
            "; ".join(
                f"{m.index}: local {local[m.index]:.2f} in flight {m.inflight} ahead "
                f"{int(ahead[m.index]) if ahead is not None else '-'} rate "
                f"{m.rate or default:.1f} remote {m.remote_rate or 0:.1f} finish "
                f"{self._finish_s(m, keys, default, local[m.index], ahead):.2f} s"
                for m in self.members
                if m.index in local
            ),
        )

    def usable(self, member: Member) -> bool:
        """Whether `member` is not set aside now."""
        return member.down_until <= self._clock()

    def others_usable(self, member: Member) -> bool:
        """Whether a server other than `member` is not set aside now."""
        now = self._clock()
        return any(m.down_until <= now for m in self.members if m is not member)

    def finished(
        self,
        member: Member,
        held: int,
        samples: int,
        *,
        measured: bool,
        where: np.ndarray | None = None,
    ) -> None:
        """A chunk finished on `member`.

        Args:
            held: its keys counted in flight there.
            samples: the samples it brought.
            measured: whether it counts toward the rate (not after a failure: its time
                was the failure's).
            where: the chunk's places in the manifest (whether its bytes were local).
        """
        remote = self._remote(member, where)
        with self._lock:
            member.inflight = max(0, member.inflight - held)
            member.failures = 0
            member._finished(self._clock(), samples, measured, remote)

    def _remote(self, member: Member, where: np.ndarray | None) -> bool:
        """Whether a chunk at `where` lies mostly on other nodes than `member`'s."""
        if self.placement is None or where is None:
            return False
        return self.placement.shares(where)[member.index] < 0.5

    def failed(self, member: Member) -> float:
        """Set `member` aside after a failure; returns its cool-down in seconds."""
        with self._lock:
            cooldown = min(MAX_COOLDOWN_S, _FIRST_COOLDOWN_S * 2**member.failures)
            member.failures += 1
            member.down_until = max(member.down_until, self._clock() + cooldown)
            return cooldown

    def release(self, member: Member, samples: int) -> None:
        """A chunk left `member` unfinished, `samples` of its keys in flight there."""
        with self._lock:
            member.inflight = max(0, member.inflight - samples)

    def _local(
        self, keys: Sequence[str], up: Sequence[Member], where: np.ndarray | None
    ) -> dict[int, float]:
        """Each server's share of the chunk local to it."""
        if self.placement is not None and where is not None:
            shares = self.placement.shares(where)
            return {m.index: shares[m.index] for m in up}
        return {m.index: m.local_share(keys) for m in up}

    def _finish_s(
        self,
        member: Member,
        keys: Sequence[str],
        default: float,
        local: float,
        ahead: np.ndarray | None,
    ) -> float:
        """When `member` would finish a chunk of `keys`, `local` of them local to it.

        With a placement: its work in flight and its own work `ahead`, then the chunk at
        its rate on chunks like it (its own node's, or others' with `REMOTE_MARGIN`).
        So a chunk leaves its home only when the home has more work before it than the
        other server has - more than its share of the bytes, or a slow server - not when
        the other happens to be idle a moment. Without one: sooner by `LOCAL_GAIN` for
        the local share of a `--local-prefix`."""
        rate = member.rate if member.rate is not None else default
        if self.placement is None:
            return (member.inflight + len(keys)) / rate * (1.0 - LOCAL_GAIN * local)
        queued = member.inflight
        if ahead is not None:
            queued += int(ahead[member.index])
        if local >= 0.5:
            return (queued + len(keys)) / rate
        remote = member.remote_rate if member.remote_rate is not None else rate * REMOTE_PRIOR
        return queued / rate + REMOTE_MARGIN * len(keys) / remote

    def __enter__(self) -> Servers:
        with contextlib.ExitStack() as stack:
            for member in self.members:
                stack.enter_context(member.sessions)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
