"""`hapi train` as a user runs it: a real server on loopback, generated images, a model file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model

from hapi.cli.train_run import SPEC_KEY
from hapi.data import open_store, synth_dataset
from hapi.graph import ModelSpec, build_model
from hapi.server import ServerConfig, serve

from ..cli_runner import hapi

SMALL = ["--image-size", "64", "--batch-size", "4", "--num-classes", "2", "--freeze", "layer4"]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of generated images: train and val, two classes."""
    root = tmp_path_factory.mktemp("images")
    store = open_store(root)
    synth_dataset(store, "train", classes=2, per_class=4, size=72, seed=1)
    synth_dataset(store, "val", classes=2, per_class=2, size=72, seed=2)
    return root


@pytest.fixture(scope="module")
def server(images: Path) -> Iterator[str]:
    """A hapi server on 127.0.0.1 over `images`."""
    with serve(ServerConfig(store=str(images))) as running:
        yield running.address


def test_train_writes_a_model_that_loads(server: str, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    done = hapi(
        "train", "resnet18", "--dataset", "train", "--server", server, "--epochs", "2",
        *SMALL, "--eval-dataset", "val", "--out", str(out),
    )  # fmt: skip
    assert done.code == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "layer4" in text and "plan" in text  # the freeze point and the plan's reason
    assert "epoch 1: loss" in text and "epoch 2: loss" in text
    assert "summary" in text and "eval accuracy" in text and str(out) in text
    with safe_open(str(out), "pt") as f:
        spec = ModelSpec.from_dict(json.loads(f.metadata()[SPEC_KEY]))
    assert spec.name == "resnet18" and spec.num_classes == 2
    model = build_model(spec)
    fresh = model.fc.weight.detach().clone()
    missing, unexpected = load_model(model, str(out))
    assert not missing and not unexpected
    # The classifier trained; the frozen layers are the base's.
    assert not torch.equal(model.fc.weight, fresh)
    assert torch.equal(model.conv1.weight, build_model(spec).conv1.weight)


def test_a_job_file_with_the_command_line_over_it(server: str, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    out = tmp_path / "from-file.safetensors"
    job.write_text(
        f'model = "resnet18"\ndataset = "train"\nserver = "{server}"\nepochs = 3\n'
        f'image-size = 64\nbatch_size = 4\nnum_classes = 2\nfreeze = "layer4"\ncut = "freeze"\n'
        f'out = "{out}"\n'
    )
    done = hapi("train", "--config", str(job), "--epochs", "1")
    assert done.code == 0, done.stderr
    assert "epoch 1: loss" in done.stdout and "epoch 2:" not in done.stdout
    assert out.exists()


def test_no_augment_trains_later_epochs_from_the_trainers_cache(
    server: str, tmp_path: Path
) -> None:
    done = hapi(
        "train", "resnet18", "--dataset", "train", "--server", server, "--epochs", "2",
        *SMALL, "--cut", "freeze", "--no-augment", "--cache-dir", str(tmp_path / "cache"),
        "--plot", str(tmp_path / "run.png"),
    )  # fmt: skip
    assert done.code == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "cacheable: the transforms are deterministic" in text
    assert (
        "epoch 2:" in text and "8 from the trainer's cache, 0 from the server's, 0 computed" in text
    )
    assert "wrote the run's picture to" in text
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_push_to_a_repository(server: str, images: Path, tmp_path: Path) -> None:
    from hapi.repo import ModelRepo

    repo = tmp_path / "repo"
    done = hapi(
        "train", "resnet18", "--dataset", "train", "--server", server, "--epochs", "1",
        *SMALL, "--cut", "freeze", "--push", "tuned", "--repo", str(repo),
    )  # fmt: skip
    assert done.code == 0, done.stderr
    assert "tuned@1" in done.stdout
    tuned = ModelRepo.open(str(repo)).resolve("tuned")
    assert tuned.metrics["train_loss"] > 0
    # MODEL may be a repository reference: the next fine-tune starts from the pushed one,
    # on a server that reads the same repository.
    with serve(ServerConfig(store=str(images), repo=str(repo))) as beside:
        again = hapi(
            "train", "repo://tuned", "--repo", str(repo), "--dataset", "train",
            "--server", beside.address, "--epochs", "1", *SMALL[:4], "--cut", "freeze",
            "--push", "tuned-again",
        )  # fmt: skip
    assert again.code == 0, again.stderr
    assert ModelRepo.open(str(repo)).resolve("tuned-again").parent == tuned.id


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "0"], "epochs must be an integer >= 1, got 0"),
        (["--out", "model.pt"], "must end in .safetensors"),
        (["--push", "x"], "needs a repository: add --repo"),
    ],
)
def test_a_bad_option_is_one_line(args: list[str], message: str) -> None:
    done = hapi("train", "resnet18", "--dataset", "train", "--server", "grpc://x:1", *args)
    assert done.code == 1
    assert message in done.error


def test_a_missing_option_and_a_bad_job_file_are_one_line(tmp_path: Path) -> None:
    missing = hapi("train", "resnet18", "--server", "grpc://x:1")
    assert missing.code == 1 and "no dataset given" in missing.error
    job = tmp_path / "job.toml"
    job.write_text('model = "resnet18"\nepoch = 3\n')
    bad = hapi("train", "--config", str(job))
    assert bad.code == 1 and "unknown key(s) epoch" in bad.error
    job.write_text("model = \n")
    assert "is not valid TOML" in hapi("train", "--config", str(job)).error
