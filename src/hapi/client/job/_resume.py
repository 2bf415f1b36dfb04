"""A job's resumable state: what `TransferJob.state_dict` holds besides the model.

The state is the user's own file on the trainer, never wire data. It is kept to what
`torch.load(weights_only=True)` reads (tensors, numbers, strings, lists, tuples, dicts),
so loading a state file runs no code from it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hapi.errors import InvalidRequest

__all__ = ["STATE_VERSION", "capture_rng", "read_state", "restore_rng"]

STATE_VERSION = 1
"""The layout of a job's state; a state of another version is refused."""


def capture_rng() -> dict[str, Any]:
    """The trainer's random states: torch (CPU, and CUDA once used), numpy's and Python's."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # The numpy state as plain numbers: a weights-only load refuses ndarrays.
        "numpy": (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Set the random states `capture_rng` returned."""
    torch.set_rng_state(rng["torch"])
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def read_state(source: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    """A state given as a dict or as the path of a file `torch.save` wrote.

    Raises:
        InvalidRequest: not a job's state, or one of another version.
    """
    state = source if isinstance(source, Mapping) else torch.load(source, weights_only=True)
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, Mapping) else None
        raise InvalidRequest(
            f"not a TransferJob state of version {STATE_VERSION} (got version {version!r}): "
            "save one with job.state_dict() or job.save_state(path)"
        )
    return state
