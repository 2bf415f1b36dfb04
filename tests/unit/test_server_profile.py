"""Which server profiles itself: one unlike the trainer (another device, other threads, or
an older server that does not say) answers the `profile` action; one alike has the
trainer's heads scaled to its level - a probe's, or the job's own chunks'."""

from __future__ import annotations

import pytest
import torch

from hapi.client.planning._probe_chunks import Probe
from hapi.client.planning._server_profile import alike, scaled_by_chunks
from hapi.client.planning.chunk_tally import ChunkTotals
from hapi.graph import ModelSpec, build_model, trace
from hapi.plan import TrainerProfile, wire_bytes
from hapi.wire import SessionStats
from hapi.wire.replies import SessionInfo


def _info(device: str, threads: int) -> SessionInfo:
    return SessionInfo(session="s", cut=1, freeze=1, num_cuts=2, feature_shape=[4],
                       wire_dtype="fp32", bytes_per_sample=16, device=device,
                       threads=threads)  # fmt: skip


def test_a_server_alike_is_one_on_the_trainers_device_with_as_many_threads() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18", num_classes=2)), (3, 32, 32))
    here = torch.get_num_threads()
    assert alike(_info("cpu", here), graph)
    assert not alike(_info("cpu", here + 1), graph)  # threads weigh layers differently
    assert not alike(_info("cuda:0", here), graph)
    assert not alike(_info("", 0), graph)  # an older server says neither


def _raw_probe(samples: int, read_s: float) -> Probe:
    return Probe(seconds=0.5, nbytes=samples * 90_000, samples=samples,
                 server=SessionStats(samples=samples, read_s=read_s * samples),
                 blobs=[], round_trip_s=0.001, cpu_s=0.01, reported_s=0.0,
                 server_cpu_s=0.0)  # fmt: skip


def test_a_server_alike_measured_beside_training_is_levelled_by_the_jobs_own_chunks() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18", num_classes=2)), (3, 32, 32))
    freeze = graph.resolve_cut("layer3")
    # The trainer timed its heads; the server's chunks at the freeze cut took 3x as long
    # a sample beside its reads (a slower core), and sent the features and a little more.
    head = tuple(0.001 * k for k in range(freeze + 1))
    trainer = TrainerProfile(decode_s=0.002, head_s=head, tail_s=(0.0,) * (freeze + 1))
    read = 0.0005
    per_sample = read + 3 * (trainer.decode_s + head[freeze])
    feature = wire_bytes(graph, freeze, "fp32")
    chunks = ChunkTotals(chunks=4, samples=64, bytes=64 * (feature + 100),
                         server_s=64 * per_sample)  # fmt: skip

    server = scaled_by_chunks(graph, freeze, raw=_raw_probe(4, read), chunks=chunks,
                              trainer=trainer, wire_dtype="fp32")  # fmt: skip

    # The freeze cut is predicted at what its chunks cost; every cut by the trainer's
    # share of the work at the chunks' level; its bytes as the chunks carried them.
    assert server.compute_s(freeze) == pytest.approx(per_sample)
    assert server.read_s == pytest.approx(read)
    assert server.head_s == pytest.approx(tuple(3 * h for h in head))
    assert server.decode_s == pytest.approx(3 * trainer.decode_s)
    assert server.out_bytes[freeze] == feature + 100
    assert server.batch_size == 16 and server.raw_bytes == 90_000
    # A cold probe's reads count for at most half of what the chunks cost.
    slow_store = scaled_by_chunks(graph, freeze, raw=_raw_probe(4, 1.0), chunks=chunks,
                                  trainer=trainer, wire_dtype="fp32")  # fmt: skip
    assert slow_store.read_s == pytest.approx(per_sample / 2)
    assert slow_store.compute_s(freeze) == pytest.approx(per_sample)
