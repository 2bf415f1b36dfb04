"""Any PyTorch model through a real server: the user's own module with the user's weights.

The trainer exports the frozen head with torch.export and uploads it; the server runs that
program (loaded without pickle) and trains the same as local mode: within the stated fp32
tolerance per step by default, bit for bit with `exact=True`.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.client import TransferJob, connect
from hapi.data import open_store, synth_dataset
from hapi.errors import IntegrityError, InvalidRequest
from hapi.graph import INPUT, ModelSpec, build_model, export_head, trace
from hapi.graph.export import HeadArtifact
from hapi.server import HapiServer, serve

from ..graph_checks import NoisyAux

STEP_RTOL = STEP_ATOL = 1e-5
"""The README's fp32 tolerance per step, pushdown against local mode (`exact=False`)."""


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    # 24 images, 3 steps of 8: few, small and cheap; 6 steps take two epochs.
    synth_dataset(open_store(root), "train", classes=3, per_class=8, size=72, seed=5)
    return root


@pytest.fixture(scope="module")
def server(store_dir: Path) -> Iterator[HapiServer]:
    # A feature batch of 7 against training batches of 8: the head runs at other batch
    # sizes on the server than in the trainer.
    with serve(store=str(store_dir), batch_size=7) as running:
        yield running


def _job(server: HapiServer, model: object, size: int, **options: object) -> TransferJob:
    defaults: dict[str, object] = {
        "cut": None,  # the freeze point
        "image_size": size,
        "batch_size": 8,
        "chunk_size": 6,
        "prefetch": 2,
        "seed": 3,
    }
    defaults.update(options)
    return TransferJob(model, "train", server.address, **defaults)  # type: ignore[arg-type]


def _pushdown_and_local(
    server: HapiServer, build: object, size: int, epochs: int = 1, **options: object
) -> tuple[TransferJob, TransferJob]:
    """The same model trained twice from the same weights: pushdown, then local mode."""
    jobs = []
    for mode in ("pushdown", "local"):
        model = build() if callable(build) else build
        job = _job(server, model, size, mode=mode, **options)
        job.fit(epochs, lr=0.02)
        jobs.append(job)
    return jobs[0], jobs[1]


def _users_timm_resnet() -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(11)
    model = timm.create_model("resnet18", pretrained=False, num_classes=3)
    with torch.no_grad():  # weights the user set: not timm's init
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model.eval()


def _users_hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
        hidden_dropout_prob=0.1,
    )
    torch.manual_seed(12)
    model = transformers.ViTForImageClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model.eval()


def _close_per_step(pushdown: TransferJob, local: TransferJob) -> None:
    assert len(pushdown.history.losses) == len(local.history.losses) > 0
    torch.testing.assert_close(
        torch.tensor(pushdown.history.losses),
        torch.tensor(local.history.losses),
        rtol=STEP_RTOL,
        atol=STEP_ATOL,
    )


