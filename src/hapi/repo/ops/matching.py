"""Matching models against stored versions: a model's layer identities, and whether a
model's state dict has a version's keys and shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hapi.errors import IntegrityError, InvalidRequest
from hapi.repo.storage.manifest import VersionManifest
from hapi.repo.storage.modules import ModuleEntry, describe_modules

__all__ = ["check_matches", "few", "layer_ids"]


def layer_ids(model: Any) -> list[str]:
    """The layer identities of a module tree, an `nn.Module` or a `ModelSpec` (or its dict).

    Raises:
        InvalidRequest: `model` is none of these.
    """
    if isinstance(model, nn.Module):
        modules: Sequence[ModuleEntry] = describe_modules(model)
    elif isinstance(model, tuple) and all(isinstance(m, ModuleEntry) for m in model):
        modules = model
    else:
        from hapi.graph import ModelSpec, build_model

        spec = ModelSpec.from_dict(model) if isinstance(model, dict) else model
        if not isinstance(spec, ModelSpec):
            raise InvalidRequest(
                f"a model to match is an nn.Module, a ModelSpec or a ref, got {model!r}"
            )
        with torch.device("meta"):
            modules = describe_modules(build_model(spec))
    return [m.layer for m in modules if m.layer is not None]


def check_matches(model: nn.Module, manifest: VersionManifest, ref: str) -> None:
    """Check that `model` has exactly the version's keys and shapes.

    Raises:
        IntegrityError: missing, unexpected or mis-shaped keys, all named.
    """
    own = model.state_dict()
    missing = [k for k in own if k not in manifest.tensors]
    unexpected = [k for k in manifest.tensors if k not in own]
    shapes = [
        f"{k} (model {list(own[k].shape)}, stored {list(manifest.tensors[k].shape)})"
        for k in own
        if k in manifest.tensors and tuple(own[k].shape) != manifest.tensors[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from {ref}: {few(missing)}")
        if unexpected:
            parts.append(f"not in the model: {few(unexpected)}")
        if shapes:
            parts.append(f"different shapes: {few(shapes)}")
        raise IntegrityError(f"{type(model).__name__} does not match {ref}: " + "; ".join(parts))


def few(items: list[str]) -> str:
    """The first five items, and how many more."""
    shown = ", ".join(items[:5])
    return shown + (f" and {len(items) - 5} more" if len(items) > 5 else "")
