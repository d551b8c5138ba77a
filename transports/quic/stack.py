"""Which QUIC implementation carries the sessions: aioquic or qh3, chosen by name.

Theory of operation
-------------------
kvcs drives a QUIC stack through the sans-I/O ``QuicConnection`` API that aioquic
defined and qh3 (a fork with a native packet and crypto core) kept: construct a
connection from a ``QuicConfiguration``, feed it datagrams, timers and stream
writes, take datagrams and events out. Everything stack-specific that kvcs needs
is collected in one :class:`QuicStack` value, so the pump, the endpoint and the
event-loop drivers never import a stack themselves, and a third stack with the
same API plugs in by building one more :class:`QuicStack`.

Two things the stacks expose differently. One is how many written stream bytes
still wait for their first transmission (the backpressure signal): qh3
offers ``get_send_buffer_size``; for aioquic it is read from each stream's
sender (``_buffer_stop - highest_offset``: bytes queued but never sent).

The other is the peer's bidirectional stream credit (its cumulative MAX_STREAMS
limit, RFC 9000 section 4.6), which the pump reports to the session so that it
opens request streams only within it: aioquic keeps it in the connection's
``_remote_max_streams_bidi`` (it queues streams opened beyond it, unseen by the
peer); qh3 2.1 offers ``max_concurrent_bidi_streams`` (the native core's
``stream_limits[0]``: despite the name, the peer's cumulative limit, raised by
each MAX_STREAMS frame; qh3 raises ``ValueError`` for a stream opened beyond
it).

One qh3 workaround lives here too: qh3 2.1's core can raise ``RuntimeError``
("packet builder capacity exhausted") from ``poll_transmit`` in the middle of
a server's handshake flight (seen with every aioquic client on 127.0.0.1), and
its ``datagrams_to_send`` then raises and drops the datagrams it had already
built, so the handshake only completes after retransmissions (or, in a loop
that lets the exception escape, never). :func:`_qh3_datagrams` keeps what was
built and stops at the error; the next call goes on.

One qh3 2.1 fault is not worked around, because it cannot be from outside: its core
keeps stream-data reservations (``pending_streams``) for a stream that it removes once
the stream is finished (every byte and the FIN acknowledged), and the next
``poll_transmit`` then raises ``ValueError("reserved stream is missing")`` after it
has committed part of a packet that it never sends, so the connection cannot go on.
The pump ends that connection as a stack failure (a publisher reconnects and announces
again). Seen only with large datagrams (``--datagram-size 16000`` on loopback, about 1 in
8 three-process transfers of 64 MiB, with UDP receive drops, where a retransmission
queued after a loss races the late ACK that finishes the stream); never in 20 runs at
the default size.

And one qh3 limitation is lifted: a qh3 client always advertises
``max_udp_payload_size`` 1472 in its transport parameters, whatever its
``max_datagram_size``, and a qh3 server does no path MTU discovery, so a server
(a relay) sent at most about 1450-byte datagrams to qh3 clients even where both
sides were configured for, say, 16000 (on loopback that is ten times the
packets, and the kernel's per-packet work, of the client-to-server direction).
:func:`_qh3_connection` makes a client whose ``max_datagram_size`` is larger
advertise that size instead (RFC 9000 section 18.2: the largest UDP payload it
is willing to receive; :mod:`.udp` reads datagrams of up to 64 KiB).

And one qh3 2.1 fault is worked around with a standard mechanism: its server credits a
client's datagrams, for the anti-amplification limit (RFC 9000 section 8.1: at most three
times the bytes received before the client's address is validated), with the bytes of
the QUIC packets it parsed, not with the whole UDP datagram, as the RFC counts them.
picoquic and aioquic clients pad their first datagram with bytes after the Initial
packet (RFC 9000 section 14.1 allows it), so a picoquic client's 1252-byte datagram
counts as its 275-byte packet: qh3 then pads its ServerHello Initial to the 825 bytes
it believes it may send, picoquic drops a server Initial under 1200 bytes, repeats its
own, and the handshake never completes; qh3's builder also raises "packet builder
capacity exhausted" whenever the budget left is smaller than its next 900-byte CRYPTO
chunk. A server whose address validation is done has no such limit, so for a new
client Initial whose datagram is longer than its QUIC packets
(:func:`_qh3_undercounts`), a qh3 endpoint first answers with a Retry (RFC 9000
section 8.1.2; :class:`RetryKit`, :class:`~.endpoint.QuicEndpoint`): the client's next
Initial carries the token, proving its address, and the connection is created with
the address validated. It costs such clients one round trip; qh3 clients (which pad
inside the Initial packet) get no Retry.

And one aioquic fault is worked around: its pacer stalls a fast connection to one packet
per wake. aioquic paces sends with a token bucket (``QuicPacketPacer``): tokens, in
seconds of send time, refill at one second per second up to ``bucket_max``, the time
of a burst of 2 to 16 full packets at the pacing rate (``congestion_window /
smoothed_rtt``), and a packet costs ``packet_time``. ``update_rate`` floors
``packet_time`` at one microsecond but computes ``bucket_max`` from the unfloored rate,
so once the rate passes one datagram per microsecond (a congestion window of tens of
MB over a loopback round trip of a millisecond: Reno's slow start never ends where
nothing is lost) the bucket holds less than one packet. After every packet the pacer
then asks to be woken a microsecond later, and each wake of the event loop sends one
datagram. Measured through a relay (256 MiB, three processes), a producer in that state
made 177-214 thousand send calls for 232 thousand datagrams and its relay and consumer
about three times their usual CPU; about one run in three reached it (congestion windows
of 21-33 MB), taking 47-87 s instead of 25-31 s. :func:`_aioquic_connection` gives each
connection's pacer a bucket of at least the burst's packets at the floored packet time,
so the pacer allows the bursts it means to (2 to 16 packets) at any rate, and below
the floor nothing changes.

Holding input (backpressure from a relay whose cache is full to its publishers,
``Relay.intake_held``, :mod:`kvcs_core.relay.intake`): QUIC flow control (RFC 9000
section 4) stops a sender at the credit its receiver granted, so a receiver holds its
peer back by not extending that credit. The stacks extend it at different moments, and
:attr:`QuicStack.hold_input` holds each at its own:

* qh3 2.1's native core credits data when the application *takes* it: its
  ``poll_event`` hands a ``StreamData`` event out and, once what is left of a window is
  at most half of it, raises the limit to what was taken plus the window (MAX_DATA,
  MAX_STREAM_DATA). qh3's Python ``QuicConnection`` takes every core event right after
  each datagram and timer (``_drain_core``), so :func:`_qh3_hold_input` shadows that
  method on the held connection with one that takes nothing: what arrives waits in the
  core, within the window, and the peer stops once the window is used. Every other core
  event waits too (control messages, the connection's end), so a relay holds only the
  sessions that feed it, for a bounded time. On release the method is restored and
  called at once: no datagram may come to call it, since the peer is blocked.
* aioquic 1.7 hands data over as it arrives and credits from what it *received*
  (``_write_connection_limits``, ``_write_stream_limits``, called as it builds packets),
  doubling a window whenever more than half of it was used, so what it granted ahead
  grows with the transfer. :func:`_aioquic_credit_windows` replaces both writers on
  every connection: credit then slides by the configured window (raised to what was
  received plus the window once less than half of it is left, as qh3 does), never
  doubles, and while held is not raised at all. What kvcs has taken from the connection
  is then held in the session's queues, bounded by that window.
* aiopquic (:mod:`.pquic_binding`) cannot hold: picoquic credits when its Cython layer
  drains one ring shared by every connection of the endpoint.

Where a stack is not built as expected, ``hold_input`` answers ``False`` and nothing is
held (the relay then forwards what does not fit without keeping it).

And one limit is raised: how many bidirectional streams the peer may have open at
once. Every MOQT request is a bidirectional stream that stays open while the
request lives, and a publication's KVSP index (binding 9) keeps one
PUBLISH_NAMESPACE open per indexed block, so a publisher of a 256-block
publication holds about 260 request streams on its session with the relay. qh3
2.1 grants its peer 100 of them (a constant in ``QuicConnection``, not a
configuration setting) and aioquic 128 (a ``Limit`` it raises only as streams
end), so the rest waited for credit that never came. Both now grant
:data:`PEER_BIDI_STREAMS`, the same as the session's own bound on the peer's open
requests (``SessionConfig.max_concurrent_peer_requests``, 1024: past it the
session answers EXCESSIVE_LOAD), so the MOQT limit, with its clear error, is the
one that applies. For qh3, :func:`_qh3_more_streams` passes it to the native
core (which enforces it) and :func:`_qh3_connection` writes it into the
``initial_max_streams_bidi`` transport parameter (which qh3 also hard-codes, to
100); :func:`_aioquic_connection` sets aioquic's limit before the handshake (its
transport parameters carry it). Where a stack's internals are not as expected,
its own default stays and a debug line says so.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import attrs

from . import aioquic_streams

log = logging.getLogger("kvcs.quic")

PEER_BIDI_STREAMS = 1024
"""Bidirectional streams the peer may have open at once (module docstring)."""
_QH3_LOCAL_MAX_STREAMS_BIDI_ARG = 21
"""Position of ``local_max_streams_bidi`` in qh3 2.1's ``QuicConnectionCore(...)``."""
_QH3_DEFAULT_STREAMS_BIDI = 100

