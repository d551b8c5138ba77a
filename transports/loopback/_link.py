"""One simulated QUIC connection between two machines: stream maps, pacing, faults."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from kvcs_core.moqt.protocol import Machine
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

from ._policy import Chunking, LoopbackError, Sent

if TYPE_CHECKING:
    from ._network import Network

CLIENT, SERVER = 0, 1
UNLIMITED_BUDGET = 1 << 20
"""Bytes offered to ``poll_data`` per endpoint per step on a link without a bandwidth."""
MAX_POLLS_PER_STEP = 4096
"""``poll_data`` calls per endpoint per step (bounds a scheduler that returns tiny writes)."""


def _nbytes(chunks: tuple[bytes | memoryview, ...]) -> int:
    return sum(c.nbytes if isinstance(c, memoryview) else len(c) for c in chunks)


def _byte_view(chunk: bytes | memoryview) -> bytes | memoryview:
    """``chunk`` as something whose ``len`` counts bytes (a flat ``"B"`` view), uncopied."""
    if isinstance(chunk, bytes):
        return chunk
    mv = memoryview(chunk)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _cut(
    chunks: tuple[bytes | memoryview, ...], spans: Iterable[tuple[int, int]]
) -> Iterator[tuple[int, int, bytes | memoryview]]:
    """``(start, end, bytes start..end of the concatenated chunks)`` for ascending spans.

    A span inside one chunk is that chunk or a slice of it (a view for a
    memoryview, a copy for ``bytes``); only a span that crosses a chunk boundary
    is joined into new ``bytes``. ``chunks`` holds no empty chunk.
    """
    i, base = 0, 0  # chunks[i] holds bytes base .. base + len(chunks[i])
    for start, end in spans:
        while start >= base + len(chunks[i]):
            base += len(chunks[i])
            i += 1
        c = chunks[i]
        top = base + len(c)
        if end <= top:
            yield start, end, c if (start == base and end == top) else c[start - base : end - base]
            continue
        parts = [c[start - base :]]
        j, b = i + 1, top
        while end > b + len(chunks[j]):
            parts.append(chunks[j])
            b += len(chunks[j])
            j += 1
        parts.append(chunks[j][: end - b])
        yield start, end, b"".join(parts)


def _chunk_spans(chunks: tuple[bytes | memoryview, ...]) -> Iterator[tuple[int, int]]:
    """One span per chunk: the zero-copy ``Chunking.WHOLE``."""
    pos = 0
    for c in chunks:
        yield pos, pos + len(c)
        pos += len(c)


class _Stream:
    """Both halves of one stream, indexed by side (CLIENT / SERVER)."""

    __slots__ = ("ended", "injected", "last_arrival", "opener", "refs", "stopped", "uni")

    def __init__(self, opener: int, uni: bool, refs: list[StreamRef], injected: bool) -> None:
        self.opener = opener
        self.uni = uni
        self.refs = refs
        """``refs[side]``: how the machine on ``side`` names this stream."""
        self.injected = injected
        """Opened by ``Link.inject_stream``: no machine sits at the sending end."""
        self.ended: list[str | None] = [None, None]
        """Sending half of ``side`` finished: ``"FIN"`` or ``"RESET"``."""
        self.stopped = [False, False]
        """``side`` sent STOP_SENDING: bytes still arriving for it are discarded."""
        self.last_arrival = [0.0, 0.0]
        """Arrival time of the last item ``side`` sent on this stream (per-stream FIFO)."""

    def can_send(self, side: int) -> bool:
        return not self.uni or self.opener == side

    def can_receive(self, side: int) -> bool:
        return not self.uni or self.opener != side


class _Delivery:
    """Something in flight towards endpoint ``to``: a prebuilt event or stream bytes.

    Stream bytes are ``chunks`` (none empty), ``nbytes`` in all: one ``bytes``
    the link copied, or with ``zero_copy`` the writer's own buffers; coalescing
    concatenates the tuples and never the bytes.
    """

    __slots__ = ("chunks", "event", "fin", "final", "nbytes", "stream", "to")

    def __init__(
        self,
        to: int,
        *,
        event: TransportEvent | None = None,
        stream: _Stream | None = None,
        chunks: tuple[bytes | memoryview, ...] = (),
        fin: bool = False,
        final: bool = False,
    ) -> None:
        self.to = to
        self.event = event
        self.stream = stream
        self.chunks = chunks
        self.nbytes = sum(len(c) for c in chunks)
        self.fin = fin
        self.final = final


class Endpoint:
    """One side of a :class:`Link`: a machine plus its counters and stream map."""

    def __init__(self, link: Link, side: int, machine: Machine[Any], label: str) -> None:
        self.link = link
        self.side = side
        self.machine = machine
        self.label = label
        """``"<link name>.client"`` or ``"<link name>.server"``."""
        self.bytes_sent = 0
        """Stream and datagram payload bytes this endpoint sent (control and pulled data)."""
        self.bytes_received = 0
        """Stream and datagram payload bytes handed to this endpoint's machine."""
        self.bytes_dropped = 0
        """Bytes that reached this endpoint but were discarded (after STOP_SENDING, close,
        or datagram loss)."""
        self.sent_log: list[Sent] = []
        """Every non-empty write and datagram this endpoint sent, in order."""
        self._streams: dict[StreamRef, _Stream] = {}
        self._next_peer_n = 0
        self._done = False  # no more deliveries except its TransportClosed
        self._finished = False  # TransportClosed delivered
        self._tx_free_at = 0.0  # the paced transmitter is busy until then
        self._backlogged = True  # poll_data may have something

    def __repr__(self) -> str:
        return f"<Endpoint {self.label}>"

    @property
    def peer(self) -> Endpoint:
        return self.link.endpoints[1 - self.side]

    @property
    def closed(self) -> bool:
        """This endpoint's machine has been handed its ``TransportClosed`` (or is about to)."""
        return self._done

    def peer_ref(self, ref: StreamRef) -> StreamRef:
        """The peer machine's name for the stream this endpoint calls ``ref``."""
        st = self._streams.get(ref)
        if st is None or st.injected:
            raise LoopbackError(f"{self.label}: no stream {ref!r} shared with the peer")
        return st.refs[1 - self.side]

    def _alloc_peer_ref(self) -> StreamRef:
        ref = StreamRef(False, self._next_peer_n)
        self._next_peer_n += 1
        return ref


