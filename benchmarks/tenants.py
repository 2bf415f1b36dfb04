"""Many jobs on one server under a memory cap: adaptive batches against fixed ones.

`hapi serve` runs in a memory cgroup this script creates and removes (cgroup v1,
`memory.limit_in_bytes`; run as root), capped at the server's warm usage plus two batches
of activations, with `--memory-budget` under the cap. Jobs are processes that open a
session each and stream chunks for a fixed time, all starting together. Runs:

- `alone`: one job, the single-job throughput;
- `adaptive`: N jobs, the scheduler choosing batch sizes within the budget, one batch
  computing at a time (`--compute-slots 1`, the server has one core);
- `adaptive4`: the same with four batches computing at once, so that the budget, not
  the slots, bounds them: batch sizes shrink to fit;
- `fixed`: N jobs without adaptation (a budget larger than the machine, a compute slot
  per chunk: every chunk runs its configured batch at once, as before the scheduler);
- `weights`: two jobs of tenants weighted 2:1.

Reported per run: OOM kills, failed requests, aggregate samples/s against `alone`, Jain's
index over the jobs' throughput (weighted shares for `weights`), the server's peak RSS
against the cap, and the scheduler's peak against the budget.

    python benchmarks/tenants.py                  # writes benchmarks/out/tenants.{json,png}
    python benchmarks/tenants.py --results        # ... and its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _results import write_section  # benchmarks/, the script's own directory
from _tenants_jobs import _cores, _job, _job_spec, _run_jobs
from _tenants_report import MiB, _jain, _median_row, _plot, _table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.memory_cgroup import remove_cgroup  # the tests remove their groups alike

HERE = Path(__file__).resolve().parent
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured time per run")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--freeze", default="avgpool")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--stored-size", type=int, default=256)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64, help="keys per chunk")
    parser.add_argument("--in-flight", type=int, default=4, help="chunks in flight per job")
    parser.add_argument("--batch-size", type=int, default=32, help="the server's largest batch")
    parser.add_argument("--runs", default="alone,adaptive,adaptive4,fixed,weights")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the runs, interleaved")
    parser.add_argument("--cold-trials", type=int, default=20, help="rounds of 8 cold opens")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # internal: run one job (JSON)
    args = parser.parse_args()
    if args.job:
        _job(json.loads(args.job))
        return
    if not CGROUP_ROOT.is_dir() or os.geteuid() != 0:
        sys.exit("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hapi-tenants-") as root:
        _make_dataset(root, args)
        tenants = _tenants_file(root)
        sizes = _warm_sizes(root, tenants, args)
        print(json.dumps({"sizes": sizes}), flush=True)
        cold = _cold_opens(root, tenants, args.cold_trials)
        print(json.dumps({"cold_opens": cold}), flush=True)
        measured = []
        # Rounds interleave the runs, so that a slow minute of a shared machine does not
        # fall on one run only; the table shows each run's median round.
        for _ in range(args.repeat):
            for run in args.runs.split(","):
                measured.append(_run(run, root, tenants, sizes, args))
                print(json.dumps(measured[-1]), flush=True)
    rows = [_median_row([r for r in measured if r["run"] == run]) for run in args.runs.split(",")]
    alone = next((r["samples_per_s"] for r in rows if r["run"] == "alone"), None)
    for row in rows:
        row["vs_alone"] = row["samples_per_s"] / alone if alone else None
    result = {
        "machine": _machine(),
        "args": _jsonable(vars(args)),
        "sizes": sizes,
        "cold_opens": cold,
        "rows": rows,
        "rounds": measured,
    }
    (args.out / "tenants.json").write_text(json.dumps(result, indent=2))
    _plot(rows, sizes, args.out / "tenants.png")
    table = _table(rows, sizes, cold, args)
    print(table)
    if args.results:
        write_section("tenants", table)


# The server, in a memory cgroup -------------------------------------------------------------


@contextlib.contextmanager
def _cgroup(limit: int | None) -> Iterator[Path]:
    path = CGROUP_ROOT / f"hapi-tenants-{os.getpid()}"
    path.mkdir()
    try:
        if limit is not None:
            (path / "memory.limit_in_bytes").write_text(str(limit))
        yield path
    finally:
        remove_cgroup(path, CGROUP_ROOT)


class _Server:
    """`hapi serve` in `cgroup`, pinned to core 0 with one torch thread."""

    def __init__(self, root: str, tenants: dict[str, Any], cgroup: Path, **options: Any):
        self.cgroup = cgroup
        self.port = _free_port()
        self.address = f"grpc://127.0.0.1:{self.port}"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items() if v is not None]
        command = [
            *("hapi", "serve", "--store", root, "--port", str(self.port)),
            *("--tenants", tenants["path"], "--threads", "1", *flags),
        ]
        # Join the cgroup before exec, so that everything the server allocates counts.
        join = f'echo $$ > {cgroup / "cgroup.procs"} && exec taskset -c {_cores()[0]} "$@"'
        env = {**os.environ, **tenants["env"], "OMP_NUM_THREADS": "1"}
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (kept for the server's life)
        self.process = subprocess.Popen(
            ["sh", "-c", join, "sh", *command], env=env, stdout=self.log, stderr=self.log
        )
        self.peak_rss = 0
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_rss, daemon=True)
        self._wait_ready()
        self._watch.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError("server did not start")

    def _watch_rss(self) -> None:
        while not self._stop.wait(0.1):
            self.peak_rss = max(self.peak_rss, self.rss())

    def rss(self) -> int:
        """The server's anonymous RSS: its own memory (mapped library files are shared
        page cache, charged to whichever group read them first)."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return 0
        # A process that has exited (a zombie) has no RssAnon line.
        return int(status.split("RssAnon:")[1].split()[0]) * 1024 if "RssAnon:" in status else 0

    def charged(self, peak: bool = False) -> int:
        """What the kernel charges the cgroup now (or at most so far): what the cap holds."""
        name = "memory.max_usage_in_bytes" if peak else "memory.usage_in_bytes"
        return int((self.cgroup / name).read_text())

    def stats(self, token: str) -> dict[str, Any]:
        from hapi.client import connect

        with connect(self.address, token=token, timeout=30) as conn:
            return conn.stats().model_dump()

    def stop(self) -> int | None:
        """Stop the server; its exit status (negative: the signal that ended it)."""
        self._stop.set()
        code = self.process.poll()
        if code is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            return None
        return code


