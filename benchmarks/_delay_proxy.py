"""A TCP proxy that gives every request a store's first-byte latency (these machines have
no `netem`): what a client sends waits `delay` before it is passed on, so each HTTP
request reaches the store `delay` late, while responses flow back at once, zero-copy
(`os.splice`), so bulk bytes cost the proxy's core little and keep the link's rate.

    with DelayProxy(("127.0.0.1", 8333), delay_s=0.02, core=1) as proxy:
        ...  # clients use proxy.endpoint instead of http://127.0.0.1:8333

The benchmark starts it as a subprocess (`python _delay_proxy.py PORT HOST:PORT DELAY`)
and ends it by its pid.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["DelayProxy"]

_PIPE = 1 << 20


class DelayProxy:
    """The proxy process in front of `upstream`, on a free loopback port.

    Args:
        upstream: the store's (host, port).
        delay_s: the latency added to each request.
        core: pinned to this core (`_host.taskset`).
    """

    def __init__(self, upstream: tuple[str, int], *, delay_s: float, core: int) -> None:
        self.upstream, self.delay_s, self.core = upstream, delay_s, core
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DelayProxy:
        from _host import taskset

        host, port = self.upstream
        cmd = [*taskset(self.core), sys.executable, str(Path(__file__))]
        cmd += [str(self.port), f"{host}:{port}", str(self.delay_s)]
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.__exit__()
                    raise RuntimeError(f"delay proxy on {self.port} did not start") from None
                time.sleep(0.05)

    def requests(self) -> int:
        """HTTP requests passed on so far."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(b"COUNT\n")
            return int(s.makefile().readline())

    def __exit__(self, *exc: object) -> None:
        from _host import end

        end(self.proc)


_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")
_counted = [0]
_lock = threading.Lock()


def _requests(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    # Requests are small and a client sends the next only after its response: sleeping
    # here holds each one back by `delay_s` from when it arrived.
    try:
        while data := src.recv(1 << 16):
            if data.startswith(_METHODS):
                with _lock:  # one recv per bodiless request (GETs)
                    _counted[0] += 1
            time.sleep(delay_s)
            dst.sendall(data)
    except OSError:
        pass
    _close(src, dst)


def _responses(src: socket.socket, dst: socket.socket) -> None:
    r, w = os.pipe()
    try:
        while n := os.splice(src.fileno(), w, _PIPE):
            while n:
                n -= os.splice(r, dst.fileno(), n)
    except OSError:
        pass
    finally:
        os.close(r)
        os.close(w)
    _close(src, dst)
    for s in (src, dst):
        s.close()


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _serve(port: int, upstream: tuple[str, int], delay_s: float) -> None:
    listener = socket.create_server(("127.0.0.1", port), backlog=256)
    while True:
        client, _ = listener.accept()
        if client.recv(6, socket.MSG_PEEK) == b"COUNT\n":
            client.sendall(f"{_counted[0]}\n".encode())
            client.close()
            continue
        server = socket.create_connection(upstream)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_requests, args=(client, server, delay_s), daemon=True).start()
        threading.Thread(target=_responses, args=(server, client), daemon=True).start()


if __name__ == "__main__":
    host, _, up_port = sys.argv[2].rpartition(":")
    _serve(int(sys.argv[1]), (host, int(up_port)), float(sys.argv[3]))
