"""`JobConfig`: everything that defines a transfer-learning job."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, TypedDict

from torch import nn

from hapi._sizes import parse_bytes
from hapi.data import StoreOptions, Transforms
from hapi.errors import InvalidRequest, shorten
from hapi.graph import RAW, ModelSpec
from hapi.plan.replan import ReplanConfig
from hapi.wire import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, OnError, WireDtype, check_wire_dtype
from hapi.wire.codecs import COMPRESSIONS, Compression

__all__ = ["JobConfig", "JobOptions"]


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A transfer-learning job: which model, which data, where the cut is, how to train.

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
    store: str | None = None
    """The servers' store as this trainer reaches it (`s3://bucket/prefix`, a directory),
    the same root the servers serve: while no server answers, chunks are read from it
    and computed here from raw bytes. None: chunks wait for a server (`retry_budget_s`)."""
    store_options: StoreOptions | None = None
    """Endpoint and credentials of an S3 `store`; the AWS variables when unset."""
    repo: str | None = None
    """URI of the model repository, as the trainer reaches it: for `repo://` models and
    for `TransferJob.push`."""
    repo_store_options: StoreOptions | None = None
    """Endpoint and credentials of an S3 repository; the AWS variables when unset."""
    num_classes: int | None = None
    """Replace the model's classifier with a fresh one of this many outputs; None keeps it."""
    eval_dataset: str | None = None
    """The evaluation set's prefix; None evaluates on `dataset` with eval transforms."""
    freeze: int | str | None = None
    """Last frozen cut point: index, module name (`layer3`); None: from `requires_grad` if
    something is frozen, else everything but the classifier."""
    cut: int | str | None = "auto"
    """Where to split: `auto` (the planner chooses the cut and local share from
    measurements), a cut index or cut point name, or None for the freeze point."""
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
    retry_budget_s: float = 60.0
    """Seconds a chunk is retried (backoff with jitter) when the server or its store is
    unreachable or its stream is cut; 0 fails at once."""
    mode: Literal["pushdown", "local"] = "pushdown"
    """`local`: the baseline, fetching raw bytes and running everything in the trainer."""
    image_size: int = 224
    """Input height and width."""
    transforms: Transforms | None = None
    """Training transforms; None: `Transforms.train(image_size)` (random crop and flip),
    or the eval transforms with `augment=False`."""
    augment: bool = True
    """Train on randomly augmented samples (the default transforms); False trains on the
    eval transforms, which are deterministic: every feature is cached after epoch 1."""
    views: int | None = None
    """Draw each sample's augmentation from this many seeded views (epoch e draws view
    e mod K): from epoch K on, every feature repeats and comes from the cache. None:
    fresh augmentation every epoch, never cached."""
    cache: bool = True
    """Keep features in the trainer's feature cache (`cache_dir`) when the transforms make
    them repeat; later epochs and later jobs on the same head read them from there."""
    cache_dir: str | None = None
    """The trainer's feature cache; None: `$HAPI_CACHE_DIR/features` (`~/.cache/hapi`)."""
    cache_size: int | str = "10GiB"
    """The feature cache's bound on disk (`10GiB`, or bytes): least recently used go."""
    eval_transforms: Transforms | None = None
    """Evaluation transforms; None: `Transforms.eval(image_size)`."""
    batch_size: int = 32
    """Training batch size."""
    chunk_size: int = 64
    """Keys per chunk request."""
    prefetch: int = 4
    """Chunks in flight at once per server; a hybrid plan has as many local ones beside."""
    wire_dtype: WireDtype = "fp32"
    """Dtype of features on the wire: fp32 (exact), fp16, bf16, or int8 (a quarter of
    fp32's bytes, dequantized on the trainer; lossy, see README "What is guaranteed")."""
    wire_compression: Compression | Literal["auto"] = "auto"
    """Lossless buffer compression of feature streams: none, lz4 or zstd (kept with
    `exact=True`), or `auto`: with `cut="auto"` the planner chooses it with the cut, from
    each one's measured bytes and CPU (with a fixed cut, `auto` sends none: nothing was
    measured). A string rather than None, as `cut` is: "auto" says who chooses, and None
    would read as "no compression". A server that predates it sends none."""
    lossy_wire: bool = False
    """With `cut="auto"`: let the planner send features as fp16 or int8 where their fewer
    bytes pay (lossy: see README "What is guaranteed"); refused with `exact=True`. While
    the training loop's features are cached (`cache`, deterministic transforms) the dtype
    stays `wire_dtype`: the cache's entries are keyed by it."""
    device: str = "cpu"
    """Where the tail trains: `cpu`, `cuda`, `cuda:N` (under torchrun, `cuda` is the
    rank's own GPU)."""
    distributed: bool | None = None
    """Data-parallel training with DDP: None when there are several ranks (torchrun's
    environment, or a process group already initialised), True to require them, False to
    train alone; `batch_size` is then per rank."""
    seed: int = 0
    """Seeds the epoch order, the augmentations and the trainable layers' randomness."""
    on_error: OnError = "raise"
    """A bad object fails the epoch (`raise`), or is skipped and reported (`skip`)."""
    exact: bool = False
    """Run the frozen head per sample wherever it runs (server, trainer), so every plan
    gives bit-identical features and losses; slower. False: batched, equal to tolerance."""
    token: str | None = None
    """The server's bearer token (your tenant's), if it has one."""
    tls_ca: str | None = None
    """PEM file of the CA that signed the server's certificate, for a `grpc+tls://`
    server; None trusts the system's CAs."""
    tls_cert: str | None = None
    """PEM file of a client certificate, for a server that asks for one (mutual TLS)."""
    tls_key: str | None = None
    """PEM file of `tls_cert`'s private key."""

    def __post_init__(self) -> None:
        servers = self.servers
        if not servers or not all(servers):
            raise InvalidRequest(
                f"server must be an address such as 'grpc://127.0.0.1:8815', or several, got "
                f"{shorten(repr(self.server))}"
            )
        if len(set(servers)) != len(servers):
            raise InvalidRequest(f"a server is listed twice: {shorten(repr(servers))}")
        if self.mode not in ("pushdown", "local"):
            raise InvalidRequest(
                f"mode must be 'pushdown' or 'local', got {shorten(repr(self.mode))}"
            )
        if isinstance(self.cut, bool) or (isinstance(self.cut, int) and self.cut < RAW):
            raise InvalidRequest(
                f"cut must be 'auto', RAW (-1), INPUT (0), a cut point >= 1 or its name, got "
                f"{self.cut!r}; or None to cut at the freeze point"
            )
        if not 0.0 <= self.local_share <= 1.0:
            raise InvalidRequest(
                f"local_share must be in [0, 1] (the share of chunks computed in the trainer), "
                f"got {self.local_share}"
            )
        if self.local_share and self.cut == "auto":
            raise InvalidRequest(
                "local_share goes with an explicit cut; with cut='auto' the planner chooses it"
            )
        if not isinstance(self.replan, bool | ReplanConfig):
            raise InvalidRequest(f"replan must be a bool or a ReplanConfig, got {self.replan!r}")
        if not (self.distributed is None or isinstance(self.distributed, bool)):
            raise InvalidRequest(
                f"distributed must be None, True or False, got {shorten(repr(self.distributed))}"
            )
        if self.probe_samples < 1:
            raise InvalidRequest(f"probe_samples must be >= 1, got {self.probe_samples}")
        if not 0.0 <= self.retry_budget_s < float("inf"):
            raise InvalidRequest(
                f"retry_budget_s must be >= 0 seconds (0: never retry), got {self.retry_budget_s}"
            )
        if isinstance(self.model, str) and self.repo is None:
            raise InvalidRequest(
                f"model {shorten(repr(self.model))} is a repository reference: pass "
                "repo=<the repository URI>"
            )
        if self.num_classes is not None and isinstance(self.model, nn.Module):
            raise InvalidRequest(
                "num_classes replaces the classifier of a named model; give your own module "
                "the classifier you want before passing it"
            )
        if self.exact and self.wire_dtype != "fp32":
            raise InvalidRequest(
                f"exact=True needs wire_dtype='fp32' (got {shorten(repr(self.wire_dtype))}): "
                "features rounded on the wire differ from the trainer's own; "
                "wire_compression='zstd' or 'lz4' saves bytes losslessly"
            )
        if self.wire_compression not in ("auto", *COMPRESSIONS):
            raise InvalidRequest(
                f"unknown wire_compression {shorten(repr(self.wire_compression))}: use auto "
                "(the planner chooses), none, lz4 or zstd"
            )
        if self.exact and self.lossy_wire:
            raise InvalidRequest(
                "exact=True refuses lossy_wire=True: fp16 and int8 features differ from the "
                "trainer's own; drop one of them (lossless compression stays chosen)"
            )
        if self.num_classes is not None and self.num_classes < 1:
            raise InvalidRequest(
                f"num_classes must be >= 1, got {self.num_classes}; or leave it unset to keep "
                "the model's classifier"
            )
        if not MIN_IMAGE_SIZE <= self.image_size <= MAX_IMAGE_SIZE:
            raise InvalidRequest(
                f"image_size must be {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE} pixels (what a server "
                f"accepts), got {self.image_size}"
            )
        for name in ("batch_size", "chunk_size", "prefetch"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        check_wire_dtype(self.wire_dtype)
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
        parse_bytes(self.cache_size)
        if self.on_error not in ("raise", "skip"):
            raise InvalidRequest(
                f"on_error must be 'raise' or 'skip', got {shorten(repr(self.on_error))}"
            )

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers' addresses, in the order given."""
        if isinstance(self.server, str):
            return tuple(a.strip() for a in self.server.split(","))
        return tuple(self.server)

    @property
    def train_transforms(self) -> Transforms:
        if not self.augment:
            return self.test_transforms
        transforms = self.transforms or Transforms.train(self.image_size)
        if self.views is not None and transforms.is_random:
            transforms = replace(transforms, views=self.views)
        return transforms

    @property
    def test_transforms(self) -> Transforms:
        return self.eval_transforms or Transforms.eval(self.image_size)


class JobOptions(TypedDict, total=False):
    """`TransferJob`'s keyword options: every field of `JobConfig` but the three it takes
    by position, so editors and type checkers know each name and type."""

    store: str | None
    store_options: StoreOptions | None
    repo: str | None
    repo_store_options: StoreOptions | None
    num_classes: int | None
    eval_dataset: str | None
    freeze: int | str | None
    cut: int | str | None
    local_share: float
    replan: bool | ReplanConfig
    probe_samples: int
    reuse_profiles: bool
    retry_budget_s: float
    mode: Literal["pushdown", "local"]
    image_size: int
    transforms: Transforms | None
    augment: bool
    views: int | None
    cache: bool
    cache_dir: str | None
    cache_size: int | str
    eval_transforms: Transforms | None
    batch_size: int
    chunk_size: int
    prefetch: int
    wire_dtype: WireDtype
    wire_compression: Compression | Literal["auto"]
    lossy_wire: bool
    device: str
    distributed: bool | None
    seed: int
    on_error: OnError
    exact: bool
    token: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
