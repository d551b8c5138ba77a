"""Fuzz a server ``MoqtSession`` with arbitrary stream, datagram and timer input.

Invariant: for any bytes on any stream, the session either produces events or
ends with SessionClosed carrying a session error code; any other exception is
a bug.

A server session is started at t=0 and handed a valid client SETUP on the
peer's control stream (stream index 0); its application subscribes to and
fetches a track from the client, and answers every peer request (accepting
most, refusing some) from a small ``TrackStore``. The rest of the input is a
sequence of operations, each one opcode byte ``kind | arg << 3``:

======  ============================================================
kind    operation (``k`` = stream ``arg`` modulo the streams known)
======  ============================================================
0 / 1   the peer opens a new unidirectional / bidirectional stream
2       ``L`` (next byte), then ``L`` bytes on stream ``k``
3       FIN on stream ``k``
4 / 5   RESET_STREAM / STOP_SENDING on stream ``k``, code = next byte
6       a datagram of ``L`` (next byte) bytes
7       time passes (``arg**2 / 100`` s; ``arg`` 31: 60 s) and timers fire
======  ============================================================

Streams the session can receive on are numbered in order of appearance: the
peer's control stream (0), then every bidirectional stream the server opens
(its own requests) and every stream an operation opens. After every input the
outputs are drained in protocol order and object data is pulled
(``poll_data``). Beyond "no exception", the harness checks:

* at most one ``SessionClosed``, the last event, with a ``SessionErrorCode``;
  a close by the session itself goes with ``CloseTransport`` of the same code;
  a closed session emits nothing more and has no timer;
* ``get_timer()`` is never ``<= now`` right after ``handle_timer(now)``;
* the transport commands are ones a QUIC stack accepts (the loopback's
  "machine bugs"): no write or RESET on a stream the session cannot send on,
  nothing after its FIN or RESET, no STOP_SENDING on a stream it does not
  receive, no stream opened twice; ``poll_data`` stays within its budget.

Seed corpus: ``python3 fuzz/fuzz_session.py --make-corpus`` plays real client
sessions against the harness (subscriptions with fills, fetches, updates,
cancels, namespaces, PUBLISH with objects, GOAWAY) and records what each
client sent as operations, in ``fuzz/corpus/session/``.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzzlib import fuzz_main

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
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
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import GroupOrder, ObjectStatus, RequestErrorCode, SessionErrorCode
from kvcs_core.wire.names import FullTrackName, TrackNamespace

SESSION_CODES = frozenset(int(c) for c in SessionErrorCode)
NS = TrackNamespace.of("kvcs-1", b"fuzz")
SERVED = FullTrackName(NS, b"served")
"""The track the server serves to the peer."""
WANTED = FullTrackName(NS, b"wanted")
"""The track the server subscribes to and fetches from the peer."""
CLIENT_SETUP = m.encode_message(
    m.Setup(max_filter_ranges=4, max_request_updates=4, moqt_implementation=b"fuzz")
)
POLL_BUDGET = 1500
MAX_POLLS = 64

OPEN_UNI, OPEN_BIDI, DATA, FIN, RESET, STOP, DATAGRAM, TIME = range(8)


def delay(arg: int) -> float:
    return 60.0 if arg == 31 else arg * arg / 100


def make_store() -> TrackStore:
    store = TrackStore(SERVED)
    for g in range(2):
        for o in range(3):
            store.append(g, o, bytes([g, o]) * (20 + 30 * o))
        store.append(g, 3, status=ObjectStatus.END_OF_GROUP)
    return store


@dataclass
class _StreamState:
    local: bool
    uni: bool
    sent_end: bool = False
    """Our sending half finished (FIN or RESET)."""
    stopped: bool = False
    peer_ended: bool = False
    """The peer's sending half finished: a transport delivers nothing more on it."""

    @property
    def can_send(self) -> bool:
        return not self.uni or self.local

    @property
    def can_receive(self) -> bool:
        return not self.uni or not self.local


