"""A real SeaweedFS cluster for tests and benchmarks on 127.0.0.1: a master, volume servers,
and a filer with its S3 gateway - each its own process, stopped by its pid.

`SeaweedS3` (`weed mini`) runs all of them in one process with one volume server; a
cluster is what locality needs: several volume servers, each holding some of a bucket's
volumes, with a `hapi serve` beside each (`hapi serve --beside`).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from hapi.data import StoreOptions

from .launcher import Launched, free_port
from .seaweed import ACCESS_KEY, SECRET_KEY, new_bucket, weed_binary

__all__ = ["SeaweedCluster"]


def _get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return dict(json.loads(reply.read()))


@dataclass
class _Weed(Launched):
    """One `weed` server process (master, volume or filer)."""

    args: Sequence[str] = ()
    ready: Callable[[], object] = lambda: None
    env: dict[str, str] = field(default_factory=dict)

    name = "weed"
    log_name = "weed.log"

    def start(self, timeout: float = 60.0) -> Self:
        cmd = [weed_binary(), "-logtostderr", f"-config_dir={self.data_dir}", *self.args]
        return self._launch(cmd, self.ready, timeout, env=self.env, interval=0.3)


@dataclass
class SeaweedCluster:
    """A master, `volumes` volume servers and a filer with the S3 gateway, on loopback.

    Args:
        data_dir: where every process keeps its data and log.
        volumes: volume servers.
        replication: the master's default replication (`001`: every volume on two servers
            of the rack).
    """

    data_dir: Path
    volumes: int = 3
    replication: str = "000"
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, _Weed] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def filer_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['filer']}"

    @property
    def volume_urls(self) -> list[str]:
        """Each volume server's URL, in order."""
        return [f"http://127.0.0.1:{self.ports[f'volume{i}']}" for i in range(self.volumes)]

    @property
    def options(self) -> StoreOptions:
        return StoreOptions(
            endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY
        )

    def new_bucket(self, prefix: str = "hapi") -> str:
        """A fresh, empty bucket's URI (an admin's first write creates it)."""
        return new_bucket(self.options, prefix)

    def start(self, timeout: float = 60.0) -> Self:
        """Start the master, then the volume servers, then the filer and its gateway.

        Raises:
            RuntimeError: a process exited or was not ready in `timeout`; all are stopped.
        """
        taken: set[int] = set()
        names = ["master", *(f"volume{i}" for i in range(self.volumes)), "filer", "s3"]
        for name in names:
            self.ports.setdefault(name, free_port(taken))
        try:
            self._start_master(timeout)
            for i in range(self.volumes):
                self.start_volume(i, timeout)
            self._start_filer(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _weed(
        self, name: str, args: list[str], ready: Callable[[], object], timeout: float
    ) -> None:
        where = self.data_dir / name
        where.mkdir(parents=True, exist_ok=True)
        # TMPDIR keeps the sockets weed makes in the temp directory out of /tmp.
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        env["TMPDIR"] = str(where)
        self.procs[name] = _Weed(where, args=args, ready=ready, env=env).start(timeout)

    def _start_master(self, timeout: float) -> None:
        port = self.ports["master"]
        args = [
            "master", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={port}",
            f"-mdir={self.data_dir / 'master'}", "-peers=none", "-telemetry=false",
            f"-defaultReplication={self.replication}", "-volumeSizeLimitMB=64",
        ]  # fmt: skip
        self._weed("master", args, lambda: _get(f"http://127.0.0.1:{port}/cluster/status"), timeout)

    def start_volume(self, i: int, timeout: float = 60.0) -> None:
        """Start volume server `i` (again, after `stop_volume`: same port and data)."""
        port = self.ports[f"volume{i}"]
        args = [
            "volume", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={port}",
            f"-dir={self.data_dir / f'volume{i}'}", "-max=100", "-preStopSeconds=0",
            f"-master=127.0.0.1:{self.ports['master']}", "-dataCenter=dc1", "-rack=r1",
        ]  # fmt: skip
        self._weed(f"volume{i}", args, lambda: self._registered(port), timeout)

    def stop_volume(self, i: int) -> None:
        """Stop volume server `i` by its pid (a storage node that went away)."""
        self.procs.pop(f"volume{i}").stop(grace=0.0)

    def _registered(self, port: int) -> None:
        """Raise until the master lists the volume server on `port`."""
        status = json.dumps(_get(f"http://127.0.0.1:{self.ports['master']}/dir/status"))
        if f"127.0.0.1:{port}" not in status:
            raise RuntimeError(f"volume server {port} not registered yet")

    def _start_filer(self, timeout: float) -> None:
        args = [
            "filer", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={self.ports['filer']}",
            f"-master=127.0.0.1:{self.ports['master']}", "-s3", f"-s3.port={self.ports['s3']}",
            f"-localSocket={self.data_dir / 'filer' / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 'filer' / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-defaultStoreDir={self.data_dir / 'filer'}",
        ]  # fmt: skip
        self._weed("filer", args, lambda: self.new_bucket("ready"), timeout)

    def stop(self) -> None:
        """Stop every process this cluster started, by its pid; the filer first."""
        for name in reversed(list(self.procs)):
            self.procs.pop(name).stop(grace=1.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
