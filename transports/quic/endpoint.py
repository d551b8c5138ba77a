"""``QuicEndpoint``: one UDP socket's worth of QUIC connections, each a MoqtSession (sans-I/O).

Theory of operation
-------------------
An event-loop driver (:mod:`.asyncio_binding`, :mod:`.trio_binding`) owns a UDP socket and a
clock and does only three things: hand every datagram it reads to
:meth:`QuicEndpoint.receive_datagram`, call :meth:`QuicEndpoint.handle_timer`
when :meth:`QuicEndpoint.get_timer` falls due, and after either (or after the
application did something) call :meth:`QuicEndpoint.service` and send the
datagrams it returns, all of them in one call to the socket (so that
:mod:`.udp` can send them as GSO runs). Everything else is here, free of I/O,
so both drivers (and any other loop) share it.

* **Demultiplexing** (RFC 9000 section 5.2): datagrams are routed by their
  Destination Connection ID to the connection that issued it. A server creates
  a connection for a new Initial of at least 1200 bytes, answers an unknown
  QUIC version with Version Negotiation, and drops everything else. A client
  endpoint can hold several outgoing connections on its one socket.
* **Address validation** (RFC 9000 section 8.1.2): a stack that needs it
  (:attr:`.stack.QuicStack.retry`: qh3, for clients that pad their first datagram
  after the Initial packet, see :mod:`.stack`) answers such a new Initial with a
  Retry carrying a token that binds the client's address and the connection IDs;
  the client's next Initial returns it and the connection is created with the
  address validated. Nothing is held between the two: the token is encrypted and
  authenticated with the endpoint's own key (made on the first Retry), and one
  that does not validate (another server's, another address's) counts as no token.
* **Sessions.** Each connection carries one :class:`MoqtSession` through a
  :class:`~.pump.SessionPump`. The :class:`Application` (a relay, a
  publisher, a consumer, or several) is told of each new connection and gets
  every session event with ``now``; what it commands on any session goes out
  in the same :meth:`QuicEndpoint.service` call.
* **Bounds.** At most ``max_connections`` connections, and at most
  ``max_connections_per_address`` (default :data:`DEFAULT_MAX_PER_ADDRESS`,
  and never more than a quarter of ``max_connections``) from one IP address,
  so one client cannot lock the others out. A handshake over either limit is
  refused at once: the server answers the Initial with a QUIC
  CONNECTION_CLOSE, error CONNECTION_REFUSED (0x2, RFC 9000 section 20.1)
  and a reason phrase naming the limit (:data:`REFUSED_PER_ADDRESS`,
  :data:`REFUSED_FULL`), logged as a warning; a retransmitted Initial of the
  same attempt gets the same answer again without new work (a bounded record).
  Each connection holds at most ``max_unsent`` unsent bytes in its stack, and
  at most ``max_outstanding`` unsent or unacknowledged; all of them together
  hold about ``send_budget`` (each an even share, at least ``max_unsent``:
  :meth:`QuicEndpoint._share_send_budget`), so a relay's send buffers stay a
  fixed margin however many consumers it serves;
  :meth:`QuicEndpoint.service` loops a bounded number of rounds.
* **Failure isolation.** Any exception raised while one connection is worked
  on (its stack, or what its events caused) ends that connection alone,
  logged (:meth:`~.pump.SessionPump.fail`); the endpoint and the other
  connections go on, and no exception reaches the event-loop driver.
* **Delivery's share of a turn.** A relay busy taking in a publisher reads a
  batch of datagrams per turn (up to :data:`.udp.RECV_BATCH`), while a paced
  stack sends one burst per connection per call (aioquic: at most 16 packets,
  RFC 9002 section 7.7), so a live subscriber got about one datagram for every
  sixteen taken in, and its first layer came late. So after the usual rounds,
  :meth:`QuicEndpoint.service` asks the connections that still have stream data
  waiting again, with the driver's :attr:`QuicEndpoint.clock` read afresh (the
  pacer refills with time, and building a burst takes time), for as long as they
  produce datagrams, until it has sent as many as were received since the last
  call (at most :data:`MAX_FAIR_ROUNDS` rounds). The pacer still decides each
  burst; nothing is sent that the stack would not send. Without a clock, or with
  nothing received, nothing changes.
* **Links** (:class:`~.reconnect.Link`): client connections that are opened
  again, with backoff, when they end; the endpoint gives them its timer and
  shows them their connection's events first.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import attrs

from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.events import SessionEvent
from kvcs_core.moqt.session import MoqtSession

from .pump import DEFAULT_MAX_OUTSTANDING, DEFAULT_MAX_UNSENT, DEFAULT_SEND_BUDGET, SessionPump
from .stack import QuicStack

log = logging.getLogger("kvcs.quic")

SMALLEST_INITIAL = 1200
"""RFC 9000 section 14.1: a client's Initial datagram is at least 1200 bytes."""

