"""Reply bodies of the Flight actions, and the report that ends each chunk's stream.

Replies ignore fields they do not know, so a client keeps working against a newer server
that reports more.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hapi.errors import HapiError, error_class
from hapi.wire.codecs import Compression
from hapi.wire.dtypes import WireDtype

__all__ = [
    "ChunkReport",
    "FeatureCacheStats",
    "HasHeadReply",
    "ProfileKeyInfo",
    "ProfileReply",
    "ServerStats",
    "SessionInfo",
    "SessionStats",
    "SkippedKey",
]


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def to_bytes(self) -> bytes:
        """The message as compact JSON bytes."""
        return self.model_dump_json().encode()


class SessionInfo(_Reply):
    """The reply to `open_session`."""

    session: str
    cut: int
    freeze: int
    num_cuts: int
    feature_shape: list[int]
    wire_dtype: WireDtype
    bytes_per_sample: int = Field(
        description="Feature bytes per sample on the wire, uncompressed (0 for RAW)."
    )
    compression: Compression = Field(
        default="none",
        description="The stream's buffer compression; a server older than it sends none.",
    )
    batch_size: int = Field(
        default=0, description="The largest feature-extraction batch the server runs."
    )
    memory_fixed: int = Field(
        default=0, description="Bytes of the server's budget each running batch holds."
    )
    memory_per_sample: int = Field(
        default=0, description="Bytes of the server's budget each sample of a batch adds."
    )
    head_bytes: int = Field(
        default=0, description="Bytes of the head's weights (shared with other sessions)."
    )
    idle_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds without a chunk or keepalive after which the server closes the "
        "session as abandoned: a client renews it well within that.",
    )
    local_prefixes: list[str] = Field(
        default_factory=list,
        description="Prefixes of the store local to this server (its storage node): a "
        "trainer with several servers sends it the chunks whose keys lie there.",
    )
    beside: str = Field(
        default="",
        description="The storage node's volume server this server shares a machine with "
        "(`hapi serve --beside`): it answers `locate`, and a trainer sends it the chunks "
        "whose bytes lie there. Empty: it says nothing of where it is.",
    )
    device: str = Field(
        default="",
        description="Where the server runs heads (cpu, cuda:0); empty from an older server.",
    )
    threads: int = Field(
        default=0, ge=0, description="The server's torch intra-op threads; 0 from an older server."
    )
    head_dtype: str = Field(
        default="",
        description="The dtype the session's head computes in (float32, bfloat16: "
        "`hapi.graph.precision`); empty from an older server.",
    )


class LocateReply(_Reply):
    """The reply to `locate`: each key's bytes on the server's node, and in all."""

    local: list[int]
    total: list[int]


class HasHeadReply(_Reply):
    """The reply to `has_head`."""

    present: bool
    """Whether the server holds the head: if so, there is nothing to upload."""
    max_bytes: int = 0
    """The largest head artifact (program and weights) the server accepts."""


class SessionStats(_Reply):
    """What a session has cost its server so far: the reply to `close_session`, and per
    session in `ServerStats`."""

    chunks: int = 0
    """Chunks computed to their end."""
    samples: int = 0
    """Samples computed (a chunk's client that leaves early reads fewer)."""
    skipped: int = 0
    abandoned: int = 0
    """Chunk streams whose client cancelled or disconnected before their end; the server
    stops computing each within a batch."""
    bytes_read: int = 0
    bytes_sent: int = 0
    read_s: float = 0.0
    """Time the chunk pipeline waited for the store."""
    transform_s: float = 0.0
    head_s: float = 0.0
    encode_s: float = 0.0
    shaping_wait_s: float = 0.0
    cpu_s: float = 0.0
    """CPU time of the chunk pipeline's threads (decode, transform, head, encode): what
    the server's cores spent, which wall times over-count when chunks run concurrently."""
    cache_hits: int = 0
    """Samples the server's feature cache gave (no read, no head)."""
    cache_misses: int = 0
    """Samples a session whose features are cacheable computed (and offered the cache)."""
    compiled_samples: int = 0
    """Samples its compiled head computed (`hapi serve --compile-heads`); the rest ran
    eager."""


class FeatureCacheStats(_Reply):
    """A server's feature cache (`hapi serve --feature-cache`), since the server started."""

    directory: str
    max_bytes: int
    bytes_held: int
    """Entries' bytes on disk, as the server last counted them."""
    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    corrupt: int = 0
    """Entries that failed their checksum: misses, and removed."""
    dropped: int = 0
    """Computed features not kept: the writer had too much waiting (the disk is slower
    than the server computes), so a later job computes them again."""
    write_failures: int = 0
    """Computed features not kept because the directory refused them (full, read-only):
    the first refusal turned writing off, and the server went on serving."""
    write_error: str | None = None
    """Why writing is off, or None while it writes."""


class ServerStats(_Reply):
    """The reply to `stats`: the server's settings and every session's counters."""

    store: str
    egress_limit_bytes_per_s: float | None = None
    heads_cached: int
    heads_bytes: int
    bytes_sent: int
    """Over every session, open and closed."""
    sessions: dict[str, SessionStats] = Field(default_factory=dict)
    closed_sessions: dict[str, SessionStats] = Field(default_factory=dict)
    memory_budget: int = 0
    """Bytes heads and running batches may hold together (`--memory-budget`)."""
    memory_used: int = 0
    """Bytes they hold now."""
    memory_peak: int = 0
    """The most they have held since the server started."""
    device_allocated: int | None = None
    """On a GPU server, bytes the CUDA allocator hands out for tensors now (every
    tenant's heads and batches: what `memory_used` accounts for, measured). None on the
    CPU."""
    device_reserved: int | None = None
    """On a GPU server, bytes the CUDA allocator holds from the device, its cache
    included. None on the CPU."""
    compute_slots: int = 0
    """Batches that compute at once."""
    batches_running: int = 0
    batches_waiting: int = 0
    """Batches waiting for the scheduler now: above zero, the server is saturated."""
    cpu_s: float = 0.0
    """CPU time of the server's process since it started, every thread's: a probe's
    difference, less its chunks' own threads' (`SessionStats.cpu_s`), is what handing its
    bytes to the network cost the server's cores (gRPC's threads and the kernel's)."""
    feature_cache: FeatureCacheStats | None = None
    """The feature cache's counters; None when the server keeps none."""
    compiled_heads: dict[str, str] = Field(default_factory=dict)
    """Each head the server may compile, in one line: compiled (how much faster, the
    compile's seconds), still eager, or why it runs eager (`--compile-heads`)."""


class SkippedKey(_Reply):
    """A key left out of a chunk under `on_error="skip"`, and why."""

    key: str
    error: str
    """The `hapi.errors` class name, e.g. `CorruptObject`."""
    message: str

    @classmethod
    def of(cls, key: str, exc: HapiError) -> SkippedKey:
        """The report of `key`, left out because of `exc`."""
        return cls(key=key, error=type(exc).__name__, message=str(exc))

    def exception(self) -> HapiError:
        """The error that made the key be skipped, as its `hapi.errors` class."""
        return error_class(self.error)(self.message)


class ChunkReport(_Reply):
    """The app metadata of a chunk's last batch: what the chunk left out, so nothing is
    lost silently. Nothing follows it: a client has read the chunk once it has the report
    (the stream's end can queue behind the next stream's bytes)."""

    chunk: int
    skipped: list[SkippedKey] = Field(default_factory=list)
    server_s: float = Field(
        default=0.0,
        ge=0,
        description="Seconds the server computed this chunk (read, decode, transform, head, "
        "encode), excluding its wait for the scheduler and for the link.",
    )
    queue_s: float = Field(
        default=0.0, ge=0, description="Seconds the chunk waited for the server's scheduler."
    )
    free_share: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="The share of the server's compute no other chunk was using when this "
        "one ended: push-back, so a planner moves work to the trainer when it is low.",
    )
    cached: int = Field(
        default=0, ge=0, description="Keys whose features came from the server's feature cache."
    )
    read_bytes: int = Field(default=0, ge=0, description="Bytes the chunk read from the store.")
    compiled: int = Field(
        default=0, ge=0, description="Keys whose features the server's compiled head computed."
    )
    head: str | None = Field(
        default=None,
        max_length=600,
        description="How the server runs the head, when it has done more than run it eager: "
        "compiling, compiled, or why it stays eager (`hapi serve --compile-heads`).",
    )
    local_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Of `read_bytes`, those read from the server's own storage node; None "
        "from a server that does not know where it is (no `--beside`).",
    )
    sent_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Bytes of the chunk's batches as they crossed the wire (compressed, when "
        "the stream is): a trainer counts them after decompression. None from an older server.",
    )

    @staticmethod
    def with_sent_bytes(report: bytes, sent: int, *, packing_s: float = 0.0) -> bytes:
        """`report` (a chunk thread's, as bytes) with the bytes its stream sent, and the
        seconds its stream spent compressing them added to `server_s` (encoding is the
        server's work, as the planner charges it)."""
        parsed = ChunkReport.model_validate_json(report)
        update = {"sent_bytes": sent, "server_s": parsed.server_s + packing_s}
        return parsed.model_copy(update=update).to_bytes()


