"""`SessionOpener`: a new session built from its request - its head found (named, from the
repository, or uploaded), its feature shape and schema, and its memory model measured."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hapi._fx_lock import TRACING
from hapi.data import StoreOptions, Transforms
from hapi.errors import InvalidCut, InvalidRequest, shorten
from hapi.graph import INPUT, RAW, ModelGraph, load_head
from hapi.graph.precision import head_dtype
from hapi.server.chunks._batch_tuner import BatchTuner, BatchTuners
from hapi.server.chunks._compiled import CompiledHead, CompiledHeads
from hapi.server.chunks.session import RAW_BATCH_BYTES, Session
from hapi.server.chunks.tier import NO_FEATURE_CACHE, FeatureTier
from hapi.server.head_cache import HeadCache, HeadLease
from hapi.server.locality import Locality
from hapi.server.memory.batch_memory import session_memory, session_name, tensor_bytes
from hapi.server.memory.budget import MemoryModel
from hapi.server.memory.scheduler import Scheduler
from hapi.server.security.tenants import Tenant
from hapi.server.server_config import ServerConfig
from hapi.server.uploads import HeadUploads, head_graph, on_device
from hapi.wire import (
    SessionInfo,
    SessionRequest,
    feature_schema,
    raw_schema,
)
from hapi.wire.codecs import sample_bytes
from hapi.wire.messages import UploadedHead

__all__ = ["Opened", "SessionOpener"]

READ_AHEAD_OBJECT = 256 << 10
"""Bytes of one object a chunk reads ahead, in its memory model (`Session` bounds its
read-ahead to this much per object on average)."""


class Opened(NamedTuple):
    """A session just built, not yet registered."""

    session: Session
    lease: HeadLease | None
    """The head it holds from the cache, released when it closes (None: it runs none)."""
    graph: ModelGraph
    """Its model's graph, as far as the server knows it."""


