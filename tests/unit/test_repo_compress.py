"""A repository writing compressed blobs and deltas: same reads, fewer bytes, gc and fsck
still safe, checked against a plain dict of state dicts."""

from __future__ import annotations

import uuid

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from hapi.errors import InvalidRequest, UnknownCodec
from hapi.repo import ModelRepo, RepoConfig
from hapi.repo.storage.codec import DELTA, PLAIN, ZSTD, read_info
from hapi.repo.storage.layout import DELTAS, TENSORS, delta_key, hash_of_tensor_key, tensor_key
from hapi.repo.storage.tensors import tensor_hash

DELTAS_ON = RepoConfig(compress=True, deltas=True, lock_wait_s=0)


def new_repo(config: RepoConfig = DELTAS_ON) -> ModelRepo:
    return ModelRepo.open(f"memory://{uuid.uuid4().hex}", catalog=":memory:", config=config)


def base_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(64, 32, 3, 3, generator=gen) * 0.02,
        "fc.weight": torch.randn(16, 512, generator=gen) * 0.02,
        "fc.bias": torch.zeros(16),
        "steps": torch.tensor(7),
    }


def tuned(state: dict[str, torch.Tensor], keys: tuple[str, ...], seed: int):
    gen = torch.Generator().manual_seed(1000 + seed)
    return {
        k: v + torch.randn(v.shape, generator=gen) * 1e-4 if k in keys else v
        for k, v in state.items()
    }


def codec_of(repo: ModelRepo, tensor: torch.Tensor):
    return read_info(repo.store.get(tensor_key(tensor_hash(tensor))))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fine_tune_is_stored_as_deltas_and_pulls_bit_exact() -> None:
    repo = new_repo()
    base = base_state()
    ft = tuned(base, ("fc.weight", "conv.weight"), 1)
    repo.push(base, "m")
    pushed = repo.push(ft, "ft", parent="m")
    assert same(repo.pull("ft"), ft) and same(repo.pull("m"), base)
    info = codec_of(repo, ft["fc.weight"])
    assert (info.codec, info.base, info.depth) == (DELTA, tensor_hash(base["fc.weight"]), 1)
    assert codec_of(repo, base["conv.weight"]).codec == ZSTD
    # A 0-d int64 saves nothing compressed: it stays a plain safetensors blob.
    assert codec_of(repo, base["steps"]).codec == PLAIN
    changed = sum(ft[k].numel() * 4 for k in ("fc.weight", "conv.weight"))
    assert pushed.uploaded_bytes < 0.8 * changed
    marker = delta_key(tensor_hash(ft["fc.weight"]), tensor_hash(base["fc.weight"]))
    assert repo.store.exists(marker)


def test_without_compress_whole_only_deltas_are_compressed() -> None:
    repo = new_repo(RepoConfig(compress=True, deltas=True, compress_whole=False))
    base = base_state()
    ft = tuned(base, ("fc.weight",), 1)
    repo.push(base, "m")
    repo.push(ft, "ft", parent="m")
    assert same(repo.pull("ft"), ft) and same(repo.pull("m"), base)
    # The base and what the fine-tune shares with it stay plain; the change is a delta.
    assert {codec_of(repo, t).codec for t in base.values()} == {PLAIN}
    assert codec_of(repo, ft["fc.weight"]).codec == DELTA
    assert codec_of(repo, ft["conv.weight"]).codec == PLAIN


def test_tensors_under_16_kib_stay_plain_however_well_they_compress() -> None:
    repo = new_repo()
    small, large = torch.ones(4095), torch.ones(4096)  # float32: just under and at 16 KiB
    repo.push({"bn.running_var": small, "big": large}, "m")
    assert codec_of(repo, small).codec == PLAIN
    assert codec_of(repo, large).codec == ZSTD


def test_delta_chains_stop_at_max_delta_depth() -> None:
    repo = new_repo(RepoConfig(compress=True, deltas=True, max_delta_depth=2))
    state = base_state()
    repo.push(state, "m")
    depths = []
    for i in range(5):
        state = tuned(state, ("fc.weight",), i)
        repo.push(state, "m", parent="m")
        depths.append(codec_of(repo, state["fc.weight"]).depth)
    assert depths == [1, 2, 0, 1, 2]
    assert same(repo.pull("m"), state)


def test_gc_keeps_the_bases_of_kept_deltas_and_drops_them_with_the_last_delta() -> None:
    repo = new_repo()
    base = base_state()
    ft = tuned(base, ("fc.weight",), 1)
    ft2 = tuned(ft, ("conv.weight",), 2)  # keeps ft's fc.weight, a delta on base's
    repo.push(base, "m")
    repo.push(ft, "ft", parent="m")
    repo.push(ft2, "ft2", parent="ft")
    repo.rm("m")
    repo.rm("ft")
    report = repo.gc()
    assert report.removed_blobs == 0  # every blob is ft2's or a base of one of its deltas
    assert same(repo.pull("ft2"), ft2)
    assert repo.fsck().ok
    repo.rm("ft2")
    repo.gc()
    assert list(repo.store.list(TENSORS)) == [] and list(repo.store.list(DELTAS)) == []