@dataclass
class ServerUnderTest:
    """A server session, its application, and the checks made after every input."""

    session: MoqtSession = field(
        default_factory=lambda: MoqtSession(
            SessionConfig(role=Role.SERVER, setup_timeout=5.0, request_timeout=8.0)
        )
    )
    store: TrackStore = field(default_factory=make_store)
    now: float = 0.0
    streams: list[StreamRef] = field(default_factory=list)
    """Streams the session can receive on, by index (the operations' ``k``)."""
    state: dict[StreamRef, _StreamState] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    commands: list[TransportCommand] = field(default_factory=list)
    on_command: Callable[[TransportCommand], None] | None = None
    """Seed generation: where the server's commands go (the real client)."""
    _next_peer_ref: int = 0
    _closed_seen: bool = False
    _asked: bool = False

    # --- set-up ----------------------------------------------------------------------

    def start(self) -> None:
        self.session.start(now=0.0)
        self._drain()
        ctrl = self.open_peer(uni=True)
        self.feed(StreamData(stream=ctrl, data=CLIENT_SETUP))

    def open_peer(self, *, uni: bool) -> StreamRef:
        ref = StreamRef(False, self._next_peer_ref)
        self._next_peer_ref += 1
        self.streams.append(ref)
        self.state[ref] = _StreamState(local=False, uni=uni)
        self.feed(StreamOpened(stream=ref, uni=uni))
        return ref

    # --- inputs ----------------------------------------------------------------------

    def feed(self, event: TransportEvent) -> None:
        self.session.handle_transport_event(event, self.now)
        self._drain()
        self._pull()

    def advance(self, dt: float) -> None:
        self.now += dt
        self._grow()  # the served track grows: live subscriptions get objects
        t = self.session.get_timer()
        if t is not None and t <= self.now:
            self.session.handle_timer(self.now)
            after = self.session.get_timer()
            assert after is None or after > self.now, (
                f"get_timer() = {after} <= now {self.now} right after handle_timer"
            )
        self._drain()
        self._pull()

    def _grow(self) -> None:
        largest = self.store.largest
        g = 2 if largest is None or largest.group < 2 else largest.group + 1
        if g < 12:
            self.store.append(g, 0, b"live" * 10)
            self.store.append(g, 1, status=ObjectStatus.END_OF_GROUP)

    # --- outputs and checks ---------------------------------------------------------------

    def _drain(self) -> None:
        s = self.session
        while (cmd := s.next_command()) is not None:
            self._check_command(cmd, pulled=False)
        t = s.get_timer()
        new: list[Any] = []
        while (e := s.next_event()) is not None:
            new.append(e)
        if self._closed_seen:
            assert not new, f"events after SessionClosed: {new}"
        for e in new:
            assert not self._closed_seen, f"{e!r} after SessionClosed"
            self.events.append(e)
            if isinstance(e, ev.SessionClosed):
                self._closed_seen = True
                self._check_close(e)
        if s.is_closed:
            assert t is None, "a closed session has a timer"
            assert self._closed_seen, "closed without a SessionClosed event"
        else:
            self._application(new)

    def _check_close(self, e: ev.SessionClosed) -> None:
        closes = [c for c in self.commands if isinstance(c, CloseTransport)]
        if e.initiator is ev.Initiator.LOCAL:
            assert int(e.code) in SESSION_CODES, f"closed with unknown code {e.code:#x}: {e}"
            assert [c.code for c in closes] == [e.code], (closes, e)
        else:
            assert not closes, (closes, e)

    def _check_command(self, cmd: TransportCommand, *, pulled: bool) -> None:
        self.commands.append(cmd)
        if self._closed_seen:
            raise AssertionError(f"{cmd!r} after SessionClosed")
        if isinstance(cmd, OpenStream):
            assert cmd.stream.local, f"OpenStream with a peer ref {cmd.stream!r}"
            assert cmd.stream not in self.state, f"OpenStream {cmd.stream!r} twice"
            self.state[cmd.stream] = _StreamState(local=True, uni=cmd.uni)
            if not cmd.uni:
                self.streams.append(cmd.stream)  # the peer may answer on it
        elif isinstance(cmd, WriteStream):
            if cmd.opens:  # a data stream opened by its first pull
                assert pulled, f"WriteStream(opens=True) {cmd.stream!r} from next_command"
                assert cmd.stream.local, f"opens with a peer ref {cmd.stream!r}"
                assert cmd.stream not in self.state, f"stream {cmd.stream!r} opened twice"
                self.state[cmd.stream] = _StreamState(local=True, uni=True)
            st = self.state.get(cmd.stream)
            assert st is not None, f"write on unknown stream {cmd.stream!r}"
            assert st.can_send, f"write on receive-only {cmd.stream!r}"
            assert not st.sent_end, f"write on {cmd.stream!r} after its FIN/RESET"
            if cmd.fin:
                st.sent_end = True
        elif isinstance(cmd, AbortStream):
            st = self.state.get(cmd.stream)
            assert st is not None, f"abort on unknown stream {cmd.stream!r}"
            if cmd.kind is AbortKind.RESET:
                assert st.can_send, f"RESET on receive-only {cmd.stream!r}"
                st.sent_end = True
            else:
                assert st.can_receive, f"STOP_SENDING on send-only {cmd.stream!r}"
                st.stopped = True
        elif isinstance(cmd, CloseTransport):
            pass
        else:
            assert isinstance(cmd, SendDatagram), cmd
        if self.on_command is not None:
            self.on_command(cmd)

    def _pull(self) -> None:
        for _ in range(MAX_POLLS):
            item = self.session.poll_data(POLL_BUDGET)
            if item is None:
                return
            n = item.nbytes if isinstance(item, WriteStream) else sum(len(c) for c in item.chunks)
            assert n <= POLL_BUDGET, f"poll_data({POLL_BUDGET}) gave {n} bytes"
            self._check_command(item, pulled=True)
            self._drain()

    # --- the server's application -------------------------------------------------------

    def _application(self, new: list[Any]) -> None:
        s, now = self.session, self.now
        if not self._asked and any(isinstance(e, ev.SetupCompleted) for e in new):
            self._asked = True
            s.subscribe(
                WANTED,
                now=now,
                location_filter=p.LocationFilter.next_object(),
                fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
            )
            s.fetch(WANTED, now=now, location_filter=p.LocationFilter.absolute_start(0, 0))
        for e in new:
            rid = getattr(e, "request_id", None)
            rec = s.requests.get(rid) if rid is not None else None
            if rec is None or rec.mine or rec.state is not RequestState.PENDING:
                continue
            if rid % 10 == 4:
                s.reject_request(rid, RequestErrorCode.DOES_NOT_EXIST, now=now)
            elif isinstance(e, ev.SubscribeRequested):
                s.accept_subscribe(rid, self.store, now=now)
            elif isinstance(e, ev.FetchRequested):
                s.accept_fetch(rid, self.store, now=now)
            elif isinstance(e, ev.TrackStatusRequested):
                s.accept_track_status(rid, self.store, now=now)
            elif isinstance(e, ev.PublishRequested):
                s.accept_publish(rid, now=now)
            elif isinstance(e, ev.SubscribeNamespaceRequested):
                s.accept_request(rid, now=now)
                s.send_namespace(rid, TrackNamespace.of("x"), now=now)
            elif isinstance(e, ev.PublishNamespaceRequested | ev.SubscribeTracksRequested):
                s.accept_request(rid, now=now)
        self._drain_commands_only()

    def _drain_commands_only(self) -> None:
        # answers the application gave: commands now, events on the next drain
        while (cmd := self.session.next_command()) is not None:
            self._check_command(cmd, pulled=False)

    # --- operations -------------------------------------------------------------------

    def run_ops(self, data: bytes, *, close: bool = True) -> None:
        """Apply the operations in ``data``; then the connection closes (``close``)."""
        i, n = 0, len(data)
        while i < n and not self.session.is_closed:
            op = data[i]
            i += 1
            kind, arg = op & 7, op >> 3
            k = self.streams[arg % len(self.streams)]
            if kind in (OPEN_UNI, OPEN_BIDI):
                if len(self.streams) < 64:
                    self.open_peer(uni=kind == OPEN_UNI)
            elif kind in (DATA, DATAGRAM):
                length = data[i] if i < n else 0
                chunk = data[i + 1 : i + 1 + length]
                i += 1 + length
                if kind == DATAGRAM:
                    self.feed(DatagramReceived(data=chunk))
                elif self._peer_can_send(k):
                    self.feed(StreamData(stream=k, data=chunk))
            elif kind == FIN:
                if self._peer_can_send(k):
                    self.state[k].peer_ended = True
                    self.feed(StreamData(stream=k, data=b"", fin=True))
            elif kind in (RESET, STOP):
                code = data[i] if i < n else 0
                i += 1
                st = self.state[k]
                if kind == RESET and self._peer_can_send(k):
                    st.peer_ended = True
                    self.feed(StreamAborted(stream=k, kind=AbortKind.RESET, code=code))
                elif kind == STOP and st.can_send:
                    self.feed(StreamAborted(stream=k, kind=AbortKind.STOP_SENDING, code=code))
            else:
                self.advance(delay(arg))
        if close and not self.session.is_closed:
            self.feed(TransportClosed(code=0, reason="fuzz input ended", by_peer=True))
            assert self.session.is_closed and self._closed_seen

    def _peer_can_send(self, ref: StreamRef) -> bool:
        """The peer's half of ``ref`` exists and has not ended (else QUIC delivers nothing)."""
        st = self.state[ref]
        return (not st.uni or not st.local) and not st.peer_ended


