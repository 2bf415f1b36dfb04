"""Scale-out: N servers each behind its own link, a server killed mid-epoch, and chaos runs.

Every `hapi serve` reads the same store (a local directory of photo-like JPEGs of about
100 KB) and sends through its own egress token bucket (`--rate`), so each is link-bound;
the servers share one core (`taskset`), the trainer - this process, one torch thread -
has the other. One job (ResNet-18 at 64 px frozen to `layer3`, cut there: 16 KB of
features a sample, so a link's 64 KiB burst is a few samples) trains over the first N
servers.

- `scale`: the last of two epochs, for N = 1, 2, 4, in interleaved repeats: aggregate
  samples/s against N times one server's.
- `kill`: two servers; in epoch 2 one is killed (kill -9, not restarted) half-way. The
  epoch then runs its second half on one server: half of (one server's epoch - two
  servers' epoch) is capacity lost, not time lost to the failure. The time lost is the
  killed epoch less the undisturbed one less that; the bound it is held to is the time
  of the chunks the dead server had in flight (fetched again) at one server's rate.
- `chaos`: two servers over a SeaweedFS store; each run trains one epoch while servers are
  killed and restarted and the store is stopped and started at seeded random moments
  (`tests/chaos.py`), and counts the keys delivered: lost, duplicated, failed runs.

    python benchmarks/scale.py                  # writes benchmarks/out/scale.{json,png}
    python benchmarks/scale.py --results        # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests' SeaweedFS, server-process and chaos helpers

from _host import machine, pin, taskset  # noqa: E402
from _results import write_section  # noqa: E402

if TYPE_CHECKING:
    from hapi.wire import SessionRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--rate", default="1mbit", help="each server's egress limit")
    parser.add_argument("--chaos-rate", default="2mbit", help="egress limit in chaos runs")
    parser.add_argument("--images", type=int, default=240)
    parser.add_argument("--stored-size", type=int, default=440, help="side of the JPEGs")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chaos-runs", type=int, default=50)
    parser.add_argument("--parts", default="scale,kill,chaos")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report from out/scale.json"
    )
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads((args.out / "scale.json").read_text())
        for key, value in saved["args"].items():
            if key not in ("out", "results", "report_only"):
                setattr(args, key, type(getattr(args, key))(value))
        report = _report(saved, args)
        print(report)
        if args.results:
            write_section("scale", report)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")

    import torch

    torch.set_num_threads(1)
    pin(0)
    result: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hapi-scale-") as root:
        _make_dataset(root, args)
        counts = [int(n) for n in args.servers.split(",")]
        if "scale" in parts or "kill" in parts:
            with _Servers(root, max([*counts, 2]), args) as servers:
                if "scale" in parts:
                    result["scale"] = _scale(servers, counts, args)
                    _save(result, args)
                if "kill" in parts:
                    result["kill"] = _kill(servers, args, result.get("scale"))
                    _save(result, args)
        if "chaos" in parts:
            result["chaos"] = _chaos(Path(root), args)
    result["wall_s"] = time.time() - started
    _save(result, args)
    report = _report(result, args)
    print(report)
    if "scale" in result:
        _plot(result, args.out / "scale.png")
    if args.results:
        write_section("scale", report)


def _save(result: dict, args: argparse.Namespace) -> None:
    """Write what is measured so far (a later part may fail)."""
    (args.out / "scale.json").write_text(json.dumps(result, indent=1))


class _Servers:
    """`count` servers on the store at `root`, on the second core, each link-shaped."""

    def __init__(self, root: str, count: int, args: argparse.Namespace) -> None:
        from tests.seaweed import free_port
        from tests.serve_process import ServeProcess

        taken: set[int] = set()
        self.all = [ServeProcess(root, free_port(taken), wrap=taskset(1)) for _ in range(count)]
        self.options = ("--batch-size", "16", "--egress-limit", args.rate)

    def __enter__(self) -> _Servers:
        for server in self.all:
            server.start(*self.options)
        for server in self.all:
            server.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.all:
            server.stop()


def _job(addresses: list[str], args: argparse.Namespace, **options: Any):
    from hapi.client import TransferJob

    return TransferJob(
        {"name": "resnet18", "num_classes": 4},
        "train",
        addresses,
        freeze="layer3",
        cut=None,  # the freeze point: 16 KB of features a sample at 64 px
        image_size=args.image_size,
        batch_size=16,
        chunk_size=args.chunk_size,
        prefetch=args.prefetch,
        seed=1,
        **options,
    )


def _scale(servers: _Servers, counts: list[int], args: argparse.Namespace) -> dict:
    runs: dict[int, list[float]] = {n: [] for n in counts}
    for repeat in range(args.repeats):
        for n in counts:
            job = _job([s.address for s in servers.all[:n]], args)
            epoch = job.fit(2, lr=0.01).epochs[-1]
            runs[n].append(epoch.samples / epoch.seconds)
            print(json.dumps({"repeat": repeat, "servers": n, "samples_s": runs[n][-1]}))
    one = statistics.median(runs[counts[0]]) / counts[0]
    return {
        str(n): {
            "samples_s": rates,
            "median": statistics.median(rates),
            "spread": (max(rates) - min(rates)) / statistics.median(rates),
            "vs_n_x_one": statistics.median(rates) / (n * one),
        }
        for n, rates in runs.items()
    }


def _kill(servers: _Servers, args: argparse.Namespace, scale: dict | None) -> dict:
    pair = servers.all[:2]
    addresses = [s.address for s in pair]
    rows = []
    for repeat in range(args.repeats):
        normal = _job(addresses, args).fit(2, lr=0.01).epochs[-1]
        job = _job(addresses, args)
        job.fit(1, lr=0.01)
        steps = job.batches_per_epoch()
        killed_at: list[float] = []
        t0 = time.perf_counter()

        def kill_half_way(
            step: int, total: int, t0: float = t0, killed_at: list[float] = killed_at
        ) -> None:
            if step == total // 2 and not killed_at:
                pair[1].kill()
                killed_at.append(time.perf_counter() - t0)

        epoch = job.fit(1, lr=0.01, progress=kill_half_way).epochs[-1]
        pair[1].start()
        pair[1].wait_ready()
        # One server's rate from the scale runs (else half of two servers').
        one = (
            float(scale["1"]["median"])
            if scale and "1" in scale
            else normal.samples / normal.seconds / 2
        )
        alone_s = epoch.samples / one
        # Half an epoch on one server instead of two is the capacity the kill took away;
        # what the epoch took beyond that is the time the failure itself cost.
        capacity_s = (alone_s - normal.seconds) * (1 - (steps // 2) / steps)
        rows.append(
            {
                "normal_s": normal.seconds,
                "killed_s": epoch.seconds,
                "killed_at_s": killed_at[0],
                "capacity_s": capacity_s,
                "lost_s": epoch.seconds - normal.seconds - capacity_s,
                "bound_s": args.prefetch * args.chunk_size / one,
                "samples": epoch.samples,
                "failovers": epoch.failovers,
                "retries": epoch.retries,
            }
        )
        print(json.dumps({"repeat": repeat, **rows[-1]}))
    return {"runs": rows, "lost_median_s": statistics.median(r["lost_s"] for r in rows)}


def _chaos(root: Path, args: argparse.Namespace) -> dict:
    from tests.chaos import Chaos
    from tests.seaweed import SeaweedS3, free_port
    from tests.serve_process import ServeProcess

    from hapi.client import FeatureLoader, TransferJob
    from hapi.client.servers.sessions import Sessions
    from hapi.data import open_store, synth_dataset
    from hapi.errors import HapiError
    from hapi.wire import SessionRequest

    samples = 96
    runs: list[dict[str, Any]] = []
    with SeaweedS3(root / "weed") as store:
        uri = store.new_bucket()
        manifest = synth_dataset(
            open_store(uri, store.options), "train", classes=4, per_class=samples // 4,
            size=args.stored_size, seed=3,
        )  # fmt: skip
        env = store.client_env
        taken: set[int] = set()
        pair = [ServeProcess(uri, free_port(taken), env, taskset(1)) for _ in range(2)]
        try:
            for server in pair:
                server.start("--batch-size", "4", "--egress-limit", args.chaos_rate)
            for server in pair:
                server.wait_ready()
            spec = TransferJob(
                {"name": "resnet18", "num_classes": 4}, "train", pair[0].address,
                freeze="layer3", cut=None, image_size=args.image_size,
            )  # fmt: skip
            for run in range(args.chaos_runs):
                for server in pair:
                    if not server.running:
                        server.start()
                    server.wait_ready()
                events = ["kill", "store", "kill"] if run % 2 else ["store", "kill", "kill"]
                delivered: collections.Counter[str] = collections.Counter()
                error = None
                t0 = time.perf_counter()
                assert spec.spec is not None  # a named model
                request = functools.partial(
                    SessionRequest,
                    model=spec.spec.to_dict(),
                    freeze=spec.freeze,
                    transforms=spec.config.train_transforms.to_dict(),
                    image_size=args.image_size,
                    seed=run,
                )
                sessions = [Sessions(_connect(s.address), _at_cut(request)) for s in pair]
                loader = FeatureLoader(
                    sessions[0].connection, sessions, manifest, batch_size=8, chunk_size=4,
                    prefetch=2, seed=run, retry_budget_s=120, cut=spec.freeze,
                )  # fmt: skip
                with Chaos(pair, store, seed=run, events=events) as chaos:
                    try:
                        with loader.servers:
                            for batch in loader.batches(0):
                                delivered.update(batch.keys)
                    except HapiError as exc:
                        error = f"{type(exc).__name__}: {exc}"
                wanted = set(manifest.keys)
                row = {
                    "run": run,
                    "seconds": time.perf_counter() - t0,
                    "events": chaos.done,
                    "lost": len(wanted - set(delivered)),
                    "duplicated": sum(c - 1 for c in delivered.values() if c > 1),
                    "retries": loader.stats.retries,
                    "failovers": loader.stats.failovers,
                    "error": error,
                }
                runs.append(row)
                print(json.dumps(row))
        finally:
            for server in pair:
                server.stop()
    return {
        "samples": samples,
        "runs": runs,
        "lost": sum(r["lost"] for r in runs),
        "duplicated": sum(r["duplicated"] for r in runs),
        "failed": sum(r["error"] is not None for r in runs),
        "events": sum(len(r["events"]) for r in runs),
    }


def _at_cut(request: Callable[..., SessionRequest]) -> Callable[[int], SessionRequest]:
    """The session request for a cut, from one with every other field set."""

    def at(cut: int) -> SessionRequest:
        return request(cut=cut)

    return at


def _connect(address: str):
    from hapi.client import connect

    return connect(address)


def _report(result: dict, args: argparse.Namespace) -> str:
    lines = [
        "## Scale-out: many servers, a server killed, chaos",
        "",
        f"`python benchmarks/scale.py --results` on {result['machine']}; resnet18 at "
        f"{args.image_size} px frozen to `layer3` and cut there (16 KB a sample), "
        f"{args.images} JPEGs stored at {args.stored_size} px, chunks of {args.chunk_size}, "
        f"{args.prefetch} in flight per server. Each server's egress is limited to "
        f"{args.rate} (its own link); the servers share one core, the trainer has the "
        "other. Medians of "
        f"{args.repeats} interleaved repeats (spread = (max - min) / median). Data: "
        "`out/scale.json`.",
        "",
    ]
    if "scale" in result:
        lines += [
            "| servers | samples/s (spread) | vs N x one server |",
            "|---|---|---|",
        ]
        for n, row in result["scale"].items():
            lines.append(
                f"| {n} | {row['median']:.1f} ({row['spread']:.0%}) | {row['vs_n_x_one']:.2f} |"
            )
        lines += ["", "![aggregate throughput against N servers](out/scale.png)", ""]
    if "kill" in result:
        runs = result["kill"]["runs"]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "samples"}
        lines += [
            "A kill -9 of one of two servers half-way through an epoch (not restarted): "
            f"epoch {med['killed_s']:.2f} s against {med['normal_s']:.2f} s undisturbed, of "
            f"which {med['capacity_s']:.2f} s is the half epoch on one server instead of two; "
            f"the failure itself cost **{med['lost_s']:.2f} s** (median; runs: "
            + ", ".join(f"{r['lost_s']:.2f}" for r in runs)
            + f"), against the {med['bound_s']:.2f} s of the chunks it had in flight; "
            f"{med['failovers']:.0f} chunks moved to the other server, every key once. (Below "
            "zero: at the kill the trainer held more than half the epoch's samples - they "
            "stream ahead of training - so less than half was left for the one server.)",
            "",
        ]
    if "chaos" in result:
        chaos = result["chaos"]
        n = len(chaos["runs"])
        seconds = statistics.median(r["seconds"] for r in chaos["runs"])
        lines += [
            f"Chaos: {n} runs of one epoch ({chaos['samples']} keys, 2 servers over SeaweedFS "
            f"at {args.chaos_rate} each), each with 3 events at seeded random moments (a server "
            "killed and brought back 0.2-3 s later, or the store stopped for 0.5-3 s and "
            f"started again): {chaos['events']} events in all, **{chaos['lost']} keys lost, "
            f"{chaos['duplicated']} duplicated, {chaos['failed']} runs failed**; median run "
            f"{seconds:.1f} s, {sum(r['retries'] for r in chaos['runs'])} chunk retries and "
            f"{sum(r['failovers'] for r in chaos['runs'])} failovers in all.",
        ]
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = result["scale"]
    ns = [int(n) for n in scale]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot(ns, [scale[str(n)]["median"] for n in ns], "o-", label="measured")
    one = scale[str(ns[0])]["median"] / ns[0]
    ax.plot(ns, [n * one for n in ns], "--", color="gray", label="N x one server")
    ax.plot(ns, [0.9 * n * one for n in ns], ":", color="gray", label="0.9 x N")
    for n in ns:
        ax.scatter([n] * len(scale[str(n)]["samples_s"]), scale[str(n)]["samples_s"], s=8)
    ax.set_xlabel("servers (each link-bound)")
    ax.set_ylabel("samples / s")
    ax.set_xticks(ns)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _make_dataset(root: str, args: argparse.Namespace) -> None:
    from hapi.data import open_store, synth_dataset

    synth_dataset(
        open_store(root), "train", classes=4, per_class=max(1, args.images // 4),
        size=args.stored_size, seed=0, quality=90,
    )  # fmt: skip


if __name__ == "__main__":
    main()
