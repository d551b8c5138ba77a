"""Requests beyond the peer's bidirectional stream credit (issue 10, finding 8).

Every request of ours is its own bidirectional stream (d21 section 6.4.2), and the
peer limits how many we may open (QUIC MAX_STREAMS). The transport reports that
limit as ``StreamCredit``; a request made while it is used up is held by the
session, unsent and without a running timer, and goes out as the credit grows.

Two bare sessions are linked here by :class:`Wire`, a minimal in-test transport
that models the credit the way QUIC does: it hands the client's stream opens to
the server, and fails the test if the client ever opens more bidi streams than
granted (where qh3 raises and aioquic queues the stream where nobody sees it).
"""

from __future__ import annotations

import pytest

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.moqt.transport_io import (
    AbortStream,
    CloseTransport,
    OpenStream,
    SendDatagram,
    StreamAborted,
    StreamCredit,
    StreamData,
    StreamOpened,
    StreamRef,
    TransportClosed,
    TransportCommand,
    WriteStream,
)
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import RequestErrorCode, SessionErrorCode
from kvcs_core.wire.names import FullTrackName, TrackNamespace

NS = TrackNamespace.of("kvcs-1", b"c" * 16)
TIMEOUT = 30.0


def _track(i: int) -> FullTrackName:
    return FullTrackName(NS, f"t{i}".encode())


class Wire:
    """A client and a server session over an in-test transport with bidi credit."""

    def __init__(self, credit: int | None, client: SessionConfig | None = None) -> None:
        self.cli = MoqtSession(client or SessionConfig(role=Role.CLIENT, request_timeout=TIMEOUT))
        self.srv = MoqtSession(SessionConfig(role=Role.SERVER))
        self.now = 0.0
        self.credit = credit
        self.cli_bidi_opened = 0
        self.peer_ref: dict[tuple[int, StreamRef], StreamRef] = {}
        """(side, its stream) -> the other side's name for that stream."""
        self.next_peer = [0, 0]
        self.events: dict[int, list[ev.SessionEvent]] = {0: [], 1: []}
        self.cli.start(now=0.0)
        self.srv.start(now=0.0)
        if credit is not None:
            self.cli.handle_transport_event(StreamCredit(bidi=credit), 0.0)
        self.flush()

    def sessions(self) -> tuple[MoqtSession, MoqtSession]:
        return self.cli, self.srv

    def grant(self, total: int) -> None:
        """The server's QUIC raises MAX_STREAMS (bidi) to ``total``."""
        self.credit = total
        self.cli.handle_transport_event(StreamCredit(bidi=total), self.now)
        self.flush()

    def _deliver(self, side: int, cmd: TransportCommand) -> None:
        other = self.sessions()[1 - side]
        if isinstance(cmd, OpenStream | WriteStream) and (isinstance(cmd, OpenStream) or cmd.opens):
            uni = cmd.uni if isinstance(cmd, OpenStream) else True
            if side == 0 and not uni:
                self.cli_bidi_opened += 1
                assert self.credit is None or self.cli_bidi_opened <= self.credit, (
                    f"bidi stream {self.cli_bidi_opened} opened beyond the credit {self.credit}"
                )
            ref = StreamRef(False, self.next_peer[1 - side])
            self.next_peer[1 - side] += 1
            self.peer_ref[(side, cmd.stream)] = ref
            self.peer_ref[(1 - side, ref)] = cmd.stream
            other.handle_transport_event(StreamOpened(stream=ref, uni=uni), self.now)
            if isinstance(cmd, OpenStream):
                return
        if isinstance(cmd, WriteStream):
            data = b"".join(bytes(c) for c in cmd.chunks)
            target = self.peer_ref[(side, cmd.stream)]
            other.handle_transport_event(
                StreamData(stream=target, data=data, fin=cmd.fin), self.now
            )
        elif isinstance(cmd, AbortStream):
            target = self.peer_ref[(side, cmd.stream)]
            other.handle_transport_event(
                StreamAborted(stream=target, kind=cmd.kind, code=cmd.code), self.now
            )
        elif isinstance(cmd, CloseTransport):
            other.handle_transport_event(
                TransportClosed(code=cmd.code, reason=cmd.reason), self.now
            )
        else:
            assert isinstance(cmd, SendDatagram)  # nothing here sends datagrams

    def flush(self) -> None:
        for _ in range(10_000):
            moved = False
            for side, s in enumerate(self.sessions()):
                while (cmd := s.next_command()) is not None:
                    self._deliver(side, cmd)
                    moved = True
                while (item := s.poll_data(1 << 20)) is not None:
                    self._deliver(side, item)
                    moved = True
                while (e := s.next_event()) is not None:
                    self.events[side].append(e)
            if not moved:
                return
        raise AssertionError("the sessions never went quiet")

    def run_to(self, t: float) -> None:
        """Advance the clock to ``t``, firing every deadline on the way at its time."""
        for _ in range(10_000):
            due = [x for x in (self.cli.get_timer(), self.srv.get_timer()) if x is not None]
            nxt = min(due, default=None)
            if nxt is None or nxt > t:
                break
            self.now = max(self.now, nxt)
            for s in self.sessions():
                s.handle_timer(self.now)
            self.flush()
        self.now = t
        self.flush()

    def of(self, side: int, kind: type) -> list:  # type: ignore[type-arg]
        return [e for e in self.events[side] if isinstance(e, kind)]