ALPN = "moqt-22"
"""The ALPN of MOQT draft-22 over native QUIC (wire reference section 1)."""

STACKS = ("aioquic", "qh3", "pquic")

DEFAULT_STACK = "qh3"
"""The stack used when none is named: qh3, the fastest of the two packet-level stacks
(its packet and crypto core is native; 3-5x aioquic on a live fetch here). aioquic
stays selectable (``stack="aioquic"``, ``--stack aioquic``) and tested."""
"""``pquic`` is aiopquic (picoquic, Python >= 3.12, asyncio only): :mod:`.pquic_binding`."""


class StackUnavailable(RuntimeError):
    """The requested QUIC stack is not installed."""


@attrs.frozen
class RetryKit:
    """What a server needs to validate a client's address with a Retry (RFC 9000
    section 8.1.2) before it creates the connection, and when to do it."""

    encode_retry: Callable[..., bytes]
    """The stack's ``encode_quic_retry(version=, source_cid=, destination_cid=,
    original_destination_cid=, retry_token=)``."""
    token_handler: Callable[[], Any]
    """Makes the stack's ``QuicRetryTokenHandler`` (``create_token(addr, odcid, scid)``,
    ``validate_token(addr, token) -> (odcid, scid)``, raising when invalid: qh3 raises
    ``ValueError`` or, for a token it cannot decrypt, its ``CryptoError``)."""
    needed: Callable[[bytes, int], bool]
    """``(first datagram, host CID length) -> whether to validate before accepting``."""


