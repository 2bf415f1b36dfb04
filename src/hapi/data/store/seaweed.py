"""Where a SeaweedFS store's objects live: the volumes that hold each object's bytes, and
the volumes a volume server holds - what lets a job send each chunk to the server beside
its data (docs/locality.md).

The filer answers both halves of "where is this key" that S3 cannot: an entry lists its
chunks' file ids (`<volume>,<needle>`), and a volume server's `/status` lists its volumes.
Replicas are the same volume on several servers, so an object is local to every server
holding one of its volumes. An object the filer keeps inline has no volume: it is local
nowhere, and any server reads it as well as another.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hapi.data.shards.members import split_member
from hapi.errors import InvalidRequest, ObjectNotFound, StoreUnavailable, shorten

__all__ = [
    "AUTO",
    "Placement",
    "SeaweedLocator",
    "find_beside",
    "local_volume_servers",
    "volume_ids",
    "volume_url",
]

Placement = Mapping[int, int]
"""An object's bytes by the volume that holds them (empty: inline, local nowhere)."""

LISTED_AT = 32
"""Keys of one directory from which the directory is listed (its entries carry their
chunks, a thousand a request) rather than each key looked up."""
MAX_KNOWN = 2_000_000
"""Placements kept at most (about 200 bytes each)."""
_PAGE = 1000
_WORKERS = 8


def _get_json(url: str, timeout: float) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise ObjectNotFound(f"SeaweedFS has no entry {shorten(url)}") from None
        raise StoreUnavailable(f"SeaweedFS answered {exc.code} to {shorten(url)}") from None
    except (OSError, ValueError) as exc:
        raise StoreUnavailable(
            f"SeaweedFS at {shorten(url)} cannot be reached ({exc}): check the filer's or "
            "volume server's URL (hapi serve --filer, --beside) and that it runs"
        ) from None


def check_http_url(url: str, what: str) -> str:
    """`url` without a trailing slash, if it is an http(s) URL with a host.

    Raises:
        InvalidRequest: it is not.
    """
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidRequest(
            f"{what} must be an http(s) URL such as http://127.0.0.1:8080, got {shorten(url)!r}"
        )
    return url.rstrip("/")


def volume_ids(volume_server: str, *, timeout: float = 10.0) -> frozenset[int]:
    """The volumes a SeaweedFS volume server holds now (its `/status`).

    Raises:
        StoreUnavailable: it cannot be reached or answers no status.
    """
    status = _get_json(f"{check_http_url(volume_server, 'a volume server')}/status", timeout)
    return frozenset(int(v["Id"]) for v in status.get("Volumes") or [])


AUTO = "auto"
"""`--beside auto`: the volume server running on this machine, found by `find_beside`."""
_VOLUME_PORT = {"volume": "port", "server": "volume.port", "mini": "volume.port"}
"""The `weed` commands that run a volume server, and each one's flag for its port."""
_OTHER_COMMANDS = frozenset({
    "master", "filer", "s3", "iam", "mount", "webdav", "sftp", "shell", "admin", "worker",
    "backup", "upload", "download", "export", "fix", "benchmark", "scaffold", "version",
    "filer.sync", "filer.backup", "mq.broker",
})  # fmt: skip


def volume_url(argv: Sequence[str]) -> str | None:
    """The URL of the volume server a `weed` command line runs (`weed volume`, `weed
    server`, `weed mini`), from its flags (`-port=8080` or `-port 8080`; default 8080,
    on loopback unless `-ip.bind` names an address); None for any other process."""
    if not argv or not argv[0].rsplit("/", 1)[-1].startswith("weed"):
        return None
    # The command is the first word weed knows as one (a flag's value may come between).
    known = _VOLUME_PORT.keys() | _OTHER_COMMANDS
    command = next((a for a in argv[1:] if a in known), None)
    if command not in _VOLUME_PORT:
        return None
    flags: dict[str, str] = {}
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("-"):
            name, eq, value = arg.lstrip("-").partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                value = argv[i + 1]
            flags[name] = value
    port = flags.get(_VOLUME_PORT[command]) or "8080"
    bind = flags.get("ip.bind", "")
    host = bind if bind not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host}:{port}"


def local_volume_servers(pids: Sequence[int] | None = None) -> list[str]:
    """The URLs of the SeaweedFS volume servers running on this machine (Linux: from
    each process's command line), or among `pids`."""
    proc = Path("/proc")
    if pids is None:
        pids = [int(p.name) for p in proc.iterdir() if p.name.isdigit()]
    found = []
    for pid in pids:
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        url = volume_url([a.decode(errors="replace") for a in argv if a])
        if url is not None and url not in found:
            found.append(url)
    return found


def find_beside(beside: str, *, pids: Sequence[int] | None = None) -> str:
    """`beside`, or for `AUTO` the one volume server that runs on this machine and
    answers its status.

    Raises:
        InvalidRequest: none runs here, or several do (naming them).
    """
    if beside != AUTO:
        return beside
    running = []
    for url in local_volume_servers(pids):
        try:
            volume_ids(url, timeout=2.0)
        except StoreUnavailable:
            continue
        running.append(url)
    if len(running) == 1:
        return running[0]
    if not running:
        raise InvalidRequest(
            "--beside auto found no SeaweedFS volume server running on this machine (weed "
            "volume, server or mini): start one here, or name one with --beside URL"
        )
    raise InvalidRequest(
        f"--beside auto found {len(running)} SeaweedFS volume servers on this machine "
        f"({', '.join(running)}): name the one this server reads beside with --beside URL"
    )


