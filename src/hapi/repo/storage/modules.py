"""A model's module tree as a manifest records it, and the identities of its layers.

Each module is written down with its class, the settings that can be read back from it
and its own parameters' and buffers' names. A layer (a module with computation state of
its own, in `named_modules` order) has an identity hashing its class, settings, tensors'
shapes and dtypes and the previous layer's identity, so a shared prefix of layers is one
lookup. More: docs/repository.md, "Module trees and layer identities".
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hapi.repo.storage._fields import optional, required, strings

__all__ = ["ModuleEntry", "class_name", "describe_modules", "module_config"]

_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True, kw_only=True)
class ModuleEntry:
    """One module of a model's tree."""

    name: str
    """Qualified name (`layer4.0.conv1`; `""` is the model itself)."""
    cls: str
    """`module.qualname` of its class (`torch.nn.modules.conv.Conv2d`)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Recoverable constructor settings (JSON values)."""
    params: tuple[str, ...] = ()
    """Names of its direct parameters (`weight`, `bias`)."""
    buffers: tuple[str, ...] = ()
    """Names of its direct persistent buffers (`running_mean`, ...)."""
    layer: str | None = None
    """Its layer identity, for modules that are layers; None for pure containers."""

    @property
    def short_cls(self) -> str:
        """The class's own name (`Conv2d`)."""
        return self.cls.rsplit(".", 1)[-1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "class": self.cls,
            "config": self.config,
            "params": list(self.params),
            "buffers": list(self.buffers),
            "layer": self.layer,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModuleEntry:
        """Read a stored entry, checking every field's type.

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        what = f"module {str(data.get('name'))[:60]!r}"
        return cls(
            name=required(data, "name", str, what),
            cls=required(data, "class", str, what),
            config=dict(optional(data, "config", dict, what, default={})),
            params=strings(
                optional(data, "params", list, what, default=[]), f"the params of {what}"
            ),
            buffers=strings(
                optional(data, "buffers", list, what, default=[]), f"the buffers of {what}"
            ),
            layer=optional(data, "layer", str, what),
        )


def class_name(module: nn.Module) -> str:
    """`module.qualname` of the module's class."""
    t = type(module)
    return f"{t.__module__}.{t.__qualname__}"


def module_config(module: nn.Module) -> dict[str, Any]:
    """The settings a module keeps as plain attributes, as JSON values.

    Every torch.nn layer keeps its constructor arguments as public attributes
    (`in_channels`, `kernel_size`, `eps`, `inplace`), and so do most custom modules;
    tensors, submodules and private state are not settings.
    """
    config: dict[str, Any] = {}
    attrs = vars(module)
    # Most of a module's attributes are torch's private state: drop them before sorting.
    for key in sorted(k for k in attrs if not k.startswith("_") and k != "training"):
        jsonable = _jsonable(attrs[key])
        if jsonable is not _SKIP:
            config[key] = jsonable
    if "bias" in module._parameters:
        # Conv and Linear take `bias=` but keep a parameter, not a flag.
        config["bias"] = module._parameters["bias"] is not None
    return config


def describe_modules(model: nn.Module) -> tuple[ModuleEntry, ...]:
    """The module tree of `model`, with layer identities, in `named_modules` order."""
    entries: list[ModuleEntry] = []
    previous = ""
    for name, module in model.named_modules():
        params = tuple(k for k, v in module._parameters.items() if v is not None)
        buffers = tuple(
            k
            for k, v in module._buffers.items()
            if v is not None and k not in module._non_persistent_buffers_set
        )
        config = module_config(module)
        cls = class_name(module)
        layer = None
        if not module._modules or params or buffers:
            shapes = [
                [k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                for k, t in [*module._parameters.items(), *module._buffers.items()]
                if t is not None
            ]
            body = json.dumps([previous, cls, config, shapes], sort_keys=True)
            layer = hashlib.sha256(body.encode()).hexdigest()[:32]
            previous = layer
        entries.append(
            ModuleEntry(
                name=name,
                cls=cls,
                config=config,
                params=params,
                buffers=buffers,
                layer=layer,
            )
        )
    return tuple(entries)


class _Skip:
    pass


_SKIP = _Skip()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, tuple | list) and all(isinstance(v, _SCALARS) for v in value):
        return [_jsonable(v) for v in value]
    return _SKIP
