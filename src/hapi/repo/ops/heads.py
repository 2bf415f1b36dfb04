"""Heads from the repository: the layers before a cut, with only their tensors fetched.

The architecture comes from the `ModelSpec` stored with the version, or from a skeleton
model the caller passes. A spec is built on PyTorch's meta device - no memory, no random
init - and traced there once per process; loading a head then costs a copy of its
data-less modules and the read of its tensors, which are assigned into it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from hapi.graph import ModelGraph

from hapi.errors import IntegrityError, InvalidRequest
from hapi.repo.storage.manifest import VersionManifest
from hapi.repo.storage.modules import describe_modules

__all__ = ["HeadInfo", "PlannedHead", "finish_head", "plan_head", "trace_version"]

log = logging.getLogger("hapi.repo")


@dataclass(frozen=True, kw_only=True)
class HeadInfo:
    """What a head needs from the repository, and the key to share it under."""

    ref: str
    """The version it comes from (`name@n`)."""
    id: str
    """That version's manifest id."""
    cut: int
    """The cut the head ends at."""
    cut_name: str
    """The cut point's name (`layer3`); `input` for cut 0."""
    hashes: dict[str, str] = field(default_factory=dict)
    """State-dict key -> tensor content hash, for every tensor the head needs."""
    nbytes: int = 0
    """Raw bytes of those tensors."""
    cache_key: str = ""
    """Equal for heads that compute the same function: same code, same module settings,
    same tensors. Two models fine-tuned from one base share it below their changes."""

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.hashes)


@dataclass(frozen=True)
class PlannedHead:
    """A head module whose tensors are not loaded yet."""

    module: nn.Module
    """On the meta device, its modules are the process-wide traced spec's: `finish_head`
    loads into a copy of them."""
    info: HeadInfo
    on_meta: bool


def plan_head(
    manifest: VersionManifest,
    ref: str,
    cut: int,
    *,
    model: nn.Module | None,
    input_shape: tuple[int, ...],
    meta: bool = True,
) -> PlannedHead:
    """Trace the version's architecture and find the head's tensors.

    Raises:
        InvalidRequest: the version has no spec and no `model` skeleton was given.
        InvalidCut: `cut` is not a cut point of the model.
        IntegrityError: the architecture names tensors the version does not have.
    """
    from hapi.graph import trace

    if model is None and meta and manifest.spec is not None:
        # Versions derived from one base share a spec: trace it once per process. Planning
        # alone (`head_info`) needs no copy; `finish_head` copies before loading.
        graph = _traced_spec(json.dumps(manifest.spec, sort_keys=True), tuple(input_shape))
        head, on_meta = graph.head(cut), True
    else:
        skeleton, on_meta = _skeleton(manifest, ref, model), False
        graph = trace(skeleton, input_shape)
        head = graph.head(cut)
    keys = list(head.state_dict().keys())
    missing = [k for k in keys if k not in manifest.tensors]
    if missing:
        raise IntegrityError(
            f"{ref} does not match its architecture: the head up to cut {cut} needs "
            f"{_few(missing)} that the version does not have"
        )
    hashes = {k: manifest.tensors[k].hash for k in keys}
    cut_name = graph.cut_point(cut).name if cut > 0 else "input"
    info = HeadInfo(
        ref=ref,
        id=manifest.id,
        cut=cut,
        cut_name=cut_name,
        hashes=hashes,
        nbytes=sum(manifest.tensors[k].nbytes for k in keys),
        cache_key=_cache_key(head, hashes),
    )
    return PlannedHead(head, info, on_meta)


def trace_version(
    manifest: VersionManifest, ref: str, *, model: nn.Module | None, input_shape: tuple[int, ...]
) -> ModelGraph:
    """The version's architecture traced into cut points, without reading a tensor.

    From its spec, the graph is built on the meta device (no memory) and traced once per
    process; otherwise from the `model` skeleton the caller passes.

    Raises:
        InvalidRequest: the version has no spec and no `model` was given.
    """
    if model is None and manifest.spec is not None:
        return _traced_spec(json.dumps(manifest.spec, sort_keys=True), tuple(input_shape))
    from hapi.graph import trace

    return trace(_skeleton(manifest, ref, model), input_shape)


def finish_head(
    planned: PlannedHead, tensors: dict[str, torch.Tensor], *, retry: Callable[[], PlannedHead]
) -> nn.Module:
    """Load `tensors` into the planned head; frozen, in eval mode.

    A head built on the meta device may keep state outside the state dict (non-persistent
    buffers); then it is rebuilt for real by `retry` and loaded again.
    """
    # Loading assigns tensors into the modules: never into the shared traced spec's.
    head = copy.deepcopy(planned.module) if planned.on_meta else planned.module
    head.load_state_dict(tensors, strict=True, assign=True)
    if planned.on_meta and any(t.is_meta for t in chain(head.parameters(), head.buffers())):
        log.info(
            "head of %s keeps state outside its state dict; building it on the CPU",
            planned.info.ref,
        )
        head = retry().module
        head.load_state_dict(tensors, strict=True, assign=True)
    head.requires_grad_(False)
    return head.eval()


@functools.lru_cache(maxsize=16)
def _traced_spec(spec: str, input_shape: tuple[int, ...]) -> ModelGraph:
    from hapi.graph import ModelSpec, build_model, trace

    with torch.device("meta"):
        return trace(build_model(ModelSpec.from_dict(json.loads(spec))), input_shape)


def _skeleton(manifest: VersionManifest, ref: str, model: nn.Module | None) -> nn.Module:
    if model is not None:
        return model
    if manifest.spec is None:
        raise InvalidRequest(
            f"{ref} was pushed without a model spec, so its architecture is unknown: pass "
            "model=<a module of the same architecture>, or push it with spec=ModelSpec(...)"
        )
    from hapi.graph import ModelSpec, build_model

    return build_model(ModelSpec.from_dict(dict(manifest.spec)))


def _cache_key(head: nn.Module, hashes: dict[str, str]) -> str:
    code = getattr(head, "code", None) or repr(head)
    modules = [[m.name, m.cls, m.config] for m in describe_modules(head)[1:]]
    body = json.dumps([code, modules, sorted(hashes.items())], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def _few(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
