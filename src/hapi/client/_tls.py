"""TLS for the client: `grpc+tls://` addresses and the PEM files `connect` is given."""

from __future__ import annotations

from pathlib import Path

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
        options["tls_root_certs"] = _read_pem(ca, "tls_ca", "CA bundle")
    if cert is not None and key is not None:
        options["cert_chain"] = _read_pem(cert, "tls_cert", "client certificate")
        options["private_key"] = _read_pem(key, "tls_key", "client key")
    return options


def _read_pem(path: str, option: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(
            f"cannot read the TLS {what} {path} ({exc.strerror or exc}): check {option}"
        ) from None
    if b"-----BEGIN " not in data:
        raise InvalidRequest(f"TLS {what} {path} is not PEM (no '-----BEGIN' line): check {option}")
    return data
