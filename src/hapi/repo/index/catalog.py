"""`Catalog`: a SQLite index of the manifests and refs in the store.

The catalog is a cache. Everything in it comes from the manifests and ref objects in the
store, so it can be thrown away and rebuilt (`ModelRepo.reindex`), and it is brought up to
date from the store lazily (`sync.py`). It records the store's epoch (`epoch.py`) it was
built under, so a sync can tell a catalog of an earlier incarnation of the repository.
SQLite in WAL mode lets several processes read and write one catalog file at once; writers
serialise on SQLite's own lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from hapi.repo.index.snapshot import Snapshot
from hapi.repo.index.version import ModelVersion
from hapi.repo.storage.manifest import VersionManifest

__all__ = ["Catalog"]

_BUSY_S = 60.0
"""How long a process waits for another's lock on a shared catalog file."""

# Bump when the schema changes: an old catalog is then dropped and rebuilt from the store.
_SCHEMA_VERSION = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS manifests (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, parent TEXT, created TEXT NOT NULL,
    tags TEXT NOT NULL, metrics TEXT NOT NULL, tensors INTEGER NOT NULL,
    nbytes INTEGER NOT NULL, body TEXT NOT NULL, arch TEXT);
CREATE INDEX IF NOT EXISTS manifests_name ON manifests (name);
CREATE INDEX IF NOT EXISTS manifests_arch ON manifests (arch);
CREATE TABLE IF NOT EXISTS tags (
    manifest TEXT NOT NULL, tag TEXT NOT NULL, PRIMARY KEY (tag, manifest));
CREATE TABLE IF NOT EXISTS refs (
    name TEXT NOT NULL, version INTEGER NOT NULL, id TEXT NOT NULL,
    PRIMARY KEY (name, version));
CREATE INDEX IF NOT EXISTS refs_id ON refs (id);
CREATE TABLE IF NOT EXISTS edges (
    child TEXT NOT NULL, parent TEXT NOT NULL, PRIMARY KEY (child, parent));
CREATE INDEX IF NOT EXISTS edges_parent ON edges (parent);
CREATE TABLE IF NOT EXISTS tensor_refs (
    manifest TEXT NOT NULL, key TEXT NOT NULL, hash TEXT NOT NULL, dtype TEXT NOT NULL,
    shape TEXT NOT NULL, nbytes INTEGER NOT NULL, PRIMARY KEY (manifest, key));
CREATE INDEX IF NOT EXISTS tensor_refs_hash ON tensor_refs (hash);
CREATE TABLE IF NOT EXISTS modules (
    arch TEXT NOT NULL, position INTEGER NOT NULL, name TEXT NOT NULL,
    cls TEXT NOT NULL, short_cls TEXT NOT NULL, config TEXT NOT NULL,
    layer INTEGER, layer_id TEXT, PRIMARY KEY (arch, position));
CREATE INDEX IF NOT EXISTS modules_layer_id ON modules (layer_id);
CREATE INDEX IF NOT EXISTS modules_cls ON modules (short_cls);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_TABLES = ("manifests", "refs", "edges", "tensor_refs", "modules", "tags", "meta")

# The visible versions: a manifest with the ref that names it.
_VERSIONS = """
SELECT m.id, m.name, r.version, m.parent, m.created, m.tags, m.metrics, m.tensors, m.nbytes
FROM manifests m JOIN refs r ON r.id = m.id AND r.name = m.name
"""

_SNAPSHOT = _VERSIONS.replace("SELECT m.id", "SELECT m.arch, m.id", 1) + (
    " ORDER BY m.created DESC, m.id"
)


