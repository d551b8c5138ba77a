"""``SessionPump``: one QUIC connection carrying one MoqtSession (sans-I/O glue).

Theory of operation
-------------------
MOQT over native QUIC (wire reference section 1, d21 section 6.1) needs streams
of both kinds, resets, STOP_SENDING, datagrams and an application close. The
pump translates between a QUIC stack's ``QuicConnection`` (aioquic's sans-I/O
API, which qh3 shares; see :mod:`.stack`) and the core's own transport
vocabulary (:mod:`kvcs_core.moqt.transport_io`); it holds no protocol policy
and performs no I/O: datagrams, timers and ``now`` are passed in, datagrams
come out.

* **Streams.** A session names the streams it opens; the pump gives each the
  next QUIC stream ID of its kind and creates it at once (an empty write), so
  two opens in a row get different IDs. Streams the peer opens get a
  ``StreamRef(local=False, n)`` from the pump's counter, announced with
  ``StreamOpened`` before their first bytes, reset or STOP_SENDING.
* **Stream credit.** Every request of ours is a bidirectional stream, and the
  peer allows only so many (its MAX_STREAMS; aioquic grants 128 at first, qh3
  100). The pump reports that limit to the session as ``StreamCredit`` once
  the session starts and after every batch of QUIC events in which it grew
  (:attr:`.stack.QuicStack.bidi_credit`), less the bidi streams of ours that
  are not the session's (over WebTransport the client's CONNECT stream, which
  counts against the same QUIC limit). The session then opens request streams
  only within the credit and holds the rest, their timers not running, so a
  client with many open requests never closes itself waiting for credit the
  peer has not granted. (WebTransport's own per-session stream limits,
  WT_MAX_STREAMS capsules, are not implemented by aioquic or qh3 and are not
  modelled; the QUIC limit is the one that applies.)
* **Sending.** Control writes (``next_command``) are handed to QUIC at once.
  Object data is *pulled* (``poll_data``) only while fewer than
  ``max_unsent`` written bytes wait for their first transmission, so QUIC flow
  and congestion control push back on the core instead of the stack's buffers
  growing without bound (ARCHITECTURE.md "Data path and memory"), and only
  while those plus the bytes in flight (sent, not yet acknowledged: the stack
  keeps them for retransmission) stay under ``max_outstanding``: a sender's
  memory per connection is bounded even when its peer grants large windows and
  acknowledges late (a consumer short of CPU), at the price of a send window.
  The endpoint narrows that window to ``window_share`` when it holds several
  connections (an even share of its ``send_budget``, :data:`DEFAULT_SEND_BUDGET`),
  so the total is bounded however many consumers a relay serves.
  Chunks go to ``send_stream_data`` one by one (the stack copies them once
  into its send buffer; nothing is joined here). Joining each object's
  prefix, header and payload into one piece first was measured on qh3 and
  did not pay: an isolated loop of 256 MiB of 32 KiB objects spent 0.35-0.47 s
  in three calls per object against 0.14 s in one, but through
  ``bench_relay_pipeline`` (unpaced, live, one relay; four alternating runs
  each way) the relay and producer used as much CPU or more with the join
  and goodput did not rise.
* **Stream data in runs.** The stack reports stream data one STREAM frame at a
  time (about one per datagram). The events the stack has ready are taken
  together: a run of ``StreamDataReceived`` events reaches the session as one
  ``StreamData`` per stream, its chunks joined (a copy of a few KiB, against the
  session's work per event), in the order each stream first appears in the
  run; any other event ends the run first, so it keeps its place. Only the
  order *between* streams changes, which QUIC never promised (RFC 9000
  section 2.2); each stream's bytes stay in order. Over WebTransport each
  event goes on alone.
* **Events.** Session events are queued for the owner (the endpoint), which
  hands them to the application (relay, publisher, consumer) and then calls
  :meth:`SessionPump.flush` so that whatever the application commanded goes
  out.
* **Lifetime.** The session starts (sends SETUP) when the handshake completes
  with ALPN ``moqt-22``, or, over WebTransport (ALPN ``h3``, when the pump
  allows it), when the CONNECT is answered 200 (:mod:`.webtransport`: its
  streams, datagrams and close stand in for QUIC's, and stream error codes are
  mapped into the HTTP/3 space); any other ALPN closes the connection. A QUIC
  connection termination reaches the session as ``TransportClosed``. An
  exception raised by the stack itself ends this one connection the same
  way (logged as a warning), never the endpoint and its other connections.
  Every connection that ends is logged once, with who ended it, the code and
  the reason (INFO for a clean close, WARNING otherwise: an error code, the
  idle timeout, a stack failure).
* **Keep-alive.** With ``keepalive`` on, a connection that has heard nothing
  from its peer for a third of the idle timeout (the smaller of ours and the
  peer's where the stack tells it; at most :data:`MAX_KEEPALIVE_INTERVAL`)
  sends a QUIC PING (RFC 9000 section 10.1.2: an ack-eliciting packet whose
  acknowledgement restarts both idle timers), so a quiet session lives as long
  as both ends do, and a dead peer is still noticed within the idle timeout.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import attrs

from kvcs_core.moqt.events import SessionClosed, SessionEvent
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.transport_io import (
    AbortKind,
    AbortStream,
    CloseTransport,
    DatagramReceived,
    OpenStream,
    SendDatagram,
    StreamAborted,
    StreamCredit,
    StreamData,
    StreamOpened,
    StreamRef,
    TransportClosed,
    TransportCommand,
    TransportEvent,
    WriteStream,
)

from . import webtransport as wt
from .stack import ALPN, QuicStack
from .webtransport import H3_ALPN, WebTransportLink, wt_to_http

log = logging.getLogger("kvcs.quic")

DEFAULT_MAX_UNSENT = 1 << 20
"""Bytes of object data a connection may hold unsent in its QUIC stack (1 MiB)."""

DEFAULT_MAX_OUTSTANDING = 8 << 20
"""Bytes a connection may hold in its QUIC stack's send buffers, unsent or sent and not
yet acknowledged (8 MiB): the memory a sender spends per connection beyond what it
caches, and its send window (8 MiB per round trip: 168 MB/s at 50 ms)."""

DEFAULT_SEND_BUDGET = 16 << 20
"""Bytes all the connections of one endpoint may hold in their stacks' send buffers
together (16 MiB): each connection's window is an even share of it (never below
``max_unsent``, never above ``max_outstanding``), so a relay fanning one cache out to
many consumers spends a fixed margin beside its cache rather than a window per
consumer (:class:`~.endpoint.QuicEndpoint`)."""

ALPN_MISMATCH = 0x178
"""QUIC CRYPTO_ERROR(no_application_protocol): the peer did not agree on ``moqt-22``."""

H3_NO_ERROR = 0x100
"""HTTP/3 H3_NO_ERROR: the QUIC close after a WebTransport session ended."""

QUIC_INTERNAL_ERROR = 0x1
"""The code reported to the session when the QUIC stack itself failed on this connection."""

MAX_KEEPALIVE_INTERVAL = 15.0
"""The longest silence (seconds) before a keep-alive PING, whatever the idle timeout."""


def keepalive_interval(idle_timeout: float, peer_idle_timeout: float | None = None) -> float:
    """Seconds of silence from the peer after which a connection PINGs (module docstring)."""
    idle = idle_timeout if peer_idle_timeout is None else min(idle_timeout, peer_idle_timeout)
    return max(0.05, min(idle / 3.0, MAX_KEEPALIVE_INTERVAL))


def _addr(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"
    return "?" if addr is None else str(addr)


class SessionPump:
    """Binds one ``QuicConnection`` of any aioquic-compatible stack to one ``MoqtSession``."""

    def __init__(
        self,
        stack: QuicStack,
        quic: Any,
        session: MoqtSession,
        *,
        max_unsent: int = DEFAULT_MAX_UNSENT,
        max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
        label: str = "",
        webtransport: bool = False,
        wt_target: tuple[str, str] | None = None,
        keepalive: bool = False,
        peer: Any = None,
    ) -> None:
        self.stack = stack
        self.quic = quic
        self.session = session
        self.label = label
        self.max_unsent = max_unsent
        self.max_outstanding = max_outstanding
        self.window_share: int | None = None
        """The endpoint's share of its send budget for this connection (``None``: no
        share set, ``max_outstanding`` alone bounds it)."""
        self.events: deque[SessionEvent] = deque()
        self.handshake_complete = False
        self.terminated = False
        self.alpn: str | None = None
        self.bytes_pulled = 0
        self._is_client = bool(quic.configuration.is_client)
        self._sid_of: dict[StreamRef, int] = {}
        self._ref_of: dict[int, StreamRef] = {}
        self._next_peer_ref = 0
        self._send_done: set[int] = set()
        self._unsent_streams: set[int] = set()
        self._closing = False
        self._stack_failed = False
        self.close_reason: str | None = None
        """Why the session or connection ended, in one line (``None`` while open)."""
        self.ended_how: str | None = None
        """Once the connection ended: who or what ended it (``closed by us``, ``closed by
        the peer or the QUIC stack``, ``idle timeout (30 s)``, ``QUIC stack error in ...``,
        ``given up by us``), as logged."""
        self.cid_changes: list[tuple[bool, bytes]] = []
        """Connection IDs the stack issued (True) or retired (False), for the endpoint's demux."""
        self.allow_webtransport = webtransport
        """A server: accept WebTransport (ALPN h3) besides native QUIC. A client: set by
        ``wt_target`` (``(authority, path)``), which makes it speak WebTransport."""
        self.wt_target = wt_target
        self.wt: WebTransportLink | None = None
        """The WebTransport session this MOQT session runs over, if it does."""
        self.announced = False
        """The endpoint told its application about this connection (after the handshake,
        once it is known whether the session runs over QUIC or WebTransport)."""
        self.peer = peer
        """The peer's UDP address (the last one a datagram came from)."""
        self.keepalive = keepalive
        self.reconnects = False
        """The embedding opens this connection again when it ends (a :class:`~.reconnect.Link`)."""
        self._last_heard: float | None = None
        self._last_ping: float | None = None
        self._pings = 0
        self._logged_end = False
        self._bidi_base = 0
        """Bidi streams of ours opened before the session started (not the session's)."""
        self._credit_reported: int | None = None
        self.input_held = False
        """The connection's input is held (:meth:`hold_input`)."""

    # --- inputs ---------------------------------------------------------------------------

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        if self.feed_datagram(data, addr, now):
            self.process_events(now)

    def feed_datagram(self, data: bytes, addr: Any, now: float) -> bool:
        """Hand one datagram to QUIC, leaving what it caused to :meth:`process_events`
        (so that a batch of datagrams costs one round of event handling); ``False`` when
        the stack has failed."""
        return self.feed_datagrams([data], addr, now)

    def feed_datagrams(self, datagrams: list[bytes], addr: Any, now: float) -> bool:
        """:meth:`feed_datagram` for datagrams from one address, in order: in one call
        where the stack takes a batch (:attr:`.stack.QuicStack.receive_many`)."""
        if self._stack_failed:
            return False
        self.peer = addr
        self._last_heard = now
        many = self.stack.receive_many
        try:
            if many is not None and len(datagrams) > 1:
                many(self.quic, datagrams, addr, now)
            else:
                for data in datagrams:
                    self.quic.receive_datagram(data, addr, now)
        except Exception as exc:  # a stack failure ends this connection only
            self._on_stack_failure("receive_datagram", exc, now)
            return False
        return True

    def process_events(self, now: float) -> None:
        """Carry what QUIC reported since the last call to the session."""
        if not self._stack_failed:
            self._process_quic_events(now)

    def handle_timer(self, now: float) -> None:
        if self._stack_failed:
            return
        ping_at = self._keepalive_at()
        if ping_at is not None and ping_at <= now:
            self._pings += 1
            self._last_ping = now
            try:
                self.quic.send_ping(self._pings)
            except Exception as exc:  # a stack failure ends this connection only
                self._on_stack_failure("send_ping", exc, now)
                return
        quic_timer = self.quic.get_timer()
        if quic_timer is not None and quic_timer <= now:
            try:
                self.quic.handle_timer(now)
            except Exception as exc:  # a stack failure ends this connection only
                self._on_stack_failure("handle_timer", exc, now)
                return
            self._process_quic_events(now)
        if self.handshake_complete and not self.terminated:
            deadline = self.session.get_timer()
            if deadline is not None and deadline <= now:
                self.session.handle_timer(now)
                self._drain_session()

    def get_timer(self) -> float | None:
        if self._stack_failed:
            return None
        timers = [self.quic.get_timer(), self._keepalive_at()]
        if self.handshake_complete and not self.terminated:
            timers.append(self.session.get_timer())
        present = [t for t in timers if t is not None]
        return min(present) if present else None

    def _keepalive_at(self) -> float | None:
        """When the next keep-alive PING is due (``None``: none is)."""
        if (
            not self.keepalive
            or self.alpn is None  # the handshake has not completed
            or self.terminated
            or self._closing
            or self._last_heard is None
        ):
            return None
        peer_idle = getattr(self.quic, "_remote_max_idle_timeout", None)  # aioquic only
        interval = keepalive_interval(
            float(self.quic.configuration.idle_timeout),
            float(peer_idle) if isinstance(peer_idle, int | float) and peer_idle > 0 else None,
        )
        last = self._last_heard
        if self._last_ping is not None and self._last_ping > last:
            last = self._last_ping
        return last + interval

    # --- outputs -------------------------------------------------------------------------

    def flush(self, now: float) -> int:
        """Apply the session's commands and pull object data while QUIC has room."""
        self._drain_session()
        if self.terminated or not self.handshake_complete:
            return 0
        unsent = self.unsent_bytes()
        window = self.max_outstanding
        if self.window_share is not None and self.window_share < window:
            window = self.window_share
        budget = min(
            self.max_unsent - unsent,
            window - unsent - self.stack.bytes_in_flight(self.quic),
        )
        pulled = 0
        while budget > 0:
            item = self.session.poll_data(budget)
            if item is None:
                break
            n = self._apply(item)
            pulled += n
            budget -= max(n, 1)
        self._drain_session()
        self.bytes_pulled += pulled
        return pulled

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        if self._stack_failed:
            return []
        try:
            out = self.stack.datagrams_to_send(self.quic, now)
        except Exception as exc:  # a stack failure ends this connection only
            self._on_stack_failure("datagrams_to_send", exc, now)
            return []
        return out

    @property
    def sending(self) -> bool:
        """Stream data handed to QUIC may still wait for its first transmission."""
        return bool(self._unsent_streams) and not self.terminated

    def unsent_bytes(self) -> int:
        """Object and control bytes handed to QUIC that it has not sent once yet."""
        total = 0
        for sid in list(self._unsent_streams):
            try:
                n = self.stack.unsent_bytes(self.quic, sid)
            except Exception as exc:  # e.g. qh3 on a stream it has dropped
                log.debug("%s: stream %d: no send-buffer size: %s", self.label, sid, exc)
                n = 0
            if n:
                total += n
            else:
                self._unsent_streams.discard(sid)
        return total

    def hold_input(self, held: bool, now: float) -> bool:
        """Stop (``held``) or resume taking what the connection receives, so that its
        flow-control credit stops growing and the peer is held back (a relay whose cache
        is full, ``Relay.intake_held``; :attr:`.stack.QuicStack.hold_input`). On resume,
        everything received meanwhile is carried to the session at once. ``False``: the
        stack cannot hold, or the connection is gone (nothing changed)."""
        if held == self.input_held:
            return True
        hold = self.stack.hold_input
        if hold is None or self._stack_failed or (held and self.terminated):
            return False
        try:
            done = hold(self.quic, held)
        except Exception as exc:  # a stack failure ends this connection only
            self._on_stack_failure("hold_input", exc, now)
            return False
        if not done:
            return False
        self.input_held = held
        if not held:
            self._process_quic_events(now)
        return True

    # --- local commands ------------------------------------------------------------------

    def close(self, code: int, reason: str, now: float) -> None:
        """Close the MOQT session (which closes the connection with ``code``)."""
        if self.terminated:
            return
        if self.handshake_complete and not self.session.is_closed:
            self.session.close(code, reason, now=now)
            self._drain_session()
        else:
            self._close_quic(code, reason)

    # --- QUIC -> session -------------------------------------------------------------------

    def _process_quic_events(self, now: float) -> None:
        self._take_quic_events(now)
        self._report_credit(now)

    def _report_credit(self, now: float) -> None:
        """Tell the session the peer's bidi stream credit when it grew (module docstring)."""
        if not self.handshake_complete or self.terminated:
            return
        total = self.stack.bidi_credit(self.quic)
        if total is None:
            return
        credit = max(0, total - self._bidi_base)
        if self._credit_reported is not None and credit <= self._credit_reported:
            return
        self._credit_reported = credit
        self._feed(StreamCredit(bidi=credit), now)

    def _start_session(self, now: float) -> None:
        self.handshake_complete = True
        self._bidi_base = self.quic.get_next_available_stream_id(False) // 4
        self.session.start(now=now)
        self._drain_session()
        self._report_credit(now)

    def _take_quic_events(self, now: float) -> None:
        ev = self.stack.events
        # stream data of a run of StreamDataReceived events, per stream (module docstring)
        runs: dict[int, list[bytes]] = {}
        fins: set[int] = set()
        next_event = self.quic.next_event
        data_event = ev.StreamDataReceived
        # over WebTransport each event goes on alone (looked at again after every other
        # event, as a handshake may start WebTransport)
        in_runs = self.wt is None
        while (qe := next_event()) is not None:
            if in_runs and isinstance(qe, data_event):
                sid = qe.stream_id
                run = runs.get(sid)
                if run is None:
                    runs[sid] = [qe.data]
                else:
                    run.append(qe.data)
                if qe.end_stream:
                    fins.add(sid)
                continue
            if runs:
                self._feed_runs(runs, fins, now)
                runs, fins = {}, set()
            if self.wt is not None and not isinstance(
                qe, ev.ConnectionTerminated | ev.ConnectionIdIssued | ev.ConnectionIdRetired
            ):
                self._on_webtransport(qe, now)
            elif isinstance(qe, ev.StreamReset):
                ref = self._peer_ref(qe.stream_id, now)
                if ref is not None:
                    self._feed(
                        StreamAborted(stream=ref, kind=AbortKind.RESET, code=qe.error_code), now
                    )
            elif isinstance(qe, ev.StopSendingReceived):
                # the stack has already answered with RESET_STREAM (aioquic and qh3 do):
                # later writes of the session to this stream are dropped here
                self._send_done.add(qe.stream_id)
                self._unsent_streams.discard(qe.stream_id)
                ref = self._ref_of.get(qe.stream_id)
                if ref is not None:
                    self._feed(
                        StreamAborted(stream=ref, kind=AbortKind.STOP_SENDING, code=qe.error_code),
                        now,
                    )
            elif isinstance(qe, ev.DatagramFrameReceived):
                self._feed(DatagramReceived(data=qe.data), now)
            elif isinstance(qe, ev.HandshakeCompleted):
                self._on_handshake(qe, now)
            elif isinstance(qe, ev.ConnectionTerminated):
                self._on_terminated(qe, now)
            elif isinstance(qe, ev.ConnectionIdIssued):
                self.cid_changes.append((True, qe.connection_id))
            elif isinstance(qe, ev.ConnectionIdRetired):
                self.cid_changes.append((False, qe.connection_id))
            in_runs = self.wt is None
        if runs:
            self._feed_runs(runs, fins, now)

    def _feed_runs(self, runs: dict[int, list[bytes]], fins: set[int], now: float) -> None:
        """Each stream's data from a run of ``StreamDataReceived`` events, in one piece."""
        for sid, chunks in runs.items():
            ref = self._peer_ref(sid, now)
            if ref is None:
                continue
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self._feed(StreamData(stream=ref, data=data, fin=sid in fins), now)

    def _on_handshake(self, qe: Any, now: float) -> None:
        self.alpn = qe.alpn_protocol
        if qe.alpn_protocol == H3_ALPN and (self.allow_webtransport or self.wt_target):
            self._start_webtransport(now)
            return
        if qe.alpn_protocol != ALPN:
            log.warning(
                "%s: peer negotiated ALPN %r, not %s; closing", self.label, qe.alpn_protocol, ALPN
            )
            self._close_quic(ALPN_MISMATCH, f"ALPN {ALPN} required", transport=True)
            return
        self._start_session(now)

    # --- WebTransport (see .webtransport) -------------------------------------------------

    def _start_webtransport(self, now: float) -> None:
        authority, path = self.wt_target or ("", "/")
        self.wt = WebTransportLink(self.stack, self.quic, authority=authority, path=path)
        if not self.session.config.webtransport:  # a server learns it from the ALPN
            self.session = MoqtSession(attrs.evolve(self.session.config, webtransport=True))

    def _on_webtransport(self, qe: Any, now: float) -> None:
        assert self.wt is not None
        for item in self.wt.handle(qe):
            if isinstance(item, wt.Data):
                ref = self._peer_ref(item.stream_id, now)
                if ref is not None:
                    self._feed(StreamData(stream=ref, data=item.data, fin=item.fin), now)
            elif isinstance(item, wt.Reset):
                ref = self._peer_ref(item.stream_id, now)
                if ref is not None:
                    self._feed(StreamAborted(stream=ref, kind=AbortKind.RESET, code=item.code), now)
            elif isinstance(item, wt.StopSending):
                self._send_done.add(item.stream_id)  # the stack answered with a reset
                self._unsent_streams.discard(item.stream_id)
                ref = self._ref_of.get(item.stream_id)
                if ref is not None:
                    self._feed(
                        StreamAborted(stream=ref, kind=AbortKind.STOP_SENDING, code=item.code), now
                    )
            elif isinstance(item, wt.Datagram):
                self._feed(DatagramReceived(data=item.data), now)
            elif isinstance(item, wt.Established):
                self._start_session(now)
            elif isinstance(item, wt.Ended):
                self._on_webtransport_ended(item, now)

    def _on_webtransport_ended(self, item: wt.Ended, now: float) -> None:
        if self.close_reason is None:
            self.close_reason = (
                f"{item.reason or 'WebTransport session closed'} (code {item.code:#x})"
            )
        if self.handshake_complete and not self.terminated:
            self.terminated = True
            self._log_end("closed by the peer (WebTransport)", item.code)
            self.session.handle_transport_event(
                TransportClosed(code=item.code, reason=item.reason, by_peer=True), now
            )
            self._drain_session()
        self._close_quic(H3_NO_ERROR, "WebTransport session closed")

    def _on_terminated(self, qe: Any, now: float) -> None:
        if self.terminated:
            return
        self.terminated = True
        if self.close_reason is None:
            self.close_reason = (
                f"{qe.reason_phrase or 'connection closed'} (code {qe.error_code:#x})"
            )
        phrase = (qe.reason_phrase or "").lower()
        if "idle" in phrase:
            how = f"idle timeout ({float(self.quic.configuration.idle_timeout):g} s)"
        elif self._closing:
            how = "closed by us"
        else:
            how = "closed by the peer or the QUIC stack"
        self._log_end(how, qe.error_code)
        if self.handshake_complete:
            self.session.handle_transport_event(
                TransportClosed(
                    code=qe.error_code, reason=qe.reason_phrase or "", by_peer=not self._closing
                ),
                now,
            )
            self._drain_session()

    def _on_stack_failure(self, what: str, exc: Exception, now: float) -> None:
        """The stack raised: give the connection up (nothing more is sent or read on it)."""
        self._stack_failed = True
        if self.terminated:  # it had ended already (e.g. qh3: "connection is closed")
            log.debug("%s: after its end, %s raised: %s", self.label, what, exc)
            return
        try:
            closed = self.stack.close_event(self.quic)
        except Exception:
            closed = None
        if closed is not None:  # the peer (or the stack) closed it: that is the end, not exc
            log.debug("%s: %s raised after the connection closed: %s", self.label, what, exc)
            self._on_terminated(closed, now)
            return
        log.warning("%s: QUIC stack error in %s: %r; connection dropped", self.label, what, exc)
        if self.close_reason is None:
            self.close_reason = f"QUIC stack error: {exc}"
        self.terminated = True
        self._log_end(f"QUIC stack error in {what}", QUIC_INTERNAL_ERROR)
        if self.handshake_complete:
            self.session.handle_transport_event(
                TransportClosed(code=QUIC_INTERNAL_ERROR, reason=str(exc), by_peer=False), now
            )
            self._drain_session()

    def fail(self, what: str, exc: Exception, now: float) -> None:
        """Give this connection up after ``exc`` escaped work on it (the endpoint's guard).
        What the stack reported first (its own end of the connection) is taken in."""
        try:
            if not self._stack_failed and not self.terminated:
                self._take_quic_events(now)
        except Exception as again:
            log.debug("%s: events after a failure not read: %s", self.label, again)
        try:
            self._on_stack_failure(what, exc, now)
        except Exception as again:  # the session failed too: nothing more is done for it
            log.warning("%s: giving the connection up failed too: %s", self.label, again)
            self.terminated = True
            self.events.clear()

    def abandon(self, reason: str, now: float) -> None:
        """Give the connection up now, without waiting for the stack (an attempt that took
        too long); the endpoint reaps it."""
        if self.terminated:
            return
        if self.close_reason is None:
            self.close_reason = reason
        self._close_quic(QUIC_INTERNAL_ERROR, reason, transport=True)
        self.terminated = True
        self._log_end("given up by us", QUIC_INTERNAL_ERROR, clean=False)
        if self.handshake_complete:
            self.session.handle_transport_event(
                TransportClosed(code=QUIC_INTERNAL_ERROR, reason=reason, by_peer=False), now
            )
            self._drain_session()

    def _log_end(self, how: str, code: int, *, clean: bool | None = None) -> None:
        """The one log line of a connection that ended (module docstring)."""
        if self._logged_end:
            return
        self._logged_end = True
        self.ended_how = how
        if clean is None:
            clean = code in (0, H3_NO_ERROR) and "idle" not in how and "error" not in how
        reason = self.close_reason or f"no reason given (code {code:#x})"
        log.log(
            logging.INFO if clean else logging.WARNING,
            "%s: connection with %s ended, %s: %s",
            self.label,
            _addr(self.peer),
            how,
            reason,
        )

    def _peer_ref(self, sid: int, now: float) -> StreamRef | None:
        ref = self._ref_of.get(sid)
        if ref is not None:
            return ref
        peer_initiated = bool(sid & 1) == self._is_client
        if not peer_initiated or not self.handshake_complete:
            return None
        ref = StreamRef(False, self._next_peer_ref)
        self._next_peer_ref += 1
        self._ref_of[sid] = ref
        self._sid_of[ref] = sid
        self._feed(StreamOpened(stream=ref, uni=bool(sid & 2)), now)
        return ref

    def _feed(self, event: TransportEvent, now: float) -> None:
        if self.terminated and not isinstance(event, TransportClosed):
            return
        self.session.handle_transport_event(event, now)
        self._drain_session()

    # --- session -> QUIC -------------------------------------------------------------------

    def _drain_session(self) -> None:
        session = self.session
        while (cmd := session.next_command()) is not None:
            self._apply(cmd)
        while (e := session.next_event()) is not None:
            if isinstance(e, SessionClosed) and self.close_reason is None:
                self.close_reason = f"{e.reason or 'closed'} (MOQT code {e.code:#x})"
            self.events.append(e)

    def _apply(self, cmd: TransportCommand) -> int:
        if self.terminated:
            return 0
        if isinstance(cmd, WriteStream):
            return self._write(cmd)
        if isinstance(cmd, OpenStream):
            self._open(cmd.stream, cmd.uni)
        elif isinstance(cmd, SendDatagram):
            data = b"".join(cmd.chunks)
            if self.wt is not None:
                self.wt.datagram(data)
            else:
                self.quic.send_datagram_frame(data)
            return len(data)
        elif isinstance(cmd, AbortStream):
            self._abort(cmd)
        elif isinstance(cmd, CloseTransport):
            if self.wt is not None:  # CLOSE_WEBTRANSPORT_SESSION carries the MOQT code
                try:
                    self.wt.close(cmd.code, cmd.reason)
                except Exception as exc:  # e.g. the connection is gone already
                    log.debug("%s: CLOSE_WEBTRANSPORT_SESSION not sent: %s", self.label, exc)
                self._close_quic(H3_NO_ERROR, cmd.reason)
            else:
                self._close_quic(cmd.code, cmd.reason)
        return 0

    def _open(self, ref: StreamRef, uni: bool) -> None:
        if self.wt is not None:
            sid = self.wt.open_stream(uni)
        else:
            sid = self.quic.get_next_available_stream_id(uni)
            self.quic.send_stream_data(sid, b"", False)  # reserves the ID
        self._sid_of[ref] = sid
        self._ref_of[sid] = ref

    def _write(self, cmd: WriteStream) -> int:
        if cmd.opens:
            self._open(cmd.stream, True)
        sid = self._sid_of.get(cmd.stream)
        if sid is None or sid in self._send_done:
            log.debug("%s: write to closed or unknown stream %r ignored", self.label, cmd.stream)
            return 0
        n = 0
        last = len(cmd.chunks) - 1
        try:
            for i, chunk in enumerate(cmd.chunks):
                n += len(chunk)
                self.quic.send_stream_data(sid, chunk, cmd.fin and i == last)
            if cmd.fin and not cmd.chunks:
                self.quic.send_stream_data(sid, b"", True)
        except (AssertionError, ValueError) as exc:  # the stack closed the stream itself
            # (anything else, e.g. qh3's QuicConnectionError, ends the connection: the
            # endpoint's guard calls fail())
            log.debug("%s: stream %d refused a write: %s", self.label, sid, exc)
            self._send_done.add(sid)
            return n
        if cmd.fin:
            self._send_done.add(sid)
        if n:
            self._unsent_streams.add(sid)
        return n

    def _abort(self, cmd: AbortStream) -> None:
        sid = self._sid_of.get(cmd.stream)
        if sid is None:
            return
        code = cmd.code if self.wt is None else wt_to_http(cmd.code)
        if cmd.kind is AbortKind.RESET:
            if sid not in self._send_done:
                self._send_done.add(sid)
                self._unsent_streams.discard(sid)
                self.quic.reset_stream(sid, code)
        else:
            try:
                self.quic.stop_stream(sid, code)
            except (AssertionError, ValueError) as exc:
                # the stack has already received the whole stream (qh3: "cannot stop
                # receiving on a completed stream"): there is nothing left to stop, and
                # it is no reason to end the connection
                log.debug("%s: stream %d: STOP_SENDING not sent: %s", self.label, sid, exc)

    def _close_quic(self, code: int, reason: str, *, transport: bool = False) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            if transport:
                self.quic.close(error_code=code, frame_type=0, reason_phrase=reason)
            else:
                self.quic.close(error_code=code, reason_phrase=reason)
        except Exception as exc:  # qh3 raises when the connection is closed already
            log.debug("%s: close not sent: %s", self.label, exc)
