"""A SeaweedFS cluster for `locality.py`: a storage node per network namespace (volume
server, filer with its S3 gateway), the photos spread evenly over the nodes.

Each node is a SeaweedFS data center of its own, with as many volumes, and a third of the
photos is written through each node's gateway (`spread_volumes`, `upload`). Every
process is stopped by its pid when the cluster's `with` ends.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

from _cluster_net import ClusterNet
from _host import end, taskset

__all__ = ["BUCKET", "KEY", "PORTS", "SECRET", "cluster", "node_shares"]

KEY, SECRET = "hapi-bench", "hapi-bench-secret"
BUCKET = "photos"
"""The S3 bucket, and so SeaweedFS's collection, the photos are written to."""
PORTS = {"master": 9333, "volume": 8080, "filer": 8888, "s3": 8333, "hapi": 8815}


@contextlib.contextmanager
def cluster(
    nodes: int, trainer: str, args: argparse.Namespace, images: int, replication: str = "000"
) -> Iterator[tuple[ClusterNet, Path, float, list[subprocess.Popen[bytes]]]]:
    """`nodes` storage nodes with `images` photos written, links to the trainer at
    `trainer`, between nodes unshaped until `ClusterNet.shape`; the photos' mean size and
    the volume servers."""
    with (
        tempfile.TemporaryDirectory(prefix="hapi-locality-") as root,
        ClusterNet(nodes, between="10gbit", trainer=trainer) as net,
        ExitStack() as stack,
    ):
        _address_bridges(net)
        volumes = _startcluster(net, Path(root), stack, replication)
        spread_volumes(net, replication)
        yield net, Path(root), upload(net, args, images), volumes


def _address_bridges(net: ClusterNet) -> None:
    """Give this (root) namespace an address on both networks: it uploads the data and
    waits for the servers. Nothing it sends is timed."""
    for bridge, addr in zip(net.bridges, ("10.78.1.1/24", "10.78.2.1/24"), strict=True):
        subprocess.run(["ip", "addr", "add", addr, "dev", bridge], check=True)


def _weed(
    net: ClusterNet, i: int, args: list[str], where: Path, stack: ExitStack
) -> subprocess.Popen[bytes]:
    where.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
           "TMPDIR": str(where)}  # fmt: skip
    weed = str(Path(sys.executable).parent / "weed")
    cmd = net.node_cmd(i, [*taskset(1), weed, "-logtostderr", f"-config_dir={where}", *args])
    log = stack.enter_context(open(where / "weed.log", "ab"))  # noqa: SIM115 - the stack closes it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    stack.callback(end, proc)
    return proc


def _startcluster(
    net: ClusterNet, root: Path, stack: ExitStack, replication: str = "000"
) -> list[subprocess.Popen[bytes]]:
    """A master on node 0; a volume server and a filer with its S3 gateway on every node
    (the volume servers returned), each node a data center of its own. Each node's filer keeps
    the whole namespace (filers follow each other's changes) and writes to its own
    node's volumes first."""
    master = f"{net.storage_ips[0]}:{PORTS['master']}"
    _weed(net, 0, ["master", f"-ip={net.storage_ips[0]}", f"-port={PORTS['master']}",
                   f"-mdir={root / 'master'}", "-peers=none", "-telemetry=false",
                   f"-defaultReplication={replication}", "-volumeSizeLimitMB=64"],
          root / "master", stack)  # fmt: skip
    _wait(f"http://{master}/cluster/status")
    volumes = []
    for i, ip in enumerate(net.storage_ips):
        args = ["volume", f"-ip={ip}", f"-port={PORTS['volume']}", "-max=100",
                f"-dir={root / f'volume{i}'}", f"-master={master}", f"-dataCenter={_site(i)}",
                "-preStopSeconds=0"]  # fmt: skip
        volumes.append(_weed(net, i, args, root / f"volume{i}", stack))
    for ip in net.storage_ips:
        _wait(f"http://{ip}:{PORTS['volume']}/status")
    for i, ip in enumerate(net.storage_ips):
        _weed(net, i, ["filer", f"-ip={ip}", f"-port={PORTS['filer']}", f"-master={master}",
                       f"-dataCenter={_site(i)}", f"-s3.dataCenter={_site(i)}",
                       "-s3", f"-s3.port={PORTS['s3']}", "-s3.port.iceberg=0",
                       "-s3.port.lance=0", f"-defaultStoreDir={root / f'filer{i}'}",
                       f"-localSocket={root / f'filer{i}' / 'f.sock'}",
                       f"-s3.localSocket={root / f'filer{i}' / 's.sock'}"],
              root / f"filer{i}", stack)  # fmt: skip
        # One at a time: a new filer copies the others' metadata, and quits if one it
        # was told of does not answer yet.
        _wait(f"http://{ip}:{PORTS['filer']}/")
    return volumes


