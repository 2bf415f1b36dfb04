"""Measuring a job's plan on one server: the job's side of `hapi.client.measuring`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from hapi.client._codec_choice import job_codecs
from hapi.client._profile_cache import ProfileCache
from hapi.client.connection import Connection
from hapi.client.history import Event
from hapi.client.measuring import plan_job
from hapi.plan import Plan, Workload

if TYPE_CHECKING:
    from hapi.client.job import TransferJob

__all__ = ["measure_plan"]


def measure_plan(job: TransferJob, connection: Connection, *, aside: bool = False) -> Plan:
    """Measure `job` on `connection`'s server and choose its plan (`plan_job`), recording
    it in the job's history. `aside`: while the job trains - the trainer is timed on a
    copy of the model, as timing runs backward passes that would race the training step's.
    """
    config, model, data = job.config, job._model, job._data
    manifest = data.manifest(config.dataset)
    transforms = config.train_transforms
    planned = plan_job(
        connection,
        functools.partial(data.request, transforms=transforms, connection=connection),
        manifest,
        model.graph_aside() if aside else model.graph,
        model.freeze,
        transforms,
        Workload(
            samples=-(-len(manifest) // job.world_size),  # a rank's epoch is its shard
            chunk_size=config.chunk_size,
            prefetch=config.prefetch,
            servers=len(data.connections),
            back_to_back=True,  # `fit` fetches each epoch while the one before drains
        ),
        dataset=config.dataset,
        samples=config.probe_samples,
        batch_size=config.batch_size,
        seed=config.seed,
        wire_dtype=config.wire_dtype,
        cache=ProfileCache() if config.reuse_profiles else None,
        codecs=job_codecs(config),
    )
    plan = planned.plan
    message = plan.reason
    if planned.kept:
        message += " (from the profiles an earlier run of this job measured)"
    details = {**plan.to_dict(), "kept_profiles": planned.kept}
    job.history.events.append(Event("plan", None, None, message, details))
    return plan
