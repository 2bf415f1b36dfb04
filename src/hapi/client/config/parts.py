"""The parts of a `JobConfig`: one small frozen config per concern of a job, each checking
its own fields (as torchtitan's `Trainer.Config` nests each component's config).

`TransferJob` takes them nested (`planning=PlanningConfig(cut=3)`) or as the flat keywords
of `JobOptions` (`cut=3`); `JobConfig.from_options` sorts the flat ones into these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from hapi._sizes import parse_bytes
from hapi.data import StoreOptions, Transforms
from hapi.errors import InvalidRequest, shorten
from hapi.graph import Cut, CutLike
from hapi.plan.replan import ReplanConfig
from hapi.wire import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, OnError, WireDtype, check_wire_dtype
from hapi.wire.codecs import COMPRESSIONS, Compression

__all__ = [
    "CacheConfig",
    "ConnectConfig",
    "DataConfig",
    "FetchConfig",
    "PlanningConfig",
    "TrainingConfig",
    "WireConfig",
]


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """What trains, where, and in which batches."""

    num_classes: int | None = None
    """Replace the model's classifier with a fresh one of this many outputs; None keeps it."""
    freeze: int | str | None = None
    """Last frozen cut point: index, module name (`layer3`); None: from `requires_grad` if
    something is frozen, else everything but the classifier."""
    batch_size: int = 32
    """Training batch size."""
    device: str = "cpu"
    """Where the tail trains: `cpu`, `cuda`, `cuda:N` (under torchrun, `cuda` is the
    rank's own GPU)."""
    distributed: bool | None = None
    """Data-parallel training with DDP: None when there are several ranks (torchrun's
    environment, or a process group already initialised), True to require them, False to
    train alone; `batch_size` is then per rank."""
    seed: int = 0
    """Seeds the epoch order, the augmentations and the trainable layers' randomness."""

    def __post_init__(self) -> None:
        if self.num_classes is not None and self.num_classes < 1:
            raise InvalidRequest(
                f"num_classes must be >= 1, got {self.num_classes}; or leave it unset to keep "
                "the model's classifier"
            )
        if self.batch_size < 1:
            raise InvalidRequest(f"batch_size must be >= 1, got {self.batch_size}")
        if not (self.distributed is None or isinstance(self.distributed, bool)):
            raise InvalidRequest(
                f"distributed must be None, True or False, got {shorten(repr(self.distributed))}"
            )


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The samples: evaluation set, image size, transforms and augmentation."""

    eval_dataset: str | None = None
    """The evaluation set's prefix; None evaluates on `dataset` with eval transforms."""
    image_size: int = 224
    """Input height and width."""
    transforms: Transforms | None = None
    """Training transforms; None: `Transforms.train(image_size)` (random crop and flip),
    or the eval transforms with `augment=False`."""
    eval_transforms: Transforms | None = None
    """Evaluation transforms; None: `Transforms.eval(image_size)`."""
    augment: bool = True
    """Train on randomly augmented samples (the default transforms); False trains on the
    eval transforms, which are deterministic: every feature is cached after epoch 1."""
    views: int | None = None
    """Draw each sample's augmentation from this many seeded views (epoch e draws view
    e mod K): from epoch K on, every feature repeats and comes from the cache. None:
    fresh augmentation every epoch, never cached."""

    def __post_init__(self) -> None:
        if not MIN_IMAGE_SIZE <= self.image_size <= MAX_IMAGE_SIZE:
            raise InvalidRequest(
                f"image_size must be {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE} pixels (what a server "
                f"accepts), got {self.image_size}"
            )
        if self.views is not None and (
            isinstance(self.views, bool) or not isinstance(self.views, int) or self.views < 1
        ):
            raise InvalidRequest(
                f"views must be a whole number >= 1, got {shorten(repr(self.views))}; or None "
                "for fresh augmentation every epoch"
            )
        if self.views is not None and self.transforms is not None and self.transforms.views:
            raise InvalidRequest(
                "views is given twice: in transforms and as views=; pass one of them"
            )
        if self.views is not None and not self.augment:
            raise InvalidRequest(
                "views=K draws each sample's augmentation from K views, but augment=False "
                "trains without augmentation: pass one of them"
            )
        if not self.augment and self.transforms is not None:
            raise InvalidRequest(
                "augment=False trains on the eval transforms, but transforms= gives others: "
                "pass one of them"
            )

    @property
    def train_transforms(self) -> Transforms:
        """The transforms training samples go through."""
        if not self.augment:
            return self.test_transforms
        transforms = self.transforms or Transforms.train(self.image_size)
        if self.views is not None and transforms.is_random:
            transforms = replace(transforms, views=self.views)
        return transforms

    @property
    def test_transforms(self) -> Transforms:
        """The transforms evaluation samples go through."""
        return self.eval_transforms or Transforms.eval(self.image_size)


