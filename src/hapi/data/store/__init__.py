"""Reaching objects: the `ObjectStore` protocol, `StoreOptions`, and `Store`, the facade
over obstore for every kind of store registered in `hapi.data.store.schemes`.

Importing this package does not import obstore (nor torch): a client is made on first use.
"""

from __future__ import annotations

from hapi.data.store.object_store import ObjectStore
from hapi.data.store.options import StoreOptions
from hapi.data.store.store import Store, object_version, open_store

__all__ = ["ObjectStore", "Store", "StoreOptions", "object_version", "open_store"]