MAX_SERVICE_ROUNDS = 64
"""Event-dispatch rounds per :meth:`QuicEndpoint.service` (events causing events)."""

MAX_SEND_ROUNDS = 8
"""Pull-and-send rounds per :meth:`QuicEndpoint.service` while QUIC keeps taking data."""

MAX_FAIR_ROUNDS = 64
"""Rounds of delivery's share per :meth:`QuicEndpoint.service` (module docstring)."""

DEFAULT_MAX_CONNECTIONS = 256
"""Connections an endpoint holds at once."""

DEFAULT_MAX_PER_ADDRESS = 32
"""Connections one IP address may hold at once (see the module docstring)."""

CONNECTION_REFUSED = 0x2
"""QUIC transport error CONNECTION_REFUSED (RFC 9000 section 20.1): a handshake over a limit."""

REFUSED_PER_ADDRESS = "too many connections from this address"
"""The reason phrase of a refusal over the per-address limit (the limit follows it)."""

REFUSED_FULL = "server full"
"""The reason phrase of a refusal over the endpoint's connection limit."""

MAX_REFUSALS_REMEMBERED = 256
"""Refused handshakes whose answer is kept to repeat for retransmitted Initials."""

MAX_ENDED_REMEMBERED = 1024
"""Connections that ended kept in :attr:`QuicEndpoint.ended` for observers."""


