"""`TransferJob`'s typed keyword options stay the job's configuration, field for field; the
flat keywords and the nested parts describe the same job."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from hapi.client.config.job import PARTS, JobConfig, JobOptions, flat_names
from hapi.client.config.parts import (
    CacheConfig,
    DataConfig,
    FetchConfig,
    PlanningConfig,
    TrainingConfig,
    WireConfig,
)
from hapi.errors import InvalidRequest
from hapi.graph import ModelSpec

_JOB = {"model": ModelSpec(name="resnet18"), "dataset": "train", "server": "grpc://h:1"}


def test_every_option_is_a_part_or_a_part_field_of_the_same_type() -> None:
    option_hints = typing.get_type_hints(JobOptions)
    config_hints = typing.get_type_hints(JobConfig)
    top = {f.name for f in dataclasses.fields(JobConfig)} - set(PARTS) - set(_JOB)
    expected = {name: config_hints[name] for name in top}
    for part, kind in PARTS.items():
        expected[part] = config_hints[part]
        field_hints = typing.get_type_hints(kind)
        for name, flat in flat_names(part).items():
            expected.setdefault(flat, field_hints[name])
    expected["cache"] = bool | CacheConfig  # the flat bool, or the part whole
    assert option_hints == expected
    # No flat keyword names two fields.
    flats = [flat for part in PARTS for flat in flat_names(part).values()]
    assert len(flats) == len(set(flats))


def test_flat_keywords_and_nested_parts_make_the_same_config() -> None:
    flat = JobConfig.from_options(
        **_JOB,
        cut=3,
        local_share=0.25,
        wire_dtype="fp16",
        wire_compression="zstd",
        cache=False,
        cache_size="1GiB",
        batch_size=8,
        chunk_size=16,
        image_size=64,
    )
    nested = JobConfig(
        **_JOB,  # type: ignore[arg-type]
        planning=PlanningConfig(cut=3, local_share=0.25),
        wire=WireConfig(dtype="fp16", compression="zstd"),
        cache=CacheConfig(enabled=False, size="1GiB"),
        training=TrainingConfig(batch_size=8),
        fetch=FetchConfig(chunk_size=16),
        data=DataConfig(image_size=64),
    )
    assert flat == nested
    assert flat.planning.cut == 3 and flat.wire.dtype == "fp16" and not flat.cache.enabled
    # A config gives back the keywords that build it again (`TransferJob.from_config`).
    assert JobConfig.from_options(**_JOB, **nested.options()) == nested
    # Parts not named keep their defaults.
    assert flat.connect == JobConfig(**_JOB).connect  # type: ignore[arg-type]


def test_a_model_name_becomes_a_spec_and_a_server_list_a_tuple() -> None:
    config = JobConfig.from_options("resnet18", "train", ["grpc://a:1", "grpc://b:1"])
    assert config.model == ModelSpec(name="resnet18")
    assert config.servers == ("grpc://a:1", "grpc://b:1")


def test_a_part_given_whole_and_flat_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="cut given beside planning="):
        JobConfig.from_options(**_JOB, planning=PlanningConfig(), cut=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="cache_dir given beside cache="):
        JobConfig.from_options(**_JOB, cache=CacheConfig(), cache_dir="/tmp/x")  # type: ignore[arg-type]
    # Flat keywords of one part beside another part whole are fine.
    config = JobConfig.from_options(**_JOB, planning=PlanningConfig(cut=2), wire_dtype="fp16")  # type: ignore[arg-type]
    assert (config.planning.cut, config.wire.dtype) == (2, "fp16")


def test_each_part_checks_its_own_fields_and_the_job_checks_the_parts() -> None:
    with pytest.raises(InvalidRequest, match="local_share goes with an explicit cut"):
        PlanningConfig(local_share=0.5)
    with pytest.raises(InvalidRequest, match="exact=True needs"):
        WireConfig(dtype="int8", exact=True)
    with pytest.raises(InvalidRequest, match="planning must be a PlanningConfig"):
        JobConfig(**_JOB, planning=WireConfig())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown job options: cutt"):
        JobConfig.from_options(**_JOB, cutt=3)  # type: ignore[arg-type, call-arg]
