"""Opening stores from the command line: readers never create what they read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hapi.errors import ObjectNotFound

if TYPE_CHECKING:
    from hapi.data import Store, StoreOptions

__all__ = ["existing_repo", "existing_store", "store_options"]


def store_options(endpoint: str | None) -> StoreOptions | None:
    """The options of `--endpoint`; None leaves everything to the AWS variables."""
    from hapi.data import StoreOptions

    return StoreOptions(endpoint=endpoint) if endpoint else None


def existing_store(uri: str, options: StoreOptions | None, hint: str) -> Store:
    """Open a store that must already exist (a mistyped directory is not made).

    Args:
        uri: the store.
        options: S3 endpoint and credentials.
        hint: what to do when the directory is missing, added to the error.

    Raises:
        ObjectNotFound: `uri` is a local directory that does not exist.
    """
    from hapi.data import open_store

    try:
        return open_store(uri, options, create=False)
    except ObjectNotFound as exc:
        raise ObjectNotFound(f"{exc}: check the path, or {hint}") from None


def existing_repo(uri: str, options: StoreOptions | None) -> Store:
    """The store of a model repository that must already exist; see `existing_store`."""
    return existing_store(
        uri,
        options,
        f"push a model there first (`hapi repo push NAME --model resnet18 --repo {uri}`)",
    )