def _closed(w: Wire, side: int) -> list[ev.SessionClosed]:
    return w.of(side, ev.SessionClosed)


def test_two_hundred_requests_on_a_credit_of_128_wait_without_timing_out() -> None:
    w = Wire(credit=128)
    rids = [w.cli.subscribe(_track(i), now=0.0) for i in range(200)]
    w.flush()
    seen = w.of(1, ev.SubscribeRequested)
    assert len(seen) == 128, "only what the credit allows reaches the peer"
    assert w.cli.held_requests == 72
    # the server accepts every subscription it saw (their streams stay open: no credit back)
    stores: list[TrackStore] = []
    w.run_to(10.0)
    for e in seen:
        stores.append(TrackStore(e.track))
        w.srv.accept_subscribe(e.request_id, stores[-1], now=w.now)
    w.flush()
    assert len(w.of(0, ev.SubscribeAccepted)) == 128
    # far past the request timeout of the held requests' creation: nothing timed out
    w.run_to(40.0)
    assert not _closed(w, 0) and not w.cli.is_closed, _closed(w, 0)
    assert w.cli.held_requests == 72
    # the credit grows: the held requests go out, in the order they were made
    w.grant(200)
    assert w.cli.held_requests == 0
    seen = w.of(1, ev.SubscribeRequested)
    assert [e.request_id for e in seen] == rids
    # their timers started now (t=40), not at t=0: still open at t=69.9 ...
    w.run_to(40.0 + TIMEOUT - 0.1)
    assert not w.cli.is_closed, _closed(w, 0)
    # ... and the first unanswered one closes the session at exactly t=70
    w.run_to(100.0)
    closed = _closed(w, 0)
    assert closed and closed[0].code == SessionErrorCode.CONTROL_MESSAGE_TIMEOUT
    assert w.cli.is_closed


def test_held_requests_are_released_as_credit_arrives_step_by_step() -> None:
    w = Wire(credit=2)
    rids = [w.cli.track_status(_track(i), now=0.0) for i in range(5)]
    w.flush()
    assert [e.request_id for e in w.of(1, ev.TrackStatusRequested)] == rids[:2]
    for step, total in ((5.0, 3), (20.0, 4), (45.0, 5)):
        w.run_to(step)
        for e in w.of(1, ev.TrackStatusRequested):
            if (
                w.srv.requests.get(e.request_id) is not None
                and not w.srv.requests[e.request_id].finished
            ):
                w.srv.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, now=w.now)
        w.flush()
        w.grant(total)
        assert [e.request_id for e in w.of(1, ev.TrackStatusRequested)] == rids[:total]
    w.run_to(60.0)
    for e in w.of(1, ev.TrackStatusRequested)[4:]:
        w.srv.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, now=w.now)
    w.flush()
    w.run_to(200.0)
    assert not w.cli.is_closed, _closed(w, 0)
    assert sorted(e.request_id for e in w.of(0, ev.RequestFailed)) == rids