@attrs.frozen
class QuicStack:
    """The handful of names kvcs takes from a QUIC implementation."""

    name: str
    configuration: Callable[..., Any]
    connection: Callable[..., Any]
    events: ModuleType
    pull_header: Callable[[bytes, int], Any]
    """``(datagram, host_cid_length) -> header`` (raises ``ValueError`` on garbage)."""
    encode_version_negotiation: Callable[..., bytes]
    packet_type_initial: Any
    unsent_bytes: Callable[[Any, int], int]
    """``(connection, stream_id) -> bytes written but not yet sent once``."""
    datagrams_to_send: Callable[[Any, float], list[tuple[bytes, Any]]]
    """``(connection, now) -> [(datagram, address)]``: the connection's ``datagrams_to_send``."""
    bytes_in_flight: Callable[[Any], int] = attrs.field(default=lambda conn: 0)
    """``(connection) -> bytes sent and neither acknowledged nor declared lost`` (what the
    stack's congestion controller counts: sent stream data stays in the stack's send
    buffer at least that long); 0 where the stack does not tell."""
    receive_many: Callable[[Any, list[bytes], Any, float], None] | None = None
    """``(connection, datagrams, address, now)``: datagrams from one address in one call
    (qh3's ``receive_many_datagrams``: one crossing into its native core per batch
    instead of a Python wrapper per datagram); ``None``: one ``receive_datagram`` each."""
    bidi_credit: Callable[[Any], int | None] = attrs.field(default=lambda conn: None)
    """``(connection) -> bidirectional streams the peer allows us in total`` (its
    cumulative MAX_STREAMS), ``None`` where the stack does not tell."""
    close_event: Callable[[Any], Any] = attrs.field(default=lambda conn: None)
    """``(connection) -> ConnectionTerminated | None``: how the connection has ended, once
    the stack knows it, even before it reports the end as an event. qh3 refuses every
    write ("connection is closed") from the moment it reads the peer's CONNECTION_CLOSE,
    but emits ``ConnectionTerminated`` only when its draining period is over."""
    h3_connection: Callable[..., Any] | None = None
    """The stack's ``H3Connection`` (for WebTransport), ``None`` if it has none."""
    h3_events: ModuleType | None = None
    endpoint: Callable[..., Any] | None = None
    """The endpoint class for this stack (``None``: :class:`~.endpoint.QuicEndpoint`); a
    stack that owns its sockets brings its own (:mod:`.pquic_binding`)."""
    retry: RetryKit | None = None
    """How a server of this stack validates clients' addresses with a Retry, ``None``:
    it never does (module docstring: qh3 needs it for some clients)."""
    hold_input: Callable[[Any, bool], bool] | None = None
    """``(connection, held) -> whether it is done``: stop (``True``) or resume (``False``)
    handing the application what the connection received, so that its flow-control
    credit stops growing (module docstring, "Holding input"); on resume, what was held
    is handed over at once. ``None``: the stack cannot hold (every byte received is
    credited back at once)."""
    max_stream_data: int | None = None
    """The per-stream receive window kvcs configures (``max_stream_data``), ``None``: the
    common one (:data:`~.config.MAX_STREAM_DATA`). A stack that reserves receive memory
    per stream in proportion to its window gives a smaller one (:mod:`.pquic_binding`)."""


