"""Measuring per-cut costs on a real model, leaving the model as it was."""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from hapi.data import Transforms, load_sample
from hapi.graph import ModelGraph, ModelSpec, build_model, trace
from hapi.plan import (
    LinkProfile,
    ProfileKey,
    Workload,
    choose_plan,
    measure_decode,
    measure_heads,
    measure_server,
    measure_step,
    measure_tails,
    measure_trainer,
    memory_per_sample,
    time_segments,
    wire_bytes,
)
from hapi.plan.measure import time_per_item

from ..image_bytes import jpeg

FREEZE = 14  # flatten


@pytest.fixture(scope="module")
def resnet18() -> Iterator[ModelGraph]:
    # One thread: on a shared 2-core machine, two spinning threads per op make it slow.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield trace(build_model(ModelSpec(name="resnet18")), (3, 32, 32))
    torch.set_num_threads(threads)


def _positive(values: tuple[float, ...] | list[float]) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


def test_trainer_profile_has_a_positive_time_for_every_cut(resnet18: ModelGraph) -> None:
    model = resnet18.model
    flags = [p.requires_grad for p in model.parameters()]
    stats = model.bn1.running_mean.clone()
    model.train()
    profile = measure_trainer(resnet18, FREEZE, decode_s=0.001, batch_size=2, repeats=1)
    assert len(profile.head_s) == len(profile.tail_s) == FREEZE + 1
    assert profile.head_s[0] == 0.0
    assert _positive(profile.head_s[1:])
    assert list(profile.head_s) == sorted(profile.head_s)
    assert _positive(profile.tail_s)
    # The tail from the input runs all the frozen layers; from the freeze point, none.
    assert profile.tail_s[0] >= profile.tail_s[FREEZE]
    assert profile.local_s(FREEZE) > profile.remote_s(FREEZE)
    # The model is as it was: modes, flags, gradients, batch-norm statistics.
    assert model.training and all(m.training for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.bn1.running_mean, stats)


def test_the_optimizers_step_is_measured_on_the_weights_left_as_they_were(
    resnet18: ModelGraph,
) -> None:
    model = resnet18.model
    weights = [p.detach().clone() for p in model.parameters()]
    step = measure_step(resnet18, FREEZE, repeats=1)
    assert 0 < step < 1.0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(p.grad is None for p in model.parameters())
    # Nothing to train after the last cut: no step.
    assert measure_step(resnet18, resnet18.num_cuts) == 0.0


def test_every_tail_carries_its_share_of_the_optimizers_step(resnet18: ModelGraph) -> None:
    # A step per training batch, shared by its samples, from every cut alike.
    profile = measure_trainer(resnet18, FREEZE, batch_size=4, repeats=1, step_s=100.0)
    assert all(25.0 <= t < 26.0 for t in profile.tail_s)
    assert profile.head_s[FREEZE] < 1.0


