"""What sits on an endpoint's sessions: a relay, or KVCS publishers and consumers (sans-I/O).

Theory of operation
-------------------
:class:`~.endpoint.QuicEndpoint` tells its :class:`~.endpoint.Application`
about every new connection and every session event. The two applications here
only route; the protocol decisions stay in the core machines:

* :class:`RelayApp` hands every session to one
  :class:`~kvcs_core.relay.relay.Relay`: accepted connections as downstream
  peers, connections the relay opened itself (to a parent relay) as upstream
  (as *links* when they are reopened on loss, :mod:`.reconnect`).
* :class:`ClientApp` offers each event to the KVCS publishers and consumers
  that use the session (a publisher answers what concerns its namespace, a
  consumer what answers its requests) and to watchers (one-off waits such as
  discovery). Consumer output events are collected per consumer in a
  :class:`ConsumerHandle` for the async API to read. A request of the peer
  that none of them answered gets a default answer (:func:`answer_unclaimed`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvcs_core.kvcs.consumer import ConsumerEvent, KvcsConsumer
from kvcs_core.kvcs.publisher import KvcsPublisher
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.events import SessionEvent
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.relay.relay import Relay
from kvcs_core.wire.codes import RequestErrorCode

from .pump import SessionPump

Watcher = Callable[[SessionPump, SessionEvent, float], None]

_PEER_REQUESTS = (
    ev.SubscribeRequested,
    ev.FetchRequested,
    ev.TrackStatusRequested,
    ev.PublishNamespaceRequested,
    ev.SubscribeNamespaceRequested,
    ev.PublishRequested,
    ev.SubscribeTracksRequested,
)


def answer_unclaimed(session: MoqtSession, event: SessionEvent, now: float) -> None:
    """Answer a request of the peer that nothing on this client answered.

    Wire reference 8.2: a limited endpoint SHOULD answer a request it does not
    serve (NOT_SUPPORTED), not ignore it; a server may send requests to a client
    right after SETUP, before any publication is attached (the moq-rs server
    sends SUBSCRIBE_NAMESPACE and PUBLISH_NAMESPACE to every client). Answers:

    * SUBSCRIBE, FETCH, TRACK_STATUS: REQUEST_ERROR DOES_NOT_EXIST (no
      publication here serves the track);
    * SUBSCRIBE_NAMESPACE: REQUEST_OK, with no NAMESPACE yet: a publication
      attached later announces itself on it (``KvcsPublisher.attach``);
    * PUBLISH_NAMESPACE: REQUEST_OK (noted; a client forwards nothing);
    * PUBLISH: REQUEST_ERROR UNINTERESTED (nothing here asked for tracks);
    * SUBSCRIBE_TRACKS: REQUEST_ERROR NOT_SUPPORTED.
    """
    if not isinstance(event, _PEER_REQUESTS) or session.is_closed:
        return
    rec = session.requests.get(event.request_id)
    if rec is None or rec.mine or rec.state is not RequestState.PENDING:
        return
    rid = event.request_id
    if isinstance(event, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
        session.reject_request(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track", now=now)
    elif isinstance(event, ev.SubscribeNamespaceRequested | ev.PublishNamespaceRequested):
        session.accept_request(rid, now=now)
    elif isinstance(event, ev.PublishRequested):
        session.reject_request(rid, RequestErrorCode.UNINTERESTED, "no interest", now=now)
    else:
        session.reject_request(rid, RequestErrorCode.NOT_SUPPORTED, "not supported", now=now)


class RelayApp:
    """Every connection of the endpoint belongs to one relay.

    After every call into the relay, the connections named by ``Relay.intake_held``
    (the cache is full: :mod:`kvcs_core.relay.intake`) have their input held, and the
    others released (:meth:`.pump.SessionPump.hold_input`; a stack that cannot hold
    leaves them as they are)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self._pumps: dict[MoqtSession, SessionPump] = {}
        self._held: frozenset[MoqtSession] = frozenset()

    def connection_made(self, pump: SessionPump, now: float) -> None:
        upstream = bool(pump.quic.configuration.is_client)
        for session in [s for s, p in self._pumps.items() if p.terminated]:
            del self._pumps[session]
        self._pumps[pump.session] = pump
        # a reconnecting upstream (a Link): what it served waits for the next one
        self.relay.add_session(pump.session, upstream=upstream, link=upstream and pump.reconnects)
        self._sync_intake(now)

    def handle_session_event(self, pump: SessionPump, event: SessionEvent, now: float) -> None:
        self.relay.handle_session_event(pump.session, event, now)
        if type(event) is ev.SessionClosed:
            self._pumps.pop(pump.session, None)
        if self.relay.intake_held is not self._held:
            self._sync_intake(now)

    def handle_timer(self, now: float) -> None:
        self.relay.handle_timer(now)
        self._sync_intake(now)

    def _sync_intake(self, now: float) -> None:
        want = self.relay.intake_held
        before, self._held = self._held, want
        for session in before - want:
            pump = self._pumps.get(session)
            if pump is not None:
                pump.hold_input(False, now)  # its held events wait in pump.events
        for session in want - before:
            pump = self._pumps.get(session)
            if pump is not None:
                pump.hold_input(True, now)

    def get_timer(self) -> float | None:
        return self.relay.get_timer()


class ConsumerHandle:
    """One consumer and the events it emitted, in order."""

    def __init__(self, consumer: KvcsConsumer, sessions: tuple[MoqtSession, ...]) -> None:
        self.consumer = consumer
        self.sessions = sessions
        self.events: deque[ConsumerEvent] = deque()
        self.history: list[ConsumerEvent] = []

    def drain(self) -> None:
        while (e := self.consumer.next_event()) is not None:
            self.events.append(e)
            self.history.append(e)


class ClientApp:
    """Routes session events to KVCS publishers, consumers and watchers."""

    def __init__(self) -> None:
        self.publishers: list[tuple[KvcsPublisher, MoqtSession]] = []
        self.consumers: list[ConsumerHandle] = []
        self.watchers: list[Watcher] = []

    def connection_made(self, pump: SessionPump, now: float) -> None:
        return None

    def handle_session_event(self, pump: SessionPump, event: SessionEvent, now: float) -> None:
        session = pump.session
        for watch in list(self.watchers):
            watch(pump, event, now)
        # a SUBSCRIBE_NAMESPACE can cover several publications: each announces itself
        every = isinstance(event, ev.SubscribeNamespaceRequested)
        claimed = False
        for pub, on in self.publishers:
            if on is session and pub.handle_session_event(session, event, now):
                claimed = True
                if not every:
                    break
        if not claimed:
            for handle in self.consumers:
                if session in handle.sessions and not handle.consumer.done:
                    handle.consumer.handle_session_event(session, event, now)
                    handle.drain()
        answer_unclaimed(session, event, now)

    def handle_timer(self, now: float) -> None:
        for handle in self.consumers:
            deadline = handle.consumer.get_timer()
            if deadline is not None and deadline <= now:
                handle.consumer.handle_timer(now)
                handle.drain()

    def get_timer(self) -> float | None:
        timers = [h.consumer.get_timer() for h in self.consumers if not h.consumer.done]
        present = [t for t in timers if t is not None]
        return min(present) if present else None
