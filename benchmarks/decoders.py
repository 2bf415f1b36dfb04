"""Which JPEG decoder a sample should go through: Pillow (with `draft`, what hapi runs),
simplejpeg, PyTurboJPEG and torchvision's `decode_jpeg` (issue 52, item 3).

Each decoder turns the same bytes - photo-like JPEGs of ~100 KB at 440 px, as the other
benchmarks use - into an RGB uint8 array at the size hapi's eval transforms ask the
decoder for (`decoded_size`: the smallest DCT scale at least the resize's need, so 1/2
for 112 px and the full image for 224 px), and nothing after: the decoder's own work.
torchvision's `decode_jpeg` cannot scale as it decodes, so it decodes the full image at
both sizes. One core, one thread, the decoders interleaved, medians of the repeats; CPU
ms a sample. Pixels: each decoder's array against Pillow's, which `exact=True` promises.

    python benchmarks/decoders.py            # writes benchmarks/out/decoders.{json,png}
    python benchmarks/decoders.py --results  # ... and its section of benchmarks/RESULTS.md

Needs the bench extra's decoders (`pip install -e '.[bench]'`) and libjpeg-turbo's
TurboJPEG library (Debian: `libturbojpeg0`).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _host import machine, pin
from _results import write_section
from decode import _images
from PIL import Image

from hapi.data import Transforms
from hapi.data.images import decoded_size

HERE = Path(__file__).resolve().parent
Decoder = Callable[[bytes, tuple[int, int], tuple[int, int]], np.ndarray]
"""(the JPEG's bytes, the size to decode to, its stored size) -> RGB uint8, H x W x 3."""


def _pillow(data: bytes, size: tuple[int, int], full: tuple[int, int]) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    if size != full:
        image.draft(None, size)
    return np.asarray(image.convert("RGB"))


def _simplejpeg(data: bytes, size: tuple[int, int], full: tuple[int, int]) -> np.ndarray:
    import simplejpeg

    if size == full:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")  # type: ignore[no-any-return]
    return simplejpeg.decode_jpeg(  # type: ignore[no-any-return]
        data, colorspace="RGB", min_width=size[0], min_height=size[1]
    )


_TURBO: list[object] = []


def _turbojpeg(data: bytes, size: tuple[int, int], full: tuple[int, int]) -> np.ndarray:
    import turbojpeg

    if not _TURBO:
        _TURBO.append(turbojpeg.TurboJPEG())
    scale = max(
        n for n in (1, 2, 4, 8) if -(-full[0] // n) >= size[0] and -(-full[1] // n) >= size[1]
    )
    turbo = _TURBO[0]
    return turbo.decode(data, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=(1, scale))  # type: ignore[attr-defined, no-any-return]


def _torchvision(data: bytes, size: tuple[int, int], full: tuple[int, int]) -> np.ndarray:
    from torchvision.io import ImageReadMode, decode_jpeg

    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decode_jpeg(raw, mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()


DECODERS: dict[str, Decoder] = {
    "Pillow + draft": _pillow,
    "simplejpeg": _simplejpeg,
    "PyTurboJPEG": _turbojpeg,
    "torchvision decode_jpeg": _torchvision,
}


def measure(blobs: list[bytes], side: int, repeats: int) -> list[dict[str, object]]:
    """Each decoder's CPU ms a sample at `side`, and its pixels against Pillow's."""
    transforms = Transforms.eval(side)
    sizes = [(decoded_size(b, transforms, 0), Image.open(io.BytesIO(b)).size) for b in blobs]
    times: dict[str, list[float]] = {name: [] for name in DECODERS}
    names = list(DECODERS)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            decode = DECODERS[name]
            t0 = time.process_time()
            for blob, (size, full) in zip(blobs, sizes, strict=True):
                decode(blob, size or full, full)
            times[name].append((time.process_time() - t0) / len(blobs) * 1e3)
    reference = [_pillow(b, s or f, f) for b, (s, f) in zip(blobs, sizes, strict=True)]
    rows = []
    for name, decode in DECODERS.items():
        arrays = [decode(b, s or f, f) for b, (s, f) in zip(blobs, sizes, strict=True)]
        same_shape = all(a.shape == p.shape for a, p in zip(arrays, reference, strict=True))
        equal = max_diff = None
        if same_shape:
            diffs = [np.abs(a.astype(np.int16) - p) for a, p in zip(arrays, reference, strict=True)]
            equal = float(np.mean([np.mean(d == 0) for d in diffs]))
            max_diff = int(max(int(d.max()) for d in diffs))
        rows.append({
            "side": side, "decoder": name, "ms": statistics.median(times[name]),
            "runs_ms": times[name], "shape": list(arrays[0].shape),
            "equal_pixels": equal, "max_diff": max_diff,
        })  # fmt: skip
    return rows


def _report(data: dict[str, object]) -> str:
    rows: list[dict] = data["rows"]  # type: ignore[assignment,type-arg]
    lines = [
        "## JPEG decoders (`benchmarks/decoders.py`)",
        "",
        f"`python benchmarks/decoders.py --results` on {data['machine']}: {data['images']} "
        f"photo-like JPEGs of {data['kb']:.0f} KB at 440 px, each decoded to RGB uint8 at the "
        "size hapi's eval transforms ask the decoder for (1/2 scale for 112 px, full for "
        f"224 px); one core, one thread, decoders interleaved, medians of {data['repeats']} "
        "repeats. Pixels: against Pillow's.",
        "",
        "| side | decoder | CPU ms a sample | / Pillow | decoded to | identical pixels "
        "| max difference |",
        "|---|---|---|---|---|---|---|",
    ]
    pillow = {r["side"]: r["ms"] for r in rows if r["decoder"] == "Pillow + draft"}
    for r in rows:
        shape = "x".join(str(v) for v in r["shape"][:2])
        equal = f"{r['equal_pixels']:.1%}" if r["equal_pixels"] is not None else "- (full size)"
        diff = str(r["max_diff"]) if r["max_diff"] is not None else "-"
        lines.append(
            f"| {r['side']} | {r['decoder']} | {r['ms']:.2f} | {r['ms'] / pillow[r['side']]:.2f}x "
            f"| {shape} | {equal} | {diff} |"
        )
    return "\n".join(lines)


def _plot(data: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict] = data["rows"]  # type: ignore[assignment,type-arg]
    sides = sorted({r["side"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(DECODERS)
    for k, name in enumerate(DECODERS):
        values = [
            next(r["ms"] for r in rows if r["side"] == s and r["decoder"] == name) for s in sides
        ]
        ax.bar([i + k * width for i in range(len(sides))], values, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sides))], [f"{s} px" for s in sides])
    ax.set_ylabel("CPU ms a sample (one core)")
    ax.set_title("Decoding a ~100 KB JPEG for the model's input")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


ADOPTED = (
    "Adopted: simplejpeg decodes YCbCr and grayscale JPEGs on both tiers "
    "(`hapi.data.images._turbo`), with the same pixels as Pillow's `draft` (the unit tests "
    "hold them equal at every transform's size); CMYK JPEGs, which libjpeg-turbo converts "
    "to RGB 1 value apart from Pillow, and other formats go through Pillow. PyTurboJPEG is "
    "as fast but needs the system's libturbojpeg; torchvision's `decode_jpeg` cannot scale "
    "while decoding."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="112,224")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args()
    pin(0)
    torch.set_num_threads(1)
    blobs = _images(440, 440, args.images)
    rows = [
        row
        for side in map(int, args.sides.split(","))
        for row in measure(blobs, side, args.repeats)
    ]
    data = {
        "machine": machine(), "images": len(blobs), "repeats": args.repeats,
        "kb": sum(map(len, blobs)) / len(blobs) / 1e3, "rows": rows,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decoders.json").write_text(json.dumps(data, indent=1))
    _plot(data, args.out / "decoders.png")
    text = _report(data) + "\n\n" + ADOPTED + "\n\n![decoders](out/decoders.png)"
    print(text)
    if args.results:
        write_section("decoders", text)


if __name__ == "__main__":
    main()
