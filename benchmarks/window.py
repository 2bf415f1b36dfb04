"""The trainer's HTTP/2 receive window: what a cancel recalls after a link drop, and what a
held window costs a link-bound stream.

A Flight server that sends N random bytes per ticket runs in the storage namespace of a
`ShapedLink` (core 0); a client in the trainer's (core 1) opens its streams as hapi's
loader does - four at once, read in turn. For each window (gRPC's bandwidth-delay probe,
fixed sizes, and hapi's own: `hapi.client.servers._window` from the measured round trip):

- at 1 Gbit/s, 40 rounds of four 800 KB streams read in turn: MB/s;
- then the link drops to 10 Mbit/s and the client opens four 393 KB streams, reads the
  first, cancels the other three (a re-plan's re-route) and fetches 16 KB: the seconds
  from opening to the 16 KB, against the first stream alone (its bytes at 10 Mbit/s).

Each client is a fresh process, the windows interleaved, median of the repeats.

Then what a held window costs hapi's own jobs in the steady state: `plan.py`'s stage
(256 photo-like JPEGs, ResNet-18 at 64 px to each of `--freezes`, server and trainer
pinned to a core each) at each `--rates`, RAW, INPUT, the plan's choice and `auto` each
run under gRPC's probe (`connect`'s default) and a held window (`receive_window="auto"`)
side by side, interleaved, epoch 2 of 3.

    python benchmarks/window.py            # writes benchmarks/out/window.{json,png}
    python benchmarks/window.py --results  # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _host import end, machine, pin
from _netns import ShapedLink
from _results import DETAILS, write_section

HERE = Path(__file__).resolve().parent
PORT = 8815
WINDOWS = ["probe", "32768", "65536", "131072", "262144", "1048576", "hapi"]
"""`probe`: gRPC's own; a number: held at that many bytes; `hapi`: `receive_window="auto"`."""
ALONE_S = 393_000 / (10e6 / 8)
"""Seconds the first stream's bytes need at 10 Mbit/s: a drop's least cost."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rates", default="100mbit,1gbit", help="the jobs' link rates")
    parser.add_argument("--freezes", default="layer3,avgpool+flatten", help="ResNet-18's")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: dict[str, list[dict]] = {w: [] for w in WINDOWS}
    with ShapedLink("1gbit") as link:
        server = subprocess.Popen(
            link.storage_cmd([sys.executable, __file__, "--serve"]),
            preexec_fn=lambda: pin(0),
        )  # fmt: skip
        try:
            time.sleep(2)
            for r in range(args.repeats):
                for window in WINDOWS if r % 2 == 0 else WINDOWS[::-1]:
                    run = _client(link, window)
                    runs[window].append(run)
                    print(json.dumps({"window": window, **run}), flush=True)
        finally:
            end(server)
    rows = [_row(w, runs[w]) for w in WINDOWS]
    jobs = [row for rate in args.rates.split(",") for row in _jobs(rate, args)]
    result = {
        "machine": machine(),
        "args": vars(args) | {"out": str(args.out)},
        "minutes": (time.time() - started) / 60,
        "rows": rows,
        "jobs": jobs,
    }
    (args.out / "window.json").write_text(json.dumps(result, indent=1))
    _plot(rows, args.out / "window.png")
    if args.results:
        write_section("window", _report(rows, jobs, args))


def _client(link: ShapedLink, window: str) -> dict:  # type: ignore[type-arg]
    link.set_rate("1gbit")
    proc = subprocess.Popen(
        link.trainer_cmd([sys.executable, __file__, "--client", link.storage_ip, window]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=lambda: pin(1),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    fast = json.loads(proc.stdout.readline())
    link.set_rate("10mbit")
    proc.stdin.write("\n")
    proc.stdin.flush()
    drop = json.loads(proc.stdout.readline())
    proc.wait()
    return {**fast, **drop}


def _jobs(rate: str, args: argparse.Namespace) -> list[dict]:  # type: ignore[type-arg]
    """hapi's jobs at `rate`, to each freeze, under gRPC's probe and a held window, side
    by side."""
    import tempfile

    import _plan_worker
    import plan

    stage_args = argparse.Namespace(
        images=256, change_images=0, classes=4, stored_size=440, image_size=64,
        batch_size=32, chunk_size=16, prefetch=_plan_worker.PREFETCH, epochs=3, trace=False,
        shaping="netns", window="grpc",
    )  # fmt: skip
    epochs: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hapi-window-") as root:
        plan._make_dataset(root, stage_args)
        with plan.Stage(root, rate, stage_args) as stage:
            for freeze in args.freezes.split(","):
                job = plan._job_options(stage_args, "resnet18", freeze)
                planned = stage.trainer({**job, "plan_only": True})
                assert planned is not None
                chosen = [planned["plan"]["cut"], planned["plan"]["share"]]
                options = [[-1, 0.0], [0, 0.0], chosen, "auto"]
                for r in range(args.repeats):
                    for window in ("grpc", "auto") if r % 2 == 0 else ("auto", "grpc"):
                        result = stage.trainer({**job, "options": options, "window": window})
                        assert result is not None
                        for run in result["runs"]:
                            key = (freeze, run["label"], window)
                            epochs.setdefault(key, []).append(run["epoch_s"])
                            print(json.dumps({"rate": rate, "window": window, **run}), flush=True)
    labels = list(dict.fromkeys((freeze, label) for freeze, label, _ in epochs))
    return [
        {
            "rate": rate,
            "freeze": freeze,
            "option": label,
            "grpc_s": statistics.median(epochs[freeze, label, "grpc"]),
            "auto_s": statistics.median(epochs[freeze, label, "auto"]),
            "runs": {w: epochs[freeze, label, w] for w in ("grpc", "auto")},
        }
        for freeze, label in labels
    ]


def _row(window: str, runs: list[dict]) -> dict:  # type: ignore[type-arg]
    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {
        "window": window,
        "bytes": runs[0]["bytes"],
        "mb_s": median("mb_s"),
        "after_drop_s": median("after_drop_s"),
        "first_s": median("first_s"),
        "runs": runs,
    }


def _serve() -> None:
    import pyarrow as pa
    import pyarrow.flight as flight

    payloads: dict[int, pa.Table] = {}

    class Bytes(flight.FlightServerBase):  # type: ignore[misc]
        def do_get(self, context, ticket):  # type: ignore[no-untyped-def]
            n = int(ticket.ticket.decode())
            if n not in payloads:
                payloads[n] = pa.table({"b": pa.array([os.urandom(n)], type=pa.binary())})
            return flight.RecordBatchStream(payloads[n])

    Bytes(f"grpc://0.0.0.0:{PORT}").serve()


def _run_client(host: str, window: str) -> None:
    import pyarrow.flight as flight

    from hapi.client.servers._window import Window, grpc_options, held_window

    address = f"grpc://{host}:{PORT}"
    named: dict[str, Window] = {"hapi": "auto", "probe": "grpc"}
    held = held_window(address, named.get(window) or int(window))
    client = flight.connect(address, generic_options=grpc_options(held))

    def ticket(n: int) -> flight.Ticket:
        return flight.Ticket(str(n).encode())

    moved, t0 = 0, time.perf_counter()
    for _ in range(40):
        streams = [client.do_get(ticket(800_000)) for _ in range(4)]
        moved += sum(s.read_all().nbytes for s in streams)
    rate = moved / (time.perf_counter() - t0) / 1e6
    print(json.dumps({"mb_s": rate, "bytes": held}), flush=True)
    sys.stdin.readline()  # the link is at 10 Mbit/s now
    t0 = time.perf_counter()
    streams = [client.do_get(ticket(393_000)) for _ in range(4)]
    streams[0].read_all()
    first = time.perf_counter() - t0
    for stream in streams[1:]:
        stream.cancel()
    client.do_get(ticket(16_000)).read_all()
    print(json.dumps({"first_s": first, "after_drop_s": time.perf_counter() - t0}), flush=True)


def _label(row: dict) -> str:  # type: ignore[type-arg]
    if row["window"] == "probe":
        return "gRPC probe"
    size = f"{row['bytes'] // 1024} KiB" if row["bytes"] else "probe"
    return f"auto ({size})" if row["window"] == "hapi" else size


def _report(rows: list[dict], jobs: list[dict], args: argparse.Namespace) -> str:  # type: ignore[type-arg]
    lines = [
        "## The receive window: what a re-route's cancel recalls",
        "",
        f"`python benchmarks/window.py --results` on {machine()}: a Flight server sending "
        "N random bytes a ticket in one network namespace (core 0), a client in another "
        "(core 1), a veth shaped with `tc tbf`; four streams open at once and read in turn, "
        f"as the loader reads them; each window a fresh client, interleaved, median of "
        f"{args.repeats}. **1 Gbit/s**: 40 rounds of 800 KB streams. **After the drop** "
        "to 10 Mbit/s: four 393 KB streams opened, the first read, three cancelled, then "
        f"16 KB fetched - from opening to the 16 KB; the first stream's bytes alone need "
        f"{ALONE_S:.2f} s at 10 Mbit/s. What the windows of the streams behind it let the "
        "server send before the cancel crosses anyway.",
        "",
        "| receive window | 1 Gbit/s MB/s | after the drop s | over the first's bytes |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {_label(r)} | {r['mb_s']:.1f} | {r['after_drop_s']:.2f} | "
            f"{r['after_drop_s'] / ALONE_S:.2f}x |"
        )
    names = {"-1:0.0": "RAW", "0:0.0": "INPUT", "auto": "`auto`"}
    ratios = [j["auto_s"] / j["grpc_s"] for j in jobs]
    lines += [
        "",
        "![window](out/window.png)",
        "",
        "hapi's jobs under both, side by side (ResNet-18, 256 images at 64 px, epoch 2 of "
        f"3, median of {args.repeats}; a fixed option's label is cut:share): "
        f"held / probe {min(ratios):.2f}-{max(ratios):.2f}x, median "
        f"{statistics.median(ratios):.2f}x.",
        DETAILS,
        "| link | freeze | option | gRPC probe s | held (`auto`) s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for j in jobs:
        lines.append(
            f"| {j['rate']} | {j['freeze']} | {names.get(j['option'], j['option'])} | "
            f"{j['grpc_s']:.3f} | "
            f"{j['auto_s']:.3f} | {j['auto_s'] / j['grpc_s']:.2f}x |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    labels = [_label(r) for r in rows]
    left.bar(labels, [r["after_drop_s"] for r in rows], color="tab:red")
    left.axhline(ALONE_S, color="k", lw=0.8, ls="--", label="the first stream's bytes alone")
    left.set_ylabel("s from opening to the 16 KB")
    left.set_title("after a drop to 10 Mbit/s", fontsize=9)
    left.set_ylim(0, 1.35 * max(r["after_drop_s"] for r in rows))
    left.legend(fontsize=7)
    right.bar(labels, [r["mb_s"] for r in rows], color="tab:blue")
    right.set_ylabel("MB/s")
    right.set_title("1 Gbit/s, 800 KB streams read in turn", fontsize=9)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve()
    elif sys.argv[1:2] == ["--client"]:
        _run_client(sys.argv[2], sys.argv[3])
    else:
        main()
