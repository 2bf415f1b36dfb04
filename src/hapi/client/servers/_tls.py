"""TLS for the client: `grpc+tls://` addresses and the PEM files `connect` is given."""

from __future__ import annotations

from hapi._pem import read_pem
from hapi.errors import InvalidRequest

__all__ = ["flight_tls_options", "tls_address"]


def tls_address(address: str, *, ca: str | None, cert: str | None, key: str | None) -> str:
    """`address` with its scheme, checked against the TLS options given with it.

    A bare `host:port` is `grpc+tls://` when a TLS option is given, else `grpc://`.

    Raises:
        InvalidRequest: TLS options with an address that is not `grpc+tls://`, or a
            client certificate without its key (or the reverse).
    """
    if (cert is None) != (key is None):
        raise InvalidRequest(
            "a client certificate needs its key: pass tls_cert and tls_key together"
        )
    tls = ca is not None or cert is not None
    if "://" not in address:
        return f"{'grpc+tls' if tls else 'grpc'}://{address}"
    if tls and not address.startswith("grpc+tls://"):
        # Refused rather than ignored: the token would cross the network in clear text.
        raise InvalidRequest(
            f"TLS options need a grpc+tls:// address, got {address}: write it as "
            f"grpc+tls://{address.partition('://')[2]}"
        )
    return address


def flight_tls_options(ca: str | None, cert: str | None, key: str | None) -> dict[str, bytes]:
    """Keyword arguments of `flight.connect` for a CA bundle and a client certificate.

    Raises:
        InvalidRequest: a file cannot be read or is not PEM.
    """
    options = {}
    if ca is not None:
        options["tls_root_certs"] = read_pem(ca, "tls_ca", "CA bundle")
    if cert is not None and key is not None:
        options["cert_chain"] = read_pem(cert, "tls_cert", "client certificate")
        options["private_key"] = read_pem(key, "tls_key", "client key")
    return options
