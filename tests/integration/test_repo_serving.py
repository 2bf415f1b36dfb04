"""The server and the trainer on a model repository: heads shared by content, lineage kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.client import Connection, TransferJob, connect
from hapi.data import Transforms, load_sample, open_store, sample_seed, synth_dataset
from hapi.errors import IntegrityError, RefNotFound, UnknownModel
from hapi.graph import ModelSpec, build_model, trace
from hapi.repo import ModelRepo
from hapi.repo.storage.layout import tensor_key
from hapi.server import HapiServer, serve
from hapi.wire import ChunkTicket, SessionRequest

SIZE = 64
SHAPE = (3, SIZE, SIZE)
SPEC = ModelSpec(name="resnet18", num_classes=3)
EVAL = Transforms.eval(SIZE)


def _cut(name: str) -> int:
    graph = trace(build_model(SPEC), SHAPE)
    return next(p.index for p in graph.cut_points if p.name == name)


def _nudged(model: nn.Module, *prefixes: str) -> nn.Module:
    """A copy of `model` whose parameters under `prefixes` changed, as fine-tuning does."""
    derived = build_model(SPEC)
    derived.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in derived.named_parameters():
            if name.startswith(prefixes):
                p.add_(0.01)
    return derived


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    repo = ModelRepo.open(root)
    base = build_model(SPEC)
    repo.push(base, "base", spec=SPEC)
    repo.push(_nudged(base, "fc"), "ft-fc", parent="base", spec=SPEC)
    repo.push(_nudged(base, "layer4", "fc"), "ft-layer4", parent="base", spec=SPEC)
    return root


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    store = open_store(root)
    synth_dataset(store, "train", classes=3, per_class=4, size=80, seed=1)
    return root


@pytest.fixture(scope="module")
def server(store_dir: Path, repo_dir: Path) -> Iterator[HapiServer]:
    with serve(store=str(store_dir), repo=str(repo_dir), batch_size=5) as running:
        yield running


@pytest.fixture
def conn(server: HapiServer) -> Iterator[Connection]:
    with connect(server.address) as c:
        yield c


def _request(model: str, cut: int, freeze: int | None = None) -> SessionRequest:
    return SessionRequest(
        model=model,
        cut=cut,
        freeze=cut if freeze is None else freeze,
        transforms=EVAL.to_dict(),
        image_size=SIZE,
    )


def test_sessions_of_models_from_one_base_share_heads_below_their_changes(
    server: HapiServer, conn: Connection
) -> None:
    before = len(server.heads)
    layer3, layer4 = _cut("layer3"), _cut("layer4")
    for ref in ("repo://base", "ft-fc@1", "repo://ft-layer4"):
        conn.open_session(_request(ref, layer3))
    # Below layer4 the three versions hold the same tensors: one head in memory.
    assert len(server.heads) == before + 1
    for ref in ("base", "repo://ft-fc", "repo://ft-layer4"):
        conn.open_session(_request(f"repo://{ref.removeprefix('repo://')}", layer4))
    # ft-fc still shares the base's layer4; ft-layer4 changed it.
    assert len(server.heads) == before + 3
    assert conn.stats().heads_cached == len(server.heads)


def test_features_of_a_repo_model_are_its_head(
    conn: Connection, store_dir: Path, repo_dir: Path
) -> None:
    cut = _cut("layer4")
    info = conn.open_session(_request("ft-layer4@1", cut))
    keys = list(conn.manifest("train").keys[:6])
    result = conn.fetch(
        ChunkTicket(session=info.session, chunk=0, keys=keys, labels=[0] * len(keys))
    )
    got = torch.cat([b.features for b in result.batches if b.features is not None])
    model = build_model(SPEC)
    ModelRepo.open(repo_dir).load_into(model, "ft-layer4")
    store = open_store(store_dir)
    x = torch.stack([load_sample(store.get(k), k, EVAL, sample_seed(0, 0, k)) for k in keys])
    with torch.inference_mode():
        expected = trace(model, SHAPE).head(cut)(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_session_reads_only_the_heads_tensors(tmp_path: Path, store_dir: Path) -> None:
    repo = ModelRepo.open(tmp_path / "repo")
    pushed = repo.push(build_model(SPEC), "only-head", spec=SPEC)
    # Break the classifier's blob: a head that stops before it never reads it.
    fc = repo.manifest(pushed.ref).tensors["fc.weight"].hash
    repo.store.put(tensor_key(fc), b"truncated")
    with (
        serve(store=str(store_dir), repo=str(tmp_path / "repo")) as server,
        connect(server.address) as conn,
    ):
        num_cuts = conn.open_session(_request("repo://only-head", _cut("layer4"))).num_cuts
        with pytest.raises(IntegrityError, match="fc.weight"):
            conn.open_session(_request("repo://only-head", num_cuts))
        # The failed open hurt nobody: the server goes on.
        assert conn.open_session(_request("repo://only-head", 1)).cut == 1


def test_bad_references_get_clear_errors(conn: Connection, store_dir: Path) -> None:
    with pytest.raises(RefNotFound, match="no model 'repo://bsae'.*did you mean base"):
        conn.open_session(_request("repo://bsae", 2))
    with pytest.raises(RefNotFound, match="base has versions 1"):
        conn.open_session(_request("base@7", 2))
    with (
        serve(store=str(store_dir)) as bare,
        connect(bare.address) as other,
        pytest.raises(UnknownModel, match="--repo"),
    ):
        other.open_session(_request("repo://base", 2))


def test_a_job_from_the_repo_trains_like_local_and_pushes_its_model_with_lineage(
    server: HapiServer, repo_dir: Path
) -> None:
    options = {"repo": str(repo_dir), "freeze": "layer3", "image_size": SIZE, "batch_size": 4}
    push = TransferJob("repo://base", "train", server.address, seed=3, **options)
    local = TransferJob("repo://base", "train", server.address, seed=3, mode="local", **options)
    repo = ModelRepo.open(repo_dir)
    base = repo.resolve("base")
    assert push.base is not None and push.base.id == base.id
    push.fit(1, lr=0.05)
    local.fit(1, lr=0.05)
    torch.testing.assert_close(
        torch.tensor(push.history.losses), torch.tensor(local.history.losses), rtol=1e-4, atol=1e-4
    )

    pushed = push.push("base-tuned", tags=["test"])
    assert pushed.parent == base.id
    assert pushed.metrics["train_loss"] == pytest.approx(push.history.epochs[-1].loss)
    # Only what training changed went up: layer4 and fc, not the frozen front.
    assert 0 < pushed.uploaded_bytes < base.nbytes * 0.8
    changed = repo.diff("base", "base-tuned")
    assert changed.changed and all(k.startswith(("layer4", "fc")) for k in changed.changed)
    state = repo.pull("base-tuned")
    for name, tensor in push.model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert [v.id for v in repo.ancestors("base-tuned")] == [base.id]


def test_a_job_can_replace_the_classifier_of_a_repo_model(
    server: HapiServer, repo_dir: Path
) -> None:
    job = TransferJob(
        "repo://ft-layer4",
        "train",
        server.address,
        repo=str(repo_dir),
        num_classes=5,
        freeze="layer4",
        image_size=SIZE,
    )
    state = ModelRepo.open(repo_dir).pull("ft-layer4")
    own = job.model.state_dict()
    assert own["fc.weight"].shape == (5, 512)
    assert all(torch.equal(own[k], v) for k, v in state.items() if not k.startswith("fc."))
    assert job.spec.num_classes == 5
