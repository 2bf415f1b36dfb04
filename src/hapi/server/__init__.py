"""The storage-side server: `hapi serve`."""

from hapi.server.config import ServerConfig
from hapi.server.server import HapiServer, serve
from hapi.server.shaping import TokenBucket, parse_rate

__all__ = ["HapiServer", "ServerConfig", "TokenBucket", "parse_rate", "serve"]
