"""The session's output side: transport commands, events and stream-ref allocation.

Theory of operation
-------------------
Inputs and local commands never act on the transport directly; they append to
the queues here, which the adapter drains in protocol order (``protocol.py``):
commands first, then the timer, then events. Keeping the queues in one small
object lets the session's parts (request handling, the publisher's data path,
the subscriber's data path) share them without reaching into each other.
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

    def open_stream(self, *, uni: bool, priority: int = 128) -> StreamRef:
        ref = StreamRef(True, self._next_ref)
        self._next_ref += 1
        self.commands.append(OpenStream(stream=ref, uni=uni, priority=priority))
        return ref

    def new_stream_ref(self) -> StreamRef:
        """A ref for a stream of ours opened later by a ``WriteStream(opens=True)``."""
        ref = StreamRef(True, self._next_ref)
        self._next_ref += 1
        return ref

    def write(self, stream: StreamRef, *chunks: bytes | memoryview, fin: bool = False) -> None:
        self.commands.append(WriteStream(stream=stream, chunks=chunks, fin=fin))

    def send(self, stream: StreamRef, msg: ControlMessageBase, *, fin: bool = False) -> None:
        self.write(stream, encode_message(msg), fin=fin)

    def abort(self, stream: StreamRef, kind: AbortKind, code: int) -> None:
        self.commands.append(AbortStream(stream=stream, kind=kind, code=code))

    def close(self, code: int, reason: str) -> None:
        self.commands.append(CloseTransport(code=code, reason=reason))
        self.closed = True

    def emit(self, event: SessionEvent) -> None:
        self.events.append(event)
