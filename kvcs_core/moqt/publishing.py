"""The publisher's data path: serving subscriptions, fills and FETCHes from a TrackStore.

Theory of operation
-------------------
Objects live in a :class:`~.track_store.TrackStore` (shared by every session that serves the
track); this module decides what goes to *this* peer, on which stream, in which
order (d21 sections 3, 5.1.2, 11):

* **Subscriptions** (d21 section 3.1). On SUBSCRIBE_OK the subscription window
  and the fill range are computed against one Largest Object in one step
  (Ambiguity A27), so the exactly-once recipe (NEXT_OBJECT + FILL{ABSOLUTE_START
  0,0}) has neither gap nor overlap (wire reference section 6). From then on the
  store's listener offers each new object; objects that pass Forward, the
  window and the range filters (d21 3.3.3) go onto one subgroup stream per
  (group, subgroup) (d21 11.3), opened by the first pull that writes to it (its
  SUBGROUP_HEADER travels in that ``WriteStream(opens=True)``, so a producer far
  ahead of its link does not hold a stream open per queued group), FIN'd after an End of Group
  or End of Track object or when a later group starts (the original publisher
  produces groups in order), or onto datagrams for Datagram-preference objects.
* **Fills** (d21 section 3.4). A fill is a fetch-format stream named by the
  SUBSCRIBE's (or REQUEST_UPDATE's) Request ID, carrying the objects of the
  fill range and FIN'd at its end; it is only opened while Forward is 1.
* **FETCH** (d21 section 9.11). The range is evaluated with the FETCH rules;
  nothing published or a start past Largest Object is REQUEST_ERROR
  INVALID_RANGE. FETCH_OK is sent at once (End Location = the last object that
  exists in the range, Ambiguity A2d) and the objects follow on one stream.
* **Served ranges are snapshots.** A fill or FETCH takes the list of the
  store's objects in its range when it is processed (references to the stored
  objects, no payload copy) and sends from that list, so a relay evicting
  groups of the store meanwhile (its cache budget) removes nothing from a
  response in progress: the objects being served keep their buffers alive
  until written; eviction only drops the store's own index. The response lets
  go of each object once it is written, so what an evicted snapshot holds
  shrinks as it progresses.
* **Late objects (Ambiguity A27).** Objects can reach the store out of order
  (a relay's upstream delivers subgroups, fills and fetches on separate
  streams): an object below a subscription's live start may be appended after
  the subscription's fill was computed. It is not in the fill's snapshot and
  the window rejects it (wire reference 5.4: objects below a NEXT_OBJECT start
  do not pass), yet it belongs to the fill range, so it is *fill-delivered*:
  sent on a further fetch-format stream named by the same Request ID as the
  fill (a *late fill* stream, FIN'd once drained; several fill streams may be
  open at once, wire reference 6 item 1), counted in Stream Count. Every
  object of the fill range thus reaches the subscriber exactly once, whenever
  it reaches the store (the exactly-once recipe, wire reference 6). A
  subscription remembers its last ``_MAX_FILL_RECORDS`` fill ranges.
* **Restores.** A cache (a relay) may evict objects and append them again
  later (fetched upstream for a late joiner). Such an object is not new: while
  :attr:`Publisher.restoring` names the store (``MoqtSession.restoring``), an
  appended object is never sent on the live path, and on a late fill stream
  only to fills whose snapshot lacked its group (they were computed while it
  was evicted), so nobody receives an object twice.
* **Sending is pulled** (STYLE.md R9): :meth:`Publisher.poll_data` asks the
  :class:`Scheduler` for the most urgent sender (d21 5.1.2: subscriber
  priority, then publisher priority, then group order, fill before subscription
  within a group, then subgroup) and writes at most ``max_bytes`` of it, header
  and payload as separate chunks (scatter/gather; payloads are views into the
  store, never copied). Fills and fetches read the store through a cursor, so a
  large range costs no queue memory.
* **Cut-through (a relay's store still filling).** A cache may answer a
  request before the objects it covers have all arrived (it knows the range
  from its upstream's answer) and mark its store *filling*
  (:attr:`~.track_store.TrackStore.filling`). Then a late-fill stream (A27) is not FIN'd
  when drained but kept for the next object of its fill range, and a FETCH
  served with a known End Location (``accept_fetch(..., end=...)``) keeps its
  stream after its snapshot and sends each object of its range appended
  later, in order; both finish when the store settles (or, for the FETCH,
  once End Location is sent). An object that reaches such a FETCH out of
  order cannot go on its one stream: the stream is reset (INTERNAL_ERROR),
  a typed failure the consumer recovers from, never a silent gap.
* **Queue limit.** Queued objects are references into the store: while the
  store holds them they cost nothing beyond it, so a subscriber that is behind
  is served at its own pace. What counts against
  ``max_queued_bytes_per_subscription`` is what its queues hold of groups the
  store has evicted since they were queued (the store tells its watchers; a
  group evicted again as it grows is counted once, at what is queued of it then);
  past the limit the subscription ends with PUBLISH_DONE TOO_FAR_BEHIND and
  its streams are reset (d21 5.2). A cache's budget, not a per-subscriber
  queue, bounds memory.
* **Closing** the session lets go of every queued object, snapshot and store
  listener at once (:meth:`Publisher.release`): a relay's evicted objects that a
  gone subscriber still queued are freed with it.
* **Ending**. ``end_subscription`` lets queued objects drain, FINs every stream,
  then sends PUBLISH_DONE with the stream count (d21 9.9: PUBLISH_DONE only after
  every stream is closed). A cancelled subscription resets all its streams
  (d21 4.5).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs

from kvcs_core.moqt.config import SessionConfig
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.output import Output
from kvcs_core.moqt.requests import RequestRecord, RequestState
from kvcs_core.moqt.scheduler import Delivery as SchedDelivery
from kvcs_core.moqt.scheduler import Scheduler
from kvcs_core.moqt.track_store import StoreChange
from kvcs_core.moqt.transport_io import (
    AbortKind,
    SendDatagram,
    StreamAborted,
    StreamRef,
    WriteStream,
)
from kvcs_core.moqt.windows import RangeFilterSet, Window, fetch_range, subscription_window
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import (
    GroupOrder,
    LocationFilterType,
    ObjectStatus,
    PropertyType,
    PublishDoneCode,
    RequestErrorCode,
    StreamResetCode,
)
from kvcs_core.wire.datagram import ObjectDatagram, encode_datagram_header
from kvcs_core.wire.fetch import FetchStreamWriter
from kvcs_core.wire.kvp import kvps_bytes
from kvcs_core.wire.names import Location
from kvcs_core.wire.subgroup import SubgroupHeader, SubgroupIdMode, encode_subgroup_header
from kvcs_core.wire.varint import encode_vi64

if TYPE_CHECKING:
    from kvcs_core.moqt.track_store import ListenerHandle, StoredObject, TrackStore


_MAX_OBJECTS_PER_WRITE = 64
"""Objects one pull may carry from one stream (whole objects while the budget allows)."""

_MAX_MEMO_PREFIXES = 1024
"""Subgroup object prefixes memoised per session (bounded: cleared when full)."""

_MAX_FILL_RECORDS = 8

_MAX_OPEN_SUBGROUPS = 16
"""Subgroup streams a subscription keeps open at once before it FINs the oldest groups'."""
"""Fill ranges a subscription remembers for late objects (A27); the oldest is forgotten."""


