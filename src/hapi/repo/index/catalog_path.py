"""Where a repository's catalog is cached: one file per store, named by what the store is.

Two handles share a catalog file exactly when they reach the same objects, so the file is
named by everything that picks the store: for S3 the bucket and prefix *and* the endpoint
(the same `s3://models` on MinIO and on AWS are different buckets), with the same
`AWS_ENDPOINT_URL` fallback the store itself uses. Credentials are left out on purpose:
two keys for one bucket read the same objects.
"""

from __future__ import annotations

import hashlib
import os
from urllib.parse import urlparse

from hapi._cache_home import cache_home
from hapi.data.store import StoreOptions

__all__ = ["default_catalog_path", "store_identity"]


def store_identity(uri: str, options: StoreOptions | None = None) -> str:
    """A string that names the store `uri` reaches with `options`: equal strings, one store.

    Args:
        uri: a directory, `file:///dir`, `s3://bucket/prefix` or `memory://name`.
        options: S3 endpoint and region; unset ones fall back to `AWS_ENDPOINT_URL` and
            `AWS_REGION` as they do when the store is opened.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "memory":
        return uri
    if parsed.scheme == "s3":
        prefix = parsed.path.strip("/")
        endpoint = (options.endpoint if options else None) or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            where = _normal_endpoint(endpoint)
        else:
            # Without an endpoint the region picks AWS's (and its partition: aws-cn, ...).
            region = (options.region if options else None) or os.environ.get("AWS_REGION")
            where = f"aws:{region or 'us-east-1'}"
        return f"s3://{parsed.netloc}/{prefix}\n{where}"
    path = parsed.path if parsed.scheme == "file" else uri
    return "file://" + os.path.realpath(os.path.expanduser(path))


def default_catalog_path(uri: str, options: StoreOptions | None = None) -> str:
    """Where the catalog of the repository at `uri` is kept unless told otherwise.

    A file per store (see `store_identity`) under `$HAPI_CACHE_DIR` (default
    `~/.cache/hapi`); `:memory:` for a `memory://` store, whose contents die with the
    process anyway.
    """
    if uri.startswith("memory://"):
        return ":memory:"
    digest = hashlib.sha256(store_identity(uri, options).encode()).hexdigest()[:16]
    return str(cache_home() / f"repo-{digest}.sqlite")


def _normal_endpoint(endpoint: str) -> str:
    # Scheme and host are case-insensitive; a trailing slash names the same endpoint.
    parsed = urlparse(endpoint.strip())
    if not parsed.scheme or not parsed.netloc:
        return endpoint.strip().rstrip("/")
    path = parsed.path.rstrip("/")
    return f"{parsed.scheme.lower()}://{parsed.netloc.lower()}{path}"
