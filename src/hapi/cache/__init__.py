"""The feature cache: a sample's frozen features computed once and kept, on either tier.

`FeatureSpace` says what a feature depends on besides its sample (the head's content, the
cut, the transforms, the wire dtype, exactness); `entry_name` names a sample in it by key,
object version and view; `FeatureCache` keeps entries in a bounded directory shared by
processes. `cacheability` says whether a job's features repeat between epochs at all.
"""

from __future__ import annotations

from hapi.cache.feature_dir import CacheStats, FeatureCache, SpaceUsage, default_cache_root
from hapi.cache.space import Cacheability, FeatureSpace, cacheability, entry_name

__all__ = [
    "CacheStats",
    "Cacheability",
    "FeatureCache",
    "FeatureSpace",
    "SpaceUsage",
    "cacheability",
    "default_cache_root",
    "entry_name",
]
