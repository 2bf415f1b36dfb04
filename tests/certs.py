"""Certificates for TLS tests: a throwaway CA, a server certificate and a client certificate.

`make_certs(tmp_path)` writes them as PEM files and returns their paths; every test that
needs TLS makes its own, so no key ever lives in the repository. The server certificate
names `localhost`, `127.0.0.1` and `::1` (subject alternative names): a client must
connect to one of those names, or gRPC refuses the certificate.

    certs = make_certs(tmp_path)
    flight.FlightServerBase("grpc+tls://127.0.0.1:0",
                            tls_certificates=[(certs.server_cert.read_bytes(),
                                               certs.server_key.read_bytes())])
    flight.connect(f"grpc+tls://127.0.0.1:{port}", tls_root_certs=certs.ca_cert.read_bytes())
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Certs", "make_certs"]

_VALID = dt.timedelta(days=1)


@dataclass(frozen=True, kw_only=True)
class Certs:
    """Paths of the PEM files `make_certs` wrote."""

    ca_cert: Path
    """The CA that signed both certificates: the client's `tls_root_certs`, and the server's
    `root_certificates` for mutual TLS."""
    server_cert: Path
    """Server certificate for localhost, 127.0.0.1 and ::1."""
    server_key: Path
    """The server certificate's private key (PKCS#8, unencrypted)."""
    client_cert: Path
    """Client certificate (extended key usage: client auth), for mutual TLS."""
    client_key: Path
    """The client certificate's private key (PKCS#8, unencrypted)."""


def make_certs(
    directory: Path, *, hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
) -> Certs:
    """Write a fresh CA, server and client certificate under `directory`.

    Args:
        directory: where the PEM files go (a pytest `tmp_path`); created if missing.
        hosts: the server certificate's names: IP addresses become IP SANs, others DNS SANs.

    Returns:
        The paths of the files written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("hapi test CA")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key, server_cert = _leaf(
        ca_cert, ca_key, hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, hosts
    )
    client_key, client_cert = _leaf(
        ca_cert, ca_key, "hapi test client", ExtendedKeyUsageOID.CLIENT_AUTH, ()
    )
    certs = Certs(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
    )
    certs.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    certs.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    certs.server_key.write_bytes(_key_pem(server_key))
    certs.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    certs.client_key.write_bytes(_key_pem(client_key))
    return certs


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    usage: x509.ObjectIdentifier,
    hosts: tuple[str, ...],
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(_name(common_name), ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )
    if hosts:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False
        )
    return key, builder.sign(ca_key, hashes.SHA256())


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    # Backdated a little: a clock a few seconds behind would otherwise see "not yet valid".
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALID)
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
