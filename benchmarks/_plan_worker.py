"""The planner benchmark's trainer process: plan, or run each option (and the auto job) for real."""

from __future__ import annotations

import json
import time

PREFETCH = 4
"""Chunks in flight per route: the loader's default (`JobConfig.prefetch`). Sweeps before
2026-11-27 ran 3."""
CONFIGS = {"vit": ("vit_b_16", {"image_size": "IMAGE_SIZE"})}
"""Models built with options: torchvision's ViT takes its input size (IMAGE_SIZE: the
job's image size)."""


def _worker(spec: dict) -> None:
    """In the trainer's process: plan, or run each option (and the auto job) for real."""
    import torch

    from hapi.client import Connection, TransferJob, connect

    torch.set_num_threads(1)
    if spec.get("ping"):
        connect(spec["address"], timeout=2).stats()
        print(json.dumps({"ok": True}))
        return
    common = {
        "freeze": spec["freeze"],
        "image_size": spec.get("image_size", 112),
        "batch_size": spec.get("batch_size", 32),
        "chunk_size": spec.get("chunk_size", 16),
        "prefetch": spec.get("prefetch", PREFETCH),
        "retry_budget_s": 10,
        # Every job plans cold, from its own measurements: kept profiles are keyed by the
        # server's address, not the link's rate, so a sweep's next rate would plan from
        # the last rate's link (what a warm start costs is `startup.py`'s to measure).
        "reuse_profiles": False,
    }
    model = _spec(
        spec.get("model", "resnet18"), spec.get("image_size", 112), spec.get("classes", 4)
    )
    dataset = spec.get("dataset", "train")

    def server() -> Connection:
        """A job's own connection, with the receive window the spec names (`--window`;
        `window.py` runs jobs under two side by side)."""
        return connect(spec["address"], receive_window=spec.get("window", "grpc"))

    if spec.get("plan_only"):
        job = TransferJob(model, dataset, server(), replan=False, **common)
        assert job.plan is not None
        print(json.dumps({"plan": job.plan.to_dict()}))
        return
    chunks: list[dict] = []
    if spec.get("trace"):
        _trace_chunks(chunks)
    runs = []
    # Each option a fixed (cut, share), or "auto": a job that plans and re-plans itself.
    jobs = [
        ("auto", {}) if o == "auto" else (f"{o[0]}:{o[1]}", {"cut": int(o[0]), "local_share": o[1]})
        for o in spec["options"]
    ]
    for label, options in jobs:
        job = TransferJob(model, dataset, server(), **common, **options)
        planned = job.plan.to_dict() if job.plan is not None else None
        epochs = spec.get("epochs", 3)
        at = measured_epoch(epochs)
        progress = _signal_change(job, at, spec["change_at"]) if "change_at" in spec else None
        job.fit(epochs, lr=0.01, progress=progress)
        last = job.history.epochs[at]
        runs.append(
            {
                "label": label,
                "cut": last.cut,
                "share": last.share,
                "epoch_s": last.seconds,
                "server_s": last.server_s,
                "transfer_s": last.transfer_s,
                "trainer_s": last.trainer_s,
                "binding": last.binding,
                "bytes": last.bytes_received,
                "wait_s": last.wait_s,
                "chunks_local": last.chunks_local,
                "changes": [e.message for e in job.history.plan_changes if e.epoch == at],
                # Every epoch's: a job that re-planned in the first epoch runs the last
                # at what it chose, and the figures alone do not say why.
                "all_changes": [f"epoch {e.epoch}: {e.message}" for e in job.history.plan_changes],
                "reroutes": len([e for e in job.history.reroutes if e.epoch == at]),
                "recalls": len([e for e in job.history.recalls if e.epoch == at]),
                "plan": planned,
                "chunks": chunks[:],
            }
        )
        chunks.clear()
    print(json.dumps({"runs": runs}))


def _trace_chunks(into: list[dict]) -> None:
    """Record every measurement the router hears: a chunk's read (samples, bytes, server
    and link seconds) and, later, its training (trainer seconds), a row each."""
    import dataclasses

    from hapi.client.planning.in_force import PlanInForce
    from hapi.plan import ReadMeasurement

    observe = PlanInForce._observe
    started = time.perf_counter()

    def traced(self, served, measured):  # type: ignore[no-untyped-def]
        row = {
            "t": round(time.perf_counter() - started, 3),
            "stage": "read" if isinstance(measured, ReadMeasurement) else "trained",
            **dataclasses.asdict(measured),
        }
        for at in ("issued", "read_end"):
            if row.get(at) is not None:
                row[at] = round(row[at] - started, 3)
        into.append(row)
        observe(self, served, measured)
        replanner = self._replanner
        if replanner is not None:
            # What the re-planner believes after it: a misread shows where it came from.
            row["scales"] = {k: round(v, 3) for k, v in replanner.scales().items()}

    PlanInForce._observe = traced  # type: ignore[method-assign]

    from hapi.client.pipeline.fetch import Fetcher

    fetch = Fetcher.fetch

    def traced_fetch(self, flow):  # type: ignore[no-untyped-def]
        fetch(self, flow)
        into.append(
            {
                "flow": flow.index,
                "epoch": self.epoch,
                "local": flow.route.local,
                "issued": round(flow.issued - started, 3),
                "turn": flow.turn and round(flow.turn - started, 3),
                "end": round(flow.read_end - started, 3),
                "server_s": flow.server_s,
                "queue_s": flow.queue_s,
                "bytes": flow.bytes,
                "link_s": flow.link_s,
            }
        )

    Fetcher.fetch = traced_fetch  # type: ignore[method-assign]


def _spec(model: str, image_size: int, classes: int) -> dict:
    """The job's model: a torchvision name, or one of `CONFIGS` with its options."""
    name, options = CONFIGS.get(model, (model, None))
    config: dict[str, object] | None = None
    if options is not None:
        config = {k: image_size if v == "IMAGE_SIZE" else v for k, v in options.items()}
    return {"name": name, "num_classes": classes, "config": config}


def measured_epoch(epochs: int) -> int:
    """The epoch of a job's `epochs` that is measured. Of 3 or more, the one before the
    last: it was fetched while the one before it drained and fetches the next while it
    drains, as every epoch of a long fit does (the first has no epoch to fill behind, and
    the first of the job also opens its sessions; the last has no next epoch to pay for).
    Of 2, the last; of 1, that one."""
    return epochs - 2 if epochs >= 3 else epochs - 1


def _signal_change(job, epoch: int, at: float):  # type: ignore[no-untyped-def]
    """A progress callback that tells the parent to change the link, once, in the middle
    of `epoch`."""
    step_at = max(1, int(job.batches_per_epoch() * at))

    def progress(step: int, total: int) -> None:
        if len(job.history.epochs) == epoch and step == step_at:
            print("CHANGE", flush=True)

    return progress
