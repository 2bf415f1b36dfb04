"""The tenants benchmark's jobs: each a trainer process of its own, run side by side."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_SCRIPT = Path(__file__).with_name("tenants.py")  # each job runs `tenants.py --job`


def _job_spec(
    args: argparse.Namespace,
    address: str,
    token: str,
    tenant: str,
    start: float,
    seconds: float,
    warmup: float,
) -> dict[str, Any]:
    return {
        "address": address,
        "token": token,
        "tenant": tenant,
        "model": args.model,
        "freeze": args.freeze,
        "image_size": args.image_size,
        "chunk": args.chunk,
        "in_flight": args.in_flight,
        "start": start,
        "warmup": warmup,
        "seconds": seconds,
    }


def _run_jobs(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cores = _cores()
    procs = [
        subprocess.Popen(
            [
                "taskset",
                "-c",
                str(cores[-1]),
                sys.executable,
                str(Path(__file__).with_name("tenants.py")),
                "--job",
                json.dumps(job),
            ],
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for job in jobs
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        lines = out.decode().strip().splitlines()
        if proc.returncode or not lines:  # its traceback went to stderr, above
            raise RuntimeError(f"a job exited with {proc.returncode} and no result")
        results.append(json.loads(lines[-1]))
    return results


def _job(spec: dict[str, Any]) -> None:
    """One job: open a session, stream chunks `in_flight` at a time, count what arrives."""
    from hapi.client import connect
    from hapi.data import Transforms
    from hapi.graph import ModelSpec
    from hapi.wire import ChunkTicket, SessionRequest

    counted = [0]
    batches: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    conn = connect(spec["address"], token=spec["token"], timeout=120)
    keys = list(conn.manifest("train").keys)
    request = SessionRequest(
        model=ModelSpec(name=spec["model"], num_classes=4).to_dict(),
        cut=0,
        freeze=spec["freeze"],
        transforms=Transforms.eval(spec["image_size"]).to_dict(),
        image_size=spec["image_size"],
    )
    info = conn.open_session(request)
    info = conn.open_session(request.model_copy(update={"cut": info.freeze}))
    time.sleep(max(spec["start"] - time.time(), 0))
    begin = time.time() + spec["warmup"]
    end = begin + spec["seconds"]
    chunks = iter(range(1 << 30))

    def worker() -> None:
        while time.time() < end:
            with lock:
                n = next(chunks)
            start = (n * spec["chunk"]) % len(keys)
            part = (keys + keys)[start : start + spec["chunk"]]
            ticket = ChunkTicket(
                session=info.session, chunk=n, epoch=0, keys=part, labels=[0] * len(part)
            )
            try:
                for piece in conn.stream(ticket):
                    now = time.time()
                    if piece.batch is not None and begin <= now < end:
                        with lock:
                            counted[0] += len(piece.batch.keys)
                            batches.append(len(piece.batch.keys))
            except Exception as exc:
                with lock:
                    errors.append(type(exc).__name__)
                time.sleep(0.5)

    threads = [threading.Thread(target=worker) for _ in range(spec["in_flight"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with contextlib.suppress(Exception):
        conn.close_session(info.session)
    print(
        json.dumps(
            {
                "tenant": spec["tenant"],
                "samples_per_s": counted[0] / spec["seconds"],
                "errors": len(errors),
                "error_kinds": sorted(set(errors)),
                "batches": len(batches),
                "memory_per_sample": info.memory_per_sample,
                "memory_fixed": info.memory_fixed,
            }
        ),
        flush=True,
    )


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))
