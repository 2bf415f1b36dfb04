"""The server's side of a job's profiles: its own `profile` action, rescaled to what the
probe at the freeze cut saw, or - where the server runs heads as the trainer does - the
trainer's timed heads scaled to the server's level by that probe.
"""

from __future__ import annotations

import dataclasses

import torch

from hapi.client.planning._probe_chunks import Probe, raw_s, send_s
from hapi.client.planning.chunk_tally import ChunkTotals
from hapi.client.servers.source import Server
from hapi.errors import InvalidRequest, OverBudget
from hapi.graph import INPUT, ModelGraph
from hapi.plan import ServerProfile, TrainerProfile, memory_per_sample, wire_bytes
from hapi.wire.messages import MAX_PROFILE_BATCH, MAX_PROFILE_KEYS, ProfileRequest
from hapi.wire.replies import SessionInfo

__all__ = [
    "alike",
    "calibrated",
    "device_of",
    "profile_action",
    "scaled_by_chunks",
    "scaled_trainer",
]


def alike(server: SessionInfo, graph: ModelGraph) -> bool:
    """Whether the server runs heads as the trainer does - the same device, as many torch
    threads - so the trainer's timed heads give the cuts' relative costs, and the probe
    at the freeze cut their level on the server (`scaled_trainer`), without the `profile`
    action: it held the server's core a second of a cold job's start (ResNet-18 at 112 px,
    `docs/cost-model.md`), and measured what the trainer's heads already had. A GPU
    against a CPU, or 16 threads against one, weigh the layers differently: the server
    then profiles itself."""
    return (
        bool(server.device)
        and torch.device(server.device) == device_of(graph)
        and server.threads == torch.get_num_threads()
    )


def device_of(graph: ModelGraph) -> torch.device:
    first = next(graph.model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def calibrated(
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
    head = at_freeze.server.head_s / m
    ratio = head / profiled.head_s[freeze] if profiled.head_s[freeze] > 0 else 1.0
    read, decode = _level(at_freeze) or (profiled.read_s, at_freeze.server.transform_s / m)
    return dataclasses.replace(
        profiled,
        raw_bytes=raw_bytes,
        read_s=read,
        raw_s=raw_s(read, raw),  # serving an object raw reads it too
        send_s=send_s(raw),
        decode_s=decode,
        head_s=tuple(t * ratio for t in profiled.head_s),
    )


def profile_action(
    connection: Server, session: str, keys: list[str], batch_size: int
) -> ServerProfile | None:
    """The server's own profile of the session's cuts, its heads timed in batches of
    `batch_size` (the job's chunks'), or None from a server without the `profile` action."""
    request = ProfileRequest(
        session=session,
        keys=keys[:MAX_PROFILE_KEYS],
        batch_size=min(batch_size, MAX_PROFILE_BATCH),
    )
    try:
        reply = connection.profile(request)
    except OverBudget:  # the job's own samples do not fit: the job's error, said as such
        raise
    except InvalidRequest:  # an older server: "unknown action"
        return None
    return ServerProfile.from_dict(reply.server_profile())


def scaled_trainer(
    graph: ModelGraph,
    freeze: int,
    *,
    raw: Probe,
    at_freeze: Probe,
    trainer: TrainerProfile,
    wire_dtype: str,
    batch_size: int = 1,
) -> ServerProfile:
    """The server's profile from the probe chunks and the trainer's heads (a server that
    runs heads as the trainer does, `alike`, or one without the `profile` action): the
    trainer's per-cut head times scaled to the server's at the freeze cut, and the
    probe's level as `calibrated` takes it - its wait for the store, and the rest of
    what its chunks reported as decoding - so the plan predicts the freeze cut at what
    its chunks report. `batch_size`: the probe's chunks' (the server's head batch)."""
    n = max(raw.samples, 1)
    m = max(at_freeze.samples, 1)
    counters = at_freeze.server
    head_freeze = counters.head_s / m if freeze > INPUT else 0.0
    local = trainer.head_s[freeze]
    ratio = head_freeze / local if local > 0 else 1.0
    # Bytes on the wire beyond the tensor itself (key, label, Arrow's buffers), measured.
    overhead = max(0, round(at_freeze.nbytes / m) - wire_bytes(graph, freeze, wire_dtype))
    cuts = range(freeze + 1)
    # Warm reads: the RAW probe read the objects cold.
    read_s, decode_s = _level(at_freeze) or (counters.read_s / m, counters.transform_s / m)
    return ServerProfile(
        read_s=read_s,
        raw_s=raw_s(read_s, raw),
        send_s=send_s(raw),
        decode_s=decode_s,
        head_s=tuple(trainer.head_s[k] * ratio for k in cuts),
        out_bytes=tuple(wire_bytes(graph, k, wire_dtype, overhead=overhead) for k in cuts),
        memory_bytes=tuple(memory_per_sample(graph, k) for k in cuts),
        raw_bytes=raw.nbytes / n,
        wire_dtype=wire_dtype,
        batch_size=max(1, batch_size),
    )


def scaled_by_chunks(
    graph: ModelGraph,
    freeze: int,
    *,
    raw: Probe,
    chunks: ChunkTotals,
    trainer: TrainerProfile,
    wire_dtype: str,
) -> ServerProfile:
    """The server's profile from the job's own chunks at the freeze cut (a server that runs
    heads as the trainer does, `alike`, measured while the job trains on that cut): the
    trainer's decoding and per-cut heads scaled by one factor to what those chunks cost
    the server a sample, beside its reads as the RAW probe saw them. The plan predicts
    the freeze cut at what its chunks reported, and each other cut by its share of the
    work as the trainer timed it - the server computes no probe of its own."""
    n = max(raw.samples, 1)
    m = max(chunks.samples, 1)
    per_sample = chunks.server_s / m
    # The probe read its objects cold, an epoch's reads are warm: at most half the chunks'
    # time, which is mostly decoding and the head.
    read = min(raw.server.read_s / n, per_sample / 2)
    work = trainer.decode_s + trainer.head_s[freeze]
    ratio = (per_sample - read) / work if work > 0 else 1.0
    overhead = max(0, round(chunks.bytes / m) - wire_bytes(graph, freeze, wire_dtype))
    cuts = range(freeze + 1)
    return ServerProfile(
        read_s=read,
        raw_s=raw_s(read, raw),
        send_s=send_s(raw),
        decode_s=trainer.decode_s * ratio,
        head_s=tuple(trainer.head_s[k] * ratio for k in cuts),
        out_bytes=tuple(wire_bytes(graph, k, wire_dtype, overhead=overhead) for k in cuts),
        memory_bytes=tuple(memory_per_sample(graph, k) for k in cuts),
        raw_bytes=raw.nbytes / n,
        wire_dtype=wire_dtype,
        batch_size=max(1, m // max(chunks.chunks, 1)),
    )


def _level(at_freeze: Probe) -> tuple[float, float] | None:
    """The probe's read and decode seconds per sample, as its chunks reported them: its
    wait for the store, and the rest of their time beside the head - decoding and
    transforming, encoding and handing on each batch; None from an older server, which
    reports no time beyond its counters (its transforms' then stand)."""
    m = max(at_freeze.samples, 1)
    counters = at_freeze.server
    rest = (at_freeze.reported_s - counters.head_s - counters.read_s) / m
    if rest < counters.transform_s / m:
        return None
    return counters.read_s / m, rest
