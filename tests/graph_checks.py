"""Checks shared by the graph tests: a split is exact, also across the wire and in training."""

from __future__ import annotations

import copy

import torch
from torch import nn

from hapi.graph import INPUT, ModelGraph, model_output
from hapi.wire import decode_batch, encode_batch, feature_schema


def split_exactly(model: nn.Module, graph: ModelGraph, cuts: list[int] | None = None) -> None:
    """In eval mode, `tail(head(x))` equals the model's output bit for bit at each cut,
    also when the activation goes through the wire's fp32 encoding; shapes are as said."""
    model.eval()
    x = torch.randn(2, *graph.input_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model_output(model(x))
        for cut in range(graph.num_cuts + 1) if cuts is None else cuts:
            features = graph.head(cut).eval()(x)
            shape = graph.input_shape if cut == INPUT else graph.cut_point(cut).shape
            assert tuple(features.shape[1:]) == tuple(shape), f"cut {cut}"
            tail = graph.tail(cut).eval()
            assert torch.equal(tail(features), expected), f"cut {cut}"
            schema = feature_schema(list(shape), "fp32")
            sent = decode_batch(encode_batch(schema, ["a", "b"], [0, 1], features)).features
            assert sent is not None and torch.equal(tail(sent), expected), f"cut {cut} (wire)"


def train_step_both_ways(model: nn.Module, graph: ModelGraph, cut: int, seed: int) -> None:
    """One step through head and tail and one through a copy of the original; equal."""
    # As TransferJob does: the tail in train mode, then the head's modules in eval mode
    # and its parameters frozen. The reference copies the model with those flags.
    model.train()
    tail = graph.tail(cut).train()
    head = graph.head(cut)
    for module in head.modules():
        module.eval()
    for _, p in graph.head_parameters(cut):
        p.requires_grad_(False)
    reference = copy.deepcopy(model)
    x = torch.randn(4, *graph.input_shape, generator=torch.Generator().manual_seed(seed))

    torch.manual_seed(seed)
    with torch.no_grad():
        features = head(x)
    out = tail(features)
    out.square().mean().backward()
    torch.manual_seed(seed)
    expected = model_output(reference(x))
    expected.square().mean().backward()

    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grads = dict(reference.named_parameters())
    trained = 0
    for name, p in model.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None, name
            continue
        trained += 1
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=0, msg=name)
    assert trained > 0
    buffers = dict(reference.named_buffers())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name], rtol=0, atol=0, msg=name)
    model.zero_grad(set_to_none=True)


class NoisyAux(nn.Module):
    """A user's root forward with training-only branches: feature noise, an auxiliary head.

    Args:
        classes: outputs of the classifier and of the auxiliary head.
        seed: seeds the initial weights (None: torch's global generator as it is).
    """

    def __init__(self, classes: int = 5, seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, classes)
        self.aux = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self.stem(x))
        if self.training:
            x = x + 0.1 * torch.randn_like(x)
        x = x.mean(dim=(2, 3))
        out = self.fc(x)
        if self.training:
            out = out + 0.5 * self.aux(x)
        return out
