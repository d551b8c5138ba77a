"""Address validation with Retry on qh3 servers (RFC 9000 section 8.1.2).

qh3 2.1 credits a client's first datagram, for its anti-amplification limit, with the
QUIC packets in it and not with the padding some clients put after the Initial packet
(picoquic, aioquic), so against a picoquic client it never completed a handshake
(:mod:`kvcs.transports.quic.stack`). A qh3 endpoint answers such an Initial with a
Retry first. Here: which first datagrams need it (those of real aioquic and qh3
clients); a whole handshake in memory through the Retry, with the client's
``HandshakeCompleted`` as the proof; a token presented from another address does not
validate and earns a new Retry instead of a connection; over real UDP, aioquic and
picoquic (pquic) clients connect to a qh3 relay and qh3 clients get no Retry.
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import pytest

from kvcs.transports.quic import asyncio_binding
from kvcs.transports.quic.apps import ClientApp
from kvcs.transports.quic.config import quic_configuration
from kvcs.transports.quic.endpoint import QuicEndpoint
from kvcs.transports.quic.stack import load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed

try:
    import aiopquic  # noqa: F401

    HAVE_PQUIC = True
except ImportError:
    HAVE_PQUIC = False

SERVER = ("127.0.0.1", 4433)
CLIENT = ("127.0.0.1", 50001)
ELSEWHERE = ("127.0.0.9", 50001)
WAIT = 10.0


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return self_signed(tmp_path_factory.mktemp("tls"))


def _client(stack_name: str) -> Any:
    st = load_stack(stack_name)
    cfg = quic_configuration(st, is_client=True, tls=TlsConfig(verify=False))
    conn = st.connection(configuration=cfg)
    conn.connect(SERVER, now=0.0)
    return st, conn


def _first_datagram(stack_name: str) -> bytes:
    st, conn = _client(stack_name)
    return bytes(st.datagrams_to_send(conn, 0.0)[0][0])


def _qh3_server(tls: TlsConfig) -> QuicEndpoint:
    st = load_stack("qh3")
    cfg = quic_configuration(st, is_client=False, tls=tls)
    return QuicEndpoint(st, cfg, ClientApp())  # no publishers: it only looks on


def test_only_initials_padded_after_their_packet_need_validation() -> None:
    """aioquic pads its first datagram after the Initial packet (qh3 would count the packet
    alone): Retry; qh3 pads inside the packet (counted whole): none."""
    kit = load_stack("qh3").retry
    assert kit is not None
    aioquic_first = _first_datagram("aioquic")
    qh3_first = _first_datagram("qh3")
    assert len(aioquic_first) >= 1200 and len(qh3_first) >= 1200
    assert kit.needed(aioquic_first, 8)
    assert not kit.needed(qh3_first, 8)
    assert load_stack("aioquic").retry is None  # aioquic servers send what they may, no Retry


def test_a_handshake_through_a_retry_completes_in_memory(tls: TlsConfig) -> None:
    """aioquic client -> qh3 endpoint: the first Initial earns a Retry and no connection;
    the Initial with the token makes the connection, whose handshake completes."""
    st, client = _client("aioquic")
    server = _qh3_server(tls)
    now = 0.0
    completed = False
    for _ in range(50):
        for data, _addr in st.datagrams_to_send(client, now):
            server.receive_datagram(bytes(data), CLIENT, now)
        for data, _addr in server.service(now):
            client.receive_datagram(bytes(data), SERVER, now)
        while (event := client.next_event()) is not None:
            completed |= isinstance(event, st.events.HandshakeCompleted)
        if completed:
            break
        now += 0.01
    assert completed, "no HandshakeCompleted at the client"
    assert server.retries == 1
    assert len(server.pumps) == 1


def _retried(tls: TlsConfig) -> tuple[QuicEndpoint, list[bytes]]:
    """A qh3 endpoint that answered an aioquic client's first Initial (from ``CLIENT``)
    with a Retry, and the client's datagrams that answer it (its Initial with the token)."""
    st, client = _client("aioquic")
    server = _qh3_server(tls)
    (first, _), *_ = st.datagrams_to_send(client, 0.0)
    server.receive_datagram(bytes(first), CLIENT, 0.0)
    [(retry, _)] = server.service(0.0)
    assert server.retries == 1 and not server.pumps
    client.receive_datagram(bytes(retry), SERVER, 0.01)
    with_token = [bytes(d) for d, _ in st.datagrams_to_send(client, 0.01)]
    assert st.pull_header(with_token[0], 8).token, "the second Initial carries the token"
    return server, with_token


