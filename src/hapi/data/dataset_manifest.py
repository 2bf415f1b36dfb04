"""`DatasetManifest`: a dataset's keys and labels, read from an ImageFolder layout."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hapi.data.formats import list_layout, names_files
from hapi.data.shards.damage import ShardDamage
from hapi.data.store import ObjectStore
from hapi.errors import InvalidRequest, ObjectNotFound

__all__ = ["IMAGE_EXTENSIONS", "DatasetManifest"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
"""File name endings (any case) that `DatasetManifest.from_store` and `import_folder` take."""


@dataclass(frozen=True)
class DatasetManifest:
    """The samples of a dataset: full store keys, integer labels, and class names.

    `keys[i]` is the full store key (prefix included) of sample i, `labels[i]` indexes
    `classes`. `from_store` sorts keys, so the same store always gives the same manifest,
    and an epoch's order (a seeded permutation of it) is the same on every machine.

    Raises:
        InvalidRequest: keys and labels differ in length, a label does not index
            `classes`, or a class name repeats.
    """

    prefix: str
    keys: tuple[str, ...]
    labels: tuple[int, ...]
    classes: tuple[str, ...]
    versions: tuple[str, ...] = field(default=(), compare=False)
    """Each key's version as listed (`ObjectStore.list_versions`), or empty where unknown:
    the feature cache keys a sample by it, so a rewritten object is never a stale hit.
    Not part of equality: the same samples in the same order are the same dataset."""
    damaged: tuple[ShardDamage, ...] = field(default=(), compare=False)
    """Shards that break off before their end (an upload cut short): their complete
    samples are in `keys`, the rest lost (`ShardDamage.lost_keys`)."""

    def __post_init__(self) -> None:
        for name in ("keys", "labels", "classes", "versions", "damaged"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.keys) != len(self.labels):
            raise InvalidRequest(
                f"manifest has {len(self.keys)} keys but {len(self.labels)} labels"
            )
        if self.versions and len(self.versions) != len(self.keys):
            raise InvalidRequest(
                f"manifest has {len(self.keys)} keys but {len(self.versions)} versions"
            )
        if len(set(self.classes)) != len(self.classes):
            raise InvalidRequest(f"manifest class names repeat: {self.classes}")
        bad = [v for v in self.labels if not 0 <= v < len(self.classes)]
        if bad:
            raise InvalidRequest(
                f"manifest label {bad[0]!r} does not index its {len(self.classes)} classes"
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
        listed = None if names_files(prefix) else list(store.list_versions(prefix))
        sharded = list_layout(store, prefix, listed)
        if sharded is not None:
            return cls(
                prefix,
                sharded.keys,
                sharded.labels,
                sharded.classes,
                sharded.versions,
                sharded.damaged,
            )
        base = f"{prefix}/" if prefix else ""
        listing = store.list_versions(prefix) if listed is None else listed
        pairs, versions = _image_folder(listing, base, extensions)
        if not pairs:
            where = f"under prefix {prefix!r}" if prefix else "at the root"
            raise ObjectNotFound(
                f"no images {where} of store {store.uri}: expected the ImageFolder layout "
                f"{base}<class>/<name>.jpg (create one with `hapi data synth` or "
                "`hapi data import`)"
            )
        classes = tuple(sorted({c for c, _ in pairs}))
        index = {c: i for i, c in enumerate(classes)}
        pairs.sort(key=lambda p: p[1])
        return cls(
            prefix=prefix,
            keys=tuple(k for _, k in pairs),
            labels=tuple(index[c] for c, _ in pairs),
            classes=classes,
            versions=tuple(versions[k] for _, k in pairs),
        )

    def subset(self, indices: Sequence[int]) -> DatasetManifest:
        """The manifest of the samples at `indices`, in that order (same classes)."""
        return DatasetManifest(
            self.prefix,
            tuple(self.keys[i] for i in indices),
            tuple(self.labels[i] for i in indices),
            self.classes,
            tuple(self.versions[i] for i in indices) if self.versions else (),
        )

    def version_map(self) -> dict[str, str] | None:
        """Each key's version, or None where the listing gave none (an older server)."""
        if not self.versions:
            return None
        return dict(zip(self.keys, self.versions, strict=True))

    def counts(self) -> dict[str, int]:
        """The number of samples of each class, in class order."""
        tally = [0] * len(self.classes)
        for label in self.labels:
            tally[label] += 1
        return dict(zip(self.classes, tally, strict=True))

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
                data["prefix"], tuple(keys), tuple(labels), tuple(classes), tuple(versions), damaged
            )
        except KeyError as exc:
            raise InvalidRequest(f"malformed manifest: no field {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed manifest: {exc}") from exc


def _image_folder(
    listing: Iterable[tuple[str, str]], base: str, extensions: Sequence[str]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The (class, key) of every image of an ImageFolder layout under `base`, and versions.

    A class is an image's first folder under `base`; objects right under it, other
    extensions and paths with a part starting with `.` are left out.
    """
    endings = tuple(e.lower() for e in extensions)
    pairs: list[tuple[str, str]] = []
    versions: dict[str, str] = {}
    for key, version in listing:
        if not key.startswith(base) or not key.lower().endswith(endings):
            continue
        parts = key[len(base) :].split("/")
        if len(parts) < 2 or any(p.startswith(".") for p in parts):
            continue
        pairs.append((parts[0], key))
        versions[key] = version
    return pairs, versions
