"""The virtual clock, the delivery queue and the step loop of the loopback network."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from kvcs_core.moqt.protocol import Machine
from kvcs_core.moqt.transport_io import (
    DatagramReceived,
    StreamData,
    TransportCommand,
    TransportEvent,
)

from ._link import Endpoint, Link, _Delivery
from ._policy import Chunking, Livelock, LoopbackError, LoopbackTimeout, TraceRecord

EventCallback = Callable[[Machine[Any], Any], Any]
ScopedEventCallback = Callable[[Machine[Any], Any], "Iterable[Machine[Any]] | None"]
MAX_DRAIN_PASSES = 1000
"""Rounds of "drain every machine" after callbacks before a callback loop is a Livelock."""


class Network:
    """An in-memory, deterministic network of :class:`Link`s with a virtual clock.

    Args:
        seed: derives every random choice (random chunking without its own seed,
            datagram loss), so equal inputs give equal runs.
        trace: keep :attr:`trace`, every transport event handed to any machine.
        keep_events: keep every machine's drained events in :meth:`events`
            (turn off for long product runs and use :meth:`on_event`).
    """

    def __init__(self, seed: int = 0, *, trace: bool = False, keep_events: bool = True) -> None:
        self.seed = seed
        self._now = 0.0
        self._links: list[Link] = []
        self._endpoints: dict[int, Endpoint] = {}  # id(machine) -> endpoint
        self._machines: list[Machine[Any]] = []
        self._deadlines: list[float | None] = []  # parallel to _machines
        self._index: dict[int, int] = {}  # id(machine) -> position in _machines
        self._events: list[list[Any]] = []  # parallel to _machines
        # Skipping quiet machines (see _drain_all): ``_gen`` counts the moments at which
        # any machine may have changed without an input from the network (an on_event
        # callback ran, or a public driver was entered after local commands);
        # ``_drained_gen[i]`` is the ``_gen`` at machine i's last drain.
        self._gen = 0
        self._drained_gen: list[int] = []  # parallel to _machines
        self._keep_events = keep_events
        self._callbacks: list[tuple[EventCallback, bool]] = []  # (callback, scoped)
        self._queue: list[tuple[float, int, Link, _Delivery]] = []
        self._seq = 0
        self.trace: list[TraceRecord] | None = [] if trace else None
        """With ``trace=True``: ``(time, endpoint label, event)`` for every delivered event."""
        self.steps = 0
        """Steps run so far (all ``step``/``run_*`` calls)."""

    # --- set-up and getters --------------------------------------------------------------

    @property
    def now(self) -> float:
        """The virtual clock, seconds since the network was made (never goes backwards)."""
        return self._now

    @property
    def links(self) -> tuple[Link, ...]:
        return tuple(self._links)

    def connect(
        self,
        client: Machine[Any],
        server: Machine[Any],
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        chunking: Chunking = Chunking.WHOLE,
        coalesce: bool = False,
        quantum: int | None = None,
        datagram_loss: float = 0.0,
        name: str = "",
        zero_copy: bool = False,
    ) -> Link:
        """Link two machines with a QUIC-like connection.

        Args:
            client, server: the two machines; each may sit on one link only.
            latency: one-way delay, virtual seconds.
            bandwidth: bytes/s per direction for data pulled with ``poll_data``;
                ``None`` = unlimited (1 MiB offered per endpoint per step).
            chunking: how stream bytes are cut into ``StreamData`` events.
            coalesce: merge consecutive writes of a stream that are due together
                into one before chunking.
            quantum: ``poll_data`` budget per pacing slot (see ``Link.set_bandwidth``).
            datagram_loss: probability (seeded) that a datagram is dropped.
            name: label used in logs and errors (default ``link<N>``).
            zero_copy: carry the machines' write buffers to the peer instead of
                copying them. A writer must then never mutate or reuse a buffer it
                has passed in a ``WriteStream`` or ``SendDatagram`` (a
                ``TrackStore`` payload is immutable, so a session serving one
                qualifies), and receivers get ``memoryview`` slices of the
                sender's buffers. ``Chunking.WHOLE`` then delivers one
                ``StreamData`` per non-empty *chunk* of a write (header and
                payload apart, as a QUIC stack that sends from the caller's
                buffers would); other chunkings cut the same pieces as without
                ``zero_copy``, joining bytes only for a piece that spans chunks.
                A datagram of one chunk is passed on; one of several is joined.

        Raises:
            LoopbackError: a machine is already on a link, or client is server.
        """
        if client is server:
            raise LoopbackError("a link needs two different machines")
        for m in (client, server):
            if id(m) in self._endpoints:
                raise LoopbackError(
                    f"{m!r} is already on {self._endpoints[id(m)].link!r}: one link per machine "
                    "(a multi-session component puts one session on each link)"
                )
        link = Link(
            self,
            len(self._links),
            client,
            server,
            latency=latency,
            bandwidth=bandwidth,
            chunking=chunking,
            coalesce=coalesce,
            quantum=quantum,
            datagram_loss=datagram_loss,
            name=name,
            zero_copy=zero_copy,
        )
        self._links.append(link)
        for ep in link.endpoints:
            self._endpoints[id(ep.machine)] = ep
            self._index[id(ep.machine)] = len(self._machines)
            self._machines.append(ep.machine)
            self._deadlines.append(None)
            self._events.append([])
            self._drained_gen.append(-1)
        for ep in link.endpoints:  # a machine may have queued output before it was linked
            self._settle(ep.machine)
        return link

    def endpoint(self, machine: Machine[Any]) -> Endpoint:
        """The endpoint ``machine`` sits on."""
        ep = self._endpoints.get(id(machine))
        if ep is None:
            raise LoopbackError(f"{machine!r} is not on this network")
        return ep

    def link_of(self, machine: Machine[Any]) -> Link:
        """The link ``machine`` sits on."""
        return self.endpoint(machine).link

    def events(self, machine: Machine[Any]) -> list[Any]:
        """Every event drained from ``machine`` so far (the live list, oldest first)."""
        self.endpoint(machine)
        return self._events[self._index[id(machine)]]

    def on_event(self, callback: EventCallback, *, scoped: bool = False) -> None:
        """Call ``callback(machine, event)`` for every event drained from any machine.

        The callback may call local commands on any machine; the network drains
        every machine afterwards (in link order) until they are quiet.

        With ``scoped=True`` the callback returns the machines it may have changed
        (called local commands on, or changed what they serve), ``()`` for none, or
        ``None`` for "any"; only those are drained again, which saves work on a
        network of many machines. What the machines see is the same as without
        ``scoped`` as long as the callback names every machine it changed.
        """
        self._callbacks.append((callback, scoped))

    def next_time(self) -> float | None:
        """When something is next due: a delivery, a machine timer or a pacing slot.

        ``None`` when the network is idle (nothing in flight, no timer set, no
        machine with data that may be pulled). A value ``<= now`` means due now.
        """
        candidates: list[float] = []
        if self._queue:
            candidates.append(self._queue[0][0])
        candidates.extend(d for d in self._deadlines if d is not None)
        for link in self._links:
            if not link.closed:
                candidates.extend(ep._tx_free_at for ep in link.endpoints if ep._backlogged)
        return min(candidates, default=None)

    @property
    def idle(self) -> bool:
        """Nothing pending at all (see :meth:`next_time`; pure, drains nothing)."""
        return self.next_time() is None

    # --- driving ---------------------------------------------------------------------------

    def poke(self, machine: Machine[Any]) -> None:
        """Drain ``machine`` now, after calling a local command on it outside the loop.

        Optional: ``step`` and every ``run_*`` drain all machines before each step.
        """
        self.endpoint(machine)._backlogged = True
        self._settle(machine)

    def step(self) -> bool:
        """Run steps up to the first one where something happens; ``False``: idle.

        A step (1) drains every machine, (2) if nothing is due at ``now``, moves the
        clock forward to :meth:`next_time`, (3) delivers every item that was due
        when the step began, draining each receiver after each event, (4) fires
        ``handle_timer(now)`` on every machine whose timer is due, (5) pulls
        data with ``poll_data`` from every endpoint whose transmitter is free.
        Something "happens" when an item is delivered, a timer fires or data is
        pulled; a step in which only empty polls ran (machines that may have had
        data after a local command) is followed by the next one, so
        ``while net.step(): ...`` walks the network one instant at a time and ends
        when it is idle.
        """
        self._entry()
        for _ in range(2 * len(self._machines) + 2):  # each empty step clears flags
            happened = self._step()
            if happened is None:
                return False
            if happened:
                return True
        return True

    def run_until(
        self,
        predicate: Callable[[], bool],
        *,
        max_steps: int = 100_000,
        max_time: float = 3600.0,
    ) -> None:
        """Run steps until ``predicate()`` is true (checked before each step).

        The clock rests at the time of the step that made the predicate true.
        ``predicate`` must be pure; react to events with :meth:`on_event`.

        Raises:
            Livelock: nothing is pending and the predicate is false ("stuck"), or
                ``max_steps`` steps ran (the message says whether the clock moved).
            LoopbackTimeout: the next step would be more than ``max_time`` virtual
                seconds after the call (the clock is left where it was).
        """
        self._entry()
        start = self._now
        limit = start + max_time
        for _ in range(max_steps):
            if predicate():
                return
            t = self.next_time()
            if t is None:
                raise Livelock(
                    f"stuck at t={self._now:.6f}: nothing in flight, no timer, no data to "
                    "pull, and the predicate is still false"
                )
            if t > limit:
                raise LoopbackTimeout(
                    f"predicate still false after {max_time} virtual seconds "
                    f"(t={self._now:.6f}, next activity at t={t:.6f})"
                )
            self._step()
        if predicate():
            return
        moved = (
            "the clock did not move"
            if self._now == start
            else (f"clock moved {start:.6f} -> {self._now:.6f}")
        )
        raise Livelock(f"predicate still false after max_steps={max_steps} steps; {moved}")

    def run_until_idle(self, *, max_steps: int = 100_000, max_time: float = 3600.0) -> None:
        """Run until nothing is pending before ``now + max_time`` (returns normally then).

        A machine with a periodic timer is never idle; it simply runs to the horizon.

        Raises:
            Livelock: ``max_steps`` steps ran and work was still due before the horizon.
        """
        self._entry()
        limit = self._now + max_time
        for _ in range(max_steps):
            t = self.next_time()
            if t is None or t > limit:
                return
            self._step()
        t = self.next_time()
        if t is None or t > limit:
            return
        raise Livelock(f"still busy after max_steps={max_steps} steps (t={self._now:.6f})")

    def run_for(self, duration: float, *, max_steps: int = 100_000) -> None:
        """Run everything due in the next ``duration`` seconds, then set the clock to its end.

        Raises:
            Livelock: ``max_steps`` steps ran before the end of the interval.
        """
        if duration < 0:
            raise ValueError("duration must be >= 0")
        self._entry()
        target = self._now + duration
        for _ in range(max_steps):
            t = self.next_time()
            if t is None or t > target:
                self._advance(target)
                return
            self._step()
        raise Livelock(f"max_steps={max_steps} ran out before t={target:.6f}")

    # --- internals -------------------------------------------------------------------------

    def _entry(self) -> None:
        """A public driver was called: local commands may have run since the last one."""
        for link in self._links:
            for ep in link.endpoints:
                ep._backlogged = True
        self._gen += 1
        self._drain_all()

    def _advance(self, t: float) -> None:
        self._now = max(self._now, t)

    def _step(self) -> bool | None:
        """One step; ``None``: idle, else whether anything was delivered, fired or pulled."""
        self.steps += 1
        self._drain_all()
        t = self.next_time()
        if t is None:
            return None
        self._advance(t)
        now = self._now
        happened = False
        # 1. deliveries that were due when the step began (later ones: next step, so a
        #    zero-latency ping-pong takes one step per round trip and stays bounded).
        seq_limit = self._seq
        q = self._queue
        while q and q[0][0] <= now and q[0][1] < seq_limit:
            _, _, link, item = heapq.heappop(q)
            if link.coalesce and item.stream is not None:
                while (
                    not item.fin
                    and q
                    and q[0][0] <= now
                    and q[0][1] < seq_limit
                    and q[0][2] is link
                    and q[0][3].stream is item.stream
                    and q[0][3].to == item.to
                ):
                    nxt = heapq.heappop(q)[3]
                    item.chunks += nxt.chunks  # the bytes are joined only where a piece spans
                    item.nbytes += nxt.nbytes
                    item.fin = nxt.fin
            link._deliver(item)
            happened = True
        # 2. timers
        for i, m in enumerate(self._machines):
            d = self._deadlines[i]
            if d is not None and d <= now:
                self._endpoints[id(m)]._backlogged = True
                m.handle_timer(now)
                self._settle(m)
                happened = True
        # 3. data (an endpoint that is not backlogged returned None from its last
        #    poll_data and got no input since, so it has nothing: see next_time)
        for link in self._links:
            for ep in link.endpoints:
                if not ep._backlogged:
                    continue
                got = link._pull(ep)
                if got is not None:  # polled: poll_data may have produced output too
                    self._settle(ep.machine)
                    happened = happened or got > 0
        return happened

    def _schedule(self, when: float, link: Link, item: _Delivery) -> None:
        heapq.heappush(self._queue, (max(when, self._now), self._seq, link, item))
        self._seq += 1

    def _feed(self, ep: Endpoint, event: TransportEvent) -> None:
        """Hand one transport event to a machine, then drain it."""
        if self.trace is not None:
            self.trace.append(TraceRecord(self._now, ep.label, event))
        if isinstance(event, (StreamData, DatagramReceived)):
            d = event.data
            ep.bytes_received += d.nbytes if isinstance(d, memoryview) else len(d)
        ep._backlogged = True
        ep.machine.handle_transport_event(event, self._now)
        self._settle(ep.machine)

    def _drain_one(self, machine: Machine[Any], i: int = -1) -> tuple[bool, bool]:
        """Drain one machine (at position ``i`` when known); returns (it produced output,
        a callback may have changed a machine). The order is
        ``kvcs_core.moqt.protocol.drain``'s: commands, timer, events."""
        if i < 0:
            i = self._index[id(machine)]
        next_command = machine.next_command
        commands: list[TransportCommand] = []
        while (cmd := next_command()) is not None:
            commands.append(cmd)
        self._deadlines[i] = machine.get_timer()
        next_event = machine.next_event
        events: list[Any] = []
        while (e := next_event()) is not None:
            events.append(e)
        self._drained_gen[i] = self._gen
        if commands:
            ep = self._endpoints[id(machine)]
            ep._backlogged = True
            for cmd in commands:
                ep.link._apply(ep, cmd)
        called = False
        if events:
            for e in events:
                if self._keep_events:
                    self._events[i].append(e)
                for cb, scoped in self._callbacks:
                    touched = cb(machine, e)
                    if scoped and touched is not None:
                        for t in touched:
                            self._drained_gen[self._index[id(t)]] = -1
                            self._endpoints[id(t)]._backlogged = True
                            called = True
                    else:  # it may have touched any machine
                        self._gen += 1
                        for link in self._links:
                            for ep in link.endpoints:
                                ep._backlogged = True
                        called = True
        return bool(commands or events), called

    def _settle(self, machine: Machine[Any]) -> None:
        """Drain ``machine``; if a callback ran, drain everyone until quiet."""
        _, called = self._drain_one(machine)
        if called:
            self._drain_all()

    def _drain_all(self) -> None:
        """Drain every machine, in link order, until a pass finds them all quiet.

        A machine is drained again only if it may have new output: it was drained
        before the last callback ran or public driver was entered (``_gen``), or a
        scoped callback named it. One drained after that and given no input since
        holds no commands or events and the same timer, so draining it again would
        change nothing. (Inputs from the network, ``handle_transport_event``,
        ``handle_timer`` and ``poll_data``, are each followed by a drain of their
        machine, see ``_settle``.)
        """
        machines = self._machines
        drained = self._drained_gen
        for _ in range(MAX_DRAIN_PASSES):
            busy = False
            for i, m in enumerate(machines):
                if drained[i] == self._gen:
                    continue
                produced, _ = self._drain_one(m, i)
                busy = busy or produced
            if not busy:
                return
        raise Livelock(
            f"machines still emitted output after {MAX_DRAIN_PASSES} drain passes "
            "(an on_event callback feeding itself?)"
        )
