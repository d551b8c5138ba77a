"""Holding a connection's input holds its peer back (``QuicStack.hold_input``, #11).

Two connections of one stack (aioquic, qh3) exchange datagrams in memory. The server
has a relay's receive window (``RELAY_MAX_DATA``); the client writes more than that on
several streams. While the server's input is held, the client gets no more than the
window onto the wire (QUIC flow control: the credit stops growing), and nothing is
lost: released, every byte arrives, in order, bit for bit. aioquic's credit slides by a
fixed window instead of doubling (``stack._aioquic_credit_windows``), so what a relay
has granted stays one window however much it received before; the same pair without a
hold transfers everything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcs.transports.quic.config import RELAY_MAX_DATA, quic_configuration
from kvcs.transports.quic.stack import QuicStack, StackUnavailable, load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed

CLIENT, SERVER = ("127.0.0.1", 40001), ("127.0.0.1", 40002)
STREAM_BYTES = 6 << 20
STREAMS = 4
"""24 MiB in all, on four streams: more than the server's 16 MiB connection window."""


def _stack(name: str) -> QuicStack:
    try:
        return load_stack(name)
    except StackUnavailable as exc:  # pragma: no cover - both are dependencies
        pytest.fail(str(exc))


class Pair:
    """A client and a server connection of ``stack``, handshaken, in memory."""

    def __init__(self, stack: QuicStack, tmp: Path) -> None:
        self.stack = stack
        self.now = 1000.0
        self.client = stack.connection(
            configuration=quic_configuration(stack, is_client=True, tls=TlsConfig(verify=False))
        )
        self.client.connect(SERVER, now=self.now)
        first = self.client.datagrams_to_send(now=self.now)
        header = stack.pull_header(first[0][0], 8)
        self.server = stack.connection(
            configuration=quic_configuration(
                stack, is_client=False, tls=self_signed(tmp), max_data=RELAY_MAX_DATA
            ),
            original_destination_connection_id=header.destination_cid,
        )
        for data, _ in first:
            self.server.receive_datagram(data, CLIENT, now=self.now)
        self.received: dict[int, bytearray] = {}
        self.run(30)
        assert self.handshaken(), "no handshake in memory"
        self.received.clear()

    def handshaken(self) -> bool:
        return bool(getattr(self.client, "_handshake_complete", True))

    def run(self, rounds: int) -> None:
        """``rounds`` exchanges both ways (bounded), the server's events read as they come."""
        for _ in range(rounds):
            self.now += 0.0005
            for data, _ in self.client.datagrams_to_send(now=self.now):
                self.server.receive_datagram(data, CLIENT, now=self.now)
            self.now += 0.0005
            for data, _ in self.server.datagrams_to_send(now=self.now):
                self.client.receive_datagram(data, SERVER, now=self.now)
            while (e := self.server.next_event()) is not None:
                data = getattr(e, "data", None)
                if isinstance(data, bytes | bytearray | memoryview) and hasattr(e, "stream_id"):
                    self.received.setdefault(e.stream_id, bytearray()).extend(data)
            while self.client.next_event() is not None:
                pass

    def on_the_wire(self, streams: list[int]) -> int:
        """Bytes the client has sent at least once, over ``streams``."""
        return STREAMS * STREAM_BYTES - sum(
            self.stack.unsent_bytes(self.client, s) for s in streams
        )

    def delivered(self) -> int:
        return sum(len(b) for b in self.received.values())


def _pattern(stream_index: int) -> bytes:
    block = bytes((stream_index * 31 + i) % 251 for i in range(4096))
    return block * (STREAM_BYTES // len(block))


def _write(pair: Pair) -> dict[int, bytes]:
    sent: dict[int, bytes] = {}
    for i in range(STREAMS):
        sid = pair.client.get_next_available_stream_id(is_unidirectional=True)
        data = _pattern(i)
        pair.client.send_stream_data(sid, data, end_stream=True)
        sent[sid] = data
    return sent


def _until_delivered(pair: Pair, total: int, rounds: int) -> None:
    for _ in range(rounds):
        pair.run(20)
        if pair.delivered() >= total:
            return


@pytest.mark.parametrize("name", ["aioquic", "qh3"])
def test_a_held_connection_holds_its_peer_to_one_window(name: str, tmp_path: Path) -> None:
    stack = _stack(name)
    assert stack.hold_input is not None
    pair = Pair(stack, tmp_path)
    assert stack.hold_input(pair.server, True)
    sent = _write(pair)
    wire, before = 0, -1
    for _ in range(60):  # until the client stops sending (bounded)
        pair.run(100)
        wire = pair.on_the_wire(list(sent))
        if wire == before:
            break
        before = wire
    # held: the client filled the connection window and stopped there; the rest waits
    assert RELAY_MAX_DATA // 2 < wire <= RELAY_MAX_DATA + 64 * 1024, wire
    assert pair.delivered() <= RELAY_MAX_DATA
    pair.run(200)  # and it stays held
    assert pair.on_the_wire(list(sent)) == wire
    assert stack.hold_input(pair.server, False)
    _until_delivered(pair, STREAMS * STREAM_BYTES, 400)
    assert {sid: bytes(b) for sid, b in pair.received.items()} == sent


@pytest.mark.parametrize("name", ["aioquic", "qh3"])
def test_without_a_hold_everything_flows_and_credit_stays_one_window(
    name: str, tmp_path: Path
) -> None:
    stack = _stack(name)
    pair = Pair(stack, tmp_path)
    sent = _write(pair)
    _until_delivered(pair, STREAMS * STREAM_BYTES, 400)
    assert {sid: bytes(b) for sid, b in pair.received.items()} == sent
    if name == "aioquic":
        # the credit granted ahead of what arrived is one window, not aioquic's doubling
        limit: Any = pair.server._local_max_data
        assert limit.used == STREAMS * STREAM_BYTES
        assert limit.value - limit.used <= RELAY_MAX_DATA


def test_a_stack_that_cannot_hold_says_so() -> None:
    qh3 = _stack("qh3")
    assert qh3.hold_input is not None
    assert qh3.hold_input(object(), True) is False  # not a qh3 connection
    aioquic = _stack("aioquic")
    assert aioquic.hold_input is not None
    assert aioquic.hold_input(object(), True) is False
