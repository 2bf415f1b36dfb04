"""Measuring a job's pipeline before it trains: the server, the link and the trainer.

A RAW probe of the job's own objects gives the link, the objects' size and what receiving
and serving raw cost; then both tiers measure at once - the trainer its heads, step,
decoding and codecs, the server its `profile` (where it runs heads unlike the trainer)
and a probe at the freeze cut - and `plan_job` chooses the plan, from profiles kept by an
earlier run where it can (`ProfileCache`). How and why: `docs/cost-model.md`, "How a job
measures its pipeline".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hapi.client.planning._probe_chunks import (
    Probe,
    link_of,
    probe,
    probe_raw,
)
from hapi.client.planning._server_profile import (
    alike,
    calibrated,
    device_of,
    profile_action,
    scaled_by_chunks,
    scaled_trainer,
)
from hapi.client.planning.chunk_tally import ChunkTally
from hapi.client.planning.codec_choice import Codec, codecs_may_pay, measure_codecs
from hapi.client.planning.profile_cache import ProfileCache, job_key
from hapi.client.servers.source import Server
from hapi.data import DatasetManifest, Transforms
from hapi.errors import HapiError, InvalidRequest
from hapi.graph import INPUT, RAW, ModelGraph
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
    measure_decode,
    measure_trainer,
)
from hapi.wire import SessionRequest
from hapi.wire.replies import SessionInfo

__all__ = [
    "BESIDE_CHUNKS",
    "STALE_LINK",
    "Planned",
    "Profiles",
    "has_kept_profiles",
    "measure_job",
    "plan_job",
    "probe_keys",
]

_WARM = 4
"""Samples (and objects) the trainer's warm-ups run on before its one timed run."""
_CPU_HEAD_BATCH = 16
"""Samples a CPU trainer times its heads on. A core's time per sample does not change with
the batch beyond a few samples (ResNet-18 at 112 px: batches of 8, 16 and 32 within the
runs' noise), and the heads at the job's batch of 32 took 0.85 s of a cold job's start; a
GPU's does change (a small batch leaves it idle), so it times the job's batch."""
STALE_LINK = 2.0
"""How far off (either way) a job's link must measure from the kept one to replace it..."""
STALE_S = 0.05
"""... and by how many seconds over the probe's bytes (`_stale_link`)."""


@dataclass(frozen=True)
class Profiles:
    """The three profiles a plan is made from."""

    server: ServerProfile
    trainer: TrainerProfile
    link: LinkProfile
    codecs: tuple[CodecProfile, ...] = ()
    """The wire codecs weighed, measured on the probe's features; none: the job's dtype
    uncompressed, as the server's profile sizes it."""


def probe_keys(manifest: DatasetManifest, n: int, seed: int) -> tuple[list[str], list[int]]:
    """`n` keys spread over the dataset (a seeded sample), with their labels."""
    if not len(manifest):
        raise InvalidRequest("cannot plan a job on an empty dataset")
    pick = np.random.default_rng([seed, 7]).permutation(len(manifest))[:n]
    return [manifest.keys[i] for i in pick], [manifest.labels[i] for i in pick]


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
    with _session(connection, request) as info:
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


