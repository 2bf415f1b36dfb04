"""Any memory layout on the wire: heads return standard strides; the wire encodes them."""

from __future__ import annotations

import pytest
import torch

from hapi.graph import ModelSpec, build_model, standard_layout, trace
from hapi.graph.strides import is_standard_layout
from hapi.wire import decode_batch, encode_batch, feature_schema


def test_standard_layout_views_hidden_permutations_and_copies_real_ones() -> None:
    hidden = torch.randn(2, 1, 1, 6).permute(0, 3, 1, 2)  # what ConvNeXt's avgpool gives
    assert hidden.is_contiguous() and not is_standard_layout(hidden)
    fixed = standard_layout(hidden)
    assert fixed.stride() == (6, 1, 1, 1) and fixed.data_ptr() == hidden.data_ptr()
    assert torch.equal(fixed, hidden)

    channels_last = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    copied = standard_layout(channels_last)
    assert copied.stride() == (60, 20, 5, 1) and torch.equal(copied, channels_last)

    plain = torch.randn(2, 3)
    assert standard_layout(plain) is plain


# 28M parameters each to initialise: the fast tier keeps one model that permutes.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) for n in ("convnext_tiny", "swin_t")]
)
def test_permuted_activations_cross_the_wire_in_every_dtype(name: str) -> None:
    model = build_model(ModelSpec(name=name))
    graph = trace(model, (3, 64, 64))
    cut = graph.resolve_cut("avgpool")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        features = graph.head(cut)(x)
        assert is_standard_layout(features)
        expected = model(x)
        for wire_dtype in ("fp32", "fp16", "bf16"):
            schema = feature_schema(list(graph.cut_point(cut).shape), wire_dtype)
            batch = decode_batch(encode_batch(schema, ["a", "b"], [0, 1], features))
            assert batch.features is not None
            assert torch.equal(batch.features, features.to(batch.features.dtype))
        schema = feature_schema([768, 1, 1], "fp32")
        sent = decode_batch(encode_batch(schema, ["a", "b"], [0, 1], features)).features
        assert sent is not None and torch.equal(graph.tail(cut)(sent), expected)
