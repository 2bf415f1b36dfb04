"""The exposure check, the Flight location, and reading a server's certificate and key."""

from __future__ import annotations

from pathlib import Path

import pyarrow.flight as flight
import pytest
from cryptography.hazmat.primitives import serialization

from hapi.errors import InvalidRequest
from hapi.server.security.tls import ServerTls, check_exposure, flight_location, is_loopback

from ..certs import Certs, make_certs

LOOPBACK = [
    "127.0.0.1",
    "127.0.0.2",
    "127.255.255.254",
    "::1",
    "[::1]",
    "::ffff:127.0.0.1",
    "localhost",
    "LOCALHOST.",
]
EXPOSED = [
    "0.0.0.0",
    "::",
    "[::]",
    "",
    "10.0.0.5",
    "192.168.1.2",
    "fe80::1",
    "storage-1",
    "::ffff:10.0.0.1",
]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_is_never_exposed(host: str) -> None:
    assert is_loopback(host)
    assert check_exposure(host, has_token=False, has_tls=False, insecure=False) == []


@pytest.mark.parametrize("host", EXPOSED)
def test_beyond_loopback_needs_token_and_tls(host: str) -> None:
    assert not is_loopback(host)
    assert check_exposure(host, has_token=True, has_tls=True, insecure=False) == []
    for has_token, has_tls in [(False, False), (False, True), (True, False)]:
        with pytest.raises(InvalidRequest, match="--insecure"):
            check_exposure(host, has_token=has_token, has_tls=has_tls, insecure=False)


def test_insecure_exposes_with_warnings_that_say_what() -> None:
    open_plain = check_exposure("0.0.0.0", has_token=False, has_tls=False, insecure=True)
    assert len(open_plain) == 2
    assert "without a token" in open_plain[0] and "every key of the store" in open_plain[0]
    assert "clear text" in open_plain[1]
    (token_plain,) = check_exposure("0.0.0.0", has_token=True, has_tls=False, insecure=True)
    assert "the token" in token_plain and "clear text" in token_plain
    (open_tls,) = check_exposure("::", has_token=False, has_tls=True, insecure=True)
    assert "without a token" in open_tls


def test_refusal_names_what_and_fix() -> None:
    with pytest.raises(InvalidRequest) as info:
        check_exposure("0.0.0.0", has_token=True, has_tls=False, insecure=False)
    message = str(info.value)
    assert "'0.0.0.0'" in message and "the token" in message
    assert "--tls-cert" in message and "127.0.0.1" in message


def test_flight_location() -> None:
    assert flight_location("127.0.0.1", 5, tls=True) == "grpc+tls://127.0.0.1:5"
    assert flight_location("localhost", 0, tls=False) == "grpc://localhost:0"
    assert flight_location("::1", 7, tls=True) == "grpc+tls://[::1]:7"
    assert flight_location("[::]", 7, tls=False) == "grpc://[::]:7"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_server_tls_options(certs: Certs) -> None:
    tls = ServerTls.from_files(certs.server_cert, certs.server_key)
    assert tls.cert == certs.server_cert.read_bytes()
    assert "PRIVATE" not in repr(tls)
    options = tls.flight_options()
    assert set(options) == {"tls_certificates"}
    (pair,) = options["tls_certificates"]
    assert isinstance(pair, flight.CertKeyPair) and pair.key == tls.key
    mutual = ServerTls.from_files(certs.server_cert, certs.server_key, client_ca=certs.ca_cert)
    assert mutual.flight_options()["verify_client"] is True
    assert mutual.flight_options()["root_certificates"] == certs.ca_cert.read_bytes()


def test_server_tls_says_which_file_is_wrong(certs: Certs, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"not a certificate")
    cases = [
        ((tmp_path / "missing.pem", certs.server_key), "cannot read the TLS certificate"),
        ((garbage, certs.server_key), "is not PEM"),
        ((certs.server_cert, garbage), "is not PEM"),
        ((certs.server_cert, encrypted), "is encrypted"),
        ((certs.server_cert, certs.client_key), "cannot use TLS certificate"),
        ((certs.server_key, certs.server_key), "cannot use TLS certificate"),
    ]
    for (cert, key_path), fix in cases:
        with pytest.raises(InvalidRequest, match=fix):
            ServerTls.from_files(cert, key_path)
    with pytest.raises(InvalidRequest, match="holds no usable certificate"):
        ServerTls.from_files(certs.server_cert, certs.server_key, client_ca=certs.server_key)