def measure_job(
    connection: Server,
    request: Callable[[int], SessionRequest],
    manifest: DatasetManifest,
    graph: ModelGraph,
    freeze: int,
    transforms: Transforms,
    *,
    samples: int = 16,
    batch_size: int = 8,
    chunk_size: int | None = None,
    seed: int = 0,
    wire_dtype: str = "fp32",
    profiles: ProfileCache | None = None,
    codecs: Sequence[Codec] = (),
    codecs_worth: Callable[[ServerProfile, TrainerProfile, LinkProfile], bool] | None = None,
    seen: ChunkTally | None = None,
) -> Profiles:
    """Measure the server, the link and the trainer for a job (a few seconds).

    Args:
        connection: the job's server.
        request: the job's session request for a cut.
        manifest: the training set.
        graph: the job's model, traced, on the trainer's device.
        freeze: the freeze point (cuts 0..freeze are profiled).
        transforms: the training transforms (the trainer decodes with them).
        samples: objects per probe chunk.
        batch_size: samples per measured batch in the trainer.
        chunk_size: the job's keys per chunk, the probe's at the freeze cut too.
        seed: picks the probe's objects.
        wire_dtype: the dtype features travel in.
        profiles: where the trainer's head and step times are kept between jobs.
        codecs: wire codecs to measure on the probe's features (`measure_codecs`), on
            the trainer while the server profiles itself - or after, where
            `codecs_worth` says they may pay (`codecs_may_pay`; None: always); none
            measured: `Profiles.codecs` is empty, the job's dtype uncompressed.
        seen: the job's own chunks at the freeze cut, while it trains there: they stand
            in for the probe at that cut where they can (`_measured_beside`).

    Raises:
        HapiError: the server refused a probe or cannot be reached.
    """
    keys, labels = probe_keys(manifest, samples, seed)
    beside = seen and _measured_beside(
        connection, request(RAW), (keys, labels), graph, freeze, transforms, seen,
        seed=seed, batch_size=batch_size, profiles=profiles, wire_dtype=wire_dtype,
    )  # fmt: skip
    if beside:
        return _with_codecs(beside, graph, freeze, transforms, codecs, codecs_worth, seed)
    probes = _probe_side_by_side(
        connection, request, keys, labels, graph, freeze, transforms, seed=seed,
        batch_size=batch_size, chunk_size=chunk_size, profiles=profiles, codecs=codecs,
    )  # fmt: skip
    link, trainer = link_of(probes.raw), probes.trainer
    server = _server_profile(probes, graph, freeze, len(keys), chunk_size, wire_dtype)
    if probes.codecs is not None:
        return Profiles(server=server, trainer=trainer, link=link, codecs=probes.codecs)
    measured = _Measured(server, trainer, link, probes.raw.blobs)
    return _with_codecs(measured, graph, freeze, transforms, codecs, codecs_worth, seed)


@dataclass(frozen=True)
class _Measured:
    """The three profiles, before the codecs, and the RAW probe's objects."""

    server: ServerProfile
    trainer: TrainerProfile
    link: LinkProfile
    blobs: list[bytes]


def _with_codecs(
    measured: _Measured,
    graph: ModelGraph,
    freeze: int,
    transforms: Transforms,
    codecs: Sequence[Codec],
    worth: Callable[[ServerProfile, TrainerProfile, LinkProfile], bool] | None,
    seed: int,
) -> Profiles:
    """The profiles with `codecs` measured on the probe's objects, where they may pay."""
    server, trainer, link = measured.server, measured.trainer, measured.link
    codec_profiles: tuple[CodecProfile, ...] = ()
    if codecs and (worth is None or worth(server, trainer, link)):
        blobs = measured.blobs
        codec_profiles = measure_codecs(graph, freeze, blobs, transforms, codecs, seed=seed)
    return Profiles(server=server, trainer=trainer, link=link, codecs=codec_profiles)


BESIDE_CHUNKS = 2
"""The job's own chunks at the freeze cut (after its first) that stand in for a probe."""
BESIDE_WAIT_S = 30.0
"""The longest a plan measured beside training waits for them before it probes the cut."""