def _no_drain() -> None:
    """qh3's ``_drain_core`` while a connection's input is held (module docstring)."""


def _all_walked(stream: Any) -> None:
    """Where aioquic's streams are all walked (no :class:`~.aioquic_streams.StreamTable`)."""


def _qh3_hold_input(conn: Any, held: bool) -> bool:
    """Hold a qh3 connection's input by leaving its native core's events undrained (module
    docstring, "Holding input"); ``False`` where qh3 is not built as expected."""
    if not callable(getattr(type(conn), "_drain_core", None)) or not hasattr(conn, "__dict__"):
        return False
    if held:
        conn.__dict__["_drain_core"] = _no_drain
        return True
    conn.__dict__.pop("_drain_core", None)
    if getattr(conn, "_core", None) is not None:
        conn._drain_core()  # what arrived while held (no datagram may come to drain it)
    return True


_AIOQUIC_HELD = "_kvcs_input_held"
"""Set on an aioquic connection whose limit writers :func:`_aioquic_credit_windows` wrapped:
a one-item list, ``[True]`` while its input is held."""


def _aioquic_hold_input(conn: Any, held: bool) -> bool:
    """Hold an aioquic connection's input by not raising its receive limits (module
    docstring, "Holding input"): aioquic hands data over as it arrives and credits from
    what it received, so the credit is what is held."""
    state = getattr(conn, "__dict__", {}).get(_AIOQUIC_HELD)
    if not isinstance(state, list):
        return False
    state[0] = held
    if not held and isinstance(conn._streams, aioquic_streams.StreamTable):
        conn._streams.watch_all()  # what arrived while held may now need credit
    return True


