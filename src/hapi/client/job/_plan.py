"""A job's plan in force, built from its parts: what the options fix, and measuring the
plan on one server (the job's side of `hapi.client.planning.measuring`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hapi.cache import Cacheability, cacheability
from hapi.client.config.job import JobConfig
from hapi.client.job._data import JobData
from hapi.client.job._model import JobModel
from hapi.client.pipeline.history import Event
from hapi.client.planning.chunk_tally import ChunkTally
from hapi.client.planning.codec_choice import job_codecs
from hapi.client.planning.in_force import PlanInForce
from hapi.client.planning.plan_job import has_kept_profiles, plan_job
from hapi.client.planning.profile_cache import ProfileCache
from hapi.client.servers.retry import RetryPolicy
from hapi.client.servers.source import Server
from hapi.graph import RAW, Cut
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
        measure_aside=lambda connection, seen: measure(connection, aside=True, seen=seen),
        retries=RetryPolicy(budget_s=config.fetch.retry_budget_s),
        beside=functools.partial(_first_run, config, model, data),
        record=record,
        shared=dp.from_rank0 if dp is not None else None,
        cached=lambda: data.all_cached(next_epoch()),
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
    cut = Cut.of(planning.cut)
    if cut.auto:
        return None
    return (cut.index(model.graph, model.freeze), planning.local_share)


def measure_plan(
    config: JobConfig,
    model: JobModel,
    data: JobData,
    record: Callable[[Event], None],
    connection: Server,
    *,
    aside: bool = False,
    seen: ChunkTally | None = None,
) -> Plan:
    """Measure the job on `connection`'s server and choose its plan (`plan_job`), recording
    it. `aside`: while the job trains - the trainer is timed on a copy of the model, as
    timing runs backward passes that would race the training step's; `seen`: the job's
    own chunks at the freeze cut, which it trains on meanwhile.
    """
    args, options = _plan_args(config, model, data, connection, aside=aside)
    planned = plan_job(
        *args,
        **options,
        wire_dtype=config.wire.dtype,
        codecs=job_codecs(config.wire, cached=trains_cached(config)),
        seen=seen,
    )
    plan = planned.plan
    message = plan.reason
    if planned.stale_link is not None:
        message += (
            f" (from the profiles an earlier run of this job measured, but the link measured "
            f"again: {plan.link.bytes_per_s / 1e6:.3g} MB/s, kept "
            f"{planned.stale_link.bytes_per_s / 1e6:.3g} MB/s)"
        )
    elif planned.kept:
        message += " (from the profiles an earlier run of this job measured)"
    details = {**plan.to_dict(), "kept_profiles": planned.kept,
               "stale_link": planned.stale_link is not None}  # fmt: skip
    record(Event("plan", None, None, message, details))
    return plan


def _first_run(config: JobConfig, model: JobModel, data: JobData) -> bool:
    """Whether no earlier run of the job kept its profiles: its plan is then measured
    while it trains on the freeze cut, not before."""
    args, options = _plan_args(config, model, data, data.connections[0], aside=False)
    connection, request, manifest, graph, freeze, _, workload = args
    kept = has_kept_profiles(
        connection, request, manifest, graph, freeze, workload, dataset=options["dataset"],
        samples=options["samples"], batch_size=options["batch_size"], cache=options["cache"],
    )  # fmt: skip
    return not kept


def _plan_args(
    config: JobConfig, model: JobModel, data: JobData, connection: Server, *, aside: bool
) -> tuple[list[Any], dict[str, Any]]:
    """`plan_job`'s arguments for the job on `connection`, less the wire's."""
    manifest = data.manifest(config.dataset)
    transforms = config.train_transforms
    fetch, training = config.fetch, config.training
    world = model.dp.world if model.dp is not None else 1
    workload = Workload(
        samples=-(-len(manifest) // world),  # a rank's epoch is its shard
        chunk_size=fetch.chunk_size,
        prefetch=fetch.prefetch,
        servers=len(data.connections),
        back_to_back=True,  # `fit` fetches each epoch while the one before drains
    )
    graph = model.graph_aside() if aside else model.graph
    args = [connection, data.requests(transforms, connection), manifest, graph, model.freeze,
            transforms, workload]  # fmt: skip
    options = {
        "dataset": config.dataset,
        "samples": config.planning.probe_samples,
        "batch_size": training.batch_size,
        "seed": training.seed,
        "cache": ProfileCache() if config.planning.reuse_profiles else None,
    }
    return args, options


def trains_cached(config: JobConfig) -> bool:
    """Whether the job's training features go to the trainer's cache."""
    return config.cache.enabled and cacheability(config.train_transforms).cacheable