def _measured_beside(
    connection: Server,
    raw_request: SessionRequest,
    probe_set: tuple[list[str], list[int]],
    graph: ModelGraph,
    freeze: int,
    transforms: Transforms,
    seen: ChunkTally,
    *,
    seed: int,
    batch_size: int,
    profiles: ProfileCache | None,
    wire_dtype: str,
) -> _Measured | None:
    """The profiles of a job that trains on the freeze cut while they are measured: the
    RAW probe, the trainer timing itself (its core is mostly idle beside chunks at the
    freeze cut), and the job's own chunks at the freeze cut in place of a probe there -
    the server computes no head for the plan. None where the server runs heads unlike
    the trainer (it profiles itself, `_probe_side_by_side`), or no chunk came in time."""
    keys, labels = probe_set
    with _session(connection, raw_request) as raw_info:
        if not alike(raw_info, graph):
            return None
        raw = probe_raw(connection, raw_info.session, keys, labels)
    trainer = _time_trainer(graph, freeze, raw.blobs, transforms, seed, batch_size, profiles)
    trainer = dataclasses.replace(trainer, receive_s=raw.cpu_s / raw.nbytes if raw.nbytes else 0.0)
    chunks = seen.wait(BESIDE_CHUNKS, BESIDE_WAIT_S)
    if chunks is None:
        return None
    server = scaled_by_chunks(
        graph, freeze, raw=raw, chunks=chunks, trainer=trainer, wire_dtype=wire_dtype
    )
    return _Measured(server, trainer, link_of(raw), raw.blobs)


@dataclass(frozen=True)
class _Probes:
    """What a job's probes measured, the server's side and the trainer's."""

    raw: Probe
    """The RAW probe: the link, the objects' size, what receiving and serving them cost."""
    at_cut: SessionInfo
    """The session at the freeze cut (the server's batch size in it)."""
    profiled: ServerProfile | None
    """The server's own profile of the cuts; None: it runs heads as the trainer does, or
    cannot profile them all (the probe at the freeze cut stands in)."""
    at_freeze: Probe | None
    """The probe at the freeze cut, in the job's chunks; None: not needed."""
    trainer: TrainerProfile
    """The trainer's heads, step, decoding and receiving."""
    codecs: tuple[CodecProfile, ...] | None
    """The codecs, measured while the server measured; None: not yet (measured after,
    where they may pay)."""


def _probe_side_by_side(
    connection: Server,
    request: Callable[[int], SessionRequest],
    keys: list[str],
    labels: list[int],
    graph: ModelGraph,
    freeze: int,
    transforms: Transforms,
    *,
    seed: int,
    batch_size: int,
    chunk_size: int | None,
    profiles: ProfileCache | None,
    codecs: Sequence[Codec],
) -> _Probes:
    """Probe the link with both tiers idle, then let the trainer and the server measure
    themselves at once (arguments as `measure_job`'s)."""
    with (
        _session(connection, request(freeze)) as at_cut_info,
        _session(connection, request(RAW)) as raw_info,
        concurrent.futures.ThreadPoolExecutor(1, "hapi-measure") as pool,
    ):
        # First, with both tiers idle: the trainer's CPU time receiving it is what
        # receiving costs, the server's what sending does. It reads the objects cold,
        # which `raw_s` takes out.
        raw = probe_raw(connection, raw_info.session, keys, labels)
        # Then the two tiers measure themselves side by side (two machines, or two cores:
        # one after the other they took twice as long): the trainer its heads, step,
        # decoding and codecs, the server its profile and a probe at the freeze cut.
        server_done = threading.Event()

        def trainer_side() -> tuple[TrainerProfile, tuple[CodecProfile, ...] | None]:
            timed = _time_trainer(graph, freeze, raw.blobs, transforms, seed, batch_size, profiles)
            if not codecs or server_done.is_set():
                return timed, None  # measured below if they may pay
            # The server is still measuring, the trainer's core idle beside it: free.
            return timed, measure_codecs(graph, freeze, raw.blobs, transforms, codecs, seed=seed)

        trained = pool.submit(trainer_side)
        try:
            profiled, at_freeze = _server_side(
                connection, raw_info, at_cut_info.session, keys, labels, graph, freeze,
                chunk_size=chunk_size, batch_size=batch_size,
            )  # fmt: skip
        finally:
            server_done.set()
            trainer_alone, codec_profiles = trained.result()
    trainer = dataclasses.replace(
        trainer_alone,
        # The RAW probe's bytes, received while the trainer did nothing else.
        receive_s=raw.cpu_s / raw.nbytes if raw.nbytes else 0.0,
    )
    return _Probes(raw, at_cut_info, profiled, at_freeze, trainer, codec_profiles)


