"""Store kinds registered per URL scheme: how each makes its obstore client, says where its
credentials and endpoint are set, and is checked. `scheme_of` finds a URI's.

A new kind of store is one `Scheme` added to `SCHEMES`; the facade (`Store`) never asks
which kind it has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from hapi.data.store._cloud import (
    AZURE_CREDENTIALS,
    AZURE_HOSTS,
    GCS_CREDENTIALS,
    azure_client,
    azure_endpoint,
    gcs_client,
    gcs_endpoint,
)
from hapi.data.store._location import is_windows_drive, local_dir
from hapi.data.store._s3 import CREDENTIALS as S3_CREDENTIALS
from hapi.data.store._s3 import s3_client, s3_endpoint
from hapi.data.store.options import StoreOptions
from hapi.errors import InvalidRequest, shorten

__all__ = ["SCHEMES", "Scheme", "scheme_of"]


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """How hapi reaches the stores of one kind of URI."""

    client: Callable[[str, StoreOptions, bool], Any]
    """Makes the obstore store of `(uri, options, create)`; `create` makes a missing local
    directory. Raises `InvalidRequest` for a URI or a setting it cannot use."""
    credentials: str
    """Where the credentials come from, for an error message (a refused request)."""
    endpoint: Callable[[StoreOptions], str]
    """The endpoint a store is reached at, and how it is set, for an error message."""
    local: bool = False
    """A directory on this machine: keys are paths under its root, which must exist (or
    be made) and which no key may leave through a symlink."""
    remote: bool = False
    """Reached over the network: `Store.check` makes one request to see that it answers."""


# Memory stores are process-wide by URI so two `open_store("memory://x")` calls see the same
# objects, as two handles on one bucket would.
_MEMORY: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()


def _memory_client(uri: str, options: StoreOptions, create: bool) -> Any:
    from obstore.store import MemoryStore

    with _MEMORY_LOCK:
        return _MEMORY.setdefault(uri, MemoryStore())


def _local_client(uri: str, options: StoreOptions, create: bool) -> Any:
    from obstore.store import LocalStore

    return LocalStore(local_dir(uri, create=create))


def _here(options: StoreOptions) -> str:
    return "this machine"


LOCAL = Scheme(
    client=_local_client,
    # A local directory has no credentials: a refusal there is the S3 default's wording,
    # as it always was.
    credentials=S3_CREDENTIALS,
    endpoint=_here,
    local=True,
)
MEMORY = Scheme(client=_memory_client, credentials=S3_CREDENTIALS, endpoint=_here)
S3 = Scheme(client=s3_client, credentials=S3_CREDENTIALS, endpoint=s3_endpoint, remote=True)
GCS = Scheme(client=gcs_client, credentials=GCS_CREDENTIALS, endpoint=gcs_endpoint, remote=True)
AZURE = Scheme(
    client=azure_client, credentials=AZURE_CREDENTIALS, endpoint=azure_endpoint, remote=True
)

SCHEMES: dict[str, Scheme] = {
    "": LOCAL,
    "file": LOCAL,
    "memory": MEMORY,
    "s3": S3,
    "gs": GCS,
    # The forms obstore's AzureStore.from_url parses: az://container/path,
    # azure://container/path, abfs[s]://container@account.dfs.core.windows.net/path (and
    # https://account.blob.core.windows.net/container/path, found by its host).
    "az": AZURE,
    "azure": AZURE,
    "abfs": AZURE,
    "abfss": AZURE,
}
"""Each URL scheme hapi knows, and its kind of store."""


def scheme_of(uri: str) -> Scheme:
    """The kind of store `uri` names: by its scheme, a Windows drive (`C:\\data`) being a
    local directory and an `https` URI on an Azure host an Azure container.

    Raises:
        InvalidRequest: the scheme is not one hapi knows.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "https" and (parsed.hostname or "").endswith(AZURE_HOSTS):
        return AZURE
    found = SCHEMES.get(parsed.scheme)
    if found is not None:
        return found
    if is_windows_drive(uri):
        return LOCAL
    raise InvalidRequest(
        f"unknown store URI scheme {shorten(repr(parsed.scheme))} in {shorten(repr(uri))}: "
        "use a directory path, file:///dir, s3://bucket/prefix, gs://bucket/prefix, "
        "az://container/prefix or memory://"
    )
