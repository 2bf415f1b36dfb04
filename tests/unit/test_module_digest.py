"""`module_digest`: a head's digest follows its content - program and weights - only."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from hapi.graph import ModelSpec, build_model, trace
from hapi.graph.content import module_digest

SPEC = ModelSpec(name="mobilenet_v3_small", num_classes=3)  # small to build: 2.5M parameters


def head(spec: ModelSpec = SPEC, cut: int = 5) -> nn.Module:
    return trace(build_model(spec), input_shape=(3, 32, 32)).head(cut).eval()


@functools.cache
def built() -> nn.Module:
    """One head of `SPEC`, built once: tests change copies of it only."""
    return head()


def test_heads_built_apart_with_the_same_content_have_one_digest() -> None:
    assert module_digest(head()) == module_digest(built())
    # The classifier lies beyond the cut: another one leaves the head's content alone.
    spec = ModelSpec(name="mobilenet_v3_small", num_classes=9)
    assert module_digest(head(spec)) == module_digest(built())


def test_one_changed_weight_changes_the_digest() -> None:
    a = built()
    b = copy.deepcopy(a)
    with torch.no_grad():
        next(iter(b.parameters())).view(-1)[0] += 1e-6
    assert module_digest(a) != module_digest(b)


def test_a_changed_buffer_cut_or_layer_setting_changes_the_digest() -> None:
    a = built()
    b = copy.deepcopy(a)
    bn = next(m for m in b.modules() if isinstance(m, nn.BatchNorm2d))
    bn.running_mean.add_(1.0)
    assert module_digest(a) != module_digest(b)
    assert module_digest(head(cut=4)) != module_digest(a)
    c = copy.deepcopy(a)
    conv = next(m for m in c.modules() if isinstance(m, nn.Conv2d))
    conv.stride = (1, 1)
    assert module_digest(a) != module_digest(c)


def test_bf16_weights_are_digested_by_their_bytes() -> None:
    a = nn.Linear(4, 2).to(torch.bfloat16)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.bias[0] = b.bias[0] + 1
    assert module_digest(a) != module_digest(b)
    assert module_digest(a) == module_digest(copy.deepcopy(a))