class _Kind(enum.IntEnum):
    SUBGROUP = 1
    FILL = 2
    FETCH = 3
    DATAGRAMS = 4


@attrs.define(eq=False)
class _FillRecord:
    """A fill opened for a subscription: where objects appended later in its range go."""

    request_id: int
    """The Request ID naming the fill (the SUBSCRIBE's or the REQUEST_UPDATE's)."""
    start: Location
    end: Location
    order: GroupOrder
    filters: RangeFilterSet
    groups: frozenset[Location]
    """The objects the fill's snapshot held (a restored object it lacked is sent; a group
    a cache evicted while it was being produced may be partly in the snapshot)."""
    late: _Sender | None = None
    """The open late-fill sender, if any (A27)."""
    restored: set[Location] = attrs.field(factory=set)
    """Objects sent on this fill after its snapshot (late, restored or followed): a
    group a cache evicts and fetches again (for another late joiner) is restored, and
    must reach a fill that already got it once."""


@attrs.define(eq=False)
class _Served:
    """A subscription or FETCH we serve to the peer."""

    rec: RequestRecord
    store: TrackStore
    priority: int
    group_order: GroupOrder
    forward: bool = True
    window: Window | None = None
    """Set with :func:`_set_window` (which keeps ``win_lo``/``win_hi`` in step)."""
    win_lo: tuple[int, int] = (0, 0)
    """``window.start`` as ``(group, object)``: compared on every object (hot path)."""
    win_hi: tuple[int, int] | None = None
    """``window.end`` as ``(group, object)``; None = open."""
    location_filter: p.LocationFilter | None = None
    """The subscription's LOCATION_FILTER in effect (sticky across REQUEST_UPDATEs)."""
    announced: Location | None = None
    """Our PUBLISH: the Largest Object it announced (where its live part starts after)."""
    filters: RangeFilterSet = attrs.field(factory=RangeFilterSet)
    """Set with :func:`_set_filters` (which keeps ``any_filter`` in step)."""
    any_filter: bool = False
    """``filters`` holds an object-level filter (else every object matches)."""
    alias: int = 0
    listener: ListenerHandle | None = None
    senders: dict[tuple[int, int], _Sender] = attrs.field(factory=dict)
    """Open subgroup senders by (group, subgroup)."""
    others: list[_Sender] = attrs.field(factory=list)
    """Fill / fetch / datagram senders."""
    streams_opened: int = 0
    queued_bytes: int = 0
    ending: tuple[int, str] | None = None
    current_group: int | None = None
    done: bool = False
    subgroup_timeout: float | None = None
    """Effective SUBGROUP_DELIVERY_TIMEOUT in seconds (d21 section 5.2), None = none."""
    object_timeout: float | None = None
    """Effective OBJECT_DELIVERY_TIMEOUT in seconds (d21 section 5.2), None = none."""
    timed_out: set[tuple[int, int]] = attrs.field(factory=set)
    """Subgroups reset for a delivery timeout: never reopened (d21 section 5.2)."""
    fills: list[_FillRecord] = attrs.field(factory=list)
    """The fills opened for this subscription, newest last (A27 late objects)."""
    watcher: ListenerHandle | None = None
    unretained: dict[int, int] = attrs.field(factory=dict)
    """Queued bytes per group the store evicted after they were queued (queue limit)."""
    unretained_bytes: int = 0
    fetch_range: tuple[Location, Location] | None = None
    """A following FETCH (cut-through): its range, start and End Location."""


@attrs.define(eq=False)
class _Sender:
    sid: int
    kind: _Kind
    served: _Served
    stream: StreamRef | None = None
    queue: deque[StoredObject] = attrs.field(factory=deque)
    enqueued: deque[float] = attrs.field(factory=deque)
    """When each queued object was offered (for OBJECT_DELIVERY_TIMEOUT, d21 5.2)."""
    cursor: Iterator[StoredObject] | None = None
    fetch_writer: FetchStreamWriter | None = None
    partial: list[bytes | memoryview] = attrs.field(factory=list)
    """Chunks of the object being written (byte views: ``len`` is their size)."""
    fin_when_drained: bool = False
    finished: bool = False
    group_id: int = 0
    subgroup_id: int = 0
    complete_at: float | None = None
    """When the subgroup became known complete (its End of Group / End of Track object
    was queued, or a later group started): SUBGROUP_DELIVERY_TIMEOUT runs from here."""
    filters: RangeFilterSet | None = None
    """Range filters for a cursor sender (fill/fetch); None: the served request's."""
    last_loc: Location | None = None
    """Late-fill sender: the Location of the last object queued (fetch order, A27)."""
    next_oid: int = -1
    """Subgroup stream: the smallest Object ID allowed next (-1 before the first object)."""
    stream_header: bytes = b""
    """Subgroup sender whose stream is not open yet: its SUBGROUP_HEADER, written with
    the first pull, which opens the stream (``WriteStream.opens``)."""
    follow: bool = False
    """A late-fill or following-FETCH stream kept open while the store is filling."""


_DELIVERY: dict[_Kind, int] = {
    _Kind.FILL: SchedDelivery.FILL,
    _Kind.FETCH: SchedDelivery.FILL,
    _Kind.DATAGRAMS: SchedDelivery.DATAGRAM,
    _Kind.SUBGROUP: SchedDelivery.SUBGROUP,
}
"""The *delivery* part of a sender's rank (scheduler rule 4)."""


def _set_window(served: _Served, window: Window) -> None:
    served.window = window
    served.win_lo = (window.start.group, window.start.object)
    end = window.end
    served.win_hi = None if end is None else (end.group, end.object)


def _set_filters(served: _Served, filters: RangeFilterSet) -> None:
    served.filters = filters
    served.any_filter = filters.filters_objects


_ABANDONED = _Sender(sid=-1, kind=_Kind.SUBGROUP, served=None, finished=True)  # type: ignore[arg-type]
"""Stands in for a subgroup reset after a delivery timeout: objects offered to it are dropped."""


def _drop_queued(sender: _Sender) -> None:
    """Let go of everything ``sender`` still had to write (queued objects, its snapshot,
    the object it was writing)."""
    sender.queue.clear()
    sender.enqueued.clear()
    sender.partial.clear()
    sender.cursor = None