def check(data: bytes) -> None:
    sut = ServerUnderTest()
    sut.start()
    assert not sut.session.is_closed, "the valid client SETUP closed the session"
    sut.run_ops(data)


# --------------------------------------------------------------------------- seed corpus


class _Recorder:
    """Plays a real client against a ServerUnderTest and records the client's writes as ops."""

    def __init__(self) -> None:
        self.ops = bytearray()
        self.client = MoqtSession(SessionConfig(role=Role.CLIENT))
        self.sut = ServerUnderTest()
        self.client_to_index: dict[StreamRef, int] = {}
        self.server_to_client: dict[StreamRef, StreamRef] = {}
        self._next_client_peer = 0
        self._pending: list[TransportCommand] = []
        self.sut.on_command = self._pending.append
        self.client_store = TrackStore(WANTED)
        self.client_events: list[Any] = []
        self.skipped_setup = False

    # server -> client
    def _deliver_server_output(self) -> None:
        while self._pending:
            cmd = self._pending.pop(0)
            c = self.client
            if isinstance(cmd, OpenStream):
                ref = StreamRef(False, self._next_client_peer)
                self._next_client_peer += 1
                self.server_to_client[cmd.stream] = ref
                if not cmd.uni:
                    self.client_to_index[ref] = self.sut.streams.index(cmd.stream)
                c.handle_transport_event(StreamOpened(stream=ref, uni=cmd.uni), self.sut.now)
            elif isinstance(cmd, WriteStream):
                ref = self.server_to_client.get(cmd.stream, cmd.stream)
                if not cmd.stream.local:  # a peer stream: the client's own ref
                    ref = self._client_ref_of_peer(cmd.stream)
                data = b"".join(bytes(x) for x in cmd.chunks)
                c.handle_transport_event(
                    StreamData(stream=ref, data=data, fin=cmd.fin), self.sut.now
                )
            elif isinstance(cmd, AbortStream):
                ref = (
                    self.server_to_client[cmd.stream]
                    if cmd.stream.local
                    else self._client_ref_of_peer(cmd.stream)
                )
                c.handle_transport_event(
                    StreamAborted(stream=ref, kind=cmd.kind, code=cmd.code), self.sut.now
                )
            elif isinstance(cmd, SendDatagram):
                c.handle_transport_event(
                    DatagramReceived(data=b"".join(bytes(x) for x in cmd.chunks)), self.sut.now
                )
            self._client_output()

    def _client_ref_of_peer(self, server_ref: StreamRef) -> StreamRef:
        idx = self.sut.streams.index(server_ref)
        for cref, i in self.client_to_index.items():
            if i == idx and cref.local:
                return cref
        raise KeyError(server_ref)

    # client -> server (as ops)
    def _client_output(self) -> None:
        c = self.client
        while True:
            cmd = c.next_command()
            if cmd is None:
                item = c.poll_data(POLL_BUDGET)
                if item is None:
                    break
                cmd = item
            self._client_command(cmd)
        while (e := c.next_event()) is not None:
            self.client_events.append(e)
            if isinstance(e, ev.SubscribeRequested | ev.FetchRequested):
                rid = e.request_id
                if c.requests[rid].state is RequestState.PENDING:
                    if isinstance(e, ev.SubscribeRequested):
                        c.accept_subscribe(rid, self.client_store, now=self.sut.now)
                    else:
                        c.accept_fetch(rid, self.client_store, now=self.sut.now)
                    self._client_output()

    def _emit(self, op: int, payload: bytes = b"") -> None:
        self.ops.append(op)
        self.ops += payload

    def _client_command(self, cmd: TransportCommand) -> None:
        sut = self.sut
        if isinstance(cmd, OpenStream):
            if cmd.stream == StreamRef(True, 0):  # the control stream: the harness made it
                self.client_to_index[cmd.stream] = 0
                return
            self._emit(OPEN_UNI if cmd.uni else OPEN_BIDI)
            sut.run_ops(bytes([OPEN_UNI if cmd.uni else OPEN_BIDI]), close=False)
            self.client_to_index[cmd.stream] = len(sut.streams) - 1
        elif isinstance(cmd, WriteStream):
            data = b"".join(bytes(x) for x in cmd.chunks)
            if cmd.stream == StreamRef(True, 0) and not self.skipped_setup:
                self.skipped_setup = True  # the harness sent its own SETUP
                return
            idx = self.client_to_index[cmd.stream]
            for at in range(0, len(data), 255):
                piece = data[at : at + 255]
                self._op(DATA | idx << 3, bytes([len(piece)]) + piece)
            if cmd.fin:
                self._op(FIN | idx << 3)
        elif isinstance(cmd, AbortStream):
            idx = self.client_to_index[cmd.stream]
            self._op((RESET if cmd.kind is AbortKind.RESET else STOP) | idx << 3, bytes([0]))
        elif isinstance(cmd, SendDatagram):
            data = b"".join(bytes(x) for x in cmd.chunks)[:255]
            self._op(DATAGRAM, bytes([len(data)]) + data)

    def _op(self, op: int, payload: bytes = b"") -> None:
        self._emit(op, payload)
        self.sut.run_ops(bytes([op]) + payload, close=False)

    def time(self, arg: int) -> None:
        self._op(TIME | arg << 3)
        t = self.client.get_timer()
        if t is not None and t <= self.sut.now:
            self.client.handle_timer(self.sut.now)
        self.pump()

    def pump(self) -> None:
        for _ in range(50):
            self._client_output()
            if not self._pending:
                break
            self._deliver_server_output()


