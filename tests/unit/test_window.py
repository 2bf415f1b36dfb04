"""The trainer's receive window: sized from a real round trip on loopback."""

from __future__ import annotations

import pickle
import socket

import pytest

from hapi.client import connect
from hapi.client.servers._window import (
    FLOOR,
    PER_STREAM_RATE,
    grpc_options,
    held_window,
    receive_window,
    round_trip,
)
from hapi.errors import InvalidRequest


def test_a_short_link_gets_the_floor_and_a_long_one_its_bandwidth_delay_product() -> None:
    assert receive_window(0.0001) == FLOOR  # a veth: 50 KB at the per-stream rate
    assert receive_window(0.010) == int(0.010 * PER_STREAM_RATE)  # 5 MB on a 10 ms link
    assert receive_window(0.050) > receive_window(0.010)


def test_the_window_is_held_only_when_one_was_sized() -> None:
    assert grpc_options(None) == []  # gRPC's own probe
    assert dict(grpc_options(65536)) == {
        "grpc.http2.bdp_probe": 0,
        "grpc.http2.lookahead_bytes": 65536,
    }


def test_the_round_trip_is_a_handshake_with_the_servers_port() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        rtt = round_trip(f"grpc://127.0.0.1:{port}")
        assert rtt is not None and 0 < rtt < 0.5
        assert receive_window(rtt) == FLOOR  # loopback is a short link
        assert round_trip(f"grpc+tls://localhost:{port}") is not None


@pytest.mark.parametrize("address", ["grpc://127.0.0.1", "unix:///tmp/hapi.sock"])
def test_an_address_without_a_port_keeps_grpcs_probe(address: str) -> None:
    assert round_trip(address) is None


def test_a_server_that_does_not_answer_keeps_grpcs_probe() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, never listening: the port refuses
        port = taken.getsockname()[1]
        assert round_trip(f"grpc://127.0.0.1:{port}", timeout=0.5) is None


def test_connect_takes_a_window_and_a_pickled_connection_keeps_it() -> None:
    assert connect("127.0.0.1:1").receive_window == "grpc"  # the probe, unless asked
    conn = connect("127.0.0.1:1", receive_window=65536)
    assert pickle.loads(pickle.dumps(conn)).receive_window == 65536
    assert held_window(conn.address, "grpc") is None
    assert held_window(conn.address, 262144) == 262144
    assert held_window(conn.address, "auto") is None  # nothing listens: gRPC's probe


@pytest.mark.parametrize("window", ["fast", 0, 512, True, 1.5e6])
def test_a_window_that_is_not_one_is_refused_with_the_forms_it_takes(window: object) -> None:
    with pytest.raises(InvalidRequest, match="'auto'.*'grpc'.*number of bytes"):
        connect("127.0.0.1:1", receive_window=window)  # type: ignore[arg-type]
