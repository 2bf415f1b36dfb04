"""`Locality`: a server's place in a SeaweedFS cluster - the volume server on its machine
(`hapi serve --beside`) and the filer that says where each object lives (`--filer`).

It answers a trainer's `locate` (which of these objects' bytes are on my node), and
counts the bytes each chunk read from the server's own node and from others
(`hapi_local_read_bytes`, `hapi_remote_read_bytes`, and each `ChunkReport`). Why the
server and not the trainer asks the filer: the filer and volume servers sit on the
storage network, which a trainer outside the cluster may not reach (docs/locality.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlparse

from hapi.data.store.seaweed import SeaweedLocator, check_http_url, find_beside, volume_ids
from hapi.errors import HapiError, InvalidRequest

__all__ = ["Locality"]

log = logging.getLogger("hapi.server")

VOLUMES_TTL_S = 30.0
"""How long the list of the volumes beside the server is trusted (new volumes appear as
a bucket grows; an old one moves only when an operator balances the cluster)."""


class Locality:
    """Where the server is, and which bytes are local to it.

    Args:
        beside: the URL of the SeaweedFS volume server on the server's machine.
        locator: each object's volumes, from the filer.
        on_read: called with (local, remote) bytes of each chunk's reads (the metrics).
        volumes_of: a volume server's volumes (tests pass a fake).
    """

    def __init__(
        self,
        beside: str,
        locator: SeaweedLocator,
        *,
        on_read: Callable[[int, int], None] | None = None,
        volumes_of: Callable[[str], frozenset[int]] = volume_ids,
    ) -> None:
        self.beside = check_http_url(beside, "--beside")
        self.locator = locator
        self._on_read = on_read
        self._volumes_of = volumes_of
        self._volumes: frozenset[int] = frozenset()
        self._volumes_at = -VOLUMES_TTL_S
        self._lock = threading.Lock()
        self._warned = False
        self._later = threading.Lock()

    @classmethod
    def of(
        cls,
        beside: str | None,
        filer: str | None,
        store_uri: str,
        *,
        on_read: Callable[[int, int], None] | None = None,
    ) -> Locality | None:
        """The locality a server's settings describe; None without `--beside`.

        Raises:
            InvalidRequest: `--beside` without `--filer`, or a store that is not S3;
                `--beside auto` where no volume server, or several, run on this machine.
        """
        if beside is None:
            return None
        if filer is None:
            raise InvalidRequest(
                "--beside needs --filer: the SeaweedFS filer URL (e.g. http://filer:8888), "
                "which says on which volumes each object lies"
            )
        parsed = urlparse(store_uri)
        if parsed.scheme != "s3":
            raise InvalidRequest(
                f"--beside works with a SeaweedFS store through its S3 gateway (s3://bucket), "
                f"not {store_uri}: other stores cannot say where an object lies"
            )
        locator = SeaweedLocator(filer, parsed.netloc, parsed.path)
        return cls(find_beside(beside), locator, on_read=on_read)

    def volumes(self) -> frozenset[int]:
        """The volumes the volume server beside this server holds (refreshed every
        `VOLUMES_TTL_S`; the last known while it cannot be reached)."""
        with self._lock:
            if time.monotonic() - self._volumes_at < VOLUMES_TTL_S:
                return self._volumes
        try:
            volumes = self._volumes_of(self.beside)
        except HapiError as exc:
            self._warn(exc)
            return self._volumes
        with self._lock:
            self._volumes, self._volumes_at = volumes, time.monotonic()
        return volumes

    def locate(self, keys: Sequence[str]) -> tuple[list[int], list[int]]:
        """Each key's bytes on this server's node, and its bytes in all.

        Raises:
            StoreUnavailable: the filer cannot be reached.
        """
        placements = self.locator.locate(keys)
        mine = self.volumes()
        local = [sum(n for v, n in p.items() if v in mine) for p in placements]
        return local, [sum(p.values()) for p in placements]

    def count(self, keys: Sequence[str], nbytes: int) -> int | None:
        """Of `nbytes` read for `keys`, the bytes read from this server's node (shard
        members count their shard's share), counted in the metrics.

        Known where the keys' placements are (a trainer asked this server to locate
        them, as a job over several servers does); else None at once, and the filer is
        asked in the background so that the metrics count them. A chunk's report never
        waits for the filer."""
        if nbytes <= 0 or not keys:
            return 0
        placements = self.locator.cached(keys)
        if placements is None:
            self._count_later(list(keys), nbytes)
            return None
        return self._counted(placements, nbytes)

    def _counted(self, placements: Sequence[Mapping[int, int]], nbytes: int) -> int:
        mine = self.volumes()
        local = sum(n for p in placements for v, n in p.items() if v in mine)
        total = sum(n for p in placements for n in p.values())
        read_here = round(nbytes * local / total) if total else 0
        if self._on_read is not None:
            self._on_read(read_here, nbytes - read_here)
        return read_here

    def _count_later(self, keys: list[str], nbytes: int) -> None:
        def run() -> None:
            try:
                self._counted(self.locator.locate(keys), nbytes)
            except HapiError as exc:
                self._warn(exc)
            finally:
                self._later.release()

        # One lookup at a time: a server whose chunks outrun the filer counts fewer.
        if self._later.acquire(blocking=False):
            threading.Thread(target=run, name="hapi-locate-count", daemon=True).start()

    def _warn(self, exc: HapiError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("where objects lie is unknown, chunks go unplaced: %s", exc)
