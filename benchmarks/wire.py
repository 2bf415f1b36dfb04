"""Wire codecs: bytes per sample at two cuts of seven models, codec CPU, int8's and fp8's
accuracy, and the plan's predicted epoch with and without codecs.

1. Bytes: seven models at 224 px (random init, but EfficientNet-Lite0 with its ImageNet
   weights) run on photo-like JPEGs (~100 KB at 440 px, as the other benchmarks use);
   at the last frozen cut (`default_freeze`) and the cut before the last stage, each
   codec's bytes on the wire per sample (the packed batch's, `measure_codec`) against
   the mean JPEG, with encode (server) and decode (trainer) CPU per sample.
2. Accuracy: `hapi demo`'s task (EfficientNet-Lite0, ImageNet weights, a linear probe at
   112 px) and ResNet-18 fine-tuning its last stage, trained with fp32, int8 and fp8 features
   from a real server; the evaluation set is 4x the demo's, so one image is 0.4 points.
3. Plan: ResNet-18 at 224 px frozen to layer3, profiled here; the planner's predicted
   epoch at 10 Mbit/s and 1 Gbit/s with fp32 only, lossless codecs, and all codecs.

    python benchmarks/wire.py             # writes benchmarks/out/wire.{json,png}
    python benchmarks/wire.py --results   # ... and its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _host import machine
from _results import DETAILS, write_section

from hapi.client import TransferJob
from hapi.data import Transforms, load_sample, open_store, synth_dataset, synth_image
from hapi.graph import ModelGraph, ModelSpec, build_model, trace
from hapi.plan import LinkProfile, Workload
from hapi.plan.codecs import CodecProfile, choose_codec
from hapi.plan.defaults import default_freeze
from hapi.plan.measure import measure_decode, measure_server, measure_trainer
from hapi.server import serve
from hapi.wire.codec_cost import CodecCost, measure_codec

HERE = Path(__file__).resolve().parent
MODELS = {
    "resnet18": ("resnet18", None, "layer3"),
    "resnet50": ("resnet50", None, "layer3"),
    "vgg11": ("vgg11", None, "features.15"),
    "vgg19": ("vgg19", None, "features.27"),
    "densenet121": ("densenet121", None, "features.transition3"),
    "vit_b_16": ("vit_b_16", {"image_size": 224}, "encoder.layers.encoder_layer_10"),
    "efficientnet_lite0": ("efficientnet_lite0", None, "_blocks.14"),
}
"""Name: (model, its config, the cut before its last stage)."""
CODECS = [
    ("fp32", "none"),
    ("fp16", "none"),
    ("fp32", "zstd"),
    ("fp16", "zstd"),
    ("int8", "none"),
    ("int8", "zstd"),
    ("int8", "lz4"),
    ("fp8", "none"),
    ("fp8", "zstd"),
]
MBIT = 1e6 / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8, help="images per model")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--results", action="store_true", help="write benchmarks/RESULTS.md")
    parser.add_argument("--from-json", type=Path, help="report a saved run (its wire.json) again")
    args = parser.parse_args()
    if args.from_json:
        text = _section(json.loads(args.from_json.read_text()))
        print(text)
        if args.results:
            write_section("wire", text)
        return
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    blobs = _photos(args.samples)
    jpeg = statistics.fmean(map(len, blobs))
    x = torch.stack([load_sample(b, str(i), Transforms.eval(224), 0) for i, b in enumerate(blobs)])
    rows = [row for name in args.models.split(",") for row in _bytes(name, x, jpeg)]
    accuracy = [] if args.skip_accuracy else _accuracy()
    plans = _plans(blobs, x)
    out = {
        "machine": machine(),
        "jpeg_bytes": jpeg,
        "bytes": rows,
        "accuracy": accuracy,
        "plans": plans,
        "seconds": time.time() - started,
    }
    (args.out / "wire.json").write_text(json.dumps(out, indent=1))
    _plot(rows, args.out / "wire.png")
    text = _section(out)
    print(text)
    if args.results:
        write_section("wire", text)


def _photos(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    blobs = []
    for i in range(n):
        buf = io.BytesIO()
        synth_image(i % 4, 4, 440, rng).save(buf, "JPEG", quality=90)
        blobs.append(buf.getvalue())
    return blobs


def _graph(name: str, size: int) -> ModelGraph:
    model, config, _ = MODELS[name]
    weights = "imagenet" if model == "efficientnet_lite0" else None
    return trace(
        build_model(ModelSpec(name=model, config=config, weights=weights)), (3, size, size)
    )


def _bytes(name: str, x: torch.Tensor, jpeg: float) -> list[dict[str, object]]:
    graph = _graph(name, 224)
    last = default_freeze(graph).freeze
    before = graph.resolve_freeze(MODELS[name][2])
    rows = []
    for where, cut in (("last frozen", last), ("before last stage", before)):
        with torch.inference_mode():
            features = graph.head(cut).eval()(x)
        for dtype, compression in CODECS:
            cost = measure_codec(features, dtype, compression)  # type: ignore[arg-type]
            rows.append(
                {
                    "model": name,
                    "where": where,
                    "cut": graph.cut_point(cut).name,
                    "codec": dtype if compression == "none" else f"{dtype}+{compression}",
                    "bytes": cost.bytes_per_sample,
                    "of_jpeg": cost.bytes_per_sample / jpeg,
                    "encode_ms": cost.encode_s * 1e3,
                    "decode_ms": cost.decode_s * 1e3,
                }
            )
        print(name, where, graph.cut_point(cut).name, flush=True)
    return rows


def _accuracy() -> list[dict[str, object]]:
    """fp32 against int8 and fp8 features on the demo's task, and ResNet-18's last stage."""
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="hapi-wire-") as root:
        store = open_store(root)
        synth_dataset(store, "train", classes=4, per_class=48, size=320, seed=0)
        synth_dataset(store, "val", classes=4, per_class=64, size=320, seed=1)
        with serve(store=root) as server:
            for model, weights, freeze, lr in (
                ("efficientnet_lite0", "imagenet", "_avg_pooling+view", 0.02),
                ("resnet18", None, "layer3", 0.01),
            ):
                for dtype in ("fp32", "int8", "fp8"):
                    spec = ModelSpec(name=model, weights=weights, num_classes=4, seed=0)
                    job = TransferJob(
                        spec, "train", server.address, eval_dataset="val", freeze=freeze,
                        cut=None, image_size=112, batch_size=32, wire_dtype=dtype,
                        wire_compression="zstd", seed=0, reuse_profiles=False,
                    )  # fmt: skip
                    optimizer = torch.optim.SGD(job.trainable_parameters, lr=lr, momentum=0.9)
                    job.fit(2, optimizer)
                    result = job.evaluate()
                    results.append(
                        {
                            "model": model,
                            "freeze": freeze,
                            "wire_dtype": dtype,
                            "accuracy": result.accuracy,
                            "loss": result.loss,
                            "samples": result.samples,
                            "train_bytes": sum(e.bytes_received for e in job.history.epochs),
                        }
                    )
                    print(results[-1], flush=True)
    return results


def _plans(blobs: list[bytes], x: torch.Tensor) -> list[dict[str, object]]:
    """The planner's choice for ResNet-18 frozen to layer3, with and without codecs."""
    graph = _graph("resnet18", 224)
    freeze = graph.resolve_freeze("layer3")
    decode_s = measure_decode(blobs, Transforms.train(224))
    jpeg = statistics.fmean(map(len, blobs))
    server = measure_server(graph, freeze, read_s=0.0, decode_s=decode_s, raw_bytes=jpeg)
    trainer = measure_trainer(graph, freeze, decode_s=decode_s, batch_size=32)
    with torch.inference_mode():
        per_cut = [x] + [graph.head(k).eval()(x) for k in range(1, freeze + 1)]
    base = [measure_codec(f, "fp32", "none") for f in per_cut]
    codecs = [_codec(per_cut, base, d, c) for d, c in CODECS]
    names = [p.name for p in graph.cut_points]
    work = Workload(samples=10_000, chunk_size=64, prefetch=4)
    rows: list[dict[str, object]] = []
    # This CPU trains layer4 at 224 px slower than a 10 Mbit/s link carries layer3: the
    # trainer binds and no codec can help. A GPU trainer, its profile this one's / 50, is
    # where the link binds.
    for rate, speedup in ((10 * MBIT, 1), (10 * MBIT, 50), (1000 * MBIT, 1), (1000 * MBIT, 50)):
        scaled = trainer.scaled(1 / speedup)
        link = LinkProfile(bytes_per_s=rate, latency_s=0.001)
        for label, weighed, lossy in (
            ("fp32 only", codecs[:1], False),
            ("lossless codecs", codecs, False),
            ("all codecs", codecs, True),
        ):
            choice = choose_codec(
                weighed, server, scaled, link, work, freeze=freeze, names=names, lossy=lossy
            )
            rows.append(
                {
                    "mbit": rate / MBIT,
                    "trainer": "this CPU" if speedup == 1 else f"CPU / {speedup}",
                    "codecs": label,
                    "codec": choice.codec.label,
                    "option": choice.plan.chosen.label,
                    "epoch_s": choice.plan.epoch_s,
                    "reason": choice.plan.reason,
                }
            )
            print(rows[-1]["mbit"], speedup, label, choice.plan.reason[:160], flush=True)
    return rows


