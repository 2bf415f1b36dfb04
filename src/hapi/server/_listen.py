"""How a server meets the network: its tenants, TLS and location, checked before it binds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.flight as flight

from hapi.errors import Unauthenticated
from hapi.server._guard import UnusedCallsRefusal
from hapi.server.metrics import Metrics
from hapi.server.security.auth import TENANT_MIDDLEWARE, TenantMiddlewareFactory
from hapi.server.security.tenants import Tenants
from hapi.server.security.tls import ServerTls, check_exposure, flight_location, is_loopback
from hapi.server.server_config import ServerConfig

__all__ = ["Listener", "serve_metrics"]

log = logging.getLogger("hapi.server")


@dataclass(frozen=True, kw_only=True)
class Listener:
    """Where a server listens, who may call it, and over what."""

    location: str
    """`grpc://host:port`, or `grpc+tls://host:port` with a certificate."""
    tenants: Tenants
    """Who may call: a tenants file, one token's tenant, or the anonymous tenant."""
    tls: ServerTls | None
    """The server's certificate; None serves plain text."""

    @classmethod
    def from_config(cls, config: ServerConfig) -> Listener:
        """Read the tenants and certificates `config` names; refuse to expose the store.

        Raises:
            InvalidRequest: a tenants or certificate file is bad, or the address is beyond
                loopback without a token or TLS and `config.insecure` is not set.
        """
        if config.tenants:
            tenants = Tenants.from_file(config.tenants)
        elif config.token:
            tenants = Tenants.single(config.token)
        else:
            tenants = Tenants.open()
        tls = None
        if config.tls_cert and config.tls_key:
            tls = ServerTls.from_files(
                config.tls_cert, config.tls_key, client_ca=config.tls_client_ca
            )
        # Refused before binding: an exposed server must not answer even once.
        exposed = check_exposure(
            config.host,
            has_token=tenants.requires_token,
            has_tls=tls is not None,
            insecure=config.insecure,
        )
        for warning in exposed:
            log.warning("%s (accepted by --insecure)", warning)
        # Always from flight_location: a grpc:// location with certificates serves plain text.
        location = flight_location(config.host, config.port, tls=tls is not None)
        return cls(location=location, tenants=tenants, tls=tls)

    def flight_options(
        self, *, on_refused: Callable[[Unauthenticated], None] | None = None
    ) -> dict[str, Any]:
        """Keyword arguments of `flight.FlightServerBase.__init__` after the location.

        Args:
            on_refused: sees every call refused for its token (to count it).
        """
        middleware: dict[str, flight.ServerMiddlewareFactory] = {
            TENANT_MIDDLEWARE: TenantMiddlewareFactory(self.tenants, on_refused=on_refused),
            "unused": UnusedCallsRefusal(),
        }
        return {"middleware": middleware, **(self.tls.flight_options() if self.tls else {})}


def serve_metrics(metrics: Metrics, config: ServerConfig) -> None:
    """Serve `metrics` on `config.metrics_host:metrics_port`, over HTTPS with the server's
    certificate when it has one.

    Raises:
        InvalidRequest: the port cannot be bound.
    """
    if not is_loopback(config.metrics_host):
        log.warning(
            "metrics on %s, beyond loopback: they name tenants and sessions; keep that "
            "address on a private network",
            config.metrics_host,
        )
    tls = {"certfile": config.tls_cert, "keyfile": config.tls_key} if config.tls_cert else {}
    metrics.serve_http(config.metrics_host, config.metrics_port or 0, **tls)
    log.info("metrics at %s", metrics.url)
