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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi.errors import HapiError, InvalidRequest, UnknownModel
from hapi.graph import ModelGraph, ModelSpec, build_model, trace

if TYPE_CHECKING:
    from hapi.repo import ModelRepo

__all__ = ["HeadCache", "LoadedModel"]


@dataclass(frozen=True)
class LoadedModel:
    """A model traced into cut points, ready to give heads."""

    graph: ModelGraph
    key: str
    """Names the model and input size among the cache's models."""
    version: str | None = None
    """The repository version (`name@<id>`) it comes from; None for a spec."""


ModelLoader = Callable[[dict[str, Any]], nn.Module]


def load_named_model(model: dict[str, Any]) -> nn.Module:
    """Build a model from a `ModelSpec` dict (the default loader)."""
    return build_model(ModelSpec.from_dict(model))


class HeadCache:
    """Traced models and their heads.

    Args:
        device: where heads run.
        repo: the repository that `repo://` references resolve in; None refuses them.
        loader: builds a model from a spec dict.
    """

    def __init__(
        self,
        device: str = "cpu",
        repo: ModelRepo | None = None,
        loader: ModelLoader = load_named_model,
    ) -> None:
        self.device = torch.device(device)
        self.repo = repo
        self._loader = loader
        self._models: dict[str, LoadedModel] = {}
        self._heads: dict[str, nn.Module] = {}
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
        loaded = LoadedModel(graph=graph, key=key)
        with self._lock:
            return self._models.setdefault(key, loaded)

    def head(self, loaded: LoadedModel, cut: int) -> nn.Module:
        """The head of `loaded` up to `cut`, frozen, in eval mode on the cache's device."""
        if loaded.version is not None:
            return self._repo_head(loaded, cut)
        key = json.dumps([loaded.key, cut])
        with self._lock:
            head = self._heads.get(key)
        if head is None:
            head = loaded.graph.head(cut).eval().to(self.device)
            head.requires_grad_(False)
            with self._lock:
                head = self._heads.setdefault(key, head)
        return head

    def __len__(self) -> int:
        """Heads in memory."""
        with self._lock:
            return len(self._heads)

    def _version(self, ref: str, image_size: int) -> LoadedModel:
        repo = self._require_repo(ref)
        # Resolve on every open: a name moves to its newest version, an id never does.
        version = repo.resolve(ref)
        pinned = f"{version.name}@{version.id}"
        key = json.dumps(["repo", version.id, image_size])
        with self._lock:
            if key in self._models:
                return self._models[key]
        graph = repo.graph(pinned, input_shape=(3, image_size, image_size))
        loaded = LoadedModel(graph=graph, key=key, version=pinned)
        with self._lock:
            return self._models.setdefault(key, loaded)

    def _repo_head(self, loaded: LoadedModel, cut: int) -> nn.Module:
        assert loaded.version is not None
        repo = self._require_repo(loaded.version)
        shape = loaded.graph.input_shape
        info = repo.head_info(loaded.version, cut, input_shape=shape)
        key = json.dumps(["repo", info.cache_key, list(shape)])
        with self._lock:
            head = self._heads.get(key)
        if head is None:
            module, _ = repo.load_head(loaded.version, cut, input_shape=shape)
            head = module.to(self.device)
            with self._lock:
                head = self._heads.setdefault(key, head)
        return head

    def _require_repo(self, ref: str) -> ModelRepo:
        if self.repo is None:
            raise UnknownModel(
                f"model reference {ref!r} needs a model repository, and this server has "
                "none: start it with `hapi serve --repo URI`, or send a model spec "
                "({'name': 'resnet18', ...})"
            )
        return self.repo
