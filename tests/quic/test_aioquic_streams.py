"""aioquic's packets walk only the streams with something to do (``aioquic_streams``, #11).

Two aioquic connections exchange datagrams in memory, optionally losing some of them
(a fixed pattern, both ways), with aioquic's loss timers run. Many request-like
bidirectional streams are opened, answered and left open, as MOQT requests and a KVSP
index's PUBLISH_NAMESPACE streams are. Then: those quiet streams are out of both walks
(send queue and credit watch) while they still exist; data, FINs, resets and
STOP_SENDING on them still go out, under loss too, bit for bit; a quiet stream that is
sent more than its window later gets its credit raised; finished streams are discarded
and the peer may open others in their place; and the plain aioquic class, given the
same lossy exchange, delivers the same bytes.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from kvcs.transports.quic import aioquic_streams
from kvcs.transports.quic.config import quic_configuration
from kvcs.transports.quic.stack import QuicStack, StackUnavailable, load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed

CLIENT, SERVER = ("127.0.0.1", 40011), ("127.0.0.1", 40012)
REQUESTS = 150
"""Quiet bidirectional streams, more than aioquic's default limit of 128."""


def _aioquic() -> QuicStack:
    try:
        return load_stack("aioquic")
    except StackUnavailable as exc:  # pragma: no cover - aioquic is a dependency
        pytest.fail(str(exc))


