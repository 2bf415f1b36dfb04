"""Decoding at a reduced size: a sample's decode-and-transform time, full against reduced.

`Transforms.reduced_decode` (on by default) lets a JPEG decoder scale by 1/2, 1/4 or 1/8
as it decodes, down to what the first op's output needs. This measures `load_sample`,
the function both tiers run for every sample, with it off and on: per-sample CPU time
(one core, one torch thread, the two settings interleaved, medians of the repeats) and
how close the samples are (PSNR of the reduced sample against the full decode's, on
[0, 1] pixel values before `Normalize`). Two kinds of image: photos of ~100 KB at 440 px,
as the other benchmarks use (ImageNet's mean is ~110 KB at ~400 x 350), and 12-megapixel
camera frames (4032 x 3024); each at the training pipeline (`Transforms.train`) and the
evaluation one (`Transforms.eval`), at 64, 112 and 224 px.

    python benchmarks/decode.py                 # writes benchmarks/out/decode.{json,png}
    python benchmarks/decode.py --results       # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from _host import machine, pin
from _results import DETAILS, write_section
from PIL import Image

from hapi.data import Transforms, load_sample, sample_seed, synth_image
from hapi.data.ops import IMAGENET_MEAN, IMAGENET_STD

HERE = Path(__file__).resolve().parent
KINDS = {"photo": (440, 440, 64), "camera": (4032, 3024, 12)}
"""Image kind: (width, height, how many)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,112,224", help="the model's input sides")
    parser.add_argument("--kinds", default="photo,camera", help=f"of {sorted(KINDS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args()
    pin(0)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = []
    for kind in args.kinds.split(","):
        width, height, count = KINDS[kind]
        blobs = _images(width, height, count)
        kb = sum(map(len, blobs)) / len(blobs) / 1e3
        for pipeline in ("train", "eval"):
            for size in map(int, args.sizes.split(",")):
                row = _measure(blobs, pipeline, size, args.repeats)
                row.update(kind=kind, width=width, height=height, kb=kb)
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "machine": machine(),
        "args": vars(args) | {"out": str(args.out)},
        "minutes": (time.time() - started) / 60,
        "rows": rows,
    }
    (args.out / "decode.json").write_text(json.dumps(result, indent=1))
    _plot(rows, args.out / "decode.png")
    if args.results:
        write_section("decode", _report(rows, args))


def _images(width: int, height: int, count: int) -> list[bytes]:
    """Photo-like JPEGs (quality 90) of that size, as `hapi.data.synth` draws them."""
    rng = np.random.default_rng(0)
    blobs = []
    for i in range(count):
        buf = io.BytesIO()
        image = synth_image(i % 4, 4, max(width, height), rng).crop((0, 0, width, height))
        image.save(buf, "JPEG", quality=90)
        blobs.append(buf.getvalue())
    return blobs


def _measure(blobs: list[bytes], pipeline: str, size: int, repeats: int) -> dict[str, object]:
    reduced = getattr(Transforms, pipeline)(size)
    full = dataclasses.replace(reduced, reduced_decode=False)
    seeds = [sample_seed(0, 0, str(i)) for i in range(len(blobs))]
    times: dict[str, list[float]] = {"full": [], "reduced": []}
    samples: dict[str, list[torch.Tensor]] = {}
    for r in range(repeats):
        # Interleaved, the order alternating, so drift on a shared machine hits both.
        for name in ("full", "reduced") if r % 2 == 0 else ("reduced", "full"):
            transforms = full if name == "full" else reduced
            t0 = time.process_time()
            out = [
                load_sample(b, str(i), transforms, s)
                for i, (b, s) in enumerate(zip(blobs, seeds, strict=True))
            ]
            times[name].append((time.process_time() - t0) / len(blobs) * 1e3)
            samples[name] = out
    std = torch.tensor(IMAGENET_STD)[:, None, None]
    mse = statistics.fmean(
        float(torch.mean(((a - b) * std) ** 2))
        for a, b in zip(samples["full"], samples["reduced"], strict=True)
    )
    scaled = [_scaled(b, reduced, s) for b, s in zip(blobs, seeds, strict=True)]
    full_ms, reduced_ms = statistics.median(times["full"]), statistics.median(times["reduced"])
    return {
        "pipeline": pipeline,
        "size": size,
        "full_ms": full_ms,
        "reduced_ms": reduced_ms,
        "speedup": full_ms / reduced_ms,
        "full_ms_runs": times["full"],
        "reduced_ms_runs": times["reduced"],
        "psnr_db": 10 * math.log10(1 / mse) if mse > 0 else None,
        "reduced_share": sum(scaled) / len(blobs),
    }


def _scaled(data: bytes, transforms: Transforms, seed: int) -> bool:
    """Whether the decoder scales this image down for this sample, as `load_sample` asks."""
    image = Image.open(io.BytesIO(data))
    full = image.size
    image.draft(None, transforms.decode_size(*full, seed=seed))
    return image.size != full


def _report(rows: list[dict], args: argparse.Namespace) -> str:  # type: ignore[type-arg]
    lines = [
        "## Decoding at a reduced size",
        "",
        f"`python benchmarks/decode.py --results` on {machine()}; `load_sample` (what both "
        "tiers run per sample) with `reduced_decode` off and on, pinned to one core, one "
        f"torch thread, interleaved, median of {args.repeats} repeats; CPU ms per sample. "
        "PSNR: the reduced sample against the full decode's, on [0, 1] pixels "
        f"(mean {IMAGENET_MEAN} undone). Reduced: the share of samples the decoder scaled.",
        "",
        "![decode](out/decode.png)",
        DETAILS,
        "| images | pipeline | size | full ms | reduced ms | speed-up | PSNR dB | reduced |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        psnr = "identical" if r["psnr_db"] is None else f"{r['psnr_db']:.1f}"
        lines.append(
            f"| {r['kind']} {r['width']}x{r['height']} ({r['kb']:.0f} KB) | {r['pipeline']} | "
            f"{r['size']} | {r['full_ms']:.2f} | {r['reduced_ms']:.2f} | {r['speedup']:.2f}x | "
            f"{psnr} | {r['reduced_share']:.0%} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        mine = [r for r in rows if r["kind"] == kind]
        x = np.arange(len(mine))
        ax.bar(x - 0.2, [r["full_ms"] for r in mine], 0.4, label="full decode")
        ax.bar(x + 0.2, [r["reduced_ms"] for r in mine], 0.4, label="reduced decode")
        for i, r in enumerate(mine):
            ax.text(
                i + 0.2,
                r["reduced_ms"],
                f"{r['speedup']:.1f}x",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(x, [f"{r['pipeline']}\n{r['size']} px" for r in mine], fontsize=7)
        ax.set_ylabel("CPU ms per sample")
        ax.set_title(
            f"{kind} {mine[0]['width']}x{mine[0]['height']}, {mine[0]['kb']:.0f} KB", fontsize=9
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
