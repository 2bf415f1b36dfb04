"""A dataset by URI: the store at that URI, read as an ImageFolder layout from its root."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hapi.data.dataset_manifest import DatasetManifest
from hapi.data.shards.damage import ShardDamage
from hapi.data.shards.members import split_member
from hapi.data.store import ObjectStore, Store, StoreOptions, open_store

__all__ = ["DatasetSummary", "open_dataset", "summarize"]


def open_dataset(
    uri: str | os.PathLike[str], options: StoreOptions | None = None
) -> tuple[Store, DatasetManifest]:
    """Open the dataset whose root is `uri` and list it.

    A dataset URI is a store URI (`/data/train`, `s3://bucket/train`) whose root holds
    `<class>/<image>` folders, so the manifest's prefix is `""` and its keys are relative
    to that root. To keep several datasets in one store, open the store and call
    `DatasetManifest.from_store(store, "train")` instead.

    Raises:
        ObjectNotFound: no images in the ImageFolder layout at `uri` (a missing local
            directory is reported, not made).
        StoreUnavailable: the store cannot be reached.
    """
    store = open_store(uri, options, create=False)
    return store, DatasetManifest.from_store(store)


@dataclass(frozen=True, kw_only=True)
class DatasetSummary:
    """What a dataset holds, for a one-line report."""

    images: int
    """Number of images."""
    counts: dict[str, int]
    """Images per class, in class order."""
    nbytes: int
    """Total size of the images in bytes (of the shards, for a sharded dataset)."""
    shards: int = 0
    """WebDataset or Parquet shards the samples are members of (damaged ones included);
    0 for one object each."""
    damaged: tuple[ShardDamage, ...] = ()
    """Shards that break off before their end: their complete samples are counted."""

    def __str__(self) -> str:
        per_class = ", ".join(f"{c}: {n}" for c, n in self.counts.items())
        shards = f" in {self.shards} shards" if self.shards else ""
        line = (
            f"{self.images} images, {len(self.counts)} classes ({per_class}), "
            f"{self.nbytes / 1e6:.2f} MB{shards}"
        )
        if not self.damaged:
            return line
        bad = "".join(f"\n  {d.describe()}" for d in self.damaged)
        return (
            f"{line}; {len(self.damaged)} damaged (upload again whole; their complete "
            f"samples are counted):{bad}"
        )


def summarize(
    store: ObjectStore, manifest: DatasetManifest, *, in_flight: int = 16
) -> DatasetSummary:
    """Count a dataset's images per class and their bytes (one HEAD request per object:
    per image, or per shard)."""
    shards = {p[0] for k in manifest.keys if (p := split_member(k)) is not None}
    shards |= {d.shard for d in manifest.damaged}
    objects = sorted(shards | {k for k in manifest.keys if split_member(k) is None})
    with ThreadPoolExecutor(in_flight, thread_name_prefix="hapi-size") as pool:
        nbytes = sum(pool.map(store.size, objects))
    return DatasetSummary(
        images=len(manifest),
        counts=manifest.counts(),
        nbytes=nbytes,
        shards=len(shards),
        damaged=manifest.damaged,
    )
