"""`module_digest`: a digest of what a built module computes - its code and its weights.

A head a server built (from a named model or a repository version) has no content address
of its own, unlike an uploaded one (`hapi.graph.export.head_digest`); a feature cache
needs one, so that heads with the same program and weights share features however they
were named, and a head whose weights changed never reads another's.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

__all__ = ["module_digest"]

_FORMAT = "hapi-module-digest-1"


def module_digest(module: nn.Module) -> str:
    """SHA-256 over a module's code and every tensor it holds.

    The code is each submodule's class, its `extra_repr` (a layer's settings: kernel size,
    stride, epsilon...) and, for a traced `fx.GraphModule`, its generated `forward`; the
    tensors are every parameter and buffer (non-persistent ones too: they take part in
    the computation) by name, dtype, shape and bytes.
    """
    h = hashlib.sha256(_FORMAT.encode() + b"\0")
    for name, sub in module.named_modules():
        cls = type(sub)
        code = getattr(sub, "code", "") if isinstance(sub, torch.fx.GraphModule) else ""
        _field(h, f"{name}|{cls.__module__}.{cls.__qualname__}|{sub.extra_repr()}|{code}")
    tensors = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous()
        _field(h, f"{name}|{t.dtype}|{list(t.shape)}")
        # Bytes as they are, whatever the dtype (bf16 has no numpy view).
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _field(h: hashlib._Hash, text: str) -> None:
    data = text.encode()
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)