class _Pause(nn.Module):
    """A layer that takes a known time per batch in eval mode (and counts its calls). It
    reads `self.training`, so the tracer keeps it a leaf rather than tracing through it."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.calls = seconds, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.calls += 1
            time.sleep(self.seconds)
        return x


def test_heads_timed_a_segment_at_a_time() -> None:
    slow, slower = _Pause(0.02), _Pause(0.04)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), slow, nn.ReLU(), slower, nn.Flatten())
    graph = trace(model, (3, 8, 8))
    last = graph.num_cuts
    slow.calls = slower.calls = 0  # tracing ran them once
    heads = measure_heads(graph, last, batch_size=4, repeats=3)
    steps = [b - a for a, b in itertools.pairwise(heads)]
    # Each pause shows in the step of the cut after it, per sample of the batch of 4...
    assert 0.02 / 4 <= max(steps[:3]) < 0.02 / 4 * 1.5
    assert 0.04 / 4 <= max(steps[3:]) < 0.04 / 4 * 1.5
    assert 0.06 / 4 <= heads[last] < 0.06 / 4 * 1.5
    # ... and each layer ran once per repeat and once to warm up, not once per cut after
    # it: that is what makes a profile at the job's own batch size affordable.
    assert slow.calls == slower.calls == 1 + 3


class _Live(nn.Module):
    """A segment that notes how many outputs of the segments before it are still alive
    whenever it runs."""

    def __init__(self, outputs: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__()
        self.outputs, self.seen = outputs, [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(sum(ref() is not None for ref in self.outputs))
        out = x + 1
        self.outputs.append(weakref.ref(out))
        return out


def test_segments_are_timed_holding_only_their_input_and_output() -> None:
    outputs: list[weakref.ref[torch.Tensor]] = []
    segments = [_Live(outputs) for _ in range(4)]
    heads = time_segments(segments, torch.zeros(2, 3), repeats=3)
    assert len(heads) == 5 and heads[0] == 0
    # The server holds a batch's input and output in its budget, not every cut's: when a
    # segment runs, only its input (the last output of the one before) is alive.
    assert [max(s.seen) for s in segments] == [0, 1, 1, 1]


def test_tails_measured_one_by_one(resnet18: ModelGraph) -> None:
    tails = measure_tails(resnet18, FREEZE, [0, 10, FREEZE], batch_size=2, repeats=1)
    assert set(tails) == {0, 10, FREEZE}
    assert _positive(list(tails.values()))
    assert all(p.grad is None for p in resnet18.model.parameters())


def test_decoding_is_measured_warm() -> None:
    # A job measures decoding first thing in its process, where the codec's first call
    # is slow: that call must not set the plan's decoding cost.
    calls = itertools.count()
    blobs = [jpeg(40, 40, seed) for seed in range(3)]

    def first_call_slow(i: int, data: bytes) -> None:
        if next(calls) == 0:
            time.sleep(0.3)
        load_sample(data, f"probe/{i}", Transforms.eval(32), i)

    decode = time_per_item(first_call_slow, blobs)
    assert 0 < decode < 0.05  # the cold pass would read 0.1 s a sample
    assert next(calls) == 3 * 4  # one warm pass, then three measured
    assert 0 < measure_decode(blobs, Transforms.eval(32)) < 0.05


def test_server_profile_and_a_plan_from_measurements(resnet18: ModelGraph) -> None:
    blobs = [jpeg(40, 40, seed) for seed in range(3)]
    decode = measure_decode(blobs, Transforms.eval(32))
    assert math.isfinite(decode) and decode > 0
    key = ProfileKey.of("sha256:0", (3, 32, 32), Transforms.eval(32).to_dict(), "cpu")
    server = measure_server(
        resnet18,
        FREEZE,
        read_s=1e-4,
        decode_s=decode,
        raw_bytes=sum(map(len, blobs)) / 3,
        wire_dtype="fp16",
        batch_size=2,
        repeats=1,
        key=key,
    )
    assert server.out_bytes[0] == 3 * 32 * 32 * 2
    assert server.out_bytes[FREEZE] == 512 * 2
    assert _positive(server.head_s[1:])
    trainer = measure_trainer(resnet18, FREEZE, decode_s=decode, batch_size=2, repeats=1)
    plan = choose_plan(
        server,
        trainer,
        LinkProfile(bytes_per_s=1.25e6),
        Workload(samples=256, chunk_size=32),
        freeze=FREEZE,
        names=resnet18.names(),
    )
    assert len(plan.options) >= FREEZE + 2  # RAW, INPUT, cuts 1..14, and hybrids
    assert plan.epoch_s == min(o.epoch_s for o in plan.options) or "within tolerance" in (
        plan.reason
    )


def test_wire_bytes_and_memory_follow_the_shapes(resnet18: ModelGraph) -> None:
    assert wire_bytes(resnet18, 0) == 3 * 32 * 32 * 4
    assert wire_bytes(resnet18, FREEZE, "bf16", overhead=16) == 512 * 2 + 16
    layer1 = resnet18.cut_point(6).bytes_per_sample
    assert memory_per_sample(resnet18, 0) == 3 * 32 * 32 * 4
    # The input, plus conv1's input and output alive together (its output is the largest).
    conv1 = resnet18.cut_point(1).bytes_per_sample
    assert memory_per_sample(resnet18, 1) == 3 * 32 * 32 * 4 + 3 * 32 * 32 * 4 + conv1
    assert memory_per_sample(resnet18, FREEZE) >= memory_per_sample(resnet18, 6) > layer1


class _Batches(nn.Module):
    """A segment that notes the batch size of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(len(x))
        return x + 1


def test_a_warm_up_on_a_few_samples_then_the_whole_batch_timed() -> None:
    # A job's start pays for every forward a profile runs: the warm-up pays a segment's
    # first calls, which do not grow with the batch, so it runs on `warm` samples.
    segments = [_Batches() for _ in range(3)]
    heads = time_segments(segments, torch.zeros(8, 3), repeats=1, warm=2)
    assert len(heads) == 4 and all(b >= a for a, b in itertools.pairwise(heads))
    assert [s.batches for s in segments] == [[2, 8]] * 3


def test_decoding_warmed_on_a_few_objects() -> None:
    calls = itertools.count()
    blobs = [jpeg(40, 40, seed) for seed in range(5)]

    def counted(i: int, data: bytes) -> None:
        next(calls)
        load_sample(data, f"probe/{i}", Transforms.eval(32), i)

    assert time_per_item(counted, blobs, repeats=1, warm=2) > 0
    assert next(calls) == 2 + 5  # two to warm up, then each object once


def test_tails_timed_on_features_of_the_batchs_shape(resnet18: ModelGraph) -> None:
    # The features a tail is timed on come from one sample's head: a tail's cost is its
    # shapes', and the whole batch's head cost a job's start as much as the tail did.
    import hapi.plan.measure as measure

    features = measure._features(resnet18, FREEZE, torch.rand(3, *resnet18.input_shape))
    assert features.shape == (3, *resnet18.cut_point(FREEZE).shape)
    assert torch.equal(features[0], features[2])
