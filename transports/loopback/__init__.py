"""An in-memory, deterministic network that links kvcs machines: product transport and test harness.

Theory of operation
-------------------
A :class:`Network` owns a virtual clock (``net.now``, float seconds from 0.0)
and any number of :class:`Link`\\ s. ``net.connect(a, b, latency=..., bandwidth=...,
chunking=...)`` joins two machines (anything that follows
:class:`kvcs_core.moqt.protocol.Machine`) with one QUIC-like connection: two
:class:`Endpoint`\\ s, ``link.client`` and ``link.server``. A machine sits on one
link only; a multi-session component (a relay) puts one session on each link.
Nothing here reads a wall clock, starts a thread or touches a socket; every
random choice comes from a seeded ``random.Random``; every loop is bounded. The
same machines, inputs and seeds give the same event logs, byte for byte.

**Streams.** A machine names the streams it opens (``StreamRef(local=True, n)``).
When endpoint A's machine emits ``OpenStream``, the link allocates B's name for it,
``StreamRef(local=False, k)`` with ``k`` from B's own counter, and delivers
``StreamOpened(stream=B's ref, uni)`` to B before any byte of the stream. Writes
on either side are translated to the other side's ref, so on a bidirectional
stream B opened, A writes to ``StreamRef(False, k)`` and B reads its own local
ref. ``WriteStream`` bytes arrive as ``StreamData`` in order, FIN on the last
piece; ``AbortStream(RESET)`` arrives as ``StreamAborted(RESET)`` after the bytes
sent before it; ``AbortStream(STOP_SENDING)`` reaches the sending machine as
``StreamAborted(STOP_SENDING)``, and bytes still arriving for the machine that
stopped are discarded (counted in ``Endpoint.bytes_dropped``). The loopback does
not answer STOP_SENDING with a RESET: that is the sending machine's decision.
Every item a side sends on one stream arrives in the order it was sent
(per-stream FIFO), whatever latency or bandwidth changes in between.
``SendDatagram`` arrives as ``DatagramReceived`` (optionally lost, seeded). The
link copies the bytes of a write when it takes it, so a machine may reuse its
buffers; receivers get ``bytes``. ``net.connect(..., zero_copy=True)`` skips
that copy: the writer's buffers themselves travel and receivers get
``memoryview`` slices of them, so a writer on such a link must never mutate or
reuse a buffer once written (true of a session serving a ``TrackStore``, whose
payloads are immutable). It is opt-in, for measuring a machine's own copies
and memory without the simulator's; see ``Network.connect``.

**Machine bugs raise.** A write after FIN or RESET, a write on a receive-only
uni stream, an unknown ref, ``OpenStream`` of a ref twice, a RESET on a stream it
cannot send on, STOP_SENDING on one it does not receive, or ``poll_data``
returning more than its budget raise :class:`LoopbackError` (an
``AssertionError``) out of the ``step``/``run_*`` call. A RESET after the
stream's FIN or RESET, and a repeated STOP_SENDING, are ignored (QUIC allows both).

**Close and faults.** ``CloseTransport(code, reason)`` from A: A gets
``TransportClosed(by_peer=False)`` at once (the next step, same virtual time), B
gets ``TransportClosed(by_peer=True)`` ``latency`` later, after whatever A sent
that arrives by then; bytes arriving later are lost. From the moment of the
close the link carries nothing new: both machines' later commands are ignored
(``link.dropped_commands``) and no data is pulled. ``link.cut(code=0x1,
reason="link cut")`` severs a link: both machines get
``TransportClosed(by_peer=True)`` at the current time, everything in flight is
lost. ``link.set_latency`` and ``link.set_bandwidth`` apply to what is sent next.
``link.inject_stream``, ``inject_data``, ``inject_datagram`` and
``inject_event`` hand raw bytes or events to one machine as if from its peer
(garbage tests); injected bytes go through the link's chunking.

**Control plane and data plane.** Commands from ``next_command()`` (opens,
control-stream writes, resets, datagrams, close) are carried free of bandwidth
after ``latency``: the control plane is small, and the session sends it first
anyway. Object data is *pulled*: in each step, every endpoint whose transmitter
is free is offered a byte budget, and ``poll_data(budget)`` is called until the
budget is spent or it returns ``None``. Without a bandwidth the budget is 1 MiB
per step; with ``bandwidth`` bytes/s it is one *quantum* (default about 1 ms of
the link, at least 1200 bytes) and the transmitter is busy ``nbytes /
bandwidth`` after each item, so 1 MiB at 1 MB/s leaves over 1.048576 virtual
seconds in the order the machine's scheduler chose; each item arrives
``latency`` after its last byte left. ``Endpoint.sent_log`` (and the merged
``Link.sent_log``) records ``Sent(time, stream, nbytes, pulled, sender)`` for
every non-empty write or datagram; ``bytes_sent``/``bytes_received`` count
payload bytes of both planes.

**Chunking.** The receiver's view of stream bytes is cut by the link's
:class:`Chunking`: ``Chunking.WHOLE`` (one ``StreamData`` per write, its chunks
joined; with ``zero_copy`` one event per non-empty chunk of a write, nothing
joined), ``Chunking.BYTEWISE`` (one byte per event) or ``Chunking.random(seed,
max_size)`` (seeded random pieces; with ``seed=None`` derived from the network
seed and link index). ``coalesce=True`` first merges consecutive writes of one
stream that are due together, so pieces can span write boundaries. Every
policy delivers the same concatenated bytes.

**Driving.** ``net.step()`` (1) drains every machine (so local commands called
between steps take effect), (2) if nothing is due at ``now``, moves the clock to
:meth:`Network.next_time`, the earliest of the next delivery, any machine's
``get_timer()`` and the next pacing slot of an endpoint that may have data,
(3) delivers every item that was due when the step began (items a delivery
causes at the same instant wait for the next step, so a zero-latency exchange
is one step per round trip), (4) calls ``handle_timer(now)`` on each machine
whose timer is due, (5) pulls data. Every ``handle_transport_event``,
``handle_timer`` and ``poll_data`` call is followed by
:func:`kvcs_core.moqt.protocol.drain`: commands are applied to the link, the
deadline is remembered, events go to ``net.events(machine)`` and to every
``net.on_event(callback)`` callback; callbacks may call local commands on any
machine, and then every machine is drained until quiet. ``net.poke(machine)``
drains one machine at once. ``net.run_until(predicate)`` steps until the
predicate holds, raising :class:`Livelock` when nothing is pending ("stuck") or
``max_steps`` run out, and :class:`LoopbackTimeout` when the next activity lies
beyond ``max_time`` virtual seconds; ``net.run_until_idle()`` steps until
nothing is due before the horizon; ``net.run_for(seconds)`` runs an interval and
leaves the clock at its end. The clock never goes backwards and every
``handle_*`` call gets ``now``.

Limits: ``net.events`` and ``net.trace`` grow with the run (turn them off with
``keep_events=False`` / leave ``trace=False`` for long product runs); stream
bookkeeping is kept for the life of a link; in-flight bytes are bounded by what
the machines write, which the pull model bounds by bandwidth x latency plus the
control plane.
"""

from __future__ import annotations

from ._link import UNLIMITED_BUDGET, Endpoint, Link
from ._network import Network
from ._policy import Chunking, Livelock, LoopbackError, LoopbackTimeout, Sent, TraceRecord

__all__ = [
    "UNLIMITED_BUDGET",
    "Chunking",
    "Endpoint",
    "Link",
    "Livelock",
    "LoopbackError",
    "LoopbackTimeout",
    "Network",
    "Sent",
    "TraceRecord",
]
