"""The storage-side server: `hapi serve`.

Names load on first use: `from hapi.server import ServerConfig` must not import torch, so
`hapi serve` refuses a bad setting at once instead of after seconds of imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hapi._lazy import lazy_exports

__all__ = ["HapiServer", "ServerConfig", "TokenBucket", "parse_rate", "serve"]

_WHERE = {
    "HapiServer": ".server",
    "ServerConfig": ".server_config",
    "TokenBucket": ".shaping",
    "parse_rate": ".shaping",
    "serve": ".running",
}

if TYPE_CHECKING:
    from hapi.server.running import serve
    from hapi.server.server import HapiServer
    from hapi.server.server_config import ServerConfig
    from hapi.server.shaping import TokenBucket, parse_rate

__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE)
