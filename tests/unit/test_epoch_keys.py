"""`EpochKeys`' listings: the next epoch's begun ahead, taken once, never stale."""

from __future__ import annotations

import threading
import time

import pytest

from hapi.client.pipeline.keys import EpochKeys
from hapi.data import DatasetManifest
from hapi.errors import StoreUnavailable


def _manifest(version: str) -> DatasetManifest:
    keys = tuple(f"d/c/{i}.jpg" for i in range(4))
    return DatasetManifest("d", keys, (0,) * 4, ("c",), (version,) * 4)


class _Listings:
    """A store whose listing takes `delay_s` and gives each listing a new version."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls, self.delay_s = 0, delay_s
        self.began = threading.Event()

    def __call__(self) -> DatasetManifest:
        self.calls += 1
        self.began.set()
        time.sleep(self.delay_s)
        return _manifest(f"v{self.calls}")


def _keys(listings: _Listings) -> EpochKeys:
    return EpochKeys(
        _manifest("v0"), seed=1, shuffle=True, chunk_size=2, batch_size=2, relist=listings
    )


def test_a_listing_begun_ahead_is_the_next_epochs_and_is_not_listed_again() -> None:
    listings = _Listings(delay_s=0.2)
    keys = _keys(listings)
    keys.list_ahead()
    keys.list_ahead()  # one in flight at a time
    assert listings.began.wait(5)
    versions = keys.versions()  # waits for the one begun
    assert listings.calls == 1 and versions is not None
    assert set(versions.values()) == {"v1"}
    assert keys.listing_s >= 0.2
    assert set((keys.versions() or {}).values()) == {"v2"}  # none ahead: listed now


def test_a_listing_begun_ahead_but_taken_late_is_listed_again() -> None:
    listings = _Listings()
    keys = _keys(listings)
    keys.list_ahead()
    assert listings.began.wait(5)
    time.sleep(1.2)  # past three times the listing's time and a second: a paused job
    assert set((keys.versions() or {}).values()) == {"v2"}


def test_a_listing_that_fails_turns_the_cache_off_for_the_epoch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def down() -> DatasetManifest:
        raise StoreUnavailable("store away")

    keys = EpochKeys(_manifest("v0"), seed=1, shuffle=True, chunk_size=2, batch_size=2, relist=down)
    keys.list_ahead()
    assert keys.versions() is None
    assert "does not use the feature cache" in caplog.text
