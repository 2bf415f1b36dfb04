"""Measuring a job's pipeline before it trains: the server, the link and the trainer.

The link, the objects' size and the trainer's decoding come from a probe chunk of the
job's own objects in a RAW session: its bytes over the stream's time, less the server's
wait for its store (the session's own counters, `stats`) and the request's round trip.
The trainer's CPU time receiving it, per byte, is what every byte costs the core that
trains (`TrainerProfile.receive_s`); the server's time on it, as its report says, is what
serving an object raw costs the server (`ServerProfile.raw_s`: reading and encoding).
The server measures its side itself when it answers the `profile` action: reading,
decoding and the head to every cut, on the same objects, the head in batches of the
job's chunk size. A probe at the freeze cut then sets their level: it runs the path
every chunk runs, in chunks of the job's size, and the session's counters give its
decoding and head time per sample.
An older server gets the probe alone, and the head to the other cuts is the trainer's
measured head scaled by the server/trainer ratio at the freeze point: the layers'
relative costs are the model's, the ratio is the machines'. A first small chunk at the
freeze cut pays for what a session's first chunk pays once, so the probe does not count it.

It costs a job's start what the plan must save back, so each side measures roughly and
once - one timed run after a warm-up on a few samples, a RAW probe of four objects where
the link is slow - and the two sides measure at once: the re-planner corrects a plan from
the chunks' own times (`benchmarks/startup.py` weighs the start against fixed plans).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hapi.client._codec_choice import Codec, measure_codecs
from hapi.client._probe_chunks import (
    Probe,
    link_of,
    probe,
    probe_raw,
    raw_s,
    send_s,
)
from hapi.client._profile_cache import ProfileCache, job_key
from hapi.client.connection import Connection
from hapi.data import DatasetManifest, Transforms
from hapi.errors import HapiError, InvalidRequest, OverBudget
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
    memory_per_sample,
    wire_bytes,
)
from hapi.wire import ActionType, SessionRequest
from hapi.wire.messages import MAX_PROFILE_BATCH, MAX_PROFILE_KEYS, ProfileRequest
from hapi.wire.replies import ProfileReply

__all__ = ["STALE_LINK", "Planned", "Profiles", "measure_job", "plan_job", "probe_keys"]

_WARM = 4
"""Samples (and objects) the trainer's warm-ups run on before its one timed run."""
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
    connection: Connection,
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
) -> Planned:
    """Measure the job's pipeline (`measure_job`) - or take what an earlier run of the same
    job kept in `cache` - and choose its plan for `workload`.

    Args:
        dataset: the training set's prefix (the kept profiles are the dataset's).
        cache: where profiles are kept between jobs; None measures everything.
        codecs: the wire codecs to choose from with the cut (`choose_codec`); none, or
            only the job's dtype uncompressed: the plan sends that.
        Others: as `measure_job`'s.
    """
    key = job_key(
        graph, freeze, batch_size, server=connection.address,
        job={"dataset": dataset, "samples": len(manifest),
             "request": request(RAW).model_dump(mode="json"),
             "chunk_size": workload.chunk_size, "probe": samples},
    )  # fmt: skip
    if list(codecs) == [(wire_dtype, "none")]:
        codecs = ()  # the server's profile sizes it already
    stored = cache.job(key) if cache is not None else None
    kept = _covering(stored, codecs)
    stale: LinkProfile | None = None
    if kept is not None:
        profiles = kept
        fresh = _stale_link(connection, request(RAW), manifest, kept.link, samples, seed)
        if fresh is not None and cache is not None and stored is not None:
            stale, profiles = kept.link, dataclasses.replace(kept, link=fresh)
            cache.keep(key, stored[0], stored[1], fresh, stored[3])  # the next job's too
    else:
        profiles = measure_job(
            connection, request, manifest, graph, freeze, transforms,
            samples=samples, batch_size=batch_size, chunk_size=workload.chunk_size, seed=seed,
            wire_dtype=wire_dtype, profiles=cache, codecs=codecs,
        )  # fmt: skip
        if cache is not None:
            cache.keep(key, profiles.server, profiles.trainer, profiles.link, profiles.codecs)
    if profiles.codecs:
        # The candidates are what the job allows (lossy ones only when it opted in).
        plan = choose_codec(
            profiles.codecs, profiles.server, profiles.trainer, profiles.link, workload,
            freeze=freeze, names=graph.names(), lossy=True, config=config,
        ).plan  # fmt: skip
    else:
        plan = choose_plan(
            profiles.server,
            profiles.trainer,
            profiles.link,
            workload,
            freeze=freeze,
            names=graph.names(),
            config=config,
        )
    return Planned(plan, kept is not None, stale)


