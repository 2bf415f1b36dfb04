"""A job's plan in force, built from its parts: what the options fix, and measuring the
plan on one server (the job's side of `hapi.client.measuring`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hapi.cache import Cacheability
from hapi.client._codec_choice import job_codecs
from hapi.client._job_data import JobData
from hapi.client._job_model import JobModel
from hapi.client._profile_cache import ProfileCache
from hapi.client.connection import Connection
from hapi.client.history import Event
from hapi.client.job_config import JobConfig
from hapi.client.measuring import has_kept_profiles, plan_job
from hapi.client.plan_in_force import PlanInForce
from hapi.client.retry import RetryPolicy
from hapi.graph import RAW
from hapi.plan import Plan, Workload

__all__ = ["describe", "job_plans", "measure_plan"]


def job_plans(
    config: JobConfig,
    model: JobModel,
    data: JobData,
    record: Callable[[Event], None],
    next_epoch: Callable[[], int],
) -> PlanInForce:
    """The plan in force of a job: fixed by its options, or measured on its servers.

    Args:
        next_epoch: the training epoch `fit` runs next (whose features may all be cached,
            and then no plan is measured).
    """
    dp = model.dp
    measure = functools.partial(measure_plan, config, model, data, record)
    return PlanInForce(
        fixed=fixed_choice(config, model),
        default=(model.freeze, 0.0),
        connections=data.connections,
        measure=measure,
        measure_aside=functools.partial(measure, aside=True),
        retries=RetryPolicy(budget_s=config.fetch.retry_budget_s),
        record=record,
        shared=dp.from_rank0 if dp is not None else None,
        cached=lambda: data.all_cached(next_epoch()),
        measure_first=lambda: (
            config.planning.plan_first
            or config.planning.replan is False
            or _kept(config, model, data)
        ),
    )


def describe(
    config: JobConfig, model: JobModel, plans: PlanInForce, cacheability: Cacheability
) -> str:
    """What the job trains and how its data travels, in a few lines (`TransferJob.summary`)."""
    trained = sum(p.numel() for p in model.parts.trainable())
    lines = [f"{model.name}: {trained:,} parameters train", model.freeze_reason]
    if config.planning.mode == "local":
        lines.append("mode=local: the baseline, raw bytes to the trainer")
    elif (fixed := plans.fixed) is not None:
        lines.append(f"cut {fixed[0]}, {fixed[1]:.0%} of chunks local, as given")
    else:
        plan = plans.plan
        assert plan is not None  # an auto job has one
        lines.append(f"plan: {plan.reason}")
    lines.append(f"features {cacheability.why}")
    return "\n".join(lines)


def fixed_choice(config: JobConfig, model: JobModel) -> tuple[int, float] | None:
    """The (cut, share) the options fix, or None for the planner to choose."""
    planning = config.planning
    if planning.mode == "local":
        return (RAW, 0.0)
    if planning.cut == "auto":
        return None
    cut = model.freeze if planning.cut is None else model.resolve_cut(planning.cut)
    return (cut, planning.local_share)


def measure_plan(
    config: JobConfig,
    model: JobModel,
    data: JobData,
    record: Callable[[Event], None],
    connection: Connection,
    *,
    aside: bool = False,
) -> Plan:
    """Measure the job on `connection`'s server and choose its plan (`plan_job`), recording
    it. `aside`: while the job trains - the trainer is timed on a copy of the model, as
    timing runs backward passes that would race the training step's.
    """
    transforms = config.train_transforms
    planned = plan_job(
        connection,
        data.requests(transforms, connection),
        data.manifest(config.dataset),
        model.graph_aside() if aside else model.graph,
        model.freeze,
        transforms,
        _workload(config, model, data),
        seed=config.training.seed,
        cache=ProfileCache() if config.planning.reuse_profiles else None,
        **_measured_as(config),
    )
    plan = planned.plan
    message = plan.reason
    if planned.kept:
        message += " (from the profiles an earlier run of this job measured)"
    details = {**plan.to_dict(), "kept_profiles": planned.kept}
    record(Event("plan", None, None, message, details))
    return plan


def _kept(config: JobConfig, model: JobModel, data: JobData) -> bool:
    """Whether the job's first server has the plan at once: from profiles an earlier run
    of this job kept, measuring nothing."""
    if not config.planning.reuse_profiles:
        return False
    connection = data.connections[0]
    return has_kept_profiles(
        connection,
        data.requests(config.train_transforms, connection),
        data.manifest(config.dataset),
        model.graph,
        model.freeze,
        _workload(config, model, data),
        cache=ProfileCache(),
        **_measured_as(config),
    )


def _workload(config: JobConfig, model: JobModel, data: JobData) -> Workload:
    world = model.dp.world if model.dp is not None else 1
    return Workload(
        samples=-(-len(data.manifest(config.dataset)) // world),  # a rank's epoch is its shard
        chunk_size=config.fetch.chunk_size,
        prefetch=config.fetch.prefetch,
        servers=len(data.connections),
        back_to_back=True,  # `fit` fetches each epoch while the one before drains
    )


def _measured_as(config: JobConfig) -> dict[str, Any]:
    """`plan_job`'s options that say what is measured (and key the kept profiles)."""
    return {
        "dataset": config.dataset,
        "samples": config.planning.probe_samples,
        "batch_size": config.training.batch_size,
        "wire_dtype": config.wire.dtype,
        "codecs": job_codecs(config),
    }
