"""`Store.check()` and `hapi serve`'s start on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import dataclasses

import pytest

from hapi.data import StoreOptions, open_store
from hapi.errors import ObjectNotFound, StoreUnavailable

from ..seaweed import SeaweedS3


@pytest.mark.s3
def test_check_passes_on_a_bucket_that_is_there(s3_bucket: tuple[str, StoreOptions]) -> None:
    uri, options = s3_bucket
    open_store(f"{uri}/empty-prefix", options).check()
    store = open_store(uri, options)
    store.put("a/1.bin", b"x")
    store.check()


@pytest.mark.s3
def test_check_names_a_missing_bucket_and_wrong_keys(seaweed: SeaweedS3) -> None:
    with pytest.raises(ObjectNotFound, match="does not exist"):
        open_store("s3://hapi-no-such-bucket", seaweed.options).check()
    wrong = dataclasses.replace(seaweed.options, secret_access_key="wrong")
    with pytest.raises(StoreUnavailable, match="access key"):
        open_store(seaweed.new_bucket(), wrong).check()
