"""Who is calling: bearer tokens to tenants, for every Flight call, before any handler runs."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow.flight as flight

from hapi.errors import Unauthenticated
from hapi.server.security.tenants import Tenant, Tenants
from hapi.wire import encode_error

__all__ = ["TENANT_MIDDLEWARE", "TenantMiddleware", "TenantMiddlewareFactory", "caller"]

TENANT_MIDDLEWARE = "tenant"
"""Key of `TenantMiddlewareFactory` in the server's middleware, read back by `caller`."""


class TenantMiddleware(flight.ServerMiddleware):
    """Carries the tenant of one call to the handlers (see `caller`)."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant


class TenantMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Authenticates every call by its bearer token; refuses the call without a tenant.

    Install as `middleware={TENANT_MIDDLEWARE: TenantMiddlewareFactory(tenants)}`. An open
    server (`Tenants.open()`) gives every call its anonymous tenant.
    """

    def __init__(
        self, tenants: Tenants, *, on_refused: Callable[[Unauthenticated], None] | None = None
    ) -> None:
        """Authenticate by `tenants`; `on_refused` sees each refusal (to count it)."""
        self.tenants = tenants
        self.on_refused = on_refused

    def start_call(
        self, info: flight.CallInfo, headers: dict[str, list[str]]
    ) -> flight.ServerMiddleware | None:
        try:
            tenant = self.tenants.authenticate_header(headers.get("authorization", []))
        except Unauthenticated as exc:
            if self.on_refused is not None:
                self.on_refused(exc)
            raise encode_error(exc) from None
        return TenantMiddleware(tenant)


def caller(context: flight.ServerCallContext) -> Tenant:
    """The tenant of the call `context` belongs to.

    Raises:
        Unauthenticated: the server has no `TenantMiddlewareFactory` under `TENANT_MIDDLEWARE`.
    """
    middleware = context.get_middleware(TENANT_MIDDLEWARE)
    if not isinstance(middleware, TenantMiddleware):
        raise Unauthenticated(
            "the server authenticates no tenants: install TenantMiddlewareFactory"
        )
    return middleware.tenant
