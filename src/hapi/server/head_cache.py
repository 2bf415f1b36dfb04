"""The head cache: each head is loaded once and shared by every session that needs it.

A `ModelSpec` dict is built whole, traced, and its heads kept by (spec, image size, cut); a
repository reference (`repo://flowers@2`) is traced on the meta device and only the head's
tensors are read, kept by `cache_key`. Tensors count in the server's budget
(`Scheduler.reserve`), each storage once; heads no session holds are idle and evicted
oldest first. Each model or head is built once, under a lock of its own key, and tracing
holds `hapi._fx_lock.TRACING`. More: docs/server.md, "The head cache".
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi._fx_lock import TRACING
from hapi.errors import HapiError, InvalidRequest, UnknownModel
from hapi.graph import ModelGraph, ModelSpec, build_model, trace
from hapi.server.memory.batch_memory import static_bytes

if TYPE_CHECKING:
    from hapi.repo import ModelRepo
    from hapi.server.memory.scheduler import Scheduler

__all__ = ["HeadCache", "HeadLease", "LoadedModel"]


@dataclass(frozen=True)
class LoadedModel:
    """A model traced into cut points, ready to give heads."""

    graph: ModelGraph
    key: str
    """Names the model and input size among the cache's models."""
    version: str | None = None
    """The repository version (`name@<id>`) it comes from; None for a spec."""


@dataclass(frozen=True)
class HeadLease:
    """A head a session holds; give it back with `HeadCache.release` when the session ends."""

    key: str
    module: nn.Module


ModelLoader = Callable[[dict[str, Any]], nn.Module]


def load_named_model(model: dict[str, Any]) -> nn.Module:
    """Build a model from a `ModelSpec` dict (the default loader)."""
    return build_model(ModelSpec.from_dict(model))


@dataclass(eq=False)
class _Entry:
    """A cached model or head and the tensor storages it keeps alive."""

    value: Any
    storages: dict[tuple[str, int], int] = field(default_factory=dict)
    holders: int = 0


