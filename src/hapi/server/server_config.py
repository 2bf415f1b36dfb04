"""`ServerConfig`: how a `hapi serve` runs."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hapi._sizes import parse_bytes
from hapi.data import StoreOptions
from hapi.errors import InvalidRequest, shorten
from hapi.server.chunks._compiled import COMPILE_MODES, CompileMode, HeadCompiler, compiler_for

__all__ = ["ServerConfig"]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Settings of one storage-side server.

    Raises:
        InvalidRequest: a value out of range, saying what it should be.
    """

    store: str
    """URI of the object store the server reads (a directory, `s3://bucket/prefix`, ...)."""
    store_options: StoreOptions | None = None
    """Endpoint and credentials for an S3 store; the AWS variables when unset."""
    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default: expose it on purpose, with a token."""
    port: int = 0
    """Port to listen on; 0 picks a free one (see `HapiServer.port`)."""
    egress_limit: str | float | None = None
    """Cap on bytes sent per second over all streams (`50mbit`, `1gbit`); None: no cap."""
    batch_size: int = 256
    """Largest feature-extraction batch the server runs at once (independent of training).
    Within it, each session's batch is chosen by the head's measured time a sample
    (`hapi.server.chunks._batch_tuner`), starting at 32."""
    device: str = "cpu"
    """Where heads run: `cpu`, `cuda` or `cuda:N`."""
    threads: int | None = None
    """torch intra-op threads for heads; None keeps torch's default."""
    token: str | None = None
    """Bearer token callers must send (one tenant reading every key); None with no
    `tenants` accepts every caller (loopback use)."""
    tenants: str | None = None
    """TOML file of tenants (tokens, prefixes, weights; see `hapi.server.security.tenants`),
    re-read on SIGHUP; instead of `token`."""
    tls_cert: str | None = None
    """PEM certificate (chain) to serve `grpc+tls://` with; None serves plain `grpc://`."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`, unencrypted."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    insecure: bool = False
    """Bind beyond loopback without a token or without TLS anyway (with warnings)."""
    metrics_port: int | None = None
    """Port to serve Prometheus metrics on (0: any free port); None: no metrics endpoint."""
    metrics_host: str = "127.0.0.1"
    """Address of the metrics endpoint; the metrics name tenants and sessions, so keep it
    on loopback or a private network."""
    bf16_heads: bool = True
    """Run the heads of sessions that allow it (`head_dtype="bf16"`) in bf16 where the
    device has bf16 kernels (`hapi.graph.precision`): 2x faster on an AMX CPU. False:
    every head in fp32."""
    compile_heads: CompileMode = "auto"
    """`auto`: compile a head (`torch.compile`, inductor with freezing) once the eager time
    it has run would have paid for the compile, and run the compiled head if it is faster
    and its features agree (`hapi.server.chunks._compiled`); `always`: compile as soon as
    its batch size settles, and run it whatever its speed; `off`: every head eager. Exact
    sessions always run eager."""
    head_compiler: HeadCompiler = "auto"
    """What compiles heads: `openvino` (`pip install 'hapi[openvino]'`; CPU only),
    `inductor` (`torch.compile`), or `auto`: OpenVINO on a CPU where it is installed (it ran
    ResNet heads faster here: docs/server.md, "Compiled heads"), else inductor."""
    idle_heads: int = 4
    """Heads no open session uses that stay loaded for the next session (each job opens
    one per epoch); older ones are dropped to bound the server's memory."""
    session_idle_s: float = 60.0
    """A session no chunk or keepalive has used for this long is closed (its job died
    without closing it), freeing its head; a job's open loader renews it every third of
    this (`hapi.client.servers.sessions.KEEPALIVE_S`), so keep it above a minute."""
    repo: str | None = None
    """URI of a model repository for `repo://` model references; None: named models only."""
    memory_budget: int | str | None = None
    """Bytes heads and running batches may hold together (`4GiB`, or a number); None: from
    the tightest limit on the process's memory (`hapi.server.memory.limits.tightest_limit`)."""
    max_head_bytes: int | str = "2GiB"
    """The largest head a trainer may upload (a user's own model, exported: program and
    weights); larger uploads are refused before they are held in memory."""
    local_prefixes: tuple[str, ...] = ()
    """Prefixes of the store local to this server (on its storage node): trainers with
    several servers send it the chunks whose keys lie there. Empty: it says nothing."""
    beside: str | None = None
    """URL of the SeaweedFS volume server on this server's machine (`--beside`), or `auto`
    to find the one running here: the server answers which objects lie there, and
    trainers send it the chunks whose bytes do (docs/locality.md). Needs `filer`. None:
    the server says nothing of where it is."""
    filer: str | None = None
    """URL of the SeaweedFS filer that says on which volumes each object lies (its path,
    if any, is the buckets folder; `/buckets` by default)."""
    compute_slots: int | None = None
    """Batches computed at once; None: the cores this process may run on (a 1-core server
    runs one batch at a time, so the first chunk's bytes leave first)."""
    feature_cache: str | None = None
    """Directory where computed features are kept and shared by every session whose head,
    cut and transforms are the same (`hapi.server.chunks.feature_cache`); None: no cache."""
    feature_cache_size: int | str = "50GiB"
    """The bound on the feature cache's bytes on disk (`50GiB`, or a number): the least
    recently used entries go beyond it. Not part of the memory budget."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            raise InvalidRequest(
                f"port must be 0..65535, got {shorten(repr(self.port))}: pick a free port, or 0 "
                "for any free one"
            )
        if self.batch_size < 1:
            raise InvalidRequest(
                f"batch_size must be >= 1, got {self.batch_size}: it is the most samples a "
                "head runs at once; 32 suits most models"
            )
        if not self.session_idle_s > 0:
            raise InvalidRequest(
                f"session_idle_s must be > 0 seconds, got {self.session_idle_s}: it is how "
                "long an unused session is kept (default 60)"
            )
        if self.idle_heads < 0:
            raise InvalidRequest(
                f"idle_heads must be >= 0, got {self.idle_heads}: 0 drops a head as soon as "
                "no session uses it"
            )
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # refuse a bad size before binding a port
        parse_bytes(self.max_head_bytes)
        parse_bytes(self.feature_cache_size)
        if self.compute_slots is not None and (
            isinstance(self.compute_slots, bool)
            or not isinstance(self.compute_slots, int)
            or self.compute_slots < 1
        ):
            raise InvalidRequest(
                f"compute_slots must be an int >= 1, got {shorten(repr(self.compute_slots))}: "
                "leave it unset for one per core"
            )
        if self.threads is not None and self.threads < 1:
            raise InvalidRequest(
                f"threads must be >= 1, got {self.threads}: leave it unset for torch's default"
            )
        if isinstance(self.local_prefixes, str) or not all(
            isinstance(p, str) and p.strip("/") for p in self.local_prefixes
        ):
            raise InvalidRequest(
                f"local_prefixes must be a tuple of non-empty prefixes such as "
                f"('datasets/shard-0',), got {shorten(repr(self.local_prefixes))}"
            )
        self._check_locality()
        if self.egress_limit is not None:
            from hapi.server.shaping import parse_rate

            parse_rate(self.egress_limit)  # refuse a bad rate before binding a port
        self._check_security()
        self._check_heads()

    def _check_heads(self) -> None:
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", str(self.device)):
            raise InvalidRequest(
                f"device must be cpu, cuda or cuda:N, got {shorten(repr(self.device))}"
            )
        if self.compile_heads not in COMPILE_MODES:
            raise InvalidRequest(
                f"compile_heads is one of {', '.join(COMPILE_MODES)}, got "
                f"{shorten(repr(self.compile_heads))}"
            )
        compiler_for(self.head_compiler, torch.device(self.device))

    def _check_locality(self) -> None:
        if self.beside is None and self.filer is None:
            return
        from hapi.server.locality import Locality

        if self.beside is None:
            raise InvalidRequest(
                "filer is given without beside: name the volume server on this machine "
                "with --beside, or leave both out"
            )
        Locality.of(self.beside, self.filer, self.store)  # refuse bad URLs before serving

    def _check_security(self) -> None:
        if self.token and self.tenants:
            raise InvalidRequest(
                "give either a token (--token, HAPI_TOKEN) or a tenants file (--tenants), not "
                "both: with a tenants file every token is in the file"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidRequest(
                "TLS needs both the certificate and its private key: pass --tls-cert and "
                "--tls-key together"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidRequest(
                "--tls-client-ca checks clients' certificates over TLS: pass --tls-cert and "
                "--tls-key as well"
            )
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool)
            or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise InvalidRequest(
                f"metrics_port must be 0..65535, got {shorten(repr(self.metrics_port))}: pick a "
                "free port, or 0 for any free one"
            )
