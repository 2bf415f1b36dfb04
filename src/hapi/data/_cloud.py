"""GCS and Azure Blob stores on obstore: which URIs name them, and how their clients are made.

obstore reads each cloud's usual environment variables itself (`GOOGLE_SERVICE_ACCOUNT`,
`GOOGLE_APPLICATION_CREDENTIALS`, `AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`,
`AZURE_STORAGE_SAS_TOKEN`, `AZURE_STORAGE_USE_EMULATOR`...); `StoreOptions` fields, when set,
win over them. Kept apart from `store.py` so that each cloud's settings are read in one place.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from hapi.errors import InvalidRequest, shorten

if TYPE_CHECKING:
    from hapi.data.store import StoreOptions

__all__ = ["cloud_client", "credential_hint", "endpoint_hint", "is_cloud", "is_remote"]

GCS_SCHEMES = frozenset({"gs"})
# The forms obstore's AzureStore.from_url parses: az://container/path, azure://container/path,
# abfs[s]://container@account.dfs.core.windows.net/path, https://account.blob.core.windows.net/
# container/path.
AZURE_SCHEMES = frozenset({"az", "azure", "abfs", "abfss"})
_AZURE_HOSTS = (".blob.core.windows.net", ".dfs.core.windows.net")


def is_azure(uri: str) -> bool:
    """Whether `uri` names an Azure Blob container (any form obstore accepts)."""
    parsed = urlparse(uri)
    if parsed.scheme == "https":
        return (parsed.hostname or "").endswith(_AZURE_HOSTS)
    return parsed.scheme in AZURE_SCHEMES


def is_cloud(uri: str) -> bool:
    """Whether `uri` names a GCS bucket or an Azure container."""
    return urlparse(uri).scheme in GCS_SCHEMES or is_azure(uri)


def is_remote(uri: str) -> bool:
    """Whether `uri` names a store reached over the network (S3, GCS, Azure)."""
    return urlparse(uri).scheme == "s3" or is_cloud(uri)


def credential_hint(uri: str) -> str:
    """Where the credentials of `uri`'s kind of store come from, for an error message."""
    if urlparse(uri).scheme in GCS_SCHEMES:
        return (
            "the service account (StoreOptions.service_account, GOOGLE_SERVICE_ACCOUNT or "
            "GOOGLE_APPLICATION_CREDENTIALS)"
        )
    if is_azure(uri):
        return (
            "the account and its key or SAS token (StoreOptions.account_name/account_key, "
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN)"
        )
    return "the access key and secret (options, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"


def endpoint_hint(uri: str, options: StoreOptions) -> str:
    """The endpoint a store is reached at, and how it is set, for an error message."""
    if urlparse(uri).scheme in GCS_SCHEMES:
        where = options.endpoint or os.environ.get("GOOGLE_BASE_URL") or "the GCS endpoint"
        return f"{where} (--endpoint, GOOGLE_BASE_URL or the service account's gcs_base_url)"
    if is_azure(uri):
        where = options.endpoint or os.environ.get("AZURE_STORAGE_ENDPOINT") or "the account"
        return f"{where} (--endpoint or AZURE_STORAGE_ENDPOINT)"
    where = options.endpoint or os.environ.get("AWS_ENDPOINT_URL") or "the AWS S3 endpoint"
    return f"{where} (--endpoint or AWS_ENDPOINT_URL)"


def cloud_client(
    uri: str, options: StoreOptions, client_options: dict[str, Any], retry: dict[str, Any]
) -> Any:
    """The obstore store of a GCS or Azure URI.

    Raises:
        InvalidRequest: the URI names no bucket or container, or a required setting (the
            Azure account, say) is set nowhere; the message names it and where to set it.
    """
    from obstore.store import AzureStore, GCSStore

    parsed = urlparse(uri)
    config: dict[str, Any] = {}
    make: Any  # GCSStore.from_url or AzureStore.from_url: the same call, typed per cloud
    if options.endpoint:
        config["base_url" if parsed.scheme in GCS_SCHEMES else "endpoint"] = options.endpoint
    if parsed.scheme in GCS_SCHEMES:
        if not parsed.netloc:
            raise InvalidRequest(f"{shorten(repr(uri))} names no bucket: use gs://bucket/prefix")
        if options.service_account:
            _check_file(options.service_account, "service_account")
            config["service_account"] = options.service_account
        make, kind = GCSStore.from_url, "GCS"
    else:
        if not (parsed.netloc and parsed.netloc.split("@")[0]):
            raise InvalidRequest(
                f"{shorten(repr(uri))} names no container: use az://container/prefix"
            )
        if options.account_name:
            config["account_name"] = options.account_name
        if options.account_key:
            config["account_key"] = options.account_key
        make, kind = AzureStore.from_url, "Azure"
    try:
        return make(uri, config=config, client_options=client_options, retry_config=retry)
    except Exception as exc:
        # obstore checks its settings here ("Account must be specified"): say where to set
        # the one it lacks.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequest(
            f"cannot open {kind} store {shorten(repr(uri))}: {shorten(reason)}; set "
            f"{credential_hint(uri)}"
            + (", or AZURE_STORAGE_USE_EMULATOR=true for Azurite" if kind == "Azure" else "")
        ) from None


def _check_file(path: str, name: str) -> None:
    # obstore reads the file on first use and reports a missing one as a failed request.
    if not os.path.isfile(path):
        raise InvalidRequest(
            f"{name} {shorten(repr(path))} is not a file: give the path of a service "
            "account JSON key"
        )
