"""Synthetic labelled images: datasets for tests, the demo and benchmarks, made offline.

Nothing may download a dataset here, so hapi makes its own. Each class has its own
colour and its own stripe orientation and frequency; every image adds a random stripe
phase, distractor blobs (alike for all classes) and sensor-like noise, all drawn from the
seed. That is easy to learn from pre-trained features (a nearest-centroid on mean colour
already separates the classes), and the noise makes the JPEGs about as large per pixel as
photographs are.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
from PIL import Image

from hapi.data.dataset_manifest import DatasetManifest
from hapi.data.store import ObjectStore
from hapi.data.store.upload import Progress, put_all
from hapi.errors import InvalidRequest

__all__ = ["class_name", "synth_dataset", "synth_image"]


def class_name(label: int, classes: int) -> str:
    """The folder name of class `label`: `class_3`, zero-padded so names sort as numbers."""
    return f"class_{label:0{len(str(classes - 1))}d}"


def synth_image(label: int, classes: int, size: int, rng: np.random.Generator) -> Image.Image:
    """One RGB image of class `label` out of `classes`, `size` x `size` pixels."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle = np.pi * label / classes
    freq = 4 + 2 * (label % 3)
    phase = rng.uniform(0, 2 * np.pi)
    stripes = np.sin(2 * np.pi * freq * (xx * np.cos(angle) + yy * np.sin(angle)) + phase)
    # Hues evenly spaced round the colour wheel: the mean colours of classes differ.
    turn = 2 * np.pi * (label / classes + np.array([0, 1 / 3, 2 / 3]))
    hue = np.cos(turn).astype(np.float32)
    base = 0.5 + 0.3 * hue + rng.normal(0, 0.05, 3).astype(np.float32)
    img = base[None, None, :] + 0.25 * stripes[..., None] * (0.6 + 0.4 * hue[None, None, :])
    for _ in range(rng.integers(1, 4)):
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.2)
        mask = ((yy - cy) ** 2 + (xx - cx) ** 2) < r * r
        img[mask] = rng.uniform(0, 1, 3)
    img += rng.normal(0, 0.08, img.shape).astype(np.float32)
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8), "RGB")


def synth_dataset(
    store: ObjectStore,
    prefix: str = "",
    *,
    classes: int = 4,
    per_class: int = 32,
    size: int = 112,
    seed: int = 0,
    quality: int = 90,
    progress: Progress | None = None,
) -> DatasetManifest:
    """Write a labelled JPEG dataset `<prefix>/class_<c>/<i:05d>.jpg`; return its manifest.

    Write a train and a validation split as two prefixes with different seeds:
    `synth_dataset(store, "train", seed=0)`, `synth_dataset(store, "val", seed=1)`.

    Args:
        store: where to write.
        prefix: the dataset's folder in the store; `""` for the store's root.
        classes: number of classes, >= 2.
        per_class: images per class, >= 1.
        size: image side in pixels, >= 8.
        seed: the same seed (and arguments) writes the same bytes.
        quality: JPEG quality, 1 to 95.
        progress: called with the number of images written so far.

    Returns:
        The manifest of everything under `prefix`, as `DatasetManifest.from_store` lists it.

    Raises:
        InvalidRequest: an argument out of range.
    """
    if classes < 2 or per_class < 1 or size < 8 or not 1 <= quality <= 95:
        raise InvalidRequest(
            "synth needs classes >= 2, per_class >= 1, size >= 8 and 1 <= quality <= 95; got "
            f"classes={classes}, per_class={per_class}, size={size}, quality={quality}"
        )
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""

    def images() -> Iterator[tuple[str, bytes]]:
        # One generator drawn in a fixed order: the bytes depend on the seed only.
        rng = np.random.default_rng(seed)
        for i in range(per_class):
            for label in range(classes):
                buf = io.BytesIO()
                synth_image(label, classes, size, rng).save(buf, "JPEG", quality=quality)
                yield f"{base}{class_name(label, classes)}/{i:05d}.jpg", buf.getvalue()

    put_all(store, images(), progress=progress)
    return DatasetManifest.from_store(store, prefix)
