"""Arrow Flight over TLS in this environment, with certificates the test makes.

A minimal Flight server (not hapi's) shows the pyarrow calls that work, and what a client
sees when TLS goes wrong, so `HapiServer` and `Connection` can rely on them:

    server: FlightServerBase("grpc+tls://HOST:PORT", tls_certificates=[CertKeyPair(cert, key)],
                             [verify_client=True, root_certificates=client_ca_pem])
    client: flight.connect("grpc+tls://NAME:PORT", tls_root_certs=ca_pem,
                           [cert_chain=client_cert_pem, private_key=client_key_pem])

NAME must be one of the server certificate's subject alternative names. The tests at the
end run hapi's own server and client over TLS, and check what a client is told when the
handshake fails.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from hapi.client import connect
from hapi.errors import InvalidRequest, ServerUnavailable, Unauthenticated
from hapi.server import ServerConfig
from hapi.server import serve as hapi_serve
from hapi.server.security.auth import TENANT_MIDDLEWARE, TenantMiddlewareFactory, caller
from hapi.server.security.tenants import Tenant, Tenants
from hapi.server.security.tls import ServerTls, flight_location
from hapi.wire import decode_error

from ..certs import Certs, make_certs

TABLE = pa.table({"key": ["a/1", "a/2"], "x": [1.5, 2.5]})
# A wrong certificate fails at the handshake, and gRPC retries until the deadline: keep it short.
OPTIONS = flight.FlightCallOptions(timeout=10)


class Echo(flight.FlightServerBase):
    """Answers `whoami` with the caller's tenant (or client certificate), and any ticket
    with TABLE."""

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[Any]:
        if context.get_middleware(TENANT_MIDDLEWARE) is not None:
            who = caller(context).name.encode()
        else:
            who = context.peer_identity()
        yield flight.Result(pa.py_buffer(who))

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> Any:
        return flight.RecordBatchStream(TABLE)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def serve(tls: ServerTls | None, **options: Any) -> Echo:
    location = flight_location("127.0.0.1", 0, tls=tls is not None)
    return Echo(location, **(tls.flight_options() if tls else {}), **options)


def whoami(client: flight.FlightClient, options: flight.FlightCallOptions = OPTIONS) -> bytes:
    (result,) = client.do_action(flight.Action("whoami", b""), options)
    return bytes(result.body.to_pybytes())


def test_tls_round_trip(certs: Certs) -> None:
    ca = certs.ca_cert.read_bytes()
    with serve(ServerTls.from_files(certs.server_cert, certs.server_key)) as server:
        for host in ("127.0.0.1", "localhost"):
            with flight.connect(f"grpc+tls://{host}:{server.port}", tls_root_certs=ca) as client:
                assert client.do_get(flight.Ticket(b"t"), OPTIONS).read_all().equals(TABLE)
                assert whoami(client) == b""  # no client certificate


def test_client_that_does_not_trust_the_server_fails(certs: Certs, tmp_path: Path) -> None:
    other_ca = make_certs(tmp_path).ca_cert.read_bytes()
    with serve(ServerTls.from_files(certs.server_cert, certs.server_key)) as server:
        tls = f"grpc+tls://127.0.0.1:{server.port}"
        assert "certificate verify failed" in refusal(tls)  # the system's CAs
        assert "certificate verify failed" in refusal(tls, tls_root_certs=other_ca)
        refusal(f"grpc://127.0.0.1:{server.port}")  # plain text: "Socket closed"


def test_tls_client_against_plain_server_fails(certs: Certs) -> None:
    with serve(None) as server:
        address = f"grpc+tls://127.0.0.1:{server.port}"
        assert "Ssl handshake failed" in refusal(address, tls_root_certs=certs.ca_cert.read_bytes())


def test_address_must_be_a_name_of_the_certificate(tmp_path: Path) -> None:
    named = make_certs(tmp_path, hosts=("localhost",))
    ca = named.ca_cert.read_bytes()
    with serve(ServerTls.from_files(named.server_cert, named.server_key)) as server:
        by_ip = f"grpc+tls://127.0.0.1:{server.port}"
        assert "not in peer certificate" in refusal(by_ip, tls_root_certs=ca)
        with flight.connect(by_ip, tls_root_certs=ca, override_hostname="localhost") as client:
            assert whoami(client) == b""


def test_grpc_location_ignores_the_certificate(certs: Certs) -> None:
    # The pitfall `flight_location` avoids: pyarrow serves plain text on a grpc:// location
    # even when given a certificate, so a plain client gets through.
    tls = ServerTls.from_files(certs.server_cert, certs.server_key)
    with (
        Echo("grpc://127.0.0.1:0", **tls.flight_options()) as server,
        flight.connect(f"grpc://127.0.0.1:{server.port}") as client,
    ):
        assert whoami(client) == b""


def test_mutual_tls(certs: Certs, tmp_path: Path) -> None:
    ca = certs.ca_cert.read_bytes()
    stranger = make_certs(tmp_path)
    mutual = ServerTls.from_files(certs.server_cert, certs.server_key, client_ca=certs.ca_cert)
    with serve(mutual) as server:
        address = f"grpc+tls://127.0.0.1:{server.port}"
        with flight.connect(
            address,
            tls_root_certs=ca,
            cert_chain=certs.client_cert.read_bytes(),
            private_key=certs.client_key.read_bytes(),
        ) as client:
            assert whoami(client) == b"hapi test client"  # the certificate's common name
        refusal(address, tls_root_certs=ca)  # no client certificate: "Socket closed"
        refusal(
            address,
            tls_root_certs=ca,
            cert_chain=stranger.client_cert.read_bytes(),
            private_key=stranger.client_key.read_bytes(),
        )


def test_two_tenants_over_tls(certs: Certs) -> None:
    tenants = Tenants(
        [
            Tenant(name="team-a", token="token-a-0123456789", prefixes=("datasets/a",)),
            Tenant(name="team-b", token="token-b-0123456789", prefixes=("datasets/b",)),
        ]
    )
    refused: list[Unauthenticated] = []
    middleware = {TENANT_MIDDLEWARE: TenantMiddlewareFactory(tenants, on_refused=refused.append)}
    tls = ServerTls.from_files(certs.server_cert, certs.server_key)
    with serve(tls, middleware=middleware) as server:
        address = f"grpc+tls://127.0.0.1:{server.port}"
        with flight.connect(address, tls_root_certs=certs.ca_cert.read_bytes()) as client:
            for token, name in [
                ("token-a-0123456789", b"team-a"),
                ("token-b-0123456789", b"team-b"),
            ]:
                assert whoami(client, bearer(token)) == name
            for headers in ([], [(b"authorization", b"Bearer token-c")]):
                options = flight.FlightCallOptions(headers=headers, timeout=10)
                with pytest.raises(flight.FlightUnauthenticatedError) as info:
                    whoami(client, options)
                assert isinstance(decode_error(info.value), Unauthenticated)
    assert len(refused) == 2


def refusal(address: str, **options: Any) -> str:
    """The message of the FlightUnavailableError a call through a new client gets."""
    with (
        flight.connect(address, **options) as client,
        pytest.raises(flight.FlightUnavailableError) as info,
    ):
        whoami(client)
    return str(info.value)


def bearer(token: str) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {token}".encode())], timeout=10
    )


# hapi's own server and client over TLS -------------------------------------------------


def hapi_tls(certs: Certs, store: Path, **options: Any) -> Any:
    return hapi_serve(
        ServerConfig(
            store=str(store),
            tls_cert=str(certs.server_cert),
            tls_key=str(certs.server_key),
            **options,
        )
    )


def test_hapi_client_over_tls(certs: Certs, tmp_path: Path) -> None:
    with hapi_tls(certs, tmp_path, token="tls-token-0123456789") as server:
        assert server.address.startswith("grpc+tls://127.0.0.1:")
        conn = connect(server.address, token="tls-token-0123456789", tls_ca=certs.ca_cert)
        assert conn.stats().sessions == {}
        # A Connection pickles into DataLoader workers with its TLS options.
        copy = pickle.loads(pickle.dumps(conn))
        assert (copy.tls_ca, copy.address) == (str(certs.ca_cert), server.address)
        assert copy.stats().sessions == {}
        bare = connect(
            f"localhost:{server.port}", token="tls-token-0123456789", tls_ca=certs.ca_cert
        )
        assert bare.address.startswith("grpc+tls://") and bare.stats().sessions == {}


def test_hapi_client_names_a_failed_handshake(certs: Certs, tmp_path: Path) -> None:
    stranger = make_certs(tmp_path / "other")
    with hapi_tls(certs, tmp_path) as server:
        untrusting = connect(server.address, tls_ca=stranger.ca_cert, timeout=10)
        with pytest.raises(ServerUnavailable, match=r"TLS handshake with grpc\+tls://") as info:
            untrusting.stats()
        assert "check tls_ca" in str(info.value) and "unreachable" not in str(info.value)
        plain = connect(f"grpc://127.0.0.1:{server.port}", timeout=10)
        with pytest.raises(ServerUnavailable) as info:
            plain.stats()
        assert f"connect to grpc+tls://127.0.0.1:{server.port}" in str(info.value)
    with hapi_serve(ServerConfig(store=str(tmp_path))) as server:
        tls_to_plain = connect(f"grpc+tls://127.0.0.1:{server.port}", tls_ca=certs.ca_cert)
        with pytest.raises(ServerUnavailable, match="that the server uses TLS"):
            tls_to_plain.stats()


def test_hapi_mutual_tls(certs: Certs, tmp_path: Path) -> None:
    with hapi_tls(certs, tmp_path, tls_client_ca=str(certs.ca_cert)) as server:
        with_cert = connect(
            server.address,
            tls_ca=certs.ca_cert,
            tls_cert=certs.client_cert,
            tls_key=certs.client_key,
            timeout=10,
        )
        assert with_cert.stats().sessions == {}
        without = connect(server.address, tls_ca=certs.ca_cert, timeout=10)
        with pytest.raises(ServerUnavailable, match="tls_cert/tls_key"):
            without.stats()


def test_connect_refuses_tls_options_it_cannot_use(certs: Certs, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="grpc\\+tls://host:1"):
        connect("grpc://host:1", tls_ca=certs.ca_cert)
    with pytest.raises(InvalidRequest, match="tls_cert and tls_key together"):
        connect("grpc+tls://host:1", tls_cert=certs.client_cert)
    (tmp_path / "not.pem").write_text("hello")
    for bad, what in [(tmp_path / "missing.pem", "cannot read"), (tmp_path / "not.pem", "not PEM")]:
        with pytest.raises(InvalidRequest, match=what):
            connect("grpc+tls://127.0.0.1:1", tls_ca=bad).stats()
