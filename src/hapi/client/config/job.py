"""`JobConfig`: everything that defines a transfer-learning job, one part per concern
(`hapi.client.config.parts`), and `JobOptions`, the flat keywords `TransferJob` also takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Unpack

from torch import nn

from hapi.client.config.parts import (
    CacheConfig,
    ConnectConfig,
    DataConfig,
    FetchConfig,
    PlanningConfig,
    TrainingConfig,
    WireConfig,
)
from hapi.data import StoreOptions, Transforms
from hapi.errors import InvalidRequest, shorten
from hapi.graph import CutLike, ModelSpec
from hapi.plan.replan import ReplanConfig
from hapi.repo.storage.refs import is_repo_ref
from hapi.wire import OnError, WireDtype
from hapi.wire.codecs import Compression

__all__ = ["PARTS", "JobConfig", "JobOptions", "flat_names"]

PARTS: dict[str, type] = {
    "training": TrainingConfig,
    "data": DataConfig,
    "planning": PlanningConfig,
    "wire": WireConfig,
    "fetch": FetchConfig,
    "cache": CacheConfig,
    "connect": ConnectConfig,
}
"""`JobConfig`'s parts: the keyword each is given by, and its config."""

# Flat keywords that are not their field's name: `WireConfig(dtype=)` reads well nested,
# `wire_dtype=` flat, beside the other flat options.
_RENAMED = {
    "wire": {"dtype": "wire_dtype", "compression": "wire_compression", "lossy": "lossy_wire"},
    "cache": {"enabled": "cache", "dir": "cache_dir", "size": "cache_size"},
}


