"""`Manifest`: a dataset's keys and labels, read from an ImageFolder layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hapi.data.store import ObjectStore
from hapi.errors import InvalidRequest, ObjectNotFound

__all__ = ["IMAGE_EXTENSIONS", "Manifest"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


@dataclass(frozen=True)
class Manifest:
    """The samples of a dataset: full store keys, integer labels, and class names.

    Keys are sorted, so the same store always gives the same manifest, and an epoch's
    order (a seeded permutation of it) is the same on every machine.
    """

    prefix: str
    keys: tuple[str, ...]
    labels: tuple[int, ...]
    classes: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.labels):
            raise InvalidRequest(
                f"manifest has {len(self.keys)} keys but {len(self.labels)} labels"
            )
        if any(not 0 <= label < len(self.classes) for label in self.labels):
            raise InvalidRequest("manifest labels must index its classes")

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def from_store(
        cls, store: ObjectStore, prefix: str = "", *, extensions: Sequence[str] = IMAGE_EXTENSIONS
    ) -> Manifest:
        """List an ImageFolder layout: `<prefix>/<class>/<name>.<ext>`.

        Images deeper than one folder below the prefix belong to their first folder's
        class; objects directly under the prefix, or with other extensions, are ignored.

        Raises:
            ObjectNotFound: no images in that layout under the prefix.
        """
        prefix = prefix.strip("/")
        base = f"{prefix}/" if prefix else ""
        pairs: list[tuple[str, str]] = []
        for key in store.list(prefix):
            rest = key[len(base) :] if key.startswith(base) else None
            if rest is None or "/" not in rest or not key.lower().endswith(tuple(extensions)):
                continue
            pairs.append((rest.split("/", 1)[0], key))
        if not pairs:
            raise ObjectNotFound(
                f"no images under {prefix or 'the root'!r} of {store.uri}: expected the "
                "ImageFolder layout <prefix>/<class>/<name>.jpg (create one with "
                "`hapi data synth` or `hapi data import`)"
            )
        classes = tuple(sorted({c for c, _ in pairs}))
        index = {c: i for i, c in enumerate(classes)}
        pairs.sort(key=lambda p: p[1])
        return cls(
            prefix=prefix,
            keys=tuple(k for _, k in pairs),
            labels=tuple(index[c] for c, _ in pairs),
            classes=classes,
        )

    def subset(self, indices: Sequence[int]) -> Manifest:
        """The manifest of the samples at `indices` (same classes)."""
        return Manifest(
            self.prefix,
            tuple(self.keys[i] for i in indices),
            tuple(self.labels[i] for i in indices),
            self.classes,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form; `from_dict` reads it back."""
        return {
            "prefix": self.prefix,
            "keys": list(self.keys),
            "labels": list(self.labels),
            "classes": list(self.classes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Read a manifest from `to_dict` output."""
        try:
            return cls(
                prefix=str(data["prefix"]),
                keys=tuple(data["keys"]),
                labels=tuple(int(v) for v in data["labels"]),
                classes=tuple(data["classes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed manifest: {exc}") from exc
