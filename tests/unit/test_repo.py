"""The model repository on an in-memory store: push, pull, refs, lineage, queries, errors."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.data import open_store
from hapi.errors import IntegrityError, InvalidRequest, RefNotFound
from hapi.repo import ModelRepo, PushedVersion, RepoConfig, tensor_hash
from hapi.repo.storage.layout import tensor_key


def small(seed: int = 0, classes: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, classes),
    )


def fine_tune(model: nn.Module, *names: str) -> nn.Module:
    """Change only the named parameters, as a fine-tune of those layers would."""
    for name, p in model.named_parameters():
        if any(name.startswith(n) for n in names):
            p.data += 0.01
    return model


@pytest.fixture
def repo() -> ModelRepo:
    return ModelRepo.open(f"memory://{uuid.uuid4().hex}")


def test_push_pull_round_trip(repo: ModelRepo) -> None:
    model = small()
    v = repo.push(model, "net", tags=["base"], metrics={"acc": 0.5})
    assert isinstance(v, PushedVersion) and v.ref == "net@1" and v.tags == ("base",)
    pulled = repo.pull("net")
    assert pulled.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(pulled[key], value) and pulled[key].dtype == value.dtype
    other = small(seed=1)
    assert repo.load_into(other, "net@1").id == v.id
    assert all(
        torch.equal(a, b)
        for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_derived_model_uploads_only_what_changed(repo: ModelRepo) -> None:
    base = small()
    first = repo.push(base, "base")
    derived = repo.push(fine_tune(base, "6."), "derived", parent="base")
    assert first.uploaded_bytes > 0
    assert derived.uploaded_tensors == 2  # fc weight and bias
    fc_bytes = 8 * 5 * 4 + 5 * 4
    assert fc_bytes <= derived.uploaded_bytes < fc_bytes + 400  # plus safetensors headers
    again = repo.push(base, "derived")
    assert again.uploaded_tensors == 0 and again.version == 2
    usage = repo.usage()
    assert usage.versions == 3 and usage.logical_bytes == 3 * first.nbytes
    assert usage.blob_bytes < first.nbytes + fc_bytes + 4000


def test_equal_tensors_are_stored_once_whatever_their_names(repo: ModelRepo) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    v = repo.push({"a": t, "b": t.clone(), "c": t.to(torch.float64)}, "dict")
    assert v.uploaded_tensors == 2  # a and b are equal; c has another dtype
    assert tensor_hash(t) == tensor_hash(t.clone()) != tensor_hash(t.reshape(4, 3))
    assert torch.equal(repo.pull("dict")["c"], t.to(torch.float64))


def test_bfloat16_and_scalar_tensors_round_trip(repo: ModelRepo) -> None:
    state = {
        "bf": torch.randn(4, 3).to(torch.bfloat16),
        "n": torch.tensor(7),
        "flag": torch.tensor([True, False]),
    }
    repo.push(state, "odd")
    pulled = repo.pull("odd")
    assert all(torch.equal(pulled[k], v) and pulled[k].dtype == v.dtype for k, v in state.items())


def test_refs_resolve_in_every_form(repo: ModelRepo) -> None:
    v1 = repo.push(small(0), "net")
    v2 = repo.push(small(1), "net")
    assert repo.resolve("net").id == v2.id
    assert repo.resolve("net@1").id == v1.id
    assert repo.resolve(f"net@{v1.id[:6]}").id == v1.id
    assert repo.resolve(v1.id).ref == "net@1"
    assert repo.resolve(v2.id[:10]).ref == "net@2"
    assert repo.resolve("repo://net@2").id == v2.id
    assert repo.resolve(v1).id == v1.id
    assert [v.version for v in repo.log("net")] == [2, 1]


def test_an_id_prefix_of_digits_is_not_taken_for_a_missing_version(repo: ModelRepo) -> None:
    # One id in ~7 starts with four digits; "net@<them>" must still find it.
    for seed in range(200):
        version = repo.push(small(seed), "net")
        if version.id[:4].isdigit():
            break
    assert version.id[:4].isdigit()
    assert repo.resolve(f"net@{version.id[:4]}").id == version.id
    assert repo.resolve("net@1").version == 1


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("nett", "did you mean net"),
        ("net@7", "net has versions 1"),
        ("net@zzzz", "invalid model reference"),
        ("bad name!", "invalid model reference"),
        ("net@", "invalid model reference"),
        ("0123456789abcdef", "no model"),
    ],
)
def test_bad_refs_say_what_exists(repo: ModelRepo, ref: str, message: str) -> None:
    repo.push(small(), "net")
    with pytest.raises(RefNotFound, match=message):
        repo.pull(ref)


def test_bad_names_and_values_are_refused(repo: ModelRepo) -> None:
    with pytest.raises(InvalidRequest, match="invalid model name"):
        repo.push(small(), "a/b")
    with pytest.raises(InvalidRequest, match="not a tensor"):
        repo.push({"x": [1, 2]}, "x")  # type: ignore[dict-item]
    with pytest.raises(InvalidRequest, match="must be a number"):
        repo.push(small(), "m", metrics={"acc": "high"})  # type: ignore[dict-item]
    with pytest.raises(RefNotFound, match="no model"):
        repo.push(small(), "child", parent="nobody")
    assert repo.ls() == []


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"lock_ttl_s": 0}, "lock_ttl_s"),
        ({"lock_wait_s": -1}, "lock_wait_s"),
    ],
)
def test_bad_settings_are_invalid_requests(setting: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        RepoConfig(**setting)  # type: ignore[arg-type]


def test_load_into_names_mismatched_keys(repo: ModelRepo) -> None:
    repo.push(small(classes=5), "net")
    with pytest.raises(IntegrityError, match=r"different shapes: 6.weight \(model \[3, 8\]"):
        repo.load_into(small(classes=3), "net")
    bigger = nn.Sequential(*small(), nn.Linear(5, 2))
    with pytest.raises(IntegrityError, match="missing from net@1: 7.weight, 7.bias"):
        repo.load_into(bigger, "net")
    with pytest.raises(IntegrityError, match="not in the model: 3.weight"):
        repo.load_into(nn.Sequential(*list(small())[:3]), "net")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_blob_is_named_on_load(repo: ModelRepo, damage: str) -> None:
    model = small()
    repo.push(model, "net")
    key = tensor_key(tensor_hash(model.state_dict()["6.weight"]))
    data = repo.store.get(key)
    if damage == "flip":
        repo.store.put(key, data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "truncate":
        repo.store.put(key, data[: len(data) // 2])
    else:
        repo.store.delete(key)
    with pytest.raises(IntegrityError, match=r"'6.weight' of net@1"):
        repo.pull("net")
    report = repo.fsck(repair=True)
    distinct = len(set(map(tensor_hash, model.state_dict().values())))
    assert not report.ok and report.checked == distinct - (damage == "delete")
    assert [*report.corrupt, *report.missing] == [key]
    repo.push(model, "net")  # a later push restores the dropped blob
    assert repo.fsck().ok
    assert torch.equal(repo.pull("net@1")["6.weight"], model.state_dict()["6.weight"])


def test_tampered_manifest_is_refused(repo: ModelRepo) -> None:
    v = repo.push(small(), "net")
    key = f"manifests/{v.id}.json"
    body = json.loads(repo.store.get(key))
    body["metrics"] = {"acc": 1.0}
    repo.store.put(key, json.dumps(body).encode())
    with pytest.raises(IntegrityError, match="corrupt"):
        repo.pull("net")


def test_lineage_ancestors_descendants(repo: ModelRepo) -> None:
    base = repo.push(small(), "base")
    a = repo.push(fine_tune(small(), "6."), "a", parent=base)
    b = repo.push(fine_tune(small(), "3.", "6."), "b", parent="base")
    a2 = repo.push(fine_tune(fine_tune(small(), "6."), "6."), "a", parent="a@1")
    other = repo.push(small(seed=3), "other")
    assert [v.id for v in repo.ancestors("a@2")] == [a.id, base.id]
    assert {v.id for v in repo.descendants("base")} == {a.id, b.id, a2.id}
    trees = repo.lineage()
    assert [t.version.id for t in trees] == [base.id, other.id]
    assert [c.version.ref for c in trees[0].children] == ["a@1", "b@1"]
    assert [c.version.ref for c in trees[0].children[0].children] == ["a@2"]
    assert [t.version.id for t in repo.lineage("a@2")] == [base.id]


def test_diff_names_changed_tensors(repo: ModelRepo) -> None:
    repo.push(small(), "base")
    repo.push(fine_tune(small(), "3.", "6."), "ft")
    d = repo.diff("base", "ft")
    assert d.changed == ("3.weight", "6.weight", "6.bias")
    assert not d.added and not d.removed and d.same == len(small().state_dict()) - 3
    assert d.shared_layers == 7  # architecture is the same throughout
    assert repo.diff("base", "base").identical


def test_find_by_classes_and_longest_common_prefix(repo: ModelRepo) -> None:
    repo.push(small(classes=5), "five")
    repo.push(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()), "tiny")
    repo.push(nn.Sequential(nn.Linear(4, 4)), "mlp", tags=["mlp"])
    assert {v.name for v in repo.find(contains=["Conv2d", "BatchNorm2d", "ReLU"])} == {"five"}
    assert {v.name for v in repo.find(contains=["Conv2d", "ReLU"])} == {"tiny"}
    assert {v.name for v in repo.find(contains=["torch.nn.modules.linear.Linear"])} == {
        "five",
        "mlp",
    }
    assert [v.name for v in repo.find(tag="mlp")] == ["mlp"]
    assert [v.name for v in repo.find(name="t*")] == ["tiny"]
    # A new model with another classifier shares everything but the last layer with "five".
    best = repo.longest_common_prefix(small(seed=9, classes=10))
    assert best is not None and best.ref == "five@1" and (best.layers, best.of) == (6, 7)
    matches = repo.prefix_matches(small(classes=10))
    assert [(m.ref, m.layers) for m in matches] == [("five@1", 6), ("tiny@1", 1)]
    assert [v.name for v in repo.find(prefix_of=small(), min_layers=2)] == ["five"]
    assert repo.longest_common_prefix(nn.Sequential(nn.Conv2d(1, 8, 3))) is None


def test_rm_and_gc_free_only_unshared_tensors(repo: ModelRepo) -> None:
    base = small()
    repo.push(base, "base")
    repo.push(fine_tune(small(), "6."), "ft", parent="base")
    blobs = set(repo.store.list("tensors"))
    assert repo.gc().removed_blobs == 0
    repo.rm("ft")
    with pytest.raises(RefNotFound):
        repo.resolve("ft")
    assert repo.gc(dry_run=True).removed_blobs == 2 and set(repo.store.list("tensors")) == blobs
    report = repo.gc()
    assert report.removed_blobs == 2 and report.removed_bytes > 0 and report.manifests == 1
    assert torch.equal(repo.pull("base")["6.weight"], base.state_dict()["6.weight"])
    v = repo.push(small(1), "ft")
    assert v.version == 2  # a removed version's number is not reused


def test_reindex_rebuilds_the_catalog_from_the_store_alone(tmp_path: Path) -> None:
    uri = str(tmp_path / "repo")
    first = ModelRepo.open(uri, catalog=tmp_path / "one.sqlite")
    first.push(small(), "base")
    first.push(fine_tune(small(), "6."), "ft", parent="base")
    second = ModelRepo.open(uri, catalog=tmp_path / "two.sqlite")
    assert [v.ref for v in second.ls()] == ["base@1", "ft@1"]
    assert second.reindex() == 2
    assert [v.ref for v in second.descendants("base")] == ["ft@1"]
    # A version pushed by another handle is seen on the next lookup by name.
    first.push(small(2), "base")
    assert second.resolve("base").version == 2
    second.rm("base@2")
    assert first.resolve("base").version == 1


def test_manifest_format_is_stable(repo: ModelRepo) -> None:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    v = repo.push(model, "lin", tags=["b", "a"], metrics={"acc": 1})
    body = json.loads(repo.store.get(f"manifests/{v.id}.json"))
    assert sorted(body) == [
        "created",
        "format",
        "id",
        "metrics",
        "modules",
        "name",
        "parent",
        "spec",
        "tags",
        "tensors",
    ]
    assert body["format"] == "hapi.repo.manifest/1" and body["tags"] == ["a", "b"]
    assert body["tensors"] == [
        {"key": "weight", "hash": GOLDEN_HASH, "dtype": "float32", "shape": [1, 2], "nbytes": 8},
        {
            "key": "bias",
            "hash": tensor_hash(model.bias),
            "dtype": "float32",
            "shape": [1],
            "nbytes": 4,
        },
    ]
    assert body["modules"] == [
        {
            "name": "",
            "class": "torch.nn.modules.linear.Linear",
            "config": {"bias": True, "in_features": 2, "out_features": 1},
            "params": ["weight", "bias"],
            "buffers": [],
            "layer": GOLDEN_LAYER,
        }
    ]


# The content hash of float32 [[1, 2]]: a change of the hashed encoding orphans every blob.
GOLDEN_HASH = "d0891258c6830721804d4f521022195e87409acb5f7880b6a1f4ef2c069a5b7c"
# The layer identity of Linear(2, 1): a change of it breaks prefix matches with every stored
# version (`find --prefix-of`, `longest_common_prefix`).
GOLDEN_LAYER = "aaa640fe5e744ce25f1d3d9a002d5420"


def test_concurrent_pushes_of_one_name_get_distinct_versions(repo: ModelRepo) -> None:
    with ThreadPoolExecutor(4) as pool:
        pushed = list(pool.map(lambda s: repo.push(small(s), "net"), range(8)))
    assert sorted(v.version for v in pushed) == list(range(1, 9))
    for v in pushed:
        assert repo.resolve(f"net@{v.version}").id == v.id


def test_a_repo_opens_on_any_store(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s")
    repo = ModelRepo(store, catalog=":memory:")
    repo.push(small(), "net")
    assert ModelRepo.open(f"file://{tmp_path / 's'}", catalog=":memory:").resolve("net")
