"""Feature batches in any memory layout: encoded with standard strides, decoded to equal values."""

from __future__ import annotations

import pytest
import torch

from hapi.wire import decode_batch, encode_batch, feature_schema


def _permuted() -> torch.Tensor:
    # ConvNeXt's pooled (N, 768, 1, 1): contiguous to torch, strides (768, 1, 768, 768).
    t = torch.randn(3, 1, 1, 768).permute(0, 3, 1, 2)
    assert t.is_contiguous() and t.stride() == (768, 1, 768, 768)
    return t


def _channels_last() -> torch.Tensor:
    return torch.randn(3, 8, 5, 6).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("make", [_permuted, _channels_last])
@pytest.mark.parametrize("wire_dtype", ["fp32", "fp16", "bf16"])
def test_any_layout_decodes_to_the_same_values(make: object, wire_dtype: str) -> None:
    features = make()  # type: ignore[operator]
    schema = feature_schema(list(features.shape[1:]), wire_dtype)  # type: ignore[arg-type]
    batch = decode_batch(encode_batch(schema, ["a", "b", "c"], [0, 1, 2], features))
    assert batch.features is not None
    assert batch.features.stride() == torch.empty(features.shape).stride()
    assert torch.equal(batch.features, features.to(batch.features.dtype))
