"""A job's first plan: from the profiles an earlier run of the same job kept
(`ProfileCache`), with its link measured again where that one is stale, or measured now
(`measure_job`); then the cut and codec chosen for the workload."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hapi.client.planning._probe_chunks import link_of, open_probe_session, probe_raw
from hapi.client.planning.chunk_tally import ChunkTally
from hapi.client.planning.codec_choice import Codec, codecs_may_pay
from hapi.client.planning.measuring import Profiles, measure_job, probe_keys
from hapi.client.planning.profile_cache import ProfileCache, job_key
from hapi.client.servers.source import Server
from hapi.data import DatasetManifest, Transforms
from hapi.graph import RAW, ModelGraph
from hapi.plan import (
    CodecProfile,
    LinkProfile,
    Plan,
    PlannerConfig,
    ServerProfile,
    TrainerProfile,
    Workload,
    choose_codec,
    choose_plan,
)
from hapi.wire import SessionRequest

__all__ = ["STALE_LINK", "STALE_S", "Planned", "has_kept_profiles", "plan_job"]

STALE_LINK = 2.0
"""How far off (either way) a job's link must measure from the kept one to replace it..."""
STALE_S = 0.05
"""... and by how many seconds over the probe's bytes (`_stale_link`)."""


@dataclass(frozen=True)
class Planned:
    """A job's first plan, and whether it came from kept profiles."""

    plan: Plan
    kept: bool
    """Chosen from the profiles an earlier run of the same job measured (`ProfileCache`)."""
    stale_link: LinkProfile | None = None
    """The kept link, where the job measured its link again and found it `STALE_LINK`
    times off (the plan is the fresh link's); None otherwise."""


def plan_job(
    connection: Server,
    request: Callable[[int], SessionRequest],
    manifest: DatasetManifest,
    graph: ModelGraph,
    freeze: int,
    transforms: Transforms,
    workload: Workload,
    *,
    dataset: str,
    samples: int = 16,
    batch_size: int = 8,
    seed: int = 0,
    wire_dtype: str = "fp32",
    cache: ProfileCache | None = None,
    config: PlannerConfig | None = None,
    codecs: Sequence[Codec] = (),
    seen: ChunkTally | None = None,
) -> Planned:
    """Measure the job's pipeline (`measure_job`) - or take what an earlier run of the same
    job kept in `cache` - and choose its plan for `workload`.

    Args:
        dataset: the training set's prefix (the kept profiles are the dataset's).
        cache: where profiles are kept between jobs; None measures everything.
        codecs: the wire codecs to choose from with the cut (`choose_codec`); none, or
            only the job's dtype uncompressed: the plan sends that.
        seen: the job's own chunks at the freeze cut, where it trains on that cut while
            its plan is measured (`measure_job`).
        Others: as `measure_job`'s.
    """
    key = _key(connection, request, manifest, graph, freeze, workload, dataset=dataset,
               samples=samples, batch_size=batch_size)  # fmt: skip
    if list(codecs) == [(wire_dtype, "none")]:
        codecs = ()  # the server's profile sizes it already

    def worth(server: ServerProfile, trainer: TrainerProfile, link: LinkProfile) -> bool:
        return codecs_may_pay(server, trainer, link, workload, freeze=freeze, config=config)

    kept = _kept_profiles(cache, key, codecs, worth, connection, request, manifest, samples, seed)
    if kept is not None:
        profiles, stale = kept
    else:
        profiles, stale = measure_job(
            connection, request, manifest, graph, freeze, transforms,
            samples=samples, batch_size=batch_size, chunk_size=workload.chunk_size, seed=seed,
            wire_dtype=wire_dtype, profiles=cache, codecs=codecs, codecs_worth=worth, seen=seen,
        ), None  # fmt: skip
        if cache is not None:
            cache.keep(key, profiles.server, profiles.trainer, profiles.link, profiles.codecs)
    plan = _choose(profiles, workload, freeze=freeze, names=graph.names(), config=config)
    return Planned(plan, kept is not None, stale)


def has_kept_profiles(
    connection: Server,
    request: Callable[[int], SessionRequest],
    manifest: DatasetManifest,
    graph: ModelGraph,
    freeze: int,
    workload: Workload,
    *,
    dataset: str,
    samples: int = 16,
    batch_size: int = 8,
    cache: ProfileCache | None = None,
) -> bool:
    """Whether an earlier run of the job (arguments as `plan_job`'s) kept its profiles in
    `cache`: a job that has none is measured while it trains (`PlanInForce`)."""
    if cache is None:
        return False
    key = _key(connection, request, manifest, graph, freeze, workload, dataset=dataset,
               samples=samples, batch_size=batch_size)  # fmt: skip
    return cache.job(key) is not None