def _codec(
    per_cut: list[torch.Tensor], base: list[CodecCost], dtype: str, compression: str
) -> CodecProfile:
    costs = [measure_codec(f, dtype, compression) for f in per_cut]  # type: ignore[arg-type]
    return CodecProfile(
        wire_dtype=dtype,
        compression=compression,
        out_bytes=tuple(round(c.bytes_per_sample) for c in costs),
        encode_s=tuple(max(0.0, c.encode_s - b.encode_s) for c, b in zip(costs, base, strict=True)),
        decode_s=tuple(max(0.0, c.decode_s - b.decode_s) for c, b in zip(costs, base, strict=True)),
        lossy=dtype != "fp32",
    )


def _plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    models = list(dict.fromkeys(str(r["model"]) for r in rows))
    codecs = list(dict.fromkeys(str(r["codec"]) for r in rows))
    width = 0.8 / len(codecs)
    for ax, where in zip(axes, ("last frozen", "before last stage"), strict=True):
        for i, codec in enumerate(codecs):
            values = [
                next(float(r["of_jpeg"]) for r in rows  # type: ignore[arg-type]
                     if r["model"] == m and r["where"] == where and r["codec"] == codec)
                for m in models
            ]  # fmt: skip
            ax.bar(np.arange(len(models)) + i * width, values, width, label=codec)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(f"at the {where} cut")
        ax.set_xticks(np.arange(len(models)) + 0.4, models, rotation=30, fontsize=8)
    axes[0].set_ylabel("bytes per sample / mean JPEG")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _section(out: dict) -> str:
    rows, jpeg = out["bytes"], out["jpeg_bytes"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    lines = [
        "## Wire codecs (`benchmarks/wire.py`)",
        "",
        f"Machine: {out['machine']}. Mean JPEG {jpeg / 1e3:.0f} KB. Command: "
        "`python benchmarks/wire.py --results` "
        f"({out['seconds'] / 60:.0f} min). Plot: `out/wire.png`.",
        "",
    ]
    tables: list[str] = []  # the byte tables go to out/wire.md; their summaries stay
    for where in ("last frozen", "before last stage"):
        tables += [
            f"Bytes per sample at the {where} cut, as a fraction of the JPEG "
            "(encode / decode ms per sample for int8+zstd):",
            "",
            "| model | cut | " + " | ".join(codecs) + " | int8+zstd ms |",
            "|---|---|" + "---|" * (len(codecs) + 1),
        ]
        for m in models:
            mine = {r["codec"]: r for r in rows if r["model"] == m and r["where"] == where}
            z = mine["int8+zstd"]
            tables.append(
                f"| {m} | {z['cut']} | "
                + " | ".join(f"{mine[c]['of_jpeg']:.3g}" for c in codecs)
                + f" | {z['encode_ms']:.2f} / {z['decode_ms']:.2f} |"
            )
        medians = {
            c: statistics.median(
                1 / r["of_jpeg"] for r in rows if r["where"] == where and r["codec"] == c
            )
            for c in codecs
        }
        under = {
            c: sum(1 for r in rows if r["where"] == where and r["codec"] == c and r["of_jpeg"] <= 1)
            for c in codecs
        }
        tables.append("")
        lines += [
            f"At the {where} cut, median x fewer bytes than the JPEG: "
            + ", ".join(f"{c} {medians[c]:.2g}x" for c in codecs)
            + ". Models at most the JPEG: "
            + ", ".join(f"{c} {under[c]}/{len(models)}" for c in codecs)
            + ".",
            "",
        ]
    if out["accuracy"]:
        dtypes = list(dict.fromkeys(r["wire_dtype"] for r in out["accuracy"]))
        lines += [
            "| accuracy (2 epochs, 256 val images; +zstd) | " + " | ".join(dtypes) + " |",
            "|---|" + "---|" * len(dtypes),
        ]
        for model in dict.fromkeys(r["model"] for r in out["accuracy"]):
            acc = {r["wire_dtype"]: r for r in out["accuracy"] if r["model"] == model}
            lines.append(
                f"| {model} (freeze {acc['fp32']['freeze']}) | "
                + " | ".join(
                    f"{acc[d]['accuracy']:.2%} (loss {acc[d]['loss']:.3f})" for d in dtypes
                )
                + " |"
            )
        lines.append("")
    lines += [
        DETAILS,
        *tables,
        "Plan for ResNet-18 at 224 px frozen to layer3 (*predicted* epoch of 10,000 samples; "
        "the same choices measured on real epochs through a shaped link: [Wire codecs "
        "measured](../RESULTS.md#wire-codecs-measured-epochs-through-a-shaped-link-benchmarkswire_epochspy)):",
        "",
        "| link | trainer | fp32 only | lossless codecs | all codecs |",
        "|---|---|---|---|---|",
    ]
    for mbit, trainer in dict.fromkeys((r["mbit"], r["trainer"]) for r in out["plans"]):
        cells = [r for r in out["plans"] if (r["mbit"], r["trainer"]) == (mbit, trainer)]
        lines.append(
            f"| {mbit:.0f} Mbit/s | {trainer} | "
            + " | ".join(f"{r['epoch_s']:.0f} s ({r['codec']}, {r['option']})" for r in cells)
            + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
