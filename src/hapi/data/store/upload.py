"""Writing many objects with a few requests in flight, for synth and import."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from hapi.data.store.object_store import ObjectStore

__all__ = ["Progress", "put_all"]

Progress = Callable[[int], None]
"""Called with the number of objects written so far."""


def put_all(
    store: ObjectStore,
    items: Iterable[tuple[str, bytes]],
    *,
    progress: Progress | None = None,
    in_flight: int = 8,
) -> int:
    """Write `(key, data)` pairs, `in_flight` at a time; return the bytes written.

    Items are produced lazily and at most `in_flight` wait in memory, so a large dataset
    never sits in memory at once. On S3 one write at a time would leave the link idle
    between requests.
    """
    written = nbytes = 0
    pending: deque[Future[None]] = deque()
    with ThreadPoolExecutor(in_flight, thread_name_prefix="hapi-put") as pool:
        try:
            for key, data in items:
                if len(pending) >= in_flight:
                    pending.popleft().result()
                    written += 1
                    if progress is not None:
                        progress(written)
                pending.append(pool.submit(store.put, key, data))
                nbytes += len(data)
            while pending:
                pending.popleft().result()
                written += 1
                if progress is not None:
                    progress(written)
        finally:
            for future in pending:
                future.cancel()
    return nbytes