def _aioquic_credit_windows(conn: Any) -> None:
    """Make aioquic extend its receive credit by a fixed window, and hold it on request
    (module docstring, "Holding input"); where aioquic is not built as expected its own
    limits stay, and its input cannot be held.

    aioquic calls the stream writer for every stream in every packet it builds, so the
    wrapper returns at once when there is nothing to raise or send, and calls aioquic's
    writer (to write the frame) only when there is."""
    max_data = getattr(conn, "_local_max_data", None)
    write_connection = getattr(conn, "_write_connection_limits", None)
    write_stream = getattr(conn, "_write_stream_limits", None)
    if (
        max_data is None
        or not hasattr(max_data, "used")
        or not callable(write_connection)
        or not callable(write_stream)
    ):
        log.debug("aioquic: no receive limits where expected; its credit kept as is")
        return
    connection_window = int(max_data.value)
    connection_half = connection_window // 2
    stream_window = int(conn._configuration.max_stream_data)
    stream_half = stream_window // 2
    held = [False]
    streams = conn._streams
    quiet = streams.quiet if isinstance(streams, aioquic_streams.StreamTable) else _all_walked

    def write_connection_limits(builder: Any, space: Any) -> None:
        if held[0]:
            return
        used = max_data.used
        if max_data.value - used <= connection_half:
            max_data.value = used + connection_window
        max_data.used = 0  # read only by aioquic's doubling test, which this replaces
        try:
            write_connection(builder, space)  # also MAX_STREAMS
        finally:
            max_data.used = used

    def write_stream_limits(builder: Any, space: Any, stream: Any) -> None:
        if held[0]:
            return
        local = stream.max_stream_data_local
        if not local:  # zero: a stream of ours that receives nothing
            quiet(stream)
            return
        receiver = stream.receiver
        high = receiver.highest_offset
        if local - high <= stream_half:
            stream.max_stream_data_local = high + stream_window
        elif stream.max_stream_data_local_sent == local:
            quiet(stream)  # nothing to raise, nothing to send (until data or a loss)
            return
        receiver.highest_offset = 0  # read only by aioquic's doubling test, as above
        try:
            write_stream(builder, space, stream)
        finally:
            receiver.highest_offset = high

    conn.__dict__[_AIOQUIC_HELD] = held
    conn._write_connection_limits = write_connection_limits
    conn._write_stream_limits = write_stream_limits


def _aioquic_unsent(conn: Any, stream_id: int) -> int:
    stream = conn._streams.get(stream_id)
    if stream is None:
        return 0
    sender = stream.sender
    return max(0, int(sender._buffer_stop) - int(sender.highest_offset))


def _qh3_unsent(conn: Any, stream_id: int) -> int:
    return int(conn.get_send_buffer_size(stream_id))


def _qh3_receive_many(conn: Any, datagrams: list[bytes], addr: Any, now: float) -> None:
    conn.receive_many_datagrams(datagrams, addr, now)


def _aioquic_in_flight(conn: Any) -> int:
    return int(conn._loss.bytes_in_flight)


def _qh3_in_flight(conn: Any) -> int:
    core = getattr(conn, "_core", None)  # qh3 builds its native core when it connects
    return 0 if core is None else int(core.bytes_in_flight)


def _close_event(conn: Any) -> Any:
    """The connection's pending ``ConnectionTerminated`` (aioquic and qh3 both keep it in
    ``_close_event``), ``None`` while it is open or where the stack does not tell."""
    event = getattr(conn, "_close_event", None)
    return event if hasattr(event, "error_code") else None


def _aioquic_bidi_credit(conn: Any) -> int | None:
    value = getattr(conn, "_remote_max_streams_bidi", None)
    return value if isinstance(value, int) else None