@dataclass(frozen=True, kw_only=True)
class PlanningConfig:
    """Where the model is cut, and who chooses it."""

    mode: Literal["pushdown", "local"] = "pushdown"
    """`local`: the baseline, fetching raw bytes and running everything in the trainer."""
    cut: CutLike = "auto"
    """Where to split: `auto` (the planner chooses the cut and local share from
    measurements), a cut index or cut point name, or `freeze` (None) for the freeze
    point; any form `Cut.of` reads."""
    local_share: float = 0.0
    """With an explicit cut: the share of chunks the trainer computes itself from raw
    bytes (a fixed hybrid plan); `auto` chooses its own."""
    replan: bool | ReplanConfig = True
    """With `cut="auto"`: re-plan from measured chunks while training (a `ReplanConfig`
    says when); False keeps the first plan."""
    probe_samples: int = 16
    """Objects the planner's probes read to measure the server, the link and decoding."""
    reuse_profiles: bool = True
    """Keep the trainer's measured head and training times on disk (`$HAPI_CACHE_DIR`)
    for later jobs on the same model, batch size and machine; False measures every job."""

    def __post_init__(self) -> None:
        if self.mode not in ("pushdown", "local"):
            raise InvalidRequest(
                f"mode must be 'pushdown' or 'local', got {shorten(repr(self.mode))}"
            )
        cut = Cut.of(self.cut)  # refuses what is no cut
        if not 0.0 <= self.local_share <= 1.0:
            raise InvalidRequest(
                f"local_share must be in [0, 1] (the share of chunks computed in the trainer), "
                f"got {self.local_share}"
            )
        if self.local_share and cut.auto:
            raise InvalidRequest(
                "local_share goes with an explicit cut; with cut='auto' the planner chooses it"
            )
        if not isinstance(self.replan, bool | ReplanConfig):
            raise InvalidRequest(f"replan must be a bool or a ReplanConfig, got {self.replan!r}")
        if self.probe_samples < 1:
            raise InvalidRequest(f"probe_samples must be >= 1, got {self.probe_samples}")


@dataclass(frozen=True, kw_only=True)
class WireConfig:
    """How features travel, and whether they must equal the trainer's own bit for bit.

    `exact` is here, not with the training options, because what it constrains is the
    wire: it refuses a rounded dtype and lossy codecs."""

    dtype: WireDtype = "fp32"
    """Dtype of features on the wire: fp32 (exact), fp16, bf16, int8 or fp8 (a quarter of
    fp32's bytes, dequantized on the trainer; lossy, see README "What is guaranteed").
    Flat keyword: `wire_dtype`."""
    compression: Compression | Literal["auto"] = "auto"
    """Lossless buffer compression of feature streams: none, lz4 or zstd (kept with
    `exact=True`), or `auto`: with `cut="auto"` the planner chooses it with the cut, from
    each one's measured bytes and CPU (with a fixed cut, `auto` sends none: nothing was
    measured). A string rather than None, as `cut` is: "auto" says who chooses, and None
    would read as "no compression". A server that predates it sends none. Flat keyword:
    `wire_compression`."""
    lossy: bool = False
    """With `cut="auto"`: let the planner send features as fp16, int8 or fp8 where their fewer
    bytes pay (lossy: see README "What is guaranteed"); refused with `exact=True`. While
    the training loop's features are cached (`cache`, deterministic transforms) the dtype
    stays `dtype`: the cache's entries are keyed by it. Flat keyword: `lossy_wire`."""
    exact: bool = False
    """Run the frozen head per sample wherever it runs (server, trainer), so every plan
    gives bit-identical features and losses; slower. False: batched, equal to tolerance."""
    head_dtype: Literal["fp32", "bf16"] = "fp32"
    """bf16: let the server run the frozen head in bf16 where its device has bf16 kernels
    (2x faster on an AMX CPU; features within 0.5-3.6% of the fp32 head's largest value,
    by model: README "What is guaranteed"). Refused with `exact=True`."""

    def __post_init__(self) -> None:
        check_wire_dtype(self.dtype)
        if self.exact and self.dtype != "fp32":
            raise InvalidRequest(
                f"exact=True needs wire_dtype='fp32' (got {shorten(repr(self.dtype))}): "
                "features rounded on the wire differ from the trainer's own; "
                "wire_compression='zstd' or 'lz4' saves bytes losslessly"
            )
        if self.compression not in ("auto", *COMPRESSIONS):
            raise InvalidRequest(
                f"unknown wire_compression {shorten(repr(self.compression))}: use auto "
                "(the planner chooses), none, lz4 or zstd"
            )
        if self.exact and self.head_dtype != "fp32":
            raise InvalidRequest(
                "exact=True refuses head_dtype='bf16': a bf16 head rounds the features"
            )
        if self.head_dtype not in ("fp32", "bf16"):
            raise InvalidRequest(
                f"head_dtype is 'fp32' or 'bf16', got {shorten(repr(self.head_dtype))}"
            )
        if self.exact and self.lossy:
            raise InvalidRequest(
                "exact=True refuses lossy_wire=True: fp16, int8 and fp8 features differ from the "
                "trainer's own; drop one of them (lossless compression stays chosen)"
            )


@dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """How chunks are fetched, and what happens when a server, the store or an object
    fails."""

    chunk_size: int = 64
    """Keys per chunk request."""
    prefetch: int = 4
    """Chunks in flight at once per server; a hybrid plan has as many local ones beside."""
    retry_budget_s: float = 60.0
    """Seconds a chunk is retried (backoff with jitter) when the server or its store is
    unreachable or its stream is cut; 0 fails at once."""
    store: str | None = None
    """The servers' store as this trainer reaches it (`s3://bucket/prefix`, a directory),
    the same root the servers serve: while no server answers, chunks are read from it
    and computed here from raw bytes. None: chunks wait for a server (`retry_budget_s`)."""
    store_options: StoreOptions | None = None
    """Endpoint and credentials of an S3 `store`; the AWS variables when unset."""
    on_error: OnError = "raise"
    """A bad object fails the epoch (`raise`), or is skipped and reported (`skip`)."""

    def __post_init__(self) -> None:
        for name in ("chunk_size", "prefetch"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.retry_budget_s < float("inf"):
            raise InvalidRequest(
                f"retry_budget_s must be >= 0 seconds (0: never retry), got {self.retry_budget_s}"
            )
        if self.on_error not in ("raise", "skip"):
            raise InvalidRequest(
                f"on_error must be 'raise' or 'skip', got {shorten(repr(self.on_error))}"
            )


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The trainer's feature cache."""

    enabled: bool = True
    """Keep features in the trainer's feature cache (`dir`) when the transforms make them
    repeat; later epochs and later jobs on the same head read them from there. Flat
    keyword: `cache` (a bool)."""
    dir: str | None = None
    """The trainer's feature cache; None: `$HAPI_CACHE_DIR/features` (`~/.cache/hapi`).
    Flat keyword: `cache_dir`."""
    size: int | str = "10GiB"
    """The feature cache's bound on disk (`10GiB`, or bytes): least recently used go.
    Flat keyword: `cache_size`."""
    listing_fresh_s: float = 60.0
    """How long the job's own listing of its dataset stands for the first epoch's object
    versions (the time from building a job to its first epoch: planning, a warm-up).
    Later, the first epoch lists again, so an object rewritten meanwhile is a miss."""

    def __post_init__(self) -> None:
        parse_bytes(self.size)
        if not 0.0 <= self.listing_fresh_s < float("inf"):
            raise InvalidRequest(
                f"listing_fresh_s must be >= 0 seconds, got {self.listing_fresh_s!r}"
            )

    @property
    def max_bytes(self) -> int:
        """`size` in bytes."""
        return parse_bytes(self.size)


@dataclass(frozen=True, kw_only=True)
class ConnectConfig:
    """How the trainer authenticates to its servers."""

    token: str | None = None
    """The server's bearer token (your tenant's), if it has one."""
    tls_ca: str | None = None
    """PEM file of the CA that signed the server's certificate, for a `grpc+tls://`
    server; None trusts the system's CAs."""
    tls_cert: str | None = None
    """PEM file of a client certificate, for a server that asks for one (mutual TLS)."""
    tls_key: str | None = None
    """PEM file of `tls_cert`'s private key."""
