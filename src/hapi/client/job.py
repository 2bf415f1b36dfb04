"""`TransferJob`: fine-tune the last layers of a model on data in an object store."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi.client._decode import RawDecoder
from hapi.client._from_repo import build_from_repo
from hapi.client.config import JobConfig
from hapi.client.connection import Connection, connect
from hapi.client.loader import FeatureLoader
from hapi.data import DatasetManifest, Transforms
from hapi.errors import HapiError, InvalidRequest, NothingToTrain
from hapi.graph import INPUT, RAW, ModelGraph, ModelSpec, build_model, trace
from hapi.repo.refs import is_repo_ref
from hapi.wire import SessionRequest, SkippedKey

if TYPE_CHECKING:
    from hapi.repo import ModelRepo, ModelVersion, PushedVersion

__all__ = ["EpochStats", "EvalResult", "History", "TransferJob"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class EpochStats:
    """One training epoch, as the trainer saw it."""

    epoch: int
    loss: float
    accuracy: float
    seconds: float
    samples: int
    bytes_received: int
    wait_s: float
    """Time the trainer waited for data: the part of the epoch the pipeline did not hide."""
    compute_s: float
    """CPU time of the tail's forward, backward and optimizer steps (the training thread)."""
    decode_s: float
    """CPU time spent decoding and transforming raw bytes (the baseline's input work)."""
    skipped: tuple[SkippedKey, ...] = ()
    """Keys left out under `on_error="skip"`, each with its error."""


