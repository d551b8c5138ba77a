"""Per-request state: one record per bidirectional request stream.

Theory of operation
-------------------
Every MOQT request lives on its own bidirectional stream (d21 section 6.4.2):
the first message is the request (SUBSCRIBE, FETCH, TRACK_STATUS, PUBLISH,
PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS), then the responder
answers with exactly one OK or REQUEST_ERROR, then updates and their answers
(matched by order, wire reference 4.4), notifications, and, for subscriptions,
PUBLISH_DONE. :class:`RequestRecord` keeps what one side knows about one such
stream, whichever side opened it; the lifecycle table below is what the session
enforces:

=============== ======================================================
state           meaning
=============== ======================================================
PENDING         request sent/received, no answer yet
ESTABLISHED     OK sent/received (subscriptions, namespace requests)
DONE            finished normally (FETCH complete, PUBLISH_DONE, ...)
FAILED          REQUEST_ERROR, cancellation or a local failure
=============== ======================================================

Request IDs (d21 section 6.4.2.1): the client uses even IDs, the server odd
ones, +2 per request *and per REQUEST_UPDATE*. Wrong parity or reuse closes the
session with INVALID_REQUEST_ID. IDs arrive out of order, so the set of seen
IDs is kept as a low watermark plus a bounded set above it (Ambiguity A28;
:class:`RequestIdTracker`).
"""

from __future__ import annotations

import enum
import heapq
from collections import deque

import attrs

from kvcs_core.moqt.events import RequestKind
from kvcs_core.moqt.transport_io import StreamRef
from kvcs_core.wire.codes import GroupOrder, MessageType
from kvcs_core.wire.messages import ControlStreamDecoder
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace
from kvcs_core.wire.params import Parameters

REQUEST_KIND_OF: dict[MessageType, RequestKind] = {
    MessageType.SUBSCRIBE: RequestKind.SUBSCRIBE,
    MessageType.FETCH: RequestKind.FETCH,
    MessageType.TRACK_STATUS: RequestKind.TRACK_STATUS,
    MessageType.PUBLISH_NAMESPACE: RequestKind.PUBLISH_NAMESPACE,
    MessageType.SUBSCRIBE_NAMESPACE: RequestKind.SUBSCRIBE_NAMESPACE,
    MessageType.SUBSCRIBE_TRACKS: RequestKind.SUBSCRIBE_TRACKS,
    MessageType.PUBLISH: RequestKind.PUBLISH,
}
MESSAGE_OF_KIND: dict[RequestKind, MessageType] = {v: k for k, v in REQUEST_KIND_OF.items()}


class RequestState(enum.IntEnum):
    PENDING = 1
    ESTABLISHED = 2
    DONE = 3
    FAILED = 4


@attrs.define(eq=False)
class RequestRecord:
    """What this session knows about one request stream."""

    request_id: int
    kind: RequestKind
    stream: StreamRef
    mine: bool
    """True when this endpoint sent the request."""
    opened_at: float
    decoder: ControlStreamDecoder = attrs.field(factory=ControlStreamDecoder)
    state: RequestState = RequestState.PENDING
    track: FullTrackName | None = None
    namespace: TrackNamespace | None = None
    """PUBLISH_NAMESPACE namespace, or SUBSCRIBE_NAMESPACE prefix (current)."""
    params: Parameters = attrs.field(factory=Parameters)
    group_order: GroupOrder = GroupOrder.ASCENDING
    track_alias: int | None = None
    largest: Location | None = None
    pending_updates: deque[int] = attrs.field(factory=deque)
    """Request IDs of REQUEST_UPDATEs awaiting an answer, in order (answers match by order)."""
    peer_fin: bool = False
    local_fin: bool = False
    goaway_seen: bool = False
    cancelled: bool = False
    """Ours, cancelled locally: what the peer sent before it saw our reset is ignored."""
    deferred_updates: list[object] = attrs.field(factory=list)
    """Peer REQUEST_UPDATEs that arrived before we answered the request itself: they are
    answered after it, because answers are matched by order (wire reference 4.4)."""
    tokens: tuple[tuple[int, bytes], ...] = ()
    """Authorization tokens the peer presented with this request (type, value), aliases
    resolved (d21 section 8.9)."""
    announced: set[tuple[bytes, ...]] = attrs.field(factory=set)
    """SUBSCRIBE_NAMESPACE: suffixes announced and not yet withdrawn."""
    pending_prefixes: dict[int, TrackNamespace] = attrs.field(factory=dict)
    """Our REQUEST_UPDATEs carrying TRACK_NAMESPACE_PREFIX, by update ID: the new prefix
    applies from their REQUEST_OK on (wire reference 5.8)."""

    @property
    def finished(self) -> bool:
        return self.state in (RequestState.DONE, RequestState.FAILED)

    def change_prefix(self, prefix: TrackNamespace) -> None:
        """A TRACK_NAMESPACE_PREFIX update took effect: suffixes are relative to ``prefix``
        from now on (wire reference 5.8). The namespaces announced so far are kept,
        re-expressed against it; those outside it left the request's scope."""
        old = self.namespace
        self.namespace = prefix
        if old is None or not self.announced:
            return
        kept: set[tuple[bytes, ...]] = set()
        for suffix in self.announced:
            full = old + TrackNamespace(suffix)
            if prefix.is_prefix_of(full):
                kept.add(full.suffix_after(prefix).fields)
        self.announced = kept


@attrs.define
class RequestIdTracker:
    """Validates the peer's Request IDs: parity and no reuse (d21 6.4.2.1, Ambiguity A28).

    IDs below the low watermark are all "seen"; IDs above are kept in a set that
    the watermark absorbs as it advances. The set is bounded (``limit``): a peer that
    skips IDs cannot make it grow for ever. When it is full, the watermark jumps to
    just past the smallest ID held, so the IDs it skipped below that count as used
    (A28: "IDs far below the watermark count as reused"). Each step costs
    O(log limit).
    """

    parity: int
    limit: int = 4096
    _watermark: int = 0
    """Every ID of our parity below this has been seen (or given up on)."""
    _above: set[int] = attrs.field(factory=set)
    _heap: list[int] = attrs.field(factory=list)
    """The IDs of ``_above``, as a min-heap."""

    def __attrs_post_init__(self) -> None:
        self._watermark = self.parity

    def accept(self, request_id: int) -> bool:
        """Record ``request_id``; False when its parity is wrong or it was used before."""
        if request_id & 1 != self.parity:
            return False
        if request_id < self._watermark or request_id in self._above:
            return False
        above, heap = self._above, self._heap
        above.add(request_id)
        heapq.heappush(heap, request_id)
        if len(above) > self.limit:
            self._watermark = heap[0]  # give up on the IDs skipped below the smallest held
        while heap and heap[0] == self._watermark:
            above.discard(heapq.heappop(heap))
            self._watermark += 2
        return True

    @property
    def window(self) -> int:
        """IDs held above the watermark (the out-of-order window)."""
        return len(self._above)
