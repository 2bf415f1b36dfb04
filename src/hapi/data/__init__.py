"""Data in object stores: the store facade, dataset manifests, seeded transforms.

Names load on first use: `from hapi.data import StoreOptions` must not import torch
(seconds), because the CLI and the server's configuration need only the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hapi._lazy import lazy_exports

__all__ = [
    "IMAGE_EXTENSIONS",
    "CenterCrop",
    "DatasetManifest",
    "DatasetSummary",
    "HorizontalFlip",
    "Normalize",
    "ObjectStore",
    "RandomResizedCrop",
    "Resize",
    "Sample",
    "Skipped",
    "Store",
    "StoreOptions",
    "Transforms",
    "decode_image",
    "decoded_size",
    "import_folder",
    "load_sample",
    "load_samples",
    "local_images",
    "open_dataset",
    "open_store",
    "read_objects",
    "sample_seed",
    "skip_or_raise",
    "summarize",
    "synth_dataset",
    "synth_image",
]

_WHERE = {
    "IMAGE_EXTENSIONS": ".dataset_manifest",
    "CenterCrop": ".ops",
    "DatasetManifest": ".dataset_manifest",
    "DatasetSummary": ".dataset",
    "HorizontalFlip": ".ops",
    "Normalize": ".ops",
    "ObjectStore": ".store",
    "RandomResizedCrop": ".ops",
    "Resize": ".ops",
    "Sample": ".samples",
    "Skipped": ".samples",
    "Store": ".store",
    "StoreOptions": ".store",
    "Transforms": ".transforms",
    "decode_image": ".images",
    "decoded_size": ".images",
    "import_folder": ".folder",
    "load_sample": ".images",
    "load_samples": ".samples",
    "local_images": ".folder",
    "open_dataset": ".dataset",
    "open_store": ".store",
    "read_objects": ".samples",
    "sample_seed": ".transforms",
    "skip_or_raise": ".samples",
    "summarize": ".dataset",
    "synth_dataset": ".synth",
    "synth_image": ".synth",
}

if TYPE_CHECKING:
    from hapi.data.dataset import DatasetSummary, open_dataset, summarize
    from hapi.data.dataset_manifest import IMAGE_EXTENSIONS, DatasetManifest
    from hapi.data.folder import import_folder, local_images
    from hapi.data.images import decode_image, decoded_size, load_sample
    from hapi.data.ops import CenterCrop, HorizontalFlip, Normalize, RandomResizedCrop, Resize
    from hapi.data.samples import Sample, Skipped, load_samples, read_objects, skip_or_raise
    from hapi.data.store import ObjectStore, Store, StoreOptions, open_store
    from hapi.data.synth import synth_dataset, synth_image
    from hapi.data.transforms import Transforms, sample_seed


__getattr__, __dir__ = lazy_exports(__name__, globals(), _WHERE)
