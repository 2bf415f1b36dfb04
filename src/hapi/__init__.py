"""hapi: fast transfer learning on data in object stores.

Run the frozen front of a model next to the data (`hapi serve`), send only compact features
to the trainer, and fine-tune the rest there (`TransferJob`).
"""

from hapi.client import TransferJob, connect
from hapi.data import Transforms
from hapi.errors import HapiError
from hapi.graph import INPUT, RAW, ModelSpec
from hapi.server import ServerConfig, serve

__all__ = [
    "INPUT",
    "RAW",
    "HapiError",
    "ModelSpec",
    "ServerConfig",
    "Transforms",
    "TransferJob",
    "connect",
    "serve",
]

__version__ = "0.1.0"
