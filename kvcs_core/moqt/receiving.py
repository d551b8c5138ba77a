"""The subscriber's data path: data streams and datagrams in, ``ObjectReceived`` out.

Theory of operation
-------------------
Subgroup streams and datagrams name their track by Track Alias, learned from
SUBSCRIBE_OK (d21 section 3.1.2); fetch and fill streams name a request by the
Request ID in FETCH_HEADER (d21 section 11.4.1): a FETCH of ours, a SUBSCRIBE of
ours (its initial fill) or one of our REQUEST_UPDATEs on a subscription (a
later fill), which is how a fill is told apart from a FETCH response (wire
reference section 6, item 1).

A subgroup stream may arrive before the SUBSCRIBE_OK that defines its alias;
its decoded items are held (bounded by ``max_unknown_alias_bytes``) and
released when the alias becomes known, else the stream is stopped (d21 section
7.1: "abandon it or buffer briefly"). Objects for a request that has ended are
dropped quietly and their stream is stopped (wire reference 7.1).

Decoding a fetch stream needs its group order (Group ID deltas run backwards
when descending): the FETCH's GROUP_ORDER, or for a fill the inner
FILL_PARAMETERS GROUP_ORDER, else the subscription's (Ambiguity A6: we always
send GROUP_ORDER explicitly).

Malformed bytes raise :class:`~kvcs_core.wire.errors.CodecError`, which the session turns
into a close with the error's code.
"""

from __future__ import annotations

import attrs

from kvcs_core.moqt.config import SessionConfig
from kvcs_core.moqt.events import (
    DataStreamEnded,
    Delivery,
    ObjectReceived,
    PublishDoneReceived,
    RangeMarkerReceived,
    RequestKind,
)
from kvcs_core.moqt.output import Output
from kvcs_core.moqt.requests import RequestRecord, RequestState
from kvcs_core.moqt.transport_io import AbortKind, StreamAborted, StreamRef
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import GroupOrder, ObjectStatus, PropertyType, StreamResetCode
from kvcs_core.wire.datagram import ObjectDatagram
from kvcs_core.wire.fetch import EndOfRangeMarker, FetchHeader, FetchObject
from kvcs_core.wire.kvp import KeyValuePairs, find_kvp
from kvcs_core.wire.names import Location
from kvcs_core.wire.objects import (
    DataStreamDecoder,
    DataStreamItem,
    PaddingStreamHeader,
    decode_datagram,
)
from kvcs_core.wire.subgroup import SubgroupHeader, SubgroupObject


@attrs.define(eq=False)
class _RxStream:
    decoder: DataStreamDecoder
    request: RequestRecord | None = None
    delivery: Delivery = Delivery.SUBSCRIPTION
    via_request_id: int = -1
    header: SubgroupHeader | None = None
    held: list[DataStreamItem] = attrs.field(factory=list)
    held_bytes: int = 0
    dropping: bool = False
    group_id: int | None = None
    subgroup_id: int | None = None
    fin: bool = False
    priority: int = -1
    """Bound subgroup stream: its objects' Publisher Priority (the header's, else the
    track's default); -1 until bound (the per-Object fast path keys on it)."""


@attrs.define(eq=False)
class _SubscriptionRx:
    request: RequestRecord
    default_priority: int = 128