def test_a_users_timm_model_trains_through_the_server_at_a_block_cut(
    server: HapiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _users_timm_resnet()
    pushdown = _job(server, model, 48, freeze="layer3")
    assert pushdown.cut == pushdown.graph.resolve_cut("layer3")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was unpickled")

    # The server loads the head from JSON and safetensors: nothing may be unpickled.
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    pushdown.fit(1, lr=0.02)
    monkeypatch.undo()
    local = _job(server, _users_timm_resnet(), 48, freeze="layer3", mode="local")
    local.fit(1, lr=0.02)
    _close_per_step(pushdown, local)
    (epoch,) = pushdown.history.epochs
    assert epoch.chunks_pushed > 0 and epoch.chunks_local == 0
    # Only the tail trained: the user's frozen weights are as the user set them.
    before = _users_timm_resnet()
    for name, changed in (("layer2.0.conv1.weight", False), ("fc.weight", True)):
        assert torch.equal(model.get_parameter(name), before.get_parameter(name)) != changed


def test_a_hugging_face_vit_from_a_config_trains_cut_between_encoder_layers(
    server: HapiServer,
) -> None:
    pushdown, local = _pushdown_and_local(server, _users_hf_vit, 32, freeze="vit.layers.1")
    assert pushdown.graph.method == "export"
    assert pushdown.graph.cut_point(pushdown.cut).name == "vit.layers.1"
    _close_per_step(pushdown, local)


@pytest.mark.parametrize("name", ["convnext_tiny", "swin_t"])
def test_models_with_permuted_activations_train_pushed_down_at_avgpool(
    server: HapiServer, name: str
) -> None:
    spec = ModelSpec(name=name, num_classes=3)
    pushdown, local = _pushdown_and_local(server, spec, 32, freeze="avgpool")
    assert pushdown.graph.cut_point(pushdown.cut).name == "avgpool"
    assert pushdown.history.epochs[0].bytes_received > 24 * 768 * 4  # features, not bytes
    _close_per_step(pushdown, local)


def test_the_demo_model_keeps_drop_connect_in_training(server: HapiServer) -> None:
    spec = ModelSpec(name="efficientnet_lite0", weights="imagenet", num_classes=3)
    job = _job(server, spec, 64, freeze="_blocks.7")
    original = build_model(spec)
    x = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = job.graph.head(job.cut)(x)
    tail = job.tail.train()
    # The original in train mode, its frozen part in eval mode as the job runs it.
    original.train()
    for module in (original._conv_stem, original._bn0, *original._blocks[:8]):
        module.eval()
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = tail(features)
        torch.manual_seed(seed)
        with torch.no_grad():
            torch.testing.assert_close(out, original(x), rtol=0, atol=0)
        outputs.append(out)
    # Drop-connect draws other blocks to drop with another seed: training is random.
    assert not torch.equal(outputs[0], outputs[1])


def test_exact_runs_give_bit_identical_losses_in_every_plan(server: HapiServer) -> None:
    spec = ModelSpec(name="regnet_y_400mf", num_classes=3)
    options = {"freeze": "trunk_output.block2", "exact": True}
    local = _job(server, spec, 48, mode="local", **options)
    local.fit(2, lr=0.05)
    plans = [
        {},  # pushed down at the freeze point
        {"cut": "trunk_output.block1"},  # before it: the trainer runs the rest
        {"cut": "trunk_output.block1", "local_share": 0.5},  # some chunks computed locally
    ]
    for plan in plans:
        job = _job(server, spec, 48, **options, **plan)
        job.fit(2, lr=0.05)
        assert job.history.losses == local.history.losses, plan
    # The user's own module: the server runs the uploaded program, per sample.
    pushdown, local = _pushdown_and_local(
        server, _users_timm_resnet, 48, epochs=2, freeze="layer2", exact=True
    )
    assert pushdown.history.losses == local.history.losses


def test_default_runs_agree_per_step_to_the_stated_tolerance(server: HapiServer) -> None:
    # lr=0: every step starts from the same weights, so what differs is one step's work.
    spec = ModelSpec(name="regnet_y_400mf", num_classes=3)
    jobs = [
        _job(server, spec, 48, freeze="trunk_output.block2", mode=mode)
        for mode in ("pushdown", "local")
    ]
    for job in jobs:
        job.fit(2, lr=0.0)
    _close_per_step(*jobs)


def test_auto_plans_a_users_module_from_its_freeze_point_head(server: HapiServer) -> None:
    model = _users_timm_resnet()
    job = _job(server, model, 48, freeze="layer3", cut="auto", replan=False)
    plan = job.plan
    assert plan is not None and plan.freeze == job.freeze
    # The server timed the head it was sent, to the freeze point; every cut is weighed.
    assert server.uploads.has(export_head(job.graph, job.freeze).digest)
    assert len(plan.server.head_s) == job.freeze + 1
    assert all(plan.option(cut) is not None for cut in range(INPUT, job.freeze + 1))
    job.fit(1, lr=0.02)
    local = _job(server, _users_timm_resnet(), 48, freeze="layer3", mode="local")
    local.fit(1, lr=0.02)
    _close_per_step(job, local)


def _noisy_aux() -> NoisyAux:
    return NoisyAux(classes=3, seed=13)


def test_a_users_training_only_branches_train_through_the_server(server: HapiServer) -> None:
    aux_before = _noisy_aux().aux.weight.detach().clone()
    pushdown, local = _pushdown_and_local(server, _noisy_aux, 32, freeze="stem")
    model = pushdown.model
    # The auxiliary head runs in training only: it trained, so the tail ran the train graph.
    assert not torch.equal(model.aux.weight, aux_before)
    (epoch,) = pushdown.history.epochs
    assert epoch.chunks_pushed > 0 and epoch.chunks_local == 0
    _close_per_step(pushdown, local)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # a branch on a tensor's value: torch.export cannot follow it
            return x * 2
        return x


def _gated() -> nn.Module:
    pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return nn.Sequential(nn.Conv2d(3, 4, 3), Gate(), nn.ReLU(), pool, nn.Linear(4, 3))


def test_a_module_that_cannot_be_exported_fails_at_build_time_naming_its_line(
    server: HapiServer,
) -> None:
    with pytest.raises(InvalidRequest, match=r"cannot be exported .*\(if x\.mean\(\) > 0:"):
        _job(server, _gated(), 16, freeze=3)
    # Before the branch it exports; and local mode runs no head on the server at all.
    assert _job(server, _gated(), 16, freeze=3, cut=1).cut == 1
    assert _job(server, _gated(), 16, freeze=3, mode="local").cut < INPUT


def test_two_jobs_with_one_module_share_one_head_and_bad_uploads_are_refused(
    store_dir: Path,
) -> None:
    model = _users_timm_resnet()
    with serve(store=str(store_dir)) as fresh:
        first = _job(fresh, model, 48, freeze="layer2")
        second = _job(fresh, _users_timm_resnet(), 48, freeze="layer2")
        first.fit(1)
        stored = fresh.uploads.nbytes
        second.fit(1)
        stats = fresh.stats()
        assert stats.heads_cached == 1 and fresh.uploads.nbytes == stored > 0

        conn = connect(fresh.address)
        good = export_head(trace(_users_timm_resnet(), (3, 48, 48)), "layer1")
        lying = HeadArtifact(
            program=good.program, weights=good.weights[:-1] + b" ", input_shape=good.input_shape
        )
        object.__setattr__(lying, "digest", good.digest)  # bytes that do not match their name
        with pytest.raises(IntegrityError, match="does not match"):
            conn.put_head(lying)
        assert not conn.has_head(good.digest).present
        conn.put_head(good)
        assert conn.has_head(good.digest).present
