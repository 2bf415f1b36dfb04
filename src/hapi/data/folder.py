"""Uploading a local ImageFolder tree (`<dir>/<class>/<image>`) into a store."""

from __future__ import annotations

from pathlib import Path

from hapi.data.dataset_manifest import IMAGE_EXTENSIONS, DatasetManifest
from hapi.data.store import ObjectStore
from hapi.data.store.upload import Progress, put_all
from hapi.errors import ObjectNotFound

__all__ = ["import_folder", "local_images"]


def local_images(directory: str | Path) -> list[Path]:
    """The image files of a local ImageFolder tree, sorted.

    The same rule as `DatasetManifest.from_store`: files in class folders (at any depth below
    them) with an image extension; files directly in `directory` and paths with a part
    starting with `.` are left out.

    Raises:
        ObjectNotFound: `directory` is not a directory, or holds no images in class folders.
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ObjectNotFound(f"{str(root)!r} is not a directory: give a local ImageFolder tree")
    files = sorted(
        p
        for p in root.glob("*/**/*")
        if p.is_file()
        and p.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise ObjectNotFound(
            f"no images in class folders under {str(root)!r}: expected <dir>/<class>/<name>.jpg"
        )
    return files


def import_folder(
    directory: str | Path, store: ObjectStore, prefix: str = "", *, progress: Progress | None = None
) -> DatasetManifest:
    """Upload a local ImageFolder tree under `prefix`, keeping its class folders.

    Args:
        directory: the tree's root: `<directory>/<class>/<image>`.
        store: where to write.
        prefix: the dataset's folder in the store; `""` for the store's root.
        progress: called with the number of images uploaded so far.

    Returns:
        The manifest of everything under `prefix`, as `DatasetManifest.from_store` lists it.

    Raises:
        ObjectNotFound: the directory does not exist or holds no class folders of images.
    """
    root = Path(directory).expanduser()
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    items = ((base + p.relative_to(root).as_posix(), p.read_bytes()) for p in local_images(root))
    put_all(store, items, progress=progress)
    return DatasetManifest.from_store(store, prefix)