# Runs ----------------------------------------------------------------------------------------


def _warm_sizes(root: str, tenants: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The server's idle and warm RSS and a session's memory, measured without a cap."""
    with _cgroup(None) as group:
        server = _Server(root, tenants, group, batch_size=args.batch_size, compute_slots=1)
        try:
            idle = server.charged()
            token = tenants["tokens"]["a"]
            job = _job_spec(args, server.address, token, "a", time.time() + 1.0, 6.0, 1.0)
            result = _run_jobs([job])[0]
            stats = server.stats(token)
            warm = server.charged(peak=True)
        finally:
            server.stop()
    per_batch = result["memory_per_sample"] * args.batch_size
    cap = warm + 2 * per_batch
    # The budget holds heads and batches; the rest of the process (Python, torch, gRPC)
    # is what it was idle, and some room for buffers the budget does not see.
    budget = cap - idle - 96 * MiB
    return {
        "idle": idle,
        "warm": warm,
        "memory_per_sample": result["memory_per_sample"],
        "memory_fixed": result["memory_fixed"],
        "heads_bytes": stats["memory_used"],
        "cap": cap,
        "budget": budget,
    }


def _cold_opens(root: str, tenants: dict[str, Any], trials: int) -> dict[str, Any]:
    """Eight sessions opened at the same moment on models the server has not loaded, in
    each of `trials` rounds (new input sizes each round: new traces), with one session
    streaming throughout; then every session must compute."""
    from hapi.client import connect
    from hapi.data import Transforms
    from hapi.graph import ModelSpec
    from hapi.wire import ChunkTicket, SessionRequest

    token = tenants["tokens"]["c"]
    failures: list[str] = []
    with _cgroup(None) as group:
        server = _Server(root, tenants, group)
        try:
            conn = connect(server.address, token=token, timeout=300)
            keys = list(conn.manifest("train").keys[:2])

            def request(name: str, size: int, cut: int) -> SessionRequest:
                return SessionRequest(
                    model=ModelSpec(name=name, num_classes=4).to_dict(),
                    cut=cut,
                    freeze=cut,
                    transforms=Transforms.eval(size).to_dict(),
                    image_size=size,
                )

            def fetch(session: str) -> None:
                ticket = ChunkTicket(session=session, chunk=0, keys=keys, labels=[0, 0])
                conn.fetch(ticket)

            busy = conn.open_session(request("resnet18", 64, 3)).session
            for trial in range(trials):
                size = 32 + 8 * trial  # sizes never used before: every open traces
                models = [("resnet18", size), ("mobilenet_v3_small", size)] * 4
                failures += _cold_round(
                    conn,
                    [request(n, s, 3 + i % 2) for i, (n, s) in enumerate(models)],
                    lambda: fetch(busy),
                    fetch,
                )
        finally:
            server.stop()
    return {"trials": trials, "opens": 8 * trials, "failures": len(failures), "first": failures[:3]}


def _cold_round(conn: Any, requests: list[Any], stream: Any, fetch: Any) -> list[str]:
    """Open `requests` at the same moment while `stream` runs; then fetch from each."""
    barrier = threading.Barrier(len(requests) + 1)
    opened: list[str] = []
    failures: list[str] = []

    def call(what: str, fn: Any) -> None:
        barrier.wait()
        try:
            result = fn()
            if result is not None:
                opened.append(result.session)
        except Exception as exc:
            failures.append(f"{what}: {type(exc).__name__}: {exc}"[:300])

    threads = [
        threading.Thread(target=call, args=("open", lambda r=r: conn.open_session(r)))
        for r in requests
    ]
    threads.append(threading.Thread(target=call, args=("chunk", stream)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for session in opened:
        try:
            fetch(session)
        except Exception as exc:
            failures.append(f"after: {type(exc).__name__}: {exc}"[:300])
        conn.close_session(session)
    return failures


def _run(
    run: str, root: str, tenants: dict[str, Any], sizes: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    options: dict[str, Any] = {"batch_size": args.batch_size}
    if run == "fixed":
        options.update(memory_budget=1 << 40, compute_slots=args.jobs * args.in_flight)
    else:
        # adaptive4: four batches at once on the one core, so the budget, not the slots,
        # bounds them and their sizes shrink to fit.
        options.update(memory_budget=sizes["budget"], compute_slots=4 if run == "adaptive4" else 1)
    names = {"alone": ["a"], "weights": ["a", "b"]}.get(run, ["c"] * args.jobs)
    with _cgroup(sizes["cap"]) as group:
        server = _Server(root, tenants, group, **options)
        try:  # a failed job must not leave its server running
            start = time.time() + 2.0
            jobs = [
                _job_spec(
                    args, server.address, tenants["tokens"][n], n, start, args.seconds, args.warmup
                )
                for n in names
            ]
            results = _run_jobs(jobs)
            stats = None
            with contextlib.suppress(Exception):
                stats = server.stats(tenants["tokens"]["c"])
            charged = server.charged(peak=True)
        finally:
            code = server.stop()
        oom = _oom_kills(group)
    rates = [r["samples_per_s"] for r in results]
    weights = [tenants["weights"][n] for n in names]
    shares = [r / w for r, w in zip(rates, weights, strict=True)]
    return {
        "run": run,
        "jobs": len(names),
        "samples_per_s": sum(rates),
        "per_job": rates,
        "jain": _jain(shares),
        "ratio": rates[0] / rates[1] if run == "weights" and rates[1] else None,
        "mean_batch": sum(r["samples_per_s"] for r in results)
        * args.seconds
        / max(sum(r["batches"] for r in results), 1),
        "errors": sum(r["errors"] for r in results),
        "error_kinds": sorted({e for r in results for e in r["error_kinds"]}),
        "oom_kills": oom,
        "server_exit": code,
        "peak_rss": server.peak_rss,
        "peak_charged": charged,
        "tracked_peak": stats["memory_peak"] if stats else None,
        "budget": options["memory_budget"],
        "cap": sizes["cap"],
    }


# Helpers ---------------------------------------------------------------------------------------


def _make_dataset(root: str, args: argparse.Namespace) -> None:
    from hapi.data import open_store, synth_dataset

    synth_dataset(
        open_store(root), "train", classes=4, per_class=args.images // 4, size=args.stored_size
    )


def _tenants_file(root: str) -> dict[str, Any]:
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    tokens = {name: secrets.token_hex(16) for name in weights}
    env = {f"HAPI_BENCH_{name.upper()}": tokens[name] for name in weights}
    text = "".join(
        f'[{name}]\ntoken_env = "HAPI_BENCH_{name.upper()}"\nprefixes = [""]\nweight = {w}\n\n'
        for name, w in weights.items()
    )
    path = Path(root).parent / f"hapi-tenants-{os.getpid()}.toml"
    path.write_text(text)
    return {"path": str(path), "tokens": tokens, "env": env, "weights": weights}


def _oom_kills(group: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        text = (group / "memory.oom_control").read_text()
        return int(text.split("oom_kill ")[1].split()[0])
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _machine() -> dict[str, Any]:
    return {
        "machine": platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
    }


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
