"""The trainer side: connections, the feature loader, and `TransferJob`."""

from hapi.client.connection import ChunkResult, Connection, connect
from hapi.client.history import EpochStats, Event, History
from hapi.client.job import EvalResult, TransferJob
from hapi.client.job_config import JobConfig
from hapi.client.job_parts import (
    CacheConfig,
    ConnectConfig,
    DataConfig,
    FetchConfig,
    PlanningConfig,
    TrainingConfig,
    WireConfig,
)
from hapi.client.loader import FeatureLoader, LoaderStats

__all__ = [
    "CacheConfig",
    "ChunkResult",
    "ConnectConfig",
    "Connection",
    "DataConfig",
    "EpochStats",
    "EvalResult",
    "Event",
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
