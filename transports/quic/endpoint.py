"""``QuicEndpoint``: one UDP socket's worth of QUIC connections, each a MoqtSession (sans-I/O).

Theory of operation
-------------------
An event-loop driver (:mod:`.aio`, :mod:`.trio_driver`) owns a UDP socket and a
clock and does only three things: hand every datagram it reads to
:meth:`QuicEndpoint.receive_datagram`, call :meth:`QuicEndpoint.handle_timer`
when :meth:`QuicEndpoint.get_timer` falls due, and after either (or after the
application did something) call :meth:`QuicEndpoint.service` and send the
datagrams it returns. Everything else is here, free of I/O, so both drivers
(and any other loop) share it.

* **Demultiplexing** (RFC 9000 section 5.2): datagrams are routed by their
  Destination Connection ID to the connection that issued it. A server creates
  a connection for a new Initial of at least 1200 bytes, answers an unknown
  QUIC version with Version Negotiation, and drops everything else. A client
  endpoint can hold several outgoing connections on its one socket.
* **Sessions.** Each connection carries one :class:`MoqtSession` through a
  :class:`~.pump.SessionPump`. The :class:`Application` (a relay, a
  publisher, a consumer, or several) is told of each new connection and gets
  every session event with ``now``; what it commands on any session goes out
  in the same :meth:`service` call.
* **Bounds.** At most ``max_connections`` connections (new Initials beyond it
  are dropped, so the peer's handshake times out); each holds at most
  ``max_unsent`` unsent bytes in its stack; :meth:`service` loops a bounded
  number of rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import attrs

from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.events import SessionEvent
from kvcs_core.moqt.session import MoqtSession

from .pump import DEFAULT_MAX_UNSENT, SessionPump
from .stack import QuicStack

log = logging.getLogger("kvcs.quic")

SMALLEST_INITIAL = 1200
"""RFC 9000 section 14.1: a client's Initial datagram is at least 1200 bytes."""

MAX_SERVICE_ROUNDS = 64
"""Event-dispatch rounds per :meth:`QuicEndpoint.service` (events causing events)."""

MAX_SEND_ROUNDS = 8
"""Pull-and-send rounds per :meth:`QuicEndpoint.service` while QUIC keeps taking data."""


class Application(Protocol):
    """What sits on the sessions of an endpoint (see :mod:`.apps`)."""

    def connection_made(self, pump: SessionPump, now: float) -> None: ...

    def handle_session_event(self, pump: SessionPump, event: SessionEvent, now: float) -> None: ...

    def handle_timer(self, now: float) -> None: ...

    def get_timer(self) -> float | None: ...


