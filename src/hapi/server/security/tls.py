"""TLS for `hapi serve`, and the check that refuses to expose a server by accident.

A server with a certificate listens on `grpc+tls://`; clients connect to a name the
certificate holds (a DNS or IP subject alternative name), with the CA that signed it.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.flight as flight

from hapi._pem import read_pem
from hapi.errors import InvalidRequest

__all__ = ["ServerTls", "check_exposure", "flight_location", "is_loopback"]


@dataclass(frozen=True, kw_only=True)
class ServerTls:
    """The certificate a server presents, and the CA its clients' certificates must chain to."""

    cert: bytes
    """PEM certificate chain, the server's certificate first."""
    key: bytes = field(repr=False)
    """PEM private key of the certificate, unencrypted (gRPC cannot ask for a passphrase)."""
    client_ca: bytes | None = None
    """PEM CA bundle; when set, every client must present a certificate it signed (mutual TLS)."""

    @classmethod
    def from_files(
        cls, cert: str | Path, key: str | Path, *, client_ca: str | Path | None = None
    ) -> ServerTls:
        """Read and check the PEM files of `--tls-cert`, `--tls-key` and `--tls-client-ca`.

        gRPC says only "Server did not start properly" about a bad certificate or key, so
        they are checked here first, with Python's ssl module, to say which file is wrong.

        Raises:
            InvalidRequest: a file cannot be read, is not PEM, the key is encrypted or is
                not the certificate's.
        """
        cert_pem = read_pem(cert, "--tls-cert", "certificate")
        key_pem = read_pem(key, "--tls-key", "private key")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(cert, key, password=_no_passphrase)
        except _Encrypted:
            raise InvalidRequest(
                f"TLS key {key} is encrypted: the server cannot ask for its passphrase; write "
                "an unencrypted copy readable by the server only (openssl pkey -in KEY -out NEW)"
            ) from None
        except ssl.SSLError as exc:
            raise InvalidRequest(
                f"cannot use TLS certificate {cert} with key {key} ({exc.reason or exc}): give "
                "the PEM certificate (chain) and the PEM private key that belongs to it"
            ) from None
        ca_pem = None
        if client_ca is not None:
            ca_pem = read_pem(client_ca, "--tls-client-ca", "CA bundle")
            try:
                context.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
            except ssl.SSLError as exc:
                raise InvalidRequest(
                    f"TLS client CA {client_ca} holds no usable certificate ({exc}): give the "
                    "PEM certificate of the CA that signs the clients' certificates"
                ) from None
        return cls(cert=cert_pem, key=key_pem, client_ca=ca_pem)

    def flight_options(self) -> dict[str, Any]:
        """Keyword arguments for `flight.FlightServerBase.__init__` that turn TLS on.

        The location must be `grpc+tls://` as well (`flight_location`): with a `grpc://`
        location pyarrow ignores the certificate and serves plain text.
        """
        options: dict[str, Any] = {"tls_certificates": [flight.CertKeyPair(self.cert, self.key)]}
        if self.client_ca is not None:
            options["verify_client"] = True
            options["root_certificates"] = self.client_ca
        return options


def flight_location(host: str, port: int, *, tls: bool) -> str:
    """The Flight location to listen on: `grpc+tls://host:port` with TLS, else `grpc://`."""
    scheme = "grpc+tls" if tls else "grpc"
    bare = host.strip("[]")
    try:
        if ipaddress.ip_address(bare).version == 6:
            return f"{scheme}://[{bare}]:{port}"
    except ValueError:
        pass
    return f"{scheme}://{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether `host` reaches this machine only: `localhost`, 127.0.0.0/8 or ::1.

    Other names count as exposed: what they resolve to is not ours to trust, and the
    wildcard addresses (0.0.0.0, ::, "") listen on every interface.
    """
    bare = host.strip("[]").rstrip(".").lower()
    if bare == "localhost":
        return True
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_exposure(host: str, *, has_token: bool, has_tls: bool, insecure: bool) -> list[str]:
    """What a server bound to `host` exposes; refused unless the operator accepts it.

    On loopback nothing is exposed. Beyond it a server needs a token (or tenants) and TLS:
    without a token anyone who reaches the port reads the whole store; without TLS the
    token crosses the network in clear text, and with it the store.

    Args:
        host: the address the server binds.
        has_token: whether callers must send a token (`--token` or `--tenants`).
        has_tls: whether the server has a certificate (`--tls-cert`, `--tls-key`).
        insecure: the operator's `--insecure`: expose anyway, with warnings.

    Returns:
        Warnings to log (empty when nothing is exposed).

    Raises:
        InvalidRequest: something is exposed and `insecure` is False; the message says what
            and how to fix it.
    """
    if is_loopback(host):
        return []
    where = f"hapi serve binds {host!r}, beyond loopback"
    exposed = []
    if not has_token:
        exposed.append(
            f"{where}, without a token: anyone who reaches its port can read every key of "
            "the store and run models on this machine"
        )
    if not has_tls:
        secret = "the token (and with it the store), " if has_token else ""
        exposed.append(
            f"{where}, without TLS: {secret}object keys and features cross the network in "
            "clear text, readable by anyone on the path"
        )
    if exposed and not insecure:
        raise InvalidRequest(
            "; ".join(exposed)
            + ". Bind 127.0.0.1 (--host), or give tokens (--tenants FILE, or HAPI_TOKEN) and "
            "a certificate (--tls-cert, --tls-key), or pass --insecure to accept this"
        )
    return exposed


class _Encrypted(Exception):
    pass


def _no_passphrase() -> bytes:
    # Called by ssl only for an encrypted key; without it OpenSSL would prompt on the tty.
    raise _Encrypted