def _qh3_bidi_credit(conn: Any) -> int | None:
    try:
        value = conn.max_concurrent_bidi_streams
    except Exception:  # the stack changed: no credit known (the session never holds)
        return None
    return value if isinstance(value, int) else None


def _aioquic_datagrams(conn: Any, now: float) -> list[tuple[bytes, Any]]:
    out: list[tuple[bytes, Any]] = conn.datagrams_to_send(now=now)
    return out


def _qh3_datagrams(conn: Any, now: float) -> list[tuple[bytes, Any]]:
    """qh3's ``datagrams_to_send`` without losing datagrams to a core error (module doc)."""
    core = conn._core
    if core is None:
        return []
    out: list[tuple[bytes, Any]] = []
    while True:
        try:
            transmit = core.poll_transmit(now)
        except RuntimeError as exc:
            log.debug("qh3 poll_transmit: %s (kept %d datagrams)", exc, len(out))
            break
        if transmit is None:
            break
        if conn._quic_logger is not None:
            conn._log_datagram("datagrams_sent", transmit[0])
            conn._log_packets("packet_sent", transmit[0])
        out.append((transmit[0], transmit[1]))
    return out


QH3_CLIENT_MAX_UDP_PAYLOAD = 1472
"""The ``max_udp_payload_size`` a qh3 2.1 client advertises whatever its configuration."""

_TP_MAX_UDP_PAYLOAD_SIZE = 0x03
_TP_INITIAL_MAX_STREAMS_BIDI = 0x08
_TLS_EXT_QUIC_TRANSPORT_PARAMETERS = 0x39


def _qh3_undercounts(
    pull_header: Callable[[bytes, int], Any], data: bytes, cid_length: int
) -> bool:
    """Whether a qh3 server would credit less than ``data`` (a client's first datagram)
    to the client's anti-amplification budget: the long-header packets in it, coalesced
    one after another, end before the datagram does (module docstring)."""
    offset = 0
    while offset < len(data) and data[offset] & 0x80:
        try:
            length = int(pull_header(data[offset:], cid_length).packet_length)
        except ValueError:
            return True
        if length <= 0:
            return True
        offset += length
    return offset < len(data)


def _pull_varint(data: bytes, pos: int) -> tuple[int, int]:
    first = data[pos]
    end = pos + (1 << (first >> 6))
    if end > len(data):
        raise ValueError("truncated varint")
    value = first & 0x3F
    for b in data[pos + 1 : end]:
        value = (value << 8) | b
    return value, end


def _varint(value: int) -> bytes:
    for size, tag in ((1, 0), (2, 0x40), (4, 0x80), (8, 0xC0)):
        if value < 1 << (8 * size - 2):
            return (value | tag << (8 * size - 8)).to_bytes(size, "big")
    raise ValueError("varint too large")


def with_max_udp_payload_size(params: bytes, size: int) -> bytes:
    """Encoded QUIC transport parameters with ``max_udp_payload_size`` set to ``size``
    (replaced where present, appended otherwise; every other parameter kept as is)."""
    return with_transport_parameter(params, _TP_MAX_UDP_PAYLOAD_SIZE, size)


def with_transport_parameter(params: bytes, param_id: int, number: int) -> bytes:
    """Encoded QUIC transport parameters with the integer parameter ``param_id`` set to
    ``number`` (replaced where present, appended otherwise; the others kept as is)."""
    value = _varint(number)
    entry = _varint(param_id) + _varint(len(value)) + value
    out = bytearray()
    pos = 0
    while pos < len(params):
        start = pos
        pid, pos = _pull_varint(params, pos)
        length, pos = _pull_varint(params, pos)
        pos += length
        if pos > len(params):
            raise ValueError("truncated transport parameter")
        out += entry if pid == param_id else params[start:pos]
        if pid == param_id:
            entry = b""
    return bytes(out + entry)


