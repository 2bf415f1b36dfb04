"""A job's model from a repository version: its spec built, its tensors loaded."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn

from hapi.errors import InvalidRequest
from hapi.graph import ModelSpec, build_model

if TYPE_CHECKING:
    from hapi.repo import ModelRepo, ModelVersion

__all__ = ["build_from_repo"]


def build_from_repo(
    repo: ModelRepo, version: ModelVersion, *, num_classes: int | None = None
) -> tuple[ModelSpec, nn.Module]:
    """The version's spec and model with its tensors, the classifier replaced if asked.

    Raises:
        InvalidRequest: the version was pushed without a spec.
        IntegrityError: its tensors do not fit the architecture (other than a replaced
            classifier).
    """
    stored = repo.manifest(version).spec
    if stored is None:
        raise InvalidRequest(
            f"{version.ref} was pushed without a model spec, so neither the trainer nor "
            "the server can build its architecture: push it with spec=ModelSpec(...)"
        )
    spec = ModelSpec.from_dict(dict(stored))
    if num_classes is not None:
        spec = dataclasses.replace(spec, num_classes=num_classes)
    # The stored tensors replace the init, so skip loading pre-trained weights.
    model = build_model(dataclasses.replace(spec, weights=None))
    if num_classes is None:
        repo.load_into(model, version)  # checks every key and shape before loading
        return spec, model
    state = repo.pull(version)
    own = model.state_dict()
    if set(state) != set(own):
        repo.load_into(model, version)  # raises, naming the keys that do not match
    # Only the replaced classifier differs in shape: it keeps its fresh (seeded) init.
    model.load_state_dict({k: v for k, v in state.items() if v.shape == own[k].shape}, strict=False)
    return spec, model
