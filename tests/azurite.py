"""A real Azure Blob emulator (Azurite, the npm package) for tests, on 127.0.0.1, stopped by pid.

`.ci/run` installs Azurite with npm into its cache (`$HAPI_CI_CACHE/azurite-VERSION`) and
puts it on PATH; a developer can do the same, or point `HAPI_AZURITE` at `azurite-blob`.
Containers are made with one Shared Key signed request (obstore has no call for it), with
Azurite's well-known development account.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import os
import shutil
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from hapi.data import StoreOptions

from .launcher import Launched, free_port

__all__ = ["ACCOUNT", "ACCOUNT_KEY", "AZURITE_VERSION", "Azurite", "azurite_binary"]

AZURITE_VERSION = "3.37.0"
# Azurite's published development account (the same in every Azurite): not a secret.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_binary() -> str:
    """The `azurite-blob` to run: `HAPI_AZURITE`, on PATH, or in .ci/run's cache.

    Raises:
        RuntimeError: there is none, saying how to install it.
    """
    cache = Path(os.environ.get("HAPI_CI_CACHE", Path.home() / ".cache" / "hapi-ci"))
    cached = cache / f"azurite-{AZURITE_VERSION}" / "node_modules" / ".bin" / "azurite-blob"
    for found in (os.environ.get("HAPI_AZURITE"), shutil.which("azurite-blob"), str(cached)):
        if found and os.access(found, os.X_OK):
            return found
    raise RuntimeError(
        "Azurite is missing: run .ci/run once, or `npm install --prefix "
        f"{cached.parents[2]} azurite@{AZURITE_VERSION}` (or set HAPI_AZURITE)"
    )


@dataclass
class Azurite(Launched):
    """One `azurite-blob` on 127.0.0.1. Use as a context manager, or `start()`/`stop()`.

    Interface for tests: `endpoint`, `options` (a `StoreOptions` with the endpoint and the
    account's key), `client_env` (the same as environment variables) and `new_container()`.
    """

    port: int = 0

    name = "Azurite"
    log_name = "azurite.log"

    @property
    def endpoint(self) -> str:
        """The blob endpoint URL (path style: the account is the first path segment)."""
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def options(self) -> StoreOptions:
        """Store options that reach this emulator with valid credentials."""
        return StoreOptions(endpoint=self.endpoint, account_name=ACCOUNT, account_key=ACCOUNT_KEY)

    @property
    def client_env(self) -> dict[str, str]:
        """Environment variables that point a process (`hapi serve`) at this emulator."""
        return {
            "AZURE_STORAGE_ENDPOINT": self.endpoint,
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY,
        }

    def new_container(self, prefix: str = "hapi") -> str:
        """Create a fresh, empty container and return its URI (`az://<prefix>-<random>`)."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        date = email.utils.formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
        # Shared Key: the verb, eleven empty standard headers, the x-ms-* headers and the
        # resource (the account twice: once for the key, once in the path-style URL).
        signed = "PUT\n" + "\n" * 11
        signed += "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        signed += f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        mac = hmac.new(base64.b64decode(ACCOUNT_KEY), signed.encode(), hashlib.sha256)
        signature = base64.b64encode(mac.digest()).decode()
        request = urllib.request.Request(
            f"{self.endpoint}/{name}?restype=container",
            method="PUT",
            headers={**headers, "Authorization": f"SharedKey {ACCOUNT}:{signature}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 201, response.status
        return f"az://{name}"

    def start(self, timeout: float = 60.0) -> Azurite:
        """Start Azurite and wait until it creates a container.

        Raises:
            RuntimeError: no Azurite, or it exited or was not ready in `timeout`.
        """
        binary = azurite_binary()
        self.port = self.port or free_port()
        cmd = [
            binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(self.data_dir / "data"), "--disableTelemetry", "--silent",
            "--skipApiVersionCheck",
        ]  # fmt: skip
        return self._launch(cmd, lambda: self.new_container("ready"), timeout)
