"""`--feature-cache`'s settings: off by default, and a bad size or directory named at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from hapi.errors import InvalidRequest
from hapi.server import ServerConfig
from hapi.server.chunks.feature_cache import ServerFeatureCache, open_feature_cache
from hapi.server.chunks.tier import NO_FEATURE_CACHE


def test_the_cache_is_off_by_default(tmp_path: Path) -> None:
    config = ServerConfig(store=str(tmp_path))
    assert (
        open_feature_cache(config.feature_cache, size=config.feature_cache_size) is NO_FEATURE_CACHE
    )
    assert NO_FEATURE_CACHE.stats() is None


def test_a_size_is_read_like_the_memory_budget(tmp_path: Path) -> None:
    config = ServerConfig(
        store=str(tmp_path), feature_cache=str(tmp_path / "fc"), feature_cache_size="3MiB"
    )
    tier = open_feature_cache(config.feature_cache, size=config.feature_cache_size)
    assert isinstance(tier, ServerFeatureCache)
    stats = tier.stats()
    assert (stats.max_bytes, stats.bytes_held, stats.hits) == (3 << 20, 0, 0)
    assert (tmp_path / "fc").is_dir()
    tier.close()


def test_a_bad_size_is_refused_with_the_fix() -> None:
    with pytest.raises(InvalidRequest, match="cannot read size 'lots'.*such as 4GiB"):
        ServerConfig(store=".", feature_cache="fc", feature_cache_size="lots")


def test_a_file_for_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    config = ServerConfig(store=str(tmp_path), feature_cache=str(tmp_path / "file"))
    with pytest.raises(InvalidRequest, match="is a file: pass a directory"):
        open_feature_cache(config.feature_cache, size=config.feature_cache_size)