def _site(node: int) -> str:
    """The node's data center: SeaweedFS's gateways write to their own data center's
    volumes first (a rack is not enough: a gateway's writes went to another rack's)."""
    return f"node{node}"


def spread_volumes(net: ClusterNet, replication: str, per_node: int = 2) -> None:
    """Grow the bucket's volumes, as many on every node, before anything is written
    (`upload` then writes a third of the photos through each node's gateway).

    A real cluster holds hundreds of volumes, spread evenly, and millions of objects
    over them. Left to itself, SeaweedFS grows 7 volumes for these few MB of photos, on
    nodes it picks at random: 1, 3 and 3 of them in one try, 14%, 43% and 43% of the
    bytes; with 2 volumes a node and one gateway, each object to a volume at random:
    29%, 38% and 34%. A balanced epoch then reads a fifth, or a twentieth, of its bytes
    on other nodes whatever the routing: the benchmark measured SeaweedFS's draw."""
    master = f"http://{net.storage_ips[0]}:{PORTS['master']}"
    for i, ip in enumerate(net.storage_ips):
        query = urllib.parse.urlencode({
            "count": per_node, "collection": BUCKET, "replication": replication,
            "dataCenter": _site(i), "dataNode": f"{ip}:{PORTS['volume']}",
        })  # fmt: skip
        with urllib.request.urlopen(f"{master}/vol/grow?{query}", timeout=60):
            pass


def node_shares(net: ClusterNet) -> list[float]:
    """Each node's share of the bucket's bytes, from its volume server's status."""
    held = []
    for ip in net.storage_ips:
        with urllib.request.urlopen(f"http://{ip}:{PORTS['volume']}/status", timeout=10) as r:
            volumes = json.load(r).get("Volumes") or []
        held.append(sum(v.get("Size", 0) for v in volumes if v.get("Collection") == BUCKET))
    return [round(h / max(1, sum(held)), 3) for h in held]


def _wait(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError as exc:
            if getattr(exc, "code", None) is not None:
                return  # it answers (an error status is an answer)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer") from None
            time.sleep(0.3)


def _options(ip: str) -> Any:
    from hapi.data import StoreOptions

    return StoreOptions(endpoint=f"http://{ip}:{PORTS['s3']}", access_key_id=KEY,
                        secret_access_key=SECRET)  # fmt: skip


def upload(net: ClusterNet, args: argparse.Namespace, images: int) -> float:
    """Write the photos through the nodes' gateways in turn (links not yet shaped), so
    that each node holds as many (`spread_volumes`), and wait until every node's filer
    lists them; their mean size."""
    from hapi.data import ObjectStore, open_store, synth_dataset

    stores = []
    for ip in net.storage_ips:
        deadline = time.monotonic() + 60
        while True:
            try:
                store = open_store(f"s3://{BUCKET}", _options(ip))
                store.put(".ready", b"")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        stores.append(store)
    per_class = images // 4
    synth_dataset(cast("ObjectStore", _InTurn(stores)), "train", classes=4,
                  per_class=per_class, size=args.stored_size, seed=0, quality=90)  # fmt: skip
    for store in stores:
        while len(keys := list(store.list("train"))) < 4 * per_class:
            time.sleep(0.5)
    return statistics.mean(stores[0].size(k) for k in keys[:50])


class _InTurn:
    """Stores that take the writes in turn; everything else goes to the first."""

    def __init__(self, stores: list[Any]) -> None:
        self._stores, self._turn, self._lock = stores, itertools.count(), threading.Lock()

    def put(self, key: str, data: bytes, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            store = self._stores[next(self._turn) % len(self._stores)]
        return store.put(key, data, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stores[0], name)