def _qh3_connection(connection_cls: Callable[..., Any]) -> Callable[..., Any]:
    """qh3's ``QuicConnection``; its clients advertise their ``max_datagram_size`` (see above)."""

    def connection(*, configuration: Any, **kwargs: Any) -> Any:
        conn = connection_cls(configuration=configuration, **kwargs)
        size = int(configuration.max_datagram_size)
        bigger = configuration.is_client and size > QH3_CLIENT_MAX_UDP_PAYLOAD
        create_tls = conn._create_tls

        def create_tls_advertising(*args: Any, **kw: Any) -> Any:
            bridge = create_tls(*args, **kw)
            exts = bridge.tls.handshake_extensions
            for i, (kind, data) in enumerate(exts):
                if kind == _TLS_EXT_QUIC_TRANSPORT_PARAMETERS:
                    data = with_transport_parameter(
                        data, _TP_INITIAL_MAX_STREAMS_BIDI, PEER_BIDI_STREAMS
                    )
                    if bigger:
                        data = with_max_udp_payload_size(data, size)
                    exts[i] = (kind, data)
            return bridge

        conn._create_tls = create_tls_advertising
        return conn

    return connection


def _qh3_more_streams(conn_mod: ModuleType) -> None:
    """Make qh3's connections grant :data:`PEER_BIDI_STREAMS` (module docstring): wrap the
    native core's constructor in ``qh3.quic.connection`` (once), changing only its
    ``local_max_streams_bidi`` argument, and only when it holds qh3 2.1's constant."""
    core = getattr(conn_mod, "QuicConnectionCore", None)
    if core is None or getattr(core, "_kvcs_streams", False):
        return
    pos = _QH3_LOCAL_MAX_STREAMS_BIDI_ARG

    def core_with_more_streams(*args: Any, **kwargs: Any) -> Any:
        if len(args) > pos and args[pos] == _QH3_DEFAULT_STREAMS_BIDI:
            args = (*args[:pos], PEER_BIDI_STREAMS, *args[pos + 1 :])
        else:
            log.debug("qh3: QuicConnectionCore arguments not as expected; stream limit kept")
        return core(*args, **kwargs)

    core_with_more_streams._kvcs_streams = True  # type: ignore[attr-defined]
    setattr(conn_mod, "QuicConnectionCore", core_with_more_streams)  # noqa: B010


