"""Heads of sessions whose features cross as bf16 or fp8 compute in bf16 where the
CPU has bf16 kernels: the session says so, the features stay within bf16's rounding of the
fp32 head's, and `bf16_heads=False` keeps every head in fp32."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hapi.client import FeatureLoader, connect
from hapi.data import Transforms, open_store, synth_dataset
from hapi.graph.precision import bf16_native, head_dtype
from hapi.server import HapiServer, serve
from hapi.wire import SessionRequest

SIZE = 64
NATIVE = bf16_native("cpu")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("store")
    synth_dataset(open_store(root), "train", classes=2, per_class=6, size=80, seed=2)
    return str(root)


@pytest.fixture(scope="module")
def server(root: str) -> Iterator[HapiServer]:
    with serve(store=root, batch_size=6) as running:
        yield running


def _features(server: HapiServer, wire_dtype: str) -> tuple[str, dict[str, torch.Tensor]]:
    """The session's head dtype, and each key's features at ResNet-18's layer3."""
    request = SessionRequest(
        model={"name": "resnet18"},
        cut=10,
        freeze=10,
        transforms=Transforms.eval(SIZE).to_dict(),
        image_size=SIZE,
        wire_dtype=wire_dtype,
    )
    with connect(server.address) as conn:
        info = conn.open_session(request)
        manifest = conn.manifest("train")
        loader = FeatureLoader(conn, info.session, manifest, batch_size=4, shuffle=False)
        features = {
            k: f for b in loader.batches(0) for k, f in zip(b.keys, b.features, strict=True)
        }
        conn.close_session(info.session)
    return info.head_dtype, features


def test_a_bf16_session_computes_its_head_in_bf16_within_its_rounding(
    server: HapiServer,
) -> None:
    dtype, fp32 = _features(server, "fp32")
    assert dtype == "float32"
    dtype, bf16 = _features(server, "bf16")
    assert dtype == ("bfloat16" if NATIVE else "float32")
    assert fp32.keys() == bf16.keys()
    scale = max(f.abs().max().item() for f in fp32.values())
    worst = max((fp32[k] - bf16[k]).abs().max().item() for k in fp32)
    # bf16 keeps 8 significant bits (2^-9 relative); layers in bf16 compound it: 0.8%
    # of the largest value measured.
    assert 0 < worst < 0.02 * scale


def test_a_server_may_keep_every_head_in_fp32(root: str) -> None:
    with serve(store=root, batch_size=6, bf16_heads=False) as server:
        dtype, _ = _features(server, "bf16")
    assert dtype == "float32"


def test_the_rule_takes_bf16_only_where_nothing_finer_was_asked() -> None:
    cpu = torch.device("cpu")
    bf16 = torch.bfloat16 if NATIVE else torch.float32
    assert head_dtype("bf16", exact=False, device=cpu) == bf16
    assert head_dtype("fp8", exact=False, device=cpu) == bf16
    assert head_dtype("fp16", exact=False, device=cpu) == torch.float32  # finer than bf16
    assert head_dtype("int8", exact=False, device=cpu) == torch.float32  # range / 510
    assert head_dtype("fp32", exact=False, device=cpu) == torch.float32
    assert head_dtype("bf16", exact=True, device=cpu) == torch.float32
    assert head_dtype("bf16", exact=False, device=cpu, allow=False) == torch.float32
