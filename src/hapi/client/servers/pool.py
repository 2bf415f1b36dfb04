"""`Servers`: the servers a loop spreads its chunks over, and which one takes each chunk.

Any server can read any object; one that says some prefixes are local to it
(`hapi serve --local-prefix`) is preferred for chunks whose keys lie there. A chunk goes
to the server expected to finish it first, by its samples in flight and measured rate; a
server that fails is set aside for a cool-down that doubles with each failure in a row,
up to `MAX_COOLDOWN_S`. The reasons: `docs/loader.md`, "Several servers".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from hapi.client.servers.sessions import Sessions
from hapi.client.servers.source import Server
from hapi.data.store.keys import key_under
from hapi.errors import InvalidRequest

__all__ = ["LOCAL_GAIN", "MAX_COOLDOWN_S", "Member", "Servers"]

LOCAL_GAIN = 0.5
"""How much sooner a server is expected to finish a chunk whose keys are all local to it:
its expected time is multiplied by `1 - LOCAL_GAIN x (the local share of the keys)`."""

MAX_COOLDOWN_S = 8.0
"""Longest time a failed server is set aside before a chunk tries it again."""

_FIRST_COOLDOWN_S = 0.5
_DECAY = 0.7
"""Weight of the past in a server's rate, at each chunk it finishes."""


class Member:
    """One server of the loop: its sessions and what the loop knows of it."""

    def __init__(self, index: int, sessions: Sessions) -> None:
        self.index = index
        self.sessions = sessions
        self.rate: float | None = None
        """Samples per second while it has work (decayed sums); None before its first."""
        self._samples = 0.0
        self._seconds = 0.0
        self._since = 0.0
        """When its last chunk finished, or it got work after none."""
        self.inflight = 0
        """Samples of chunks given to it and not yet finished or moved away."""
        self.failures = 0
        """Failures in a row (reset by a chunk it finishes)."""
        self.down_until = 0.0
        """Monotonic time until which it is set aside."""

    def _busy(self, now: float) -> None:
        """It gets work: after an idle spell its busy time starts now."""
        if self.inflight == 0:
            self._since = now

    def _finished(self, now: float, samples: int, measured: bool) -> None:
        """A chunk of `samples` finished at `now`; `measured`: it counts toward the rate."""
        if measured and samples > 0:
            self._samples = _DECAY * self._samples + samples
            self._seconds = _DECAY * self._seconds + max(0.0, now - self._since)
            if self._seconds > 0:
                self.rate = self._samples / self._seconds
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

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members)

    def pick(self, keys: Sequence[str], *, avoid: Member | None = None) -> Member:
        """The server for a chunk of `keys`, which are counted as in flight there.

        Args:
            keys: the chunk's keys not yet delivered.
            avoid: the server the chunk failed on; chosen again only if every other
                server is set aside for longer.
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
                local = {m.index: m.local_share(keys) for m in up}
                # On a tie, the server the keys are local to.
                chosen = min(
                    up,
                    key=lambda m: (
                        self._finish_s(m, keys, default, local[m.index]),
                        -local[m.index],
                    ),
                )
            chosen._busy(now)
            chosen.inflight += len(keys)
            return chosen

    def usable(self, member: Member) -> bool:
        """Whether `member` is not set aside now."""
        return member.down_until <= self._clock()

    def others_usable(self, member: Member) -> bool:
        """Whether a server other than `member` is not set aside now."""
        now = self._clock()
        return any(m.down_until <= now for m in self.members if m is not member)

    def finished(self, member: Member, held: int, samples: int, *, measured: bool) -> None:
        """A chunk finished on `member`.

        Args:
            held: its keys counted in flight there.
            samples: the samples it brought.
            measured: whether it counts toward the rate (not after a failure: its time
                was the failure's).
        """
        with self._lock:
            member.inflight = max(0, member.inflight - held)
            member.failures = 0
            member._finished(self._clock(), samples, measured)

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

    def _finish_s(self, member: Member, keys: Sequence[str], default: float, local: float) -> float:
        """When `member` would finish a chunk of `keys`, `local` of them local to it."""
        rate = member.rate if member.rate is not None else default
        return (member.inflight + len(keys)) / rate * (1.0 - LOCAL_GAIN * local)

    def __enter__(self) -> Servers:
        with contextlib.ExitStack() as stack:
            for member in self.members:
                stack.enter_context(member.sessions)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