class Watcher(Protocol):
    """Something that shadows client connections of an endpoint (a :class:`~.reconnect.Link`)."""

    def handle_session_event(self, pump: SessionPump, event: SessionEvent, now: float) -> None: ...

    def service(self, now: float) -> None: ...

    def handle_timer(self, now: float) -> None: ...

    def get_timer(self) -> float | None: ...

    def stop(self) -> None: ...


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
        max_outstanding: per connection, see :class:`~.pump.SessionPump`.
        send_budget: bytes all connections together may hold in their stacks' send
            buffers (:data:`~.pump.DEFAULT_SEND_BUDGET`): each gets an even share,
            at least ``max_unsent`` and at most ``max_outstanding``.
        max_connections: accepted or opened connections alive at once.
        max_connections_per_address: accepted connections alive at once from one
            IP address (capped at a quarter of ``max_connections``, at least 1).
        webtransport: a server also accepts MOQT over WebTransport (ALPN ``h3``;
            its configuration must offer that ALPN too).
        keepalive: connections PING a quiet peer (see :mod:`.pump`).
    """

    def __init__(
        self,
        stack: QuicStack,
        configuration: Any,
        app: Application,
        *,
        session_config: Callable[[Role], SessionConfig] | None = None,
        max_unsent: int = DEFAULT_MAX_UNSENT,
        max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
        send_budget: int = DEFAULT_SEND_BUDGET,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_address: int = DEFAULT_MAX_PER_ADDRESS,
        webtransport: bool = False,
        keepalive: bool = True,
    ) -> None:
        self.stack = stack
        self.webtransport = webtransport
        self.configuration = configuration
        self.app = app
        self.session_config = session_config or (lambda role: SessionConfig(role=role))
        self.max_unsent = max_unsent
        self.max_outstanding = max_outstanding
        self.send_budget = send_budget
        self.max_connections = max_connections
        self.max_connections_per_address = max(
            1, min(max_connections_per_address, max_connections // 4)
        )
        self.keepalive = keepalive
        self.pumps: list[SessionPump] = []
        self.links: list[Watcher] = []
        """Reconnecting client connections (:class:`~.reconnect.Link`) on this endpoint."""
        self.refused = 0
        """Handshakes refused over a connection limit so far."""
        self.accepted = 0
        """Connections accepted (server) or opened (client) so far."""
        self.ended: deque[SessionPump] = deque(maxlen=MAX_ENDED_REMEMBERED)
        """The latest connections that ended and were let go, oldest first (observers such
        as ``kvcs relay --json`` take them from here: ``pump.close_reason``,
        ``pump.ended_how``); at most :data:`MAX_ENDED_REMEMBERED`."""
        self.ended_total = 0
        """Connections that ended and were let go so far."""
        self._by_cid: dict[bytes, SessionPump] = {}
        self._by_host: dict[Any, int] = {}
        self._host_of: dict[SessionPump, Any] = {}
        self._refusals: dict[bytes, list[bytes]] = {}
        self._serial = 0
        self._pending_vn: list[tuple[bytes, Any]] = []
        self.retries = 0
        """Retry packets sent so far (address validation, module docstring)."""
        self._retry_tokens: Any = None
        self._now = 0.0
        """The latest time an input carried (for work that is given none)."""
        self.clock: Callable[[], float] | None = None
        """The driver's clock (the same as the ``now`` it passes), read during
        :meth:`service` for delivery's share of a turn (module docstring); ``None``: not
        read."""
        self._received = 0
        """Datagrams received for a connection since the last :meth:`service`."""

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
        pump.peer = addr
        quic.connect(addr, now=now)
        pump.cid_changes.append((True, quic.host_cid))
        self._update_cids(pump)
        return pump

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        """Route one UDP datagram; garbage and strays are dropped."""
        pump = self._route(data, addr, now)
        if pump is not None:
            self._received += 1
            self._guard(pump, "receive", now, pump.receive_datagram, data, addr, now)
            self._update_cids(pump)

    def receive_datagrams(self, datagrams: Iterable[tuple[bytes, Any]], now: float) -> None:
        """Route datagrams read together: consecutive ones for one connection from one
        address go to its stack in one call, and each connection handles the events they
        caused once, after its last datagram (same result as one by one, less work)."""
        fed: list[SessionPump] = []
        run: list[bytes] = []  # consecutive datagrams for one connection from one address
        run_pump: SessionPump | None = None
        run_addr: Any = None
        by_cid = self._by_cid
        cid_end = 1 + self.configuration.connection_id_length
        received = 0
        for data, addr in datagrams:
            # the common case inline, once per datagram: a short header (RFC 9000
            # section 17.3) of a known connection; anything else is parsed (_route_by_header)
            pump = by_cid.get(data[1:cid_end]) if data and not data[0] & 0x80 else None
            if pump is None:
                pump = self._route_by_header(data, addr, now)
                if pump is None:
                    continue
            received += 1
            if pump is run_pump and addr == run_addr:
                run.append(data)
                continue
            if run_pump is not None and run_pump.feed_datagrams(run, run_addr, now):
                fed.append(run_pump)
            run, run_pump, run_addr = [data], pump, addr
        self._received += received
        if run_pump is not None and run_pump.feed_datagrams(run, run_addr, now):
            fed.append(run_pump)
        for pump in dict.fromkeys(fed):
            self._guard(pump, "receive", now, pump.process_events, now)
            self._update_cids(pump)

    def handle_timer(self, now: float) -> None:
        for pump in list(self.pumps):
            self._guard(pump, "timer", now, pump.handle_timer, now)
            self._update_cids(pump)
        for link in list(self.links):
            link.handle_timer(now)
        deadline = self.app.get_timer()
        if deadline is not None and deadline <= now:
            try:
                self.app.handle_timer(now)
            except Exception as exc:  # never into the driver (module docstring)
                log.warning("application timer failed: %r", exc)

    def get_timer(self) -> float | None:
        timers = []
        for pump in list(self.pumps):
            try:
                timers.append(pump.get_timer())
            except Exception as exc:
                pump.fail("get_timer", exc, self._now)
        timers.extend(link.get_timer() for link in self.links)
        try:
            timers.append(self.app.get_timer())
        except Exception as exc:
            log.warning("application timer failed: %r", exc)
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
                    self._guard(pump, "connection_made", now, self.app.connection_made, pump, now)
                if self._guard(pump, "events", now, self._dispatch, pump, now):
                    dispatched = True
            for pump in list(self.pumps):
                self._guard(pump, "flush", now, pump.flush, now)
            if not dispatched and not any(p.events for p in self.pumps):
                break
        out, self._pending_vn = self._pending_vn, []
        for pump in list(self.pumps):
            out.extend(self._guard(pump, "send", now, pump.datagrams_to_send, now) or ())
        for _ in range(MAX_SEND_ROUNDS):
            more = False
            for pump in list(self.pumps):
                if self._guard(pump, "flush", now, pump.flush, now):
                    more = True
                    out.extend(self._guard(pump, "send", now, pump.datagrams_to_send, now) or ())
            if not more:
                break
        self._delivery_share(out)
        self._reap()
        for link in list(self.links):
            link.service(now)
        return out

    def _delivery_share(self, out: list[tuple[bytes, Any]]) -> None:
        """Ask the connections with stream data waiting again, at the clock's time, while
        they produce datagrams and until ``out`` holds as many as were received since the
        last call (module docstring, "Delivery's share of a turn")."""
        budget, self._received = self._received, 0
        clock = self.clock
        if clock is None:
            return
        sent = len(out)
        for _ in range(MAX_FAIR_ROUNDS):
            if sent >= budget:
                return
            now = clock()
            more = 0
            for pump in list(self.pumps):
                if not pump.sending:
                    continue
                self._guard(pump, "flush", now, pump.flush, now)
                got = self._guard(pump, "send", now, pump.datagrams_to_send, now) or ()
                out.extend(got)
                more += len(got)
            if not more:
                return
            sent += more

    def _dispatch(self, pump: SessionPump, now: float) -> bool:
        dispatched = False
        while pump.events:
            event = pump.events.popleft()
            for link in list(self.links):
                link.handle_session_event(pump, event, now)
            self.app.handle_session_event(pump, event, now)
            dispatched = True
        return dispatched

    def _guard(self, pump: SessionPump, what: str, now: float, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; an exception ends ``pump``'s connection only (module docstring)."""
        self._now = max(self._now, now)
        try:
            return fn(*args)
        except Exception as exc:
            pump.fail(what, exc, now)
            return None

    def flush_qlog(self) -> int:
        """Write the qlog traces of connections that have not ended yet (:mod:`.qlog`);
        returns how many (0 without qlog)."""
        logger = getattr(self.configuration, "quic_logger", None)
        flush = getattr(logger, "flush", None)
        return int(flush()) if callable(flush) else 0

    def close(self, now: float, code: int = 0, reason: str = "") -> None:
        """Close every session (their connections close with ``code``); links stop."""
        for link in list(self.links):
            link.stop()
        for pump in list(self.pumps):
            self._guard(pump, "close", now, pump.close, code, reason, now)

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
        return self._route_by_header(data, addr, now)

    def _route_by_header(self, data: bytes, addr: Any, now: float) -> SessionPump | None:
        """:meth:`_route` past its short-header lookup: the full header parse."""
        cid_length = self.configuration.connection_id_length
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
        validated = self._validated(data, header, addr)
        if validated is None:
            return None
        host = _host(addr)
        held = self._by_host.get(host, 0)
        if held >= self.max_connections_per_address:
            self._refuse(
                data,
                header,
                addr,
                now,
                f"{REFUSED_PER_ADDRESS} (limit {self.max_connections_per_address})",
            )
            return None
        if len(self.pumps) >= self.max_connections:
            self._refuse(data, header, addr, now, f"{REFUSED_FULL} (limit {self.max_connections})")
            return None
        quic = self.stack.connection(configuration=self.configuration, **validated)
        pump = self._adopt(quic, self.session_config(Role.SERVER), now)
        pump.peer = addr
        self._by_host[host] = held + 1
        self._host_of[pump] = host
        self._by_cid[header.destination_cid] = pump
        pump.cid_changes.append((True, quic.host_cid))
        return pump

    def _validated(self, data: bytes, header: Any, addr: Any) -> dict[str, bytes] | None:
        """The connection IDs a new server connection is created with, or ``None`` when a
        Retry was queued instead (address validation, module docstring)."""
        ids = {"original_destination_connection_id": header.destination_cid}
        kit = self.stack.retry
        if kit is None:
            return ids
        if header.token and self._retry_tokens is not None:
            try:
                odcid, retry_scid = self._retry_tokens.validate_token(addr, header.token)
            except Exception as exc:
                # not ours, or not for this address: as if none (any failure of the
                # stack's check: qh3 raises ValueError, or for a token it cannot decrypt
                # its CryptoError, which is no ValueError)
                log.debug("Retry token from %s does not validate: %s", _host(addr), exc)
            else:
                return {
                    "original_destination_connection_id": odcid,
                    "retry_source_connection_id": retry_scid,
                }
        if not kit.needed(data, self.configuration.connection_id_length):
            return ids
        try:
            if self._retry_tokens is None:
                self._retry_tokens = kit.token_handler()
            retry_scid = secrets.token_bytes(self.configuration.connection_id_length)
            token = self._retry_tokens.create_token(addr, header.destination_cid, retry_scid)
            packet = kit.encode_retry(
                version=header.version,
                source_cid=retry_scid,
                destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid,
                retry_token=token,
            )
        except Exception as exc:
            # the stack could not make a Retry: the connection goes ahead unvalidated,
            # as without the Retry (the handshake may then stall for a client that pads
            # outside its packet, but a stack fault never reaches the driver)
            log.warning("no Retry for %s (%s): accepting it unvalidated", _host(addr), exc)
            return ids
        self._pending_vn.append((packet, addr))  # sent from service(), as refusals are
        self.retries += 1
        return None

    def _refuse(self, data: bytes, header: Any, addr: Any, now: float, reason: str) -> None:
        """Answer a new connection's Initial with CONNECTION_CLOSE CONNECTION_REFUSED."""
        dcid = header.destination_cid
        answer = self._refusals.get(dcid)
        if answer is None:
            self.refused += 1
            log.warning("refusing a new connection from %s: %s", _host(addr), reason)
            answer = []
            try:
                quic = self.stack.connection(
                    configuration=self.configuration, original_destination_connection_id=dcid
                )
                quic.receive_datagram(data, addr, now)
                quic.close(error_code=CONNECTION_REFUSED, frame_type=0, reason_phrase=reason)
                answer = [d for d, _ in self.stack.datagrams_to_send(quic, now)]
                logger = getattr(self.configuration, "quic_logger", None)
                trace = getattr(quic, "_quic_logger", None)
                if logger is not None and trace is not None:
                    # with qlog on (.qlog): this connection is dropped here, so its
                    # trace is written now instead of being held forever
                    logger.end_trace(trace)
            except Exception as exc:  # the refusal is best effort: the peer then times out
                log.debug("refusal to %s not built: %s", addr, exc)
            if len(self._refusals) >= MAX_REFUSALS_REMEMBERED:
                del self._refusals[next(iter(self._refusals))]
            self._refusals[dcid] = answer
        self._pending_vn.extend((d, addr) for d in answer)

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
            max_outstanding=self.max_outstanding,
            label=f"{role}#{self._serial}",
            webtransport=self.webtransport,
            wt_target=wt_target,
            keepalive=self.keepalive,
        )
        self.pumps.append(pump)
        self.accepted += 1
        self._share_send_budget()
        return pump

    def _share_send_budget(self) -> None:
        """Give each connection an even share of ``send_budget`` as its send window (at
        least ``max_unsent``, so each can always write; at most ``max_outstanding``),
        whenever the number of connections changes. A connection that only receives
        (a relay's publisher) holds no share in practice, only a bound on one."""
        if not self.pumps:
            return
        share = max(self.max_unsent, self.send_budget // len(self.pumps))
        for pump in self.pumps:
            pump.window_share = min(share, self.max_outstanding)

    def _update_cids(self, pump: SessionPump) -> None:
        for issued, cid in pump.cid_changes:
            if issued:
                self._by_cid[cid] = pump
            elif self._by_cid.get(cid) is pump:
                del self._by_cid[cid]
        pump.cid_changes.clear()

    def _reap(self) -> None:
        ended = [p for p in self.pumps if p.terminated and not p.events]
        for pump in ended:
            self.pumps.remove(pump)
            self.ended.append(pump)
            self.ended_total += 1
            for cid in [c for c, p in self._by_cid.items() if p is pump]:
                del self._by_cid[cid]
            host = self._host_of.pop(pump, None)
            if host is not None:
                left = self._by_host.get(host, 1) - 1
                if left > 0:
                    self._by_host[host] = left
                else:
                    self._by_host.pop(host, None)
        if ended:
            self._share_send_budget()


def _host(addr: Any) -> Any:
    """The IP address of a UDP address (what the per-address limit counts)."""
    return addr[0] if isinstance(addr, tuple) and addr else addr