class Pair:
    """An aioquic client and server, handshaken in memory; ``lose(n)`` says whether the
    n-th datagram (counted over both directions) is lost."""

    def __init__(self, tmp: Path, *, connection: Any = None, lossy: bool = False) -> None:
        stack = _aioquic()
        make = connection or stack.connection
        self.now = 1000.0
        self.lossy = lossy
        self.sent = 0
        self.client = make(
            configuration=quic_configuration(stack, is_client=True, tls=TlsConfig(verify=False))
        )
        self.client.connect(SERVER, now=self.now)
        first = self.client.datagrams_to_send(now=self.now)
        header = stack.pull_header(first[0][0], 8)
        self.server = make(
            configuration=quic_configuration(stack, is_client=False, tls=self_signed(tmp)),
            original_destination_connection_id=header.destination_cid,
        )
        for data, _ in first:
            self.server.receive_datagram(data, CLIENT, now=self.now)
        self.data: dict[str, dict[int, bytearray]] = {"client": {}, "server": {}}
        self.fins: dict[str, set[int]] = {"client": set(), "server": set()}
        self.events: dict[str, list[Any]] = {"client": [], "server": []}
        self.run(40)
        assert self.client._handshake_complete, "no handshake in memory"

    def lose(self) -> bool:
        self.sent += 1
        return self.lossy and self.sent > 40 and self.sent % 9 == 4

    def run(self, rounds: int) -> None:
        """``rounds`` exchanges both ways (bounded), loss timers run, events read."""
        for _ in range(rounds):
            for src, dst, addr in (
                (self.client, self.server, CLIENT),
                (self.server, self.client, SERVER),
            ):
                self.now += 0.0005
                timer = src.get_timer()
                if timer is not None and timer <= self.now:
                    src.handle_timer(now=self.now)
                for data, _ in src.datagrams_to_send(now=self.now):
                    if not self.lose():
                        dst.receive_datagram(data, addr, now=self.now)
            self._read("server", self.server)
            self._read("client", self.client)

    def _read(self, side: str, conn: Any) -> None:
        while (e := conn.next_event()) is not None:
            self.events[side].append(e)
            if type(e).__name__ == "StreamDataReceived":
                self.data[side].setdefault(e.stream_id, bytearray()).extend(e.data)
                if e.end_stream:
                    self.fins[side].add(e.stream_id)

    def until(self, done: Any, rounds: int = 4000) -> None:
        for _ in range(rounds // 20):
            if done():
                return
            self.run(20)
        assert done(), "the exchange did not finish in time"

    def open_requests(self, count: int = REQUESTS) -> list[int]:
        """``count`` bidi streams from the client, each asked and answered, left open."""
        sids = []
        for i in range(count):
            sid = self.client.get_next_available_stream_id()
            self.client.send_stream_data(sid, b"request %04d" % i)
            sids.append(sid)
        self.until(lambda: all(len(self.data["server"].get(s, b"")) == 12 for s in sids))
        for i, sid in enumerate(sids):
            self.server.send_stream_data(sid, b"answer %04d" % i)
        self.until(lambda: all(len(self.data["client"].get(s, b"")) == 11 for s in sids))
        self.run(60)  # every ACK in
        return sids


def _payload(sid: int, size: int) -> bytes:
    return bytes((sid * 7 + i) % 251 for i in range(size))


def test_quiet_streams_leave_both_walks(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    sids = pair.open_requests()
    for conn in (pair.client, pair.server):
        assert isinstance(conn._streams, aioquic_streams.StreamTable)
        assert len(conn._streams) == REQUESTS, "the streams still exist"
        assert len(conn._streams_queue) == 0, "quiet streams are parked"
        assert len(conn._streams.values()) == 0, "and out of the credit walk"
    # bulk data on a new stream: only it is walked while it sends
    uni = pair.client.get_next_available_stream_id(is_unidirectional=True)
    body = _payload(uni, 3 << 20)
    pair.client.send_stream_data(uni, body, end_stream=True)
    longest = 0
    for _ in range(200):
        pair.run(5)
        longest = max(longest, len(pair.client._streams_queue))
        if uni in pair.fins["server"]:
            break
    assert bytes(pair.data["server"][uni]) == body
    assert longest <= 1
    assert len(pair.client._streams) == REQUESTS  # the finished uni stream was discarded
    assert set(sids) <= set(pair.client._streams)


def _lossy_exchange(pair: Pair) -> dict[str, Any]:
    """Quiet requests, then data on some of them and on new streams, under loss; every
    request then ended both ways."""
    sids = pair.open_requests()
    unis = []
    for n in range(6):
        uni = pair.client.get_next_available_stream_id(is_unidirectional=True)
        pair.client.send_stream_data(uni, _payload(uni, 300_000 + n), end_stream=True)
        unis.append(uni)
    for sid in sids[::10]:  # some quiet requests speak again, one side then the other
        pair.client.send_stream_data(sid, _payload(sid, 70_000))
        pair.server.send_stream_data(sid, _payload(sid + 1, 50_000))
    pair.until(lambda: set(unis) <= pair.fins["server"], rounds=20000)
    for sid in sids:
        pair.client.send_stream_data(sid, b"bye", end_stream=True)
        pair.server.send_stream_data(sid, b"ok", end_stream=True)
    pair.until(
        lambda: set(sids) <= pair.fins["server"] and set(sids) <= pair.fins["client"],
        rounds=20000,
    )
    pair.run(200)  # the last ACKs: both sides finish and discard the streams
    return {"sids": sids, "unis": unis}


def test_lossy_exchange_delivers_every_byte_and_discards_finished_streams(
    tmp_path: Path,
) -> None:
    pair = Pair(tmp_path, lossy=True)
    ids = _lossy_exchange(pair)
    lost = pair.sent // 9
    assert lost > 100, "the pattern lost datagrams"
    for uni in ids["unis"]:
        assert bytes(pair.data["server"][uni]) == _payload(uni, len(pair.data["server"][uni]))
        assert len(pair.data["server"][uni]) >= 300_000
    for i, sid in enumerate(ids["sids"]):
        extra = _payload(sid, 70_000) if i % 10 == 0 else b""
        assert bytes(pair.data["server"][sid]) == b"request %04d" % i + extra + b"bye"
        back = _payload(sid + 1, 50_000) if i % 10 == 0 else b""
        assert bytes(pair.data["client"][sid]) == b"answer %04d" % i + back + b"ok"
    for conn in (pair.client, pair.server):
        assert not set(ids["sids"]) & set(conn._streams), "finished requests discarded"
    # the server let the client open one stream for each that ended (RFC 9000 4.6)
    assert pair.server._local_max_streams_bidi.value >= 1024 + REQUESTS
    more = []
    for _ in range(3):
        sid = pair.client.get_next_available_stream_id()
        pair.client.send_stream_data(sid, b"again", end_stream=True)
        more.append(sid)
    pair.until(lambda: set(more) <= pair.fins["server"])


def test_plain_aioquic_delivers_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert aioquic_streams.layout_known(
        importlib.import_module("aioquic.quic.connection").QuicConnection
    )
    quiet = Pair(tmp_path, lossy=True)
    # the stack as it is where aioquic's layout is not the known one: every stream walked
    monkeypatch.setattr(aioquic_streams, "layout_known", lambda cls: False)
    plain = Pair(tmp_path, connection=_aioquic().connection, lossy=True)
    assert not isinstance(plain.client._streams, aioquic_streams.StreamTable)
    _lossy_exchange(quiet)
    _lossy_exchange(plain)
    assert quiet.data == plain.data
    assert quiet.fins == plain.fins


def test_a_parked_stream_sent_more_than_its_window_gets_credit(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    sids = pair.open_requests(20)
    sid = sids[7]
    assert len(pair.server._streams.values()) == 0
    window = pair.server._streams[sid].max_stream_data_local
    body = _payload(sid, 3 * window)
    pair.client.send_stream_data(sid, body, end_stream=True)
    pair.until(lambda: sid in pair.fins["server"])
    assert bytes(pair.data["server"][sid]) == b"request 0007" + body
    assert pair.server._streams[sid].max_stream_data_local > window


def test_reset_and_stop_sending_reach_the_peer_from_parked_streams(tmp_path: Path) -> None:
    pair = Pair(tmp_path, lossy=True)
    sids = pair.open_requests(30)
    assert len(pair.client._streams_queue) == 0
    pair.client.reset_stream(sids[3], 0x21)
    pair.client.stop_stream(sids[5], 0x22)
    pair.until(
        lambda: (
            any(
                type(e).__name__ == "StreamReset" and e.stream_id == sids[3]
                for e in pair.events["server"]
            )
            and any(
                type(e).__name__ == "StopSendingReceived" and e.stream_id == sids[5]
                for e in pair.events["server"]
            )
        )
    )
    reset = next(e for e in pair.events["server"] if type(e).__name__ == "StreamReset")
    assert reset.error_code == 0x21


def test_a_late_delivery_outcome_of_a_discarded_stream_is_ignored(tmp_path: Path) -> None:
    """A frame's fate can be known after aioquic discarded its finished stream: a probe
    sent the last frame again and that copy is acknowledged (or declared lost) late. The
    stream must not go back into the send queue: aioquic would discard it a second time
    (``_streams.pop`` raising KeyError out of ``datagrams_to_send``, the connection lost,
    as a CI run saw on a consumer) and grant the peer its stream credit twice."""
    acked = importlib.import_module("aioquic.quic.packet_builder").QuicDeliveryState
    pair = Pair(tmp_path)
    sids = pair.open_requests(4)
    sid = sids[1]
    streams = {"client": pair.client._streams[sid], "server": pair.server._streams[sid]}
    pair.client.send_stream_data(sid, b"bye", end_stream=True)
    pair.server.send_stream_data(sid, b"ok", end_stream=True)
    pair.until(lambda: sid in pair.fins["server"] and sid in pair.fins["client"])
    pair.until(lambda: sid not in pair.client._streams and sid not in pair.server._streams)
    credit = pair.server._local_max_streams_bidi.value
    for side, conn in (("client", pair.client), ("server", pair.server)):
        sender = streams[side].sender
        assert sender.is_finished
        end = sender._buffer_fin
        sender.on_data_delivery(acked.ACKED, end - 2, end, True)  # a copy acknowledged
        sender.on_data_delivery(acked.LOST, end - 2, end, True)  # another copy lost
        assert streams[side] not in conn._streams_queue
    pair.run(40)  # on the old code: KeyError(sid) from datagrams_to_send
    assert pair.server._local_max_streams_bidi.value == credit
    for conn in (pair.client, pair.server):
        assert sid not in conn._streams
    # both connections go on: the other requests still carry data both ways
    other = sids[2]
    pair.client.send_stream_data(other, b"still here", end_stream=True)
    pair.until(lambda: other in pair.fins["server"])
    assert bytes(pair.data["server"][other]).endswith(b"still here")


def test_an_unknown_layout_keeps_the_plain_class() -> None:
    class Elsewhere:
        def _write_application(self) -> None:
            for stream in self.streams:  # type: ignore[attr-defined]
                del stream

    assert not aioquic_streams.layout_known(Elsewhere)
    assert not aioquic_streams.layout_known(object)


def _refills(pair: Pair) -> list[tuple[int, int]]:
    """Streams that run dry and are written again, in a rotating pattern, after quiet
    requests: the order in which the server receives their frames."""
    sids = pair.open_requests(20)
    unis = []
    for _ in range(4):
        uni = pair.client.get_next_available_stream_id(is_unidirectional=True)
        pair.client.send_stream_data(uni, b"")
        unis.append(uni)
    pair.run(5)
    pair.events["server"].clear()
    streams = unis + sids[::4]
    for step in range(60):
        for k, sid in enumerate(streams):
            if (step + k) % 3:
                pair.client.send_stream_data(sid, _payload(sid + step, 1500 + 700 * k))
        pair.run(1)
    pair.run(100)
    return [
        (e.stream_id, len(e.data))
        for e in pair.events["server"]
        if type(e).__name__ == "StreamDataReceived"
    ]


def test_streams_are_served_in_aioquic_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aioquic moves the streams that sent in a packet to the end of its queue in the order
    # of a set of them, which hashes by address; by stream ID, both runs are deterministic
    stream_cls = importlib.import_module("aioquic.quic.stream").QuicStream
    monkeypatch.setattr(stream_cls, "__hash__", lambda self: hash(self.stream_id))
    quiet = _refills(Pair(tmp_path))
    monkeypatch.setattr(aioquic_streams, "layout_known", lambda cls: False)
    plain = _refills(Pair(tmp_path, connection=_aioquic().connection))
    assert len(quiet) > 500
    assert quiet == plain
