"""Shared fixtures: a real SeaweedFS S3 server for the whole session, fresh buckets per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.data import StoreOptions

from .seaweed import SeaweedS3

# Tests run on the CPU with small models; a second core is the server's in benchmarks only.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A SeaweedFS (`weed mini`) on 127.0.0.1 with S3 signature checks, stopped by its pid.

    Use `seaweed.options` (endpoint + credentials) and `seaweed.new_bucket_uri()`.
    """
    server = SeaweedS3(Path(tmp_path_factory.mktemp("seaweed"))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(seaweed: SeaweedS3) -> tuple[str, StoreOptions]:
    """A fresh, empty bucket: `(uri, options)` for `open_store(uri, options)`."""
    return seaweed.new_bucket_uri(), seaweed.options
