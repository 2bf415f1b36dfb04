"""The server's memory beside its budget: what jobs hold outside it, and a cap that holds.

`hapi serve` runs in a memory cgroup this script makes and removes (cgroup v1's
`memory.limit_in_bytes`, or v2's `memory.max`; run as root), pinned to one core with one
torch thread and a `--memory-budget`; N jobs - `TransferJob` processes, their cuts in turn
`"auto"` (the job plans: the `profile` action, a link probe), ResNet-18's `relu` (the
largest features), INPUT and RAW, four chunks in flight each - train against it at the
same moment. Two phases:

- `measure`: no cap. The server's charge once it is warm and idle (one job has run, no
  session is open), less the heads it keeps cached (they are in the budget); then the
  peak charge under N jobs, less the scheduler's peak (what the budget counted at most),
  gives what the jobs held outside the budget: `per_job = (peak - idle - scheduler's
  peak) / N`, at its most over samples taken every 0.2 s.
- `capped`: a new server in a group capped by the operator's rule, `cap = idle + budget
  + 8 MiB x chunks in flight` (idle as measured above; `--per-chunk`; a job keeps four
  in flight), and the same N jobs: its peak charge against the cap, OOM kills, and
  whether the server and every job finished.

The server's egress is limited (`--egress-limit`, 400 Mbit/s), as a storage node's link
is: what the chunks computed then waits for the link, and the jobs hold near the most
they can outside the budget.

    python benchmarks/memory.py                # writes benchmarks/out/memory.{json,png}
    python benchmarks/memory.py --results      # ... and its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _host import machine, taskset  # benchmarks/, the script's own directory
from _results import write_section

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests.memory_cgroup makes the groups as the tests do
MiB = 1 << 20
IN_FLIGHT = 4
"""Chunks a job keeps in flight (`TransferJob`'s `prefetch`, its default)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--stored-size", type=int, default=320, help="side of the JPEGs")
    parser.add_argument("--images", type=int, default=64, help="training images")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=16, help="keys per chunk")
    parser.add_argument(
        "--cuts",
        default="auto,3,0,-1",
        help="the jobs' cuts, in turn: auto plans; 3 is ResNet-18's relu (the largest "
        "features), 0 INPUT, -1 RAW",
    )
    parser.add_argument("--budget", default="96MiB", help="the server's --memory-budget")
    parser.add_argument(
        "--per-chunk", type=float, default=8.0, help="the rule's MiB per chunk in flight"
    )
    parser.add_argument("--egress-limit", default="400mbit", help="the server's link")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # internal: run one job (JSON)
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the plot and table from the JSON"
    )
    args = parser.parse_args()
    if args.job:
        _job(json.loads(args.job))
        return
    if args.replot:
        result = json.loads((args.out / "memory.json").read_text())
        _plot(result, args.out / "memory.png")
        table = _table(result, argparse.Namespace(**{**vars(args), **result["args"]}))
        print(table)
        if args.results:
            write_section("memory", table)
        return
    from hapi._sizes import parse_bytes

    args.out.mkdir(parents=True, exist_ok=True)
    budget = parse_bytes(args.budget)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hapi-memory-") as root:
        _make_dataset(root, args)
        measured = _phase("measure", root, args, cap=None)
        print(json.dumps(_brief(measured)), flush=True)
        idle = measured["idle"]
        cap = idle + budget + int(args.per_chunk * MiB) * IN_FLIGHT * args.jobs
        capped = _phase("capped", root, args, cap=cap, idle=idle)
        print(json.dumps(_brief(capped)), flush=True)
    result = {
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "budget": budget,
        "seconds": time.monotonic() - started,
        "phases": [measured, capped],
    }
    (args.out / "memory.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / "memory.png")
    table = _table(result, args)
    print(table)
    if args.results:
        write_section("memory", table)


def _phase(
    name: str, root: str, args: argparse.Namespace, cap: int | None, idle: int | None = None
) -> dict[str, Any]:
    """One server in a cgroup (capped at `cap`): a warm-up job, then N jobs at once."""
    from tests.memory_cgroup import MemoryCgroup

    with (
        MemoryCgroup(cap, name=f"hapi-memory-{name}") as group,
        _Server(root, group, args) as server,
    ):
        start_line = server.start_line
        started = group.usage()
        warmup = _run_jobs(server.address, args, 1)
        time.sleep(1.0)  # the warm-up's session closes as its process ends
        heads = server.stats()["memory_used"]
        charged = group.usage()
        # The warm server's memory outside the budget: its charge less the heads it keeps.
        idle_here = charged - heads
        group.reset_peak()
        watch = _Watch(group, server.process.pid, server.address)
        with watch:
            jobs = _run_jobs(server.address, args, args.jobs)
        stats = server.stats() if server.process.poll() is None else None
        peak = max(group.peak(), watch.peak)
        alive = server.process.poll() is None
        oom = group.oom_kills()
    held = (stats or {}).get("memory_peak")
    # What the jobs held outside the budget: the charge less the idle server and less
    # what the budget counted at that moment, at its most over the samples.
    outside = max(
        (s["usage"] - idle_here - s["budget_used"] for s in watch.samples if s["budget_used"]),
        default=None,
    )
    return {
        "phase": name,
        "start_line": start_line,
        "cap": cap,
        "idle": idle if idle is not None else idle_here,
        "idle_here": idle_here,
        "start_charge": started,
        "warm_charge": charged,
        "cached_heads": heads,
        "peak": peak,
        "scheduler_peak": held,
        "outside_budget": outside,
        "per_job": outside / args.jobs if outside is not None else None,
        "server_alive": alive,
        "oom_kills": oom,
        "jobs_ok": sum(1 for j in jobs if j["ok"]),
        "job_errors": sorted({j["error"] for j in jobs if not j["ok"]}),
        "warmup_ok": warmup[0]["ok"],
        "job_seconds": [j["seconds"] for j in jobs],
        "cuts": [j.get("cut") for j in jobs],
        "timeline": watch.samples,
    }


class _Server:
    """`hapi serve` in `group`, joined before it execs, pinned to the first core."""

    def __init__(self, root: str, group: Any, args: argparse.Namespace) -> None:
        self.port = _free_port()
        self.address = f"grpc://127.0.0.1:{self.port}"
        command = [
            *taskset(0),
            *(sys.executable, "-m", "hapi.cli", "serve", "--store", root),
            *("--port", str(self.port), "--threads", "1", "--memory-budget", args.budget),
            *("--egress-limit", args.egress_limit),
        ]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (kept for the server's life)
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=self.log,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=group.preexec,
        )
        self.start_line = ""

    def __enter__(self) -> _Server:
        deadline = time.monotonic() + 120
        while "memory budget" not in self.start_line:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"hapi serve did not start: {self._output()[-2000:]}")
            time.sleep(0.2)
            self.start_line = next(
                (line for line in self._output().splitlines() if "memory budget" in line), ""
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stats(self) -> dict[str, Any]:
        from hapi.client import connect

        with connect(self.address, timeout=30) as conn:
            return conn.stats().model_dump()

    def _output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


class _Watch:
    """Samples the group's charge (and what it is made of) and what the server's budget
    holds every 0.2 s while jobs run."""

    def __init__(self, group: Any, pid: int, address: str) -> None:
        self.group, self.pid, self.address = group, pid, address
        self.samples: list[dict[str, float | None]] = []
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Watch:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from hapi.client import connect

        conn = connect(self.address, timeout=10)
        while not self._stop.wait(0.2):
            used = None
            with contextlib.suppress(Exception):
                used = conn.stats().memory_used
            usage = self.group.usage()
            stat = self.group.stat()
            self.peak = max(self.peak, usage)
            self.samples.append(
                {
                    "t": round(time.monotonic() - self._t0, 2),
                    "usage": usage,
                    "budget_used": used,
                    "anon": stat.get("total_rss", stat.get("anon", 0)),
                    "cache": stat.get("total_cache", stat.get("file", 0)),
                    "threads": _threads(self.pid),
                }
            )


def _run_jobs(address: str, args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    cuts = args.cuts.split(",")
    specs = [
        {
            "address": address,
            "model": args.model,
            "image_size": args.image_size,
            "epochs": args.epochs,
            "chunk": args.chunk,
            "cut": cuts[i % len(cuts)],
        }
        for i in range(n)
    ]
    procs = [
        subprocess.Popen(
            [*taskset(1), sys.executable, __file__, "--job", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for spec in specs
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        lines = out.decode().strip().splitlines()
        results.append(
            json.loads(lines[-1])
            if lines
            else {"ok": False, "error": f"exit {proc.returncode}", "seconds": None}
        )
    return results


def _job(spec: dict[str, Any]) -> None:
    """One job: a TransferJob that plans (`cut="auto"`) and trains, as a user's does."""
    import torch

    from hapi import TransferJob

    torch.set_num_threads(1)
    began = time.monotonic()
    try:
        job = TransferJob(
            spec["model"],
            dataset="train",
            server=spec["address"],
            image_size=spec["image_size"],
            num_classes=4,
            batch_size=32,
            chunk_size=spec["chunk"],
            cut=spec["cut"] if spec["cut"] == "auto" else int(spec["cut"]),
            retry_budget_s=30.0,
        )
        job.fit(epochs=spec["epochs"])
        result: dict[str, Any] = {"ok": True, "cut": spec["cut"]}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    result["seconds"] = time.monotonic() - began
    print(json.dumps(result, default=str), flush=True)


def _make_dataset(root: str, args: argparse.Namespace) -> None:
    from hapi.data import open_store, synth_dataset

    synth_dataset(
        open_store(root), "train", classes=4, per_class=args.images // 4, size=args.stored_size
    )


def _threads(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/status").read_text().split("Threads:")[1].split()[0])
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _brief(phase: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in phase.items() if k != "timeline"}


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.0f}"


def _table(result: dict[str, Any], args: argparse.Namespace) -> str:
    measure, capped = result["phases"]
    budget = result["budget"]
    lines = [
        "## The server's memory outside its budget",
        "",
        f"`python benchmarks/memory.py --results` on {result['machine']}: `hapi serve` in a "
        f"memory cgroup the script makes and removes, on one core with one torch thread and "
        f"`--memory-budget {args.budget}`; {args.jobs} `TransferJob` processes at once, "
        f"{args.model} at {args.image_size} px, cuts in turn {args.cuts} (`auto` plans: "
        f"profile and link probe; 3 = `relu`, the largest features; 0 = INPUT; -1 = RAW), "
        f"chunks of {args.chunk} keys, four in flight per job, {args.epochs} epoch of "
        f"{args.images} JPEG photos stored at {args.stored_size} px; after one warm-up job. "
        "Idle: the warm server's charge with no session open, less the heads it keeps "
        "cached (they are in the budget). Outside the budget: the charge less idle and less "
        "what the budget held at that moment, at its most (samples every 0.2 s). The "
        f"capped run's cap is the rule, idle + budget + {args.per_chunk:g} MiB x "
        f"{IN_FLIGHT} chunks in flight x {args.jobs} jobs, with the measuring run's idle. "
        f"The server's egress is limited to {args.egress_limit}. "
        f"{result['seconds']:.0f} s in all. "
        "Data: `out/memory.json`.",
        "",
        "| run | cap MiB | charge at start MiB | idle MiB | budget's peak MiB "
        "| peak charge MiB | outside the budget MiB (per job) | OOM kills | server "
        "| jobs finished |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in (measure, capped):
        per_job = "-" if p["per_job"] is None else f"{p['per_job'] / MiB:.1f}"
        lines.append(
            f"| {p['phase']} | {_mib(p['cap']) if p['cap'] else 'none'} "
            f"| {_mib(p['start_charge'])} | {_mib(p['idle_here'])} "
            f"| {_mib(p['scheduler_peak'])} | {_mib(p['peak'])} "
            f"| {_mib(p['outside_budget'])} ({per_job}) | {p['oom_kills']} "
            f"| {'alive' if p['server_alive'] else 'killed'} | {p['jobs_ok']} of {args.jobs} |"
        )
    room = capped["cap"] - capped["peak"]
    lines += [
        "",
        f"Under the rule's cap ({_mib(capped['cap'])} MiB = idle {_mib(capped['idle'])} + "
        f"budget {_mib(budget)} + {args.jobs} x {IN_FLIGHT} x {args.per_chunk:g} MiB) the "
        "server peaked at "
        f"{_mib(capped['peak'])} MiB, {_mib(room)} MiB below it. The rule (README, "
        "Memory): cap >= idle + budget + 8 MiB x chunks in flight. Outside the budget, per "
        "chunk in flight: its read-ahead (at most 4 MiB), the batches it computed and has "
        "not sent (at most three wire batches of 1 MiB), its threads and stream. "
        "Start-up line: "
        f"`{capped['start_line'].strip()}`",
        "",
        "![the server's charge while the jobs ran](out/memory.png)",
    ]
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, phase in zip(axes, result["phases"], strict=True):
        t = [s["t"] for s in phase["timeline"]]
        ax.plot(t, [s["usage"] / MiB for s in phase["timeline"]], label="charge")
        ax.plot(t, [s["anon"] / MiB for s in phase["timeline"]], label="anonymous")
        if phase["cap"]:
            ax.axhline(phase["cap"] / MiB, color="red", linestyle="--", label="cap (the rule)")
        budget_top = (phase["idle_here"] + result["budget"]) / MiB
        ax.axhline(budget_top, color="gray", linestyle=":", label="idle + budget")
        ax.set_title(f"{phase['phase']}: {phase['jobs_ok']} jobs finished")
        ax.set_xlabel("seconds")
        ax.legend(loc="upper left")
    axes[0].set_ylabel("server's cgroup (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