class Catalog:
    """The SQLite index. Connections are opened lazily, one per process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._lock = threading.RLock()
        self._writes = 0
        self._snapshot: tuple[tuple[int, int, int], Snapshot] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    @property
    def conn(self) -> sqlite3.Connection:
        # A connection must not cross a fork: each process opens its own.
        if self._conn is None or self._pid != os.getpid():
            self._conn = self._connect()
            self._pid = os.getpid()
        return self._conn

    def _connect(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        conn = sqlite3.connect(
            self.path, timeout=_BUSY_S, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(_BUSY_S * 1000)}")
        if self.path != ":memory:":
            _use_wal(conn, _BUSY_S)
            conn.execute("PRAGMA synchronous = NORMAL")
        with _transaction(conn):
            if conn.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA_VERSION:
                for table in _TABLES:
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        return conn

    def close(self) -> None:
        """Close this process's connection (a later use reopens it)."""
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (`BEGIN IMMEDIATE`: takes SQLite's write lock up front)."""
        with self._lock, _transaction(self.conn) as conn:
            self._writes += 1
            yield conn

    def snapshot(self) -> Snapshot:
        """Every visible version in memory (see `snapshot.py`), rebuilt when this
        connection wrote or another committed (SQLite's `data_version`) since the last."""
        with self._lock:
            conn = self.conn
            stamp = (id(conn), self._writes, conn.execute("PRAGMA data_version").fetchone()[0])
            if self._snapshot is None or self._snapshot[0] != stamp:
                rows = conn.execute(_SNAPSHOT).fetchall()
                self._snapshot = (stamp, Snapshot([(_version(r[1:]), r[0]) for r in rows]))
            return self._snapshot[1]

    def query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self.conn.execute(sql, tuple(args)).fetchall()

    def clear(self, *, epoch: str | None = None) -> None:
        """Forget everything; the catalog then belongs to the store's `epoch`."""
        with self.write() as conn:
            for table in _TABLES:
                conn.execute(f"DELETE FROM {table}")
            if epoch is not None:
                conn.execute("INSERT INTO meta VALUES ('epoch', ?)", (epoch,))

    def epoch(self) -> str | None:
        """The store's epoch this catalog was built under (None: none, or not yet known)."""
        rows = self.query("SELECT value FROM meta WHERE key = 'epoch'")
        return rows[0][0] if rows else None

    def mark(self) -> tuple[str | None, float]:
        """The store's change token at the last full sync, and that sync's time."""
        rows = dict(self.query("SELECT key, value FROM meta WHERE key IN ('changes', 'synced')"))
        return rows.get("changes"), float(rows.get("synced", 0.0))

    def set_mark(self, changes: str | None, synced: float) -> None:
        with self.write() as conn:
            conn.execute("DELETE FROM meta WHERE key IN ('changes', 'synced')")
            if changes is not None:
                conn.execute(
                    "INSERT INTO meta VALUES ('changes', ?), ('synced', ?)", (changes, str(synced))
                )

    # Writers return early with nothing to write: each write makes the next query
    # rebuild the in-memory snapshot.

    def add_manifests(self, manifests: Iterable[VersionManifest]) -> None:
        manifests = list(manifests)
        if not manifests:
            return
        with self.write() as conn:
            for m in manifests:
                _insert(conn, m)

    def remove_manifests(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        if not ids:
            return
        with self.write() as conn:
            for mid in ids:
                arch = conn.execute("SELECT arch FROM manifests WHERE id = ?", (mid,)).fetchone()
                conn.execute("DELETE FROM manifests WHERE id = ?", (mid,))
                conn.execute("DELETE FROM edges WHERE child = ?", (mid,))
                conn.execute("DELETE FROM tensor_refs WHERE manifest = ?", (mid,))
                conn.execute("DELETE FROM tags WHERE manifest = ?", (mid,))
                if arch and arch[0]:
                    conn.execute(
                        "DELETE FROM modules WHERE arch = ?1 AND NOT EXISTS "
                        "(SELECT 1 FROM manifests WHERE arch = ?1)",
                        (arch[0],),
                    )

    def set_refs(self, rows: Iterable[tuple[str, int, str]]) -> None:
        """Record ref objects `(name, version, id)`."""
        rows = list(rows)
        if not rows:
            return
        with self.write() as conn:
            conn.executemany("INSERT OR REPLACE INTO refs VALUES (?, ?, ?)", rows)

    def manifest_ids(self) -> set[str]:
        return {r[0] for r in self.query("SELECT id FROM manifests")}

    def ref_keys(self, name: str | None = None) -> set[tuple[str, int]]:
        if name is None:
            return {(r[0], r[1]) for r in self.query("SELECT name, version FROM refs")}
        rows = self.query("SELECT name, version FROM refs WHERE name = ?", (name,))
        return {(r[0], r[1]) for r in rows}

    def refs_to(self, ids: Iterable[str]) -> list[tuple[str, int, str]]:
        """The refs `(name, version, id)` that name one of `ids`."""
        rows: list[tuple[str, int, str]] = []
        for mid in ids:
            found = self.query("SELECT name, version, id FROM refs WHERE id = ?", (mid,))
            rows.extend((r[0], r[1], r[2]) for r in found)
        return rows

    def manifest(self, manifest_id: str) -> VersionManifest | None:
        rows = self.query("SELECT body FROM manifests WHERE id = ?", (manifest_id,))
        return VersionManifest.from_json(rows[0][0], manifest_id) if rows else None

    def versions(
        self, where: str = "", args: Iterable[Any] = (), order: str = ""
    ) -> list[ModelVersion]:
        sql = _VERSIONS + (f" WHERE {where}" if where else "")
        sql += f" ORDER BY {order}" if order else " ORDER BY m.name, r.version"
        return [_version(row) for row in self.query(sql, args)]

    def names(self) -> list[str]:
        return [r[0] for r in self.query("SELECT DISTINCT name FROM refs ORDER BY name")]


def arch_id(m: VersionManifest) -> str | None:
    """The identity of a version's module tree (None without one): versions of one
    architecture share it, so architecture queries look at each tree once, not once per
    version (10,000 versions are a few dozen trees)."""
    if not m.modules:
        return None
    body = json.dumps([e.to_dict() for e in m.modules], sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def _insert(conn: sqlite3.Connection, m: VersionManifest) -> None:
    mid = m.id
    arch = arch_id(m)
    conn.execute(
        "INSERT OR REPLACE INTO manifests VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            mid,
            m.name,
            m.parent,
            m.created,
            json.dumps(list(m.tags)),
            json.dumps(m.metrics),
            len(m.tensors),
            m.nbytes,
            m.to_json().decode(),
            arch,
        ),
    )
    if m.parent:
        conn.execute("INSERT OR IGNORE INTO edges VALUES (?, ?)", (mid, m.parent))
    conn.execute("DELETE FROM tensor_refs WHERE manifest = ?", (mid,))
    conn.executemany(
        "INSERT INTO tensor_refs VALUES (?, ?, ?, ?, ?, ?)",
        [
            (mid, k, t.hash, t.dtype, json.dumps(list(t.shape)), t.nbytes)
            for k, t in m.tensors.items()
        ],
    )
    conn.executemany("INSERT OR IGNORE INTO tags VALUES (?, ?)", [(mid, t) for t in m.tags])
    if arch is None or conn.execute("SELECT 1 FROM modules WHERE arch = ?", (arch,)).fetchone():
        return
    rows = []
    layer = 0
    for position, entry in enumerate(m.modules):
        index = None
        if entry.layer is not None:
            layer += 1
            index = layer
        rows.append(
            (
                arch,
                position,
                entry.name,
                entry.cls,
                entry.short_cls,
                json.dumps(entry.config, sort_keys=True),
                index,
                entry.layer,
            )
        )
    conn.executemany("INSERT INTO modules VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)


def _version(row: tuple[Any, ...]) -> ModelVersion:
    mid, name, version, parent, created, tags, metrics, tensors, nbytes = row
    return ModelVersion(
        id=mid,
        name=name,
        version=version,
        parent=parent,
        created=created,
        tags=tuple(json.loads(tags)),
        metrics=json.loads(metrics),
        tensors=tensors,
        nbytes=nbytes,
    )


def _use_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """Put the catalog file in WAL mode (a property of the file: set once, kept).

    Switching takes the file's exclusive lock, and while another connection holds its
    write lock SQLite answers "database is locked" at once, without the busy handler: two
    processes opening a new shared catalog together failed that way (1 run in 12 of the
    four-process repository test). So wait and look again, as the busy timeout would.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
