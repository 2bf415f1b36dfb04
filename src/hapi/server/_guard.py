"""What a failed request sends back: its `HapiError`, or an `InternalError` with an id."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow.flight as flight

from hapi.errors import HapiError, InternalError, InvalidRequest, shorten
from hapi.server.security.auth import caller
from hapi.server.security.tenants import Tenant
from hapi.wire import encode_error

if TYPE_CHECKING:
    from hapi.server.metrics import Metrics

__all__ = ["UnusedCallsRefusal", "errors_to_wire", "tenant_call"]

log = logging.getLogger("hapi.server")


@contextlib.contextmanager
def errors_to_wire(what: str) -> Iterator[None]:
    """Turn every exception leaving the block into the Flight error a client may see.

    A `HapiError` goes as itself. Anything else is a bug or a fault of the server's
    environment: its traceback, which may name the server's files and data, is logged
    under a fresh id, and the client gets an `InternalError` with that id only.

    Args:
        what: the request, for the log (`action stats`, `chunk 3 of session ...`).
    """
    try:
        yield
    except flight.FlightError:
        raise  # already encoded (by a nested guard)
    except HapiError as exc:
        log.info("%s failed: %s: %s", what, type(exc).__name__, shorten(str(exc), 1000))
        raise encode_error(exc) from None
    except Exception:
        error = InternalError.new()
        log.exception("%s failed unexpectedly (internal error %s)", what, error.error_id)
        raise encode_error(error) from None


@contextlib.contextmanager
def tenant_call(
    what: str, who: flight.ServerCallContext | Tenant, metrics: Metrics
) -> Iterator[Tenant]:
    """`errors_to_wire` for a call of `who` (its context, or its tenant once known),
    counting each error in `metrics` under the tenant; yields the tenant."""
    with errors_to_wire(what):
        tenant = who if isinstance(who, Tenant) else caller(who)
        try:
            yield tenant
        except flight.FlightError:
            raise  # encoded, and counted, by a guard inside this one
        except HapiError as exc:
            metrics.error(tenant.name, exc)
            raise
        except Exception:
            metrics.error(tenant.name, InternalError.__name__)
            raise


_UNUSED = {
    flight.FlightMethod.LIST_FLIGHTS: "list_flights",
    flight.FlightMethod.GET_FLIGHT_INFO: "get_flight_info",
    flight.FlightMethod.GET_SCHEMA: "get_schema",
    flight.FlightMethod.DO_EXCHANGE: "do_exchange",
}


class UnusedCallsRefusal(flight.ServerMiddlewareFactory):
    """Refuses the Flight calls hapi does not use, before they reach the server.

    `do_put` is used, for uploading heads only: the server's handler refuses any other
    descriptor (this middleware does not see descriptors).

    Refused in a handler, pyarrow would answer with its own traceback (for `get_schema`
    even a hapi error gets one, naming the server's files); refused here, the caller gets
    an `InvalidRequest` and nothing else.
    """

    def start_call(
        self, info: flight.CallInfo, headers: dict[str, list[str]]
    ) -> flight.ServerMiddleware | None:
        call = _UNUSED.get(info.method)
        if call is not None:
            raise encode_error(
                InvalidRequest(
                    f"hapi servers do not answer {call}: use hapi.connect(address) and its methods"
                )
            )
        return None