def _delivery_timeout(
    params: p.Parameters,
    store: TrackStore,
    param: type[p.ObjectDeliveryTimeout | p.SubgroupDeliveryTimeout] = p.ObjectDeliveryTimeout,
    prop_type: PropertyType = PropertyType.OBJECT_DELIVERY_TIMEOUT,
) -> float | None:
    """min(subscriber, publisher) delivery timeout when both are non-zero (d21 5.2)."""
    sub = params.get(param)
    values = [sub.ms] if sub is not None and sub.ms else []
    for prop in store.track_properties:
        is_timeout = prop.type == prop_type
        if is_timeout and isinstance(prop.value, int) and prop.value:
            values.append(prop.value)
    return min(values) / 1000 if values else None


def _consume(snapshot: list[StoredObject]) -> Iterator[StoredObject]:
    """Iterate a snapshot, letting go of each object once yielded, so that a cache that
    evicted them meanwhile sees their memory freed as the response progresses."""
    queue = deque(snapshot)
    snapshot.clear()
    while queue:
        yield queue.popleft()


def _snapshot(
    store: TrackStore, start: Location, end: Location, order: GroupOrder
) -> list[StoredObject]:
    """The Normal objects of ``start..end`` in ``order``, as stored now: what a FETCH or
    fill sends (fetch streams carry no Object Status, d21 11.4.1). References only: the
    payload buffers are shared, never copied; eviction from the store leaves them here."""
    return [o for o in store.objects_in(start, end, order) if o.status is ObjectStatus.NORMAL]


def _follows(last: Location | None, loc: Location, order: GroupOrder) -> bool:
    """``loc`` may follow ``last`` on one fetch-format stream (groups in ``order``,
    Object IDs ascending within a group; wire reference 7.5, A5)."""
    if last is None:
        return True
    if loc.group == last.group:
        return loc.object > last.object
    return (loc.group < last.group) if order is GroupOrder.DESCENDING else (loc.group > last.group)


def _fill_or_fetch_order(params: p.Parameters, default: GroupOrder) -> GroupOrder:
    order = params.get(p.GroupOrderParam)
    return order.order if order is not None else default


