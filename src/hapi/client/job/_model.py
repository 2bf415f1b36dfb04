"""The job's model side: built (from a spec, the repository or the user's module), traced,
frozen up to its freeze point, and named to servers; and the training step on its tail."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hapi._fx_lock import TRACING
from hapi.client.config.job import JobConfig
from hapi.client.job._from_repo import build_from_repo
from hapi.client.job._parts import ModelParts
from hapi.client.job.export import UploadedHeads
from hapi.client.pipeline.distributed import DataParallel
from hapi.client.pipeline.rebatch import Batch
from hapi.errors import InvalidRequest
from hapi.graph import INPUT, Cut, CutLike, ModelGraph, ModelSpec, build_model, trace
from hapi.plan import choose_freeze

if TYPE_CHECKING:
    from hapi.repo import ModelRepo, ModelVersion, PushedVersion

__all__ = ["JobModel"]


class JobModel:
    """The model a job fine-tunes, and the step that trains its tail.

    Args:
        config: the job's options (the model, `repo`, `training`, the image size, `exact`).
        dp: the data-parallel side, or None when the job trains alone.

    Raises:
        InvalidRequest: a module whose head cannot be exported (naming its line).
        InvalidCut: a freeze that leaves nothing to train.
    """

    def __init__(self, config: JobConfig, dp: DataParallel | None) -> None:
        self.config, self.dp = config, dp
        self.repo: ModelRepo | None = None
        """The job's model repository: where a `repo://` model comes from, and `push` goes."""
        if config.repo is not None:
            from hapi.repo import ModelRepo

            self.repo = ModelRepo.open(config.repo, config.repo_store_options)
        model = config.model
        self.base: ModelVersion | None = None
        """The repository version the job started from, when it did."""
        self.spec, self.model = self._build(model)
        self.device = dp.device if dp is not None else torch.device(config.training.device)
        size = config.data.image_size
        # Exclusive: tracing patches nn.Module for every thread (a server in this process).
        with TRACING.exclusive():
            self.graph: ModelGraph = trace(self.model, input_shape=(3, size, size))
        choice = choose_freeze(self.graph, config.training.freeze)
        self.freeze = choice.freeze
        """The last frozen cut point."""
        self.freeze_reason = choice.reason
        """Why this freeze point (the job's summary says it)."""
        self.parts = ModelParts(self.graph, self.freeze, self.device, exact=config.wire.exact)
        self.uploads = UploadedHeads(self.graph) if isinstance(model, nn.Module) else None
        """The heads of the user's own module, exported and uploaded to servers."""
        self.model.to(self.device)

    @staticmethod
    def spec_of(config: JobConfig) -> ModelSpec | None:
        """The spec both sides build the job's model from, known before it is built; None
        for a repository version or a module of the user's own."""
        model = config.model
        if not isinstance(model, ModelSpec):
            return None
        return _with_classes(model, config.training.num_classes)

    @property
    def name(self) -> str:
        """The model's name for a person: its repository version, spec or class."""
        if self.base is not None:
            return self.base.ref
        return self.spec.name if self.spec is not None else type(self.model).__name__

    def wire_name(self) -> dict[str, Any] | str | UploadedHeads:
        """How sessions name the model: the base version pinned by id, the spec, or the
        heads of the user's own module (each uploaded when a session first needs it)."""
        if self.uploads is not None:
            return self.uploads
        if self.base is not None:
            return f"repo://{self.base.name}@{self.base.id}"
        assert self.spec is not None  # a job without a module has one
        return self.spec.to_dict()

    def check_exportable(self, cut: int) -> None:
        """Export the user's module's head to `cut` now, so a module whose head cannot run
        on the server fails at build time, naming its line (the heads to earlier cuts are
        parts of it)."""
        if self.uploads is not None and cut > INPUT:
            self.uploads.artifact(cut)

    def graph_aside(self) -> ModelGraph:
        """The model traced again from a copy, for timing while the job trains: timing runs
        forward and backward passes, which on the training model itself would race the
        training step's (an in-place update under a backward in flight)."""
        model = copy.deepcopy(self.model)
        size = self.config.data.image_size
        with TRACING.exclusive():
            return trace(model, input_shape=(3, size, size))

    def resolve_cut(self, cut: CutLike) -> int:
        """A cut's index, checked against the freeze point (RAW passes)."""
        return Cut.of(cut).index(self.graph, self.freeze)

    # The step ---------------------------------------------------------------------------

    def output(self, x: torch.Tensor, cut: int, *, sync: bool = False) -> torch.Tensor:
        """The model's output from features at `cut` (the tail, and for an exact job the
        frozen part before it per sample, as the server runs it). `sync`: through the
        data-parallel tail, which starts at the freeze point whatever the cut."""
        cut = max(cut, INPUT)
        if (self.config.wire.exact or sync) and cut < self.freeze:
            x = self.parts.convert(x, cut, self.freeze).to(self.device)
            cut = self.freeze
        tail = self.parts.tail(cut)
        if sync and self.dp is not None:
            tail = self.dp.wrap(tail)
        # Shared with the server's heads in this process and with exports of heads.
        with TRACING.shared():
            return tail(x)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., Any],
        x: torch.Tensor,
        y: torch.Tensor,
        cut: int,
    ) -> tuple[float, float, int]:
        """One optimizer step on a batch: (mean loss, correct, samples), of the global
        batch when data-parallel (equal on every rank)."""
        optimizer.zero_grad(set_to_none=True)
        if self.dp is None:
            out = self.output(x, cut)
            loss = loss_fn(out, y)
            loss.backward()
            optimizer.step()
            return loss.item(), (out.argmax(1) == y).sum().item(), len(y)
        out = self.output(x, cut, sync=True)
        loss, mean, right, n = self.dp.loss(out, y)
        loss.backward()
        if n == 0:  # no rank had a sample (all skipped): backward only kept DDP in step
            return 0.0, 0.0, 0
        optimizer.step()
        return mean, right, n

    def empty_batch(self) -> Batch:
        """A batch of no samples at the freeze point, for a rank whose shard ran out."""
        shape = self.graph.input_shape
        if self.freeze > INPUT:
            shape = self.graph.cut_point(self.freeze).shape
        empty = torch.zeros((0, *shape))
        return Batch(empty, torch.zeros(0, dtype=torch.long), [], self.freeze, ())

    def to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(self.device, torch.float32), y.to(self.device)

    def push(
        self,
        name: str,
        *,
        parent: str | ModelVersion | None,
        tags: Sequence[str],
        metrics: Mapping[str, float] | None,
    ) -> PushedVersion:
        """Store the model in the job's repository as the next version of `name`, derived
        from `parent` (default: the base version), with the job's spec.

        Raises:
            InvalidRequest: the job has no repository.
        """
        if self.repo is None:
            raise InvalidRequest(
                "this job has no model repository to push to: create it with repo=<URI>"
            )
        return self.repo.push(
            self.model,
            name,
            parent=parent if parent is not None else self.base,
            tags=tags,
            metrics=metrics,
            spec=self.spec,
        )

    def _build(self, model: ModelSpec | str | nn.Module) -> tuple[ModelSpec | None, nn.Module]:
        """The job's spec and model, with the base's weights when it comes from the repo;
        a module of the user's own has no spec."""
        classes = self.config.training.num_classes
        if isinstance(model, nn.Module):
            return None, model
        if isinstance(model, ModelSpec):
            spec = _with_classes(model, classes)
            return spec, build_model(spec)
        assert self.repo is not None  # JobConfig checks it
        self.base = self.repo.resolve(model)
        return build_from_repo(self.repo, self.base, num_classes=classes)


def _with_classes(spec: ModelSpec, classes: int | None) -> ModelSpec:
    """`spec` with its classifier replaced by one of `classes` outputs (None: as it is)."""
    return spec if classes is None else dataclasses.replace(spec, num_classes=classes)