def test_an_interrupted_push_leaves_a_marker_gc_removes_and_nothing_visible() -> None:
    repo = new_repo()
    base = base_state()
    repo.push(base, "m")
    txn = repo.prepare_push(tuned(base, ("fc.weight", "conv.weight"), 1), "ft", parent="m")
    txn.begin()
    txn.upload(limit=1)  # one delta blob and its marker written, then the pusher dies
    txn.release()
    # A marker whose blob was never written, as a push killed between the two leaves.
    orphan = delta_key("ab" * 32, tensor_hash(base["fc.weight"]))
    repo.store.put(orphan, b"")
    assert [v.name for v in repo.ls()] == ["m"]
    repo.gc()
    assert list(repo.store.list(DELTAS)) == []
    stored = {hash_of_tensor_key(k) for k in repo.store.list(TENSORS)}
    assert stored == {tensor_hash(t) for t in base.values()}
    assert same(repo.pull("m"), base)


def test_fsck_checks_deltas_over_their_bases() -> None:
    repo = new_repo()
    base = base_state()
    ft = tuned(base, ("fc.weight",), 1)
    repo.push(base, "m")
    repo.push(ft, "ft", parent="m")
    assert repo.fsck().ok
    key = tensor_key(tensor_hash(base["fc.weight"]))
    data = repo.store.get(key)
    repo.store.put(key, data[:-1] + bytes([data[-1] ^ 1]))
    report = repo.fsck()
    delta = tensor_key(tensor_hash(ft["fc.weight"]))
    assert sorted(report.corrupt) == sorted([key, delta])  # the base, and the delta on it
    assert not report.unreferenced


def test_plain_and_compressed_writers_share_blobs() -> None:
    store_uri = f"memory://{uuid.uuid4().hex}"
    plain = ModelRepo.open(store_uri, catalog=":memory:")
    packed = ModelRepo.open(store_uri, catalog=":memory:", config=DELTAS_ON)
    base = base_state()
    plain.push(base, "m")
    again = packed.push(base, "m2")
    assert again.uploaded_tensors == 0  # blobs are named by content, however stored
    ft = tuned(base, ("fc.weight",), 1)
    packed.push(ft, "ft", parent="m")
    assert same(plain.pull("ft"), ft)  # any reader decodes any blob


def test_a_blob_in_an_unknown_codec_fails_reads_and_survives_fsck_repair() -> None:
    repo = new_repo()
    base = base_state()
    repo.push(base, "m")
    key = tensor_key(tensor_hash(base["fc.weight"]))
    data = repo.store.get(key)
    repo.store.put(key, data.replace(ZSTD.encode(), b"bytegroup-zstd/9"))
    with pytest.raises(UnknownCodec, match=r"fc\.weight.*bytegroup-zstd/9"):
        repo.pull("m")
    report = repo.fsck(repair=True)
    assert list(report.unknown_codec) == [key] and not report.corrupt and not report.ok
    assert repo.store.exists(key)


def test_bad_compression_settings_say_how_to_fix_them() -> None:
    with pytest.raises(InvalidRequest, match="needs compress=True"):
        RepoConfig(deltas=True)
    with pytest.raises(InvalidRequest, match="max_delta_depth"):
        RepoConfig(compress=True, deltas=True, max_delta_depth=0)
    with pytest.raises(InvalidRequest, match="min_saving"):
        RepoConfig(compress=True, min_saving=1.0)
    with pytest.raises(InvalidRequest, match="compress_whole=False compresses only deltas"):
        RepoConfig(compress=True, compress_whole=False)


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 9), st.sampled_from(["fc", "conv", "both"])),
        st.tuples(st.just("rm"), st.integers(0, 9), st.just("")),
        st.tuples(st.just("gc"), st.just(0), st.just("")),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS)
def test_the_repository_reads_back_what_a_dict_holds(actions) -> None:
    """Pushes derived from any visible version, removals and gcs in any order: every
    visible version pulls bit-exact and fsck finds nothing wrong."""
    repo = new_repo(RepoConfig(compress=True, deltas=True, max_delta_depth=2, lock_wait_s=0))
    expected: dict[str, dict[str, torch.Tensor]] = {"v0": base_state()}
    repo.push(expected["v0"], "v0")
    for i, (action, pick, what) in enumerate(actions, start=1):
        names = sorted(expected)
        if action == "push" and names:
            parent = names[pick % len(names)]
            keys = {"fc": ("fc.weight",), "conv": ("conv.weight",)}.get(
                what, ("fc.weight", "conv.weight")
            )
            expected[f"v{i}"] = tuned(expected[parent], keys, i)
            repo.push(expected[f"v{i}"], f"v{i}", parent=parent)
        elif action == "rm" and names:
            repo.rm(names[pick % len(names)])
            del expected[names[pick % len(names)]]
        elif action == "gc":
            repo.gc()
    for name, state in expected.items():
        assert same(repo.pull(name), state)
    assert repo.fsck().ok