class Publisher:
    """Everything this session sends as a publisher (see the module docstring)."""

    def __init__(self, out: Output, config: SessionConfig) -> None:
        self._out = out
        self._config = config
        self._served: dict[int, _Served] = {}
        self._senders: dict[int, _Sender] = {}
        self._by_stream: dict[StreamRef, _Sender] = {}
        self._sched = Scheduler()
        self._timed: set[int] = set()
        """Senders of subscriptions with a delivery timeout: the only ones timers look at."""
        self._next_sid = 0
        self._next_alias = 0
        self.now = 0.0
        self.restoring: TrackStore | None = None
        """While set, objects appended to this store are *restores* (module docstring)."""
        self._prefixes: dict[tuple[int, int], bytes] = {}
        self._max_queued = config.max_queued_bytes_per_subscription
        self.objects_sent = 0
        """Objects handed to the transport so far (subscriptions, fills, FETCHes,
        datagrams); an object cut across pulls counts once, at its first byte."""
        self.payload_bytes_sent = 0
        """Payload bytes of those objects (headers and properties not counted)."""

    @property
    def queued_bytes(self) -> int:
        """Object bytes offered to live subscriptions and not yet handed to the transport."""
        return sum(s.queued_bytes for s in self._served.values())

    # -- answering requests ------------------------------------------------------------

    def accept_subscribe(
        self,
        rec: RequestRecord,
        store: TrackStore,
        now: float,
        track_alias: int | None,
        expires_ms: int | None,
    ) -> None:
        self.now = now
        params = rec.params
        prio = params.get(p.SubscriberPriority)
        fwd = params.get(p.Forward)
        if track_alias is not None:
            self._check_alias_free(track_alias, store)
        alias = track_alias if track_alias is not None else self._take_alias()
        served = _Served(
            rec=rec,
            store=store,
            priority=prio.value if prio else 128,
            group_order=_fill_or_fetch_order(params, store.group_order),
            forward=fwd is None or fwd.value == 1,
            filters=RangeFilterSet.from_params(params),
            alias=alias,
        )
        served.object_timeout = _delivery_timeout(params, store)
        served.subgroup_timeout = _delivery_timeout(
            params, store, p.SubgroupDeliveryTimeout, PropertyType.SUBGROUP_DELIVERY_TIMEOUT
        )
        # Ambiguity A27: window and fill range against one Largest Object, in one step.
        largest = store.largest
        served.location_filter = params.get(p.LocationFilter)
        _set_window(served, subscription_window(served.location_filter, largest))
        _set_filters(served, served.filters)
        self._served[rec.request_id] = served
        ok_params: list[p.Parameter] = []
        if expires_ms:
            ok_params.append(p.Expires(expires_ms))
        if largest is not None:
            ok_params.append(p.LargestObject(largest))
        self._out.send(
            rec.stream, m.SubscribeOk(alias, p.Parameters(ok_params), store.track_properties)
        )
        fill = params.get(p.FillParameters)
        if fill is not None and served.forward:
            self._open_fill(served, rec.request_id, fill.params, largest)
        served.listener = store.subscribe_listener(lambda obj: self._on_object(served, obj))
        served.watcher = store.watch(lambda c, v: self._on_store_change(served, c, v))

    def start_publish(
        self,
        rec: RequestRecord,
        store: TrackStore,
        now: float,
        alias: int,
        filters: RangeFilterSet,
    ) -> None:
        """Our PUBLISH: objects from the Next Object on (or the PUBLISH's LOCATION_FILTER),
        once forwarding (d21 9.8). Its parameters are the initial subscription settings
        (wire reference 4.3); ``filters`` are range filters that cannot travel in a PUBLISH
        (those of a SUBSCRIBE_TRACKS, applied here)."""
        self.now = now
        params = rec.params
        fwd = params.get(p.Forward)
        prio = params.get(p.SubscriberPriority)
        served = _Served(
            rec=rec,
            store=store,
            priority=prio.value if prio else 128,
            group_order=_fill_or_fetch_order(params, store.group_order),
            forward=fwd is None or fwd.value == 1,
            filters=filters,
            alias=alias,
        )
        served.object_timeout = _delivery_timeout(params, store)
        served.subgroup_timeout = _delivery_timeout(
            params, store, p.SubgroupDeliveryTimeout, PropertyType.SUBGROUP_DELIVERY_TIMEOUT
        )
        served.location_filter = params.get(p.LocationFilter)
        lf = served.location_filter or p.LocationFilter.next_object()
        _set_window(served, subscription_window(lf, store.largest))
        _set_filters(served, filters)
        served.announced = store.largest
        self._served[rec.request_id] = served
        served.listener = store.subscribe_listener(lambda obj: self._on_object(served, obj))
        served.watcher = store.watch(lambda c, v: self._on_store_change(served, c, v))

    def open_publish_fill(self, rec: RequestRecord, inner: p.Parameters) -> bool:
        """Ambiguity A10: a fill on the subscription our PUBLISH created, named by the
        PUBLISH's Request ID, from ``inner``'s LOCATION_FILTER (else the whole track) to the
        Largest Object the PUBLISH announced: the live part starts right after it, so each
        object arrives once. False: nothing to fill (or not forwarding)."""
        served = self._served.get(rec.request_id)
        if served is None or served.done or served.ending is not None or not served.forward:
            return False
        lf = inner.get(p.LocationFilter)
        rng = fetch_range(lf if lf is not None else served.location_filter, served.announced)
        if rng is None:
            return False
        order = _fill_or_fetch_order(inner, served.group_order)
        snapshot = _snapshot(served.store, rng.start, rng.end, order)
        groups = frozenset(o.location for o in snapshot)
        sender = self._add_cursor_sender(served, _Kind.FILL, rec.request_id, snapshot, order)
        sender.filters = served.filters.apply_update(inner)
        served.fills.append(
            _FillRecord(rec.request_id, rng.start, rng.end, order, sender.filters, groups)
        )
        return True

    def take_alias(self) -> int:
        """A Track Alias not used by this session yet."""
        return self._take_alias()

    def accept_fetch(
        self,
        rec: RequestRecord,
        store: TrackStore,
        now: float,
        end_location: Location | None = None,
        end_of_track: bool = False,
    ) -> bool:
        """FETCH_OK and the fetch stream. With ``end_location`` (a cache answering with its
        upstream's FETCH_OK while the objects are still arriving): that End Location and
        End Of Track, and the stream follows the store (module docstring, cut-through)."""
        self.now = now
        params = rec.params
        largest = store.largest
        if end_location is not None and (largest is None or largest < end_location):
            largest = end_location
        rng = fetch_range(params.get(p.LocationFilter), largest)
        order = _fill_or_fetch_order(params, GroupOrder.ASCENDING)
        snapshot = _snapshot(store, rng.start, rng.end, order) if rng is not None else []
        # End Location: the last object that exists in the range (Ambiguity A2d)
        end = max((o.location for o in snapshot), default=None)
        follow = end_location is not None and rng is not None
        if follow:
            end = end_location
        if rng is None or end is None:
            self._out.send(
                rec.stream,
                m.RequestError(RequestErrorCode.INVALID_RANGE, 0, b"nothing in range"),
                fin=True,
            )
            rec.local_fin = True
            return False
        prio = params.get(p.SubscriberPriority)
        served = _Served(
            rec=rec,
            store=store,
            priority=prio.value if prio else 128,
            group_order=order,
            filters=RangeFilterSet.from_params(params),
        )
        self._served[rec.request_id] = served
        if not follow:
            eot = store.end_of_track
            # End Of Track = 1 iff the track is complete and End Location is its last object
            end_of_track = eot is not None and self._last_existing(store, end, eot) == end
        last = snapshot[-1].location if snapshot else None
        self._out.send(
            rec.stream, m.FetchOk(end_of_track, end, p.Parameters(), store.track_properties)
        )
        sender = self._add_cursor_sender(served, _Kind.FETCH, rec.request_id, snapshot, order)
        if follow and rng is not None and last != end and store.filling:
            sender.follow = True
            sender.last_loc = last
            served.fetch_range = (rng.start, end)
            served.listener = store.subscribe_listener(
                lambda obj: self._on_fetch_object(sender, obj)
            )
            served.watcher = store.watch(lambda c, v: self._on_store_change(served, c, v))
        return True

    def _on_fetch_object(self, sender: _Sender, obj: StoredObject) -> None:
        """An object appended to the store of a following FETCH (module docstring)."""
        served = sender.served
        rng = served.fetch_range
        if sender.finished or not sender.follow or rng is None:
            return
        loc = obj.location
        if not (rng[0] <= loc <= rng[1]):
            return
        if obj.status is ObjectStatus.NORMAL and served.filters.matches(obj):
            if not _follows(sender.last_loc, loc, served.group_order):
                # it cannot go on the FETCH's one stream any more: a typed failure, no gap
                self._detach(served)
                self._abort_sender(sender, StreamResetCode.INTERNAL_ERROR)
                self._maybe_finish(served)
                return
            sender.last_loc = loc
            sender.queue.append(obj)
            sender.enqueued.append(self.now)
            served.queued_bytes += obj.size
        if loc == rng[1]:
            self._stop_following(sender)
        self._reschedule(sender)

    def end_fetch(self, rec: RequestRecord, *, ok: bool) -> None:
        """A following FETCH's source is done: ``ok``, its stream FINs once drained; else
        it is reset (INTERNAL_ERROR), never ended short as if complete."""
        served = self._served.get(rec.request_id)
        if served is None or served.done:
            return
        for sender in list(served.others):
            if not sender.follow:
                continue
            if ok:
                self._stop_following(sender)
            else:
                self._detach(served)
                self._abort_sender(sender, StreamResetCode.INTERNAL_ERROR)
        self._maybe_finish(served)

    def _stop_following(self, sender: _Sender) -> None:
        sender.follow = False
        if sender.cursor is None:
            sender.fin_when_drained = True
        if sender.kind is _Kind.FETCH:
            self._detach(sender.served)
        self._reschedule(sender)

    def _on_store_change(self, served: _Served, change: StoreChange, value: int) -> None:
        """The store settled (following streams finish) or evicted group ``value``
        (module docstring, queue limit)."""
        if served.done:
            return
        if change is StoreChange.SETTLED:
            for sender in list(served.others):
                if sender.follow and not sender.finished:
                    self._stop_following(sender)
            return
        held = 0
        for sender in [*served.senders.values(), *served.others]:
            if sender.kind is _Kind.SUBGROUP and sender.group_id != value:
                continue
            held += sum(o.size for o in sender.queue if o.location.group == value)
        # Every queued object of the group is unretained now, those counted at an earlier
        # eviction of the same group too (a group being produced is evicted again as it
        # grows): set, never add, or they would be counted once per eviction.
        before = served.unretained.get(value, 0)
        if held:
            served.unretained[value] = held
        elif before:
            del served.unretained[value]
        served.unretained_bytes += held - before
        if held > before and served.unretained_bytes > self._max_queued:
            self._too_far_behind(served)

    def _dequeued(self, served: _Served, obj: StoredObject) -> None:
        served.queued_bytes -= obj.size
        if served.unretained_bytes:
            group = obj.location.group
            left = served.unretained.get(group)
            if left is not None:
                n = min(left, obj.size)
                served.unretained_bytes -= n
                if left > n:
                    served.unretained[group] = left - n
                else:
                    del served.unretained[group]

    def update_subscription(
        self, rec: RequestRecord, update_id: int, params: p.Parameters, now: float
    ) -> None:
        """Apply a REQUEST_UPDATE (d21 9.5): FORWARD first, then FILL_PARAMETERS (A16)."""
        self.now = now
        served = self._served.get(rec.request_id)
        ok: list[p.Parameter] = []
        if served is None or served.done:
            self._out.send(rec.stream, m.RequestOk(p.Parameters()))
            return
        largest = served.store.largest
        fwd = params.get(p.Forward)
        if fwd is not None:
            served.forward = fwd.value == 1
        prio = params.get(p.SubscriberPriority)
        if prio is not None:
            served.priority = prio.value
        lf = params.get(p.LocationFilter)
        if lf is not None:  # NONE removes the filter (wire reference 5.4)
            served.location_filter = None if lf.filter_type == LocationFilterType.NONE else lf
            _set_window(served, subscription_window(lf, largest))
        _set_filters(served, served.filters.apply_update(params))
        if largest is not None:
            ok.append(p.LargestObject(largest))
        self._out.send(rec.stream, m.RequestOk(p.Parameters(ok)))
        fill = params.get(p.FillParameters)
        if fill is not None and served.forward:
            self._open_fill(served, update_id, fill.params, largest)

    def end_subscription(self, rec: RequestRecord, status: int, reason: str) -> None:
        served = self._served.get(rec.request_id)
        if served is None:
            self._out.send(rec.stream, m.PublishDone(status, 0, reason.encode()[:1024]), fin=True)
            rec.local_fin = True
            return
        served.ending = (status, reason)
        self._detach(served)
        for sender in served.senders.values():
            sender.fin_when_drained = True
            self._reschedule(sender)
        for sender in list(served.others):
            if sender.kind is _Kind.DATAGRAMS:
                sender.fin_when_drained = True
                if not sender.queue:
                    self._mark_finished(sender)
            elif sender.follow:
                self._stop_following(sender)  # no more objects come to it
        self._maybe_finish(served)

    def cancel(self, rec: RequestRecord) -> None:
        """The peer cancelled: reset every stream of the request (d21 4.5)."""
        served = self._served.pop(rec.request_id, None)
        if served is None:
            return
        self._detach(served)
        for sender in [*served.senders.values(), *served.others]:
            self._abort_sender(sender, StreamResetCode.CANCELLED)
        served.done = True

    def on_stream_aborted(self, event: StreamAborted) -> None:
        sender = self._by_stream.get(event.stream)
        if sender is not None and event.kind is AbortKind.STOP_SENDING:
            self._abort_sender(sender, StreamResetCode.CANCELLED)
            self._maybe_finish(sender.served)

    def on_timer(self, now: float) -> None:
        """Expire queued objects past their OBJECT_DELIVERY_TIMEOUT (d21 section 5.2)."""
        self.now = now
        for sender in [self._senders[sid] for sid in self._timed if sid in self._senders]:
            sg_timeout = sender.served.subgroup_timeout
            done_at = sender.complete_at
            if sg_timeout is not None and done_at is not None and now - done_at > sg_timeout:
                sender.served.timed_out.add((sender.group_id, sender.subgroup_id))
                self._abort_sender(sender, StreamResetCode.DELIVERY_TIMEOUT)
                continue
            timeout = sender.served.object_timeout
            if timeout is None or not sender.enqueued:
                continue
            if now - sender.enqueued[0] > timeout:
                sender.served.timed_out.add((sender.group_id, sender.subgroup_id))
                self._abort_sender(sender, StreamResetCode.DELIVERY_TIMEOUT)

    def next_deadline(self) -> float | None:
        """When the oldest queued object of a subscription with a delivery timeout expires."""
        best: float | None = None
        for sid in self._timed:
            sender = self._senders[sid]
            sg_timeout = sender.served.subgroup_timeout
            if sg_timeout is not None and sender.complete_at is not None:
                at = sender.complete_at + sg_timeout + 1e-6
                best = at if best is None or at < best else best
            timeout = sender.served.object_timeout
            if timeout is not None and sender.enqueued:
                # strictly after the timeout: the check is "older than", not "as old as"
                at = sender.enqueued[0] + timeout + 1e-6
                best = at if best is None or at < best else best
        return best

    # -- the data pump --------------------------------------------------------------------

    def poll_data(self, max_bytes: int, now: float) -> WriteStream | SendDatagram | None:
        self.now = max(self.now, now)
        blocked: list[_Sender] = []  # datagram flows whose next datagram exceeds max_bytes
        try:
            while True:
                sid = self._sched.pop_best()  # a turn: equal-priority flows rotate
                if sid is None:
                    return None
                sender = self._senders[sid]
                head = sender.queue[0] if sender.queue else None
                if (
                    sender.kind is _Kind.DATAGRAMS
                    and head is not None
                    and self._datagram_size(sender.served, head) > max_bytes
                ):
                    blocked.append(sender)  # a datagram is never split: wait for room
                    continue
                if sender.stream is None and len(sender.stream_header) >= max_bytes:
                    blocked.append(sender)  # a new stream starts with its whole header
                    continue
                out = self._produce(sender, max_bytes)
                self._reschedule(sender)
                if out is not None:
                    return out
                # the sender had nothing after all (filtered objects): try the next one
        finally:
            for sender in blocked:
                self._reschedule(sender)

    def _produce(self, sender: _Sender, budget: int) -> WriteStream | SendDatagram | None:
        """At most ``budget`` bytes of ``sender``: whole objects while they fit (up to
        ``_MAX_OBJECTS_PER_WRITE``), the last one possibly cut; the scheduler is asked
        again between pulls, so priorities apply at the granularity of one pull."""
        if sender.finished:
            return None
        if sender.kind is _Kind.DATAGRAMS:
            if not sender.queue:
                return None
            obj = sender.queue.popleft()
            sender.enqueued.popleft()
            self._dequeued(sender.served, obj)
            out = self._datagram(sender.served, obj)
            self.objects_sent += 1
            self.payload_bytes_sent += obj.size
            if not sender.queue and sender.fin_when_drained:
                self._mark_finished(sender)  # no stream to FIN: the flow just ends
            return out
        chunks: list[bytes | memoryview] = []
        stream = sender.stream
        opens = False
        if stream is None:  # a subgroup stream is opened at its first pull
            if not sender.queue:
                if sender.fin_when_drained:  # everything expired before it was sent
                    self._mark_finished(sender)
                return None
            header = sender.stream_header
            if budget <= len(header):
                return None
            stream = self._activate(sender)
            chunks.append(header)
            budget -= len(header)
            opens = True
        partial = sender.partial
        objects = 0
        while budget > 0:
            if partial:  # the rest of an object cut at an earlier budget
                head = partial[0]
                n = len(head)
                if n <= budget:
                    chunks.append(head)
                    budget -= n
                    del partial[0]
                else:
                    chunks.append(head[:budget])
                    partial[0] = head[budget:]
                    budget = 0
                continue
            if objects >= _MAX_OBJECTS_PER_WRITE:
                break
            if sender.queue or sender.cursor is not None:
                nxt = self._next_object(sender)
                if sender.finished:
                    return None  # reset for a delivery timeout: nothing more may be written
            else:
                nxt = None
            if nxt is None:
                if not chunks and (
                    sender.fin_when_drained
                    or (
                        sender.cursor is None
                        and sender.kind is not _Kind.SUBGROUP
                        and not sender.follow
                    )
                ):
                    return self._fin(sender)
                break
            objects += 1
            self.objects_sent += 1
            self.payload_bytes_sent += nxt.size
            if sender.fetch_writer is None:
                prefix = self._subgroup_prefix(sender, nxt)
            else:
                prefix = self._fetch_prefix(sender.fetch_writer, nxt)
            extra, payload = nxt.head, nxt.payload  # payload: a 1-D byte view (the store's)
            total = len(prefix) + len(extra) + len(payload)
            if total <= budget:  # the whole object: prefix, head and payload, no copy
                chunks.append(prefix)
                if extra:
                    chunks.append(extra)
                if payload:
                    chunks.append(payload)
                budget -= total
            else:
                partial.append(prefix)
                if extra:
                    partial.append(extra)
                if payload:
                    partial.append(payload)
        if not chunks:
            return None
        fin = False
        if not partial and sender.fin_when_drained and not sender.queue and sender.cursor is None:
            fin = True
            self._mark_finished(sender)
        return WriteStream.trusted(stream, tuple(chunks), fin, opens)

    def _activate(self, sender: _Sender) -> StreamRef:
        """Open a subgroup sender's stream now (the pull that carries its header)."""
        ref = self._out.new_stream_ref()
        sender.stream = ref
        sender.stream_header = b""
        self._by_stream[ref] = sender
        sender.served.streams_opened += 1
        return ref

    def _next_object(self, sender: _Sender) -> StoredObject | None:
        served = sender.served
        if sender.cursor is not None:
            filters = sender.filters if sender.filters is not None else served.filters
            for obj in sender.cursor:  # the snapshot holds Normal objects only
                if filters.matches(obj):
                    return obj
            sender.cursor = None
            if not sender.follow:
                sender.fin_when_drained = True
            elif not sender.queue:
                return None
        if sender.queue:
            obj = sender.queue.popleft()
            offered = sender.enqueued.popleft()
            self._dequeued(served, obj)
            if sender.kind is not _Kind.SUBGROUP:
                return obj  # a late-fill stream (A27): fills carry no delivery timeout
            timeout = served.object_timeout
            if timeout is not None and self.now - offered > timeout:
                # d21 5.2: checked before handing the object over; reset, never reopen
                served.timed_out.add((sender.group_id, sender.subgroup_id))
                self._abort_sender(sender, StreamResetCode.DELIVERY_TIMEOUT)
                return None
            if obj.status is not ObjectStatus.NORMAL:
                sender.fin_when_drained = True
            return obj
        return None

    @staticmethod
    def _fetch_prefix(writer: FetchStreamWriter, obj: StoredObject) -> bytes:
        """Everything of ``obj`` before its payload on a fetch or fill stream."""
        return writer.object_prefix(
            obj.location.group,
            obj.location.object,
            subgroup_id=obj.subgroup_id,
            publisher_priority=obj.publisher_priority,
            properties=obj.properties,
            payload_length=obj.size,
            datagram=obj.datagram,
        )

    def _subgroup_prefix(self, sender: _Sender, obj: StoredObject) -> bytes:
        """An object on a subgroup stream (d21 11.3.1, wire reference 7.3): Object ID delta,
        Properties length and properties (the header always sets the PROPERTIES flag here),
        Payload Length, and the Object Status when the length is 0. The same bytes as
        ``SubgroupStreamWriter.object_prefix`` (a test compares them); the objects come
        from the store, valid and in ascending order, and the common prefixes (no
        properties) are memoised by (delta, length)."""
        oid = obj.location.object
        nxt = sender.next_oid
        delta = oid if nxt < 0 else oid - nxt
        sender.next_oid = oid + 1
        size = obj.size
        props = obj.properties
        if size and not props:
            key = (delta, size)
            prefix = self._prefixes.get(key)
            if prefix is None:
                prefix = encode_vi64(delta) + b"\x00" + encode_vi64(size)
                if len(self._prefixes) >= _MAX_MEMO_PREFIXES:
                    self._prefixes.clear()
                self._prefixes[key] = prefix
            return prefix
        out = encode_vi64(delta)
        if props:
            pb = kvps_bytes(props)
            out += encode_vi64(len(pb)) + pb
        else:
            out += b"\x00"
        if size:
            return out + encode_vi64(size)
        return out + b"\x00" + encode_vi64(obj.status)

    def _datagram_size(self, served: _Served, obj: StoredObject) -> int:
        return sum(len(c) for c in self._datagram(served, obj).chunks)

    def _datagram(self, served: _Served, obj: StoredObject) -> SendDatagram:
        d = ObjectDatagram(
            track_alias=served.alias,
            group_id=obj.location.group,
            object_id=obj.location.object,
            publisher_priority=obj.publisher_priority,
            properties=obj.properties or None,
            status=None if obj.status is ObjectStatus.NORMAL else obj.status,
            end_of_group=False,
            payload=b"" if obj.status is not ObjectStatus.NORMAL else obj.payload,
        )
        header = encode_datagram_header(d)
        if obj.status is ObjectStatus.NORMAL and obj.size:
            if obj.head:
                return SendDatagram(chunks=(header, obj.head, obj.payload))
            return SendDatagram(chunks=(header, obj.payload))
        return SendDatagram(chunks=(header,))

    def _fin(self, sender: _Sender) -> WriteStream:
        assert sender.stream is not None
        self._mark_finished(sender)
        return WriteStream(stream=sender.stream, chunks=(), fin=True)

    def _mark_finished(self, sender: _Sender) -> None:
        sender.finished = True
        self._timed.discard(sender.sid)
        self._sched.set_idle(sender.sid)
        self._senders.pop(sender.sid, None)
        if sender.stream is not None:
            self._by_stream.pop(sender.stream, None)
        served = sender.served
        key = (sender.group_id, sender.subgroup_id)
        if sender.kind is _Kind.SUBGROUP and served.senders.get(key) is sender:
            del served.senders[key]
        if sender in served.others:
            served.others.remove(sender)
        self._maybe_finish(served)

    # -- live objects -------------------------------------------------------------------

    def _on_object(self, served: _Served, obj: StoredObject) -> None:
        if served.done or served.ending is not None or not served.forward:
            return
        if self.restoring is served.store:
            # an evicted object fetched again: not new, never live; only a fill whose
            # snapshot missed its group gets it
            if obj.status is ObjectStatus.NORMAL:
                self._late_fill(served, obj, restored=True)
            return
        loc = obj.location
        key = (loc.group, loc.object)
        hi = served.win_hi
        if key < served.win_lo or (hi is not None and key > hi):
            if served.fills and key < served.win_lo and obj.status is ObjectStatus.NORMAL:
                self._late_fill(served, obj)
            return
        if served.any_filter and not served.filters.matches(obj):
            return
        group = loc.group
        if served.current_group is not None and group > served.current_group:
            # a later group started: earlier subgroups count as complete for their delivery
            # timeouts (d21 5.2). Their streams stay open, though: groups may arrive
            # interleaved (a producer with several layers in flight, a relay's upstream),
            # and a stream FIN'd early would split a subgroup over several streams that
            # the next hop may receive out of order. They end with their End of Group or
            # End of Track, or when too many are open (the oldest groups first).
            for key, sender in served.senders.items():
                if key[0] < group and sender.complete_at is None:
                    sender.complete_at = self.now
        if served.current_group is None or group > served.current_group:
            served.current_group = group
        if obj.datagram:
            if self._datagram_size(served, obj) > self._config.max_datagram_size:
                return  # wire reference 7.6: too big for the path's datagrams: dropped
            sender = self._datagram_sender(served)
        else:
            sg = obj.subgroup_id
            found = served.senders.get((group, sg or 0))
            sender = found if found is not None else self._subgroup_sender(served, obj)
        if sender.finished:
            return  # a subgroup abandoned after a delivery timeout
        queue = sender.queue
        if not obj.datagram:
            floor = queue[-1].location.object + 1 if queue else sender.next_oid
            if loc.object < floor:
                # Object IDs ascend on a subgroup stream (d21 11.3.1): one that reached the
                # store after a later one of its subgroup (two publishers of a track, a
                # relay's upstream that split the subgroup over streams) cannot go on it;
                # it goes on a stream of its own, FIN'd once sent: never lost
                sender = self._stray_sender(served, obj)
                queue = sender.queue
        was_idle = not queue and not sender.partial
        queue.append(obj)
        sender.enqueued.append(self.now)
        if obj.status is not ObjectStatus.NORMAL and sender.complete_at is None:
            sender.complete_at = self.now  # the subgroup is complete: its timer starts
        served.queued_bytes += obj.size
        if was_idle:  # a busy sender's key depends on its head object only: unchanged
            self._reschedule(sender)

    def _subgroup_sender(self, served: _Served, obj: StoredObject) -> _Sender:
        sub = obj.subgroup_id or 0
        key = (obj.location.group, sub)
        sender = served.senders.get(key)
        if sender is not None:
            return sender
        if key in served.timed_out:
            return _ABANDONED
        if len(served.senders) >= _MAX_OPEN_SUBGROUPS:
            # bounded open streams: the oldest groups' subgroups end once drained
            for old in sorted(served.senders)[: len(served.senders) - _MAX_OPEN_SUBGROUPS + 1]:
                older = served.senders[old]
                if not older.fin_when_drained:
                    older.fin_when_drained = True
                    if older.complete_at is None:
                        older.complete_at = self.now
                    self._reschedule(older)
        return self._open_subgroup(served, obj, key)

    def _stray_sender(self, served: _Served, obj: StoredObject) -> _Sender:
        """A subgroup stream for an object below its subgroup stream's next Object ID: it
        starts at this object (not the subgroup's first, d21 11.3.1) and ends once drained.
        Not registered by (group, subgroup), so the subgroup's stream goes on as it was."""
        sender = self._open_subgroup(served, obj, None)
        sender.fin_when_drained = True
        served.others.append(sender)
        return sender

    def _open_subgroup(
        self, served: _Served, obj: StoredObject, key: tuple[int, int] | None
    ) -> _Sender:
        sub = obj.subgroup_id or 0
        first = served.store.subgroup_first(obj.location.group, sub) == obj.location.object
        header = SubgroupHeader(
            track_alias=served.alias,
            group_id=obj.location.group,
            subgroup_id_mode=SubgroupIdMode.ZERO if sub == 0 else SubgroupIdMode.EXPLICIT,
            subgroup_id=sub,
            publisher_priority=obj.publisher_priority,
            # every object may carry properties: the flag costs one byte per object
            has_properties=True,
            first_object=first,
        )
        # the stream is opened by the first pull (``_activate``), not now: a producer far
        # ahead of its link would otherwise hold a stream open per queued group
        sender = self._new_sender(
            served, _Kind.SUBGROUP, priority=obj.publisher_priority, stream=False
        )
        sender.group_id, sender.subgroup_id = obj.location.group, sub
        sender.stream_header = encode_subgroup_header(header)
        if key is not None:
            served.senders[key] = sender
        return sender

    def _datagram_sender(self, served: _Served) -> _Sender:
        for sender in served.others:
            if sender.kind is _Kind.DATAGRAMS:
                return sender
        sender = self._new_sender(served, _Kind.DATAGRAMS, priority=128, stream=False)
        served.others.append(sender)
        return sender

    def _open_fill(
        self, served: _Served, via_request_id: int, inner: p.Parameters, largest: Location | None
    ) -> None:
        """d21 3.4: fill range = inner LOCATION_FILTER, else the subscription's (in effect,
        after the update carrying the fill), by FETCH rules."""
        lf = inner.get(p.LocationFilter) or served.location_filter
        rng = fetch_range(lf, largest)
        if rng is None:
            return  # empty range or start past Largest Object: no fill stream (wire ref. 6.2)
        order = _fill_or_fetch_order(inner, served.group_order)
        snapshot = _snapshot(served.store, rng.start, rng.end, order)
        groups = frozenset(o.location for o in snapshot)
        last = snapshot[-1].location if snapshot else None
        sender = self._add_cursor_sender(served, _Kind.FILL, via_request_id, snapshot, order)
        # the fill inherits the subscription's range filters; inner ones override (d21 3.4)
        sender.filters = served.filters.apply_update(inner)
        fills = served.fills
        record = _FillRecord(via_request_id, rng.start, rng.end, order, sender.filters, groups)
        fills.append(record)
        if served.store.filling:
            # cut-through: the fill's own stream takes the objects still arriving
            sender.follow = True
            sender.last_loc = last
            record.late = sender
        if len(fills) > _MAX_FILL_RECORDS:
            del fills[0]

    def _late_fill(self, served: _Served, obj: StoredObject, *, restored: bool = False) -> None:
        """Ambiguity A27: ``obj`` reached the store after the subscription's fill was taken,
        below its live start: send it fill-delivered if a fill range holds it (module
        docstring). A ``restored`` object goes only to a fill whose snapshot lacked its
        group. Status objects are not sent on fetch-format streams."""
        loc = obj.location
        for fill in reversed(served.fills):
            if not (fill.start <= loc <= fill.end) or not fill.filters.matches(obj):
                continue
            if restored and (loc in fill.groups or loc in fill.restored):
                return  # the subscriber got the object with the fill, or after it
            fill.restored.add(loc)
            sender = fill.late
            if sender is None or sender.finished or not _follows(sender.last_loc, loc, fill.order):
                sender = self._new_sender(served, _Kind.FILL, priority=0)
                sender.fetch_writer = FetchStreamWriter(fill.request_id, fill.order)
                # while the store fills (a cut-through relay) the stream waits for the next
                # object of the range instead of one stream per arrival (module docstring)
                sender.follow = served.store.filling and not restored
                sender.fin_when_drained = not sender.follow
                assert sender.stream is not None
                self._out.write(sender.stream, sender.fetch_writer.header_bytes())
                served.others.append(sender)
                fill.late = sender
            sender.last_loc = loc
            sender.queue.append(obj)
            sender.enqueued.append(self.now)
            served.queued_bytes += obj.size
            if sender.follow and loc == fill.end:
                self._stop_following(sender)  # the fill's last object: nothing follows
            self._reschedule(sender)
            return

    def _add_cursor_sender(
        self,
        served: _Served,
        kind: _Kind,
        request_id: int,
        snapshot: list[StoredObject],
        order: GroupOrder,
    ) -> _Sender:
        sender = self._new_sender(served, kind, priority=0)
        sender.fetch_writer = FetchStreamWriter(request_id, order)
        sender.cursor = _consume(snapshot)
        assert sender.stream is not None
        self._out.write(sender.stream, sender.fetch_writer.header_bytes())
        served.others.append(sender)
        self._reschedule(sender)
        return sender

    def _new_sender(
        self, served: _Served, kind: _Kind, *, priority: int, stream: bool = True
    ) -> _Sender:
        sid = self._next_sid
        self._next_sid += 1
        sender = _Sender(sid=sid, kind=kind, served=served)
        if stream:
            sender.stream = self._out.open_stream(uni=True, priority=served.priority)
            self._by_stream[sender.stream] = sender
            served.streams_opened += 1
        self._senders[sid] = sender
        timed = served.object_timeout is not None or served.subgroup_timeout is not None
        if timed and kind in (_Kind.SUBGROUP, _Kind.DATAGRAMS):
            self._timed.add(sid)  # delivery timeouts apply to subscription-delivered objects
        return sender

    def _reschedule(self, sender: _Sender) -> None:
        """Tell the scheduler where ``sender``'s head object stands (d21 5.1.2): the
        :attr:`~.scheduler.SendKey.rank` of its head, built directly (this runs after
        every pull)."""
        if sender.finished:
            return
        queue = sender.queue
        if not (queue or sender.partial or sender.cursor is not None or sender.fin_when_drained):
            self._sched.set_idle(sender.sid)
            return
        served = sender.served
        kind = sender.kind
        if queue:
            head = queue[0]
            group = head.location.group
            pprio = head.publisher_priority
            seq = head.seq
        else:
            group, pprio, seq = sender.group_id, 128, sender.sid
        if served.group_order is GroupOrder.DESCENDING:
            group = -group
        delivery = _DELIVERY[kind]
        self._sched.set_ready_rank(
            sender.sid,
            served.rec.request_id,
            (served.priority, pprio, 0, group, delivery, sender.subgroup_id, seq),
        )

    # -- helpers --------------------------------------------------------------------------

    def _take_alias(self) -> int:
        in_use = {s.alias for s in self._served.values() if not s.done}
        alias = self._next_alias
        while alias in in_use:
            alias += 1
        self._next_alias = alias + 1
        return alias

    def _check_alias_free(self, alias: int, store: TrackStore) -> None:
        """d21 3.1.2: one alias must not name two tracks at once in a session."""
        for s in self._served.values():
            if not s.done and s.alias == alias and s.store.name != store.name:
                raise LocalProtocolError(f"Track Alias {alias} already names {s.store.name}")

    @staticmethod
    def _last_existing(store: TrackStore, start: Location, end: Location) -> Location | None:
        last: Location | None = None
        for obj in store.objects_in(start, end, GroupOrder.ASCENDING):
            if obj.status is ObjectStatus.NORMAL:  # status markers are not objects that exist
                last = obj.location
        return last

    def release(self) -> None:
        """The session closed: let go of every queued object, snapshot, partly written
        object and store listener, at once. A closed session sends nothing more, and
        what it still held would keep a relay's evicted objects in memory (counted against
        its cache, :mod:`kvcs_core.relay.cache`) for as long as the session object lives."""
        for served in self._served.values():
            self._detach(served)
            served.queued_bytes = 0
            served.unretained.clear()
            served.unretained_bytes = 0
        for sender in self._senders.values():  # every sender (_by_stream: those with a stream)
            _drop_queued(sender)
        self._served.clear()
        self._senders.clear()
        self._by_stream.clear()
        self._sched = Scheduler()
        self._timed.clear()

    def _detach(self, served: _Served) -> None:
        if served.listener is not None:
            served.store.remove_listener(served.listener)
            served.listener = None
        if served.watcher is not None:
            served.store.remove_listener(served.watcher)
            served.watcher = None

    def _abort_sender(self, sender: _Sender, code: int) -> None:
        if sender.finished:
            return
        if sender.stream is not None:
            self._out.abort(sender.stream, AbortKind.RESET, code)
        _drop_queued(sender)
        self._mark_finished(sender)

    def _too_far_behind(self, served: _Served) -> None:
        self._detach(served)
        for sender in [*served.senders.values(), *served.others]:
            self._abort_sender(sender, StreamResetCode.TOO_FAR_BEHIND)
        served.queued_bytes = 0
        served.ending = (PublishDoneCode.TOO_FAR_BEHIND, "subscriber too far behind")
        self._maybe_finish(served)

    def _maybe_finish(self, served: _Served) -> None:
        if served.done:
            return
        rec = served.rec
        if served.ending is None:
            if rec.kind.name == "FETCH" and not served.others:
                # every object of the FETCH was sent and the stream FIN'd
                self._detach(served)
                served.done = True
                rec.state = RequestState.DONE
                self._served.pop(rec.request_id, None)
                if not rec.local_fin:
                    self._out.write(rec.stream, fin=True)
                    rec.local_fin = True
            return
        if served.senders or served.others:
            return
        served.done = True
        rec.state = RequestState.DONE  # also when the publisher ended it (TOO_FAR_BEHIND)
        self._served.pop(rec.request_id, None)
        status, reason = served.ending
        if not rec.local_fin:
            self._out.send(
                rec.stream,
                m.PublishDone(status, served.streams_opened, reason.encode()[:1024]),
                fin=True,
            )
            rec.local_fin = True
