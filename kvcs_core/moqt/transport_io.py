"""The core's own lower-edge vocabulary: what a QUIC-like transport tells a session and
what a session asks of it.

Theory of operation
-------------------
MOQT runs over native QUIC or WebTransport (d21 section 6.1): both offer
bidirectional and unidirectional streams that can be reset (RESET_STREAM) or
stopped (STOP_SENDING), unreliable datagrams (RFC 9221), and a connection close
carrying an application error code (d21 section 12.2). Nothing else is needed,
so nothing else crosses this boundary: no aioquic type ever enters
``kvcs_core``. A transport adapter (``transports/``) translates its stack's events
into :data:`TransportEvent` values and carries out :data:`TransportCommand`
values; the loopback simulator, aioquic, trio and any other QUIC stack plug in
the same way (ARCHITECTURE.md "The call protocol", STYLE.md R1).

Streams are named by :class:`StreamRef`, an opaque handle. A session allocates
refs for the streams *it* opens (``local=True``); an adapter allocates refs for
streams the *peer* opens (``local=False``), so the two can never clash, and the
adapter keeps the two-way map to its native stream IDs. The core never does
stream-ID arithmetic (which differs between raw QUIC and WebTransport). A
stream of ours is opened either by an ``OpenStream`` command (control and
request streams, fetch and fill streams) or by the first ``WriteStream`` pulled
for it, which carries ``opens=True`` (subgroup streams: a transport then holds
open only the streams whose data is being sent).

Stream credit (RFC 9000 section 4.6): the peer limits how many bidirectional
streams we may open (MAX_STREAMS), and every request of ours is one (d21
section 6.4.2). A transport that knows the limit reports it with
:class:`StreamCredit` (cumulative, like MAX_STREAMS: "N streams in total"),
after the handshake and whenever it grows; the session then opens request
streams only within it and holds the others itself (:mod:`.output`), so a
request's timer never runs while the request waits for credit. A transport
that never reports credit gets every ``OpenStream`` at once, as before.

Payload bytes travel as ``memoryview`` slices; a write is scatter/gather
(``chunks``) so that an object header and its payload are never concatenated.
"""

from __future__ import annotations

import enum

import attrs


@attrs.frozen(order=True, cache_hash=True)
class StreamRef:
    """Opaque stream handle. ``local``: opened by this endpoint; ``n``: allocator's counter."""

    local: bool
    n: int

    def __repr__(self) -> str:
        return f"{'L' if self.local else 'P'}{self.n}"


class AbortKind(enum.IntEnum):
    """How one half of a stream is aborted."""

    RESET = 1
    """RESET_STREAM: the sender abandons its sending half."""
    STOP_SENDING = 2
    """STOP_SENDING: the receiver asks the sender to stop."""


def _summarize(buf: memoryview | bytes) -> str:
    return f"<{len(buf)} bytes>"


# --- events: transport -> session ------------------------------------------------


@attrs.frozen(kw_only=True)
class StreamOpened:
    """The peer opened a stream. Always delivered before the stream's first bytes."""

    stream: StreamRef
    uni: bool


@attrs.frozen(kw_only=True)
class StreamData:
    """Bytes arrived on a stream (in order); ``fin``: the peer finished its sending half."""

    stream: StreamRef
    data: bytes | memoryview = attrs.field(repr=_summarize, eq=False)
    fin: bool = False


@attrs.frozen(kw_only=True)
class StreamAborted:
    """The peer reset its sending half (RESET) or asked us to stop ours (STOP_SENDING)."""

    stream: StreamRef
    kind: AbortKind
    code: int


@attrs.frozen(kw_only=True)
class DatagramReceived:
    """One QUIC DATAGRAM payload."""

    data: bytes | memoryview = attrs.field(repr=_summarize, eq=False)


@attrs.frozen(kw_only=True)
class TransportClosed:
    """The connection is gone: closed by the peer (``by_peer``), by us, or lost (idle/timeout)."""

    code: int
    reason: str = ""
    by_peer: bool = True


@attrs.frozen(kw_only=True)
class StreamCredit:
    """The peer allows ``bidi`` bidirectional streams of ours in total, counting every
    one the session has opened so far (cumulative, like QUIC MAX_STREAMS; a smaller
    value than one reported before changes nothing). Only the streams the session
    itself opens count: a transport whose own streams share the limit (WebTransport's
    CONNECT stream) subtracts them first."""

    bidi: int


TransportEvent = (
    StreamOpened | StreamData | StreamAborted | DatagramReceived | TransportClosed | StreamCredit
)


# --- commands: session -> transport --------------------------------------------------


@attrs.frozen(kw_only=True)
class OpenStream:
    """Open a stream of ours; ``priority`` is a hint (lower = more urgent, MOQT order)."""

    stream: StreamRef
    uni: bool
    priority: int = 128


@attrs.frozen(kw_only=True)
class WriteStream:
    """Append ``chunks`` (in order) to a stream; ``fin``: close our sending half after them."""

    stream: StreamRef
    chunks: tuple[bytes | memoryview, ...] = attrs.field(repr=lambda c: f"<{len(c)} chunks>")
    fin: bool = False
    opens: bool = False
    """The stream is new: open it (ours, unidirectional) right before this write. No
    ``OpenStream`` command precedes it. The session opens data streams this way at
    their first pull, so that a transport holds open only streams with data ready to
    go (a producer far ahead of its link queues many groups, one stream each)."""

    @property
    def nbytes(self) -> int:
        return sum(len(c) if isinstance(c, bytes) else c.nbytes for c in self.chunks)

    @classmethod
    def trusted(
        cls,
        stream: StreamRef,
        chunks: tuple[bytes | memoryview, ...],
        fin: bool,
        opens: bool = False,
    ) -> WriteStream:
        """Build from values the session made itself (the data pump's per-pull path)."""
        w: WriteStream = object.__new__(cls)
        _WS_STREAM(w, stream)
        _WS_CHUNKS(w, chunks)
        _WS_FIN(w, fin)
        _WS_OPENS(w, opens)
        return w


_WS_STREAM = WriteStream.__dict__["stream"].__set__
_WS_CHUNKS = WriteStream.__dict__["chunks"].__set__
_WS_FIN = WriteStream.__dict__["fin"].__set__
_WS_OPENS = WriteStream.__dict__["opens"].__set__


@attrs.frozen(kw_only=True)
class AbortStream:
    """RESET_STREAM our sending half, or STOP_SENDING the peer's, with an error code."""

    stream: StreamRef
    kind: AbortKind
    code: int


@attrs.frozen(kw_only=True)
class SendDatagram:
    """Send one QUIC DATAGRAM made of ``chunks``."""

    chunks: tuple[bytes | memoryview, ...] = attrs.field(repr=lambda c: f"<{len(c)} chunks>")


@attrs.frozen(kw_only=True)
class CloseTransport:
    """Close the connection with an application error code (d21 section 12.2)."""

    code: int
    reason: str = ""


TransportCommand = OpenStream | WriteStream | AbortStream | SendDatagram | CloseTransport
