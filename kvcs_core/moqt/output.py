"""The session's output side: transport commands, events and stream-ref allocation.

Theory of operation
-------------------
Inputs and local commands never act on the transport directly; they append to
the queues here, which the adapter drains in protocol order (``protocol.py``):
commands first, then the timer, then events. Keeping the queues in one small
object lets the session's parts (request handling, the publisher's data path,
the subscriber's data path) share them without reaching into each other.

Bidirectional streams are opened within the peer's stream credit
(:class:`~kvcs_core.moqt.transport_io.StreamCredit`): once the transport has
reported a credit and it is used up, a new bidi stream's ``OpenStream`` and
every later command on that stream are *held* here, stream by stream in FIFO
order, and released (``grant_bidi``) as the credit grows. Only our own
request streams are bidi streams we open, so the hold holds only requests the
application made; the session bounds it (``SessionConfig.max_held_requests``).
A held stream that is given up before it was opened is dropped (``drop_held``)
and never reaches the transport.
"""

from __future__ import annotations

from collections import deque

from kvcs_core.moqt.events import SessionEvent
from kvcs_core.moqt.transport_io import (
    AbortKind,
    AbortStream,
    CloseTransport,
    OpenStream,
    StreamRef,
    TransportCommand,
    WriteStream,
)
from kvcs_core.wire.messages import ControlMessageBase, encode_message


class Output:
    """Queues of transport commands and session events, plus local stream refs."""

    def __init__(self) -> None:
        self.commands: deque[TransportCommand] = deque()
        self.events: deque[SessionEvent] = deque()
        self._next_ref = 0
        self.closed = False
        self.bidi_credit: int | None = None
        """Bidi streams of ours the peer allows in total (``None``: never reported)."""
        self.bidi_opened = 0
        """Bidi streams of ours handed to the transport (``OpenStream`` emitted)."""
        self._held: dict[StreamRef, list[TransportCommand]] = {}
        """Bidi streams waiting for credit, in the order they were opened (FIFO), each
        with its ``OpenStream`` and the commands issued on it since."""

    def open_stream(self, *, uni: bool, priority: int = 128) -> StreamRef:
        ref = StreamRef(True, self._next_ref)
        self._next_ref += 1
        cmd = OpenStream(stream=ref, uni=uni, priority=priority)
        if not uni:
            if self.credit_exhausted:
                self._held[ref] = [cmd]
                return ref
            self.bidi_opened += 1
        self.commands.append(cmd)
        return ref

    @property
    def credit_exhausted(self) -> bool:
        """A new bidi stream would be held (credit known and used up, or others wait)."""
        if self._held:
            return True
        return self.bidi_credit is not None and self.bidi_opened >= self.bidi_credit

    @property
    def held(self) -> int:
        """Bidi streams held for credit."""
        return len(self._held)

    def is_held(self, stream: StreamRef) -> bool:
        return bool(self._held) and stream in self._held

    def grant_bidi(self, total: int) -> list[StreamRef]:
        """The peer now allows ``total`` bidi streams of ours: release held streams
        (oldest first) up to it; returns the streams released, in order."""
        if self.bidi_credit is not None and total <= self.bidi_credit:
            return []
        self.bidi_credit = total
        released: list[StreamRef] = []
        held = self._held
        while held and self.bidi_opened < total:
            ref = next(iter(held))
            self.commands.extend(held.pop(ref))
            self.bidi_opened += 1
            released.append(ref)
        return released

    def drop_held(self, stream: StreamRef) -> bool:
        """Forget a held stream and its commands; False if it is not held."""
        return bool(self._held) and self._held.pop(stream, None) is not None

    def _queue(self, stream: StreamRef, cmd: TransportCommand) -> None:
        held = self._held.get(stream) if self._held else None
        if held is not None:
            held.append(cmd)
        else:
            self.commands.append(cmd)

    def new_stream_ref(self) -> StreamRef:
        """A ref for a stream of ours opened later by a ``WriteStream(opens=True)``."""
        ref = StreamRef(True, self._next_ref)
        self._next_ref += 1
        return ref

    def write(self, stream: StreamRef, *chunks: bytes | memoryview, fin: bool = False) -> None:
        self._queue(stream, WriteStream(stream=stream, chunks=chunks, fin=fin))

    def send(self, stream: StreamRef, msg: ControlMessageBase, *, fin: bool = False) -> None:
        self.write(stream, encode_message(msg), fin=fin)

    def abort(self, stream: StreamRef, kind: AbortKind, code: int) -> None:
        self._queue(stream, AbortStream(stream=stream, kind=kind, code=code))

    def close(self, code: int, reason: str) -> None:
        self.commands.append(CloseTransport(code=code, reason=reason))
        self.closed = True
        self._held.clear()

    def emit(self, event: SessionEvent) -> None:
        self.events.append(event)
