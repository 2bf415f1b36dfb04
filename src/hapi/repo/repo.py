"""`ModelRepo`: derived models stored once, with lineage, queries and partial loads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi.data.store import ObjectStore, StoreOptions, open_store
from hapi.errors import InvalidRequest, ObjectNotFound, RefNotFound
from hapi.repo.index.catalog import Catalog
from hapi.repo.index.catalog_path import default_catalog_path
from hapi.repo.index.lineage import LineageNode, ancestors, descendants, forest, lineage_tree
from hapi.repo.index.queries import PrefixMatch, find_versions, prefix_matches
from hapi.repo.index.resolve import lookup, not_found
from hapi.repo.index.sync import forget_manifest, sync_all, sync_changed, sync_name
from hapi.repo.index.version import ModelVersion, PushedVersion
from hapi.repo.ops.diff import ModelDiff, diff_manifests
from hapi.repo.ops.fetch import fetch_tensors
from hapi.repo.ops.fsck import FsckReport, check_repository
from hapi.repo.ops.gc import GcReport, collect_garbage
from hapi.repo.ops.heads import HeadInfo, finish_head, plan_head, trace_version
from hapi.repo.ops.matching import check_matches, few, layer_ids
from hapi.repo.ops.push import PushTransaction, build_manifest
from hapi.repo.ops.usage import RepoUsage, measure_usage
from hapi.repo.storage.encoder import encoder_for
from hapi.repo.storage.epoch import mark_changed
from hapi.repo.storage.layout import manifest_key
from hapi.repo.storage.locks import Locks
from hapi.repo.storage.manifest import VersionManifest
from hapi.repo.storage.refs import check_name
from hapi.repo.storage.repo_config import RepoConfig

if TYPE_CHECKING:
    from hapi.graph import ModelGraph

__all__ = ["ModelRepo"]

RefLike = str | ModelVersion
ModelLike = nn.Module | Mapping[str, torch.Tensor]


class ModelRepo:
    """A model repository in an object store. Open it with `ModelRepo.open`.

    The store holds everything (tensor blobs, manifests, refs); the catalog is a local
    index rebuilt from the store at will. Nothing connects until first use, so a repo can
    be pickled into worker processes.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        catalog: str | os.PathLike[str] | None = None,
        config: RepoConfig | None = None,
    ) -> None:
        self.store = store
        self.config = config or RepoConfig()
        if catalog is None:
            options = getattr(store, "options", None)
            catalog = default_catalog_path(
                store.uri, options if isinstance(options, StoreOptions) else None
            )
        self.catalog = Catalog(str(catalog))
        self.locks = Locks(store, ttl_s=self.config.lock_ttl_s, wait_s=self.config.lock_wait_s)

    @classmethod
    def open(
        cls,
        uri: str | os.PathLike[str],
        store_options: StoreOptions | None = None,
        *,
        catalog: str | os.PathLike[str] | None = None,
        config: RepoConfig | None = None,
    ) -> ModelRepo:
        """Open the repository at `uri` (a directory, `file://`, `s3://bucket/prefix` or
        `memory://name`).

        Args:
            uri: the store; a directory is created if missing.
            store_options: S3 endpoint and credentials.
            catalog: the catalog file (default: `default_catalog_path(uri, store_options)`).
            config: locking, concurrency and verification settings.
        """
        return cls(open_store(str(uri), store_options), catalog=catalog, config=config)

    def __repr__(self) -> str:
        return f"ModelRepo({self.store.uri!r})"

    @property
    def uri(self) -> str:
        return self.store.uri

    def close(self) -> None:
        """Close the catalog connection of this process."""
        self.catalog.close()

    def __enter__(self) -> ModelRepo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh(self) -> None:
        """Bring the catalog up to date with the store (other processes' pushes and rms)."""
        sync_all(self.store, self.catalog)

    def reindex(self) -> int:
        """Throw the catalog away and rebuild it from the store; return the versions found."""
        self.catalog.clear()
        self.refresh()
        return len(self.catalog.versions())

    # ----- writing

    def prepare_push(
        self,
        model: ModelLike,
        name: str,
        *,
        parent: RefLike | None = None,
        tags: Sequence[str] = (),
        metrics: Mapping[str, float] | None = None,
        spec: Any = None,
    ) -> PushTransaction:
        """A push as separate steps (`begin`, `upload`, `commit`); see `push`."""
        check_name(name)
        parent_manifest = self._load(parent)[1] if parent is not None else None
        parent_id = parent_manifest.id if parent_manifest is not None else None
        if spec is not None and not isinstance(spec, dict):
            to_dict = getattr(spec, "to_dict", None)
            if to_dict is None:
                raise InvalidRequest(f"spec must be a ModelSpec or a dict, got {spec!r}")
            spec = to_dict()
        if isinstance(tags, str):
            tags = (tags,)
        manifest, blobs = build_manifest(
            model, name=name, parent=parent_id, tags=tuple(tags), metrics=metrics, spec=spec
        )
        return PushTransaction(
            self.store,
            self.locks,
            manifest,
            blobs,
            concurrency=self.config.concurrency,
            encoder=encoder_for(self.config, self.store, manifest, parent_manifest),
        )

    def push(
        self,
        model: ModelLike,
        name: str,
        *,
        parent: RefLike | None = None,
        tags: Sequence[str] = (),
        metrics: Mapping[str, float] | None = None,
        spec: Any = None,
    ) -> PushedVersion:
        """Store `model` as the next version of `name`, uploading only the tensors the
        repository lacks.

        Args:
            model: an `nn.Module` (its state dict and module tree are stored) or a state dict.
            name: the model name; `name` then refers to this version.
            parent: the version it was derived from (a ref or a `ModelVersion`).
            tags: labels.
            metrics: numbers to keep with it (accuracy, loss).
            spec: a `hapi.graph.ModelSpec` (or its dict) that builds the architecture, so
                heads can later be loaded without a model at hand.

        Returns:
            The new version, with what the push uploaded.

        Raises:
            InvalidRequest: a bad name, spec or state-dict value.
            RefNotFound: `parent` does not exist.
            RepoError: a gc held the repository longer than `lock_wait_s`.
        """
        txn = self.prepare_push(model, name, parent=parent, tags=tags, metrics=metrics, spec=spec)
        try:
            txn.begin()
            txn.upload()
            pushed = txn.commit()
        finally:
            txn.release()
        sync_name(self.store, self.catalog, name)
        return pushed

    def rm(self, ref: RefLike) -> ModelVersion:
        """Remove one version (its manifest). Its tensors go at the next `gc`, unless other
        versions share them; its version number is never reused.

        Raises:
            RefNotFound: no such version.
        """
        version, _ = self._load(ref)
        self.store.delete(manifest_key(version.id))
        mark_changed(self.store)
        self.catalog.remove_manifests([version.id])
        return version

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Delete unreferenced tensor blobs (and abandoned manifests and partial writes).

        Does nothing, and says so in the report, while pushes are running.

        Raises:
            IntegrityError: a manifest cannot be read; nothing is deleted.
        """
        age = self.config.partial_age_s
        report = collect_garbage(self.store, self.locks, dry_run=dry_run, partial_age_s=age)
        if report.removed_manifests:
            self.refresh()
        return report

    # ----- reading

    def resolve(self, ref: RefLike) -> ModelVersion:
        """The version `ref` names (`name`, `name@3`, `name@9f2c`, an id, `repo://...`).

        Raises:
            RefNotFound: it names nothing; the message lists close names.
        """
        for _ in range(3):
            version = lookup(self.store, self.catalog, ref)
            if self.store.exists(manifest_key(version.id)):
                return version
            # Removed by another process since our catalog saw it (or the catalog is stale).
            forget_manifest(self.store, self.catalog, version.id)
        raise RefNotFound(f"{ref} was removed from {self.uri}")

    def manifest(self, ref: RefLike) -> VersionManifest:
        """The manifest of the version `ref` names, read from the store."""
        return self._load(ref)[1]

    def pull(
        self,
        ref: RefLike,
        cut: int | None = None,
        *,
        keys: Sequence[str] | None = None,
        model: nn.Module | None = None,
        input_shape: tuple[int, ...] = (3, 224, 224),
    ) -> dict[str, torch.Tensor]:
        """The version's state dict (or part of it), every tensor checked against its hash.

        Args:
            ref: the version.
            cut: only the tensors of the head up to this cut point (see `load_head`).
            keys: only these state-dict keys (e.g. `head_info(...).keys`).
            model: a skeleton of the architecture, for `cut` when no spec was pushed.
            input_shape: per-sample input shape to trace the architecture with.

        Raises:
            RefNotFound: no such version.
            InvalidRequest: a key the version does not have.
            IntegrityError: a blob is missing or corrupt (the message names the tensor).
        """
        version, manifest = self._load(ref)
        wanted: list[str] = list(manifest.tensors) if keys is None else list(keys)
        unknown = [k for k in wanted if k not in manifest.tensors]
        if unknown:
            raise InvalidRequest(f"{version.ref} has no tensors {few(unknown)}")
        if cut is not None:
            planned = plan_head(manifest, version.ref, cut, model=model, input_shape=input_shape)
            wanted = [k for k in planned.info.hashes if keys is None or k in set(wanted)]
        return self._fetch(version, manifest, wanted)

    def load_into(self, model: nn.Module, ref: RefLike) -> ModelVersion:
        """Load a version into `model`, which must have exactly its keys and shapes.

        Raises:
            IntegrityError: missing, unexpected or mis-shaped keys (checked before any
                tensor is read), or a corrupt blob.
        """
        version, manifest = self._load(ref)
        check_matches(model, manifest, version.ref)
        model.load_state_dict(self._fetch(version, manifest, list(manifest.tensors)))
        return version

    def head_info(
        self,
        ref: RefLike,
        cut: int,
        *,
        model: nn.Module | None = None,
        input_shape: tuple[int, ...] = (3, 224, 224),
    ) -> HeadInfo:
        """Which tensors the head up to `cut` needs, and its cache key; reads no tensor.

        A server keeps heads by `cache_key`: versions derived from one base share it for
        cuts below their changes.
        """
        version, manifest = self._load(ref)
        return plan_head(manifest, version.ref, cut, model=model, input_shape=input_shape).info

    def graph(
        self,
        ref: RefLike,
        *,
        model: nn.Module | None = None,
        input_shape: tuple[int, ...] = (3, 224, 224),
    ) -> ModelGraph:
        """The version's architecture traced into its cut points; reads no tensor.

        Built from the version's spec on the meta device, so its shapes and cut points
        cost no memory; its heads and tails have no data (use `load_head` for that).

        Raises:
            RefNotFound: no such version.
            InvalidRequest: the version was pushed without a spec and no `model` is given.
        """
        version, manifest = self._load(ref)
        return trace_version(manifest, version.ref, model=model, input_shape=input_shape)

    def load_head(
        self,
        ref: RefLike,
        cut: int,
        *,
        model: nn.Module | None = None,
        input_shape: tuple[int, ...] = (3, 224, 224),
    ) -> tuple[nn.Module, HeadInfo]:
        """The head up to cut point `cut`, frozen and in eval mode, reading only its tensors.

        Args:
            ref: the version.
            cut: a cut point of the architecture (`hapi.graph.trace(...).cut_points`).
            model: a skeleton of the architecture when the version has no spec; its head's
                tensors are replaced by the stored ones.
            input_shape: per-sample input shape to trace with.

        Raises:
            InvalidRequest: no spec was pushed and no `model` given.
            InvalidCut: `cut` is not a cut point.
            IntegrityError: the architecture does not match the tensors, or a blob is bad.
        """
        version, manifest = self._load(ref)

        def plan(meta: bool = True) -> Any:
            return plan_head(
                manifest, version.ref, cut, model=model, input_shape=input_shape, meta=meta
            )

        planned = plan()
        tensors = self._fetch(version, manifest, list(planned.info.hashes))
        head = finish_head(planned, tensors, retry=lambda: plan(meta=False))
        return head, planned.info

    # ----- listing and queries

    def ls(self) -> list[ModelVersion]:
        """The newest version of every name."""
        self._sync()
        return list(self.catalog.snapshot().latest)

    def log(self, name: str) -> list[ModelVersion]:
        """Every version of `name`, newest first.

        Raises:
            RefNotFound: no version of `name` exists.
        """
        sync_name(self.store, self.catalog, name)
        found = self.catalog.versions("m.name = ?", (name,), "r.version DESC")
        if not found:
            raise RefNotFound(not_found(self.store, self.catalog, name, name))
        return found

    def ancestors(self, ref: RefLike) -> list[ModelVersion]:
        """Parent, grandparent, ... of a version (stops at a removed one)."""
        version = self.resolve(ref)
        self._sync()
        return ancestors(self.catalog, version)

    def descendants(self, ref: RefLike) -> list[ModelVersion]:
        """Every version derived from `ref`, directly or not."""
        version = self.resolve(ref)
        self._sync()
        return descendants(self.catalog, version)

    def lineage(self, ref: RefLike | None = None) -> list[LineageNode]:
        """Lineage trees: the one holding `ref` (from its oldest stored ancestor), or all."""
        self._sync()
        if ref is not None:
            version = self.resolve(ref)
            root = [*ancestors(self.catalog, version)[-1:]] or [version]
            return [lineage_tree(self.catalog, root[0])]
        snap = self.catalog.snapshot()
        roots = [v for v in reversed(snap.versions) if v.parent not in snap.by_id]
        return forest(self.catalog, roots)

    def diff(self, a: RefLike, b: RefLike) -> ModelDiff:
        """Which tensors differ from version `a` to version `b` (by hash; nothing is read)."""
        va, ma = self._load(a)
        vb, mb = self._load(b)
        return diff_manifests(va, ma, vb, mb)

    def find(
        self,
        *,
        name: str | None = None,
        tag: str | None = None,
        contains: Sequence[str] | None = None,
        prefix_of: Any = None,
        min_layers: int = 1,
    ) -> list[ModelVersion]:
        """Versions by name pattern, tag and architecture (conditions combine).

        Args:
            name: a glob on the name (`resnet*`).
            tag: a tag the version carries.
            contains: module class names (`Conv2d` or `torch.nn.modules.conv.Conv2d`): one
                matches any module of that class, several match consecutive layers.
            prefix_of: a model (`nn.Module`, `ModelSpec` or ref): versions sharing at least
                `min_layers` leading layers with it, most shared first.
            min_layers: see `prefix_of`.
        """
        self._sync()
        return find_versions(
            self.catalog,
            name=name,
            tag=tag,
            contains=contains,
            layer_ids=None if prefix_of is None else self._layer_ids(prefix_of),
            min_layers=min_layers,
        )

    def prefix_matches(self, model: Any, min_layers: int = 1) -> list[PrefixMatch]:
        """Versions sharing at least `min_layers` leading layers with `model` (an
        `nn.Module`, a `ModelSpec` or a ref), most shared layers first."""
        self._sync()
        return prefix_matches(self.catalog, self._layer_ids(model), min_layers)

    def longest_common_prefix(self, model: Any) -> PrefixMatch | None:
        """The stored version sharing the most leading layers with `model` - the best base
        to transfer from - or None when none shares even one."""
        matches = self.prefix_matches(model)
        return matches[0] if matches else None

    def fsck(self, *, repair: bool = False) -> FsckReport:
        """Check every manifest and re-hash every stored tensor, referenced or not.

        Reports every finding (unreadable manifests, corrupt and missing blobs, blobs no
        version references) instead of stopping at the first.

        Args:
            repair: delete corrupt blobs, so the next push of a model holding them
                writes them again.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        return check_repository(self.store, repair=repair, concurrency=self.config.concurrency)

    def usage(self) -> RepoUsage:
        """Bytes stored, and bytes the versions would take one file each."""
        self._sync()
        return measure_usage(self.store, self.catalog)

    # ----- internals

    def _layer_ids(self, model: Any) -> list[str]:
        if isinstance(model, str | ModelVersion):
            return layer_ids(self._load(model)[1].modules)
        return layer_ids(model)

    def _sync(self) -> None:
        """Bring the catalog up to date, by one read when the store did not change."""
        sync_changed(self.store, self.catalog, self.config.relist_s)

    def _load(self, ref: RefLike) -> tuple[ModelVersion, VersionManifest]:
        """Resolve `ref` and read its manifest from the store, the source of truth."""
        for _ in range(3):
            version = lookup(self.store, self.catalog, ref)
            try:
                data = self.store.get(manifest_key(version.id))
            except ObjectNotFound:
                # Removed by another process since our catalog saw it (or the catalog is stale).
                forget_manifest(self.store, self.catalog, version.id)
                continue
            return version, VersionManifest.from_json(data, version.id)
        raise RefNotFound(f"{ref} was removed from {self.uri}")

    def _fetch(
        self, version: ModelVersion, manifest: VersionManifest, keys: list[str]
    ) -> dict[str, torch.Tensor]:
        return fetch_tensors(
            self.store,
            manifest,
            keys,
            label=version.ref,
            verify=self.config.verify,
            concurrency=self.config.concurrency,
        )