class Link:
    """A bidirectional QUIC-like connection between two machines (see the package docstring).

    Create with :meth:`~._network.Network.connect`. ``client`` and ``server`` are the two
    :class:`Endpoint`s; the names only say who was passed first.
    """

    def __init__(
        self,
        net: Network,
        index: int,
        client: Machine[Any],
        server: Machine[Any],
        *,
        latency: float,
        bandwidth: float | None,
        chunking: Chunking,
        coalesce: bool,
        quantum: int | None,
        datagram_loss: float,
        name: str,
        zero_copy: bool = False,
    ) -> None:
        self.net = net
        self.index = index
        self.name = name or f"link{index}"
        self.client = Endpoint(self, CLIENT, client, f"{self.name}.client")
        self.server = Endpoint(self, SERVER, server, f"{self.name}.server")
        self.endpoints = (self.client, self.server)
        self.chunking = chunking
        self.coalesce = coalesce
        """Merge consecutive due writes of one stream before chunking them."""
        self.zero_copy = zero_copy
        """Carry the writers' buffers instead of copies (see ``Network.connect``)."""
        self.latency = 0.0
        self.bandwidth: float | None = None
        self.quantum: int | None = quantum
        self.set_latency(latency)
        self.set_bandwidth(bandwidth, quantum=quantum)
        if not 0.0 <= datagram_loss <= 1.0:
            raise ValueError("datagram_loss must be within [0, 1]")
        self.datagram_loss = datagram_loss
        seed = f"{net.seed}/{index}"
        self._splitters = (chunking.splitter(seed, 0), chunking.splitter(seed, 1))
        self._loss_rng = random.Random(f"{seed}/loss")
        self.closed = False
        """Closed by a machine or cut: the link carries nothing new."""
        self.close_info: TransportClosed | None = None
        """How it was closed (``by_peer`` from the client's point of view)."""
        self.dropped_commands = 0
        """Commands machines emitted after the link closed (ignored)."""
        self.sent_log: list[Sent] = []
        """Both endpoints' ``sent_log`` records, merged in the order they were sent."""

    def __repr__(self) -> str:
        return f"<Link {self.name}{' closed' if self.closed else ''}>"

    # --- knobs and faults --------------------------------------------------------------

    def set_latency(self, latency: float) -> None:
        """One-way delay in virtual seconds for everything sent from now on."""
        if latency < 0:
            raise ValueError("latency must be >= 0")
        self.latency = float(latency)

    def set_bandwidth(self, bandwidth: float | None, *, quantum: int | None = None) -> None:
        """Bytes per second each direction may pull with ``poll_data`` (``None``: unlimited).

        ``quantum`` is the budget offered per pacing slot; by default
        ``max(1200, bandwidth / 1000)`` (about one millisecond of the link) capped
        at 1 MiB. Smaller means finer priority interleaving and more steps.
        """
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError("bandwidth must be > 0 or None")
        if quantum is not None and quantum < 1:
            raise ValueError("quantum must be >= 1")
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        self.quantum = quantum

    def _budget(self) -> int:
        if self.bandwidth is None:
            return UNLIMITED_BUDGET
        if self.quantum is not None:
            return self.quantum
        return min(UNLIMITED_BUDGET, max(1200, int(self.bandwidth / 1000)))

    def in_flight_chunks(self) -> list[bytes | memoryview]:
        """The stream and datagram bytes on their way across this link, not yet delivered.

        As the link holds them: without ``zero_copy`` its own copies (``bytes``);
        with it, the writers' buffers (a ``memoryview``'s ``obj`` is the writer's
        object). Pure; O(items in flight). For measuring what a transfer keeps in
        memory and how far backpressure lets it run ahead.
        """
        out: list[bytes | memoryview] = []
        for _, _, link, item in self.net._queue:
            if link is self:
                if item.chunks:
                    out.extend(item.chunks)
                elif isinstance(item.event, DatagramReceived):
                    out.append(item.event.data)
        return out

    def endpoint(self, who: Endpoint | Machine[Any]) -> Endpoint:
        """The endpoint for a machine (or the endpoint itself)."""
        for ep in self.endpoints:
            if who is ep or who is ep.machine:
                return ep
        raise LoopbackError(f"{who!r} is not an endpoint of {self!r}")

    def cut(self, code: int = 0x1, reason: str = "link cut") -> None:
        """Sever the link now: both machines get ``TransportClosed(code, reason, by_peer=True)``.

        Both are delivered at the current virtual time (by the next step); every
        byte still in flight is lost. A no-op on a link that is already cut.
        """
        ev = TransportClosed(code=code, reason=reason, by_peer=True)
        if not self.closed:
            self.close_info = ev
        self.closed = True
        for ep in self.endpoints:
            if not ep._done:
                ep._done = True
                self._schedule(self.net.now, _Delivery(ep.side, event=ev, final=True))

    def inject_event(
        self, to: Endpoint | Machine[Any], event: TransportEvent, *, delay: float = 0.0
    ) -> None:
        """Hand ``event`` to ``to``'s machine as if the transport produced it (no checks)."""
        ep = self.endpoint(to)
        self._schedule(self.net.now + delay, _Delivery(ep.side, event=event))

    def inject_stream(
        self,
        to: Endpoint | Machine[Any],
        *,
        uni: bool = True,
        data: bytes | memoryview = b"",
        fin: bool = False,
        delay: float = 0.0,
    ) -> StreamRef:
        """Open a stream towards ``to`` as if its peer had, and send ``data`` on it.

        Returns ``to``'s ref for it; continue with :meth:`inject_data`. Nothing the
        receiving machine writes or aborts on it reaches the real peer machine.
        """
        ep = self.endpoint(to)
        ref = ep._alloc_peer_ref()
        other = 1 - ep.side
        refs = [ref, ref]
        refs[other] = StreamRef(True, -1)  # no machine owns the sending end
        st = _Stream(other, uni, refs, injected=True)
        ep._streams[ref] = st
        self._send_on(
            other,
            st,
            self.net.now + delay,
            _Delivery(ep.side, event=StreamOpened(stream=ref, uni=uni)),
        )
        if data or fin:
            self.inject_data(ep, ref, data, fin=fin, delay=delay)
        return ref

    def inject_data(
        self,
        to: Endpoint | Machine[Any],
        stream: StreamRef,
        data: bytes | memoryview,
        *,
        fin: bool = False,
        delay: float = 0.0,
    ) -> None:
        """Deliver raw ``data`` to ``to`` on its stream ``stream`` (any stream it knows).

        The bytes go through the link's chunking, after anything already in flight
        on that stream. Stream state is not checked or changed (except FIN on an
        injected stream): injecting into a real stream is meant to break it.
        """
        ep = self.endpoint(to)
        st = ep._streams.get(stream)
        if st is None:
            raise LoopbackError(f"{ep.label}: inject_data on unknown stream {stream!r}")
        if st.injected and fin:
            st.ended[1 - ep.side] = "FIN"
        self._send_on(
            1 - ep.side,
            st,
            self.net.now + delay,
            _Delivery(ep.side, stream=st, chunks=(bytes(data),) if data else (), fin=fin),
        )

    def inject_datagram(
        self, to: Endpoint | Machine[Any], data: bytes | memoryview, *, delay: float = 0.0
    ) -> None:
        """Deliver one raw datagram to ``to``."""
        self.inject_event(to, DatagramReceived(data=bytes(data)), delay=delay)

    # --- commands from machines --------------------------------------------------------

    def _schedule(self, when: float, item: _Delivery) -> None:
        self.net._schedule(when, self, item)

    def _send_on(self, side: int, st: _Stream, when: float, item: _Delivery) -> None:
        """Schedule ``item`` that ``side`` sent on ``st``, keeping the stream in order."""
        when = max(when, st.last_arrival[side])
        st.last_arrival[side] = when
        self._schedule(when, item)

    def _stream(self, ep: Endpoint, ref: StreamRef, what: str) -> _Stream:
        st = ep._streams.get(ref)
        if st is None:
            raise LoopbackError(f"{ep.label}: {what} on unknown stream {ref!r} (never opened)")
        return st

    def _log(self, ep: Endpoint, time: float, ref: StreamRef | None, n: int, pulled: bool) -> None:
        ep.bytes_sent += n
        if n:
            rec = Sent(time, ref, n, pulled, ep.label)
            ep.sent_log.append(rec)
            self.sent_log.append(rec)

    def _apply(self, ep: Endpoint, cmd: TransportCommand) -> None:
        """Carry out one ``next_command()`` result of ``ep``'s machine (no bandwidth cost)."""
        if self.closed:
            self.dropped_commands += 1
            return
        now = self.net.now
        arrival = now + self.latency
        peer = ep.peer
        if isinstance(cmd, WriteStream):
            self._write(ep, cmd, now, arrival, pulled=False)
        elif isinstance(cmd, OpenStream):
            self._open(ep, cmd.stream, cmd.uni, arrival)
        elif isinstance(cmd, AbortStream):
            self._abort(ep, cmd, arrival)
        elif isinstance(cmd, SendDatagram):
            self._datagram(ep, cmd, now, arrival, pulled=False)
        elif isinstance(cmd, CloseTransport):
            self.closed = True
            self.close_info = TransportClosed(
                code=cmd.code, reason=cmd.reason, by_peer=ep.side == SERVER
            )
            ep._done = True
            self._schedule(
                now,
                _Delivery(
                    ep.side,
                    final=True,
                    event=TransportClosed(code=cmd.code, reason=cmd.reason, by_peer=False),
                ),
            )
            self._schedule(
                arrival,
                _Delivery(
                    peer.side,
                    final=True,
                    event=TransportClosed(code=cmd.code, reason=cmd.reason, by_peer=True),
                ),
            )
        else:  # pragma: no cover - the union is closed
            raise LoopbackError(f"{ep.label}: unknown command {cmd!r}")

    def _open(self, ep: Endpoint, ref: StreamRef, uni: bool, arrival: float) -> None:
        """A stream of ``ep``'s machine: ``OpenStream``, or a ``WriteStream(opens=True)``."""
        peer = ep.peer
        if not ref.local:
            raise LoopbackError(f"{ep.label}: OpenStream with a peer-side ref {ref!r}")
        if ref in ep._streams:
            raise LoopbackError(f"{ep.label}: OpenStream {ref!r} twice")
        peer_ref = peer._alloc_peer_ref()
        refs = [ref, ref]
        refs[peer.side] = peer_ref
        st = _Stream(ep.side, uni, refs, injected=False)
        ep._streams[ref] = st
        peer._streams[peer_ref] = st
        self._send_on(
            ep.side,
            st,
            arrival,
            _Delivery(peer.side, event=StreamOpened(stream=peer_ref, uni=uni)),
        )

    def _write(
        self, ep: Endpoint, cmd: WriteStream, start: float, arrival: float, *, pulled: bool
    ) -> None:
        if cmd.opens:
            self._open(ep, cmd.stream, True, arrival)
        st = self._stream(ep, cmd.stream, "WriteStream")
        if not st.can_send(ep.side):
            raise LoopbackError(
                f"{ep.label}: WriteStream on {cmd.stream!r}, a unidirectional stream the "
                "peer opened (receive-only)"
            )
        if st.ended[ep.side] is not None:
            raise LoopbackError(
                f"{ep.label}: WriteStream on {cmd.stream!r} after its {st.ended[ep.side]}"
            )
        chunks: tuple[bytes | memoryview, ...]
        if self.zero_copy:  # the writer promised not to touch these buffers again
            chunks = tuple(v for v in map(_byte_view, cmd.chunks) if len(v))
        else:  # copy now: the machine may reuse the buffers behind its memoryviews
            data = b"".join(cmd.chunks)
            chunks = (data,) if data else ()
        if cmd.fin:
            st.ended[ep.side] = "FIN"
        item = _Delivery(1 - ep.side, stream=st, chunks=chunks, fin=cmd.fin)
        self._log(ep, start, cmd.stream, item.nbytes, pulled)
        if st.injected or not (chunks or cmd.fin):
            return
        self._send_on(ep.side, st, arrival, item)

    def _abort(self, ep: Endpoint, cmd: AbortStream, arrival: float) -> None:
        st = self._stream(ep, cmd.stream, f"AbortStream({cmd.kind.name})")
        other = 1 - ep.side
        if cmd.kind is AbortKind.RESET:
            if not st.can_send(ep.side):
                raise LoopbackError(f"{ep.label}: RESET on {cmd.stream!r}, which it cannot send on")
            if st.ended[ep.side] is not None:  # after FIN or RESET: nothing left to reset
                return
            st.ended[ep.side] = "RESET"
        else:
            if not st.can_receive(ep.side):
                raise LoopbackError(
                    f"{ep.label}: STOP_SENDING on {cmd.stream!r}, which it does not receive"
                )
            if st.stopped[ep.side]:
                return
            st.stopped[ep.side] = True
            if st.ended[other] is not None:  # the peer already finished sending
                return
        if not st.injected:
            event = StreamAborted(stream=st.refs[other], kind=cmd.kind, code=cmd.code)
            self._send_on(ep.side, st, arrival, _Delivery(other, event=event))

    def _datagram(
        self, ep: Endpoint, cmd: SendDatagram, start: float, arrival: float, *, pulled: bool
    ) -> None:
        data: bytes | memoryview
        if self.zero_copy and len(cmd.chunks) == 1:
            data = _byte_view(cmd.chunks[0])
        else:
            data = b"".join(cmd.chunks)
        self._log(ep, start, None, len(data), pulled)
        if self.datagram_loss and self._loss_rng.random() < self.datagram_loss:
            ep.peer.bytes_dropped += len(data)
            return
        self._schedule(arrival, _Delivery(1 - ep.side, event=DatagramReceived(data=data)))

    # --- data plane: pull with a budget --------------------------------------------------

    def _pull(self, ep: Endpoint) -> int | None:
        """Pull object data from ``ep``'s machine if its transmitter is free now.

        Returns how many items ``poll_data`` gave (``None``: it was not called,
        the link is closed or the transmitter busy). The transmitter model: each
        pulled item occupies the wire for ``nbytes / bandwidth`` seconds after the
        previous one and arrives ``latency`` after its last byte left.
        """
        now = self.net.now
        if self.closed or ep._tx_free_at > now:
            return None
        budget = self._budget()
        bw = self.bandwidth
        cursor = now
        got = 0
        ep._backlogged = False
        for _ in range(MAX_POLLS_PER_STEP):
            if budget <= 0:
                ep._backlogged = True
                break
            item = ep.machine.poll_data(budget)
            if item is None:
                break
            got += 1
            n = _nbytes(item.chunks)
            if n > budget:
                raise LoopbackError(
                    f"{ep.label}: poll_data({budget}) returned {n} bytes, over its budget"
                )
            budget -= n
            start = cursor
            if bw is not None:
                cursor += n / bw
            if isinstance(item, WriteStream):
                self._write(ep, item, start, cursor + self.latency, pulled=True)
            elif isinstance(item, SendDatagram):
                self._datagram(ep, item, start, cursor + self.latency, pulled=True)
            else:
                raise LoopbackError(f"{ep.label}: poll_data returned {item!r}")
        else:
            ep._backlogged = True
        ep._tx_free_at = cursor
        return got

    # --- delivery ----------------------------------------------------------------------

    def _deliver(self, item: _Delivery) -> None:
        """Hand one due item to its machine (through the network, which drains it)."""
        ep = self.endpoints[item.to]
        if item.final:
            if ep._finished:
                return
            ep._finished = ep._done = True
        elif ep._done:
            ep.bytes_dropped += item.nbytes
            return
        if item.event is not None:
            self.net._feed(ep, item.event)
            return
        st = item.stream
        assert st is not None
        ref = st.refs[item.to]
        chunks = item.chunks
        n = item.nbytes
        if n == 0:  # a bare FIN
            if not st.stopped[item.to]:
                self.net._feed(ep, StreamData(stream=ref, data=b"", fin=item.fin))
            return
        splitter = self._splitters[1 - item.to]
        spans = _chunk_spans(chunks) if self.zero_copy and splitter.whole else splitter.pieces(n)
        for start, end, piece in _cut(chunks, spans):
            if ep._done or st.stopped[item.to]:
                ep.bytes_dropped += n - start
                return
            self.net._feed(ep, StreamData(stream=ref, data=piece, fin=item.fin and end == n))
