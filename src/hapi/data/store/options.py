"""`StoreOptions`: how to reach a remote store, and the settings obstore's clients take
from them (the same for every cloud)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from hapi.errors import InvalidRequest, shorten

__all__ = ["StoreOptions", "check_endpoint", "http_options"]


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How to reach an S3, GCS or Azure store. Unset fields fall back to each cloud's usual
    environment variables (AWS_*, GOOGLE_*, AZURE_STORAGE_*)."""

    endpoint: str | None = None
    """Endpoint URL: S3's (default `AWS_ENDPOINT_URL`), GCS's base URL, or Azure's blob
    endpoint (`http://127.0.0.1:10000/devstoreaccount1` for Azurite)."""
    access_key_id: str | None = None
    """Access key; default `AWS_ACCESS_KEY_ID`."""
    secret_access_key: str | None = None
    """Secret key; default `AWS_SECRET_ACCESS_KEY`."""
    region: str | None = None
    """Region; default `AWS_REGION`, else `us-east-1`."""
    service_account: str | None = None
    """GCS: path of a service account JSON key; default `GOOGLE_SERVICE_ACCOUNT`."""
    account_name: str | None = None
    """Azure: storage account; default `AZURE_STORAGE_ACCOUNT_NAME`."""
    account_key: str | None = None
    """Azure: the account's key; default `AZURE_STORAGE_ACCOUNT_KEY` (or a SAS token)."""
    concurrency: int = 16
    """Reads in flight at once in `get_many`."""
    connect_timeout: float = 5.0
    """Seconds to wait for a connection to a remote store."""
    request_timeout: float = 120.0
    """Seconds one request may take, body included: room for large tensor blobs."""
    max_retries: int = 2
    """Retries of a failed request. Few and fast, so a store that is down is reported
    in well under a second instead of after minutes of backoff."""

    def __post_init__(self) -> None:
        if self.endpoint is not None:
            check_endpoint(self.endpoint, "endpoint")
        if self.concurrency < 1:
            raise InvalidRequest(f"concurrency must be >= 1, got {self.concurrency}")
        if not (self.connect_timeout > 0 and self.request_timeout > 0):
            raise InvalidRequest(
                f"timeouts must be positive seconds, got connect_timeout={self.connect_timeout}"
                f", request_timeout={self.request_timeout}"
            )
        if self.max_retries < 0:
            raise InvalidRequest(f"max_retries must be >= 0, got {self.max_retries}")


def check_endpoint(endpoint: str, name: str) -> None:
    """Refuse an endpoint that is not an http(s) URL, naming the setting (`name`).

    Raises:
        InvalidRequest: `endpoint` has no http(s) scheme or no host.
    """
    # obstore panics on an endpoint without a scheme, with a PanicException that is a
    # BaseException: `except Exception` would miss it.
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidRequest(
            f"{name} {shorten(repr(endpoint))} is not an http(s) URL: write it as "
            "http://host:port or https://host"
        )


def http_options(options: StoreOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """obstore's client options and retry configuration, the same for every cloud."""
    client_options = {
        "allow_http": True,
        "timeout": f"{options.request_timeout}s",
        "connect_timeout": f"{options.connect_timeout}s",
    }
    retry = {
        "max_retries": options.max_retries,
        "backoff": {
            "init_backoff": timedelta(milliseconds=50),
            "max_backoff": timedelta(milliseconds=500),
            "base": 2,
        },
        "retry_timeout": timedelta(seconds=options.request_timeout),
    }
    return client_options, retry
