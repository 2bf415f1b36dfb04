"""Shards as datasets: the tar index, the Parquet reader, member reads, the shard order."""

from __future__ import annotations

import io
import itertools
import json
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hapi.client.pipeline.distributed import Shard
from hapi.data import DatasetManifest, open_store
from hapi.data.formats import expand_braces
from hapi.data.shards.members import MemberStore, member_containers, split_member
from hapi.data.shards.order import shard_order, shard_runs
from hapi.data.shards.parquet_index import ParquetIndex
from hapi.data.shards.tar_index import LARGE, TarIndex
from hapi.errors import CorruptObject, InvalidRequest, ObjectNotFound


class Counting:
    """The store at the boundary, counting the requests that reach it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.uri = inner, inner.uri
        self.ranged = 0
        self.whole = 0

    def get(self, key: str) -> bytes:
        self.whole += 1
        return bytes(self.inner.get(key))

    def get_range_versioned(self, key: str, start: int, end: int) -> tuple[bytes, str, int]:
        self.ranged += 1
        return self.inner.get_range_versioned(key, start, end)  # type: ignore[no-any-return]

    def real_key(self, key: str) -> str:
        return key


def _tar(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, body in members:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def _image(i: int, size: int = 3000) -> bytes:
    return bytes([i % 251]) * size


def _samples(n: int, start: int = 0) -> list[tuple[str, bytes]]:
    out = []
    for i in range(start, start + n):
        out += [(f"s{i:04d}.cls", str(i % 3).encode()), (f"s{i:04d}.jpg", _image(i))]
    return out


def _index(data: bytes) -> tuple[TarIndex, int]:
    reads = [0]

    def read(start: int, end: int) -> bytes:
        reads[0] += 1
        return data[start:end]

    return TarIndex.build(read, len(data), name="x.tar"), reads[0]


def test_the_tar_index_finds_each_image_and_label_by_reading_headers() -> None:
    data = _tar(_samples(40, 0))
    index, reads = _index(data)
    assert [m.key for m in index.samples] == [f"s{i:04d}" for i in range(40)]
    for i, m in enumerate(index.samples):
        assert data[m.offset : m.offset + m.size] == _image(i)
        assert m.label == i % 3
    # Small members are read through: the whole shard's headers in one request.
    assert reads == 1


def test_the_tar_index_jumps_large_members() -> None:
    data = _tar(
        [
            (name, body)
            for i in range(10)
            for name, body in ((f"v{i}.cls", b"1"), (f"v{i}.jpg", _image(i, LARGE + 4096)))
        ]
    )
    spans: list[int] = []

    def read(start: int, end: int) -> bytes:
        spans.append(end - start)
        return data[start:end]

    index = TarIndex.build(read, len(data), name="big.tar")
    assert len(index.samples) == 10
    assert all(
        data[m.offset : m.offset + m.size] == _image(i, LARGE + 4096)
        for i, m in enumerate(index.samples)
    )
    # Past a large image only a small window at the next header: most bytes never read.
    assert sum(spans) < len(data) // 2


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_long_member_names_and_json_labels_are_understood(fmt: int) -> None:
    name = "deep/" * 30 + "img"
    data = _tar(
        [(f"{name}.json", json.dumps({"label": "cat"}).encode()), (f"{name}.png", b"P")], fmt
    )
    (member,) = _index(data)[0].samples
    assert (member.key, member.label, data[member.offset : member.offset + 1]) == (
        name,
        "cat",
        b"P",
    )


def test_a_damaged_header_keeps_the_samples_before_it_and_names_the_byte() -> None:
    data = bytearray(_tar(_samples(3)))
    second = 512 + 512 + 512 + 3072  # after s0000.cls and s0000.jpg
    data[second + 10] ^= 0xFF
    index, _ = _index(bytes(data))
    assert [m.key for m in index.samples] == ["s0000"]
    damage = index.damage
    assert damage is not None and damage.at == second and damage.size == len(data)
    assert "damaged tar header" in damage.reason and damage.lost == ()
    assert damage.lost_keys() == [f"x.tar@bytes={second}-{len(data)}"]
    with pytest.raises(CorruptObject, match="'only'.*no image member"):
        _index(_tar([("only.cls", b"1")]))


@pytest.mark.parametrize(
    ("cut", "kept", "lost"),
    [
        # s0001's header is at 4608: .cls (header + a block), then .jpg's header at 5632.
        (4608 + 512 + 200, ["s0000"], ["s0001"]),  # inside s0001.cls
        (5632 + 512 + 1000, ["s0000"], ["s0001"]),  # inside s0001.jpg: it has a label only
        (5632 + 100, ["s0000"], ["s0001"]),  # a partial header: s0001 has no image yet
        (9216, ["s0000", "s0001"], []),  # on a member boundary: no end-of-archive blocks
        (300, [], []),  # before the first whole header: nothing to name, a byte range
    ],
)
def test_a_shard_cut_short_keeps_its_whole_samples_and_names_the_rest(
    cut: int, kept: list[str], lost: list[str]
) -> None:
    data = _tar(_samples(3))[:cut]
    index, _ = _index(data)
    assert [m.key for m in index.samples] == kept
    damage = index.damage
    assert damage is not None and damage.size == cut and "cut short" in damage.reason
    assert list(damage.lost) == lost
    assert damage.lost_keys() == (
        [f"x.tar#{k}" for k in lost] or [f"x.tar@bytes={damage.at}-{cut}"]
    )
    assert TarIndex.from_dict(json.loads(json.dumps(index.to_dict()))) == index


def test_a_whole_shard_has_no_damage() -> None:
    index, _ = _index(_tar(_samples(3)))
    assert index.damage is None and len(index.samples) == 3


def test_a_chunk_of_contiguous_members_costs_one_ranged_request(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put("shards/a.tar", _tar(_samples(64)))
    counting = Counting(store)
    members = MemberStore(counting)
    keys = [f"shards/a.tar#s{i:04d}" for i in (7, 3, 5, 4, 6, 8)]  # any order within a run
    members.indexes.get("shards/a.tar")
    before = counting.ranged
    got = list(members.read(keys))
    assert counting.ranged - before == 1 and counting.whole == 0
    assert got == [_image(i) for i in (7, 3, 5, 4, 6, 8)]
    # Far apart (more than max_gap between them): a request each.
    far = MemberStore(counting, max_gap=0)
    before = counting.ranged
    list(far.read(["shards/a.tar#s0001", "shards/a.tar#s0040"]))
    assert counting.ranged - before == 2


def test_a_span_past_max_span_is_read_in_pieces_that_give_the_same_bytes(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    store.put("s/a.tar", _tar(_samples(8)))
    images = [_image(i) for i in range(20)]
    store.put("s/b.parquet", _parquet({"image": images, "label": [0] * 20}, 10))
    counting = Counting(store)
    pieces = MemberStore(counting, max_span=7000)  # a tar sample is about 4 KiB
    tar_keys = [f"s/a.tar#s{i:04d}" for i in (5, 0, 7, 2)]
    rows = [f"s/b.parquet#row={i}" for i in (3, 12, 0)]
    pieces.indexes.get("s/a.tar")
    pieces.indexes.get("s/b.parquet")
    before = counting.ranged
    assert list(pieces.read(tar_keys + rows)) == [_image(i) for i in (5, 0, 7, 2, 3, 12, 0)]
    whole = MemberStore(counting)
    wide = counting.ranged - before
    before = counting.ranged
    list(whole.read(tar_keys + rows))
    # One request per tar run and per row group when whole; more in pieces.
    assert counting.ranged - before == 3 and wide > 3


def test_a_missing_member_or_shard_is_an_error_for_that_key_alone(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put("s/a.tar", _tar(_samples(4)))
    got = store.get_many(["s/a.tar#s0001", "s/a.tar#nope", "s/b.tar#s0001"])
    assert got[0] == _image(1)
    assert isinstance(got[1], ObjectNotFound) and "nope" in str(got[1])
    assert isinstance(got[2], ObjectNotFound)


def test_a_rewritten_shard_is_indexed_again_and_read_at_its_new_offsets(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put("s/a.tar", _tar(_samples(4)))
    assert store.get("s/a.tar#s0002") == _image(2)
    store.put("s/a.tar", _tar([("s0002.cls", b"0"), ("s0002.jpg", b"new")]))
    assert store.get("s/a.tar#s0002") == b"new"
    _, version = store.get_versioned("s/a.tar#s0002")
    assert version == dict(store.list_versions("s"))["s/a.tar"]


def _parquet(
    columns: dict[str, Any], rows_per_group: int, meta: dict[str, Any] | None = None
) -> bytes:
    table = pa.table(columns)
    if meta is not None:
        table = table.replace_schema_metadata({"huggingface": json.dumps(meta)})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=rows_per_group)
    return out.getvalue()


def test_the_parquet_reader_decodes_a_row_group_from_its_column_bytes_alone() -> None:
    images = [_image(i, 2000 + i) for i in range(30)]
    data = _parquet(
        {
            "image": [{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(images)],
            "label": [0] * 30,
        },
        rows_per_group=8,
    )
    index = ParquetIndex.build(lambda s, e: data[s:e], len(data), name="f.parquet", image=None)
    assert [g.rows for g in index.groups] == [8, 8, 8, 6] and index.image == "image"
    for g, group in enumerate(index.groups):
        # Only the column's span, in two pieces (as parallel ranged reads give it): the
        # rest of the file is not given to the decoder.
        mid = (group.start + group.end) // 2
        pieces = [(group.start, data[group.start : mid]), (mid, data[mid : group.end])]
        rows = index.read_group(g, pieces, name="f.parquet")
        assert rows == images[group.first_row : group.first_row + group.rows]
    with pytest.raises(CorruptObject, match="not a Parquet file"):
        ParquetIndex.build(lambda s, e: b"x" * 20, 20, name="bad.parquet", image=None)


def test_parquet_columns_by_name_hugging_face_class_names_and_row_keys(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    names = ["ant", "bee"]
    meta = {"info": {"features": {"label": {"_type": "ClassLabel", "names": names}}}}
    store.put(
        "d/a.parquet",
        _parquet(
            {"image": [_image(i) for i in range(10)], "label": [i % 2 for i in range(10)]}, 4, meta
        ),
    )
    store.put("d/b.parquet", _parquet({"pic": [_image(50)], "y": ["cat"]}, 4))
    manifest = DatasetManifest.from_store(store, "d/a.parquet")
    assert manifest.classes == ("ant", "bee") and manifest.labels[:3] == (0, 1, 0)
    assert manifest.keys[9] == "d/a.parquet#row=9"
    assert store.get(manifest.keys[9]) == _image(9)
    with pytest.raises(InvalidRequest, match="no image column.*pic"):
        DatasetManifest.from_store(store, "d/b.parquet")
    from hapi.data.formats import list_parquet

    listed = [(k, v) for k, v in store.list_versions("d") if k == "d/b.parquet"]
    named = list_parquet(store, listed, image_column="pic", label_column="y")
    assert named.keys == ("d/b.parquet#row=0&image=pic",) and named.classes == ("cat",)
    assert store.get(named.keys[0]) == _image(50)
    with pytest.raises(InvalidRequest, match="names no Parquet row"):
        store.get("d/a.parquet#rows=1")


def test_chunks_in_flight_together_read_a_row_group_they_share_once(tmp_path: Path) -> None:
    # A chunk of the shard order straddles two row groups, so the chunk in flight beside
    # it needs one of them too: the store is slow enough that both ask at once.
    store = open_store(tmp_path)
    store.put("d/a.parquet", _parquet({"image": [_image(i) for i in range(24)]}, 8))

    class Slow(Counting):
        def get_range_versioned(self, key: str, start: int, end: int) -> tuple[bytes, str, int]:
            time.sleep(0.3)
            return super().get_range_versioned(key, start, end)

    counting = Slow(store)
    members = MemberStore(counting)
    members.indexes.get("d/a.parquet")
    before = counting.ranged
    chunks = [[f"d/a.parquet#row={r}" for r in rows] for rows in (range(4, 12), range(12, 20))]
    with ThreadPoolExecutor(2) as pool:
        read = list(pool.map(lambda keys: list(members.read(keys)), chunks))
    assert read == [[_image(r) for r in rows] for rows in (range(4, 12), range(12, 20))]
    assert counting.ranged - before == 3  # groups 0, 1 and 2, each once


def test_key_lists_in_csv_and_jsonl(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    for i in range(3):
        store.put(f"lists/img/{i}.jpg", _image(i))
    store.put("lists/train.csv", b"key,label\nimg/0.jpg,dog\nimg/2.jpg,cat\n")
    store.put("lists/train.jsonl", b'{"key": "img/1.jpg", "label": 4}\n')
    csv = DatasetManifest.from_store(store, "lists/train.csv")
    assert csv.keys == ("lists/img/0.jpg", "lists/img/2.jpg") and csv.classes == ("cat", "dog")
    assert csv.labels == (1, 0) and len(csv.versions) == 2
    jsonl = DatasetManifest.from_store(store, "lists/train.jsonl")
    assert jsonl.labels == (4,) and len(jsonl.classes) == 5
    store.put("lists/bad.csv", b"img/9.jpg,1\n")
    with pytest.raises(ObjectNotFound, match="img/9.jpg"):
        DatasetManifest.from_store(store, "lists/bad.csv")


def test_brace_patterns_and_member_keys() -> None:
    assert expand_braces("s/t-{008..011}.tar") == [f"s/t-{i:03d}.tar" for i in range(8, 12)]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert split_member("s/t-003.tar#k/1") == ("s/t-003.tar", "k/1")
    assert split_member("d/x.PARQUET#row=3") == ("d/x.PARQUET", "row=3")
    assert split_member("photos/a#b.jpg") is None


def test_shard_runs_name_the_containers_split_member_names() -> None:
    # Arrow's regex in one pass, against `split_member` a key at a time: upper case, both
    # formats, whole objects, a '#' without a container, an extension at the key's start.
    keys = ["a/p-1.tar#x", "b.jpg", "a/P-2.TAR#z", "d/q.parquet#row=1", "photos/a#b.jpg",
            ".tar#a/b.tar#c", "x.tar#a.parquet#b", "a/p-1.tar#w", "e.PARQUET#row=2"]  # fmt: skip
    assert member_containers(pa.array(keys)).to_pylist() == [
        parts[0] if (parts := split_member(k)) else None for k in keys
    ]
    seen: dict[str, int] = {}
    expected = [seen.setdefault(parts[0] if (parts := split_member(k)) else k, len(seen))
                for k in keys]  # fmt: skip
    runs = shard_runs(keys)
    assert runs is not None and runs.tolist() == expected
    assert shard_runs(["a/1.jpg", "photos/a#b.jpg"]) is None


def test_the_shard_order_is_every_index_once_seeded_and_read_in_runs() -> None:
    keys = [f"s/{s:02d}.tar#{m:03d}" for s in range(10) for m in range(32)]
    orders = [shard_order(shard_runs(keys), seed=3, epoch=e, block=8) for e in (0, 1, 0)]
    assert orders[0] is not None and orders[1] is not None and orders[2] is not None
    assert orders[0].tolist() == orders[2].tolist() != orders[1].tolist()
    assert sorted(orders[1].tolist()) == list(range(len(keys)))
    for chunk in np.split(orders[0], len(keys) // 8):
        # Each chunk of 8 is one block: one shard, 8 consecutive members, shuffled.
        members = sorted(chunk.tolist())
        assert members == list(range(members[0], members[0] + 8)) and members[0] % 8 == 0
    # The first four shards' samples come before any other shard's (WebDataset's buffer).
    first = {keys[i].split("#")[0] for i in orders[0][: 4 * 32]}
    assert len(first) == 4
    assert shard_order(shard_runs(["a/1.jpg", "a/2.jpg"]), seed=0, epoch=0, block=8) is None


def test_each_chunk_of_the_shard_order_costs_at_most_two_ranged_requests(
    tmp_path: Path,
) -> None:
    # Shards whose sizes are no multiple of the chunk: a shard's short last block must not
    # push later chunks astride two shuffled blocks (a scattered read of each).
    store = open_store(tmp_path)
    sizes = [37, 50, 23, 41, 29, 64, 30]
    first = 0
    for s, n in enumerate(sizes):
        store.put(f"shards/{s:02d}.tar", _tar(_samples(n, first)))
        first += n
    manifest = DatasetManifest.from_store(store, "shards")
    assert [k.split("#")[1] for k in manifest.keys] == [f"s{i:04d}" for i in range(first)]
    counting = Counting(store)
    # Neighbours' gap (headers, a label) is read through; a skipped image is not.
    members = MemberStore(counting, max_gap=2048)
    for epoch in range(3):
        order = shard_order(shard_runs(manifest.keys), seed=5, epoch=epoch, block=16)
        assert order is not None and sorted(order.tolist()) == list(range(first))
        for start in range(0, first, 16):
            keys = [manifest.keys[j] for j in order[start : start + 16]]
            before = counting.ranged
            assert not any(isinstance(b, BaseException) for b in members.read(keys))
            assert counting.ranged - before <= 2, keys
    assert counting.whole == 0


def _runs(indices: list[int]) -> int:
    """How many runs of consecutive numbers `indices` make once sorted."""
    ordered = sorted(indices)
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(ordered))


@pytest.mark.parametrize(("world", "batch"), [(2, 16), (4, 8)])
def test_each_ranks_chunk_of_the_shard_order_is_one_block(world: int, batch: int) -> None:
    # Data-parallel ranks each take a batch of every global batch: without interleaving,
    # a rank's chunk would be a scattered part of several shuffled blocks.
    sizes = [37, 50, 23, 41, 29, 64, 30, 45]
    keys = [f"s/{s:02d}.tar#{m:03d}" for s, n in enumerate(sizes) for m in range(n)]
    order = shard_order(shard_runs(keys), seed=2, epoch=1, block=32, ranks=world, batch=batch)
    assert order is not None and sorted(order.tolist()) == list(range(len(keys)))
    whole = len(keys) // (32 * world) * 32  # each rank's part before the tail
    for rank in range(world):
        mine = Shard(rank=rank, world=world).take(order, batch).tolist()
        for start in range(0, whole, 32):
            # One block: consecutive members of one shard, or the end of one and the
            # start of the next (two runs of manifest indices).
            assert _runs(mine[start : start + 32]) <= 2


def test_the_servers_feature_cache_reads_a_chunks_members_in_one_request(
    tmp_path: Path,
) -> None:
    from hapi.data import read_objects
    from hapi.server.chunks.feature_cache import _VersionedReader

    store = open_store(tmp_path)
    store.put("shards/a.tar", _tar(_samples(64)))
    counting = Counting(store)
    members = MemberStore(counting)

    class Served:
        """The server's store as the feature cache reads it: members, with versions."""

        def __init__(self) -> None:
            self.members = members

        def get_versioned(self, key: str) -> tuple[bytes, str]:
            return members.get_versioned(key)

    reader = _VersionedReader(Served())
    keys = [f"shards/a.tar#s{i:04d}" for i in (7, 3, 5, 4, 6, 8)]
    members.indexes.get("shards/a.tar")
    before = counting.ranged
    got = list(read_objects(reader, keys))  # type: ignore[arg-type]
    assert counting.ranged - before == 1 and counting.whole == 0
    assert got == [_image(i) for i in (7, 3, 5, 4, 6, 8)]
    # Each member's version is its shard's, so the entry it fills is a hit next time.
    assert reader.versions == dict.fromkeys(keys, members.indexes.version("shards/a.tar"))
