"""The head cache: each (model, cut, input size) is loaded once and shared by sessions.

Loading a model is the slow part of opening a session (seconds for a large model); jobs
that fine-tune the same base at the same cut share one head in the server's memory.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hapi.errors import HapiError, InvalidRequest, UnknownModel
from hapi.graph import ModelGraph, ModelSpec, build_model, trace

__all__ = ["HeadCache", "LoadedModel"]


@dataclass(frozen=True)
class LoadedModel:
    """A model traced into cut points, ready to give heads."""

    graph: ModelGraph
    key: str


ModelLoader = Callable[[dict[str, Any] | str], nn.Module]


def load_named_model(model: dict[str, Any] | str) -> nn.Module:
    """Build a model from a `ModelSpec` dict (the default loader)."""
    if isinstance(model, str):
        raise UnknownModel(
            f"model reference {model!r} needs a model repository, and this server has none: "
            "start it with --repo, or send a model spec ({'name': 'resnet18', ...})"
        )
    return build_model(ModelSpec.from_dict(model))


class HeadCache:
    """Traced models and their heads, by model key and cut."""

    def __init__(self, device: str = "cpu", loader: ModelLoader = load_named_model) -> None:
        self.device = torch.device(device)
        self._loader = loader
        self._models: dict[str, LoadedModel] = {}
        self._heads: dict[tuple[str, int], nn.Module] = {}
        self._lock = threading.Lock()

    def model(self, model: dict[str, Any] | str, image_size: int) -> LoadedModel:
        """Load (or reuse) `model` traced at `image_size`."""
        key = json.dumps([model, image_size], sort_keys=True)
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
        """The head of `loaded` up to `cut`, in eval mode on the cache's device."""
        with self._lock:
            head = self._heads.get((loaded.key, cut))
            if head is None:
                head = loaded.graph.head(cut).eval().to(self.device)
                for p in head.parameters():
                    p.requires_grad_(False)
                self._heads[(loaded.key, cut)] = head
            return head

    def __len__(self) -> int:
        return len(self._heads)