class QuicEndpoint:
    """QUIC connections sharing one UDP socket, each carrying one MOQT session.

    Args:
        stack: the QUIC implementation (:func:`.stack.load_stack`).
        configuration: the stack's ``QuicConfiguration`` (``is_client`` decides
            whether this endpoint accepts connections).
        app: receives new connections and session events.
        session_config: builds the :class:`SessionConfig` of a new session from
            its role (server connections) or is given per :meth:`connect`.
        max_unsent: per connection, see :class:`~.pump.SessionPump`.
        max_connections: accepted or opened connections alive at once.
        webtransport: a server also accepts MOQT over WebTransport (ALPN ``h3``;
            its configuration must offer that ALPN too).
    """

    def __init__(
        self,
        stack: QuicStack,
        configuration: Any,
        app: Application,
        *,
        session_config: Callable[[Role], SessionConfig] | None = None,
        max_unsent: int = DEFAULT_MAX_UNSENT,
        max_connections: int = 256,
        webtransport: bool = False,
    ) -> None:
        self.stack = stack
        self.webtransport = webtransport
        self.configuration = configuration
        self.app = app
        self.session_config = session_config or (lambda role: SessionConfig(role=role))
        self.max_unsent = max_unsent
        self.max_connections = max_connections
        self.pumps: list[SessionPump] = []
        self._by_cid: dict[bytes, SessionPump] = {}
        self._serial = 0
        self._pending_vn: list[tuple[bytes, Any]] = []

    # --- inputs ---------------------------------------------------------------------------

    def connect(
        self,
        addr: Any,
        now: float,
        *,
        configuration: Any = None,
        session_config: SessionConfig | None = None,
        webtransport: tuple[str, str] | None = None,
    ) -> SessionPump:
        """Open a client connection to ``addr``; the session starts after the handshake.

        ``configuration``: a client ``QuicConfiguration`` for this connection
        (server name, trust); the endpoint's own when omitted. ``webtransport``:
        ``(authority, path)`` of a WebTransport session to open (the configuration
        then offers ALPN ``h3``) instead of native QUIC.
        """
        if len(self.pumps) >= self.max_connections:
            raise RuntimeError(f"connection limit reached ({self.max_connections})")
        quic = self.stack.connection(configuration=configuration or self.configuration)
        config = session_config or self.session_config(Role.CLIENT)
        if webtransport is not None:
            config = attrs.evolve(config, webtransport=True)
        pump = self._adopt(quic, config, now, wt_target=webtransport)
        quic.connect(addr, now=now)
        pump.cid_changes.append((True, quic.host_cid))
        self._update_cids(pump)
        return pump

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        """Route one UDP datagram; garbage and strays are dropped."""
        pump = self._route(data, addr, now)
        if pump is not None:
            pump.receive_datagram(data, addr, now)
            self._update_cids(pump)

    def receive_datagrams(self, datagrams: Iterable[tuple[bytes, Any]], now: float) -> None:
        """Route datagrams read together: each connection handles the events they
        caused once, after its last datagram (same result as one by one, less work)."""
        fed: list[SessionPump] = []
        for data, addr in datagrams:
            pump = self._route(data, addr, now)
            if pump is not None and pump.feed_datagram(data, addr, now) and pump not in fed:
                fed.append(pump)
        for pump in fed:
            pump.process_events(now)
            self._update_cids(pump)

    def handle_timer(self, now: float) -> None:
        for pump in list(self.pumps):
            pump.handle_timer(now)
            self._update_cids(pump)
        deadline = self.app.get_timer()
        if deadline is not None and deadline <= now:
            self.app.handle_timer(now)

    def get_timer(self) -> float | None:
        timers = [p.get_timer() for p in self.pumps]
        timers.append(self.app.get_timer())
        present = [t for t in timers if t is not None]
        return min(present) if present else None

    # --- outputs ----------------------------------------------------------------------------

    def service(self, now: float) -> list[tuple[bytes, Any]]:
        """Dispatch session events, carry out what they caused, return datagrams to send."""
        for _ in range(MAX_SERVICE_ROUNDS):
            dispatched = False
            for pump in list(self.pumps):
                if not pump.announced and pump.handshake_complete:
                    # the session is known only now (native QUIC or WebTransport)
                    pump.announced = True
                    self.app.connection_made(pump, now)
                while pump.events:
                    self.app.handle_session_event(pump, pump.events.popleft(), now)
                    dispatched = True
            for pump in list(self.pumps):
                pump.flush(now)
            if not dispatched and not any(p.events for p in self.pumps):
                break
        out, self._pending_vn = self._pending_vn, []
        for pump in list(self.pumps):
            out.extend(pump.datagrams_to_send(now))
        for _ in range(MAX_SEND_ROUNDS):
            more = False
            for pump in list(self.pumps):
                if pump.flush(now):
                    more = True
                    out.extend(pump.datagrams_to_send(now))
            if not more:
                break
        self._reap()
        return out

    def close(self, now: float, code: int = 0, reason: str = "") -> None:
        """Close every session (their connections close with ``code``)."""
        for pump in list(self.pumps):
            pump.close(code, reason, now)

    @property
    def idle(self) -> bool:
        """No connection is left (all closed and drained)."""
        return not self.pumps

    # --- internals --------------------------------------------------------------------------

    def _route(self, data: bytes, addr: Any, now: float) -> SessionPump | None:
        """The connection ``data`` is for (a new one for a valid Initial), else ``None``."""
        cid_length = self.configuration.connection_id_length
        if data and not data[0] & 0x80:
            # a short header (RFC 9000 section 17.3): the Destination Connection ID
            # follows the first octet; known ones skip the full header parse
            pump = self._by_cid.get(data[1 : 1 + cid_length])
            if pump is not None:
                return pump
        try:
            header = self.stack.pull_header(data, cid_length)
        except ValueError:
            return None
        pump = self._by_cid.get(header.destination_cid)
        if pump is None:
            pump = self._accept(data, header, addr, now)
        return pump

    def _accept(self, data: bytes, header: Any, addr: Any, now: float) -> SessionPump | None:
        if self.configuration.is_client:
            return None
        version = header.version
        if (
            version is not None
            and version != 0
            and version not in self.configuration.supported_versions
        ):
            # answered from service(), with the connections' datagrams
            self._pending_vn.append(
                (
                    self.stack.encode_version_negotiation(
                        source_cid=header.destination_cid,
                        destination_cid=header.source_cid,
                        supported_versions=self.configuration.supported_versions,
                    ),
                    addr,
                )
            )
            return None
        if header.packet_type != self.stack.packet_type_initial or len(data) < SMALLEST_INITIAL:
            return None
        if len(self.pumps) >= self.max_connections:
            log.warning(
                "connection limit (%d) reached; dropping a new connection from %s",
                self.max_connections,
                addr,
            )
            return None
        quic = self.stack.connection(
            configuration=self.configuration,
            original_destination_connection_id=header.destination_cid,
        )
        pump = self._adopt(quic, self.session_config(Role.SERVER), now)
        self._by_cid[header.destination_cid] = pump
        pump.cid_changes.append((True, quic.host_cid))
        return pump

    def _adopt(
        self, quic: Any, config: SessionConfig, now: float, wt_target: tuple[str, str] | None = None
    ) -> SessionPump:
        self._serial += 1
        role = "client" if config.role is Role.CLIENT else "server"
        pump = SessionPump(
            self.stack,
            quic,
            MoqtSession(config),
            max_unsent=self.max_unsent,
            label=f"{role}#{self._serial}",
            webtransport=self.webtransport,
            wt_target=wt_target,
        )
        self.pumps.append(pump)
        return pump

    def _update_cids(self, pump: SessionPump) -> None:
        for issued, cid in pump.cid_changes:
            if issued:
                self._by_cid[cid] = pump
            elif self._by_cid.get(cid) is pump:
                del self._by_cid[cid]
        pump.cid_changes.clear()

    def _reap(self) -> None:
        for pump in [p for p in self.pumps if p.terminated and not p.events]:
            self.pumps.remove(pump)
            for cid in [c for c, p in self._by_cid.items() if p is pump]:
                del self._by_cid[cid]
