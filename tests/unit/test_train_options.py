"""`hapi train`'s job options follow the config tree: a flag and a job-file key for every
option of `JobConfig`'s parts that text can give, with its field's help - none declared
again by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hapi.cli.train_run import TrainConfig
from hapi.client import JobConfig
from hapi.client.config.flags import job_flags
from hapi.client.config.job import PARTS
from hapi.errors import InvalidRequest

from ..cli_runner import hapi

_REQUIRED = {"model": "resnet18", "dataset": "train", "server": "grpc://127.0.0.1:1"}


def test_every_option_text_can_give_is_a_flag_with_its_fields_help() -> None:
    flags = {flag.name: flag for flag in job_flags()}
    # The parts' plain fields all come through; what text cannot give stays Python's.
    plain = {f.name for part in PARTS.values() for f in dataclasses.fields(part)}
    assert {"chunk_size", "local_share", "wire_compression", "retry_budget_s"} <= set(flags)
    assert not {"transforms", "eval_transforms", "store_options"} & set(flags)
    assert {flag.field for flag in flags.values()} <= plain
    assert flags["cache_dir"].part == "cache" and flags["cache_dir"].field == "dir"
    assert flags["replan"].kind is bool and flags["cut"].kind is str
    assert flags["chunk_size"].help == "Keys per chunk request."
    # The help's table wraps its cells: read it without the box's borders.
    text = " ".join(hapi("train", "--help").stdout.replace("│", " ").split())
    for name in ("--chunk-size", "--local-share", "--wire-compression", "--no-augment"):
        assert name in text
    assert "Keys per chunk request. Default: 64." in text


def test_the_command_lines_options_reach_the_job_config() -> None:
    config = TrainConfig.from_options(
        **_REQUIRED, cut="layer3", local_share=0.25, chunk_size=16, cache=False, epochs=2
    )
    assert config.epochs == 2
    job = JobConfig.from_options(model="resnet18", dataset="train", server="s", **config.job)
    assert (job.planning.cut, job.planning.local_share) == ("layer3", 0.25)
    assert job.fetch.chunk_size == 16 and job.cache.enabled is False


def test_a_job_file_gives_options_flat_or_in_their_parts_tables(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        'model = "resnet18"\ndataset = "train"\nserver = "grpc://h:1"\nimage-size = 64\n'
        '[planning]\ncut = "freeze"\n[cache]\ndir = "/tmp/c"\nsize = "1GiB"\n'
    )
    config = TrainConfig.from_toml(path, chunk_size=8)  # the command line's over the file's
    assert config.job == {
        "image_size": 64, "cut": "freeze", "cache_dir": "/tmp/c", "cache_size": "1GiB",
        "chunk_size": 8,
    }  # fmt: skip
    path.write_text('model = "resnet18"\n[cache]\ndirectory = "/tmp/c"\n')
    with pytest.raises(InvalidRequest, match=r"unknown key\(s\) directory in \[cache\]"):
        TrainConfig.from_toml(path)


def test_an_option_of_neither_the_command_nor_the_job_is_named() -> None:
    with pytest.raises(InvalidRequest, match=r"unknown key\(s\) chunksize"):
        TrainConfig.from_options(**_REQUIRED, chunksize=8)


def test_hapi_plan_takes_the_jobs_options_but_the_choice_it_makes() -> None:
    text = " ".join(hapi("plan", "--help").stdout.replace("│", " ").split())
    for name in ("--probe-samples", "--chunk-size", "--wire-dtype", "--cache-dir", "--json"):
        assert name in text
    for name in ("--cut ", "--local-share", "--mode"):
        assert name not in text