def test_a_token_from_another_address_earns_a_new_retry(tls: TlsConfig) -> None:
    server, with_token = _retried(tls)
    for data in with_token:  # the token binds CLIENT's address, not this one
        server.receive_datagram(data, ELSEWHERE, 0.02)
    assert server.retries == 2 and not server.pumps
    for data in with_token:
        server.receive_datagram(data, CLIENT, 0.03)
    assert len(server.pumps) == 1 and server.retries == 2


def test_a_token_that_does_not_decrypt_earns_a_new_retry(tls: TlsConfig) -> None:
    """A forged token of the right size (qh3's handler raises its CryptoError, not a
    ValueError, for it) is no token: a new Retry, no connection, nothing raised."""
    server, with_token = _retried(tls)
    st = load_stack("aioquic")
    second = with_token[0]
    token = st.pull_header(second, 8).token
    forged = second.replace(token, bytes(b ^ 0x5A for b in token))
    assert forged != second and st.pull_header(forged, 8).token != token
    server.receive_datagram(forged, CLIENT, 0.02)
    assert server.retries == 2 and not server.pumps


def test_a_retry_the_stack_cannot_build_lets_the_connection_go_ahead(tls: TlsConfig) -> None:
    """When the stack fails to make the Retry, the endpoint does not raise into its
    driver: the Initial makes an unvalidated connection, as before Retry existed."""
    server = _qh3_server(tls)
    kit = server.stack.retry
    assert kit is not None

    def broken(**_: Any) -> bytes:
        raise RuntimeError("no Retry today")

    server.stack = attrs.evolve(server.stack, retry=attrs.evolve(kit, encode_retry=broken))
    server.receive_datagram(_first_datagram("aioquic"), CLIENT, 0.0)
    assert server.retries == 0 and len(server.pumps) == 1


def _connect_to_qh3_relay(tls: TlsConfig, client_stack: str) -> int:
    async def go() -> int:
        b = asyncio_binding
        async with b.serve_relay("127.0.0.1:0", tls=tls, stack="qh3") as relay:
            async with b.connect(
                relay.url, tls=TlsConfig(cafile=tls.cafile), stack=client_stack, timeout=WAIT
            ) as client:
                assert client.connected
            return int(relay.driver.endpoint.retries)

    return asyncio.run(asyncio.wait_for(go(), 3 * WAIT))


@pytest.mark.parametrize(
    ("client_stack", "retried"),
    [
        ("aioquic", True),
        ("qh3", False),
        pytest.param(
            "pquic",
            True,
            marks=pytest.mark.skipif(
                not HAVE_PQUIC,
                reason="aiopquic is not importable (wheels for Python >= 3.12 only)",
            ),
        ),
    ],
)
def test_clients_of_every_stack_connect_to_a_qh3_relay(
    tls: TlsConfig, client_stack: str, retried: bool
) -> None:
    """Over UDP on 127.0.0.1: a MOQT session from each stack's client; aioquic and
    picoquic clients after a Retry (one per token-less Initial that arrives: a client
    that repeats its first Initial before the Retry reaches it gets another, which it
    ignores), qh3 clients without one. (picoquic never got a session before.)"""
    assert (_connect_to_qh3_relay(tls, client_stack) > 0) is retried