def _object_of(key: str) -> str:
    """The object a key reads: a shard member's shard, else the key."""
    member = split_member(key)
    return member[0] if member else key


def _placement(entry: Mapping[str, Any]) -> dict[int, int]:
    placed: dict[int, int] = {}
    for chunk in entry.get("chunks") or []:
        volume = (chunk.get("fid") or {}).get("volume_id")
        if volume is None:  # older filers: only the "3,01637037d6" form
            volume = str(chunk.get("file_id", "")).partition(",")[0] or None
        if volume is not None:
            placed[int(volume)] = placed.get(int(volume), 0) + int(chunk.get("size", 0))
    return placed


class SeaweedLocator:
    """Each key's placement in a SeaweedFS bucket, from its filer; kept for `ttl_s`
    (volumes move, rarely), so a job's keys are looked up once.

    Args:
        filer: the filer's URL; its path, if any, is the buckets folder (`/buckets` when
            none is given, SeaweedFS's default).
        bucket: the S3 bucket.
        prefix: the store's prefix in the bucket (`s3://bucket/prefix`).
        ttl_s: how long a placement is trusted.
        timeout: seconds for each request to the filer.
        listed_at: keys of one directory from which it is listed (`LISTED_AT`).
    """

    def __init__(
        self,
        filer: str,
        bucket: str,
        prefix: str = "",
        *,
        ttl_s: float = 300.0,
        timeout: float = 10.0,
        listed_at: int = LISTED_AT,
    ) -> None:
        base = urllib.parse.urlparse(check_http_url(filer, "the filer"))
        folder = base.path.rstrip("/") or "/buckets"
        self.filer = base._replace(path="").geturl()
        self.root = "/".join(p for p in (folder, bucket, prefix.strip("/")) if p.strip("/"))
        self.ttl_s, self.timeout, self.listed_at = ttl_s, timeout, listed_at
        self._known: dict[str, tuple[float, dict[int, int]]] = {}
        self._lock = threading.Lock()

    def locate(self, keys: Sequence[str]) -> list[dict[int, int]]:
        """Each key's placement, in order. A shard member's is its shard's; a key the
        filer does not have is placed nowhere (its read will say it is missing).

        Raises:
            StoreUnavailable: the filer cannot be reached.
        """
        objects = [_object_of(k) for k in keys]
        known = self._known_now(objects)
        wanted = sorted(set(objects) - known.keys())
        by_dir: dict[str, list[str]] = {}
        for name in wanted:
            by_dir.setdefault(name.rpartition("/")[0], []).append(name)
        found: dict[str, dict[int, int]] = {}
        with ThreadPoolExecutor(_WORKERS, thread_name_prefix="hapi-locate") as pool:
            many = self.listed_at
            singles = [n for d, names in by_dir.items() if len(names) < many for n in names]
            listed = [d for d, names in by_dir.items() if len(names) >= many]
            for entries in pool.map(self._listing, listed):
                found.update(entries)  # a directory's every entry: asked for next
            found.update(zip(singles, pool.map(self._entry, singles), strict=True))
        found.update((n, {}) for n in wanted if n not in found)
        self._keep(found)
        known.update(found)
        return [known[o] for o in objects]

    def cached(self, keys: Sequence[str]) -> list[dict[int, int]] | None:
        """`locate`'s answer if every key's placement is known and fresh; else None,
        without asking the filer."""
        objects = [_object_of(k) for k in keys]
        known = self._known_now(objects)
        return [known[o] for o in objects] if len(known) == len(set(objects)) else None

    def _known_now(self, objects: Sequence[str]) -> dict[str, dict[int, int]]:
        now = time.monotonic()
        with self._lock:
            kept = ((o, self._known.get(o)) for o in objects)
            return {o: k[1] for o, k in kept if k is not None and now - k[0] < self.ttl_s}

    def _keep(self, found: Mapping[str, dict[int, int]]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._known) + len(found) > MAX_KNOWN:
                # The oldest half goes (a dict keeps insertion order, and so age).
                for name in list(self._known)[: len(self._known) // 2]:
                    del self._known[name]
            for name, placed in found.items():
                self._known.pop(name, None)
                self._known[name] = (now, placed)

    def _path(self, name: str) -> str:
        return urllib.parse.quote("/".join(p for p in (self.root, name) if p))

    def _entry(self, name: str) -> dict[int, int]:
        url = f"{self.filer}{self._path(name)}?metadata=true&resolveManifest=true"
        try:
            return _placement(_get_json(url, self.timeout))
        except ObjectNotFound:
            return {}

    def _listing(self, directory: str) -> dict[str, dict[int, int]]:
        """Every entry of one directory, a page at a time, by its key."""
        base = f"{self.filer}{self._path(directory)}/"
        strip = f"{self.root}/".lstrip("/")
        out: dict[str, dict[int, int]] = {}
        last = ""
        while True:
            query = urllib.parse.urlencode({"limit": _PAGE, "lastFileName": last})
            try:
                page = _get_json(f"{base}?{query}", self.timeout)
            except ObjectNotFound:
                return out
            entries = page.get("Entries") or []
            for entry in entries:
                out[str(entry["FullPath"]).lstrip("/").removeprefix(strip)] = _placement(entry)
            last = str(page.get("LastFileName") or "")
            if not page.get("ShouldDisplayLoadMore") or not entries or not last:
                return out
