"""hapi: fast transfer learning on data in object stores.

Run the frozen front of a model next to the data (`hapi serve`), send only compact features
to the trainer, and fine-tune the rest there (`TransferJob`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hapi._lazy import lazy_exports

__all__ = [
    "INPUT",
    "RAW",
    "FeatureDataLoader",
    "FeatureDataset",
    "HapiError",
    "ModelRepo",
    "ModelSpec",
    "ServerConfig",
    "TransferJob",
    "Transforms",
    "connect",
    "serve",
]

__version__ = "0.1.0"

# Importing torch takes seconds; names load on first use so `hapi --help` and the
# error paths of the CLI answer at once.
_WHERE = {
    "INPUT": "hapi.graph",
    "RAW": "hapi.graph",
    "ModelSpec": "hapi.graph",
    "ModelRepo": "hapi.repo",
    "HapiError": "hapi.errors",
    "ServerConfig": "hapi.server",
    "serve": "hapi.server",
    "Transforms": "hapi.data",
    "TransferJob": "hapi.client",
    "FeatureDataset": "hapi.client",
    "FeatureDataLoader": "hapi.client",
    "connect": "hapi.client",
}

if TYPE_CHECKING:
    from hapi.client import FeatureDataLoader, FeatureDataset, TransferJob, connect
    from hapi.data import Transforms
    from hapi.errors import HapiError
    from hapi.graph import INPUT, RAW, ModelSpec
    from hapi.repo import ModelRepo
    from hapi.server import ServerConfig, serve


__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE)
