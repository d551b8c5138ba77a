"""Deadlines without a clock: one table for every timer of a session (STYLE.md R5).

Theory of operation
-------------------
The session never reads a clock: each input carries ``now`` and the session
reports its earliest deadline through ``get_timer()``. Fixed timers (SETUP,
GOAWAY) have one slot each; per-request timers (a request of ours awaiting its
answer, d21 section 12.2 CONTROL_MESSAGE_TIMEOUT) are keyed by Request ID. A
request's timer is set when its stream is opened within the peer's stream
credit, not while the request is held waiting for that credit (:mod:`.output`).
Object delivery timeouts live with the publisher's send queues (d21 section
5.2), which report their own earliest deadline here.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterator


class TimerKind(enum.IntEnum):
    SETUP = 1
    """Peer SETUP overdue -> CONTROL_MESSAGE_TIMEOUT."""
    GOAWAY = 2
    """Our GOAWAY timeout passed with requests still open -> GOAWAY_TIMEOUT."""
    REQUEST = 3
    """A request of ours unanswered -> CONTROL_MESSAGE_TIMEOUT."""
    PUBLISHER = 4
    """The publisher's data path (delivery timeouts) wants a call."""


class Deadlines:
    """A heap of (deadline, kind, key) with lazy cancellation."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._live: dict[tuple[int, int], float] = {}

    def set(self, kind: TimerKind, at: float, key: int = 0) -> None:
        self._live[(kind, key)] = at
        heapq.heappush(self._heap, (at, kind, key))

    def cancel(self, kind: TimerKind, key: int = 0) -> None:
        self._live.pop((kind, key), None)

    def set_request(self, request_id: int, at: float) -> None:
        self.set(TimerKind.REQUEST, at, request_id)

    def cancel_request(self, request_id: int) -> None:
        self.cancel(TimerKind.REQUEST, request_id)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def _prune(self) -> None:
        while self._heap:
            at, kind, key = self._heap[0]
            if self._live.get((kind, key)) == at:
                return
            heapq.heappop(self._heap)

    def earliest(self) -> float | None:
        self._prune()
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float) -> Iterator[tuple[TimerKind, int]]:
        """Yield (kind, key) of every live deadline <= now, removing it."""
        while True:
            self._prune()
            if not self._heap or self._heap[0][0] > now:
                return
            _, kind, key = heapq.heappop(self._heap)
            del self._live[(kind, key)]
            yield TimerKind(kind), key
