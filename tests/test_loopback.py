"""The loopback network (transports/loopback) against two tiny fake machines.

``Peer`` is a scriptable machine: its local commands (``open``, ``write``,
``reset``, ``stop``, ``datagram``, ``close``, ``set_timer``) queue transport
commands; it records every transport event with the time it came, reports each
as an ``Rx`` event (and timer firings as ``Fired``), and can echo what it reads
on streams its peer opened. ``Sender`` serves queued stream data only through
``poll_data``, most urgent stream first, in chunks of its choice.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import pytest

from kvcs.transports.loopback import (
    Chunking,
    Livelock,
    LoopbackError,
    LoopbackTimeout,
    Network,
    Sent,
)
from kvcs_core.moqt.transport_io import (
    AbortKind,
    AbortStream,
    CloseTransport,
    DatagramReceived,
    OpenStream,
    SendDatagram,
    StreamAborted,
    StreamData,
    StreamOpened,
    StreamRef,
    TransportClosed,
    TransportCommand,
    TransportEvent,
    WriteStream,
)

MiB = 1 << 20


def L(n: int) -> StreamRef:
    """A ref the machine itself allocated (a stream it opened)."""
    return StreamRef(True, n)


def P(n: int) -> StreamRef:
    """A ref the link allocated for a stream the peer opened."""
    return StreamRef(False, n)


@attrs.frozen
class Rx:
    time: float
    event: TransportEvent


@attrs.frozen
class Fired:
    time: float


class Peer:
    """A scriptable machine (see the module docstring)."""

    def __init__(self, name: str, *, echo: bool = False, bounce: bool = False) -> None:
        self.name = name
        self.echo = echo  # echo bytes+FIN read on peer-opened bidi streams
        self.bounce = bounce  # send every byte read straight back (never ends)
        self.got: list[tuple[float, TransportEvent]] = []
        self.fired: list[float] = []
        self.period: float | None = None
        self._cmds: deque[TransportCommand] = deque()
        self._evs: deque[Rx | Fired] = deque()
        self._timer: float | None = None
        self._next = 0
        self._bidi: set[StreamRef] = set()
        self._last_now = 0.0

    def __repr__(self) -> str:
        return f"<Peer {self.name}>"

    # local commands
    def open(self, *, uni: bool = False) -> StreamRef:
        ref = L(self._next)
        self._next += 1
        self._cmds.append(OpenStream(stream=ref, uni=uni))
        return ref

    def write(self, ref: StreamRef, data: bytes, *, fin: bool = False) -> None:
        self._cmds.append(WriteStream(stream=ref, chunks=(memoryview(data),), fin=fin))

    def reset(self, ref: StreamRef, code: int) -> None:
        self._cmds.append(AbortStream(stream=ref, kind=AbortKind.RESET, code=code))

    def stop(self, ref: StreamRef, code: int) -> None:
        self._cmds.append(AbortStream(stream=ref, kind=AbortKind.STOP_SENDING, code=code))

    def datagram(self, data: bytes) -> None:
        self._cmds.append(SendDatagram(chunks=(data[:1], memoryview(data)[1:])))

    def close(self, code: int, reason: str = "") -> None:
        self._cmds.append(CloseTransport(code=code, reason=reason))

    def set_timer(self, at: float | None, *, period: float | None = None) -> None:
        self._timer = at
        self.period = period

    # inputs
    def _check(self, now: float) -> None:
        assert now >= self._last_now, "time went backwards"
        self._last_now = now

    def handle_transport_event(self, ev: TransportEvent, now: float) -> None:
        self._check(now)
        self.got.append((now, ev))
        self._evs.append(Rx(now, ev))
        if isinstance(ev, StreamOpened) and not ev.uni:
            self._bidi.add(ev.stream)
        if isinstance(ev, StreamData):
            if self.bounce and ev.data:
                self.write(ev.stream, bytes(ev.data))
            elif self.echo and ev.stream in self._bidi:
                self.write(ev.stream, bytes(ev.data), fin=ev.fin)

    def handle_timer(self, now: float) -> None:
        self._check(now)
        if self._timer is not None and now >= self._timer:
            self.fired.append(now)
            self._evs.append(Fired(now))
            self._timer = None if self.period is None else now + self.period

    # outputs
    def next_command(self) -> TransportCommand | None:
        return self._cmds.popleft() if self._cmds else None

    def get_timer(self) -> float | None:
        return self._timer

    def next_event(self) -> Rx | Fired | None:
        return self._evs.popleft() if self._evs else None

    def poll_data(self, max_bytes: int) -> WriteStream | SendDatagram | None:
        return None

    # test helpers
    def received(self, ref: StreamRef) -> bytes:
        return b"".join(
            bytes(ev.data) for _, ev in self.got if isinstance(ev, StreamData) and ev.stream == ref
        )

    def fins(self) -> set[StreamRef]:
        return {ev.stream for _, ev in self.got if isinstance(ev, StreamData) and ev.fin}


class Sender(Peer):
    """Serves data only through ``poll_data``: lowest priority number first, ``chunk`` a time."""

    def __init__(self, name: str, streams: list[tuple[int, int]], *, chunk: int = 4096) -> None:
        super().__init__(name)
        self.chunk = chunk
        self.polls: list[int] = []
        # [priority, ref, payload, offset]
        self._queue: list[list[Any]] = []
        for i, (prio, size) in enumerate(streams):
            ref = self.open(uni=True)
            payload = bytes((i * 31 + j) % 251 for j in range(size))
            self._queue.append([prio, ref, payload, 0])

    def payload(self, ref: StreamRef) -> bytes:
        return next(q[2] for q in self._queue if q[1] == ref)

    def poll_data(self, max_bytes: int) -> WriteStream | SendDatagram | None:
        self.polls.append(max_bytes)
        live = [q for q in self._queue if q[3] < len(q[2])]
        if not live:
            return None
        q = min(live, key=lambda q: q[0])
        n = min(self.chunk, max_bytes, len(q[2]) - q[3])
        view = memoryview(q[2])[q[3] : q[3] + n]
        q[3] += n
        return WriteStream(stream=q[1], chunks=(view[:1], view[1:]), fin=q[3] == len(q[2]))


def norm(events: list[tuple[float, TransportEvent]]) -> list[tuple[Any, ...]]:
    """Events as comparable tuples (StreamData's bytes are not part of its equality)."""
    out: list[tuple[Any, ...]] = []
    for t, ev in events:
        if isinstance(ev, StreamData):
            out.append((t, "data", ev.stream, bytes(ev.data), ev.fin))
        elif isinstance(ev, DatagramReceived):
            out.append((t, "dgram", bytes(ev.data)))
        else:
            out.append((t, ev))
    return out


def pair(**kw: Any) -> tuple[Network, Peer, Peer, Any]:
    net = Network()
    a, b = Peer("a"), Peer("b", echo=kw.pop("echo", False))
    return net, a, b, net.connect(a, b, **kw)


# --- streams ---------------------------------------------------------------------------


def test_uni_stream_open_data_fin_in_order_with_ref_mapping() -> None:
    net, a, b, link = pair()
    r0, r1 = a.open(uni=True), a.open(uni=True)
    a.write(r0, b"hello")
    a.write(r0, b" world", fin=True)
    a.write(r1, b"!", fin=True)
    net.run_until_idle()
    assert norm(b.got) == [
        (0.0, StreamOpened(stream=P(0), uni=True)),
        (0.0, StreamOpened(stream=P(1), uni=True)),
        (0.0, "data", P(0), b"hello", False),
        (0.0, "data", P(0), b" world", True),
        (0.0, "data", P(1), b"!", True),
    ]
    assert link.client.peer_ref(r1) == P(1) and link.server.peer_ref(P(1)) == r1
    # b's own uni stream gets a ref from a's counter, independent of b's
    rb = b.open(uni=True)
    b.write(rb, b"back", fin=True)
    net.run_until_idle()
    assert norm(a.got) == [
        (0.0, StreamOpened(stream=P(0), uni=True)),
        (0.0, "data", P(0), b"back", True),
    ]
    # the machine's events went to the per-machine log, in order
    assert [e.event for e in net.events(a)] == [ev for _, ev in a.got]


def test_bidi_streams_map_both_ways() -> None:
    net, a, b, _ = pair()
    ra, rb = a.open(), b.open()  # both L0; each appears as P0 on the other side
    a.write(ra, b"from a on a's stream")
    b.write(rb, b"from b on b's stream")
    net.run_until_idle()
    a.write(P(0), b"a answers on b's stream", fin=True)
    b.write(P(0), b"b answers on a's stream", fin=True)
    net.run_until_idle()
    assert a.received(L(0)) == b"b answers on a's stream"
    assert a.received(P(0)) == b"from b on b's stream"
    assert b.received(L(0)) == b"a answers on b's stream"
    assert b.received(P(0)) == b"from a on a's stream"
    assert a.fins() == {L(0)} and b.fins() == {L(0)}


def test_echo_over_bidi_and_latency() -> None:
    net, a, b, _ = pair(echo=True, latency=0.05)
    r = a.open()
    a.write(r, b"hello", fin=True)
    net.run_until(lambda: L(0) in a.fins())
    assert net.now == pytest.approx(0.1)
    assert [t for t, _ in b.got] == [pytest.approx(0.05)] * 2
    assert norm(a.got) == [(pytest.approx(0.1), "data", L(0), b"hello", True)]


def test_reset_and_stop_sending() -> None:
    net, a, b, link = pair()
    u = a.open(uni=True)
    a.write(u, b"abc")
    a.reset(u, 7)
    bi = a.open()
    a.write(bi, b"x")
    net.run_until_idle()
    assert norm(b.got)[-4:] == [
        (0.0, "data", P(0), b"abc", False),
        (0.0, StreamAborted(stream=P(0), kind=AbortKind.RESET, code=7)),
        (0.0, StreamOpened(stream=P(1), uni=False)),
        (0.0, "data", P(1), b"x", False),
    ]
    a.reset(u, 8)  # a second RESET is ignored
    b.stop(P(1), 9)
    b.write(P(1), b"b still sends", fin=True)  # stopping one half leaves the other
    net.run_until_idle()
    assert norm(a.got) == [
        (0.0, StreamAborted(stream=bi, kind=AbortKind.STOP_SENDING, code=9)),
        (0.0, "data", bi, b"b still sends", True),
    ]
    n = len(b.got)
    a.write(bi, b"more")  # legal, but b asked to stop: discarded on arrival
    a.reset(bi, 10)
    net.run_until_idle()
    assert norm(b.got[n:]) == [(0.0, StreamAborted(stream=P(1), kind=AbortKind.RESET, code=10))]
    assert link.server.bytes_dropped == 4


def test_stop_sending_in_flight_data_is_discarded() -> None:
    net, a, b, link = pair(latency=1.0)
    r = a.open()
    net.run_for(1.0)
    a.write(r, b"12345")
    net.run_for(0.5)
    b.stop(P(0), 3)  # the bytes are still on the wire
    net.run_until_idle()
    assert b.received(P(0)) == b""
    assert link.server.bytes_dropped == 5
    assert a.got == [(2.5, StreamAborted(stream=r, kind=AbortKind.STOP_SENDING, code=3))]


def _peer_uni(net: Network, b: Peer) -> None:
    b.open(uni=True)
    net.poke(b)


@pytest.mark.parametrize(
    ("script", "message"),
    [
        (lambda n, a, b: (a.write(a.open(uni=True), b"x", fin=True), a.write(L(0), b"y")), "FIN"),
        (lambda n, a, b: (a.write(a.open(), b"x"), a.reset(L(0), 1), a.write(L(0), b"")), "RESET"),
        (lambda n, a, b: a.write(L(5), b"x"), "unknown stream"),
        (lambda n, a, b: (_peer_uni(n, b), a.write(P(0), b"x")), "receive-only"),
        (lambda n, a, b: (_peer_uni(n, b), a.reset(P(0), 1)), "cannot send"),
        (lambda n, a, b: (a.open(uni=True), a.stop(L(0), 1)), "does not receive"),
        (lambda n, a, b: (a.open(), a._cmds.append(OpenStream(stream=L(0), uni=False))), "twice"),
        (lambda n, a, b: a._cmds.append(OpenStream(stream=P(0), uni=True)), "peer-side ref"),
    ],
)
def test_machine_bugs_raise_loopback_error(script: Any, message: str) -> None:
    net, a, b, _ = pair()
    net.run_until_idle()
    with pytest.raises(LoopbackError, match=message):
        script(net, a, b)
        net.run_until_idle()


def test_poll_data_over_budget_raises() -> None:
    class Greedy(Sender):
        def poll_data(self, max_bytes: int) -> WriteStream | SendDatagram | None:
            return WriteStream(stream=L(0), chunks=(b"x" * (max_bytes + 1),))

    net = Network()
    net.connect(Greedy("g", [(0, 1)]), Peer("b"), bandwidth=1e6, quantum=100)
    with pytest.raises(LoopbackError, match=r"poll_data\(100\) returned 101 bytes"):
        net.run_until_idle()


# --- datagrams, close, cut ---------------------------------------------------------------


def test_datagrams_and_seeded_loss() -> None:
    net, a, b, _ = pair(latency=0.01)
    a.datagram(b"dgram")
    net.run_until_idle()
    assert norm(b.got) == [(0.01, "dgram", b"dgram")]

    def survivors(seed: int) -> list[int]:
        net = Network(seed)
        a, b = Peer("a"), Peer("b")
        net.connect(a, b, datagram_loss=0.5)
        for i in range(200):
            a.datagram(bytes([i, i]))
        net.run_until_idle()
        return [bytes(ev.data)[0] for _, ev in b.got]

    s1 = survivors(1)
    assert s1 == survivors(1) != survivors(2)
    assert 50 < len(s1) < 150


def test_close_reaches_both_sides_then_link_carries_nothing() -> None:
    net, a, b, link = pair(latency=0.25)
    r = a.open(uni=True)
    a.write(r, b"last words")
    a.close(0x10, "bye")
    a.write(r, b"after close")  # same drain, after the close: ignored
    net.run_until(lambda: bool(a.got))
    assert a.got == [(0.0, TransportClosed(code=0x10, reason="bye", by_peer=False))]
    b.write(b.open(uni=True), b"too late")  # b does not know yet; ignored all the same
    net.run_until_idle()
    assert norm(b.got) == [
        (0.25, StreamOpened(stream=P(0), uni=True)),
        (0.25, "data", P(0), b"last words", False),
        (0.25, TransportClosed(code=0x10, reason="bye", by_peer=True)),
    ]
    assert len(a.got) == 1
    assert link.closed and link.dropped_commands == 3
    assert link.close_info == TransportClosed(code=0x10, reason="bye", by_peer=False)


def test_cut_mid_transfer() -> None:
    net = Network()
    s, b = Sender("s", [(0, MiB)]), Peer("b")
    link = net.connect(s, b, bandwidth=1e6, latency=0.01)
    net.run_until(lambda: net.now >= 0.5)
    polls = len(s.polls)
    link.cut()
    net.run_until_idle()
    cut = TransportClosed(code=1, reason="link cut", by_peer=True)
    assert s.got == [(pytest.approx(0.5, abs=0.01), cut)]
    assert b.got[-1] == (s.got[0][0], cut)
    assert len(s.polls) == polls  # nothing pulled after the cut
    assert 400_000 < link.server.bytes_received < 520_000
    link.cut(2, "again")  # no-op
    net.run_until_idle()
    assert len(s.got) == 1


# --- bandwidth, pull and priorities -------------------------------------------------------


def test_bandwidth_paces_pulled_data_in_the_senders_order() -> None:
    net = Network()
    s, b = Sender("s", [(5, MiB // 2), (1, MiB // 2)]), Peer("b")
    link = net.connect(s, b, bandwidth=1e6)
    net.run_until(lambda: len(b.fins()) == 2)
    assert net.now == pytest.approx(MiB / 1e6)  # ~1 s for 1 MiB at 1 MB/s
    assert b.received(P(0)) == s.payload(L(0)) and b.received(P(1)) == s.payload(L(1))
    log = link.client.sent_log
    assert log == link.sent_log
    assert all(isinstance(r, Sent) and r.pulled and r.sender == "link0.client" for r in log)
    # the urgent stream (priority 1, opened second) left entirely before the other
    streams = [r.stream for r in log]
    first_l0 = streams.index(L(0))
    assert set(streams[:first_l0]) == {L(1)} and set(streams[first_l0:]) == {L(0)}
    # each record left when the previous bytes had been serialized
    sent = 0
    for rec in log:
        assert rec.time == pytest.approx(sent / 1e6)
        sent += rec.nbytes
    assert link.client.bytes_sent == link.server.bytes_received == MiB
    assert max(s.polls) == 1200  # default quantum: ~1 ms of the link, at least 1200 bytes


def test_unlimited_bandwidth_sends_a_mebibyte_per_step() -> None:
    net = Network()
    s, b = Sender("s", [(0, 3 * MiB)], chunk=64 * 1024), Peer("b")
    net.connect(s, b, latency=0.002)
    net.run_until(lambda: bool(b.fins()))
    assert net.now == pytest.approx(0.002)
    assert max(s.polls) == MiB
    assert b.received(P(0)) == s.payload(L(0))


def test_set_latency_and_bandwidth_keep_each_stream_in_order() -> None:
    net, a, b, link = pair(latency=1.0)
    r = a.open(uni=True)
    a.write(r, b"slow ")
    net.poke(a)
    link.set_latency(0.0)
    a.write(r, b"fast", fin=True)
    net.run_until_idle()
    assert norm(b.got) == [
        (1.0, StreamOpened(stream=P(0), uni=True)),
        (1.0, "data", P(0), b"slow ", False),
        (1.0, "data", P(0), b"fast", True),
    ]
    net2 = Network()
    s = Sender("s", [(0, 200_000)])
    link2 = net2.connect(s, Peer("b"), bandwidth=1e6)
    net2.run_until(lambda: net2.now >= 0.1)
    t0, sent = net2.now, link2.client.bytes_sent  # the slot at t0 went out at 1 MB/s
    link2.set_bandwidth(1e5)
    net2.run_until_idle()
    assert net2.now == pytest.approx(t0 + 1200 / 1e6 + (200_000 - sent) / 1e5)


def test_control_commands_are_free_and_poke_applies_them_at_once() -> None:
    net, a, _, link = pair(bandwidth=10.0)  # 10 B/s would take ages for pulled data
    r = a.open(uni=True)
    a.write(r, b"x" * 10_000, fin=True)
    net.poke(a)
    assert link.client.bytes_sent == 10_000
    assert link.client.sent_log == [Sent(0.0, r, 10_000, False, "link0.client")]
    net.run_until_idle()
    assert net.now == 0.0 and link.server.bytes_received == 10_000


# --- chunking -------------------------------------------------------------------------------


def _chunked_run(chunking: Chunking, *, seed: int = 0, coalesce: bool = False) -> list[Any]:
    net = Network(seed)
    a, b = Peer("a"), Peer("b")
    net.connect(a, b, chunking=chunking, coalesce=coalesce)
    r = a.open(uni=True)
    for i in range(5):
        a.write(r, bytes(range(i * 50, i * 50 + 50)), fin=i == 4)
    net.run_until_idle()
    assert b.received(P(0)) == bytes(range(250))
    data = [ev for _, ev in b.got if isinstance(ev, StreamData)]
    assert [ev.fin for ev in data].count(True) == 1 and data[-1].fin
    return [len(ev.data) for ev in data]


def test_chunking_policies_deliver_the_same_bytes() -> None:
    assert _chunked_run(Chunking.WHOLE) == [50] * 5
    assert _chunked_run(Chunking.BYTEWISE) == [1] * 250
    assert _chunked_run(Chunking.WHOLE, coalesce=True) == [250]
    r1 = _chunked_run(Chunking.random(1, max_size=16))
    assert r1 == _chunked_run(Chunking.random(1, max_size=16))  # reproducible per seed
    assert r1 != _chunked_run(Chunking.random(2, max_size=16))
    assert max(r1) <= 16 and len(r1) > 15
    # without its own seed, random chunking follows the network seed
    assert _chunked_run(Chunking.random(), seed=3) == _chunked_run(Chunking.random(), seed=3)
    assert _chunked_run(Chunking.random(), seed=3) != _chunked_run(Chunking.random(), seed=4)
    # coalescing lets random pieces span write boundaries
    spans = _chunked_run(Chunking.random(5, max_size=120), coalesce=True)
    assert sum(spans) == 250 and any(s > 50 for s in spans)


def test_bytewise_chunking_of_pulled_data() -> None:
    net = Network()
    s, b = Sender("s", [(0, 3000)]), Peer("b")
    net.connect(s, b, chunking=Chunking.BYTEWISE)
    net.run_until_idle()
    assert b.received(P(0)) == s.payload(L(0))
    assert sum(isinstance(ev, StreamData) for _, ev in b.got) == 3000


# --- timers, driving, livelock ---------------------------------------------------------------


def test_timers_fire_at_their_virtual_time() -> None:
    net, a, b, _ = pair()
    a.set_timer(2.5)
    b.set_timer(1.0, period=1.0)
    net.run_until(lambda: bool(a.fired))
    assert a.fired == [2.5] and b.fired == [1.0, 2.0] and net.now == 2.5
    net.run_for(1.25)
    assert b.fired == [1.0, 2.0, 3.0] and net.now == 3.75
    assert net.events(a) == [Fired(2.5)]
    net.run_until_idle(max_time=10.0)  # b's timer never stops: runs to the horizon
    assert b.fired[-1] == 13.0 and net.now == 13.0


def test_step_walks_one_instant_at_a_time() -> None:
    net, a, b, _ = pair(latency=0.5, echo=True)
    a.write(a.open(), b"x", fin=True)
    a.set_timer(0.75)
    times = []
    while net.step():
        times.append(net.now)
    assert times == [0.5, 0.75, 1.0]
    assert net.idle and net.next_time() is None
    assert [t for t, _ in b.got] == [0.5, 0.5] and a.got[0][0] == 1.0 and a.fired == [0.75]


def test_run_until_stuck_raises_livelock() -> None:
    net, a, _, _ = pair()
    a.write(a.open(uni=True), b"x")
    with pytest.raises(Livelock, match="stuck"):
        net.run_until(lambda: bool(a.got))
    assert net.idle


def test_zero_latency_ping_pong_is_a_livelock_without_moving_the_clock() -> None:
    net = Network()
    a, b = Peer("a", bounce=True), Peer("b", bounce=True)
    net.connect(a, b)
    r = a.open()
    a.write(r, b"ping")
    with pytest.raises(Livelock, match="did not move"):
        net.run_until(lambda: False, max_steps=500)
    assert net.now == 0.0 and 400 < len(a.got) + len(b.got) <= 501


def test_run_until_timeout() -> None:
    net, a, _, _ = pair()
    a.set_timer(1.0, period=1.0)
    with pytest.raises(LoopbackTimeout):
        net.run_until(lambda: False, max_time=10.0)
    assert net.now == 10.0 and len(a.fired) == 10


def test_on_event_callback_may_command_machines() -> None:
    net, a, b, _ = pair(latency=0.1)
    seen: list[tuple[str, float]] = []

    def react(machine: Any, ev: Any) -> None:
        seen.append((machine.name, ev.time))
        if machine is b and isinstance(ev.event, StreamOpened):
            b.write(b.open(uni=True), b"welcome", fin=True)

    net.on_event(react)
    a.open(uni=True)
    net.run_until(lambda: bool(a.fins()))
    assert a.received(P(0)) == b"welcome" and net.now == pytest.approx(0.2)
    assert seen == [("b", 0.1), ("a", pytest.approx(0.2)), ("a", pytest.approx(0.2))]


class Counting(Peer):
    """A Peer that counts how often the network asked for its timer (drained it)."""

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.drains = 0

    def get_timer(self) -> float | None:
        self.drains += 1
        return super().get_timer()


def _two_links(scoped: bool) -> tuple[Network, list[Counting]]:
    """a -> b on one link; b's callback makes d (on a second link) write to c."""
    net = Network(trace=True)
    a, b, c, d = (Counting(n) for n in "abcd")
    net.connect(a, b, latency=0.1)
    net.connect(c, d, latency=0.1)

    def react(machine: Any, ev: Any) -> list[Counting] | None:
        if machine is b and isinstance(ev.event, StreamOpened):
            d.write(d.open(uni=True), b"relayed", fin=True)
            return [d]
        return []

    net.on_event(react, scoped=scoped)
    a.write(a.open(uni=True), b"hello", fin=True)
    net.run_until(lambda: bool(c.fins()))
    return net, [a, b, c, d]


def test_scoped_callback_drains_only_the_machines_it_names() -> None:
    plain, before = _two_links(scoped=False)
    scoped, after = _two_links(scoped=True)
    assert scoped.trace == plain.trace and scoped.now == plain.now == pytest.approx(0.2)
    assert after[2].received(P(0)) == b"relayed"
    # a, untouched by any callback and given no input after its write, is drained less
    assert after[0].drains < before[0].drains


def test_a_callback_may_touch_a_machine_drained_earlier_in_the_same_pass() -> None:
    """A machine drained before the callback ran is drained again (it may have output)."""
    net = Network()
    a, b = Peer("a"), Peer("b")
    net.connect(a, b)  # link order: a, then b

    def react(machine: Any, ev: Any) -> list[Peer]:
        if machine is b and ev.event == StreamOpened(stream=P(0), uni=True):
            a.write(a.open(uni=True), b"more", fin=True)
            return [a]
        return []

    net.on_event(react, scoped=True)
    a.write(a.open(uni=True), b"first", fin=True)
    net.run_until(lambda: len(b.fins()) == 2)
    assert (b.received(P(0)), b.received(P(1))) == (b"first", b"more")


# --- injection, one link per machine, determinism ------------------------------------------------


def test_inject_streams_and_datagrams_as_if_from_the_peer() -> None:
    net, a, b, link = pair(echo=True)
    ref = link.inject_stream(b, uni=False, data=b"\xff\xfe garbage", fin=True)
    link.inject_datagram(link.server, b"\x00bad")
    net.run_until_idle()
    assert ref == P(0)
    assert norm(b.got) == [
        (0.0, StreamOpened(stream=P(0), uni=False)),
        (0.0, "data", P(0), b"\xff\xfe garbage", True),
        (0.0, "dgram", b"\x00bad"),
    ]
    assert a.got == []  # b's echo on the injected stream went nowhere
    # garbage into a real stream, after what is already in flight
    r = a.open(uni=True)
    a.write(r, b"real")
    net.poke(a)
    link.inject_data(b, P(1), b"junk", fin=True)
    net.run_until_idle()
    assert b.received(P(1)) == b"realjunk"
    link.inject_event(b, TransportClosed(code=3, reason="injected"), delay=1.0)
    net.run_until_idle()
    assert b.got[-1] == (1.0, TransportClosed(code=3, reason="injected"))


def test_a_machine_sits_on_one_link() -> None:
    net, a, _, _ = pair()
    with pytest.raises(LoopbackError, match="one link per machine"):
        net.connect(a, Peer("c"))
    d = Peer("d")
    with pytest.raises(LoopbackError, match="two different"):
        net.connect(d, d)


def _scenario(seed: int) -> list[Any]:
    net = Network(seed, trace=True)
    a = Sender("a", [(1, 20_000), (0, 30_000)], chunk=1000)
    b = Peer("b", echo=True)
    c, d = Peer("c"), Peer("d", echo=True)
    net.connect(a, b, latency=0.01, bandwidth=2e6, chunking=Chunking.random(max_size=900))
    link = net.connect(c, d, latency=0.003, chunking=Chunking.random(), datagram_loss=0.3)
    for i in range(20):
        c.datagram(bytes([i]) * 3)
    r = c.open()
    c.write(r, bytes(range(256)) * 4, fin=True)
    net.run_until(lambda: len(b.fins()) == 2 and bool(c.fins()))
    link.cut()
    net.run_until_idle()
    assert net.trace is not None
    return [(t, who, norm([(t, ev)])) for t, who, ev in net.trace]


def test_identical_inputs_and_seeds_give_identical_logs() -> None:
    one = _scenario(7)
    assert one == _scenario(7)
    assert one != _scenario(8)


# --- zero copy, bytes in flight ---------------------------------------------------------------


def _write_chunks(a: Peer, ref: StreamRef, *chunks: bytes | memoryview, fin: bool = False) -> None:
    a._cmds.append(WriteStream(stream=ref, chunks=chunks, fin=fin))


def test_default_link_copies_writes_so_writers_may_reuse_buffers() -> None:
    net, a, b, _ = pair()
    r = a.open(uni=True)
    buf = bytearray(b"payload")
    _write_chunks(a, r, b"hd", memoryview(buf), fin=True)
    net.poke(a)
    buf[:] = b"changed"  # allowed on a copying link
    net.run_until_idle()
    data = [ev.data for _, ev in b.got if isinstance(ev, StreamData)]
    assert len(data) == 1 and type(data[0]) is bytes and data[0] == b"hdpayload"


def test_zero_copy_hands_the_writers_buffers_to_the_receiver() -> None:
    net, a, b, link = pair(zero_copy=True)
    assert link.zero_copy
    r = a.open(uni=True)
    header, payload = b"hd", bytearray(b"payload")
    _write_chunks(a, r, header, b"", memoryview(payload), fin=True)
    net.run_until_idle()
    got = [ev for _, ev in b.got if isinstance(ev, StreamData)]
    # Chunking.WHOLE: one event per non-empty chunk, nothing joined, FIN on the last
    assert [(bytes(ev.data), ev.fin) for ev in got] == [(b"hd", False), (b"payload", True)]
    assert got[0].data is header
    assert isinstance(got[1].data, memoryview) and got[1].data.obj is payload
    payload[:] = b"mutated"  # the contract a writer on such a link must keep, shown broken
    assert bytes(got[1].data) == b"mutated"
    assert link.client.bytes_sent == link.server.bytes_received == 9


def test_zero_copy_flattens_typed_views_without_copying() -> None:
    net, a, b, _ = pair(zero_copy=True)
    r = a.open(uni=True)
    words = memoryview(bytearray(8)).cast("I")  # 2 items, 8 bytes
    _write_chunks(a, r, words, fin=True)
    net.run_until_idle()
    (ev,) = [ev for _, ev in b.got if isinstance(ev, StreamData)]
    assert isinstance(ev.data, memoryview) and ev.data.format == "B" and ev.data.nbytes == 8
    assert ev.data.obj is words.obj


@pytest.mark.parametrize(
    "chunking", [Chunking.BYTEWISE, Chunking.random(3, max_size=7), Chunking.random(4, 40)]
)
@pytest.mark.parametrize("coalesce", [False, True])
def test_zero_copy_cuts_the_same_pieces_as_a_copying_link(
    chunking: Chunking, coalesce: bool
) -> None:
    def run(zero_copy: bool) -> tuple[list[bytes | memoryview], int]:
        net = Network(5)
        a, b = Peer("a"), Peer("b")
        net.connect(a, b, chunking=chunking, coalesce=coalesce, zero_copy=zero_copy)
        r = a.open(uni=True)
        for i in range(4):
            _write_chunks(a, r, bytes([i]) * 3, memoryview(bytes(range(i * 20, i * 20 + 20))))
        _write_chunks(a, r, fin=True)
        net.run_until_idle()
        data = [ev for _, ev in b.got if isinstance(ev, StreamData)]
        assert [ev.fin for ev in data].count(True) == 1 and data[-1].fin
        return [ev.data for ev in data], sum(isinstance(ev.data, memoryview) for ev in data)

    copied, views_in_copy = run(False)
    passed, views = run(True)
    assert [bytes(d) for d in passed] == [bytes(d) for d in copied]  # same cuts, same bytes
    assert views_in_copy == 0
    # pieces inside one chunk of a memoryview are views; only spanning pieces are joined
    assert views > 0


def test_zero_copy_pulled_data_and_datagrams() -> None:
    net = Network()
    s, b = Sender("s", [(0, 10_000)], chunk=1000), Peer("b")
    link = net.connect(s, b, zero_copy=True, latency=0.001)
    s.datagram(b"dgram")  # two chunks: joined
    one = bytearray(b"one chunk")
    s._cmds.append(SendDatagram(chunks=(memoryview(one),)))  # one chunk: passed on
    net.run_until(lambda: bool(b.fins()))
    assert b.received(P(0)) == s.payload(L(0))
    data = [ev.data for _, ev in b.got if isinstance(ev, StreamData)]
    assert len(data) == 20  # Sender writes (view[:1], view[1:]): two events per write
    assert all(isinstance(d, memoryview) and d.obj is s.payload(L(0)) for d in data)
    dgrams = [ev.data for _, ev in b.got if isinstance(ev, DatagramReceived)]
    assert [bytes(d) for d in dgrams] == [b"dgram", b"one chunk"]
    assert type(dgrams[0]) is bytes and isinstance(dgrams[1], memoryview)
    assert dgrams[1].obj is one
    assert link.server.bytes_received == 10_000 + 5 + 9


def test_zero_copy_counts_dropped_bytes_like_a_copying_link() -> None:
    for zero_copy in (False, True):
        net, a, b, link = pair(latency=1.0, zero_copy=zero_copy)
        r = a.open()
        net.run_for(1.0)
        _write_chunks(a, r, b"12", memoryview(b"345"))
        net.run_for(0.5)
        b.stop(P(0), 3)  # the bytes are still on the wire
        net.run_until_idle()
        assert b.received(P(0)) == b"" and link.server.bytes_dropped == 5


def test_in_flight_chunks_are_what_was_sent_and_not_yet_delivered() -> None:
    for zero_copy in (False, True):
        net = Network()
        s, b = Sender("s", [(0, MiB)], chunk=10_000), Peer("b")
        link = net.connect(s, b, bandwidth=1e7, latency=0.01, zero_copy=zero_copy)
        peak = 0
        while not b.fins():
            net.step()
            chunks = link.in_flight_chunks()
            n = sum(len(c) for c in chunks)
            assert n == link.client.bytes_sent - link.server.bytes_received
            # copies without zero_copy, the sender's own buffer with it
            owner = {type(c) if not isinstance(c, memoryview) else id(c.obj) for c in chunks}
            assert owner <= ({id(s.payload(L(0)))} if zero_copy else {bytes})
            peak = max(peak, n)
        # backpressure: bandwidth x latency plus one quantum of 1 ms, not the whole MiB
        assert 100_000 <= peak <= 100_000 + 10_000 + 10_000
        assert link.in_flight_chunks() == []
    net, a, _, link = pair(latency=1.0)
    a.datagram(b"dgram")
    net.poke(a)
    assert [bytes(c) for c in link.in_flight_chunks()] == [b"dgram"]
