"""GCS and Azure Blob stores on obstore: how their clients are made, and where their
endpoints and credentials are set.

obstore reads each cloud's usual environment variables itself (`GOOGLE_SERVICE_ACCOUNT`,
`GOOGLE_APPLICATION_CREDENTIALS`, `AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`,
`AZURE_STORAGE_SAS_TOKEN`, `AZURE_STORAGE_USE_EMULATOR`...); `StoreOptions` fields, when set,
win over them. Kept apart from the facade so that each cloud's settings are read in one place.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from hapi.data.store.options import StoreOptions, http_options
from hapi.errors import InvalidRequest, shorten

__all__ = [
    "AZURE_CREDENTIALS",
    "AZURE_HOSTS",
    "GCS_CREDENTIALS",
    "azure_client",
    "azure_endpoint",
    "gcs_client",
    "gcs_endpoint",
]

GCS_CREDENTIALS = (
    "the service account (StoreOptions.service_account, GOOGLE_SERVICE_ACCOUNT or "
    "GOOGLE_APPLICATION_CREDENTIALS)"
)
"""Where a GCS store's credentials come from, for an error message."""
AZURE_CREDENTIALS = (
    "the account and its key or SAS token (StoreOptions.account_name/account_key, "
    "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN)"
)
"""Where an Azure store's credentials come from, for an error message."""
AZURE_HOSTS = (".blob.core.windows.net", ".dfs.core.windows.net")
"""Hosts of the `https://account.blob.core.windows.net/container/path` form of Azure URI."""


def gcs_client(uri: str, options: StoreOptions, create: bool) -> Any:
    """The obstore store of a `gs://bucket/prefix` URI (`create` is unused here).

    Raises:
        InvalidRequest: the URI names no bucket, or the service account file is missing.
    """
    from obstore.store import GCSStore

    if not urlparse(uri).netloc:
        raise InvalidRequest(f"{shorten(repr(uri))} names no bucket: use gs://bucket/prefix")
    config: dict[str, Any] = {}
    if options.endpoint:
        config["base_url"] = options.endpoint
    if options.service_account:
        _check_file(options.service_account, "service_account")
        config["service_account"] = options.service_account
    return _open(GCSStore.from_url, "GCS", uri, options, config, GCS_CREDENTIALS)


def azure_client(uri: str, options: StoreOptions, create: bool) -> Any:
    """The obstore store of an Azure URI, in any form obstore's `AzureStore.from_url` parses
    (`create` is unused here).

    Raises:
        InvalidRequest: the URI names no container, or the account is set nowhere.
    """
    from obstore.store import AzureStore

    netloc = urlparse(uri).netloc
    if not (netloc and netloc.split("@")[0]):
        raise InvalidRequest(f"{shorten(repr(uri))} names no container: use az://container/prefix")
    config: dict[str, Any] = {}
    if options.endpoint:
        config["endpoint"] = options.endpoint
    if options.account_name:
        config["account_name"] = options.account_name
    if options.account_key:
        config["account_key"] = options.account_key
    return _open(
        AzureStore.from_url,
        "Azure",
        uri,
        options,
        config,
        AZURE_CREDENTIALS + ", or AZURE_STORAGE_USE_EMULATOR=true for Azurite",
    )


def gcs_endpoint(options: StoreOptions) -> str:
    """The endpoint a GCS store is reached at, and how it is set, for an error message."""
    where = options.endpoint or os.environ.get("GOOGLE_BASE_URL") or "the GCS endpoint"
    return f"{where} (--endpoint, GOOGLE_BASE_URL or the service account's gcs_base_url)"


def azure_endpoint(options: StoreOptions) -> str:
    """The endpoint an Azure store is reached at, and how it is set, for an error message."""
    where = options.endpoint or os.environ.get("AZURE_STORAGE_ENDPOINT") or "the account"
    return f"{where} (--endpoint or AZURE_STORAGE_ENDPOINT)"


def _open(
    make: Any, kind: str, uri: str, options: StoreOptions, config: dict[str, Any], hint: str
) -> Any:
    # `make`: GCSStore.from_url or AzureStore.from_url, the same call typed per cloud.
    client_options, retry = http_options(options)
    try:
        return make(uri, config=config, client_options=client_options, retry_config=retry)
    except Exception as exc:
        # obstore checks its settings here ("Account must be specified"): say where to set
        # the one it lacks.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequest(
            f"cannot open {kind} store {shorten(repr(uri))}: {shorten(reason)}; set {hint}"
        ) from None


def _check_file(path: str, name: str) -> None:
    # obstore reads the file on first use and reports a missing one as a failed request.
    if not os.path.isfile(path):
        raise InvalidRequest(
            f"{name} {shorten(repr(path))} is not a file: give the path of a service "
            "account JSON key"
        )
