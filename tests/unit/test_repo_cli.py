"""`hapi repo ...`: the shell over the repository."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.cli import main
from hapi.repo import ModelRepo


def run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["hapi", "repo", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def repo_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HAPI_REPO", str(tmp_path / "repo"))
    monkeypatch.setenv("HAPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    repo = ModelRepo.open(tmp_path / "repo")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    repo.push(base, "base", tags=["v1"])
    with torch.no_grad():
        base[2].weight.add_(1)
    repo.push(base, "ft", parent="base", metrics={"acc": 0.75})
    repo.close()
    return tmp_path / "repo"


def test_listing_commands(
    repo_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = run(capsys, monkeypatch, "ls")
    assert code == 0 and "base@1" in out and "ft@1" in out and "2 versions" in out
    code, out, _ = run(capsys, monkeypatch, "lineage")
    assert code == 0 and out.index("base@1") < out.index("ft@1") and "└──" in out
    code, out, _ = run(capsys, monkeypatch, "diff", "base", "ft")
    assert code == 0 and "1 changed" in out and "~ 2.weight" in out
    code, out, _ = run(capsys, monkeypatch, "log", "ft")
    assert code == 0 and "acc=0.75" in out
    code, out, _ = run(capsys, monkeypatch, "show", "ft@1", "--tensors")
    assert code == 0 and "2.weight" in out and "float32" in out
    code, out, _ = run(capsys, monkeypatch, "find", "--contains", "Linear", "--contains", "ReLU")
    assert code == 0 and "base@1" in out
    code, out, _ = run(capsys, monkeypatch, "find", "--prefix-of", "ft")
    assert code == 0 and out.count("3/3") == 2  # same architecture: weights do not count


def test_rm_gc_reindex(
    repo_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "removed ft@1" in run(capsys, monkeypatch, "rm", "ft")[1]
    assert "removed 1 of" in run(capsys, monkeypatch, "gc")[1]
    assert "indexed 1 versions" in run(capsys, monkeypatch, "reindex")[1]


def test_errors_are_one_line(
    repo_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run(capsys, monkeypatch, "show", "bse")
    assert code == 1 and "did you mean base" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2


def test_fsck_finds_and_repairs_a_corrupt_tensor(
    repo_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = run(capsys, monkeypatch, "fsck")
    assert code == 0 and "checked 5 tensors: 0 corrupt, 0 missing" in out
    repo = ModelRepo.open(repo_dir)
    digest = repo.manifest("ft").tensors["2.weight"].hash
    key = next(k for k in repo.store.list("tensors") if digest in k)
    repo.store.put(key, b"not a tensor")
    code, out, _ = run(capsys, monkeypatch, "fsck")
    assert code == 1 and f"corrupt {key}" in out and "--repair" in out, out
    code, out, _ = run(capsys, monkeypatch, "fsck", "--repair")
    assert code == 1 and "(deleted)" in out and not repo.store.exists(key)
    code, out, _ = run(capsys, monkeypatch, "fsck")
    assert code == 1 and f"missing {key}, needed by ft:2.weight" in out


def test_fsck_prints_every_finding_and_what_to_do(
    repo_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hapi.data import open_store
    from hapi.repo.storage.layout import manifest_key

    repo = ModelRepo.open(repo_dir)
    version = repo.resolve("ft")
    orphan = nn.Linear(3, 3)
    repo.push(orphan, "orphan")
    repo.rm("orphan")  # its tensors now belong to no version
    repo.close()
    store = open_store(repo_dir)
    store.put(manifest_key(version.id), b'{"format": "hapi.repo.manifest/1"')

    code, out, _ = run(capsys, monkeypatch, "fsck")
    assert code == 1
    assert f"unreadable manifest {manifest_key(version.id)}" in out
    assert "1 manifests read, 1 unreadable" in out
    assert "belong to no version: hapi repo gc removes them" in out
    assert "restore the unreadable manifests from a copy or delete them" in out
    assert "--repair" not in out  # repair fixes blobs, not manifests


def test_gc_names_the_partial_writes_it_removed(
    repo_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "partial" not in run(capsys, monkeypatch, "gc")[1]  # none: not mentioned
    staged = repo_dir / "tensors" / "ff" / "ffff.safetensors#1"  # a killed write's
    staged.parent.mkdir(parents=True)
    staged.write_bytes(b"half a blob")
    os.utime(staged, (0, 0))
    out = run(capsys, monkeypatch, "gc", "--dry-run")[1]
    assert "would remove" in out and "1 partial writes" in out and staged.exists()
    assert "removed 0 of" in (out := run(capsys, monkeypatch, "gc")[1]) and "1 partial" in out
    assert not staged.exists()