def _key(
    connection: Server,
    request: Callable[[int], SessionRequest],
    manifest: DatasetManifest,
    graph: ModelGraph,
    freeze: int,
    workload: Workload,
    *,
    dataset: str,
    samples: int,
    batch_size: int,
) -> str:
    """The key a job's profiles are kept under: what they depend on."""
    return job_key(
        graph, freeze, batch_size, server=connection.address,
        job={"dataset": dataset, "samples": len(manifest),
             "request": request(RAW).model_dump(mode="json"),
             "chunk_size": workload.chunk_size, "probe": samples},
    )  # fmt: skip


def _kept_profiles(
    cache: ProfileCache | None,
    key: str,
    codecs: Sequence[Codec],
    worth: Callable[[ServerProfile, TrainerProfile, LinkProfile], bool],
    connection: Server,
    request: Callable[[int], SessionRequest],
    manifest: DatasetManifest,
    samples: int,
    seed: int,
) -> tuple[Profiles, LinkProfile | None] | None:
    """The profiles an earlier run of the job kept in `cache` under `key`, if they cover
    its `codecs` (`_covering`), with the link measured again where the kept one is stale
    (and the stale one, else None); None: the job measures them."""
    stored = cache.job(key) if cache is not None else None
    kept = _covering(stored, codecs, worth)
    if kept is None:
        return None
    profiles, stale = kept, None
    fresh = _stale_link(connection, request(RAW), manifest, kept.link, samples, seed)
    if fresh is not None and cache is not None and stored is not None:
        stale, profiles = kept.link, dataclasses.replace(kept, link=fresh)
        cache.keep(key, stored[0], stored[1], fresh, stored[3])  # the next job's too
    if codecs and not profiles.codecs and worth(profiles.server, profiles.trainer, profiles.link):
        return None  # no codec measured where none could pay, and now one may
    return profiles, stale


def _choose(
    profiles: Profiles,
    workload: Workload,
    *,
    freeze: int,
    names: Sequence[str],
    config: PlannerConfig | None,
) -> Plan:
    """The plan for `workload` from `profiles`: its cut and, where codecs were measured,
    its codec with it (`choose_codec`)."""
    if profiles.codecs:
        # The candidates are what the job allows (lossy ones only when it opted in).
        return choose_codec(
            profiles.codecs, profiles.server, profiles.trainer, profiles.link, workload,
            freeze=freeze, names=names, lossy=True, config=config,
        ).plan  # fmt: skip
    return choose_plan(
        profiles.server,
        profiles.trainer,
        profiles.link,
        workload,
        freeze=freeze,
        names=names,
        config=config,
    )


def _stale_link(
    connection: Server,
    request: SessionRequest,
    manifest: DatasetManifest,
    kept: LinkProfile,
    samples: int,
    seed: int,
) -> LinkProfile | None:
    """The link measured again where the kept one is stale, else None.

    Kept profiles are keyed by the server's address, and the path to one address can
    change between jobs (a 1 Gbit/s link that is 10 Mbit/s today): the plan would follow
    the old link until the re-planner caught up. The job's RAW probe alone (a few objects,
    0.1-0.3 s) tells. Only a link both `STALE_LINK` times off and `STALE_S` off over the
    probe's own bytes replaces the kept one, so a job run again on the same link plans
    from the same measurement as the last: a probe over a fast link is over in a few
    milliseconds, where a scheduler's pause alone read as a link 3x slower (loopback).
    """
    keys, labels = probe_keys(manifest, samples, seed)
    with open_probe_session(connection, request) as info:
        session = info.session
        raw = probe_raw(connection, session, keys, labels)
    fresh = link_of(raw)
    ratio = fresh.bytes_per_s / kept.bytes_per_s
    apart_s = abs(raw.nbytes / fresh.bytes_per_s - raw.nbytes / kept.bytes_per_s)
    return fresh if not 1 / STALE_LINK <= ratio <= STALE_LINK and apart_s > STALE_S else None


def _covering(
    kept: tuple[ServerProfile, TrainerProfile, LinkProfile, tuple[CodecProfile, ...]] | None,
    codecs: Sequence[Codec],
    worth: Callable[[ServerProfile, TrainerProfile, LinkProfile], bool],
) -> Profiles | None:
    """Kept profiles that measured every codec in `codecs`, with those codecs alone, in
    their order - or none of them where none could pay (`codecs_may_pay`); None where
    some codec was not measured. The codecs a job weighs are not part of its key: a run
    with fewer of them (`wire_compression="none"` after `auto`) plans from the same
    measurement, so its plan differs from the other's by the codec alone."""
    if kept is None:
        return None
    server, trainer, link, measured = kept
    by_codec: dict[tuple[str, str], CodecProfile] = {
        (c.wire_dtype, c.compression): c for c in measured
    }
    if not measured and codecs and not worth(server, trainer, link):
        return Profiles(server, trainer, link)
    if any(c not in by_codec for c in codecs):
        return None
    return Profiles(server, trainer, link, tuple(by_codec[c] for c in codecs))
