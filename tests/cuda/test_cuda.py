"""The CUDA paths: heads on the GPU, a tail trained on it, the server's CUDA memory accounting.

CI has no GPU: there these are skipped, naming why. Where one is, run them with
`python -m pytest tests/cuda -q -rs` (ResNet-18 at 64 px: 16 s on an H200). They hold the
GPU to what the CPU suite holds the CPU to: the same features and losses (within TF32's
tolerance where cuDNN and cuBLAS use it, bit for bit with `exact=True`), every key once,
and a server whose real allocations stay inside its memory budget.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hapi.client import Connection, TransferJob, connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.graph import ModelSpec, build_model, trace
from hapi.server import HapiServer, ServerConfig, serve
from hapi.server.memory.batch_memory import measure_head, measured_batches
from hapi.server.memory.budget import default_budget
from hapi.server.memory.limits import memory_limits
from hapi.wire import ActionType, ChunkTicket, SessionRequest
from hapi.wire.messages import ProfileRequest
from hapi.wire.replies import ProfileReply

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)"
)

SIZE = 64
SPEC = ModelSpec(name="resnet18", num_classes=3)
LAYER3, FREEZE = 10, 14  # resnet18's cuts after layer3 and before fc
GPU = "cuda"

# TF32 (cuDNN's default for convolutions on Ampere and later) keeps 10 bits of mantissa:
# a GPU's features agree with the CPU's to about 1e-2 (7e-3 at layer3 on an H200), not
# fp32's 1e-5. The tests of training turn it off (`fp32`) to hold hapi to fp32.
TF32 = {"rtol": 1e-2, "atol": 1e-2}
FP32 = {"rtol": 1e-4, "atol": 1e-4}

# cuBLAS is deterministic only with a fixed workspace, read when its handle is made.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=8, size=72, seed=11)
    return root


@pytest.fixture(scope="module")
def gpu_server(store_dir: Path) -> Iterator[HapiServer]:
    with serve(store=str(store_dir), device=GPU, batch_size=7) as running:
        yield running


@pytest.fixture(scope="module")
def cpu_server(store_dir: Path) -> Iterator[HapiServer]:
    with serve(store=str(store_dir), batch_size=7) as running:
        yield running


@pytest.fixture
def fp32() -> Iterator[None]:
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture
def deterministic(fp32: None) -> Iterator[None]:
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _request(cut: int = LAYER3, **overrides: object) -> SessionRequest:
    fields: dict[str, object] = {
        "model": SPEC.to_dict(),
        "cut": cut,
        "freeze": FREEZE,
        "transforms": Transforms.eval(SIZE).to_dict(),
        "image_size": SIZE,
    }
    fields.update(overrides)
    return SessionRequest(**fields)  # type: ignore[arg-type]


def _features(conn: Connection, session: str, keys: list[str]) -> tuple[torch.Tensor, int]:
    ticket = ChunkTicket(session=session, chunk=0, keys=keys, labels=[0] * len(keys))
    batches = [b.features for b in conn.fetch(ticket).batches if b.features is not None]
    return torch.cat(batches), len(batches)


def _job(server: HapiServer, **options: object) -> TransferJob:
    defaults: dict[str, object] = {
        "freeze": "layer3",
        "cut": None,
        "image_size": SIZE,
        "batch_size": 8,
        "chunk_size": 5,
        "prefetch": 2,
        "seed": 5,
        "replan": False,
    }
    defaults.update(options)
    return TransferJob(SPEC.to_dict(), "train", server.address, **defaults)


def _peak_since(base: int) -> int:
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_a_gpu_server_sends_the_features_a_cpu_server_does(
    gpu_server: HapiServer, cpu_server: HapiServer
) -> None:
    got: dict[str, torch.Tensor] = {}
    for name, server in (("gpu", gpu_server), ("cpu", cpu_server)):
        with connect(server.address) as conn:
            info = conn.open_session(_request())
            keys = list(conn.manifest("train").keys[:12])
            got[name], batches = _features(conn, info.session, keys)
            assert batches == 2 and info.memory_per_sample > 0
    assert got["gpu"].device.type == "cpu"  # features cross the wire, not device pointers
    torch.testing.assert_close(got["gpu"], got["cpu"], **TF32)
    print(f"gpu vs cpu features: max |diff| {(got['gpu'] - got['cpu']).abs().max():.2e}")


def test_a_gpu_servers_profile_times_its_heads_on_the_gpu(gpu_server: HapiServer) -> None:
    with connect(gpu_server.address) as conn:
        info = conn.open_session(_request(cut=5))
        keys = list(conn.manifest("train").keys[:4])
        request = ProfileRequest(session=info.session, keys=keys)
        reply = ProfileReply.model_validate_json(
            conn.action(ActionType.PROFILE, request.to_bytes())
        )
    assert reply.key.device.startswith("cuda")
    assert reply.head_s[0] == 0 and all(t > 0 for t in reply.head_s[1:])
    assert all(m > 0 for m in reply.memory_bytes)
    print("gpu head_s per cut:", [f"{t * 1e3:.2f} ms" for t in reply.head_s])


def test_the_head_measured_on_cuda_covers_what_its_batches_allocate() -> None:
    graph = trace(build_model(SPEC), (3, SIZE, SIZE))
    head = graph.head(LAYER3).eval().requires_grad_(False).to(GPU)
    out = 4 * graph.cut_point(LAYER3).numel
    batches = measured_batches(torch.device(GPU), 32)  # as a server of batch_size=32 does
    model = measure_head(head, graph.input_shape, torch.device(GPU), out_bytes=out, batches=batches)
    for batch in (2, 8, 24, 32):
        x = torch.rand(batch, *graph.input_shape, device=GPU)
        with torch.inference_mode():
            head(x)  # warm-up: cuDNN picks its algorithms and their workspaces
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            head(x)
            held = _peak_since(base) + x.numel() * 4
        mib = (held / 2**20, model.batch_bytes(batch) / 2**20)
        print(f"batch {batch}: allocated {mib[0]:.2f} MiB, the model {mib[1]:.2f} MiB")
        assert held <= model.batch_bytes(batch) <= 2.5 * held, (batch, held, model)


def test_a_gpu_server_keeps_its_real_allocations_inside_a_tight_budget(store_dir: Path) -> None:
    with (
        serve(ServerConfig(store=str(store_dir), device=GPU, batch_size=8)) as roomy,
        connect(roomy.address) as conn,
    ):
        info = conn.open_session(_request())
        keys = list(conn.manifest("train").keys[:16])
        expected, batches = _features(conn, info.session, keys)
        assert batches == 2
        held = conn.stats().memory_used  # the weights, on the GPU
    budget = held + info.memory_fixed + 2 * info.memory_per_sample + info.memory_per_sample // 2
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    config = ServerConfig(store=str(store_dir), device=GPU, batch_size=8, memory_budget=budget)
    with serve(config) as tight, connect(tight.address) as conn:
        info = conn.open_session(_request())
        got, batches = _features(conn, info.session, keys)
        stats = conn.stats()
        real = _peak_since(base)
        scraped = tight.metrics.render().decode()
    # The allocator's own counts, beside the scheduler's: every server in this process.
    assert stats.device_reserved is not None and stats.device_allocated is not None
    assert stats.device_reserved >= stats.device_allocated > 0
    assert 'hapi_device_memory_bytes{kind="allocated"}' in scraped
    print(f"tight budget {budget / 2**20:.1f} MiB: allocator peak {real / 2**20:.1f} MiB")
    # What the allocator really handed out - weights, inputs, activations, cuDNN's
    # workspaces - stayed inside the budget the server accounted against.
    assert real <= budget, f"allocated {real} bytes on a budget of {budget}"
    assert batches >= 8  # batches of 2 (or 1), not 8
    assert stats.memory_peak <= stats.memory_budget == budget
    torch.testing.assert_close(got, expected, **TF32)


def test_the_default_budget_on_a_gpu_is_most_of_its_free_memory_within_the_host() -> None:
    free, total = torch.cuda.mem_get_info()
    limits = memory_limits(GPU)
    device = next(limit for limit in limits if limit.what == GPU)
    assert device.budget <= 0.9 * free + (64 << 20) and device.budget >= 0.8 * free
    # Inputs are decoded in host memory: the host's (and a container's) limits bind too.
    host = min(limit.budget for limit in limits if limit.what != GPU)
    budget = default_budget(GPU)
    assert budget <= 0.9 * free + (64 << 20) and budget < total
    assert 0.8 * min(device.budget, host) <= budget <= 1.2 * min(device.budget, host)


def test_a_tail_trained_on_the_gpu_learns_what_the_cpu_does(
    cpu_server: HapiServer, fp32: None
) -> None:
    on_gpu = _job(cpu_server, cut="layer3", device=GPU)
    on_cpu = _job(cpu_server, cut="layer3")
    on_gpu.fit(2, lr=0.05)
    on_cpu.fit(2, lr=0.05)
    assert all(p.device.type == "cuda" for p in on_gpu.model.parameters())
    assert len(on_gpu.history.losses) == len(on_cpu.history.losses) == 6
    torch.testing.assert_close(
        torch.tensor(on_gpu.history.losses), torch.tensor(on_cpu.history.losses), **FP32
    )
    assert all(e.samples == 24 for e in on_gpu.history.epochs)


def test_a_hybrid_on_gpu_tiers_computes_local_chunks_on_the_trainers_gpu(
    gpu_server: HapiServer, fp32: None
) -> None:
    pushdown = _job(gpu_server, cut="layer3", device=GPU)
    hybrid = _job(gpu_server, cut="layer3", local_share=0.5, device=GPU)
    pushdown.fit(2, lr=0.05)
    hybrid.fit(2, lr=0.05)
    for epoch in hybrid.history.epochs:
        assert epoch.samples == 24 and (epoch.chunks_local, epoch.chunks_pushed) == (3, 2)
    torch.testing.assert_close(
        torch.tensor(hybrid.history.losses), torch.tensor(pushdown.history.losses), **FP32
    )


def test_exact_jobs_on_gpu_tiers_train_bit_for_bit_alike(
    gpu_server: HapiServer, deterministic: None
) -> None:
    # Bit for bit needs the GPU's deterministic kernels too: by default cuDNN's backward
    # sums in any order (losses 6e-4 apart after three steps on an H200).
    pushdown = _job(gpu_server, cut="layer3", device=GPU, exact=True)
    local = _job(gpu_server, mode="local", device=GPU, exact=True)
    hybrid = _job(gpu_server, cut="layer2", local_share=0.5, device=GPU, exact=True)
    for job in (pushdown, local, hybrid):
        job.fit(2, lr=0.05)
    assert len(local.history.losses) == 6
    assert pushdown.history.losses == local.history.losses == hybrid.history.losses


def test_an_automatic_plan_between_gpu_tiers_measures_both_and_trains(
    gpu_server: HapiServer,
) -> None:
    job = _job(gpu_server, cut="auto", freeze=None, device=GPU)
    plan = job.plan
    assert plan is not None and plan.server.key is not None
    assert plan.server.key.device.startswith("cuda")
    assert plan.trainer.device.startswith("cuda")
    (epoch,) = job.fit(1, lr=0.05).epochs
    assert epoch.samples == 24 and epoch.server_s > 0 and epoch.trainer_s > 0
    assert all(torch.isfinite(torch.tensor(job.history.losses)))
    print(plan.explain())