class DataReceiver:
    """Decodes our incoming data streams and datagrams into session events."""

    def __init__(
        self,
        out: Output,
        config: SessionConfig,
        requests: dict[int, RequestRecord],
        update_owner: dict[int, int],
    ) -> None:
        self._out = out
        self._config = config
        self._requests = requests
        self._update_owner = update_owner
        self.streams: dict[StreamRef, _RxStream] = {}
        self._by_alias: dict[int, _SubscriptionRx] = {}
        self._fill_orders: dict[int, GroupOrder] = {}
        """Request ID naming a fill (SUBSCRIBE or REQUEST_UPDATE) -> the fill's group order."""
        self._waiting_alias: dict[int, list[StreamRef]] = {}
        self._seen: dict[int, int] = {}
        """Data streams bound to each subscription (subgroup and fill streams)."""
        self._done_events: dict[int, PublishDoneReceived] = {}
        """PUBLISH_DONE events held until their subscription has drained."""
        self._draining: dict[int, tuple[int | None, float]] = {}
        """Subscriptions whose PUBLISH_DONE arrived while streams may still be in flight:
        Request ID -> (Stream Count, or None if unknown; give-up time) (d21 9.9)."""
        self._progressed: set[int] = set()
        """Draining subscriptions whose streams delivered bytes since their give-up time
        was set: the time moves on by another grace instead (:meth:`publish_done`)."""
        self._held_total = 0
        """Bytes held for streams whose Track Alias is unknown, over all of them
        (bounded by ``max_unknown_alias_bytes`` in total)."""
        self._open = 0
        """Peer data streams still open (not FIN'd, reset or stopped): what
        ``max_peer_data_streams`` limits."""

    # -- hooks from the session ------------------------------------------------------

    def subscription_established(
        self, rec: RequestRecord, alias: int, track_properties: KeyValuePairs
    ) -> None:
        prio = find_kvp(track_properties, PropertyType.DEFAULT_PUBLISHER_PRIORITY)
        default = prio if isinstance(prio, int) and prio <= 255 else 128
        self._by_alias[alias] = _SubscriptionRx(rec, default)
        fill = rec.params.get(p.FillParameters)
        if fill is not None:
            self._fill_orders[rec.request_id] = _fill_order(fill, rec.group_order)
        for ref in self._waiting_alias.pop(alias, []):
            st = self.streams.get(ref)
            if st is not None and st.header is not None:
                self._held_total -= st.held_bytes
                held, st.held, st.held_bytes = st.held, [], 0
                self._bind_subgroup(st, st.header)
                self._deliver(ref, st, held)
                if st.fin:
                    self._ended(ref, st, None)

    def note_update(self, rec: RequestRecord, update_id: int, params: p.Parameters) -> None:
        fill = params.get(p.FillParameters)
        if fill is not None:
            self._fill_orders[update_id] = _fill_order(fill, rec.group_order)

    def fetch_accepted(self, rec: RequestRecord) -> None:
        """Nothing to do: fetch streams are bound by Request ID as they arrive."""

    def publish_done(self, rec: RequestRecord, done: PublishDoneReceived, now: float) -> None:
        """PUBLISH_DONE: keep receiving until Stream Count streams were seen and ended, or
        ``publish_done_grace`` passes with no byte arriving on the subscription's streams
        (d21 9.9, wire reference 4.5: the subscriber keeps state *at least* that long; a
        publisher that wrote a whole track at once sends PUBLISH_DONE long before its data
        has crossed a slow path, so the grace runs from the last progress, not from the
        message); then emit ``done`` and forget the subscription. Over QUIC the control
        message can overtake data streams: the event comes after the last object the
        subscription delivers."""
        count = done.stream_count
        expected = None if count == (1 << 64) - 1 else count
        self._draining[rec.request_id] = (expected, now + self._config.publish_done_grace)
        self._done_events[rec.request_id] = done
        self._check_drained(rec)

    def draining(self, request_id: int) -> bool:
        """PUBLISH_DONE came for this subscription and its data streams may still arrive."""
        return request_id in self._draining

    def _check_drained(self, rec: RequestRecord) -> None:
        expected, _ = self._draining[rec.request_id]
        if expected is None or self._seen.get(rec.request_id, 0) < expected:
            return
        if any(st.request is rec and not st.fin for st in self.streams.values()):
            return
        self._stop_draining(rec)

    def _stop_draining(self, rec: RequestRecord) -> None:
        del self._draining[rec.request_id]
        done = self._done_events.pop(rec.request_id, None)
        if done is not None:
            self._out.emit(done)
        self._seen.pop(rec.request_id, None)
        self._progressed.discard(rec.request_id)
        self.request_finished(rec)

    def next_deadline(self) -> float | None:
        return min((d for _, d in self._draining.values()), default=None)

    def on_timer(self, now: float) -> None:
        for rid, (expected, deadline) in list(self._draining.items()):
            rec = self._requests.get(rid)
            if deadline <= now and rec is not None:
                if rid in self._progressed:  # still arriving: another grace from now
                    self._progressed.discard(rid)
                    self._draining[rid] = (expected, now + self._config.publish_done_grace)
                else:
                    self._stop_draining(rec)
            elif rec is None:
                del self._draining[rid]
                self._done_events.pop(rid, None)
                self._progressed.discard(rid)

    def _live(self, rec: RequestRecord) -> bool:
        return not rec.finished or rec.request_id in self._draining

    def request_finished(self, rec: RequestRecord) -> None:
        """The request ended: forget its alias and stop its remaining streams."""
        if rec.track_alias is not None:
            sub = self._by_alias.get(rec.track_alias)
            if sub is not None and sub.request is rec:
                del self._by_alias[rec.track_alias]

    # -- transport input ----------------------------------------------------------------

    def on_new_stream(self, s: StreamRef, data: bytes | memoryview, fin: bool) -> None:
        if self._open >= self._config.max_peer_data_streams:
            self._out.abort(s, AbortKind.STOP_SENDING, StreamResetCode.EXCESSIVE_LOAD)
            return
        self._open += 1
        decoder = DataStreamDecoder(
            fetch_group_order=self._order_for, max_payload_size=self._config.max_payload_size
        )
        self.streams[s] = _RxStream(decoder)
        self.on_stream_data(s, data, fin)

    def on_stream_data(self, s: StreamRef, data: bytes | memoryview, fin: bool) -> None:
        st = self.streams.get(s)
        if st is None:
            return  # a stream we already stopped: late bytes are dropped
        items = st.decoder.feed(data) if data else []
        if fin:
            st.decoder.close()
            st.fin = True
            self._open -= 1
        if st.dropping:
            if fin:
                del self.streams[s]
            return
        if items:
            self._deliver(s, st, items)
            rec = st.request
            if rec is not None and rec.request_id in self._draining:
                self._progressed.add(rec.request_id)
        if fin and not st.held and s in self.streams:
            self._ended(s, st, None)

    def on_stream_aborted(self, event: StreamAborted) -> None:
        st = self.streams.get(event.stream)
        if st is None or event.kind is not AbortKind.RESET:
            return
        self._ended(event.stream, st, event.code)

    def on_datagram(self, data: bytes | memoryview) -> None:
        d = decode_datagram(data)
        if not isinstance(d, ObjectDatagram):
            return  # padding (d21 section 11.5)
        sub = self._by_alias.get(d.track_alias)
        if sub is None:
            return  # unknown alias on a datagram: drop (d21 section 11.2)
        rec = sub.request
        self._out.emit(
            ObjectReceived(
                request_id=rec.request_id,
                delivery=Delivery.SUBSCRIPTION,
                location=Location.trusted(d.group_id, d.object_id),
                subgroup_id=None,
                publisher_priority=d.publisher_priority
                if d.publisher_priority is not None
                else sub.default_priority,
                status=d.status if d.status is not None else ObjectStatus.NORMAL,
                properties=d.properties or (),
                payload=d.payload,
                via_request_id=rec.request_id,
            )
        )

    # -- internals ---------------------------------------------------------------------

    def _order_for(self, request_id: int) -> GroupOrder:
        if request_id in self._fill_orders:
            return self._fill_orders[request_id]
        rec = self._requests.get(request_id)
        if rec is not None and rec.mine:
            if rec.kind is RequestKind.SUBSCRIBE:
                fill = rec.params.get(p.FillParameters)
                return _fill_order(fill, rec.group_order) if fill else rec.group_order
            return rec.group_order
        if rec is not None and rec.kind is RequestKind.PUBLISH:
            return rec.group_order  # A10: a fill named by the peer's PUBLISH
        return GroupOrder.ASCENDING

    def _bind_fetch(self, st: _RxStream, header: FetchHeader) -> None:
        rid = header.request_id
        rec = self._requests.get(rid)
        if rec is not None and rec.mine and rec.kind is RequestKind.FETCH:
            st.request, st.delivery = rec, Delivery.FETCH
        elif rec is not None and rec.mine and rec.kind is RequestKind.SUBSCRIBE:
            st.request, st.delivery = rec, Delivery.FILL
        elif rec is not None and not rec.mine and rec.kind is RequestKind.PUBLISH:
            # a fill on the peer's PUBLISH, named by it (B2; Ambiguity A10)
            st.request, st.delivery = rec, Delivery.FILL
        elif rid in self._update_owner or rid in self._fill_orders:
            owner = self._requests.get(self._update_owner.get(rid, -1))
            if owner is not None and _we_subscribe(owner):
                st.request, st.delivery = owner, Delivery.FILL
        st.via_request_id = rid
        if st.request is None or not self._live(st.request):
            st.dropping = True
        elif st.delivery is Delivery.FILL:
            self._seen[st.request.request_id] = self._seen.get(st.request.request_id, 0) + 1

    def _bind_subgroup(self, st: _RxStream, header: SubgroupHeader) -> None:
        sub = self._by_alias.get(header.track_alias)
        st.header = header
        st.group_id = header.group_id
        st.subgroup_id = header.subgroup_id
        if sub is None:
            return
        st.request = sub.request
        st.via_request_id = sub.request.request_id
        st.delivery = Delivery.SUBSCRIPTION
        prio = header.publisher_priority
        st.priority = prio if prio is not None else sub.default_priority
        rid = sub.request.request_id
        self._seen[rid] = self._seen.get(rid, 0) + 1

    def _deliver(self, s: StreamRef, st: _RxStream, items: list[DataStreamItem]) -> None:
        for item in items:
            rec = st.request
            if (
                type(item) is SubgroupObject
                and st.priority >= 0
                and rec is not None
                and (rec.state is _PENDING or rec.state is _ESTABLISHED)
            ):
                # the per-Object path: an object of a bound subgroup stream of a live request
                header = st.header
                assert header is not None
                sg = st.subgroup_id
                if sg is None:  # SUBGROUP_ID_MODE 0b01 (Ambiguity A18)
                    sg = st.subgroup_id = item.object_id
                rid = rec.request_id
                self._out.events.append(
                    ObjectReceived.trusted(
                        rid,
                        Delivery.SUBSCRIPTION,
                        Location.trusted(header.group_id, item.object_id),
                        sg,
                        st.priority,
                        item.status,
                        item.properties or (),
                        item.payload,
                        rid,
                    )
                )
                continue
            if isinstance(item, SubgroupHeader):
                self._bind_subgroup(st, item)
                if st.request is None:
                    self._waiting_alias.setdefault(item.track_alias, []).append(s)
                continue
            if isinstance(item, FetchHeader):
                self._bind_fetch(st, item)
                if st.dropping:
                    self._stop(s, st)
                    return
                continue
            if isinstance(item, PaddingStreamHeader):
                st.dropping = True
                continue
            if st.request is None:
                size = _item_size(item)
                if self._held_total + size > self._config.max_unknown_alias_bytes:
                    self._stop(s, st)  # d21 7.1: abandon rather than buffer without bound
                    return
                st.held.append(item)
                st.held_bytes += size
                self._held_total += size
                continue
            if not self._live(st.request) and st.delivery is not Delivery.FETCH:
                self._stop(s, st)
                return
            self._emit_item(st, item)

    def _emit_item(self, st: _RxStream, item: DataStreamItem) -> None:
        rec = st.request
        assert rec is not None
        if isinstance(item, SubgroupObject):
            header = st.header
            assert header is not None
            sub = self._by_alias.get(header.track_alias)
            default = sub.default_priority if sub is not None else 128
            if st.subgroup_id is None:  # SUBGROUP_ID_MODE 0b01 (Ambiguity A18)
                st.subgroup_id = item.object_id
            self._out.emit(
                ObjectReceived(
                    request_id=rec.request_id,
                    delivery=Delivery.SUBSCRIPTION,
                    location=Location.trusted(header.group_id, item.object_id),
                    subgroup_id=st.subgroup_id,
                    publisher_priority=header.publisher_priority
                    if header.publisher_priority is not None
                    else default,
                    status=item.status,
                    properties=item.properties or (),
                    payload=item.payload,
                    via_request_id=rec.request_id,
                )
            )
        elif isinstance(item, FetchObject):
            self._out.emit(
                ObjectReceived(
                    request_id=rec.request_id,
                    delivery=st.delivery,
                    location=Location.trusted(item.group_id, item.object_id),
                    subgroup_id=item.subgroup_id,
                    publisher_priority=item.publisher_priority,
                    status=ObjectStatus.NORMAL,
                    properties=item.properties,
                    payload=item.payload,
                    via_request_id=st.via_request_id,
                )
            )
        elif isinstance(item, EndOfRangeMarker):
            self._out.emit(
                RangeMarkerReceived(
                    request_id=rec.request_id,
                    kind=item.kind,
                    location=item.location,
                    via_request_id=st.via_request_id,
                )
            )

    def _stop(self, s: StreamRef, st: _RxStream) -> None:
        st.dropping = True
        self._release(st)
        if not st.fin:
            st.fin = True
            self._open -= 1
            self._out.abort(s, AbortKind.STOP_SENDING, StreamResetCode.CANCELLED)
        self.streams.pop(s, None)

    def _release(self, st: _RxStream) -> None:
        self._held_total -= st.held_bytes
        st.held.clear()
        st.held_bytes = 0

    def _ended(self, s: StreamRef, st: _RxStream, reset_code: int | None) -> None:
        if self.streams.pop(s, None) is not None and not st.fin:
            st.fin = True
            self._open -= 1  # reset before FIN
        self._release(st)
        if st.request is None or st.dropping:
            return
        self._out.emit(
            DataStreamEnded(
                request_id=st.request.request_id,
                delivery=st.delivery,
                via_request_id=st.via_request_id,
                group_id=st.group_id,
                reset_code=reset_code,
            )
        )
        rec = st.request
        if rec is not None and rec.request_id in self._draining:
            self._check_drained(rec)


_PENDING = RequestState.PENDING
_ESTABLISHED = RequestState.ESTABLISHED


def _we_subscribe(rec: RequestRecord) -> bool:
    """Our SUBSCRIBE, or the peer's PUBLISH (we are its subscriber)."""
    return (rec.kind is RequestKind.SUBSCRIBE and rec.mine) or (
        rec.kind is RequestKind.PUBLISH and not rec.mine
    )


def _fill_order(fill: p.FillParameters, default: GroupOrder) -> GroupOrder:
    inner = fill.params.get(p.GroupOrderParam)
    return inner.order if inner is not None else default


def _item_size(item: DataStreamItem) -> int:
    payload = getattr(item, "payload", None)
    return 16 + (payload.nbytes if isinstance(payload, memoryview) else 0)
