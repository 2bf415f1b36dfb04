"""A real Azure Blob emulator (Azurite, the npm package) for tests, on 127.0.0.1, stopped by pid.

Azurite is not on PyPI, so the first test that needs it installs the pinned version with npm
into the cache (`$HAPI_CI_CACHE/azurite-VERSION`, default `~/.cache/hapi-ci`), under a file
lock so parallel workers install it once; `HAPI_AZURITE` or an `azurite-blob` on PATH wins.
Containers are made with one Shared Key signed request (obstore has no call for it), with
Azurite's well-known development account.
"""

from __future__ import annotations

import base64
import email.utils
import fcntl
import hashlib
import hmac
import os
import shutil
import subprocess
import tempfile
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
    """The `azurite-blob` to run: `HAPI_AZURITE`, on PATH, or the cached one, installed with
    npm on first use.

    Raises:
        RuntimeError: it is missing and cannot be installed, saying the command that fixes it.
    """
    for found in (os.environ.get("HAPI_AZURITE"), shutil.which("azurite-blob")):
        if found and os.access(found, os.X_OK):
            return found
    cache = Path(os.environ.get("HAPI_CI_CACHE", Path.home() / ".cache" / "hapi-ci"))
    home = cache / f"azurite-{AZURITE_VERSION}"
    binary = home / "node_modules" / ".bin" / "azurite-blob"
    if not os.access(binary, os.X_OK):
        _install(home)
    return str(binary)


def _install(home: Path) -> None:
    """npm-install the pinned Azurite into `home`, once across processes.

    It goes into a scratch folder renamed into place when whole, so an install killed
    midway leaves nothing that looks installed.
    """
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "the Azure tests need Azurite, which comes from npm, and npm is missing: "
            "install it with `apt-get install -y nodejs npm`"
        )
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be installing it: wait
        if home.exists():
            return
        scratch = Path(tempfile.mkdtemp(prefix=f"{home.name}.", dir=home.parent))
        try:
            done = subprocess.run(
                [npm, "install", "--prefix", str(scratch), "--no-audit", "--no-fund",
                 "--loglevel=error", f"azurite@{AZURITE_VERSION}"],
                capture_output=True, text=True, timeout=600, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(
                    f"`npm install azurite@{AZURITE_VERSION}` failed ({done.returncode}): "
                    f"{done.stderr.strip()[-500:]}"
                )
            scratch.rename(home)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


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
