"""`hapi data import --format webdataset|parquet` and `hapi data ls` of what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from hapi.data import DatasetManifest, open_store, synth_dataset
from tests.cli_runner import hapi


@pytest.mark.parametrize(("fmt", "ext"), [("webdataset", ".tar"), ("parquet", ".parquet")])
def test_import_writes_shards_that_ls_describes(tmp_path: Path, fmt: str, ext: str) -> None:
    synth_dataset(open_store(tmp_path / "src"), classes=2, per_class=5, size=48, seed=1)
    done = hapi(
        "data",
        "import",
        str(tmp_path / "src"),
        str(tmp_path / "dst"),
        "--format",
        fmt,
        "--shard-size",
        "8KB",
    )
    assert done.code == 0, done.stderr
    shards = sorted(p.name for p in (tmp_path / "dst").iterdir() if p.suffix == ext)
    assert len(shards) > 1 and shards[0] == f"part-00000{ext}"
    listed = hapi("data", "ls", str(tmp_path / "dst"))
    assert listed.code == 0
    assert "10 images, 2 classes (class_0: 5, class_1: 5)" in " ".join(listed.stdout.split())
    assert f"in {len(shards)} shards" in " ".join(listed.stdout.split())
    manifest = DatasetManifest.from_store(open_store(tmp_path / "dst"))
    assert manifest.classes == ("class_0", "class_1")


def test_an_unknown_format_is_one_line_naming_the_choices(tmp_path: Path) -> None:
    synth_dataset(open_store(tmp_path / "src"), classes=2, per_class=1, size=32, seed=1)
    done = hapi("data", "import", str(tmp_path / "src"), str(tmp_path / "d"), "--format", "zip")
    assert done.code != 0 and "use imagefolder, webdataset or parquet" in done.stderr
