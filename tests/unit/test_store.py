"""The store facade on memory and a local directory (S3: tests/integration/test_store_s3.py)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from hapi.data import Store, StoreOptions, open_store
from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable

from ..store_contract import INVALID_KEYS, check_store_contract


@pytest.mark.parametrize("kind", ["memory", "local", "file-uri"])
def test_store_contract(kind: str, tmp_path: Path) -> None:
    uri = {
        "memory": f"memory://{tmp_path.name}",
        "local": str(tmp_path / "store"),
        "file-uri": (tmp_path / "store").as_uri(),
    }[kind]
    check_store_contract(open_store(uri))


def test_a_local_store_is_a_plain_directory(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put("train/cat/1.jpg", b"jpeg")
    assert (tmp_path / "train" / "cat" / "1.jpg").read_bytes() == b"jpeg"
    (tmp_path / "train" / "dog").mkdir()
    (tmp_path / "train" / "dog" / "2.jpg").write_bytes(b"made outside")
    assert store.get("train/dog/2.jpg") == b"made outside"


def test_memory_stores_with_one_uri_share_objects() -> None:
    open_store("memory://shared-test").put("k", b"v")
    assert open_store("memory://shared-test").get("k") == b"v"
    with pytest.raises(ObjectNotFound):
        open_store("memory://other-test").get("k")


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_invalid_keys_are_refused_before_any_request(key: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid object key"):
        open_store("memory://keys").get(key)


@pytest.mark.parametrize(
    ("uri", "needle"), [("ftp://host/x", "unknown store URI scheme 'ftp'"), ("s3://", "no bucket")]
)
def test_bad_store_uris_say_what_to_use(uri: str, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        open_store(uri).get("k")


@pytest.mark.parametrize(
    "kwargs", [{"concurrency": 0}, {"connect_timeout": 0}, {"request_timeout": -1.0},
               {"max_retries": -1}]
)  # fmt: skip
def test_store_options_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        StoreOptions(**kwargs)  # type: ignore[arg-type]


def test_opening_a_store_connects_to_nothing() -> None:
    # Nothing listens on port 9: only a request may fail, never the constructor or pickle.
    store = open_store("s3://bucket", StoreOptions(endpoint="http://127.0.0.1:9"))
    assert isinstance(store, Store) and store._client is None


def _read_in_child(store: Store, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        queue.put(store.get("k"))
    except Exception as exc:
        queue.put(exc)


def _read_in(method: str, store: Store) -> object:
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(store, queue), daemon=True)
    child.start()
    try:
        return queue.get(timeout=60)
    finally:
        child.join(10)


def test_a_store_works_in_a_spawned_worker(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put("k", b"before spawn")  # the parent's client exists now
    assert _read_in("spawn", store) == b"before spawn"


def test_a_forked_child_is_refused_clearly_instead_of_hanging(tmp_path: Path) -> None:
    # obstore's runtime does not survive fork(): without the check the read hangs forever.
    store = open_store(tmp_path)
    store.put("k", b"before fork")
    got = _read_in("fork", store)
    assert isinstance(got, StoreUnavailable) and "spawn" in str(got)
