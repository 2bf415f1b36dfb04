"""The store facade on a real Azure Blob emulator (Azurite): the shared contract, credentials."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi.data import DatasetManifest, StoreOptions, open_store, synth_dataset
from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable

from ..azurite import ACCOUNT, Azurite
from ..store_contract import check_store_contract


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """Azurite on 127.0.0.1, stopped by its pid."""
    server = Azurite(Path(tmp_path_factory.mktemp("azurite")))
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start Azurite for the Azure tests: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def no_azure_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """obstore reads every AZURE_* variable: tests of settings start from none."""
    import os

    for name in list(os.environ):
        if name.startswith("AZURE_"):
            monkeypatch.delenv(name)


def test_store_contract(azurite: Azurite) -> None:
    check_store_contract(open_store(azurite.new_container(), azurite.options))


def test_the_abfs_and_https_forms_name_the_same_container(azurite: Azurite) -> None:
    uri = azurite.new_container()
    name = uri.removeprefix("az://")
    open_store(f"{uri}/data", azurite.options).put("a/1.jpg", b"x")
    for form in (
        f"azure://{name}/data",
        f"abfs://{name}@{ACCOUNT}.dfs.core.windows.net/data",
        f"https://{ACCOUNT}.blob.core.windows.net/{name}/data",
    ):
        assert open_store(form, azurite.options).get("a/1.jpg") == b"x", form


def test_a_dataset_round_trips_through_azure(azurite: Azurite) -> None:
    uri = azurite.new_container()
    written = synth_dataset(open_store(uri, azurite.options), "train", classes=2, per_class=3)
    assert DatasetManifest.from_store(open_store(uri, azurite.options), "train") == written


def test_credentials_come_from_the_usual_variables(
    azurite: Azurite, no_azure_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = azurite.new_container()
    for name, value in azurite.client_env.items():
        monkeypatch.setenv(name, value)
    store = open_store(uri)
    store.put("k", b"v")
    store.check()
    assert open_store(uri, azurite.options).get("k") == b"v"


def test_a_wrong_key_is_refused_naming_the_key(azurite: Azurite) -> None:
    uri = azurite.new_container()
    wrong = StoreOptions(
        endpoint=azurite.endpoint, account_name=ACCOUNT, account_key="d3Jvbmcga2V5"
    )
    with pytest.raises(StoreUnavailable, match=rf"{uri} refused .*AZURE_STORAGE_ACCOUNT_KEY"):
        open_store(uri, wrong).get("x")


def test_a_missing_account_is_named_before_any_request(no_azure_env: None) -> None:
    store = open_store("az://somewhere", StoreOptions(endpoint="http://127.0.0.1:9/x"))
    with pytest.raises(InvalidRequest, match=r"az://somewhere.*AZURE_STORAGE_ACCOUNT_NAME"):
        store.get("x")


def test_a_missing_container_is_named(azurite: Azurite) -> None:
    with pytest.raises(ObjectNotFound, match="az://no-such-container.*does not exist"):
        list(open_store("az://no-such-container", azurite.options).list())


@pytest.mark.timeout(20)
def test_an_emulator_that_is_down_fails_fast_and_names_the_endpoint(no_azure_env: None) -> None:
    options = StoreOptions(
        endpoint="http://127.0.0.1:9/devstoreaccount1", account_name=ACCOUNT, account_key="a2V5"
    )
    with pytest.raises(StoreUnavailable, match=r"az://down at http://127.0.0.1:9.*running"):
        open_store("az://down", options).check()