def _stale_link(
    connection: Connection,
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
    with _session(connection, request) as session:
        raw = probe_raw(connection, session, keys, labels)
    fresh = link_of(raw)
    ratio = fresh.bytes_per_s / kept.bytes_per_s
    apart_s = abs(raw.nbytes / fresh.bytes_per_s - raw.nbytes / kept.bytes_per_s)
    return fresh if not 1 / STALE_LINK <= ratio <= STALE_LINK and apart_s > STALE_S else None


def _covering(
    kept: tuple[ServerProfile, TrainerProfile, LinkProfile, tuple[CodecProfile, ...]] | None,
    codecs: Sequence[Codec],
) -> Profiles | None:
    """Kept profiles that measured every codec in `codecs`, with those codecs alone, in
    their order; None where some codec was not measured. The codecs a job weighs are not
    part of its key: a run with fewer of them (`wire_compression="none"` after `auto`)
    plans from the same measurement, so its plan differs from the other's by the codec
    alone."""
    if kept is None:
        return None
    server, trainer, link, measured = kept
    by_codec: dict[tuple[str, str], CodecProfile] = {
        (c.wire_dtype, c.compression): c for c in measured
    }
    if any(c not in by_codec for c in codecs):
        return None
    return Profiles(server, trainer, link, tuple(by_codec[c] for c in codecs))


def measure_job(
    connection: Connection,
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
        chunk_size: the job's keys per chunk: the probe at the freeze cut runs in chunks
            of this size, so the server's head runs the batches the job's chunks will.
        seed: picks the probe's objects.
        wire_dtype: the dtype features travel in.
        profiles: where the trainer's head and step times are kept between jobs; None
            measures them.
        codecs: wire codecs to measure on the probe's features (`measure_codecs`), on
            the trainer while the server profiles itself.

    Raises:
        HapiError: the server refused a probe or cannot be reached.
    """
    keys, labels = probe_keys(manifest, samples, seed)
    with (
        _session(connection, request(freeze)) as at_cut,
        _session(connection, request(RAW)) as session,
        concurrent.futures.ThreadPoolExecutor(1, "hapi-measure") as pool,
    ):
        # First, with both tiers idle: the trainer's CPU time receiving it is what
        # receiving costs, the server's what sending does. It reads the objects cold,
        # which `raw_s` takes out.
        raw = probe_raw(connection, session, keys, labels)
        # Then the two tiers measure themselves side by side (two machines, or two cores:
        # one after the other they took twice as long): the trainer its heads, step,
        # decoding and codecs, the server its profile and a probe at the freeze cut.
        trainer_side = pool.submit(
            _time_trainer, graph, freeze, raw.blobs, transforms, seed, batch_size, profiles
        )
        coded = pool.submit(measure_codecs, graph, freeze, raw.blobs, transforms, codecs, seed=seed)
        try:
            profiled = _profile_action(connection, session, keys, chunk_size or batch_size)
            if profiled is not None and profiled.last_cut < freeze:
                profiled = None
            at_freeze = None
            if profiled is None or freeze > INPUT:
                # A few of the objects first, at the freeze cut: a session's first chunk
                # pays for what every later one reuses (the profile's own reads and heads
                # warm only part of it), and the probe must not measure that.
                probe(connection, at_cut, keys[:_WARM], labels[:_WARM])
                at_freeze = probe(connection, at_cut, keys, labels, chunk_size)
        finally:
            trainer_alone, codec_profiles = trainer_side.result(), coded.result()
    link = link_of(raw)
    trainer = dataclasses.replace(
        trainer_alone,
        # The RAW probe's bytes, received while the trainer did nothing else.
        receive_s=raw.cpu_s / raw.nbytes if raw.nbytes else 0.0,
    )
    if profiled is None:
        assert at_freeze is not None  # probed just now
        server = _scaled_trainer(graph, freeze, raw=raw, at_freeze=at_freeze, trainer=trainer,
                                 wire_dtype=wire_dtype)  # fmt: skip
    else:
        server = _calibrated(profiled, raw=raw, at_freeze=at_freeze, freeze=freeze)
    return Profiles(server=server, trainer=trainer, link=link, codecs=codec_profiles)


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
        return measure_trainer(graph, freeze, batch_size=batch_size, repeats=1, warm=_WARM)

    trainer = (
        measure() if profiles is None else profiles.trainer(graph, freeze, batch_size, measure)[0]
    )
    decode_s = measure_decode(blobs, transforms, seed=seed, repeats=1, warm=_WARM)
    return dataclasses.replace(trainer, decode_s=decode_s)


@contextlib.contextmanager
def _session(connection: Connection, request: SessionRequest) -> Iterator[str]:
    """A session for the probes, closed after them if its server still answers.

    The close is best effort: a server that died has no session left to close, and a
    failure of the probes themselves is the error to report (and retry), not the
    close's. A session nobody closes is freed by its lease (`session_idle_s`)."""
    session = connection.open_session(request).session
    try:
        yield session
    finally:
        with contextlib.suppress(HapiError):
            connection.close_session(session)


def _calibrated(
    profiled: ServerProfile, *, raw: Probe, at_freeze: Probe | None, freeze: int
) -> ServerProfile:
    """The server's own profile, its head, reading and decoding rescaled to a real chunk's.

    The profile times each cut's head on a small batch of its own; the probe at the
    freeze cut runs the path every chunk runs, in chunks of the job's size. The
    profile gives the cuts' relative costs, the probe their level: its head, its wait
    for the store, and the rest of what its chunks' reports say they cost - decoding and
    transforming, and encoding and handing on each batch - as `decode_s`. So the plan
    predicts the freeze cut at what its chunks will report, which is what the re-planner
    weighs them against: the profile action's store reads, one after another on an idle
    core, took a third of the 0.6 ms a sample a chunk waited for them beside its decoding
    (ResNet-50's INPUT chunks reported 1.14x the plan), and a re-plan in the first epoch
    answered a drift that was only the profile's.
    """
    raw_bytes = raw.nbytes / max(raw.samples, 1)  # what RAW carries per sample, as seen
    if at_freeze is None or not at_freeze.samples:
        return dataclasses.replace(
            profiled, raw_bytes=raw_bytes, raw_s=raw_s(profiled.read_s, raw), send_s=send_s(raw)
        )
    m = at_freeze.samples
    counters = at_freeze.server
    head = counters.head_s / m
    ratio = head / profiled.head_s[freeze] if profiled.head_s[freeze] > 0 else 1.0
    read, decode = profiled.read_s, counters.transform_s / m
    rest = (at_freeze.reported_s - counters.head_s - counters.read_s) / m
    if rest >= decode:  # else an older server, which reports no time
        read, decode = counters.read_s / m, rest
    return dataclasses.replace(
        profiled,
        raw_bytes=raw_bytes,
        read_s=read,
        raw_s=raw_s(read, raw),  # serving an object raw reads it too
        send_s=send_s(raw),
        decode_s=decode,
        head_s=tuple(t * ratio for t in profiled.head_s),
    )


def _profile_action(
    connection: Connection, session: str, keys: list[str], batch_size: int
) -> ServerProfile | None:
    """The server's own profile of the session's cuts, its heads timed in batches of
    `batch_size` (the job's chunks'), or None from a server without the `profile` action."""
    body = ProfileRequest(
        session=session,
        keys=keys[:MAX_PROFILE_KEYS],
        batch_size=min(batch_size, MAX_PROFILE_BATCH),
    ).to_bytes()
    try:
        reply = connection.action(ActionType.PROFILE, body)
    except OverBudget:  # the job's own samples do not fit: the job's error, said as such
        raise
    except InvalidRequest:  # an older server: "unknown action"
        return None
    return ServerProfile.from_dict(ProfileReply.model_validate_json(reply).server_profile())


def _scaled_trainer(
    graph: ModelGraph,
    freeze: int,
    *,
    raw: Probe,
    at_freeze: Probe,
    trainer: TrainerProfile,
    wire_dtype: str,
) -> ServerProfile:
    """The server's profile from the probe chunks alone (a server without the `profile`
    action): the trainer's per-cut head times scaled to the server's at the freeze cut."""
    n = max(raw.samples, 1)
    m = max(at_freeze.samples, 1)
    head_freeze = at_freeze.server.head_s / m if freeze > INPUT else 0.0
    local = trainer.head_s[freeze]
    ratio = head_freeze / local if local > 0 else 1.0
    # Bytes on the wire beyond the tensor itself (key, label, Arrow's buffers), measured.
    overhead = max(0, round(at_freeze.nbytes / m) - wire_bytes(graph, freeze, wire_dtype))
    cuts = range(freeze + 1)
    read_s = at_freeze.server.read_s / m  # warm: the RAW probe read the objects cold
    return ServerProfile(
        read_s=read_s,
        raw_s=raw_s(read_s, raw),
        send_s=send_s(raw),
        decode_s=at_freeze.server.transform_s / m,
        head_s=tuple(trainer.head_s[k] * ratio for k in cuts),
        out_bytes=tuple(wire_bytes(graph, k, wire_dtype, overhead=overhead) for k in cuts),
        memory_bytes=tuple(memory_per_sample(graph, k) for k in cuts),
        raw_bytes=raw.nbytes / n,
        wire_dtype=wire_dtype,
    )
