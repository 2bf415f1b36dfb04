"""The head cache: each head is loaded once and shared by every session that needs it.

Loading a model is the slow part of opening a session (seconds for a large model); jobs
that fine-tune the same base at the same cut share one head in the server's memory.

A session names its model in one of two ways:

- a `ModelSpec` dict: the server builds the whole model, traces it, and keeps its heads by
  (spec, image size, cut);
- a repository reference (`repo://flowers@2`, `flowers@2`, `flowers`): the server traces
  the version's architecture on the meta device and reads only the head's tensors. Heads
  are kept by their `cache_key`, a digest of their code and tensor hashes, so versions
  fine-tuned from one base share one head for every cut below what they changed.
"""

from __future__ import annotations

import json
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi.errors import HapiError, InvalidRequest, UnknownModel
from hapi.graph import ModelGraph, ModelSpec, build_model, trace

if TYPE_CHECKING:
    from hapi.repo import ModelRepo

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
    """

    def __init__(
        self,
        device: str = "cpu",
        repo: ModelRepo | None = None,
        loader: ModelLoader = load_named_model,
        idle: int = 4,
    ) -> None:
        self.device = torch.device(device)
        self.repo = repo
        self.idle = idle
        self._loader = loader
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._heads: dict[str, nn.Module] = {}
        self._holders: Counter[str] = Counter()
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def model(self, model: dict[str, Any] | str, image_size: int) -> LoadedModel:
        """Load (or reuse) `model` traced at `image_size`.

        Raises:
            UnknownModel: a model name or repository reference that names nothing.
            InvalidRequest: a model that cannot be built or traced at this size.
        """
        if isinstance(model, str):
            return self._version(model, image_size)
        key = json.dumps(["spec", model, image_size], sort_keys=True)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
        try:
            module = self._loader(model).eval()
            graph = trace(module, input_shape=(3, image_size, image_size))
        except HapiError:
            raise
        except Exception as exc:
            raise InvalidRequest(
                f"cannot load model {model!r} at image size {image_size}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return self._remember(LoadedModel(graph=graph, key=key))

    def acquire(self, loaded: LoadedModel, cut: int) -> HeadLease:
        """The head of `loaded` up to `cut`, frozen, in eval mode on the cache's device,
        held until `release`."""
        if loaded.version is not None:
            key, build = self._repo_head(loaded, cut)
        else:
            key = json.dumps([loaded.key, cut])

            def build() -> nn.Module:
                head = loaded.graph.head(cut).eval().to(self.device)
                return head.requires_grad_(False)

        with self._lock:
            head = self._heads.get(key)
        if head is None:
            # Loaded outside the lock: a slow load must not stall other sessions.
            head = build()
        with self._lock:
            head = self._heads.setdefault(key, head)
            self._holders[key] += 1
            self._idle.pop(key, None)
        return HeadLease(key, head)

    def release(self, lease: HeadLease) -> None:
        """A session is done with a head; it stays loaded among the idle ones."""
        with self._lock:
            self._holders[lease.key] -= 1
            if self._holders[lease.key] > 0:
                return
            del self._holders[lease.key]
            self._idle[lease.key] = None
            while len(self._idle) > self.idle:
                dropped, _ = self._idle.popitem(last=False)
                self._heads.pop(dropped, None)

    def __len__(self) -> int:
        """Heads in memory."""
        with self._lock:
            return len(self._heads)

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters and buffers of the heads in memory, shared ones once."""
        with self._lock:
            heads = list(self._heads.values())
        seen: dict[int, int] = {}
        for head in heads:
            for t in (*head.parameters(), *head.buffers()):
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def _version(self, ref: str, image_size: int) -> LoadedModel:
        repo = self._require_repo(ref)
        # Resolve on every open: a name moves to its newest version, an id never does.
        version = repo.resolve(ref)
        pinned = f"{version.name}@{version.id}"
        key = json.dumps(["repo", version.id, image_size])
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
        graph = repo.graph(pinned, input_shape=(3, image_size, image_size))
        return self._remember(LoadedModel(graph=graph, key=key, version=pinned))

    def _remember(self, loaded: LoadedModel) -> LoadedModel:
        with self._lock:
            kept = self._models.setdefault(loaded.key, loaded)
            self._models.move_to_end(loaded.key)
            # Heads keep the modules they need; the traced models are only for new heads.
            while len(self._models) > max(self.idle, 1):
                self._models.popitem(last=False)
            return kept

    def _repo_head(self, loaded: LoadedModel, cut: int) -> tuple[str, Callable[[], nn.Module]]:
        assert loaded.version is not None
        version = loaded.version
        repo = self._require_repo(version)
        shape = loaded.graph.input_shape
        info = repo.head_info(version, cut, input_shape=shape)

        def build() -> nn.Module:
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
