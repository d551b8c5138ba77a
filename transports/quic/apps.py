"""What sits on an endpoint's sessions: a relay, or KVCS publishers and consumers (sans-I/O).

Theory of operation
-------------------
:class:`~.endpoint.QuicEndpoint` tells its :class:`~.endpoint.Application`
about every new connection and every session event. The two applications here
only route; the protocol decisions stay in the core machines:

* :class:`RelayApp` hands every session to one
  :class:`~kvcs_core.relay.relay.Relay`: accepted connections as downstream
  peers, connections the relay opened itself (to a parent relay) as upstream.
* :class:`ClientApp` offers each event to the KVCS publishers and consumers
  that use the session (a publisher answers what concerns its namespace, a
  consumer what answers its requests) and to watchers (one-off waits such as
  discovery). Consumer output events are collected per consumer in a
  :class:`ConsumerHandle` for the async API to read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvcs_core.kvcs.consumer import ConsumerEvent, KvcsConsumer
from kvcs_core.kvcs.publisher import KvcsPublisher
from kvcs_core.moqt.events import SessionEvent
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.relay.relay import Relay

from .pump import SessionPump

Watcher = Callable[[SessionPump, SessionEvent, float], None]


class RelayApp:
    """Every connection of the endpoint belongs to one relay."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def connection_made(self, pump: SessionPump, now: float) -> None:
        self.relay.add_session(pump.session, upstream=bool(pump.quic.configuration.is_client))

    def handle_session_event(self, pump: SessionPump, event: SessionEvent, now: float) -> None:
        self.relay.handle_session_event(pump.session, event, now)

    def handle_timer(self, now: float) -> None:
        self.relay.handle_timer(now)

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
        for pub, on in self.publishers:
            if on is session and pub.handle_session_event(session, event, now):
                return
        for handle in self.consumers:
            if session in handle.sessions and not handle.consumer.done:
                handle.consumer.handle_session_event(session, event, now)
                handle.drain()

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
