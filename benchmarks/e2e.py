"""Baseline vs pushdown, end to end, through shaped links.

Server and trainer run as two processes, each pinned to its own core with one torch
thread, so the storage tier and the compute tier do not share a CPU. For each egress limit
the script starts `hapi serve` with that limit, trains ResNet-18 for a few epochs as the
baseline (raw bytes, everything in the trainer) and with pushdown at the freeze cut, and
records bytes moved, epoch time, and the pipeline bound max(server, transfer, trainer).

    python benchmarks/e2e.py                      # writes benchmarks/out/e2e.{json,png}
    python benchmarks/e2e.py --results            # ... and the table in benchmarks/RESULTS.md

With `--compiled`, pushdown also runs with bf16 heads (`head_dtype="bf16"`), and on a
second server with `--compile-heads always`, warmed until its heads are compiled, in fp32
and bf16 (`e2e-compiled.{json,png}`, its own RESULTS section).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _host import end  # benchmarks/, the script's own directory
from _results import write_section

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--freeze", default="avgpool", help="last frozen module (the cut)")
    parser.add_argument("--images", type=int, default=256, help="training images")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--stored-size", type=int, default=320, help="side of the stored JPEGs")
    parser.add_argument("--image-size", type=int, default=112, help="the model's input side")
    parser.add_argument("--limits", default="5mbit,25mbit,100mbit,1000mbit")
    parser.add_argument("--epochs", type=int, default=2, help="the last epoch is reported")
    parser.add_argument("--wire-dtype", default="fp32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--compiled", action="store_true", help="bf16 and compiled heads too")
    parser.add_argument("--repeats", type=int, default=3, help="rounds with --compiled")
    parser.add_argument("--head-dtype", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: run one trainer
    args = parser.parse_args()
    if args.trainer:
        _trainer(args)
        return
    _pin(None)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hapi-e2e-") as root:
        _make_dataset(root, args)
        for limit in args.limits.split(","):
            rows += _link(root, limit, args)
    name = "e2e-compiled" if args.compiled else "e2e"
    result = {"machine": _machine(), "args": _jsonable(vars(args)), "rows": rows}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    _plot(rows, args.out / f"{name}.png")
    table = _table(rows, args)
    print(table)
    if args.results:
        _write_results(table, args)


def _link(root: str, limit: str, args: argparse.Namespace) -> list[dict]:
    """The rows of one link: baseline and pushdown; with `--compiled`, the other heads."""
    if args.compiled:
        return _compiled_link(root, limit, args)
    rows = []
    with _Server(root, limit) as server:
        for mode, label in (("local", "baseline"), ("pushdown", "pushdown")):
            rows.append(_measure(server, mode, limit, args, label=label))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _compiled_link(root: str, limit: str, args: argparse.Namespace) -> list[dict]:
    """Eager and compiled heads on two servers, the compiled one warmed first; the ways
    interleaved in each of `--repeats` rounds, each way's median round kept."""
    eager_ways = [("local", "fp32", "baseline"), ("pushdown", "fp32", "pushdown"),
                  ("pushdown", "bf16", "pushdown, bf16")]  # fmt: skip
    compiled_ways = [("fp32", "pushdown, compiled"), ("bf16", "pushdown, bf16 compiled")]
    runs: dict[str, list[dict]] = {}
    with _Server(root, limit) as eager, _Server(root, limit, ("--compile-heads", "always")) as fast:
        heads = {label: _warm(fast, args, dtype) for dtype, label in compiled_ways}
        for r in range(args.repeats):
            for mode, dtype, label in eager_ways:
                row = _measure(eager, mode, limit, args, dtype=dtype, label=label)
                runs.setdefault(label, []).append(row)
            for dtype, label in compiled_ways:
                row = _measure(fast, "pushdown", limit, args, dtype=dtype, label=label)
                runs.setdefault(label, []).append({**row, "head": heads[label]})
            print(f"round {r + 1}: " + json.dumps({k: v[-1]["epoch_s"] for k, v in runs.items()}))
    rows = []
    for done in runs.values():
        median = sorted(done, key=lambda row: row["epoch_s"])[len(done) // 2]
        rows.append({**median, "rounds": [row["epoch_s"] for row in done]})
    return rows


def _warm(server: _Server, args: argparse.Namespace, dtype: str, most_s: float = 900) -> str:
    """Run one-epoch jobs until the server has compiled (or refused) the `dtype` head."""
    from hapi.client import connect

    deadline = time.monotonic() + most_s
    state = "not compiled"
    while time.monotonic() < deadline:
        _run_trainer(server, "pushdown", args, dtype, epochs=1)
        heads = connect(server.address).stats().compiled_heads
        mine = [
            v for k, v in heads.items() if k.endswith("bfloat16" if dtype == "bf16" else "float32")
        ]
        state = mine[0] if mine else state
        if mine and not state.startswith(("eager", "compiling", "checking")):
            break
    print(f"warm {dtype}: {state}", flush=True)
    return state


def _pin(core: int | None) -> None:
    """Pin this process to one core (or leave it) and give torch one thread."""
    cores = sorted(os.sched_getaffinity(0))
    if core is not None and len(cores) > 1:
        os.sched_setaffinity(0, {cores[core % len(cores)]})


def _make_dataset(root: str, args: argparse.Namespace) -> None:
    from hapi.data import open_store, synth_dataset

    per_class = max(1, args.images // args.classes)
    synth_dataset(
        open_store(root),
        "train",
        classes=args.classes,
        per_class=per_class,
        size=args.stored_size,
        seed=0,
    )


class _Server:
    """`hapi serve` in a subprocess on core 0, stopped by its pid."""

    def __init__(self, root: str, limit: str, extra: tuple[str, ...] = ()) -> None:
        self.root, self.limit, self.extra = root, limit, extra
        self.port = _free_port()
        self.address = f"grpc://127.0.0.1:{self.port}"

    def __enter__(self) -> _Server:
        cmd = [
            sys.executable,
            "-m",
            "hapi.cli",
            "serve",
            "--store",
            self.root,
            "--port",
            str(self.port),
            "--egress-limit",
            self.limit,
            "--threads",
            "1",
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: _pin(0),
        )
        from hapi.client import connect

        deadline = time.monotonic() + 60
        while True:
            try:
                connect(self.address, timeout=2).stats()
                return self
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.__exit__()
                    raise RuntimeError(f"server on {self.address} did not start") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        end(self.proc)


def _run_trainer(
    server: _Server, mode: str, args: argparse.Namespace, dtype: str, epochs: int
) -> dict:
    """One trainer process on core 1; what it printed."""
    cmd = [sys.executable, __file__, "--trainer", f"{server.address},{mode}"]
    for name in ("model", "freeze", "image_size", "wire_dtype", "batch_size"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--epochs", str(epochs), "--head-dtype", dtype]
    out = subprocess.run(
        cmd, check=True, capture_output=True, text=True, preexec_fn=lambda: _pin(1)
    ).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _measure(
    server: _Server,
    mode: str,
    limit: str,
    args: argparse.Namespace,
    *,
    dtype: str = "fp32",
    label: str = "",
) -> dict:
    from hapi.client import connect
    from hapi.server import parse_rate

    before = set(connect(server.address).stats().closed_sessions)
    trainer = _run_trainer(server, mode, args, dtype, args.epochs)
    closed = connect(server.address).stats().closed_sessions
    # The trainer's fit session, whose server-side times cover all epochs: the one that
    # sent, beside the RAW session that had the server load the model while the trainer
    # built its own (it sends nothing).
    opened = [s for sid, s in closed.items() if sid not in before]
    stats = max(opened, key=lambda s: s.bytes_sent)
    epochs = args.epochs
    # CPU time, not the sum of stage wall times: chunks run concurrently on one core.
    server_s = stats.cpu_s / epochs
    last = trainer["epochs"][-1]
    rate = parse_rate(limit)
    transfer_s = last["bytes_received"] / rate
    trainer_s = last["compute_s"] + last["decode_s"]
    return {
        "limit": limit,
        "mode": label or ("baseline" if mode == "local" else "pushdown"),
        "cut": trainer["cut"],
        "bytes_per_epoch": last["bytes_received"],
        "epoch_s": last["seconds"],
        "server_s": server_s,
        "transfer_s": transfer_s,
        "trainer_s": trainer_s,
        "bound_s": max(server_s, transfer_s, trainer_s),
        "wait_s": last["wait_s"],
        "samples": last["samples"],
    }


def _trainer(args: argparse.Namespace) -> None:
    import dataclasses

    import torch

    from hapi.client import TransferJob

    torch.set_num_threads(1)
    address, mode = args.trainer.split(",")
    job = TransferJob(
        {"name": args.model, "num_classes": 4},
        "train",
        address,
        freeze=args.freeze,
        cut=None,  # the freeze cut: this benchmark compares it with the baseline
        mode=mode,
        image_size=args.image_size,
        wire_dtype=args.wire_dtype,
        batch_size=args.batch_size,
        head_dtype=args.head_dtype,
    )
    job.fit(args.epochs, lr=0.01)
    epochs = [
        {k: v for k, v in dataclasses.asdict(e).items() if k != "skipped"}
        for e in job.history.epochs
    ]
    print(json.dumps({"cut": job.cut, "epochs": epochs}))


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "| link | mode | cut | MB / epoch | epoch s | server s | transfer s | trainer s "
        "| bound s | speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["limit"]: r for r in rows if r["mode"] == "baseline"}
    for r in rows:
        speedup = base[r["limit"]]["epoch_s"] / r["epoch_s"]
        lines.append(
            f"| {r['limit']} | {r['mode']} | {r['cut']} | {r['bytes_per_epoch'] / 1e6:.2f} "
            f"| {r['epoch_s']:.2f} | {r['server_s']:.2f} | {r['transfer_s']:.2f} "
            f"| {r['trainer_s']:.2f} | {r['bound_s']:.2f} | {speedup:.2f}x |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limits = list(dict.fromkeys(r["limit"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.76 / len(modes)
    for i, mode in enumerate(modes):
        sel = [next(r for r in rows if r["limit"] == lim and r["mode"] == mode) for lim in limits]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(limits))]
        axes[0].bar(xs, [r["epoch_s"] for r in sel], width, label=f"{mode} achieved")
        axes[0].scatter(
            xs,
            [r["bound_s"] for r in sel],
            color="black",
            marker="_",
            s=300,
            zorder=3,
            label="pipeline bound" if i == 0 else None,
        )
        axes[1].bar(xs, [r["bytes_per_epoch"] / 1e6 for r in sel], width, label=mode)
    for ax, title, unit in ((axes[0], "epoch time", "s"), (axes[1], "bytes moved / epoch", "MB")):
        ax.set_xticks(range(len(limits)), limits)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.set_xlabel("egress limit")
        ax.legend(fontsize=7)
    fig.suptitle("ResNet-18 fine-tune: baseline vs pushdown (server and trainer on one core each)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write_results(table: str, args: argparse.Namespace) -> None:
    name = "e2e-compiled" if args.compiled else "e2e"
    if args.compiled:
        title = "## End to end: bf16 and compiled heads (`e2e.py --compiled`)"
        command = (
            f"python benchmarks/e2e.py --limits {args.limits} --compiled --repeats "
            f"{args.repeats} --results"
        )
        extra = (
            'Beside pushdown, pushdown with `head_dtype="bf16"`, and both on a second '
            "server (`--compile-heads always`) warmed by one-epoch jobs until its head was "
            "compiled (the compile not counted; the server's words on each compiled head "
            f"below the table). Ways interleaved in {args.repeats} rounds; each way's row is "
            "its median round. "
        )
    else:
        title = "## End to end: baseline vs pushdown"
        command, extra = "python benchmarks/e2e.py --results", ""
    heads = "".join(f"\n- {r['mode']}: {r['head']}" for r in _rows_with_head(args))
    if args.compiled:
        heads += "\n\n" + _against_pushdown(
            json.loads((args.out / "e2e-compiled.json").read_text())["rows"]
        )
    write_section(
        name,
        f"{title}\n\n`{command}` on {_machine()}; {args.model}, freeze "
        f"`{args.freeze}`, {args.images} synthetic JPEGs stored at {args.stored_size} px, "
        f"trained at {args.image_size} px, batch {args.batch_size}, wire {args.wire_dtype}; "
        f"epoch {args.epochs} of {args.epochs} reported. Server and trainer are two processes "
        f"pinned to one core each; the link is the server's egress token bucket. {extra}"
        f"`bound` = max(server, transfer, trainer) per epoch; data in `out/{name}.json`.\n\n"
        f"{table}\n{heads}\n\n![epoch time and bytes per link](out/{name}.png)",
    )


def _against_pushdown(rows: list[dict]) -> str:
    """Each other head's pushed-down epoch against eager fp32 pushdown's, per link."""
    parts = []
    for limit in dict.fromkeys(r["limit"] for r in rows):
        mine = {r["mode"]: r["epoch_s"] for r in rows if r["limit"] == limit}
        eager = mine.get("pushdown")
        others = [m for m in mine if m.startswith("pushdown, ")]
        if eager:
            cells = ", ".join(
                f"{m.removeprefix('pushdown, ')} {eager / mine[m]:.2f}x" for m in others
            )
            parts.append(f"{limit}: {cells}")
    return (
        "A pushed-down epoch against eager fp32 pushdown's, faster by (issue 52's goal for "
        "the compiled head: >= 1.5x, link not binding; each way's median round): "
        + "; ".join(parts)
        + "."
    )


def _rows_with_head(args: argparse.Namespace) -> list[dict]:
    if not args.compiled:
        return []
    rows = json.loads((args.out / "e2e-compiled.json").read_text())["rows"]
    return [r for r in rows if "head" in r]


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, CPU only"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _jsonable(d: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
