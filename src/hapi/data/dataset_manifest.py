"""`DatasetManifest`: a dataset's keys and labels, read from an ImageFolder layout."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hapi.data.columns import Column, Versions, column_of
from hapi.data.formats import HIDDEN, list_layout, names_files
from hapi.data.shards.damage import ShardDamage
from hapi.data.store import ObjectStore
from hapi.errors import InvalidRequest, ObjectNotFound

__all__ = ["IMAGE_EXTENSIONS", "DatasetManifest"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
"""File name endings (any case) that `DatasetManifest.from_store` and `import_folder` take."""

_META = "hapi.manifest"
"""The key of `to_arrow`'s schema metadata: the prefix, classes and damaged shards."""


@dataclass(frozen=True)
class DatasetManifest:
    """The samples of a dataset: full store keys, integer labels, and class names.

    `keys[i]` is the full store key (prefix included) of sample i, `labels[i]` indexes
    `classes`. `from_store` sorts keys, so the same store always gives the same manifest,
    and an epoch's order (a seeded permutation of it) is the same on every machine. Keys,
    labels and versions are compact columns (`hapi.data.columns`), about 60 bytes a sample
    rather than a Python object each; any sequence given is made one.

    Raises:
        InvalidRequest: keys and labels differ in length, a label does not index
            `classes`, or a class name repeats.
    """

    prefix: str
    keys: Column[str]
    labels: Column[int]
    classes: tuple[str, ...]
    versions: Column[str] = field(default_factory=lambda: Column.strings(()), compare=False)
    """Each key's version as listed (`ObjectStore.list_versions`), or empty where unknown:
    the feature cache keys a sample by it, so a rewritten object is never a stale hit.
    Not part of equality: the same samples in the same order are the same dataset."""
    damaged: tuple[ShardDamage, ...] = field(default=(), compare=False)
    """Shards that break off before their end (an upload cut short): their complete
    samples are in `keys`, the rest lost (`ShardDamage.lost_keys`)."""

    def __post_init__(self) -> None:
        for name in ("keys", "versions"):
            object.__setattr__(self, name, column_of(getattr(self, name)))
        object.__setattr__(self, "labels", column_of(self.labels, ints=True))
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "damaged", tuple(self.damaged))
        if len(self.keys) != len(self.labels):
            raise InvalidRequest(
                f"manifest has {len(self.keys)} keys but {len(self.labels)} labels"
            )
        if len(self.versions) and len(self.versions) != len(self.keys):
            raise InvalidRequest(
                f"manifest has {len(self.keys)} keys but {len(self.versions)} versions"
            )
        if len(set(self.classes)) != len(self.classes):
            raise InvalidRequest(f"manifest class names repeat: {self.classes}")
        labels = self.labels.numpy()
        bad = labels[(labels < 0) | (labels >= len(self.classes))]
        if len(bad):
            raise InvalidRequest(
                f"manifest label {int(bad[0])!r} does not index its {len(self.classes)} classes"
            )

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def from_store(
        cls, store: ObjectStore, prefix: str = "", *, extensions: Sequence[str] = IMAGE_EXTENSIONS
    ) -> DatasetManifest:
        """List the dataset named by `prefix`: an ImageFolder layout
        (`<prefix>/<class>/<name>.<ext>`), or WebDataset `.tar` shards, Parquet files or a
        CSV/JSONL key list (`hapi.data.formats` says how each is named).

        Classes are the folders right under the prefix, sorted by name. Images nested
        deeper (`<prefix>/<class>/a/b.jpg`) belong to their first folder's class, as in
        an ImageFolder tree with subfolders. Ignored: objects directly under the prefix,
        other extensions, and any path with a part starting with `.` (`.ipynb_checkpoints`,
        `.DS_Store`).

        Args:
            store: the store to list.
            prefix: the dataset's folder in the store; `""` for the store's root.
            extensions: the file name endings (any case) that count as images.

        Raises:
            ObjectNotFound: no images in that layout under the prefix.
            InvalidRequest, CorruptObject: shards that cannot be listed (`list_layout`).
        """
        prefix = prefix.strip("/")
        # A plain prefix is listed once, for both: the shards under it, else its images.
        # A plain prefix is listed once, for both: the shards under it, else its images.
        listed = None if names_files(prefix) else _listed(store, prefix)
        sharded = list_layout(store, prefix, listed)
        if sharded is not None:
            return cls(
                prefix,
                Column.strings(sharded.keys),
                Column.ints(sharded.labels),
                sharded.classes,
                Column.strings(sharded.versions),
                sharded.damaged,
            )
        base = f"{prefix}/" if prefix else ""
        if listed is None:
            listed = _listed(store, prefix)
        keys, folders, versions = _image_folder(listed, base, extensions)
        del listed  # before the sorted copies: a listing's peak is a manifest's
        if not len(keys):
            where = f"under prefix {prefix!r}" if prefix else "at the root"
            raise ObjectNotFound(
                f"no images {where} of store {store.uri}: expected the ImageFolder layout "
                f"{base}<class>/<name>.jpg (create one with `hapi data synth` or "
                "`hapi data import`)"
            )
        classes = pc.unique(folders.array).sort()
        order = pc.sort_indices(keys.array)
        labels = pc.index_in(folders.array.take(order), value_set=classes)
        return cls(
            prefix=prefix,
            keys=Column(keys.array.take(order)),
            labels=Column.ints(labels),
            classes=tuple(classes.to_pylist()),
            versions=Column(versions.array.take(order)),
        )

    def subset(self, indices: Sequence[int] | np.ndarray) -> DatasetManifest:
        """The manifest of the samples at `indices`, in that order (same classes)."""
        return DatasetManifest(
            self.prefix,
            self.keys.subset(indices),
            self.labels.subset(indices),
            self.classes,
            self.versions.subset(indices) if len(self.versions) else self.versions,
        )

    def version_map(self) -> Versions | None:
        """Each key's version, or None where the listing gave none (an older server)."""
        return self._versions if len(self.versions) else None

    @cached_property
    def _versions(self) -> Versions:
        # One index of the keys for the manifest's life: each makes a hash a key.
        return Versions(self.keys, self.versions)

    def counts(self) -> dict[str, int]:
        """The number of samples of each class, in class order."""
        tally = np.bincount(self.labels.numpy(), minlength=len(self.classes))
        return dict(zip(self.classes, map(int, tally), strict=True))

    def to_arrow(self) -> pa.Table:
        """The manifest as one Arrow table (`key`, `label`, and `version` where listed),
        its prefix, classes and damaged shards in the schema's metadata: how it crosses
        the wire (`hapi.wire.manifest`) - a million keys in about 60 MB, no JSON."""
        columns = {"key": self.keys.array, "label": self.labels.array}
        if len(self.versions):
            columns["version"] = self.versions.array
        about = {
            "prefix": self.prefix,
            "classes": list(self.classes),
            "damaged": [d.to_dict() for d in self.damaged],
        }
        return pa.table(columns, metadata={_META: json.dumps(about)})

    @classmethod
    def from_arrow(cls, table: pa.Table) -> DatasetManifest:
        """Read a manifest from `to_arrow` output.

        Raises:
            InvalidRequest: a column or the metadata is missing or of the wrong type.
        """
        try:
            about = json.loads((table.schema.metadata or {})[_META.encode()])
            names = set(table.column_names)
            if not {"key", "label"} <= names:
                raise TypeError(f"columns key and label expected, got {sorted(names)}")
            versions = table.column("version") if "version" in names else ()
            return cls(
                str(about["prefix"]),
                Column.strings(table.column("key")),
                Column.ints(table.column("label")),
                tuple(about["classes"]),
                Column.strings(versions) if len(versions) else Column.strings(()),
                tuple(ShardDamage.from_dict(d) for d in about.get("damaged", [])),
            )
        except KeyError as exc:
            raise InvalidRequest(f"malformed manifest: no field {exc}") from exc
        except (TypeError, ValueError, pa.ArrowInvalid) as exc:
            raise InvalidRequest(f"malformed manifest: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form; `from_dict` reads it back."""
        return {
            "prefix": self.prefix,
            "keys": list(self.keys),
            "labels": list(self.labels),
            "classes": list(self.classes),
            **({"versions": list(self.versions)} if self.versions else {}),
            **({"damaged": [d.to_dict() for d in self.damaged]} if self.damaged else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetManifest:
        """Read a manifest from `to_dict` output.

        Raises:
            InvalidRequest: a field is missing or of the wrong type.
        """
        try:
            keys, classes = data["keys"], data["classes"]
            if not all(isinstance(v, str) for v in [data["prefix"], *keys, *classes]):
                raise TypeError("prefix, keys and classes must be strings")
            labels = data["labels"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
                raise TypeError("labels must be integers")
            # Absent from an older server's listing: the cache then keys by key alone
            # (`hapi.cache` says what that risks).
            versions = data.get("versions", [])
            if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
                raise TypeError("versions must be strings")
            damaged = tuple(ShardDamage.from_dict(d) for d in data.get("damaged", []))
            return cls(
                data["prefix"],
                Column.strings(keys),
                Column.ints(labels),
                tuple(classes),
                Column.strings(versions),
                damaged,
            )
        except KeyError as exc:
            raise InvalidRequest(f"malformed manifest: no field {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed manifest: {exc}") from exc


def _listed(store: ObjectStore, prefix: str) -> Versions:
    """The prefix's objects and their versions, held as two columns (listed once, read by
    both `list_layout` and `_image_folder`)."""
    return Versions.of_listing(store.list_versions(prefix))


def _image_folder(
    listed: Versions, base: str, extensions: Sequence[str]
) -> tuple[Column[str], Column[str], Column[str]]:
    """Every image of an ImageFolder layout under `base`: its key, class folder and version.

    A class is an image's first folder under `base`; objects right under it, other
    extensions and paths with a part starting with `.` are left out. Found with Arrow
    kernels over the listing's columns, not key by key.
    """
    keys = listed.key_column.array
    ending = "(" + "|".join(re.escape(e) for e in extensions) + ")$"
    folder = pc.extract_regex(pc.utf8_slice_codeunits(keys, len(base)), "^(?P<folder>[^/]*)/")
    kept = pc.and_(
        pc.and_(pc.starts_with(keys, base), folder.is_valid()),
        pc.and_(
            pc.match_substring_regex(keys, ending, ignore_case=True),
            pc.invert(pc.match_substring_regex(keys, HIDDEN)),
        ),
    )
    return (
        Column(keys.filter(kept)),
        Column(pc.struct_field(folder, "folder").filter(kept)),
        Column(listed.version_column.array.filter(kept)),
    )
