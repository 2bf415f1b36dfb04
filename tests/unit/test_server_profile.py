"""Which server profiles itself: one unlike the trainer (another device, other threads, or
an older server that does not say) answers the `profile` action; one alike has the
trainer's heads scaled to its level."""

from __future__ import annotations

import torch

from hapi.client.planning._server_profile import alike
from hapi.graph import ModelSpec, build_model, trace
from hapi.wire.replies import SessionInfo


def _info(device: str, threads: int) -> SessionInfo:
    return SessionInfo(session="s", cut=1, freeze=1, num_cuts=2, feature_shape=[4],
                       wire_dtype="fp32", bytes_per_sample=16, device=device,
                       threads=threads)  # fmt: skip


def test_a_server_alike_is_one_on_the_trainers_device_with_as_many_threads() -> None:
    graph = trace(build_model(ModelSpec(name="resnet18", num_classes=2)), (3, 32, 32))
    here = torch.get_num_threads()
    assert alike(_info("cpu", here), graph)
    assert not alike(_info("cpu", here + 1), graph)  # threads weigh layers differently
    assert not alike(_info("cuda:0", here), graph)
    assert not alike(_info("", 0), graph)  # an older server says neither