@dataclass
class History:
    """What `fit` did: per-step losses and per-epoch stats."""

    losses: list[float] = field(default_factory=list)
    epochs: list[EpochStats] = field(default_factory=list)


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and mean loss over an evaluation set."""

    accuracy: float
    loss: float
    samples: int
    bytes_received: int
    seconds: float


class TransferJob:
    """Fine-tunes a model's last layers, with its frozen front computed by a `hapi serve`.

    In `pushdown` mode the server reads, decodes and transforms the images and runs the
    head up to the cut; the trainer receives features and runs the tail. In `local` mode
    (the baseline) the server only sends the objects' bytes and the trainer does it all.
    Both give the same samples in the same order, so they train the same model.

    Example:
        >>> job = TransferJob(model="resnet18", dataset="train", server=server.address,
        ...                   freeze="layer3", image_size=112)
        >>> job.fit(epochs=2)
        >>> job.evaluate().accuracy
    """

    def __init__(
        self,
        model: ModelSpec | str | dict[str, Any],
        dataset: str,
        server: str | Connection,
        **options: Any,
    ) -> None:
        if isinstance(model, str) and not is_repo_ref(model):
            model = ModelSpec(name=model)
        elif isinstance(model, dict):
            model = ModelSpec.from_dict(model)
        address = server.address if isinstance(server, Connection) else server
        self.config = JobConfig(model=model, dataset=dataset, server=address, **options)
        self.repo: ModelRepo | None = None
        if self.config.repo is not None:
            from hapi.repo import ModelRepo

            self.repo = ModelRepo.open(self.config.repo, self.config.repo_store_options)
        self.base: ModelVersion | None = None
        """The repository version the job started from, when it did."""
        self.spec, self.model = self._build(model)
        self.connection = (
            server
            if isinstance(server, Connection)
            else connect(
                address,
                token=self.config.token,
                tls_ca=self.config.tls_ca,
                tls_cert=self.config.tls_cert,
                tls_key=self.config.tls_key,
            )
        )
        self.device = torch.device(self.config.device)
        size = self.config.image_size
        self.graph: ModelGraph = trace(self.model, input_shape=(3, size, size))
        self.freeze = self.graph.resolve_freeze(self.config.freeze)
        cut = self.freeze if self.config.cut is None else self.config.cut
        if cut != RAW:
            self.graph.check_cut(cut, self.freeze)
        # The baseline (and cut=RAW) fetches the objects' bytes and runs the whole model here.
        self.raw = self.config.mode == "local" or cut == RAW
        self.cut = RAW if self.raw else cut
        """The wire cut: RAW when the trainer decodes raw bytes itself."""
        self._frozen = list(self.graph.head(self.freeze).modules()) if self.freeze else []
        for module in self._frozen:
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
        # A RAW job's tail starts at the input: the trainer decodes and transforms itself.
        self.tail = self.graph.tail(max(self.cut, INPUT)).to(self.device)
        self.model.to(self.device)
        self.history = History()
        self._manifests: dict[str, DatasetManifest] = {}

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters `fit` trains: those of the tail that are not frozen."""
        return [p for p in self.tail.parameters() if p.requires_grad]

    def fit(
        self,
        epochs: int = 1,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        *,
        lr: float = 0.01,
        progress: Callable[[int, int], None] | None = None,
    ) -> History:
        """Train the tail for `epochs` epochs.

        Args:
            epochs: epochs to run (continuing from earlier `fit` calls).
            optimizer: an optimizer over `trainable_parameters`, a factory taking them,
                or None for SGD with momentum 0.9 at `lr`.
            lr: learning rate of the default optimizer.
            progress: called with (batches done, batches per epoch) after each step.

        Returns:
            The job's history, with this call's epochs appended.

        Raises:
            NothingToTrain: every parameter is frozen.
            HapiError: a chunk failed (`CorruptObject` naming the key, ...), or the epoch
                lost keys (`IncompleteEpoch`).
        """
        params = self.trainable_parameters
        if not params:
            raise NothingToTrain(
                "nothing to train: every parameter is frozen; lower `freeze` so the last "
                "layers train"
            )
        if optimizer is None:
            optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(params)
        loss_fn = nn.CrossEntropyLoss()
        with self._loader(self.config.dataset, self.config.train_transforms, True) as loader:
            start = len(self.history.epochs)
            for epoch in range(start, start + epochs):
                self._train_mode(True)
                # Seed per epoch so dropout in the tail draws the same masks in both modes.
                torch.manual_seed(self.config.seed * 1_000_003 + epoch)
                t0 = time.perf_counter()
                total_loss = correct = seen = compute = 0.0
                for step, (x, y) in enumerate(loader.epoch(epoch), 1):
                    t1 = time.thread_time()
                    x, y = self._to_device(x, y)
                    out = self.tail(x)
                    loss = loss_fn(out, y)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    self.history.losses.append(loss.item())
                    total_loss += loss.item() * len(y)
                    correct += (out.argmax(1) == y).sum().item()
                    seen += len(y)
                    compute += time.thread_time() - t1
                    if progress is not None:
                        progress(step, len(loader))
                self.history.epochs.append(
                    EpochStats(
                        epoch=epoch,
                        loss=total_loss / max(seen, 1),
                        accuracy=correct / max(seen, 1),
                        seconds=time.perf_counter() - t0,
                        samples=int(seen),
                        bytes_received=loader.stats.bytes_received,
                        wait_s=loader.stats.wait_s,
                        compute_s=compute,
                        decode_s=loader.stats.postprocess_s,
                        skipped=tuple(loader.stats.skipped),
                    )
                )
        return self.history

    @torch.inference_mode()
    def evaluate(
        self, dataset: str | None = None, *, progress: Callable[[int, int], None] | None = None
    ) -> EvalResult:
        """Accuracy of the model on `dataset` (default: the job's eval or training set)."""
        prefix = dataset or self.config.eval_dataset or self.config.dataset
        self._train_mode(False)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        t0 = time.perf_counter()
        total_loss = correct = seen = 0.0
        with self._loader(prefix, self.config.test_transforms, False) as loader:
            for step, (x, y) in enumerate(loader.epoch(0), 1):
                x, y = self._to_device(x, y)
                out = self.tail(x)
                total_loss += loss_fn(out, y).item()
                correct += (out.argmax(1) == y).sum().item()
                seen += len(y)
                if progress is not None:
                    progress(step, len(loader))
            nbytes = loader.stats.bytes_received
        return EvalResult(
            accuracy=correct / max(seen, 1),
            loss=total_loss / max(seen, 1),
            samples=int(seen),
            bytes_received=nbytes,
            seconds=time.perf_counter() - t0,
        )

    def batches_per_epoch(self) -> int:
        """Training batches in one epoch of the training set."""
        return -(-len(self.manifest(self.config.dataset)) // self.config.batch_size)

    def manifest(self, prefix: str) -> DatasetManifest:
        """The dataset under `prefix`, listed once by the server."""
        if prefix not in self._manifests:
            self._manifests[prefix] = self.connection.manifest(prefix)
        return self._manifests[prefix]

    def push(
        self,
        name: str,
        *,
        parent: str | ModelVersion | None = None,
        tags: Sequence[str] = (),
        metrics: Mapping[str, float] | None = None,
    ) -> PushedVersion:
        """Store the fine-tuned model in the job's repository as the next version of `name`.

        Only what fine-tuning changed is uploaded: the frozen layers' tensors are the
        base's, stored once. The version records the job's spec, so a server can load its
        head, and the job's last training and evaluation figures as metrics.

        Args:
            name: the model name.
            parent: the version it derives from; default: the version the job started
                from (a `repo://` model), else none.
            tags: labels to keep with it.
            metrics: numbers to keep with it; default: the last epoch's loss and accuracy.

        Raises:
            InvalidRequest: the job has no repository (pass `repo=` to the job).
        """
        if self.repo is None:
            raise InvalidRequest(
                "this job has no model repository to push to: create it with repo=<URI>"
            )
        if metrics is None and self.history.epochs:
            last = self.history.epochs[-1]
            metrics = {"train_loss": last.loss, "train_accuracy": last.accuracy}
        return self.repo.push(
            self.model,
            name,
            parent=parent if parent is not None else self.base,
            tags=tags,
            metrics=metrics,
            spec=self.spec,
        )

    # Internals -----------------------------------------------------------------------------

    def _build(self, model: ModelSpec | str) -> tuple[ModelSpec, nn.Module]:
        """The job's spec and model, with the base's weights when it comes from the repo."""
        classes = self.config.num_classes
        if isinstance(model, ModelSpec):
            spec = model if classes is None else dataclasses.replace(model, num_classes=classes)
            return spec, build_model(spec)
        assert self.repo is not None  # JobConfig checks it
        self.base = self.repo.resolve(model)
        return build_from_repo(self.repo, self.base, num_classes=classes)

    def _wire_model(self) -> dict[str, Any] | str:
        """How a session names the model: the base version pinned by id, or the spec."""
        if self.base is not None:
            return f"repo://{self.base.name}@{self.base.id}"
        return self.spec.to_dict()

    def _loader(self, prefix: str, transforms: Transforms, train: bool) -> _OpenLoader:
        local = self.raw
        request = SessionRequest(
            model=self._wire_model(),
            cut=self.cut,
            freeze=self.freeze,
            transforms=transforms.to_dict(),
            image_size=self.config.image_size,
            wire_dtype=self.config.wire_dtype,
            seed=self.config.seed,
            on_error=self.config.on_error,
        )
        return _OpenLoader(
            self,
            request,
            self.manifest(prefix),
            train,
            RawDecoder(transforms, self.config.seed, self.config.on_error) if local else None,
        )

    def _train_mode(self, train: bool) -> None:
        self.tail.train(train)
        # Frozen layers stay in eval mode, as on the server: batch norm keeps its
        # pre-trained statistics and dropout is off in the frozen part.
        for module in self._frozen:
            module.eval()

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(self.device, torch.float32), y.to(self.device)


class _OpenLoader:
    """A session opened for one loop, closed when the loop ends (even on an error)."""

    def __init__(
        self,
        job: TransferJob,
        request: SessionRequest,
        manifest: DatasetManifest,
        train: bool,
        decoder: RawDecoder | None,
    ) -> None:
        self.job, self.request, self.manifest = job, request, manifest
        self.train, self.decoder = train, decoder

    def __enter__(self) -> FeatureLoader:
        config = self.job.config
        info = self.job.connection.open_session(self.request)
        self.session = info.session
        return FeatureLoader(
            self.job.connection,
            info.session,
            self.manifest,
            batch_size=config.batch_size,
            chunk_size=config.chunk_size,
            prefetch=config.prefetch,
            seed=config.seed,
            shuffle=self.train,
            postprocess=self.decoder,
        )

    def __exit__(self, *exc: object) -> None:
        # The server may be gone; the session died with it.
        with contextlib.suppress(HapiError):
            self.job.connection.close_session(self.session)
