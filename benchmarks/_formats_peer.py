"""The peer of the formats benchmark: a PyTorch `DataLoader` over `s3torchconnector`'s
`S3IterableDataset`, reading the WebDataset shards whole (WebDataset's own way: stream each
tar, group its members by key) and decoding and transforming each image as hapi's trainer
does at RAW (`hapi.data.images.load_sample`, `Transforms.eval(64)`), in 64-sample batches.
It runs in a subprocess pinned to the trainer's core, its workers with it, so it has the
cores hapi's trainer has; SeaweedFS and its requests' latency are the same as hapi's.

    python _formats_peer.py BUCKET_URI ENDPOINT WORKERS   # prints samples and seconds
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset


class _Samples(IterableDataset[tuple[torch.Tensor, int]]):
    """Each shard's samples (a worker reads every `workers`-th shard)."""

    def __init__(self, bucket: str, endpoint: str) -> None:
        self.bucket, self.endpoint = bucket, endpoint

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        from s3torchconnector import S3ClientConfig, S3IterableDataset

        from hapi.data import Transforms
        from hapi.data.images import load_sample
        from hapi.data.shards.tar_index import split_wds_name

        transforms = Transforms.eval(64)
        shards = S3IterableDataset.from_prefix(
            f"{self.bucket}/webdataset/",
            region="us-east-1",
            endpoint=self.endpoint,
            s3client_config=S3ClientConfig(force_path_style=True),
            enable_sharding=True,
        )
        for reader in shards:
            if not reader.key.endswith(".tar"):
                continue  # classes.txt
            image: dict[str, bytes] = {}
            label: dict[str, int] = {}
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                for member in tar:
                    key, ext = split_wds_name(member.name) or (member.name, "")
                    body = tar.extractfile(member)
                    if body is None:
                        continue  # not a regular file
                    data = body.read()
                    if ext == "cls":
                        label[key] = int(data)
                    else:
                        image[key] = data
                    if key in image and key in label:
                        tensor = load_sample(image.pop(key), key, transforms, 0)
                        yield tensor, label.pop(key)


def _init_worker(_: int) -> None:
    torch.set_num_threads(1)


def main() -> None:
    bucket, endpoint, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    loader = DataLoader(
        _Samples(bucket, endpoint),
        batch_size=64,
        num_workers=workers,
        worker_init_fn=_init_worker,
        prefetch_factor=4,
        persistent_workers=True,
    )
    # Epoch 2 of 2 is reported: the workers' start (and their imports) is behind it.
    for _ in range(2):
        samples = 0
        t0 = time.perf_counter()
        for images, labels in loader:
            samples += len(labels)
            if images.shape[1:] != (3, 64, 64):
                raise RuntimeError(f"the peer made {tuple(images.shape)} inputs")
        seconds = time.perf_counter() - t0
    print(json.dumps({"samples": samples, "seconds": seconds}))


def peer_epoch(bucket: str, endpoint: str, weed: Any, core: int, workers: int) -> tuple[int, float]:
    """One epoch of the peer in a subprocess pinned to `core`: (samples, seconds)."""
    from _host import taskset

    env = {**os.environ, **weed.client_env, "OMP_NUM_THREADS": "1"}
    cmd = [*taskset(core), sys.executable, __file__, bucket, endpoint, str(workers)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return int(result["samples"]), float(result["seconds"])


if __name__ == "__main__":
    main()
