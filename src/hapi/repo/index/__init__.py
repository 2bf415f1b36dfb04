"""The catalog: a local SQLite index of the store's manifests and refs, and its queries.

Syncing it from the store, resolving references, name/tag/architecture queries and
lineage. Built on `hapi.repo.storage`; the operations in `hapi.repo.ops` use it.
"""
