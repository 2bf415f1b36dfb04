"""Sessions are leases: one neither a chunk nor a keepalive renews is closed, its head freed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hapi.client import connect
from hapi.client.servers.sessions import Sessions
from hapi.data import Transforms, open_store, synth_dataset
from hapi.errors import SessionNotFound
from hapi.graph import ModelSpec
from hapi.server import ServerConfig, serve
from hapi.wire import SessionRequest


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=2, per_class=2, size=40, seed=1)
    return root


def _request(cut: int = 6) -> SessionRequest:
    return SessionRequest(
        model=ModelSpec(name="resnet18", num_classes=2).to_dict(),
        cut=cut,
        freeze=8,
        transforms=Transforms.eval(32).to_dict(),
        image_size=32,
    )


def test_the_default_idle_time_is_a_minute() -> None:
    assert ServerConfig(store="/tmp").session_idle_s == 60


def test_a_session_without_keepalives_is_closed_and_one_with_them_survives(
    store_dir: Path,
) -> None:
    clock = _Clock()
    config = ServerConfig(store=str(store_dir), idle_heads=0, session_idle_s=60)
    with serve(config, clock=clock) as server, connect(server.address) as conn:
        silent = conn.open_session(_request()).session
        kept = conn.open_session(_request(cut=5)).session
        assert len(server.heads) == 2
        for _ in range(4):  # 120 s in all: twice the idle time
            clock.now += 30
            conn.keepalive(kept)
        stats = conn.stats()  # any call closes the abandoned sessions
        assert silent in stats.closed_sessions
        assert kept in stats.sessions
        assert len(server.heads) == 1  # the silent session's head is freed (idle_heads=0)
        with pytest.raises(SessionNotFound):
            conn.keepalive(silent)


def test_the_reaper_closes_a_session_though_no_call_comes(store_dir: Path) -> None:
    clock = _Clock()
    config = ServerConfig(store=str(store_dir), idle_heads=0, session_idle_s=0.5)
    with serve(config, clock=clock) as server, connect(server.address) as conn:
        session = conn.open_session(_request()).session
        clock.now += 1
        _wait_for(lambda: session in server.stats().closed_sessions)
        assert len(server.heads) == 0


def test_an_open_loop_renews_its_sessions_while_it_waits(store_dir: Path) -> None:
    clock = _Clock()
    config = ServerConfig(store=str(store_dir), idle_heads=0, session_idle_s=60)
    with serve(config, clock=clock) as server, connect(server.address) as conn:
        with Sessions(conn, lambda cut: _request(cut), keepalive_s=0.01) as sessions:
            session = sessions.get(6)
            for _ in range(3):  # a stalled job: no chunk for 150 s
                clock.now += 50
                renewed = clock.now
                _wait_for(lambda t=renewed: server._sessions[session].last_used == t)
            assert session in conn.stats().sessions
        assert session in conn.stats().closed_sessions  # closed with the loop


def test_a_session_the_server_lost_is_reopened_by_the_keepalive(store_dir: Path) -> None:
    clock = _Clock()
    config = ServerConfig(store=str(store_dir), idle_heads=0, session_idle_s=60)
    reopened: list[tuple[int, str, str]] = []
    with serve(config, clock=clock) as server, connect(server.address) as conn:
        sessions = Sessions(
            conn,
            lambda cut: _request(cut),
            keepalive_s=0.01,
            on_reopen=lambda *e: reopened.append(e),
        )
        with sessions:
            lost = sessions.get(6)
            conn.close_session(lost)  # as a restarted server would have forgotten it
            _wait_for(lambda: bool(reopened))
            assert reopened[0][:2] == (6, lost)
            new = reopened[0][2]
            assert sessions.get(6) == new
            assert new in server.stats().sessions


def _wait_for(condition: object) -> None:
    """Poll `condition` (a callable) until it holds; fails after a generous minute."""
    assert callable(condition)
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def test_keepalives_follow_the_servers_idle_limit(store_dir: Path) -> None:
    # A server with a short idle limit: the client renews within a third of it, though
    # its own keepalive period (20 s) is longer than the limit.
    config = ServerConfig(store=str(store_dir), idle_heads=0, session_idle_s=3)
    with (
        serve(config) as server,
        connect(server.address) as conn,
        Sessions(conn, lambda cut: _request(cut)) as sessions,
    ):
        session = sessions.get(6)
        opened = server._sessions[session].last_used
        _wait_for(lambda: server._sessions[session].last_used > opened)
        assert sessions.ids() == [session]  # renewed, not lost and re-opened