def flat_names(part: str) -> dict[str, str]:
    """The flat keyword of each field of `part` (a key of `PARTS`): {field: keyword}."""
    renamed = _RENAMED.get(part, {})
    return {f.name: renamed.get(f.name, f.name) for f in dataclasses.fields(PARTS[part])}


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A transfer-learning job: which model, which data, and one config per concern -
    training, data, planning, wire, fetching, cache, connecting.

    Build it nested (`JobConfig(model=..., planning=PlanningConfig(cut=3))`), or from
    `TransferJob`'s flat keywords with `from_options`; `TransferJob.from_config` runs it.

    Raises:
        InvalidRequest: a value out of range or of the wrong kind, saying what to pass.
    """

    model: ModelSpec | str | nn.Module
    """The pre-trained model: a spec both sides build, a repository reference
    (`repo://name@3`, `name@3`) both sides load from the model repository, or a module of
    your own (its frozen head is exported with torch.export and uploaded to the server)."""
    dataset: str
    """The training set's prefix in the server's store (ImageFolder layout)."""
    server: str | tuple[str, ...]
    """Address of the `hapi serve` beside the store (`grpc://host:port`), or several (one
    beside each storage node; a tuple, or one string with the addresses separated by
    commas): chunks are spread over them by their measured rates, and move from one that
    fails to the others."""
    repo: str | None = None
    """URI of the model repository, as the trainer reaches it: for `repo://` models and
    for `TransferJob.push`."""
    repo_store_options: StoreOptions | None = None
    """Endpoint and credentials of an S3 repository; the AWS variables when unset."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """What trains, where, in which batches (`num_classes`, `freeze`, `batch_size`, ...)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The samples (`image_size`, `transforms`, `augment`, `views`, `eval_dataset`)."""
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """Where the model is cut (`cut`, `local_share`, `replan`, `mode`, ...)."""
    wire: WireConfig = field(default_factory=WireConfig)
    """How features travel (`dtype`, `compression`, `lossy`, `exact`)."""
    fetch: FetchConfig = field(default_factory=FetchConfig)
    """How chunks are fetched and failures met (`chunk_size`, `retry_budget_s`, `store`)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The trainer's feature cache (`enabled`, `dir`, `size`)."""
    connect: ConnectConfig = field(default_factory=ConnectConfig)
    """The servers' token and TLS files."""

    def __post_init__(self) -> None:
        for part, kind in PARTS.items():
            if not isinstance(getattr(self, part), kind):
                raise InvalidRequest(
                    f"{part} must be a {kind.__name__}, got {shorten(repr(getattr(self, part)))}"
                )
        servers = self.servers
        if not servers or not all(servers):
            raise InvalidRequest(
                f"server must be an address such as 'grpc://127.0.0.1:8815', or several, got "
                f"{shorten(repr(self.server))}"
            )
        if len(set(servers)) != len(servers):
            raise InvalidRequest(f"a server is listed twice: {shorten(repr(servers))}")
        if isinstance(self.model, str) and self.repo is None:
            raise InvalidRequest(
                f"model {shorten(repr(self.model))} is a repository reference: pass "
                "repo=<the repository URI> (a model of the zoo is a ModelSpec)"
            )
        if self.training.num_classes is not None and isinstance(self.model, nn.Module):
            raise InvalidRequest(
                "num_classes replaces the classifier of a named model; give your own module "
                "the classifier you want before passing it"
            )

    @classmethod
    def from_options(
        cls,
        model: ModelSpec | str | dict[str, Any] | nn.Module,
        dataset: str,
        server: str | Sequence[str],
        **options: Unpack[JobOptions],
    ) -> JobConfig:
        """A config from `TransferJob`'s arguments: a model's name (`resnet18`) or spec
        dict taken as a `ModelSpec`, flat keywords sorted into their parts, parts given
        whole kept.

        Raises:
            InvalidRequest: a part given both whole and by its flat keywords, or a bad value.
            TypeError: an unknown keyword.
        """
        if isinstance(model, str) and not is_repo_ref(model):
            model = ModelSpec(name=model)
        elif isinstance(model, dict):
            model = ModelSpec.from_dict(model)
        given: dict[str, Any] = dict(options)
        top = {name: given.pop(name) for name in ("repo", "repo_store_options") if name in given}
        parts: dict[str, Any] = {}
        for part, kind in PARTS.items():
            whole = given.pop(part, None)
            if part == "cache" and isinstance(whole, bool):  # the flat `cache=False`
                given["cache"], whole = whole, None
            flat = {f: given.pop(k) for f, k in flat_names(part).items() if k in given}
            if whole is None:
                parts[part] = kind(**flat)
            elif flat:
                names = ", ".join(flat_names(part)[f] for f in flat)
                raise InvalidRequest(
                    f"{names} given beside {part}=: pass them inside {kind.__name__}(...) or "
                    "all flat, not both"
                )
            else:
                parts[part] = whole
        if given:
            raise TypeError(f"unknown job options: {', '.join(sorted(given))}")
        address = server if isinstance(server, str) else tuple(server)
        return cls(model=model, dataset=dataset, server=address, **top, **parts)

    def options(self) -> JobOptions:
        """The keywords that give `TransferJob` this config (its parts whole)."""
        given: dict[str, Any] = {"repo": self.repo, "repo_store_options": self.repo_store_options}
        given.update({part: getattr(self, part) for part in PARTS})
        return JobOptions(**given)  # type: ignore[typeddict-item]

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers' addresses, in the order given."""
        if isinstance(self.server, str):
            return tuple(a.strip() for a in self.server.split(","))
        return tuple(self.server)

    @property
    def train_transforms(self) -> Transforms:
        """The transforms training samples go through (`DataConfig`)."""
        return self.data.train_transforms

    @property
    def test_transforms(self) -> Transforms:
        """The transforms evaluation samples go through (`DataConfig`)."""
        return self.data.test_transforms


class JobOptions(TypedDict, total=False):
    """`TransferJob`'s keyword options, so editors and type checkers know each name and
    type: each part of `JobConfig` whole (`planning=PlanningConfig(...)`), or its fields
    as flat keywords (`cut=3`), not both for one part. `cache` is the flat bool or the
    part whole."""

    repo: str | None
    repo_store_options: StoreOptions | None
    training: TrainingConfig
    data: DataConfig
    planning: PlanningConfig
    wire: WireConfig
    fetch: FetchConfig
    cache: bool | CacheConfig
    connect: ConnectConfig
    num_classes: int | None
    freeze: int | str | None
    batch_size: int
    device: str
    distributed: bool | None
    seed: int
    eval_dataset: str | None
    image_size: int
    transforms: Transforms | None
    eval_transforms: Transforms | None
    augment: bool
    views: int | None
    mode: Literal["pushdown", "local"]
    cut: CutLike
    local_share: float
    replan: bool | ReplanConfig
    probe_samples: int
    reuse_profiles: bool
    wire_dtype: WireDtype
    wire_compression: Compression | Literal["auto"]
    lossy_wire: bool
    exact: bool
    head_dtype: Literal["fp32", "bf16"]
    chunk_size: int
    prefetch: int
    retry_budget_s: float
    store: str | None
    store_options: StoreOptions | None
    on_error: OnError
    cache_dir: str | None
    cache_size: int | str
    listing_fresh_s: float
    token: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
