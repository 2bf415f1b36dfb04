"""Writing a local ImageFolder tree as WebDataset `.tar` shards or Parquet files.

Samples are written in a seeded shuffled order, as WebDataset's own tools write them: a
shard's consecutive members are then as good as a random draw, which is what lets an
epoch read runs of them with one request each and still train on mixed batches.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from hapi.data.dataset_manifest import DatasetManifest
from hapi.data.folder import local_images
from hapi.data.store import ObjectStore
from hapi.errors import InvalidRequest

__all__ = ["ROWS_PER_GROUP", "ShardFormat", "import_shards", "write_shards"]

ShardFormat = Literal["webdataset", "parquet"]

ROWS_PER_GROUP = 64
"""Rows per Parquet row group: a row group is what one request reads, so about a chunk."""

Sample = tuple[str, bytes, str, int]
"""(key, image bytes, image extension, label)."""


def import_shards(
    directory: str | Path,
    store: ObjectStore,
    prefix: str = "",
    *,
    format: ShardFormat,
    shard_size: int = 256 << 20,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> DatasetManifest:
    """Write a local ImageFolder tree (`<dir>/<class>/<image>`) under `prefix` as shards.

    Args:
        directory: the tree's root.
        store: where to write.
        prefix: the dataset's folder in the store.
        format: `webdataset` (`part-00000.tar`, members `KEY.jpg` + `KEY.cls`, and the
            class names in `classes.txt`) or `parquet` (`part-00000.parquet`, columns
            `image` - Hugging Face's struct of `bytes` and `path` - and `label`).
        shard_size: start a new shard before one passes this many bytes.
        seed: the shuffle of the samples across shards.
        progress: called with the number of images written so far.

    Returns:
        The dataset's manifest, as `DatasetManifest.from_store` lists it.

    Raises:
        ObjectNotFound: the directory holds no class folders of images.
        InvalidRequest: an unknown format or a shard size below 1.
    """
    root = Path(directory).expanduser()
    files = local_images(root)
    classes = sorted({p.relative_to(root).parts[0] for p in files})
    ids = {c: i for i, c in enumerate(classes)}
    order = np.random.default_rng(seed).permutation(len(files))

    def samples() -> Iterator[Sample]:
        for n, i in enumerate(order):
            path = files[i]
            if progress is not None:
                progress(n)
            key = f"{n:08d}"
            yield (
                key,
                path.read_bytes(),
                path.suffix.lower().lstrip("."),
                ids[path.relative_to(root).parts[0]],
            )

    write_shards(store, prefix, samples(), classes, format=format, shard_size=shard_size)
    if progress is not None:
        progress(len(files))
    return DatasetManifest.from_store(store, prefix)


def write_shards(
    store: ObjectStore,
    prefix: str,
    samples: Iterator[Sample],
    classes: list[str],
    *,
    format: ShardFormat,
    shard_size: int = 256 << 20,
) -> list[str]:
    """Write `samples` in order as shards of at most about `shard_size` bytes; return the
    shards' keys."""
    if format not in ("webdataset", "parquet"):
        raise InvalidRequest(f"unknown shard format {format!r}: use webdataset or parquet")
    if shard_size < 1:
        raise InvalidRequest(f"shard_size must be >= 1 byte, got {shard_size}")
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    ext = "tar" if format == "webdataset" else "parquet"
    encode = _tar if format == "webdataset" else _parquet
    written: list[str] = []
    batch: list[Sample] = []
    size = 0
    for sample in samples:
        if batch and size + len(sample[1]) > shard_size:
            written.append(_put(store, base, ext, len(written), encode(batch, classes)))
            batch, size = [], 0
        batch.append(sample)
        size += len(sample[1]) + 1024
    if batch:
        written.append(_put(store, base, ext, len(written), encode(batch, classes)))
    if format == "webdataset":
        store.put(f"{base}classes.txt", "".join(f"{c}\n" for c in classes).encode())
    return written


def _put(store: ObjectStore, base: str, ext: str, n: int, data: bytes) -> str:
    key = f"{base}part-{n:05d}.{ext}"
    store.put(key, data)
    return key


def _tar(batch: list[Sample], classes: list[str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, data, ext, label in batch:
            for name, body in ((f"{key}.{ext}", data), (f"{key}.cls", f"{label}".encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(body), 0o444, 0
                tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def _parquet(batch: list[Sample], classes: list[str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Hugging Face's metadata, so `datasets` reads the column as Image() and the labels
    # as a ClassLabel with these names (and so does `DatasetManifest.from_store`).
    features = {
        "image": {"_type": "Image"},
        "label": {"_type": "ClassLabel", "names": classes},
    }
    table = pa.table(
        {
            "image": [{"bytes": data, "path": f"{key}.{ext}"} for key, data, ext, _ in batch],
            "label": pa.array([label for *_, label in batch], pa.int64()),
        }
    ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    out = io.BytesIO()
    # Images are compressed already: no codec, and no dictionary of unique bytes.
    pq.write_table(
        table, out, row_group_size=ROWS_PER_GROUP, compression="none", use_dictionary=["label"]
    )
    return out.getvalue()