Scenario = Callable[[_Recorder, MoqtSession, float], None]


def _scenarios() -> dict[str, Scenario]:
    def sub(fill: bool = True, lf: p.LocationFilter | None = None) -> Scenario:
        def go(r: _Recorder, c: MoqtSession, now: float) -> None:
            c.subscribe(
                SERVED,
                now=now,
                location_filter=lf or p.LocationFilter.next_object(),
                fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)) if fill else None,
            )

        return go

    def fetch(order: int = 1) -> Scenario:
        def go(r: _Recorder, c: MoqtSession, now: float) -> None:
            c.fetch(
                SERVED,
                now=now,
                location_filter=p.LocationFilter.absolute_start(0, 0),
                group_order=GroupOrder(order),
            )

        return go

    def sub_then_update(r: _Recorder, c: MoqtSession, now: float) -> None:
        rid = c.subscribe(SERVED, now=now, location_filter=p.LocationFilter.next_object())
        r.pump()
        c.request_update(
            rid,
            p.Parameters.of(
                p.SubscriberPriority(7),
                p.FillParameters(p.Parameters.of(p.LocationFilter.relative_start(1))),
            ),
            now=r.sut.now,
        )

    def sub_then_cancel(r: _Recorder, c: MoqtSession, now: float) -> None:
        rid = c.subscribe(SERVED, now=now, location_filter=p.LocationFilter.next_object())
        r.pump()
        r.time(10)
        c.cancel(rid, now=r.sut.now)

    def namespaces(r: _Recorder, c: MoqtSession, now: float) -> None:
        c.publish_namespace(NS, now=now)
        c.subscribe_namespace(TrackNamespace.of("kvcs-1"), now=now)
        c.track_status(SERVED, now=now)

    def publish(r: _Recorder, c: MoqtSession, now: float) -> None:
        store = TrackStore(FullTrackName(NS, b"pushed"))
        for o in range(4):
            store.append(0, o, bytes([o]) * 40)
        c.publish(store, now=now)
        r.pump()
        store.append(1, 0, b"later" * 8)
        store.append(1, 1, status=ObjectStatus.END_OF_GROUP)

    def publish_datagrams(r: _Recorder, c: MoqtSession, now: float) -> None:
        store = TrackStore(FullTrackName(NS, b"dgrams"))
        c.publish(store, now=now)
        r.pump()
        for o in range(3):
            store.append(0, o, bytes([o]) * 30, subgroup_id=None, datagram=True)

    def goaway(r: _Recorder, c: MoqtSession, now: float) -> None:
        c.subscribe(SERVED, now=now, location_filter=p.LocationFilter.next_object())
        r.pump()
        c.goaway(now=r.sut.now)

    def serve_wanted(r: _Recorder, c: MoqtSession, now: float) -> None:
        # the server subscribed to and fetched WANTED: the client serves it
        for o in range(3):
            r.client_store.append(0, o, bytes([o]) * 50)
        r.pump()
        r.client_store.append(1, 0, b"new" * 20)
        r.client_store.append(1, 1, status=ObjectStatus.END_OF_GROUP)

    def timeout(r: _Recorder, c: MoqtSession, now: float) -> None:
        c.subscribe(SERVED, now=now)
        r.pump()
        r.time(31)

    return {
        "setup-only": lambda r, c, now: None,
        "subscribe-fill": sub(),
        "subscribe-nofill": sub(fill=False),
        "subscribe-absolute": sub(fill=False, lf=p.LocationFilter.absolute_start(0, 1)),
        "subscribe-range": sub(fill=True, lf=p.LocationFilter.absolute_range(0, 0, 3, 0)),
        "fetch-ascending": fetch(1),
        "fetch-descending": fetch(2),
        "subscribe-update": sub_then_update,
        "subscribe-cancel": sub_then_cancel,
        "namespaces": namespaces,
        "publish": publish,
        "publish-datagrams": publish_datagrams,
        "goaway": goaway,
        "serve-wanted": serve_wanted,
        "request-timeout": timeout,
    }