class HeadCache:
    """Traced models and their heads.

    A head stays in memory while a session holds it, and afterwards among the `idle` most
    recently released ones, so a job that reopens a session (each epoch does) finds it
    loaded, and a long-running server does not keep every head it ever loaded.

    Args:
        device: where heads run.
        repo: the repository that `repo://` references resolve in; None refuses them.
        loader: builds a model from a spec dict.
        idle: heads no session holds that are kept for reuse; also the number of traced
            models kept.
        scheduler: whose budget holds the cache's tensors; None: no budget.
    """

    def __init__(
        self,
        device: str = "cpu",
        repo: ModelRepo | None = None,
        loader: ModelLoader = load_named_model,
        idle: int = 4,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.repo = repo
        self.idle = idle
        self.scheduler = scheduler
        self._loader = loader
        # Models and heads, least recently used first; models are never held.
        self._models: OrderedDict[str, _Entry] = OrderedDict()
        self._heads: OrderedDict[str, _Entry] = OrderedDict()
        self._refs: Counter[tuple[str, int]] = Counter()
        self._sizes: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self.on_drop: Callable[[str], None] | None = None
        """Told each head's key when the head leaves the cache (its compiled copies go)."""
        self._dropped: list[str] = []

    def model(self, model: dict[str, Any] | str, image_size: int) -> LoadedModel:
        """Load (or reuse) `model` traced at `image_size`.

        Raises:
            UnknownModel: a model name or repository reference that names nothing.
            InvalidRequest: a model that cannot be built or traced at this size.
            OverBudget: its weights do not fit in the server's memory budget.
        """
        if isinstance(model, str):
            return self._version(model, image_size)
        key = json.dumps(["spec", model, image_size], sort_keys=True)

        what = f"model {model.get('name', model)!r} at {image_size} px"

        def load() -> LoadedModel:
            # Building and tracing allocate the weights and run the model once: hold room
            # for both in the budget, sized from a copy of the model on the meta device.
            need = self._load_bytes(model, image_size) if self.scheduler is not None else 0
            if need and self.scheduler is not None:
                self.scheduler.reserve(need, f"loading and tracing {what}")
            try:
                module = self._loader(model).eval()
                with TRACING.exclusive():
                    graph = trace(module, input_shape=(3, image_size, image_size))
            except HapiError:
                raise
            except Exception as exc:
                raise InvalidRequest(
                    f"cannot load model {model!r} at image size {image_size}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                if need and self.scheduler is not None:
                    self.scheduler.release(need)
            return LoadedModel(graph=graph, key=key)

        return self._cached_model(key, load, what)

    def acquire(self, loaded: LoadedModel, cut: int) -> HeadLease:
        """The head of `loaded` up to `cut`, frozen, in eval mode on the cache's device,
        held until `release`.

        Raises:
            OverBudget: its weights do not fit in the server's memory budget.
        """
        if loaded.version is not None:
            key, build = self._repo_head(loaded, cut)
        else:
            key = json.dumps([loaded.key, cut])

            def build() -> nn.Module:
                with TRACING.exclusive():
                    head = loaded.graph.head(cut).eval().to(self.device)
                return head.requires_grad_(False)

        return self._hold(key, build, f"the head up to cut {cut}")

    def acquire_uploaded(
        self, digest: str, load: Callable[[], nn.Module], nbytes: int = 0
    ) -> HeadLease:
        """The head a trainer uploaded with `digest` (built by `load` on first use), frozen,
        in eval mode on the cache's device, held until `release`.

        Keyed by digest alone: sessions of every job whose head has this content share one
        module, and its tensors are counted once in the budget, like any head's.

        Args:
            digest: the artifact's digest.
            load: reads and loads the artifact (`hapi.graph.load_head`).
            nbytes: the artifact's size, held in the budget while it loads (its bytes and
                the tensors made from them exist together for a moment).

        Raises:
            OverBudget: its weights do not fit in the server's memory budget.
        """
        key = json.dumps(["uploaded", digest])

        def build() -> nn.Module:
            if nbytes and self.scheduler is not None:
                self.scheduler.reserve(nbytes, f"loading uploaded head {digest[:12]}")
            try:
                return load().eval().to(self.device).requires_grad_(False)
            finally:
                if nbytes and self.scheduler is not None:
                    self.scheduler.release(nbytes)

        return self._hold(key, build, f"uploaded head {digest[:12]}")

    def head_key(self, loaded: LoadedModel, cut: int) -> str:
        """What identifies the head of `loaded` up to `cut` among the cache's heads: for a
        repository version, a digest of its content, shared by versions that share it."""
        if loaded.version is not None:
            return self._repo_head(loaded, cut)[0]
        return json.dumps([loaded.key, cut])

    @contextlib.contextmanager
    def borrow(self, loaded: LoadedModel, cut: int) -> Iterator[nn.Module | None]:
        """The head up to `cut` for a moment (profiling every cut of a model); None at
        INPUT. A named model's head shares the traced model's weights and is not cached;
        a repository version's is held like a session's."""
        if cut == 0:
            yield None
        elif loaded.version is not None:
            lease = self.acquire(loaded, cut)
            try:
                yield lease.module
            finally:
                self.release(lease)
        else:
            with TRACING.exclusive():
                head = loaded.graph.head(cut).eval().to(self.device).requires_grad_(False)
            yield head

    def release(self, lease: HeadLease) -> None:
        """A session is done with a head; it stays loaded among the idle ones."""
        with self._lock:
            entry = self._heads.get(lease.key)
            if entry is not None:
                entry.holders -= 1
                self._heads.move_to_end(lease.key)
        self._trim()

    def __len__(self) -> int:
        """Heads in memory."""
        with self._lock:
            return len(self._heads)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors of the heads in memory, shared ones once (traced models
        may hold more: `budget_bytes`)."""
        with self._lock:
            heads = {k for entry in self._heads.values() for k in entry.storages}
            return sum(self._sizes[k] for k in heads)

    @property
    def budget_bytes(self) -> int:
        """Bytes the cache holds in the budget: its heads' and traced models' tensors."""
        with self._lock:
            return sum(self._sizes.values())

    def idle_bytes(self) -> int:
        """Bytes that evicting every model and head no session holds would free."""
        with self._lock:
            held: set[tuple[str, int]] = set()
            for entry in self._heads.values():
                if entry.holders:
                    held.update(entry.storages)
            return sum(n for k, n in self._sizes.items() if k not in held)

    def reclaim(self, nbytes: int) -> int:
        """Evict idle models and heads, oldest first, until `nbytes` are freed; return the
        bytes freed (given back to the scheduler)."""
        freed = 0
        while freed < nbytes:
            with self._lock:
                victim = self._oldest_idle()
                if victim is None:
                    break
                freed += self._drop(*victim)
        if freed and self.scheduler is not None:
            self.scheduler.release(freed)
        self._tell_dropped()
        return freed

    # Internals ---------------------------------------------------------------------------

    def _hold(self, key: str, build: Callable[[], nn.Module], what: str) -> HeadLease:
        """The head cached under `key`, built now if it is not, with one more holder."""
        with self._key_lock(key):
            with self._lock:
                entry = self._heads.get(key)
                if entry is not None:
                    entry.holders += 1
                    self._heads.move_to_end(key)
                    return HeadLease(key, entry.value)
            # Built outside the cache's lock: a slow load must not stall other sessions.
            head = build()
            self._add(self._heads, key, head, holders=1, what=what)
        self._trim()
        return HeadLease(key, head)

    def _cached_model(self, key: str, load: Callable[[], LoadedModel], what: str) -> LoadedModel:
        with self._lock:
            entry = self._models.get(key)
            if entry is not None:
                self._models.move_to_end(key)
                return entry.value  # type: ignore[no-any-return]
        with self._key_lock(key):
            with self._lock:
                entry = self._models.get(key)
                if entry is not None:
                    return entry.value  # type: ignore[no-any-return]
            loaded = load()
            self._add(self._models, key, loaded, holders=0, tensors=loaded.graph.model, what=what)
        self._trim()
        return loaded

    def _add(
        self,
        table: OrderedDict[str, _Entry],
        key: str,
        value: Any,
        *,
        holders: int,
        what: str,
        tensors: nn.Module | None = None,
    ) -> None:
        """Cache `value`, reserving the budget for the storages it adds to the cache."""
        storages = _storages((tensors if tensors is not None else value).modules())
        with self._lock:
            new = sum(n for k, n in storages.items() if k not in self._sizes)
        if new and self.scheduler is not None:
            # Raises OverBudget when it cannot fit: then nothing was cached.
            self.scheduler.reserve(new, f"the weights of {what}")
        with self._lock:
            added = 0
            for k, n in storages.items():
                if not self._refs[k]:
                    self._sizes[k] = n
                    added += n
                self._refs[k] += 1
            table[key] = _Entry(value, storages, holders)
        # Another thread may have cached some of the same storages meanwhile (give back
        # the difference), or evicted them (take it: they are in memory, here).
        if new != added and self.scheduler is not None:
            self.scheduler.release(new - added)

    def _trim(self) -> None:
        """Drop the oldest idle heads beyond `idle`, and models beyond `max(idle, 1)`."""
        freed = 0
        with self._lock:
            idle = [k for k, e in self._heads.items() if not e.holders]
            for key in idle[: max(len(idle) - self.idle, 0)]:
                freed += self._drop(self._heads, key)
            for key in list(self._models)[: max(len(self._models) - max(self.idle, 1), 0)]:
                freed += self._drop(self._models, key)
        if freed and self.scheduler is not None:
            self.scheduler.release(freed)
        self._tell_dropped()

    def _tell_dropped(self) -> None:
        """Tell `on_drop` of the heads just dropped (outside the lock: it may release
        budget)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        if self.on_drop is not None:
            for key in dropped:
                self.on_drop(key)

    def _oldest_idle(self) -> tuple[OrderedDict[str, _Entry], str] | None:
        # Traced models first: they are only needed to build new heads.
        for table in (self._models, self._heads):
            for key, entry in table.items():
                if not entry.holders:
                    return table, key
        return None

    def _drop(self, table: OrderedDict[str, _Entry], key: str) -> int:
        """Forget an entry (the lock held); return the bytes no entry keeps any more."""
        entry = table.pop(key)
        if table is self._heads:
            self._dropped.append(key)
        freed = 0
        for k in entry.storages:
            self._refs[k] -= 1
            if not self._refs[k]:
                del self._refs[k]
                freed += self._sizes.pop(k)
        return freed

    def _load_bytes(self, model: dict[str, Any], image_size: int) -> int:
        """Bytes to build `model` and trace it at `image_size`, from a meta-device copy
        (no memory); 0 when the copy cannot be made (the load then goes unchecked)."""
        try:
            # A loader that reads a checkpoint copies it into meta tensors, a no-op that
            # torch warns about once per tensor.
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                meta = self._loader(model).eval()
            with TRACING.exclusive():
                graph = trace(meta, input_shape=(3, image_size, image_size))
        except Exception:  # a loader that needs real tensors: nothing to learn here
            return 0
        weights = sum(t.numel() * t.element_size() for t in (*meta.parameters(), *meta.buffers()))
        return weights + static_bytes(graph, graph.num_cuts)

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def _version(self, ref: str, image_size: int) -> LoadedModel:
        repo = self._require_repo(ref)
        # Resolve on every open: a name moves to its newest version, an id never does.
        version = repo.resolve(ref)
        pinned = f"{version.name}@{version.id}"
        key = json.dumps(["repo", version.id, image_size])

        def load() -> LoadedModel:
            with TRACING.exclusive():
                graph = repo.graph(pinned, input_shape=(3, image_size, image_size))
            return LoadedModel(graph=graph, key=key, version=pinned)

        return self._cached_model(key, load, f"model {pinned}")

    def _repo_head(self, loaded: LoadedModel, cut: int) -> tuple[str, Callable[[], nn.Module]]:
        assert loaded.version is not None
        version = loaded.version
        repo = self._require_repo(version)
        shape = loaded.graph.input_shape
        with TRACING.exclusive():
            info = repo.head_info(version, cut, input_shape=shape)

        def build() -> nn.Module:
            # Loading a head traces its architecture, so it holds the lock too.
            with TRACING.exclusive():
                module, _ = repo.load_head(version, cut, input_shape=shape)
            return module.to(self.device)

        return json.dumps(["repo", info.cache_key, list(shape)]), build

    def _require_repo(self, ref: str) -> ModelRepo:
        if self.repo is None:
            raise UnknownModel(
                f"model reference {ref!r} needs a model repository, and this server has "
                "none: start it with `hapi serve --repo URI`, or send a model spec "
                "({'name': 'resnet18', ...})"
            )
        return self.repo


def _storages(modules: Iterable[nn.Module]) -> dict[tuple[str, int], int]:
    """Bytes of each storage the modules' own parameters and buffers use (meta: none)."""
    found: dict[tuple[str, int], int] = {}
    for module in modules:
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if t.device.type != "meta":
                storage = t.untyped_storage()
                found[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return found
