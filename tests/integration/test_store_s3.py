"""The store facade on a real S3 server (SeaweedFS): the shared contract, auth and outages."""

from __future__ import annotations

import pytest

from hapi.data import DatasetManifest, StoreOptions, open_store, synth_dataset
from hapi.errors import ObjectNotFound, StoreUnavailable

from ..seaweed import SeaweedS3
from ..store_contract import check_store_contract


@pytest.mark.s3
def test_store_contract(s3_bucket: tuple[str, StoreOptions]) -> None:
    check_store_contract(open_store(*s3_bucket))


@pytest.mark.s3
def test_a_store_under_a_prefix_sees_relative_keys(s3_bucket: tuple[str, StoreOptions]) -> None:
    uri, options = s3_bucket
    open_store(f"{uri}/datasets", options).put("train/a/1.jpg", b"x")
    root = open_store(uri, options)
    assert list(root.list()) == ["datasets/train/a/1.jpg"]
    assert list(open_store(f"{uri}/datasets", options).list("train")) == ["train/a/1.jpg"]


@pytest.mark.s3
def test_a_dataset_round_trips_through_s3(s3_bucket: tuple[str, StoreOptions]) -> None:
    store = open_store(*s3_bucket)
    written = synth_dataset(store, "train", classes=2, per_class=3, size=16)
    assert DatasetManifest.from_store(open_store(*s3_bucket), "train") == written
    assert len(written) == 6


@pytest.mark.s3
@pytest.mark.parametrize(
    ("key_id", "secret", "code"),
    [("nope", "nope", "InvalidAccessKeyId"), (None, "nope", "SignatureDoesNotMatch")],
)
def test_wrong_credentials_are_refused_clearly(
    seaweed: SeaweedS3,
    s3_bucket: tuple[str, StoreOptions],
    key_id: str | None,
    secret: str,
    code: str,
) -> None:
    uri, options = s3_bucket
    open_store(uri, options).put("x", b"1")
    bad = StoreOptions(
        endpoint=seaweed.endpoint,
        access_key_id=key_id or options.access_key_id,
        secret_access_key=secret,
    )
    with pytest.raises(StoreUnavailable, match=rf"{uri} refused .*{code}.*access key"):
        open_store(uri, bad).get("x")


@pytest.mark.s3
def test_anonymous_requests_are_refused(
    seaweed: SeaweedS3, s3_bucket: tuple[str, StoreOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    uri, _ = s3_bucket
    with pytest.raises(StoreUnavailable, match="refused"):
        open_store(uri, StoreOptions(endpoint=seaweed.endpoint)).put("x", b"1")


@pytest.mark.s3
def test_a_missing_bucket_is_named(seaweed: SeaweedS3) -> None:
    with pytest.raises(ObjectNotFound, match="s3://no-such-bucket-here.*does not exist"):
        list(open_store("s3://no-such-bucket-here", seaweed.options).list())


# Retries are few and short (StoreOptions.max_retries): an outage is reported in well
# under a second, not after minutes of backoff. The timeout guards that, loosely.
@pytest.mark.timeout(20)
def test_a_store_that_is_down_fails_fast_and_names_itself() -> None:
    options = StoreOptions(endpoint="http://127.0.0.1:9", access_key_id="k", secret_access_key="s")
    store = open_store("s3://downbucket", options)
    with pytest.raises(StoreUnavailable, match=r"s3://downbucket failed on 'x'.*running"):
        store.get("x")
    with pytest.raises(StoreUnavailable, match="s3://downbucket"):
        list(store.list())