def make_seed(scenario: Scenario) -> bytes:
    r = _Recorder()
    r.sut.start()
    r.client.start(now=0.0)
    r.pump()
    scenario(r, r.client, r.sut.now)
    r.pump()
    r.time(12)
    r.time(20)
    return bytes(r.ops)


def make_corpus(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.bin"):
        old.unlink()
    written = []
    seeds = {name: make_seed(fn) for name, fn in _scenarios().items()}
    # a few combinations and variations
    seeds["answers-replayed-pv"] = seeds["subscribe-fill"] + seeds["fetch-ascending"]
    seeds["subscribe-fill-split"] = _rechunk(seeds["subscribe-fill"], 7)
    seeds["publish-split"] = _rechunk(seeds["publish"], 5)
    seeds["namespaces-bytewise"] = _rechunk(seeds["namespaces"], 1)
    seeds["fetch-then-time"] = seeds["fetch-ascending"] + bytes([TIME | 31 << 3])
    for name, data in sorted(seeds.items()):
        check(data)  # every seed is a valid input
        digest = hashlib.sha256(data).hexdigest()[:8]
        path = out / f"seed-{name}-{digest}.bin"
        path.write_bytes(data)
        written.append(path)
    return written


def _rechunk(data: bytes, size: int) -> bytes:
    """The same ops with every DATA split into pieces of at most ``size`` bytes."""
    out = bytearray()
    i = 0
    while i < len(data):
        op = data[i]
        i += 1
        kind = op & 7
        if kind in (DATA, DATAGRAM):
            length = data[i]
            chunk = data[i + 1 : i + 1 + length]
            i += 1 + length
            if kind == DATAGRAM:
                out += bytes([op, length]) + chunk
                continue
            for at in range(0, len(chunk), size):
                piece = chunk[at : at + size]
                out += bytes([op, len(piece)]) + piece
        elif kind in (RESET, STOP):
            out += data[i - 1 : i + 1]
            i += 1
        else:
            out.append(op)
    return bytes(out)


def main() -> None:
    if "--make-corpus" in sys.argv:
        files = make_corpus(Path(__file__).resolve().parent / "corpus" / "session")
        total = sum(f.stat().st_size for f in files)
        print(f"wrote {len(files)} seeds, {total} bytes")
        return
    fuzz_main(check)


if __name__ == "__main__":
    main()
