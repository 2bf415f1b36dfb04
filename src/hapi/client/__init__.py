"""The trainer side: connections, the feature loader, and `TransferJob`."""

from hapi.client.config.job import JobConfig
from hapi.client.config.parts import (
    CacheConfig,
    ConnectConfig,
    DataConfig,
    FetchConfig,
    PlanningConfig,
    TrainingConfig,
    WireConfig,
)
from hapi.client.job.features import FeatureBatch, FeatureDataLoader, FeatureDataset
from hapi.client.job.transfer import EvalResult, TransferJob
from hapi.client.pipeline.history import EpochStats, Event, History
from hapi.client.pipeline.loader import FeatureLoader, LoaderStats
from hapi.client.servers.connection import ChunkResult, Connection, connect

__all__ = [
    "CacheConfig",
    "ChunkResult",
    "ConnectConfig",
    "Connection",
    "DataConfig",
    "EpochStats",
    "EvalResult",
    "Event",
    "FeatureBatch",
    "FeatureDataLoader",
    "FeatureDataset",
    "FeatureLoader",
    "FetchConfig",
    "History",
    "JobConfig",
    "LoaderStats",
    "PlanningConfig",
    "TrainingConfig",
    "TransferJob",
    "WireConfig",
    "connect",
]