def _server_side(
    connection: Server,
    raw_info: SessionInfo,
    at_cut: str,
    keys: list[str],
    labels: list[int],
    graph: ModelGraph,
    freeze: int,
    *,
    chunk_size: int | None,
    batch_size: int,
) -> tuple[ServerProfile | None, Probe | None]:
    """The server's own profile (`_Probes.profiled`) and the probe at the freeze cut, in
    the session `at_cut` (`_Probes.at_freeze`)."""
    profiled = None
    if not alike(raw_info, graph):
        profiled = profile_action(connection, raw_info.session, keys, chunk_size or batch_size)
    if profiled is not None and profiled.last_cut < freeze:
        profiled = None
    at_freeze = None
    if profiled is None or freeze > INPUT:
        # A few of the objects first, at the freeze cut: a session's first chunk
        # pays for what every later one reuses (the profile's own reads and heads
        # warm only part of it), and the probe must not measure that.
        probe(connection, at_cut, keys[:_WARM], labels[:_WARM])
        at_freeze = probe(connection, at_cut, keys, labels, chunk_size)
    return profiled, at_freeze


def _server_profile(
    probes: _Probes,
    graph: ModelGraph,
    freeze: int,
    probed: int,
    chunk_size: int | None,
    wire_dtype: str,
) -> ServerProfile:
    """The server's profile: its own calibrated by the probes, or where it has none the
    trainer's, scaled to the probe at the freeze cut (`probed` keys)."""
    raw, at_freeze = probes.raw, probes.at_freeze
    if probes.profiled is not None:
        return calibrated(probes.profiled, raw=raw, at_freeze=at_freeze, freeze=freeze)
    assert at_freeze is not None  # probed just now
    # The probe's chunks' batches: the job's chunk size, as far as the server batches.
    batch = min(chunk_size or probed, probed, probes.at_cut.batch_size or probed)
    return scaled_trainer(graph, freeze, raw=raw, at_freeze=at_freeze, trainer=probes.trainer,
                          wire_dtype=wire_dtype, batch_size=batch)  # fmt: skip


def _time_trainer(
    graph: ModelGraph,
    freeze: int,
    blobs: list[bytes],
    transforms: Transforms,
    seed: int,
    batch_size: int,
    profiles: ProfileCache | None,
) -> TrainerProfile:
    """The trainer's profile: its heads and training step (kept in `profiles` when given),
    and decoding this job's objects (measured every time: it is the data's)."""

    def measure() -> TrainerProfile:
        # One timed run after a warm-up on a few samples (`time_segments`): the rough
        # figure is corrected by the re-planner from the chunks' own times, and the median
        # of three cost a cold job's start a third of its measuring.
        return measure_trainer(
            graph, freeze, batch_size=batch_size, repeats=1, warm=_WARM,
            head_batch=min(batch_size, _CPU_HEAD_BATCH) if device_of(graph).type == "cpu" else None,
        )  # fmt: skip

    trainer = (
        measure() if profiles is None else profiles.trainer(graph, freeze, batch_size, measure)[0]
    )
    decode_s = measure_decode(blobs, transforms, seed=seed, repeats=1, warm=_WARM)
    return dataclasses.replace(trainer, decode_s=decode_s)


@contextlib.contextmanager
def _session(connection: Server, request: SessionRequest) -> Iterator[SessionInfo]:
    """A session for the probes, closed after them if its server still answers.

    The close is best effort: a server that died has no session left to close, and a
    failure of the probes themselves is the error to report (and retry), not the
    close's. A session nobody closes is freed by its lease (`session_idle_s`)."""
    info = connection.open_session(request)
    session = info.session
    try:
        yield info
    finally:
        with contextlib.suppress(HapiError):
            connection.close_session(session)
