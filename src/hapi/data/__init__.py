"""Data in object stores: the store facade, dataset manifests, seeded transforms."""

from hapi.data.images import decode_image, load_sample
from hapi.data.manifest import IMAGE_EXTENSIONS, Manifest
from hapi.data.store import ObjectStore, Store, StoreOptions, open_store
from hapi.data.synth import import_folder, synth_dataset, synth_image
from hapi.data.transforms import (
    CenterCrop,
    HorizontalFlip,
    Normalize,
    RandomResizedCrop,
    Resize,
    Transforms,
    sample_seed,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "CenterCrop",
    "HorizontalFlip",
    "Manifest",
    "Normalize",
    "ObjectStore",
    "RandomResizedCrop",
    "Resize",
    "Store",
    "StoreOptions",
    "Transforms",
    "decode_image",
    "import_folder",
    "load_sample",
    "open_store",
    "sample_seed",
    "synth_dataset",
    "synth_image",
]