def test_a_held_request_can_be_updated_and_cancelled_before_it_is_sent() -> None:
    w = Wire(credit=1)
    first = w.cli.subscribe(_track(0), now=0.0)
    held = w.cli.subscribe(_track(1), now=0.0)
    dropped = w.cli.subscribe(_track(2), now=0.0)
    w.flush()
    assert w.cli.held_requests == 2
    w.cli.cancel(dropped, now=0.0)  # never sent: dropped, no credit spent on it
    assert w.cli.held_requests == 1
    update = w.cli.request_update(held, p.Parameters([p.Forward(0)]), now=0.0)
    w.flush()
    assert [e.request_id for e in w.of(1, ev.SubscribeRequested)] == [first]
    assert not w.of(1, ev.RequestUpdated)  # it waits behind its held SUBSCRIBE
    w.grant(2)
    assert [e.request_id for e in w.of(1, ev.SubscribeRequested)] == [first, held]
    # the peer answers the SUBSCRIBE; the update, behind it on the same stream, follows
    w.srv.accept_subscribe(held, TrackStore(_track(1)), now=w.now)
    w.flush()
    assert [e.update_id for e in w.of(1, ev.RequestUpdated)] == [update]
    w.grant(3)  # the cancelled request never reaches the peer
    assert [e.request_id for e in w.of(1, ev.SubscribeRequested)] == [first, held]
    assert w.cli.held_requests == 0
    assert not w.cli.is_closed and not w.srv.is_closed


def test_the_hold_is_bounded_and_its_overflow_is_a_local_error() -> None:
    cfg = SessionConfig(role=Role.CLIENT, max_held_requests=3)
    w = Wire(credit=1, client=cfg)
    for i in range(4):
        w.cli.subscribe(_track(i), now=0.0)
    with pytest.raises(LocalProtocolError, match="stream credit"):
        w.cli.subscribe(_track(9), now=0.0)
    assert w.cli.held_requests == 3
    w.grant(2)
    w.cli.subscribe(_track(10), now=0.0)  # room again
    assert w.cli.held_requests == 3


def test_without_a_credit_report_requests_go_out_at_once() -> None:
    w = Wire(credit=None)
    for i in range(300):
        w.cli.subscribe(_track(i), now=0.0)
    w.flush()
    assert w.cli.held_requests == 0
    assert len(w.of(1, ev.SubscribeRequested)) == 300


def test_a_smaller_credit_report_changes_nothing() -> None:
    w = Wire(credit=4)
    for i in range(6):
        w.cli.subscribe(_track(i), now=0.0)
    w.flush()
    w.credit = 4  # the transport's limit stays 4: MAX_STREAMS never goes down
    w.cli.handle_transport_event(StreamCredit(bidi=3), 0.0)
    w.flush()
    assert w.cli.held_requests == 2
    assert len(w.of(1, ev.SubscribeRequested)) == 4
    w.grant(5)
    assert w.cli.held_requests == 1


def test_credit_reported_before_setup_is_used_at_once() -> None:
    cli = MoqtSession(SessionConfig(role=Role.CLIENT))
    cli.handle_transport_event(StreamCredit(bidi=1), 0.0)  # before start(): not buffered
    cli.start(now=0.0)
    cli.handle_transport_event(StreamOpened(stream=StreamRef(False, 0), uni=True), 0.0)
    cli.handle_transport_event(
        StreamData(stream=StreamRef(False, 0), data=m.encode_message(m.Setup())), 0.0
    )
    assert cli.setup_complete
    cli.subscribe(_track(0), now=0.0)
    cli.subscribe(_track(1), now=0.0)
    assert cli.held_requests == 1
