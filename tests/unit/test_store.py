"""The store facade on memory and a local directory (S3: tests/integration/test_store_s3.py)."""

from __future__ import annotations

import multiprocessing
import pickle
import shutil
from pathlib import Path

import pytest

from hapi.data import Store, StoreOptions, open_dataset, open_store
from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable

from ..seaweed import free_port
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
    ("kwargs", "needle"),
    [
        ({"concurrency": 0}, "concurrency must be >= 1, got 0"),
        ({"connect_timeout": 0}, "connect_timeout=0"),
        ({"request_timeout": float("nan")}, "request_timeout=nan"),
        ({"max_retries": -1}, "max_retries must be >= 0"),
        ({"endpoint": "127.0.0.1:8333"}, "not an http(s) URL"),
        ({"endpoint": "ftp://host"}, "not an http(s) URL"),
    ],
)
def test_store_options_are_validated(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        StoreOptions(**kwargs)  # type: ignore[arg-type]
    assert needle in str(caught.value)


def test_an_endpoint_without_scheme_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # obstore would panic (a BaseException) on the first request.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "localhost:8333")
    with pytest.raises(InvalidRequest, match="AWS_ENDPOINT_URL 'localhost:8333'"):
        open_store("s3://bucket").get("k")


@pytest.mark.parametrize("key", ["a\x00b", "train/\x00", "a\nb"])
def test_a_key_with_a_control_character_is_an_invalid_request(key: str) -> None:
    store = open_store("memory://control-keys")
    for call in (store.get, store.size, store.exists, store.delete, lambda k: store.put(k, b"")):
        with pytest.raises(InvalidRequest) as caught:
            call(key)
        assert repr(key) in str(caught.value)
    with pytest.raises(InvalidRequest):
        list(store.list(key))


def test_a_long_key_is_quoted_shortened() -> None:
    key = "k" * 10_000 + "/\x00"
    with pytest.raises(InvalidRequest) as caught:
        open_store("memory://long-keys").get(key)
    message = str(caught.value)
    assert len(message) < 400 and "kkkk" in message and "more characters" in message
    with pytest.raises(ObjectNotFound) as missing:
        open_store("memory://long-keys").get("k" * 10_000)
    assert len(str(missing.value)) < 400


def test_a_reader_does_not_create_a_missing_directory(tmp_path: Path) -> None:
    typo = tmp_path / "typo" / "train"
    with pytest.raises(ObjectNotFound, match=f"{typo} does not exist"):
        open_store(typo, create=False)
    with pytest.raises(ObjectNotFound, match=f"{typo} does not exist"):
        open_dataset(typo)
    assert not (tmp_path / "typo").exists()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ObjectNotFound, match="not a directory"):
        open_store(tmp_path / "file", create=False)


def test_a_reader_opens_an_existing_directory_and_a_writer_creates_one(tmp_path: Path) -> None:
    open_store(tmp_path / "new").put("k", b"v")
    reader = open_store((tmp_path / "new").as_uri(), create=False)
    assert reader.get("k") == b"v"
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.create is False and copy.get("k") == b"v"
    # The directory went away after opening: a reader reports it, it does not make it again.
    shutil.rmtree(tmp_path / "new")
    with pytest.raises(ObjectNotFound):
        copy.check()
    assert not (tmp_path / "new").exists()


def test_check_passes_on_stores_that_are_there(tmp_path: Path) -> None:
    open_store("memory://checked").check()
    open_store(tmp_path, create=False).check()
    open_store(tmp_path / "made").check()  # a writer's check makes the directory
    assert (tmp_path / "made").is_dir()


def test_check_names_an_unreachable_endpoint() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = open_store("s3://bucket/prefix", StoreOptions(endpoint=endpoint))
    with pytest.raises(StoreUnavailable) as caught:
        store.check()
    assert f"cannot reach store s3://bucket/prefix at {endpoint}" in str(caught.value)
    assert "Connection refused" in str(caught.value)
    # A later request says why too, in one line, without obstore's debug dump.
    with pytest.raises(StoreUnavailable) as later:
        store.get("k")
    assert "Connection refused" in str(later.value) and "\n" not in str(later.value)


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
