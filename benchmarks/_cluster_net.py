"""A storage cluster's networks for benchmarks: storage nodes and a trainer, each in its
own network namespace, joined by two bridges.

- the *storage network* (10.78.1.0/24) joins the nodes to each other: each node's egress
  onto it is shaped with `tc tbf` at `between`, so a read of one node's volume by
  another node crosses a link of that rate;
- the *front network* (10.78.2.0/24) joins the nodes to the trainer: each node's egress
  onto it is shaped at `trainer`.

Every neighbour's MAC is set for good (`_netns.ShapedLink` says why: ARP behind a full
tbf queue broke streams). Needs root; the namespaces and bridges are removed on exit,
whatever happened.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from _netns import BURST, _ip, _mac

__all__ = ["ClusterNet"]


class ClusterNet:
    """`nodes` storage namespaces and a trainer namespace, on two shaped networks.

    Args:
        nodes: storage nodes.
        between: each node's egress to the other nodes, in tc's units (`100mbit`).
        trainer: each node's egress to the trainer.
    """

    def __init__(self, nodes: int, *, between: str, trainer: str) -> None:
        tag = f"{os.getpid() % 10000}"
        self.tag = tag
        self.nodes = [f"hl{tag}n{i}" for i in range(nodes)]
        self.trainer = f"hl{tag}t"
        self.bridges = (f"hl{tag}bs", f"hl{tag}bf")
        self.between, self.to_trainer = between, trainer
        self.storage_ips = [f"10.78.1.{10 + i}" for i in range(nodes)]
        self.front_ips = [f"10.78.2.{10 + i}" for i in range(nodes)]
        self.trainer_ip = "10.78.2.2"

    def __enter__(self) -> ClusterNet:
        try:
            for bridge in self.bridges:
                _ip("link", "add", bridge, "type", "bridge")
                _ip("link", "set", bridge, "up")
            _ip("netns", "add", self.trainer)
            self._join(self.trainer, "f", self.bridges[1], self.trainer_ip)
            for i, ns in enumerate(self.nodes):
                _ip("netns", "add", ns)
                self._join(ns, "s", self.bridges[0], self.storage_ips[i])
                self._join(ns, "f", self.bridges[1], self.front_ips[i])
            self._neighbours()
            for ns in self.nodes:
                self._tc(ns, "s", self.between)
                self._tc(ns, "f", self.to_trainer)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _join(self, ns: str, net: str, bridge: str, addr: str) -> None:
        """Join namespace `ns` to `bridge` by a veth named `<net>` inside it."""
        outside = f"{ns}{net}"[-15:]
        _ip("link", "add", outside, "type", "veth", "peer", "name", f"{net}0", "netns", ns)
        _ip("link", "set", outside, "master", bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{net}0")
        _ip("-n", ns, "link", "set", f"{net}0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _neighbours(self) -> None:
        storage = list(zip(self.nodes, self.storage_ips, strict=True))
        front = [*zip(self.nodes, self.front_ips, strict=True), (self.trainer, self.trainer_ip)]
        for net, members in (("s0", storage), ("f0", front)):
            for ns, _ in members:
                for peer, addr in members:
                    if peer != ns:
                        _ip("-n", ns, "neigh", "replace", addr, "lladdr", _mac(peer, net),
                            "dev", net, "nud", "permanent")  # fmt: skip

    def _tc(self, ns: str, net: str, rate: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", f"{net}0", "root",
             "tbf", "rate", rate, "burst", BURST, "latency", "100ms"],
            check=True, capture_output=True,
        )  # fmt: skip

    def shape(self, *, between: str | None = None) -> None:
        """Change the rate between the nodes now."""
        if between is not None:
            self.between = between
        for ns in self.nodes:
            self._tc(ns, "s", self.between)

    def node_cmd(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside storage node `i`."""
        return ["ip", "netns", "exec", self.nodes[i], *argv]

    def trainer_cmd(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the trainer's namespace."""
        return ["ip", "netns", "exec", self.trainer, *argv]

    def __exit__(self, *exc: object) -> None:
        # Deleting a namespace deletes the veth ends inside it, and with them their peers.
        for ns in [self.trainer, *self.nodes]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for bridge in self.bridges:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)
