"""Measuring a job's pipeline before it trains: the server, the link and the trainer.

A RAW probe of the job's own objects gives the link, the objects' size and what receiving
and serving raw cost; then both tiers measure at once - the trainer its heads, step,
decoding and codecs, the server its `profile` (where it runs heads unlike the trainer)
and a probe at the freeze cut; `plan_job` (its own module) chooses the plan from them, or
from profiles kept by an earlier run (`ProfileCache`). How and why: `docs/cost-model.md`, "How a job
measures its pipeline".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hapi.client.planning._probe_chunks import (
    Probe,
    link_of,
    open_probe_session,
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
from hapi.client.planning.codec_choice import Codec, measure_codecs
from hapi.client.planning.profile_cache import ProfileCache
from hapi.client.servers.source import Server
from hapi.data import DatasetManifest, Transforms
from hapi.errors import InvalidRequest
from hapi.graph import INPUT, RAW, ModelGraph
from hapi.plan import (
    CodecProfile,
    LinkProfile,
    ServerProfile,
    TrainerProfile,
    measure_decode,
    measure_trainer,
)
from hapi.wire import SessionRequest
from hapi.wire.replies import SessionInfo

__all__ = [
    "BESIDE_CHUNKS",
    "Profiles",
    "measure_job",
    "probe_keys",
]

_WARM = 4
"""Samples (and objects) the trainer's warm-ups run on before its one timed run."""
_CPU_HEAD_BATCH = 16
"""Samples a CPU trainer times its heads on. A core's time per sample does not change with
the batch beyond a few samples (ResNet-18 at 112 px: batches of 8, 16 and 32 within the
runs' noise), and the heads at the job's batch of 32 took 0.85 s of a cold job's start; a
GPU's does change (a small batch leaves it idle), so it times the job's batch."""


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
    with open_probe_session(connection, raw_request) as raw_info:
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
        open_probe_session(connection, request(freeze)) as at_cut_info,
        open_probe_session(connection, request(RAW)) as raw_info,
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
