"""`TransferJob`'s typed keyword options stay the job's configuration, field for field."""

from __future__ import annotations

import dataclasses
import typing

from hapi.client.job_config import JobConfig, JobOptions


def test_every_option_is_a_config_field_of_the_same_type() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(JobConfig)}
    positional = {"model", "dataset", "server"}
    options = JobOptions.__annotations__
    assert set(options) == set(fields) - positional
    config_hints = typing.get_type_hints(JobConfig)
    option_hints = typing.get_type_hints(JobOptions)
    assert {k: option_hints[k] for k in options} == {k: config_hints[k] for k in options}
