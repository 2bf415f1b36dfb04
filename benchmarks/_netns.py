"""A real shaped link for benchmarks: two network namespaces joined by a veth pair.

The storage side lives in one namespace, the trainer in the other; the storage side's end
of the veth is shaped with `tc tbf` (these machines have no `netem`), so everything the
server sends crosses a link of the given rate, as it would across a storage network.
`set_rate` changes the rate while traffic flows (the re-planning benchmark). Needs root;
the namespaces and the veth are removed on exit, whatever happened.

    with ShapedLink("25mbit") as link:
        server = subprocess.Popen(link.storage_cmd(["hapi", "serve", ...]))
        trainer = subprocess.run(link.trainer_cmd([...]))   # connects to link.storage_ip
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

__all__ = ["BURST", "ShapedLink"]


BURST = "8kb"
"""tbf's bucket, at every rate.

What fills the bucket while the link idles crosses at the veth's speed: with a 64 KB
bucket a 65 KB chunk crossed a 10 Mbit/s link in 2.5 ms (26 MB/s, 20x the rate) and
130 KB at 2.3 MB/s, so late cuts ran faster than any real 10 Mbit/s link allows and the
re-planner, reading those turns, believed the link 2-4x faster than it was. With 8 KB a
65 KB turn after an idle link reads 1.35 MB/s at 10 Mbit/s and 12.4 MB/s at 100 Mbit/s,
and a 1.6 MB one gets 0.95x of the rate (0.98x with 64 KB; 103 MB/s at 1 Gbit/s with
either). One size for every rate: a bucket sized to each rate (1 ms of it) stalled the
connection (30 s without a byte) in 3 of 4 changes from 1 Gbit/s (125 KB) to 10 Mbit/s
(4-8 KB).
Measured with a socket pair across the link.
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _mac(ns: str, dev: str) -> str:
    shown = subprocess.run(
        ["ip", "-n", ns, "-o", "link", "show", dev], check=True, capture_output=True, text=True
    ).stdout.split()
    return shown[shown.index("link/ether") + 1]


class ShapedLink:
    """Two namespaces, `storage` and `trainer`, joined by a veth shaped on the storage side.

    Args:
        rate: the storage side's egress, in tc's units (`10mbit`, `1gbit`).
        subnet: the third octet of the private 10.77.N.0/24 net (one per concurrent link).
    """

    def __init__(self, rate: str, *, subnet: int | None = None) -> None:
        tag = f"{os.getpid() % 100000}"
        self.storage = f"hapi-s{tag}"
        self.trainer = f"hapi-t{tag}"
        n = subnet if subnet is not None else os.getpid() % 200 + 20
        self.storage_ip = f"10.77.{n}.1"
        self.trainer_ip = f"10.77.{n}.2"
        self.rate = rate
        self._veth = (f"vs{tag}", f"vt{tag}")

    def __enter__(self) -> ShapedLink:
        vs, vt = self._veth
        try:
            _ip("netns", "add", self.storage)
            _ip("netns", "add", self.trainer)
            _ip("link", "add", vs, "type", "veth", "peer", "name", vt)
            _ip("link", "set", vs, "netns", self.storage)
            _ip("link", "set", vt, "netns", self.trainer)
            for ns, dev, addr in (
                (self.storage, vs, self.storage_ip),
                (self.trainer, vt, self.trainer_ip),
            ):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            # Each side knows the other's MAC for good: ARP goes through tbf's queue too,
            # and with a small bucket a full queue dropped its probes until the neighbour
            # failed and streams broke with "No route to host".
            for ns, dev, peer_ns, peer_dev, peer_addr in (
                (self.storage, vs, self.trainer, vt, self.trainer_ip),
                (self.trainer, vt, self.storage, vs, self.storage_ip),
            ):
                mac = _mac(peer_ns, peer_dev)
                _ip("-n", ns, "neigh", "replace", peer_addr, "lladdr", mac,
                    "dev", dev, "nud", "permanent")  # fmt: skip
            self._tc("add")
        except BaseException:
            self.__exit__()
            raise
        return self

    def set_rate(self, rate: str) -> None:
        """Change the link's rate now; streams in flight slow down or speed up at once."""
        self.rate = rate
        self._tc("change")

    def _tc(self, verb: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", self.storage, "tc", "qdisc", verb, "dev", self._veth[0],
             "root", "tbf", "rate", self.rate, "burst", BURST, "latency",
             "100ms"],
            check=True, capture_output=True,
        )  # fmt: skip

    def storage_cmd(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the storage namespace."""
        return ["ip", "netns", "exec", self.storage, *argv]

    def trainer_cmd(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the trainer namespace."""
        return ["ip", "netns", "exec", self.trainer, *argv]

    def __exit__(self, *exc: object) -> None:
        # Deleting a namespace deletes the veth end inside it, and with it its peer.
        for ns in (self.storage, self.trainer):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
