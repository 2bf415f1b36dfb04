"""Datasets in other layouts than an ImageFolder tree: WebDataset shards, Parquet files, a
key list. `DatasetManifest.from_store` calls `list_layout` first; what the dataset
string names decides the layout, so a job, a server's `manifest` action and `hapi data ls`
list the same samples from the same string, with no option to agree on:

- `shards/` holding `.tar` files, `shards/train-{000..015}.tar`, or one `x.tar`: WebDataset;
- `data/` holding `.parquet` files, a brace pattern of them, or one `x.parquet`: Parquet;
- `lists/train.csv` or `.jsonl` (`key,label` rows, keys relative to the list's folder).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pyarrow.compute as pc

from hapi.data.columns import Versions
from hapi.data.shards.damage import ShardDamage
from hapi.data.shards.members import member_store, split_member
from hapi.data.shards.parquet_index import LABEL_COLUMNS, ParquetIndex, class_names, find_column
from hapi.data.shards.tar_index import TarIndex
from hapi.data.store import ObjectStore
from hapi.errors import CorruptObject, InvalidRequest, ObjectNotFound, shorten

__all__ = [
    "SHARD_EXTENSIONS",
    "Listing",
    "expand_braces",
    "list_key_list",
    "list_layout",
    "list_parquet",
    "names_files",
]

SHARD_EXTENSIONS = (".tar", ".parquet")
_LISTS = (".csv", ".jsonl")
_SHARD_ENDING = "(" + "|".join(re.escape(e) for e in SHARD_EXTENSIONS) + ")$"
HIDDEN = r"(^|/)\."
"""A key with a part starting with `.` (`.ipynb_checkpoints`, `.DS_Store`): left out."""
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace notation: `a-{000..002}.tar` -> a-000.tar, a-001.tar, a-002.tar
    (zero padding kept), `{train,val}.tar` -> each; several braces multiply."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    span = _RANGE.match(body)
    if span:
        lo, hi = span.groups()
        width = len(lo) if lo.startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [x for c in choices for x in expand_braces(head + c + tail)]


class Listing(NamedTuple):
    """A dataset's samples as its layout lists them: the fields of its `DatasetManifest`
    after the prefix (`DatasetManifest.from_store` makes the manifest of them)."""

    keys: tuple[str, ...]
    labels: tuple[int, ...]
    classes: tuple[str, ...]
    versions: tuple[str, ...] = ()
    damaged: tuple[ShardDamage, ...] = ()


def names_files(prefix: str) -> bool:
    """Whether a dataset string names files (a brace pattern, a shard, a key list), which
    `list_layout` lists itself, rather than a folder."""
    return "{" in prefix or prefix.lower().endswith((*_LISTS, *SHARD_EXTENSIONS))


def list_layout(store: ObjectStore, prefix: str, listing: Versions | None = None) -> Listing | None:
    """The samples of a sharded or listed dataset named by `prefix`; None for a prefix
    that holds no shards (an ImageFolder tree, listed by the caller).

    `listing`: the prefix's listing, where the caller holds it - listed once, not again
    here (a million keys take seconds to list).

    Raises:
        ObjectNotFound: a shard or list named does not exist, or a listed key.
        InvalidRequest: shards of both formats under one prefix, or shards beside images.
        CorruptObject: a shard or list that cannot be read, naming it and the member.
    """
    lower = prefix.lower()
    if lower.endswith(_LISTS):
        return list_key_list(store, prefix)
    if "{" in prefix:
        names = expand_braces(prefix)
        folder = _folder(names[0])
        listed = dict(store.list_versions(folder))
        missing = [n for n in names if n not in listed]
        if missing:
            raise ObjectNotFound(
                f"shard {shorten(repr(missing[0]))} of pattern {prefix!r} is not in store "
                f"{store.uri} ({len(missing)} of {len(names)} missing): check the pattern"
            )
        return _list_shards(store, prefix, [(n, listed[n]) for n in names])
    if lower.endswith(SHARD_EXTENSIONS):
        listed = dict(store.list_versions(_folder(prefix)))
        if prefix not in listed:
            raise ObjectNotFound(f"no shard {prefix!r} in store {store.uri}")
        return _list_shards(store, prefix, [(prefix, listed[prefix])])
    base = f"{prefix}/" if prefix else ""
    objects = listing if listing is not None else Versions.of_listing(store.list_versions(prefix))
    # Column by column (Arrow kernels), not key by key: a million keys in milliseconds.
    keys = objects.key_column.array
    visible = pc.and_(pc.starts_with(keys, base), pc.invert(pc.match_substring_regex(keys, HIDDEN)))
    is_shard = pc.match_substring_regex(keys, _SHARD_ENDING, ignore_case=True)
    nested = pc.match_substring(pc.utf8_slice_codeunits(keys, len(base)), "/")
    images = pc.sum(pc.and_(pc.and_(visible, pc.invert(is_shard)), nested)).as_py() or 0
    picked = pc.and_(visible, is_shard)
    shards = list(
        zip(
            keys.filter(picked).to_pylist(),
            objects.version_column.array.filter(picked).to_pylist(),
            strict=True,
        )
    )
    if not shards:
        return None
    if images:
        raise InvalidRequest(
            f"prefix {prefix!r} holds both shards ({len(shards)}) and other objects in "
            f"folders ({images}): name the shards alone with a pattern such as "
            f"{base}train-{{000..009}}.tar, or keep them under a prefix of their own"
        )
    return _list_shards(store, prefix, sorted(shards))


def list_parquet(
    store: ObjectStore,
    files: Sequence[tuple[str, str]],
    *,
    image_column: str | None = None,
    label_column: str | None = None,
) -> Listing:
    """The rows of Parquet `files` ((key, version), in order) as samples.

    Args:
        image_column: the column of image bytes (or Hugging Face's `image` struct); found
            by name (`IMAGE_COLUMNS`) when None. Keys then say it (`#row=N&image=COL`).
        label_column: the label column; found by name (`LABEL_COLUMNS`) when None.
    """
    indexes = member_store(store).indexes

    def index(name: str, version: str) -> ParquetIndex | CorruptObject:
        try:
            found = indexes.get(name, image=image_column, version=version)
        except CorruptObject as exc:  # no footer (cut short), or a damaged one
            return exc
        assert isinstance(found, ParquetIndex)  # a .parquet key
        return found

    built = _all(lambda f: index(*f), files)
    keys, labels, versions, names = [], [], [], None
    damaged: list[ShardDamage] = []
    suffix = f"&image={image_column}" if image_column else ""
    for (name, version), found in zip(files, built, strict=True):

        def read(start: int, end: int, shard: str = name) -> bytes:
            return bytes(indexes.read(shard, start, end, image=image_column))

        try:
            if isinstance(found, CorruptObject):
                raise found
            schema = _schema(found)
            column = label_column or find_column(schema, LABEL_COLUMNS, name, "label")
            labels += found.labels(read, column, name=name)
        except CorruptObject as exc:
            # Its rows cannot be listed: the file is named, and the other files train.
            damaged.append(ShardDamage(name, store.size(name), 0, f"unreadable ({exc})"))
            continue
        names = names or class_names(schema, column)
        keys += [f"{name}#row={r}{suffix}" for r in range(found.rows)]
        versions += [version] * found.rows
    if not keys and damaged:
        raise damaged[0].error()
    classes, ids = _classes(labels, keys, names)
    return Listing(tuple(keys), tuple(ids), classes, tuple(versions), tuple(damaged))


def _list_shards(store: ObjectStore, prefix: str, files: list[tuple[str, str]]) -> Listing:
    kinds = {f.lower().rsplit(".", 1)[-1] for f, _ in files}
    if len(kinds) > 1:
        raise InvalidRequest(
            f"prefix {prefix!r} holds both .tar and .parquet shards: give each dataset a "
            "prefix of its own, or name one kind with a pattern"
        )
    if kinds == {"parquet"}:
        return list_parquet(store, files)
    indexes = member_store(store).indexes
    built = _all(lambda f: indexes.get(f[0], version=f[1]), files)
    keys, labels, versions = [], [], []
    damaged: list[ShardDamage] = []
    for (name, version), index in zip(files, built, strict=True):
        assert isinstance(index, TarIndex)  # a .tar key
        if index.damage is not None:
            damaged.append(index.damage)
        for sample in index.samples:
            if sample.label is None:
                raise CorruptObject(
                    f"sample {shorten(repr(sample.key))} of shard {name} has no label: "
                    "add KEY.cls (an integer) or KEY.json with a 'label' field"
                )
            keys.append(f"{name}#{sample.key}")
            labels.append(sample.label)
            versions.append(version)
    if not keys:
        if damaged:
            raise damaged[0].error()
        raise ObjectNotFound(f"no samples in the shards of {prefix!r} in store {store.uri}")
    classes, ids = _classes(labels, keys, _class_file(store, _folder(files[0][0])))
    return Listing(tuple(keys), tuple(ids), classes, tuple(versions), tuple(damaged))


def list_key_list(store: ObjectStore, name: str) -> Listing:
    """A CSV (`key,label`, a header optional) or JSONL (`{"key": .., "label": ..}`) list;
    keys are relative to the list's folder and may name shard members."""
    text = store.get(name).decode("utf-8-sig")
    rows: list[tuple[str, Any]] = []
    try:
        if name.lower().endswith(".jsonl"):
            for line in text.splitlines():
                if line.strip():
                    item = json.loads(line)
                    rows.append((str(item["key"]), item["label"]))
        else:
            for i, row in enumerate(csv.reader(io.StringIO(text))):
                if not row or (i == 0 and row[0].strip().lower() == "key"):
                    continue
                rows.append((row[0].strip(), _number(row[1].strip())))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise CorruptObject(
            f"key list {name} is malformed ({shorten(repr(exc))}): write `key,label` rows "
            'or JSON lines {"key": ..., "label": ...}'
        ) from None
    folder = _folder(name)
    keys = [f"{folder}/{k}" if folder else k for k, _ in rows]
    listed = dict(store.list_versions(folder))
    versions = []
    for key in keys:
        parts = split_member(key)
        version = listed.get(parts[0] if parts else key)
        if version is None:
            raise ObjectNotFound(
                f"key {shorten(repr(key))} of list {name} is not in store {store.uri}: "
                "keys are relative to the list's folder"
            )
        versions.append(version)
    classes, ids = _classes([v for _, v in rows], keys, None)
    return Listing(tuple(keys), tuple(ids), classes, tuple(versions))


def _classes(
    labels: Sequence[Any], keys: Sequence[str], names: Sequence[str] | None
) -> tuple[tuple[str, ...], list[int]]:
    """Class names and label ids: integer labels keep their values (names from `names`, or
    the numbers), string labels are the sorted names."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        top = max(labels, default=-1) + 1
        if min(labels, default=0) < 0:
            bad = next(k for k, v in zip(keys, labels, strict=True) if v < 0)
            raise CorruptObject(f"sample {shorten(repr(bad))} has a negative label")
        if names is not None and len(names) >= top:
            return tuple(names), list(labels)
        return tuple(str(i) for i in range(top)), list(labels)
    if not all(isinstance(v, str) for v in labels):
        bad = next(k for k, v in zip(keys, labels, strict=True) if not isinstance(v, int | str))
        raise CorruptObject(f"sample {shorten(repr(bad))} has a label that is no int or string")
    text = [str(v) for v in labels]
    classes = tuple(sorted(set(text)))
    index = {c: i for i, c in enumerate(classes)}
    return classes, [index[v] for v in text]


def _class_file(store: ObjectStore, folder: str) -> list[str] | None:
    """Class names from `classes.txt` beside the shards (one a line), if there is one."""
    try:
        text = store.get(f"{folder}/classes.txt" if folder else "classes.txt").decode()
    except (ObjectNotFound, UnicodeDecodeError, InvalidRequest):
        return None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _schema(index: ParquetIndex) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_metadata(pa.BufferReader(b"PAR1" + index.footer)).schema.to_arrow_schema()


def _all(build: Any, files: Iterable[Any]) -> list[Any]:
    # Shards are indexed side by side: each is a few small reads that wait on the store.
    files = list(files)
    with ThreadPoolExecutor(min(16, max(1, len(files))), thread_name_prefix="hapi-index") as pool:
        return list(pool.map(build, files))


def _folder(key: str) -> str:
    return key.rpartition("/")[0]


def _number(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text
