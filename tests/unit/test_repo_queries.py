"""Queries answered from the catalog's in-memory snapshot agree with a plain list of what
was pushed, and see other processes' pushes through the store's change token."""

from __future__ import annotations

import uuid
from fnmatch import fnmatchcase
from pathlib import Path

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from hapi.repo import ModelRepo, RepoConfig
from hapi.repo.ops.push import build_manifest
from hapi.repo.storage.layout import manifest_key, ref_key


def net(kind: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == 0:
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Linear(4, classes)
        )
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, classes))


PUSHES = st.lists(
    st.tuples(
        st.integers(0, 1),  # architecture
        st.sampled_from([2, 3]),  # head size
        st.sampled_from(["a", "ab", "b"]),  # name
        st.integers(0, 20),  # parent: one of the versions so far, or none
        st.sampled_from([(), ("x",), ("x", "y")]),  # tags
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pushes=PUSHES)
def test_queries_agree_with_a_list_of_the_pushes(pushes) -> None:
    repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}", catalog=":memory:")
    pushed = []  # (version, architecture, head)
    for i, (kind, classes, name, parent, tags) in enumerate(pushes):
        model = net(kind, classes)
        with torch.no_grad():
            next(model.parameters()).add_(i)  # every version holds its own tensors
        base = pushed[parent][0] if parent < len(pushed) else None
        version = repo.push(model, name, parent=base, tags=tags)
        pushed.append((version, kind, classes))
    versions = [v for v, _, _ in pushed]
    newest = sorted(versions, key=lambda v: (v.created, v.id), reverse=True)

    def ids(found) -> list[str]:
        return [v.id for v in found]

    assert ids(repo.find()) == ids(newest)
    for glob in ("a*", "b", "?b", "[!a]*"):
        expect = [v for v in newest if fnmatchcase(v.name, glob)]
        assert ids(repo.find(name=glob)) == ids(expect)
    assert ids(repo.find(tag="y")) == ids([v for v in newest if "y" in v.tags])
    convs = [v for v, kind, _ in pushed if kind == 0]
    assert ids(repo.find(contains=["Conv2d", "BatchNorm2d"])) == ids(
        [v for v in newest if v in convs]
    )
    assert repo.find(contains=["BatchNorm2d", "Conv2d"]) == []  # the order of layers counts
    latest = {v.name: v for v in sorted(versions, key=lambda v: v.version)}
    assert ids(repo.ls()) == ids([latest[n] for n in sorted(latest)])
    for v, kind, classes in pushed:
        below = {c.id for c in versions if c.parent == v.id}
        grown = True
        while grown:
            more = {c.id for c in versions if c.parent in below} - below
            grown, below = bool(more), below | more
        assert set(ids(repo.descendants(v.ref))) == below
        # The same architecture and head shares every layer; another head all but the last.
        found = repo.prefix_matches(net(kind, classes))
        matches = {m.version.id: m.layers for m in found}
        # Most shared layers first, newest first among equals.
        rank = {v.id: i for i, v in enumerate(newest)}
        order = sorted(found, key=lambda m: (-m.layers, rank[m.version.id]))
        assert ids(m.version for m in found) == ids(m.version for m in order)
        layers = 4 if kind == 0 else 3  # leaves are layers, ReLU too
        for other, okind, oclasses in pushed:
            if okind == kind:
                assert matches[other.id] == layers - (oclasses != classes)


def test_versions_of_trees_sharing_as_many_layers_come_newest_first_across_trees() -> None:
    repo = ModelRepo.open(f"memory://{uuid.uuid4().hex}", catalog=":memory:")
    short = net(1, 2)
    longer = nn.Sequential(*net(1, 2), nn.Linear(2, 2))  # the same three layers, and one
    pushed = [repo.push(m, f"m{i}") for i, m in enumerate([short, longer, short, longer])]
    found = repo.prefix_matches(short)
    assert [m.layers for m in found] == [3, 3, 3, 3]
    assert [m.version.id for m in found] == [v.id for v in reversed(pushed)]


def test_another_repositorys_push_is_seen_by_the_next_query(tmp_path: Path) -> None:
    uri = tmp_path / "repo"
    shared = tmp_path / "shared.sqlite"
    writer = ModelRepo.open(uri, catalog=shared)
    same_file = ModelRepo.open(uri, catalog=shared)
    own_file = ModelRepo.open(uri, catalog=tmp_path / "own.sqlite")
    writer.push(net(1, 2), "m")
    assert [v.ref for v in same_file.ls()] == [v.ref for v in own_file.ls()] == ["m@1"]
    writer.push(net(1, 3), "m", parent="m")
    writer.push(net(0, 2), "c")
    for reader in (same_file, own_file):
        assert [v.ref for v in reader.ls()] == ["c@1", "m@2"]
        assert [v.ref for v in reader.find(contains=["Conv2d"])] == ["c@1"]
    writer.rm("c")
    assert [v.ref for v in own_file.find()] == ["m@2", "m@1"]


def test_a_version_whose_push_died_before_the_change_token_is_seen_within_relist_s(
    tmp_path: Path,
) -> None:
    uri = tmp_path / "repo"
    writer = ModelRepo.open(uri, catalog=tmp_path / "w.sqlite")
    writer.push(net(1, 2), "m")
    lazy = ModelRepo.open(uri, catalog=tmp_path / "l.sqlite", config=RepoConfig(relist_s=3600))
    eager = ModelRepo.open(uri, catalog=tmp_path / "e.sqlite", config=RepoConfig(relist_s=0))
    assert len(lazy.ls()) == len(eager.ls()) == 1
    # What a push killed between its ref and the change token leaves.
    manifest, _ = build_manifest(net(1, 3), name="n", parent=None)
    writer.store.put(manifest_key(manifest.id), manifest.to_json())
    writer.store.put(ref_key("n", 1), manifest.id.encode())
    assert [v.ref for v in eager.ls()] == ["m@1", "n@1"]
    assert [v.ref for v in lazy.ls()] == ["m@1"]  # until relist_s passes, or:
    lazy.refresh()
    assert [v.ref for v in lazy.ls()] == ["m@1", "n@1"]
    assert lazy.resolve("n").ref == "n@1"  # a ref by name looks in the store on a miss
