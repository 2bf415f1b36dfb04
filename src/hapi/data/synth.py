"""Synthetic labelled images, and uploading a local ImageFolder tree.

Nothing may download a dataset here, so tests, the demo and the benchmarks make their
own: each class has its own colour and stripe orientation, and every image adds random
phase, blobs and sensor-like noise. That is easy to learn from pre-trained features, and
the noise makes the JPEGs about as large per pixel as photographs are.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from hapi.data.manifest import IMAGE_EXTENSIONS, Manifest
from hapi.data.store import ObjectStore
from hapi.errors import InvalidRequest, ObjectNotFound

__all__ = ["import_folder", "synth_dataset", "synth_image"]

Progress = Callable[[int], None]


def synth_image(label: int, classes: int, size: int, rng: np.random.Generator) -> Image.Image:
    """One image of class `label` out of `classes`, `size` x `size` pixels."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle = np.pi * label / classes
    freq = 4 + 2 * (label % 3)
    stripes = np.sin(2 * np.pi * freq * (xx * np.cos(angle) + yy * np.sin(angle)) + rng.uniform(0, 6.3))
    hue = np.array(
        [np.cos(2 * np.pi * label / classes), np.cos(2 * np.pi * (label / classes + 1 / 3)),
         np.cos(2 * np.pi * (label / classes + 2 / 3))], np.float32,
    )  # fmt: skip
    base = 0.5 + 0.3 * hue + rng.normal(0, 0.05, 3).astype(np.float32)
    img = base[None, None, :] + 0.25 * stripes[..., None] * (0.6 + 0.4 * hue[None, None, :])
    for _ in range(rng.integers(1, 4)):  # distractor blobs, the same for every class
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
) -> Manifest:
    """Write a labelled JPEG dataset `<prefix>/class_<i>/<n>.jpg` and return its manifest.

    Args:
        store: where to write.
        prefix: the dataset's prefix in the store.
        classes: number of classes (>= 2).
        per_class: images per class.
        size: image side in pixels.
        seed: the same seed writes the same bytes.
        quality: JPEG quality.
        progress: called with the number of images written so far.
    """
    if classes < 2 or per_class < 1 or size < 8:
        raise InvalidRequest(
            f"synth needs classes >= 2, per_class >= 1 and size >= 8; got {classes}, "
            f"{per_class}, {size}"
        )
    rng = np.random.default_rng(seed)
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    written = 0
    for i in range(per_class):
        for label in range(classes):
            buf = io.BytesIO()
            synth_image(label, classes, size, rng).save(buf, "JPEG", quality=quality)
            store.put(f"{base}class_{label}/{i:05d}.jpg", buf.getvalue())
            written += 1
            if progress is not None:
                progress(written)
    return Manifest.from_store(store, prefix)


def import_folder(
    directory: str | Path, store: ObjectStore, prefix: str = "", *, progress: Progress | None = None
) -> Manifest:
    """Upload a local ImageFolder tree (`<dir>/<class>/<image>`) under `prefix`.

    Raises:
        ObjectNotFound: the directory does not exist or holds no class folders of images.
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ObjectNotFound(f"{str(root)!r} is not a directory")
    files = sorted(
        p for p in root.glob("*/**/*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    )
    if not files:
        raise ObjectNotFound(
            f"no images in class folders under {str(root)!r}: expected <dir>/<class>/<name>.jpg"
        )
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    for n, path in enumerate(files, 1):
        store.put(base + path.relative_to(root).as_posix(), path.read_bytes())
        if progress is not None:
            progress(n)
    return Manifest.from_store(store, prefix)
