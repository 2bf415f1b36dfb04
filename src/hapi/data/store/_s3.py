"""S3 (and S3-compatible: SeaweedFS, MinIO, Ceph) stores on obstore: the client of an
`s3://bucket/prefix` URI, and where its endpoint and credentials are set."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from hapi.data.store.options import StoreOptions, check_endpoint, http_options
from hapi.errors import InvalidRequest

__all__ = ["CREDENTIALS", "s3_client", "s3_endpoint"]

CREDENTIALS = "the access key and secret (options, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
"""Where an S3 store's credentials come from, for an error message."""


def s3_client(uri: str, options: StoreOptions, create: bool) -> Any:
    """The obstore store of an S3 URI (`create` is a local directory's; unused here).

    Raises:
        InvalidRequest: the URI names no bucket, or `AWS_ENDPOINT_URL` is no http(s) URL.
    """
    from obstore.store import S3Store

    parsed = urlparse(uri)
    if not parsed.netloc:
        raise InvalidRequest(f"{uri!r} names no bucket: use s3://bucket/prefix")
    endpoint = options.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and not options.endpoint:
        check_endpoint(endpoint, "AWS_ENDPOINT_URL")
    config: dict[str, str] = {
        "region": options.region or os.environ.get("AWS_REGION", "us-east-1"),
    }
    key_id = options.access_key_id or os.environ.get("AWS_ACCESS_KEY_ID")
    secret = options.secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key_id and secret:
        config["access_key_id"] = key_id
        config["secret_access_key"] = secret
    else:
        config["skip_signature"] = "true"
    if endpoint:
        config["endpoint"] = endpoint
    client_options, retry = http_options(options)
    return S3Store(
        parsed.netloc,
        prefix=parsed.path.strip("/") or None,
        config=config,  # type: ignore[arg-type]
        client_options=client_options,  # type: ignore[arg-type]
        retry_config=retry,  # type: ignore[arg-type]
    )


def s3_endpoint(options: StoreOptions) -> str:
    """The endpoint an S3 store is reached at, and how it is set, for an error message."""
    where = options.endpoint or os.environ.get("AWS_ENDPOINT_URL") or "the AWS S3 endpoint"
    return f"{where} (--endpoint or AWS_ENDPOINT_URL)"
