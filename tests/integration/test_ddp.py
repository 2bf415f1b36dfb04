"""Two data-parallel ranks (torchrun, gloo) train what one process with their combined
batch trains, each key once per epoch, against one real server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hapi
from hapi.client import TransferJob, connect
from hapi.data import open_store, synth_dataset
from hapi.server import HapiServer, serve

from ._ddp_rank import BATCH, LR, MODEL, OPTIONS, served_samples

RANK_SCRIPT = Path(__file__).with_name("_ddp_rank.py")
SAMPLES = 33  # 4 global batches of 2 x 4, and one of 1: the second rank's last slice is empty
EPOCHS = 2
STEPS = EPOCHS * -(-SAMPLES // (2 * BATCH))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=3, per_class=11, size=72, seed=8)
    with serve(store=str(root), batch_size=3) as running:
        yield running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(address: str, out: Path) -> list[dict[str, object]]:
    """Run two ranks of `_ddp_rank.py` on this machine; what each wrote."""
    env = dict(os.environ)
    src = str(Path(hapi.__file__).resolve().parents[1])
    tests = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, tests, env.get("PYTHONPATH", "")])
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over loopback only
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(RANK_SCRIPT),
        address,
        str(out),
    ]
    # A guard against a hang, not a measurement: the run takes well under a minute.
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_two_ranks_train_as_one_process_with_the_combined_batch(
    server: HapiServer, tmp_path: Path
) -> None:
    before = served_samples(server.address)
    ranks = _torchrun(server.address, tmp_path)

    single = TransferJob(MODEL, "train", server.address, **{**OPTIONS, "batch_size": 2 * BATCH})
    single.fit(EPOCHS, lr=LR)
    evaluation = single.evaluate()

    # Each epoch the shards are disjoint and together the dataset, once.
    keys = set(connect(server.address).manifest("train").keys)
    assert len(keys) == SAMPLES
    for epoch in range(EPOCHS):
        a, b = (r["keys"][epoch] for r in ranks)  # type: ignore[index]
        assert len(a) == len(set(a)) and len(b) == len(set(b))
        assert not set(a) & set(b)
        assert set(a) | set(b) == keys
        assert (len(a), len(b)) == (17, 16)  # the short global batch's one key is rank 0's
    # The server's own count: the job's two ranks together were sent each key once per
    # epoch and once for the evaluation.
    r0, r1 = ranks
    assert r0["served"] - before == (EPOCHS + 1) * SAMPLES  # type: ignore[operator]

    # Every rank's history is the global one; both ranks hold the same model.
    assert r0["losses"] == r1["losses"] and r0["epochs"] == r1["epochs"]
    assert r0["eval"] == r1["eval"]
    for name, weight in r0["tail"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(weight, r1["tail"][name], rtol=0, atol=0)  # type: ignore[index]
    # The rank-0 plan is every rank's (its reason quotes measured rates).
    assert r0["plan"] == r1["plan"]

    # The same losses and weights as one process with the combined batch: features are
    # bit for bit (exact=True); the tail sums in another order (two slices all-reduced),
    # a difference of 1e-7 relative per step that momentum SGD carries over 10 steps.
    assert len(r0["losses"]) == len(single.history.losses) == STEPS  # type: ignore[arg-type]
    torch.testing.assert_close(
        torch.tensor(r0["losses"]), torch.tensor(single.history.losses), rtol=1e-5, atol=1e-5
    )
    for name, weight in single.tail.state_dict().items():
        torch.testing.assert_close(r0["tail"][name], weight, rtol=1e-5, atol=1e-5, msg=name)  # type: ignore[index]
    for mine, theirs in zip(r0["epochs"], single.history.epochs, strict=True):  # type: ignore[call-overload]
        assert mine[2] == theirs.samples == SAMPLES
        assert mine[1] == pytest.approx(theirs.accuracy)
        assert mine[0] == pytest.approx(theirs.loss, rel=1e-5, abs=1e-5)
    accuracy, loss, samples = r0["eval"]  # type: ignore[misc]
    assert samples == evaluation.samples == SAMPLES
    assert accuracy == pytest.approx(evaluation.accuracy)
    assert loss == pytest.approx(evaluation.loss, rel=1e-4, abs=1e-5)

    # A job stopped mid-epoch and resumed from each rank's own state trains on as if
    # never stopped.
    assert r0["resumed_losses"] == r1["resumed_losses"]
    torch.testing.assert_close(
        torch.tensor(r0["resumed_losses"]), torch.tensor(r0["losses"]), rtol=0, atol=0
    )
    for name, weight in r0["tail"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(r0["resumed_tail"][name], weight, rtol=0, atol=0)  # type: ignore[index]