class SessionOpener:
    """Builds sessions from their requests for a server; registering them is the
    `SessionRegistry`'s. A request the server cannot serve is refused here, before it holds
    anything.

    Args:
        config: the server's settings (batch size, idle time, local prefixes, read-ahead).
        heads: the cache of heads, named and uploaded.
        uploads: the heads trainers uploaded, by digest.
        scheduler: the server's scheduler, which measures a session's memory model.
        clock: monotonic seconds, a new session's `last_used`.
        features: the server's feature cache, which its sessions' chunks use.
        locality: where the server is in a storage cluster (`--beside`), if it says.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        heads: HeadCache,
        uploads: HeadUploads,
        scheduler: Scheduler,
        clock: Callable[[], float],
        features: FeatureTier = NO_FEATURE_CACHE,
        locality: Locality | None = None,
    ) -> None:
        self.config = config
        self.features = features
        self.locality = locality
        self.heads = heads
        self.uploads = uploads
        self.scheduler = scheduler
        self._clock = clock
        self.read_ahead = (config.store_options or StoreOptions()).concurrency
        """Objects a chunk reads ahead of the one it decodes."""
        self.tuners = BatchTuners(config.batch_size)
        self.compiled = CompiledHeads(
            config.compile_heads, heads.device, scheduler, compiler=config.head_compiler
        )
        heads.on_drop = self.compiled.forget
        self.read_bytes = self.read_ahead * READ_AHEAD_OBJECT
        """Bytes a chunk's read-ahead holds, in its memory model."""

    def open(self, request: SessionRequest, *, tenant: Tenant) -> Opened:
        """Load (or reuse) the head a request needs and build a session of `tenant`.

        Raises:
            InvalidCut: a cut the model does not have, or above its freeze point.
            InvalidRequest: a request the server cannot serve.
            OverBudget: a head or one sample that the memory budget can never hold.
        """
        transforms = Transforms.from_dict(request.transforms)
        if isinstance(request.model, UploadedHead):
            graph, freeze, shape, lease = self._uploaded_head(request, request.model)
            num_cuts = freeze  # as far as the server knows the trainer's model
        else:
            graph, freeze, shape, lease = self._named_head(request, request.model)
            num_cuts = graph.num_cuts
        head = lease.module if lease is not None else None
        dtype = head_dtype(
            request.head_dtype,
            exact=request.exact,
            device=self.heads.device,
            allow=self.config.bf16_heads and head is not None,
        )
        if request.cut == RAW:
            schema, per_sample = raw_schema(), 0
        else:
            schema = feature_schema(shape, request.wire_dtype)
            per_sample = sample_bytes(shape, request.wire_dtype)
        try:
            memory = self._memory(request, transforms, graph, lease, per_sample)
            if dtype != torch.float32 and head is not None:
                # Autocast casts the weights for each forward: a bf16 copy alive per batch.
                memory = dataclasses.replace(memory, fixed=memory.fixed + tensor_bytes(head) // 2)
        except BaseException:
            if lease is not None:
                self.heads.release(lease)
            raise
        info = self._info(request, freeze, num_cuts, shape, per_sample, memory, head)
        info = info.model_copy(update={"head_dtype": str(dtype).removeprefix("torch.")})
        session = Session(
            id=info.session,
            request=request,
            info=info,
            schema=schema,
            head=head,
            transforms=transforms,
            device=self.heads.device,
            head_dtype=dtype,
            batch_size=self.config.batch_size,
            last_used=self._clock(),
            read_ahead=self.read_ahead,
            memory=memory,
            scheduler=self.scheduler,
            tenant=tenant.name,
            weight=tenant.weight,
            features=self.features,
            locality=self.locality,
            tuner=self._tuner(lease, request, dtype),
            compiled=self._compiled(lease, request, dtype),
        )
        return Opened(session, lease, graph)

    def _compiled(
        self, lease: HeadLease | None, request: SessionRequest, dtype: torch.dtype
    ) -> CompiledHead | None:
        """The head's compiled form, when it may run one: never for exact sessions, whose
        features are bit for bit the trainer's."""
        if lease is None or request.exact or self.config.compile_heads == "off":
            return None
        return self.compiled.get((lease.key, request.image_size, str(dtype)), lease.module, dtype)

    def _tuner(
        self, lease: HeadLease | None, request: SessionRequest, dtype: torch.dtype
    ) -> BatchTuner | None:
        """The batch tuner of the head as this session runs it (None: no head, no batch
        to choose)."""
        if lease is None:
            return None
        return self.tuners.get((lease.key, request.image_size, str(dtype)))

    def _info(
        self,
        request: SessionRequest,
        freeze: int,
        num_cuts: int,
        shape: list[int],
        per_sample: int,
        memory: MemoryModel,
        head: torch.nn.Module | None,
    ) -> SessionInfo:
        """What the trainer is told of its new session."""
        return SessionInfo(
            session=uuid.uuid4().hex,
            cut=request.cut,
            freeze=freeze,
            num_cuts=num_cuts,
            feature_shape=shape,
            wire_dtype=request.wire_dtype,
            bytes_per_sample=per_sample,
            # Object bytes (JPEG, PNG) are compressed already: a RAW stream is sent as is.
            compression="none" if request.cut == RAW else request.compression,
            batch_size=self.config.batch_size,
            memory_fixed=memory.fixed,
            memory_per_sample=memory.per_sample,
            head_bytes=tensor_bytes(head) if head is not None else 0,
            idle_s=self.config.session_idle_s,
            local_prefixes=[p.strip("/") for p in self.config.local_prefixes],
            beside=self.locality.beside if self.locality is not None else "",
            device=str(self.heads.device),
            threads=torch.get_num_threads(),
        )

    def _named_head(
        self, request: SessionRequest, model: dict[str, Any] | str
    ) -> tuple[ModelGraph, int, list[int], HeadLease | None]:
        """The graph, freeze point, feature shape and head of a named or repository model."""
        loaded = self.heads.model(model, request.image_size)
        graph = loaded.graph
        freeze = graph.resolve_freeze(request.freeze) if request.freeze is not None else None
        if freeze is None:
            freeze = graph.num_cuts
        if request.cut != RAW:
            graph.check_cut(request.cut, freeze)
        if request.cut == RAW:
            return graph, freeze, [], None
        if request.cut == INPUT:
            return graph, freeze, list(graph.input_shape), None
        shape = list(graph.cut_points[request.cut - 1].shape)
        return graph, freeze, shape, self.heads.acquire(loaded, request.cut)

    def _uploaded_head(
        self, request: SessionRequest, model: UploadedHead
    ) -> tuple[ModelGraph, int, list[int], HeadLease | None]:
        """The same for a head the trainer uploaded: the server knows only its program, so
        it takes the cut and freeze point as the trainer says, and finds the features'
        shape by running the head on one sample."""
        size = request.image_size
        input_shape = (3, size, size)
        freeze = request.freeze
        if isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < request.cut:
            raise InvalidCut(
                f"a session of an uploaded head takes its freeze point as a cut index >= its "
                f"cut {request.cut}, got {shorten(repr(freeze))}"
            )
        if request.cut <= INPUT:
            shape = [] if request.cut == RAW else list(input_shape)
            return head_graph(torch.nn.Identity(), input_shape, ()), freeze, shape, None
        digest = model.artifact
        if digest is None:
            raise InvalidRequest(
                f"a session of {shorten(model.module, 100)} at cut {request.cut} runs the head "
                "the trainer uploaded: name its digest in `artifact` (upload it with do_put)"
            )
        lease = self.heads.acquire_uploaded(
            digest,
            lambda: on_device(load_head(self.uploads.get(digest)), self.heads.device),
            self.uploads.size(digest),
        )
        try:
            out = _output_shape(lease.module, input_shape, self.heads.device)
        except BaseException:
            self.heads.release(lease)
            raise
        return head_graph(lease.module, input_shape, out), freeze, list(out), lease

    def _memory(
        self,
        request: SessionRequest,
        transforms: Transforms,
        graph: ModelGraph,
        lease: HeadLease | None,
        out_bytes: int,
    ) -> MemoryModel:
        """A new session's memory model, measured; refused when one sample cannot fit."""
        raw = request.cut == RAW
        return session_memory(
            self.scheduler,
            head=lease.module if lease is not None else None,
            graph=graph,
            cut=request.cut,
            device=self.heads.device,
            transforms=transforms,
            out_bytes=RAW_BATCH_BYTES if raw else out_bytes,
            read_bytes=self.read_bytes,
            what=session_name(request.model, request.cut),
            measured_as=lease.key if lease is not None else "input",
            max_batch=self.config.batch_size,
        )


def _output_shape(
    head: torch.nn.Module, input_shape: tuple[int, ...], device: torch.device
) -> tuple[int, ...]:
    """The shape of one sample of `head`'s output, from shapes alone, refusing a head made
    for other inputs.

    Run on fake tensors, which allocate and compute nothing: a head's real runs are
    `session_memory`'s, under a grant of the budget, once its check has refused what one
    sample could never fit (an uploaded head at 4096 px would otherwise allocate its
    gigabyte activations here, outside the budget). A `torch.export` program, which an
    uploaded head is, runs on fake tensors by construction: export traces it so.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        TRACING.shared(),
        torch.inference_mode(),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        x = torch.zeros(1, *input_shape, device=device)  # a fake tensor: no memory
        return tuple(head(x).shape[1:])
