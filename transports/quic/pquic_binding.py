"""kvcs over picoquic (``aiopquic``): a third QUIC stack, ``stack="pquic"``, asyncio only.

Theory of operation
-------------------
aiopquic runs picoquic on its own network thread, with its own UDP socket,
and talks to the asyncio thread over rings: there are no datagrams to feed
and no timers to run, so the sans-I/O part of kvcs (:class:`~.endpoint.QuicEndpoint`,
:class:`~.pump.SessionPump`) is bound to it one level up, at the stream level.

* **Connections.** :class:`PquicConnection` wraps one aiopquic
  ``QuicConnection`` in the aioquic-shaped surface the pump drives
  (``next_event``, ``send_stream_data``, ``reset_stream``, ``stop_stream``,
  ``send_datagram_frame``, ``close``, stream IDs); aiopquic's events already
  have aioquic's names and fields, so the pump translates them into the
  session's :mod:`~kvcs_core.moqt.transport_io` events unchanged. A stack
  that owns its socket has no timer (``get_timer`` is ``None``) and no
  datagrams to hand out; keep-alive PINGs are picoquic's own
  (``keep_alive_interval``, a third of the idle timeout as in :mod:`.pump`).
* **Stream IDs.** As with aioquic, asking for the next stream ID does not take
  it; the first write to it does (aiopquic's own ``get_next_available_stream_id``
  allocates on every call, so it is not used).
* **Backpressure.** A write goes into the stream's send ring in picoquic's
  thread (one copy: aiopquic takes ``bytes``). The pump pulls object data
  from the session only while the connection's written-but-unsent bytes
  (``tx_data_ring_used`` of each stream: bytes picoquic has not yet taken into
  packets, plus any held here) are below ``max_unsent`` (1 MiB), so nothing
  is buffered beyond that bound. A write that aiopquic refuses for want of
  room (``BufferError``: its TX event ring or the stream's ring is full; it
  commits nothing) is held here, in order, and retried before anything new
  is pulled; it counts as unsent, so the pump pulls nothing while it waits.
  While a connection has *any* written-but-unsent bytes (not only at its
  bound) the driver arms aiopquic's per-stream drain signal
  (``set_tx_data_drain_pending``), whose event wakes it as soon as picoquic
  takes bytes from the ring; a short fallback timer covers a signal lost to
  a full ring. Nothing else would wake it: picoquic handles ACKs in its own
  thread, and a pump stops pulling short of its bound whenever the budget
  left is smaller than what comes next (a new stream's header, a datagram),
  so waiting only at the bound stalled a lone publisher until some unrelated
  event arrived (with a relay and a consumer each in its own process, until
  the consumer's 10 s stall timer).
* **Lost signals.** Besides its eventfd signals, the driver reads every live
  connection (and a server's engine) every :data:`RX_RECHECK` seconds
  (:data:`RX_RECHECK_IDLE` for a server without connections). Without it, in
  about 1 of 20 late transfers through two pquic relays (256 MiB, separate
  processes) a relay and the consumer slept with events waiting in aiopquic's
  rings that no signal announced: the leaf relay stopped reading from the root
  (the root then stopped too, its peer's credit spent) and forwarding to the
  consumer, which gave up after its 10 s stall timer with 0 objects verified.
  With it, 40 of 40 such runs completed; the reads that find something are
  counted (``PquicDriver.lost_signals``, an upper bound: a signal may just not
  have been handled yet) and logged at debug level. Where aiopquic loses the
  signal was not found. Once no connection has had an event for
  :data:`RX_QUIET_AFTER` seconds, the fallback read slows to
  :data:`RX_RECHECK_IDLE`: an idle relay or client wakes twice a second, not
  twenty times, and the first event takes it back to :data:`RX_RECHECK`.
* **Receive memory.** aiopquic hands a stream's received bytes to the asyncio
  thread through a byte ring per stream, sized to the stream's flow-control window
  (``max_stream_data``, the most a peer may send before it is read), and
  picoquic extends the window as the ring is read. So the window is memory per
  stream being received, not only a bound on the peer: with the 16 MiB kvcs gives
  the other stacks (which buffer only what arrives), a pquic relay forwarding a
  256 MiB cache live peaked 73 MiB above its cache and an idle relay, past the
  64 MiB goal (issue 11, ``benchmarks/bench_memory.py``); with
  :data:`PQUIC_MAX_STREAM_DATA` (4 MiB) it peaked 44 MiB above, and the consumer
  33 instead of 49, with no loss of goodput on loopback (two-relay trees were
  faster). The cost is on long paths: one stream moves at most 4 MiB per round
  trip (about 80 MB/s at 50 ms), and a cache's K and V tracks are two streams.
* **Stream credit.** picoquic keeps the peer's MAX_STREAMS to itself and
  holds a stream opened beyond it until credit arrives (RFC 9000 section 4.6);
  no :class:`~kvcs_core.moqt.transport_io.StreamCredit` is reported, so the
  session opens requests at once and picoquic queues them. Every MOQT request
  is a bidirectional stream open while it lives, and a publication's KVSP index
  keeps one PUBLISH_NAMESPACE per indexed block (:mod:`.stack`), so kvcs grants
  the peer :data:`~.stack.PEER_BIDI_STREAMS` (1024) of them, as on the other
  stacks. With aiopquic's own 512, a publication of 512 blocks or more (8192
  tokens in 16-token blocks) through a pquic relay stalled: its requests past
  the 512th waited for credit that never came, so the publisher's drain (every
  written byte sent) timed out and the consumer never completed.
* **Endpoints.** A server (:class:`PquicEndpoint` with a server
  configuration) is one aiopquic ``QuicEngine``: one picoquic context, one
  socket, one thread, every accepted connection demultiplexed by picoquic.
  Each client connection gets its own aiopquic transport (socket and thread),
  as aiopquic clients do. Connection limits: picoquic refuses handshakes over
  ``max_connections`` itself; over the per-address limit a connection is
  closed with CONNECTION_REFUSED (0x2) once picoquic announces it.
* **Limits of this stack.** asyncio only (aiopquic's rings signal an eventfd
  read with ``loop.add_reader``; under trio the binding refuses with
  :class:`~.stack.StackUnavailable`); no WebTransport through kvcs; a
  server binds the wildcard address of the listen address's family (aiopquic
  takes no host), and a listen port of 0 is chosen here before binding (a
  free UDP port on that host; aiopquic does not report the one it bound); a
  port that is already bound is refused (a probe bind first: picoquic itself
  would share it silently);
  the reason phrase of our CONNECTION_CLOSE is not sent (aiopquic takes a
  code only); ``max_datagram_size`` is picoquic's own (path MTU discovery).
* **A pquic client and a qh3 2.1 server.** qh3 credits a client's first
  datagram with its Initial packet alone, not the padding picoquic puts after
  it, so its anti-amplification budget was too small for a ServerHello Initial
  picoquic accepts, and the handshake never completed (qh3's ``poll_transmit``
  raising "packet builder capacity exhausted", picoquic repeating its Initial
  about a thousand times a second). A qh3 endpoint now validates such a
  client's address with a Retry first (:mod:`.stack`, :mod:`.endpoint`), after
  which no budget applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import ipaddress
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

from kvcs_core.moqt.config import Role, SessionConfig

from ._asyncio_driving import AsyncioDriving
from .api import ConnectError
from .endpoint import QuicEndpoint
from .pump import DEFAULT_MAX_UNSENT, SessionPump, keepalive_interval
from .stack import PEER_BIDI_STREAMS, QuicStack, StackUnavailable

log = logging.getLogger("kvcs.quic")

NAME = "pquic"

MAX_WRITE = 1 << 20
"""The largest piece handed to aiopquic in one call (at most its ``stream_ring_cap``,
4 MiB by default: a larger write is refused outright)."""

PQUIC_MAX_STREAM_DATA = 4 << 20
"""The per-stream receive window of kvcs's pquic connections (4 MiB; 16 MiB on the other
stacks): aiopquic gives every stream it receives on a byte ring of this size (module
docstring, "Receive memory")."""

BACKPRESSURE_RECHECK = 0.005
"""Seconds after which a connection at its unsent bound is looked at again even if no
drain signal came (a signal can be lost to a full event ring)."""

RX_RECHECK = 0.05
"""Seconds after which every live connection is read again even if picoquic signalled
nothing (module docstring, "Lost signals")."""

RX_RECHECK_IDLE = 0.5
"""The same for a server without connections (a new connection's first events), and for
connections that have been quiet for :data:`RX_QUIET_AFTER` seconds."""

RX_QUIET_AFTER = 1.0
"""Seconds without any event on any connection after which the fallback read slows from
:data:`RX_RECHECK` to :data:`RX_RECHECK_IDLE` (module docstring, "Lost signals")."""

CONNECTION_REFUSED = 0x2
"""QUIC CONNECTION_REFUSED (RFC 9000 section 20.1)."""

TRIO_REFUSED = (
    "the pquic stack runs on asyncio only (aiopquic signals through an eventfd read by "
    "the asyncio loop); use --loop asyncio"
)


def _import_aiopquic() -> tuple[ModuleType, ModuleType, ModuleType]:
    quiet = logging.getLogger("aiopquic")
    if quiet.level == logging.NOTSET:
        # it logs every peer RESET_STREAM as a warning; MOQT resets streams routinely
        # (the pump logs how each connection ended)
        quiet.setLevel(logging.ERROR)
    try:
        cfg = importlib.import_module("aiopquic.quic.configuration")
        conn = importlib.import_module("aiopquic.quic.connection")
        events = importlib.import_module("aiopquic.quic.events")
    except ImportError as exc:
        raise StackUnavailable(
            f"QUIC stack 'pquic' is not installed ({exc}; it needs Python >= 3.12 and "
            "pip install 'kvcs[pquic]')"
        ) from exc
    return cfg, conn, events


class PquicConnection:
    """One aiopquic ``QuicConnection`` behind the aioquic-shaped surface of the pump."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.configuration = inner.configuration
        client = bool(self.configuration.is_client)
        self._next_bidi = 0 if client else 1
        self._next_uni = 2 if client else 3
        self._held: dict[int, deque[tuple[bytes, bool]]] = {}
        self._held_bytes: dict[int, int] = {}
        self._written: set[int] = set()
        """Streams written to whose ring may still hold unsent bytes."""
        self.host_cid = b""
        self.events_taken = 0
        """Events taken from aiopquic so far (the driver's fallback read counts its finds)."""
        self._max_write = max(1, min(MAX_WRITE, int(self.configuration.stream_ring_cap)))

    # --- what the pump calls ----------------------------------------------------------------

    def next_event(self) -> Any:
        event = self.inner.next_event()
        if event is not None:
            self.events_taken += 1
        return event

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        return self._next_uni if is_unidirectional else self._next_bidi

    def send_stream_data(self, stream_id: int, data: Any, end_stream: bool = False) -> None:
        self._take_id(stream_id)
        if not data and not end_stream:
            return  # the pump's "reserve the ID": taken above, nothing to send
        raw = data if isinstance(data, bytes) else bytes(data)
        step = self._max_write
        pieces = [raw[i : i + step] for i in range(0, len(raw), step)] or [b""]
        for i, piece in enumerate(pieces):
            self._send(stream_id, piece, end_stream and i == len(pieces) - 1)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self._drop_held(stream_id)
        self._written.discard(stream_id)
        self.inner.reset_stream(stream_id, error_code)

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        self.inner.stop_stream(stream_id, error_code)

    def send_datagram_frame(self, data: bytes) -> None:
        try:
            if not self.inner.send_datagram_frame(data):
                log.debug("pquic: datagram dropped (its ring is full)")
        except (ValueError, ConnectionError) as exc:  # too large for one frame, or closed
            log.debug("pquic: datagram not sent: %s", exc)

    def close(
        self, error_code: int = 0, frame_type: int | None = None, reason_phrase: str = ""
    ) -> None:
        self.inner.close(error_code)

    def get_timer(self) -> float | None:
        return None

    def handle_timer(self, now: float) -> None:
        return None

    def send_ping(self, uid: int) -> None:
        return None  # picoquic sends its own keep-alive PINGs

    # --- backpressure -----------------------------------------------------------------------

    def unsent(self, stream_id: int) -> int:
        """Bytes written to ``stream_id`` that picoquic has not taken into packets yet."""
        n = self._held_bytes.get(stream_id, 0)
        if stream_id in self._written:
            used = int(self.inner.tx_data_ring_used(stream_id))
            if used == 0 and not n:
                self._written.discard(stream_id)
            n += used
        return n

    def unsent_total(self) -> int:
        return sum(self.unsent(sid) for sid in list(self._written | set(self._held)))

    @property
    def holding(self) -> bool:
        """Writes refused for want of room wait here."""
        return bool(self._held)

    def retry_held(self) -> None:
        """Hand aiopquic what it refused before, in order, while it takes it."""
        for sid in list(self._held):
            queue = self._held[sid]
            while queue:
                data, fin = queue[0]
                if not self._push(sid, data, fin):
                    break
                queue.popleft()
                self._held_bytes[sid] -= len(data)
            if not queue:
                del self._held[sid]
                del self._held_bytes[sid]

    def arm_drain(self) -> None:
        """Ask picoquic for a wake-up when it next takes bytes from a stream we wait on."""
        for sid in list(self._written):
            self.inner.set_tx_data_drain_pending(sid)

    # --- internals --------------------------------------------------------------------------

    def _take_id(self, stream_id: int) -> None:
        ours = bool(stream_id & 1) == (not self.configuration.is_client)
        if not ours:
            return
        if stream_id & 2:
            self._next_uni = max(self._next_uni, stream_id + 4)
        else:
            self._next_bidi = max(self._next_bidi, stream_id + 4)

    def _send(self, stream_id: int, data: bytes, fin: bool) -> None:
        if stream_id in self._held or not self._push(stream_id, data, fin):
            self._held.setdefault(stream_id, deque()).append((data, fin))
            self._held_bytes[stream_id] = self._held_bytes.get(stream_id, 0) + len(data)

    def _push(self, stream_id: int, data: bytes, fin: bool) -> bool:
        try:
            self.inner.send_stream_data(stream_id, data, fin)
        except BufferError:
            return False
        if data:
            self._written.add(stream_id)
        return True

    def _drop_held(self, stream_id: int) -> None:
        self._held.pop(stream_id, None)
        self._held_bytes.pop(stream_id, None)


def _unsent(conn: Any, stream_id: int) -> int:
    return int(conn.unsent(stream_id))


def _no_header(data: bytes, cid_length: int) -> Any:
    raise ValueError("pquic: picoquic demultiplexes its own datagrams")


def _no_vn(**kwargs: Any) -> bytes:
    raise ValueError("pquic: picoquic answers version negotiation itself")


def load_pquic_stack() -> QuicStack:
    """The :class:`~.stack.QuicStack` of aiopquic (:class:`~.stack.StackUnavailable` if
    it is not installed)."""
    cfg_mod, _conn_mod, events_mod = _import_aiopquic()
    return QuicStack(
        name=NAME,
        configuration=cfg_mod.QuicConfiguration,
        connection=PquicConnection,
        events=events_mod,
        pull_header=_no_header,
        encode_version_negotiation=_no_vn,
        packet_type_initial=None,
        unsent_bytes=_unsent,
        datagrams_to_send=lambda conn, now: [],
        bidi_credit=lambda conn: None,
        endpoint=PquicEndpoint,
        max_stream_data=PQUIC_MAX_STREAM_DATA,
    )


def is_pquic(endpoint: Any) -> bool:
    return isinstance(endpoint, PquicEndpoint)


class _Protocol:
    """What aiopquic's ``QuicEngine`` calls per accepted connection: it marks the pump."""

    def __init__(self, endpoint: PquicEndpoint, inner: Any) -> None:
        self.endpoint = endpoint
        self.inner = inner
        self._loop: Any = None
        self.pump: SessionPump | None = endpoint.accept(inner)

    def _process_events(self) -> None:
        if self.pump is not None:
            self.endpoint.dirty.add(self.pump)
        else:  # refused: nothing reads its events
            while self.inner.next_event() is not None:
                pass

    def close(self) -> None:
        self.inner.close()


class PquicEndpoint(QuicEndpoint):
    """A :class:`~.endpoint.QuicEndpoint` whose connections are aiopquic's (module doc)."""

    def __init__(self, stack: QuicStack, configuration: Any, app: Any, **kwargs: Any) -> None:
        kwargs["keepalive"] = False  # picoquic's keep_alive_interval instead
        kwargs["webtransport"] = False
        super().__init__(stack, configuration, app, **kwargs)
        self.dirty: set[SessionPump] = set()
        """Connections with events to read."""
        self.on_client: Callable[[SessionPump], None] | None = None
        """Set by the driver: a new client connection's transport to watch."""
        self.on_gone: Callable[[SessionPump], None] | None = None
        """Set by the driver: a reaped connection (its client transport is stopped)."""
        _tune(configuration)
        configuration.max_connections = self.max_connections

    def connect(
        self,
        addr: Any,
        now: float,
        *,
        configuration: Any = None,
        session_config: SessionConfig | None = None,
        webtransport: tuple[str, str] | None = None,
    ) -> SessionPump:
        if webtransport is not None:
            raise ConnectError("WebTransport is not supported on the pquic stack")
        if len(self.pumps) >= self.max_connections:
            raise RuntimeError(f"connection limit reached ({self.max_connections})")
        _cfg, conn_mod, _ev = _import_aiopquic()
        cfg = configuration or self.configuration
        _tune(cfg)
        inner = conn_mod.QuicConnection(configuration=cfg)
        inner._start_transport(port=0)
        conn = PquicConnection(inner)
        pump = self._adopt(conn, session_config or self.session_config(Role.CLIENT), now)
        pump.peer = addr
        if self.on_client is not None:
            self.on_client(pump)
        inner.connect((addr[0], addr[1]))
        return pump

    def accept(self, inner: Any) -> SessionPump | None:
        """A connection picoquic accepted: a pump for it, or ``None`` (refused)."""
        peer = inner.peer_address()
        host = peer[0] if peer else None
        held = self._by_host.get(host, 0)
        if held >= self.max_connections_per_address:
            self.refused += 1
            log.warning(
                "refusing a new connection from %s: too many connections from this address "
                "(limit %d)",
                host,
                self.max_connections_per_address,
            )
            inner.close(CONNECTION_REFUSED)
            return None
        pump = self._adopt(PquicConnection(inner), self.session_config(Role.SERVER), self._now)
        pump.peer = peer
        self._by_host[host] = held + 1
        self._host_of[pump] = host
        self.dirty.add(pump)
        return pump

    def read(self, now: float) -> None:
        """Carry what picoquic reported on the marked connections to their sessions."""
        while self.dirty:
            pump = self.dirty.pop()
            if pump in self.pumps:
                self._guard(pump, "receive", now, pump.process_events, now)

    def backpressured(self) -> list[PquicConnection]:
        """Connections with written bytes picoquic has not taken yet, or refused writes.

        Not only those at their unsent bound: a pump can stop pulling short of it (the
        budget left is smaller than what comes next, e.g. a new stream's header), and
        picoquic takes the bytes in its own thread without a word to this one (ACKs
        never reach asyncio), so nothing would call the pump again.
        """
        out = []
        for pump in self.pumps:
            conn = pump.quic
            if not pump.terminated and (conn.holding or conn.unsent_total() > 0):
                out.append(conn)
        return out

    def _reap(self) -> None:
        before = list(self.pumps)
        super()._reap()
        for pump in before:
            if pump not in self.pumps:
                self.dirty.discard(pump)
                if self.on_gone is not None:
                    self.on_gone(pump)


def _tune(cfg: Any) -> None:
    """What every kvcs configuration of this stack sets: picoquic's keep-alive PINGs, and
    the bidirectional streams the peer may open (module docstring, "Stream credit")."""
    cfg.keep_alive_interval = keepalive_interval(float(cfg.idle_timeout))
    cfg.max_streams_bidi = PEER_BIDI_STREAMS


def _free_port(host: str, family: int) -> int:
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _family(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


class _Address:
    """``driver.udp.address``, as the UDP drivers have it (:class:`~.api.RelayServer`)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address


class PquicDriver(AsyncioDriving):
    """Drives a :class:`PquicEndpoint` in the running asyncio loop (the asyncio binding's
    ``open_endpoint`` for this stack)."""

    def __init__(self, endpoint: PquicEndpoint, address: tuple[str, int]) -> None:
        self.endpoint = endpoint
        self.udp = _Address(address)
        self._loop = asyncio.get_running_loop()
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._changed = asyncio.Event()
        self._closed = False
        self._engine: Any = None
        self._clients: dict[SessionPump, int] = {}
        self.lost_signals = 0
        """Fallback reads that found events waiting (their signal lost, or not handled yet)."""
        self.fallback_reads = 0
        """Fallback reads so far (module docstring, "Lost signals")."""
        self._events_seen = 0
        self._last_event_at = self.now()
        """When an event was last taken from any connection (the fallback read's pace)."""
        endpoint.on_client = self._watch_client
        endpoint.on_gone = self._forget

    # --- server -----------------------------------------------------------------------------

    def listen(self, host: str, port: int) -> tuple[str, int]:
        _cfg, conn_mod, _ev = _import_aiopquic()
        family = _family(host)
        if port == 0:
            port = _free_port(host, family)
        else:  # picoquic shares a bound port without a word: ask the kernel first
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        cfg = self.endpoint.configuration
        cfg.ip_family = family

        def protocol(inner: Any, stream_handler: Any = None) -> _Protocol:
            return _Protocol(self.endpoint, inner)

        engine = conn_mod.QuicEngine(configuration=cfg, create_protocol=protocol)
        try:
            engine._start_transport(port=port)
        except (RuntimeError, OSError) as exc:
            with contextlib.suppress(Exception):
                engine.close()
            raise OSError(f"{exc} (pquic)") from None
        self._engine = engine
        self._loop.add_reader(engine.eventfd, self._on_server_readable)
        self.wake()  # arms the fallback read ("Lost signals")
        return host, port

    def _on_server_readable(self) -> None:
        try:
            self._engine.drain_and_route()
            self.endpoint.read(self.now())
        except Exception as exc:
            log.warning("pquic: server input failed: %r", exc)
        self.wake()

    # --- clients ----------------------------------------------------------------------------

    def _watch_client(self, pump: SessionPump) -> None:
        fd = int(pump.quic.inner.eventfd)
        self._clients[pump] = fd
        self._loop.add_reader(fd, self._on_client_readable, pump)

    def _on_client_readable(self, pump: SessionPump) -> None:
        try:
            if pump.terminated:
                for _ in range(4096):  # nobody reads them any more: clear the signal
                    if pump.quic.next_event() is None:
                        break
            else:
                self.endpoint.dirty.add(pump)
                self.endpoint.read(self.now())
        except Exception as exc:
            log.warning("pquic: client input failed: %r", exc)
        self.wake()

    def _forget(self, pump: SessionPump) -> None:
        fd = self._clients.pop(pump, None)
        if fd is None:
            return
        with contextlib.suppress(Exception):
            self._loop.remove_reader(fd)
        try:
            pump.quic.inner.stop()  # joins its network thread
        except Exception as exc:
            log.debug("pquic: stopping a client transport: %s", exc)

    # --- service ----------------------------------------------------------------------------

    def _service(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        now = self.now()
        endpoint = self.endpoint
        try:
            for pump in list(endpoint.pumps):
                if pump.quic.holding:
                    endpoint._guard(pump, "send", now, pump.quic.retry_held)
            endpoint.read(now)
            endpoint.service(now)
            waiting = endpoint.backpressured()
            for conn in waiting:
                conn.arm_drain()
        except Exception as exc:
            log.warning("pquic: endpoint service failed: %r", exc)
            waiting = []
        deadline = endpoint.get_timer()
        live = any(not pump.terminated for pump in endpoint.pumps)
        # the soonest look that applies (BACKPRESSURE_RECHECK < RX_RECHECK < RX_RECHECK_IDLE)
        if waiting:
            recheck: float | None = BACKPRESSURE_RECHECK
        elif live and not self._quiet(now):  # "Lost signals"
            recheck = RX_RECHECK
        elif live or self._engine is not None:  # quiet, or a server without connections
            recheck = RX_RECHECK_IDLE
        else:
            recheck = None
        if recheck is not None:
            deadline = now + recheck if deadline is None else min(deadline, now + recheck)
        if deadline != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = (
                None if deadline is None else self._loop.call_at(max(deadline, now), self._on_timer)
            )
            self._timer_at = deadline
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _quiet(self, now: float) -> bool:
        """No connection has had an event for :data:`RX_QUIET_AFTER` seconds."""
        taken = sum(pump.quic.events_taken for pump in self.endpoint.pumps)
        if taken != self._events_seen:
            self._events_seen = taken
            self._last_event_at = now
        return now - self._last_event_at >= RX_QUIET_AFTER

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        try:
            self._read_unsignalled()
            self.endpoint.handle_timer(self.now())
        except Exception as exc:
            log.warning("pquic: endpoint timer failed: %r", exc)
        self._service()

    def _read_unsignalled(self) -> None:
        """Read every live connection as if picoquic had signalled (module docstring, "Lost
        signals"); reads that find something are counted in ``lost_signals`` and logged (debug)."""
        endpoint = self.endpoint
        live = [p for p in endpoint.pumps if not p.terminated]
        if not live and self._engine is None:
            return
        self.fallback_reads += 1
        before = sum(p.quic.events_taken for p in live)
        if self._engine is not None:
            self._engine.drain_and_route()
        endpoint.dirty.update(p for p in live if p in self._clients)
        endpoint.read(self.now())
        found = sum(p.quic.events_taken for p in live) - before
        if found:
            self.lost_signals += 1
            log.debug("pquic: %d events were waiting unsignalled", found)

    async def aclose(self, timeout: float = 1.0) -> None:
        """Close every connection, wait briefly for them to end, stop picoquic."""
        if self._closed:
            return
        self.endpoint.close(self.now())
        self.wake()
        with contextlib.suppress(TimeoutError, ConnectError):
            await self.wait_for(lambda: self.endpoint.idle, timeout)
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for pump in list(self._clients):
            self._forget(pump)
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._engine.eventfd)
            try:
                self._engine.close()
            except Exception as exc:
                log.debug("pquic: stopping the server transport: %s", exc)
            self._engine = None
        self._changed.set()


@contextlib.asynccontextmanager
async def open_endpoint(
    endpoint: PquicEndpoint, host: str, port: int
) -> AsyncIterator[PquicDriver]:
    """Drive ``endpoint`` in the running asyncio loop until the block ends; a server
    listens on ``port`` (0: a free one) of ``host``'s address family."""
    driver = PquicDriver(endpoint, (host, port))
    try:
        if not endpoint.configuration.is_client:
            driver.udp = _Address(driver.listen(host, port))
        yield driver
    finally:
        await driver.aclose()


__all__ = [
    "DEFAULT_MAX_UNSENT",
    "PquicConnection",
    "PquicDriver",
    "PquicEndpoint",
    "is_pquic",
    "load_pquic_stack",
    "open_endpoint",
]