def keep_pacing_bursts(pacer: Any) -> None:
    """Make an aioquic ``QuicPacketPacer``'s bucket hold its burst at the floored packet
    time (module docstring: its bucket is otherwise smaller than one packet at high rates)."""
    update_rate = pacer.update_rate
    datagram = int(pacer._max_datagram_size)

    def update_rate_keeping_bursts(congestion_window: int, smoothed_rtt: float) -> None:
        update_rate(congestion_window, smoothed_rtt)
        if pacer.packet_time is None:
            return
        burst = max(2 * datagram, min(congestion_window // 4, 16 * datagram))
        pacer.bucket_max = max(pacer.bucket_max, burst / datagram * pacer.packet_time)

    pacer.update_rate = update_rate_keeping_bursts


def _aioquic_connection(connection_cls: Any, acked: Any) -> Callable[..., Any]:
    """aioquic's ``QuicConnection`` granting :data:`PEER_BIDI_STREAMS`, its pacer keeping
    its bursts (module docstring), its packets walking only the streams with something to
    do (:mod:`.aioquic_streams`; ``acked``: aioquic's ``QuicDeliveryState.ACKED``)."""
    if aioquic_streams.layout_known(connection_cls):
        connection_cls = aioquic_streams.quiet_streams_connection(connection_cls, acked)
    else:
        log.debug("aioquic: streams not walked as expected; every packet walks them all")

    def connection(*, configuration: Any, **kwargs: Any) -> Any:
        conn = connection_cls(configuration=configuration, **kwargs)
        limit = getattr(conn, "_local_max_streams_bidi", None)
        if limit is not None and hasattr(limit, "value") and hasattr(limit, "sent"):
            limit.value = limit.sent = max(int(limit.value), PEER_BIDI_STREAMS)
        else:
            log.debug("aioquic: no _local_max_streams_bidi; stream limit kept")
        pacer = getattr(getattr(conn, "_loss", None), "_pacer", None)
        if hasattr(pacer, "update_rate") and hasattr(pacer, "_max_datagram_size"):
            keep_pacing_bursts(pacer)
        else:
            log.debug("aioquic: no QuicPacketPacer where expected; its pacing kept")
        _aioquic_credit_windows(conn)
        return conn

    return connection


def load_stack(name: str = DEFAULT_STACK) -> QuicStack:
    """Import and describe a QUIC stack by name (``aioquic``, ``qh3`` or ``pquic``)."""
    if name not in STACKS:
        raise StackUnavailable(f"unknown QUIC stack {name!r} (choose from {', '.join(STACKS)})")
    if name == "pquic":
        # imported here: the binding builds on this module
        pquic: Any = importlib.import_module(".pquic_binding", __package__)
        return pquic.load_pquic_stack()  # type: ignore[no-any-return]
    try:
        config_mod = importlib.import_module(f"{name}.quic.configuration")
        conn_mod = importlib.import_module(f"{name}.quic.connection")
        events_mod = importlib.import_module(f"{name}.quic.events")
        packet_mod = importlib.import_module(f"{name}.quic.packet")
    except ImportError as exc:
        raise StackUnavailable(f"QUIC stack {name!r} is not installed ({exc})") from exc
    if name == "aioquic":
        buffer_cls = importlib.import_module("aioquic.buffer").Buffer
        unsent = _aioquic_unsent
        in_flight = _aioquic_in_flight
        receive_many = None
        datagrams = _aioquic_datagrams
        credit = _aioquic_bidi_credit
        acked = importlib.import_module("aioquic.quic.packet_builder").QuicDeliveryState.ACKED
        connection = _aioquic_connection(conn_mod.QuicConnection, acked)
        hold: Callable[[Any, bool], bool] = _aioquic_hold_input
    else:
        buffer_cls = importlib.import_module("qh3._hazmat").Buffer
        unsent = _qh3_unsent
        in_flight = _qh3_in_flight
        receive_many = _qh3_receive_many
        datagrams = _qh3_datagrams
        credit = _qh3_bidi_credit
        _qh3_more_streams(conn_mod)  # before any connection: a server's builds its core at once
        connection = _qh3_connection(conn_mod.QuicConnection)
        hold = _qh3_hold_input
    pull = packet_mod.pull_quic_header

    def pull_header(data: bytes, cid_length: int) -> Any:
        return pull(buffer_cls(data=data), host_cid_length=cid_length)

    retry = None
    if name == "qh3":
        retry_mod = importlib.import_module("qh3.quic.retry")
        retry = RetryKit(
            encode_retry=packet_mod.encode_quic_retry,
            token_handler=retry_mod.QuicRetryTokenHandler,
            needed=lambda data, cid_length: _qh3_undercounts(pull_header, data, cid_length),
        )

    try:
        h3_mod: ModuleType | None = importlib.import_module(f"{name}.h3.connection")
        h3_events_mod: ModuleType | None = importlib.import_module(f"{name}.h3.events")
    except ImportError:
        h3_mod = h3_events_mod = None
    return QuicStack(
        name=name,
        configuration=config_mod.QuicConfiguration,
        connection=connection,
        events=events_mod,
        pull_header=pull_header,
        encode_version_negotiation=packet_mod.encode_quic_version_negotiation,
        packet_type_initial=packet_mod.QuicPacketType.INITIAL,
        unsent_bytes=unsent,
        bytes_in_flight=in_flight,
        receive_many=receive_many,
        datagrams_to_send=datagrams,
        bidi_credit=credit,
        close_event=_close_event,
        h3_connection=h3_mod.H3Connection if h3_mod is not None else None,
        h3_events=h3_events_mod,
        retry=retry,
        hold_input=hold,
    )
