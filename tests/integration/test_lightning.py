"""Lightning trains on hapi's features through `HapiDataModule`: two epochs, a checkpoint
taken mid-epoch resumed with every key once, alone and as two DDP ranks on the CPU."""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hapi
from hapi.data import open_store, synth_dataset
from hapi.errors import InvalidRequest
from hapi.server import HapiServer, serve

from ._lightning_run import fit

SAMPLES = 20
SCRIPT = Path(__file__).with_name("_lightning_run.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HapiServer]:
    root = tmp_path_factory.mktemp("store")
    store = open_store(root)
    synth_dataset(store, "train", classes=2, per_class=SAMPLES // 2, size=40, seed=3)
    synth_dataset(store, "val", classes=2, per_class=3, size=40, seed=4)
    with serve(store=str(root)) as running:
        yield running


def _names(server: HapiServer) -> Counter[str]:
    return Counter(hapi.connect(server.address).manifest("train").keys)


def _per_epoch(ranks: list[dict[str, Any]], checkpoint_step: int) -> dict[int, Counter[str]]:
    """Keys trained per epoch: phase 1's up to the checkpoint, then phase 2's."""
    epochs: dict[int, Counter[str]] = {}
    for seen in ranks:
        kept = [t for t in seen["phase1"] if t[1] < checkpoint_step] + seen["phase2"]
        for epoch, _, keys in kept:
            epochs.setdefault(epoch, Counter()).update(keys)
    return epochs


@pytest.mark.parametrize(
    ("workers", "steps", "checkpoint"),
    [
        (0, 10, 6),  # 5 batches an epoch: step 6 is one batch into epoch 2
        (2, 12, 9),  # 3 a worker: step 9 is three batches into epoch 2, two of worker 0's
    ],
)
def test_a_trainer_fits_and_resumes_a_checkpoint_from_mid_epoch(
    server: HapiServer, tmp_path: Path, workers: int, steps: int, checkpoint: int
) -> None:
    seen = fit(
        server.address, tmp_path, devices=1, stop_step=checkpoint + 1, every=3, workers=workers
    )
    assert [t[1] for t in seen["phase1"]] == list(range(checkpoint + 1))
    names = _names(server)
    assert _per_epoch([seen], checkpoint) == {0: names, 1: names}  # each key once an epoch
    # It went on from the checkpoint, not over.
    assert [t[1] for t in seen["phase2"]] == list(range(checkpoint, steps))
    # hapi's figures of each epoch went to the Trainer's logger.
    with open(Path(seen["log_dir"]) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("hapi/bytes_received")]
    assert len(rows) == 1  # phase 2 finished epoch 2 (from its checkpoint)
    assert float(rows[0]["hapi/samples_computed"]) + float(rows[0]["hapi/samples_cached"]) > 0
    assert float(rows[0]["hapi/cut"]) >= 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_ddp_ranks_share_each_epoch_and_resume_mid_epoch(
    server: HapiServer, tmp_path: Path
) -> None:
    env = dict(os.environ)
    src = str(Path(hapi.__file__).resolve().parents[1])
    tests = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, tests, env.get("PYTHONPATH", "")])
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over loopback only
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"):
        env.pop(name, None)
    # 3 batches a rank an epoch (20 samples, 4 a rank a step): the checkpoint at step 4
    # is one batch into epoch 2; stop at 5.
    command = [sys.executable, str(SCRIPT), server.address, str(tmp_path), "2", "5", "2"]
    # A guard against a hang, not a measurement.
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    names = _names(server)
    assert _per_epoch(ranks, 4) == {0: names, 1: names}
    mine = [Counter(k for t in r["phase1"] if t[0] == 0 for k in t[2]) for r in ranks]
    assert not set(mine[0]) & set(mine[1])  # the ranks read disjoint shares


def test_a_missing_or_old_lightning_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning

    from hapi import lightning as hapi_lightning

    monkeypatch.setattr(lightning, "__version__", "2.1.4")
    with pytest.raises(InvalidRequest, match=r"lightning >= 2.2 .* found 2.1.4: pip install -U"):
        hapi_lightning._lightning()
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if not installed
    with pytest.raises(InvalidRequest, match=r"pip install 'hapi\[lightning\]'"):
        hapi_lightning._lightning()
