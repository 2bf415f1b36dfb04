"""`Blob`: one sample's bytes as a read gives them.

A shard member is a view of the response its span came in, not a copy: a chunk's members
are copied once, into the batch that sends them (`hapi.wire.batches.binary_array`) or by the
decoder, and a server's core spent more copying them out one by one than sending them.
Whole objects stay `bytes`. A view keeps its whole response alive, so a reader takes its
members and drops them: they are not for keeping (`MemberStore.get` returns `bytes`).
"""

from __future__ import annotations

__all__ = ["Blob"]

Blob = bytes | memoryview
"""A sample's bytes: `bytes`, or a read-only view of the response it came in."""
