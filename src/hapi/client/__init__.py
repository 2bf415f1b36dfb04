"""The trainer side: connections, the feature loader, and `TransferJob`."""

from hapi.client.connection import ChunkResult, Connection, connect
from hapi.client.history import EpochStats, Event, History
from hapi.client.job import EvalResult, TransferJob
from hapi.client.job_config import JobConfig
from hapi.client.loader import FeatureLoader, LoaderStats

__all__ = [
    "ChunkResult",
    "Connection",
    "EpochStats",
    "EvalResult",
    "Event",
    "FeatureLoader",
    "History",
    "JobConfig",
    "LoaderStats",
    "TransferJob",
    "connect",
]