class ProfileKeyInfo(_Reply):
    """What a profile depends on (the planner's `ProfileKey`): equal keys share one."""

    head: str
    """Digest of the head's content (model, weights, cut)."""
    input_shape: list[int]
    transforms: str
    """Digest of the transforms' JSON."""
    device: str


class ProfileReply(_Reply):
    """The reply to `profile`: a session's costs per sample, per cut 0..m, as the server
    measured them on the job's objects. Per-cut lists are indexed by cut (0 = INPUT).

    The fields up to `key` are the planner's `ServerProfile`: build one with
    `ServerProfile.from_dict(reply.server_profile())`.
    """

    read_s: float = Field(ge=0, description="Seconds to read one object from the store.")
    decode_s: float = Field(ge=0, description="Seconds to decode and transform one object.")
    head_s: list[float] = Field(description="Seconds of the head from the input to each cut.")
    out_bytes: list[int] = Field(description="Bytes on the wire per sample at each cut.")
    memory_bytes: list[int] = Field(
        description="Bytes of the budget per sample while computing each cut (its input, "
        "activations at their peak, features)."
    )
    raw_bytes: float = Field(ge=0, description="Mean size of the objects read.")
    wire_dtype: WireDtype
    batch_size: int = Field(ge=1, description="The head's batch size when timed.")
    key: ProfileKeyInfo
    cut_names: list[str] = Field(default_factory=list, description="Name of each cut 0..m.")
    samples: int = Field(default=0, description="Objects the measurement read.")
    cached: bool = Field(
        default=False, description="Whether it came from the server's cache of profiles."
    )
    memory_fixed: list[int] = Field(
        default_factory=list, description="Bytes a batch holds whatever its size, per cut."
    )

    def server_profile(self) -> dict[str, Any]:
        """The fields the planner's `ServerProfile.from_dict` reads."""
        names = (
            "read_s", "decode_s", "head_s", "out_bytes", "memory_bytes", "raw_bytes",
            "wire_dtype", "batch_size", "key",
        )  # fmt: skip
        data = self.model_dump()
        return {name: data[name] for name in names}
