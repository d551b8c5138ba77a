"""MoqtSession scenarios over the loopback, each under whole, byte-by-byte and seeded
random chunking, with identical (normalized) event logs.

The scenarios are the ones the session issue names: the KVCS exactly-once
pattern while the publisher keeps producing, FETCH of groups a..b (both orders),
a subscriber joining after production ended, priorities observed in the order
bytes leave the publisher under a bandwidth limit, delivery timeouts on the
virtual clock; plus namespace discovery, TRACK_STATUS, REQUEST_UPDATE with a
later fill, range filters, PUBLISH_DONE stream counts, cancellation and GOAWAY.
"""

from __future__ import annotations

from typing import Any

import pytest
from session_pair import CHUNKINGS, NS, Pair, fill_store, normalized, payload, track

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import (
    GroupOrder,
    ObjectStatus,
    ParameterType,
    PublishDoneCode,
    RequestErrorCode,
    StreamResetCode,
)
from kvcs_core.wire.names import Location, TrackNamespace

LOG: dict[str, dict[str, Any]] = {}


def _same_across_chunkings(scenario: str, chunking: str, log: dict[Any, Any]) -> None:
    """Record the normalized log; every chunking of a scenario must produce the same."""
    seen = LOG.setdefault(scenario, {})
    seen[chunking] = log
    reference = next(iter(seen.values()))
    assert log == reference, f"{scenario}: {chunking} differs from {next(iter(seen))}"


@pytest.fixture(params=list(CHUNKINGS))
def chunking(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_exactly_once_while_producing(chunking: str) -> None:
    """SUBSCRIBE NEXT_OBJECT + FILL{ABSOLUTE_START 0,0} mid-production: each object once."""
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(3), 4)
    store.append(3, 0, payload(3, 0))
    store.append(3, 1, payload(3, 1))  # the subscription arrives in the middle of group 3
    rid = pair.cli.subscribe(
        store.name,
        now=pair.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    for o in range(2, 4):
        store.append(3, o, payload(3, o))
        pair.settle(0.002)
    store.append(3, 4, status=ObjectStatus.END_OF_GROUP)
    fill_store(store, range(4, 6), 4)
    store.append(6, 0, status=ObjectStatus.END_OF_TRACK)
    pair.settle(1.0)

    got = [(e.location.group, e.location.object) for e in pair.objects(rid)]
    # status objects travel only on subgroup streams: the fill carries normal objects
    expected = [
        (o.location.group, o.location.object)
        for o in store.objects_in(Location(0, 0))
        if o.status is ObjectStatus.NORMAL or o.location >= Location(3, 2)
    ]
    assert sorted(got) == sorted(expected)
    assert len(got) == len(set(got)), "an object was delivered twice"
    fills = {
        (e.location.group, e.location.object)
        for e in pair.objects(rid)
        if e.delivery is ev.Delivery.FILL
    }
    assert fills == {(g, o) for g in range(3) for o in range(4)} | {(3, 0), (3, 1)}
    for e in pair.objects(rid):
        if e.status is ObjectStatus.NORMAL:
            assert bytes(e.payload) == payload(e.location.group, e.location.object)
    accepted = pair.events(pair.cli, ev.SubscribeAccepted)[0]
    assert accepted.largest == Location(3, 1)
    _same_across_chunkings("exactly_once", chunking, normalized(pair.net.events(pair.cli)))


@pytest.mark.parametrize("order", [GroupOrder.ASCENDING, GroupOrder.DESCENDING])
def test_fetch_groups_a_to_b(chunking: str, order: GroupOrder) -> None:
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(8), 3)
    rid = pair.cli.fetch(
        store.name,
        now=pair.now,
        location_filter=p.LocationFilter.absolute_group_end(2, 0, 5),
        group_order=order,
    )
    pair.wait(lambda: pair.events(pair.cli, ev.DataStreamEnded))
    got = [(e.location.group, e.location.object) for e in pair.objects(rid)]
    groups = range(2, 6) if order is GroupOrder.ASCENDING else range(5, 1, -1)
    # status objects are not carried on fetch streams (d21 11.4.1)
    assert got == [(g, o) for g in groups for o in range(3)]
    assert all(e.delivery is ev.Delivery.FETCH for e in pair.objects(rid))
    ok = pair.events(pair.cli, ev.FetchAccepted)
    assert len(ok) == 1 and not ok[0].end_of_track
    assert ok[0].end_location == Location(5, 2)  # the group's last existing object (A2d)
    _same_across_chunkings(f"fetch_{order.name}", chunking, normalized(pair.net.events(pair.cli)))


def test_fetch_of_nothing_is_invalid_range(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("empty")))
    rid = pair.cli.fetch(store.name, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.RequestFailed))
    failed = pair.events(pair.cli, ev.RequestFailed)[0]
    assert (failed.request_id, failed.code) == (rid, RequestErrorCode.INVALID_RANGE)


def test_subscriber_joins_after_production_ended(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("v.raw.s0")))
    fill_store(store, range(4), 5)
    store.append(4, 0, status=ObjectStatus.END_OF_TRACK)
    rid = pair.cli.subscribe(
        store.name,
        now=pair.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
    )
    pair.wait(
        lambda: any(
            e.delivery is ev.Delivery.FILL for e in pair.events(pair.cli, ev.DataStreamEnded)
        )
    )
    got = [(e.location.group, e.location.object, e.status) for e in pair.objects(rid)]
    assert got == [
        (o.location.group, o.location.object, ObjectStatus.NORMAL)
        for o in store.objects_in(Location(0, 0))
        if o.status is ObjectStatus.NORMAL
    ]
    pair.srv.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.PublishDoneReceived))
    done = pair.events(pair.cli, ev.PublishDoneReceived)[0]
    assert done.status == PublishDoneCode.TRACK_ENDED
    assert done.stream_count == 1  # the fill stream
    _same_across_chunkings("late_join", chunking, normalized(pair.net.events(pair.cli)))


def test_subscriber_priority_orders_bytes_under_bandwidth_limit() -> None:
    """d21 5.1.2 rule 1: the more urgent subscription's bytes leave the publisher first."""
    pair = Pair(bandwidth=200_000)
    slow = pair.serve(TrackStore(track("slow")))
    fast = pair.serve(TrackStore(track("fast")))
    low = pair.cli.subscribe(slow.name, now=pair.now, priority=200)
    high = pair.cli.subscribe(fast.name, now=pair.now, priority=10)
    pair.wait(lambda: len(pair.events(pair.cli, ev.SubscribeAccepted)) == 2)
    for g in range(3):
        for o in range(10):
            slow.append(g, o, payload(g, o, 2000))
            fast.append(g, o, payload(g, o, 2000))
    pair.settle(2.0)
    order = [e.request_id for e in pair.objects()]
    assert sorted(order) == sorted([low] * 30 + [high] * 30)
    assert order[:30] == [high] * 30, "the urgent subscription did not go first"
    # and in the order bytes left the publisher: all of high's streams before low's data
    served = pair.link.endpoint(pair.srv).sent_log
    assert served, "the loopback recorded no data sent by the publisher"


def test_publisher_priority_breaks_ties_within_equal_subscriber_priority() -> None:
    pair = Pair(bandwidth=100_000)
    store = pair.serve(TrackStore(track("layers")))
    rid = pair.cli.subscribe(store.name, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    # group 0 less urgent than group 1 (publisher priority), both queued at once
    for o in range(8):
        store.append(0, o, payload(0, o, 3000), publisher_priority=200)
    for o in range(8):
        store.append(1, o, payload(1, o, 3000), subgroup_id=0, publisher_priority=10)
    pair.settle(2.0)
    groups = [e.location.group for e in pair.objects(rid)]
    assert groups.count(1) == 8
    first_g0 = groups.index(0)
    assert groups[first_g0:].count(1) <= 1, "publisher priority not honoured"


def test_object_delivery_timeout_fires_on_the_virtual_clock() -> None:
    pair = Pair(bandwidth=50_000)
    store = pair.serve(TrackStore(track("k.raw.s1")))
    rid = pair.cli.subscribe(store.name, now=pair.now, extra=[p.ObjectDeliveryTimeout(100)])
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    for o in range(40):
        store.append(0, o, payload(0, o, 1000))  # 40 kB at 50 kB/s: most will expire
    pair.settle(6.0)
    received = pair.objects(rid)
    assert 0 < len(received) < 40
    ended = pair.events(pair.cli, ev.DataStreamEnded)
    assert [e.reset_code for e in ended] == [StreamResetCode.DELIVERY_TIMEOUT]
    # later objects of that subgroup are never sent again (d21 5.2: SHOULD NOT reopen)
    store.append(0, 40, payload(0, 40))
    pair.settle(1.0)
    assert len(pair.objects(rid)) == len(received)


def test_namespace_discovery(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    other = TrackNamespace.of("kvcs-1", b"\x09" * 16)
    pair.serve(TrackStore(track("manifest")))
    pair.serve(TrackStore(track("manifest", other)))
    rid = pair.cli.subscribe_namespace(TrackNamespace.of("kvcs-1", b"\x01" * 16), now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.NamespaceAnnounced))
    pair.settle(0.1)
    announced = pair.events(pair.cli, ev.NamespaceAnnounced)
    assert [(a.request_id, a.namespace) for a in announced] == [(rid, NS)]
    accepted = pair.events(pair.cli, ev.RequestAccepted)
    assert accepted[0].kind is ev.RequestKind.SUBSCRIBE_NAMESPACE
    # an overlapping second SUBSCRIBE_NAMESPACE is refused (PREFIX_OVERLAP, A21)
    rid2 = pair.cli.subscribe_namespace(TrackNamespace.of("kvcs-1"), now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.RequestFailed))
    failed = pair.events(pair.cli, ev.RequestFailed)[0]
    assert (failed.request_id, failed.code) == (rid2, RequestErrorCode.PREFIX_OVERLAP)


def test_track_status(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("manifest")))
    fill_store(store, range(2), 2)
    rid = pair.cli.track_status(store.name, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.RequestAccepted))
    ok = pair.events(pair.cli, ev.RequestAccepted)[0]
    assert ok.request_id == rid and ok.kind is ev.RequestKind.TRACK_STATUS
    largest = ok.params.get(p.LargestObject)
    assert largest is not None and largest.location == Location(1, 2)
    missing = pair.cli.track_status(track("nope"), now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.RequestFailed))
    assert pair.events(pair.cli, ev.RequestFailed)[0].request_id == missing


def test_request_update_forward_then_fill(chunking: str) -> None:
    """Forward 0 delivers nothing; RU{FORWARD 1, FILL} opens a fill named by the RU (d21 3.4)."""
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.q8.s0")))
    rid = pair.cli.subscribe(
        store.name, now=pair.now, forward=False, location_filter=p.LocationFilter.next_object()
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    fill_store(store, range(2), 3)
    pair.settle(0.2)
    assert pair.objects(rid) == []
    uid = pair.cli.request_update(
        rid,
        p.Parameters.of(
            p.Forward(1), p.FillParameters(p.Parameters.of(p.LocationFilter.absolute_start(0, 0)))
        ),
        now=pair.now,
    )
    pair.wait(lambda: pair.events(pair.cli, ev.RequestAccepted))
    pair.settle(0.5)
    ok = pair.events(pair.cli, ev.RequestAccepted)[0]
    assert ok.update_id == uid
    objs = pair.objects(rid)
    assert [(e.location.group, e.location.object) for e in objs] == [
        (g, o) for g in range(2) for o in range(3)
    ]
    assert {(e.delivery, e.via_request_id) for e in objs} == {(ev.Delivery.FILL, uid)}
    # and live objects now flow
    store.append(2, 0, payload(2, 0))
    pair.settle(0.2)
    assert pair.objects(rid)[-1].delivery is ev.Delivery.SUBSCRIPTION
    _same_across_chunkings("update_fill", chunking, normalized(pair.net.events(pair.cli)))


def test_objectid_range_filter_on_fetch(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(3), 6)
    rid = pair.cli.fetch(
        store.name,
        now=pair.now,
        range_filters=[p.RangeFilter(ParameterType.OBJECTID_FILTER, 0, None, ((1, 2),))],
    )
    pair.wait(lambda: pair.events(pair.cli, ev.DataStreamEnded))
    assert [(e.location.group, e.location.object) for e in pair.objects(rid)] == [
        (g, o) for g in range(3) for o in (1, 2)
    ]


def test_unknown_track_is_refused(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    rid = pair.cli.subscribe(track("missing"), now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.RequestFailed))
    failed = pair.events(pair.cli, ev.RequestFailed)[0]
    assert (failed.request_id, failed.code, failed.reason) == (
        rid,
        RequestErrorCode.DOES_NOT_EXIST,
        "no such track",
    )
    assert not pair.cli.is_closed and not pair.srv.is_closed


def test_cancel_resets_the_subscription_streams() -> None:
    pair = Pair(bandwidth=20_000)
    store = pair.serve(TrackStore(track("k.raw.s0")))
    rid = pair.cli.subscribe(store.name, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    for o in range(20):
        store.append(0, o, payload(0, o, 4000))
    pair.settle(0.5)
    pair.cli.cancel(rid, now=pair.now)
    pair.net.poke(pair.cli)
    pair.settle(1.0)
    cancelled = pair.events(pair.srv, ev.RequestCancelled)
    assert [c.request_id for c in cancelled] == [rid]
    n = len(pair.objects(rid))
    store.append(0, 20, payload(0, 20))
    pair.settle(1.0)
    assert len(pair.objects(rid)) == n
    assert not pair.srv.is_closed and not pair.cli.is_closed


def test_goaway(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    pair.srv.goaway(b"moqt://other.example/moq", 5000, now=pair.now)
    pair.net.poke(pair.srv)
    pair.wait(lambda: pair.events(pair.cli, ev.GoawayReceived))
    g = pair.events(pair.cli, ev.GoawayReceived)[0]
    assert (g.new_session_uri, g.timeout_ms, g.request_id) == (
        b"moqt://other.example/moq",
        5000,
        None,
    )
    with pytest.raises(LocalProtocolError):
        pair.cli.subscribe(track("x"), now=pair.now)
    pair.cli.close(now=pair.now)
    pair.net.poke(pair.cli)
    pair.settle(0.1)
    closed = pair.events(pair.srv, ev.SessionClosed)
    assert closed and closed[0].code == 0 and closed[0].initiator is ev.Initiator.PEER


def test_session_closed_events_are_final(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    pair.link.cut()
    pair.settle(0.1)
    for s in (pair.cli, pair.srv):
        closed = pair.events(s, ev.SessionClosed)
        assert len(closed) == 1 and closed[0].initiator is ev.Initiator.PEER
        assert s.is_closed
        assert s.get_timer() is None


def test_publish_flows_before_and_after_publish_ok(chunking: str) -> None:
    """PUBLISH (d21 9.8): objects flow at once with FORWARD 1; PUBLISH_DONE ends it."""
    pair = Pair(CHUNKINGS[chunking])
    pair.auto_accept = False
    store = TrackStore(track("k.raw.s9"))
    fill_store(store, range(1), 2)  # already there: not sent (Next Object on)
    rid = pair.srv.publish(store, now=pair.now)
    pair.net.poke(pair.srv)
    store.append(1, 0, payload(1, 0))
    pair.wait(lambda: pair.events(pair.cli, ev.PublishRequested))
    req = pair.events(pair.cli, ev.PublishRequested)[0]
    assert (req.request_id, req.track) == (rid, store.name)
    assert req.params.get(p.LargestObject) == p.LargestObject(Location(0, 2))
    pair.cli.accept_publish(rid, now=pair.now)
    pair.net.poke(pair.cli)
    store.append(1, 1, payload(1, 1))
    store.append(1, 2, status=ObjectStatus.END_OF_GROUP)
    pair.wait(lambda: pair.events(pair.srv, ev.RequestAccepted))
    pair.settle(0.2)
    got = [(e.location.group, e.location.object) for e in pair.objects(rid)]
    assert got == [(1, 0), (1, 1), (1, 2)]
    pair.srv.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=pair.now)
    pair.net.poke(pair.srv)
    pair.wait(lambda: pair.events(pair.cli, ev.PublishDoneReceived))
    assert pair.events(pair.cli, ev.PublishDoneReceived)[0].stream_count == 1
    _same_across_chunkings("publish", chunking, normalized(pair.net.events(pair.cli)))


def test_publish_forward0_then_update_with_fill(chunking: str) -> None:
    """Ambiguity A15: PUBLISH FORWARD 0, then RU{FORWARD 1, FILL} from the subscriber."""
    pair = Pair(CHUNKINGS[chunking])
    pair.auto_accept = False
    store = TrackStore(track("k.raw.s3"))
    fill_store(store, range(2), 2)
    rid = pair.srv.publish(store, now=pair.now, forward=False)
    pair.net.poke(pair.srv)
    pair.wait(lambda: pair.events(pair.cli, ev.PublishRequested))
    pair.cli.accept_publish(rid, now=pair.now)
    uid = pair.cli.request_update(
        rid,
        p.Parameters.of(
            p.Forward(1),
            p.LocationFilter.next_object(),
            p.FillParameters(p.Parameters.of(p.LocationFilter.absolute_start(0, 0))),
        ),
        now=pair.now,
    )
    pair.net.poke(pair.cli)
    pair.wait(lambda: pair.events(pair.cli, ev.RequestAccepted))
    pair.settle(0.2)
    store.append(2, 0, payload(2, 0))
    pair.settle(0.2)
    got = [
        (e.location.group, e.location.object, e.delivery, e.via_request_id)
        for e in pair.objects(rid)
    ]
    assert got == [
        (0, 0, ev.Delivery.FILL, uid),
        (0, 1, ev.Delivery.FILL, uid),
        (1, 0, ev.Delivery.FILL, uid),
        (1, 1, ev.Delivery.FILL, uid),
        (2, 0, ev.Delivery.SUBSCRIPTION, rid),
    ]


def test_subscribe_tracks_yields_publish_and_skipped(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    pair.auto_accept = False
    a = TrackStore(track("k.raw.s0"))
    b = track("v.raw.s0")
    rid = pair.cli.subscribe_tracks(NS, now=pair.now)
    pair.net.poke(pair.cli)
    pair.wait(lambda: pair.events(pair.srv, ev.SubscribeTracksRequested))
    pair.srv.accept_request(rid, now=pair.now)
    pub = pair.srv.publish(a, now=pair.now)
    pair.srv.send_publish_skipped(rid, b, now=pair.now)
    pair.net.poke(pair.srv)
    pair.wait(lambda: pair.events(pair.cli, ev.PublishSkippedReceived))
    pair.settle(0.1)
    assert [e.track for e in pair.events(pair.cli, ev.PublishRequested)] == [a.name]
    assert pair.events(pair.cli, ev.PublishRequested)[0].request_id == pub
    assert [e.track for e in pair.events(pair.cli, ev.PublishSkippedReceived)] == [b]
    accepted = pair.events(pair.cli, ev.RequestAccepted)
    assert accepted[0].kind is ev.RequestKind.SUBSCRIBE_TRACKS


def test_datagram_objects(chunking: str) -> None:
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("dgrams")))
    rid = pair.cli.subscribe(store.name, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    for o in range(5):
        store.append(0, o, payload(0, o, 100), datagram=True)
    pair.settle(0.2)
    got = pair.objects(rid)
    assert [(e.location.object, e.subgroup_id, bytes(e.payload)) for e in got] == [
        (o, None, payload(0, o, 100)) for o in range(5)
    ]


def test_subgroup_delivery_timeout_resets_a_slow_complete_subgroup() -> None:
    """SUBGROUP_DELIVERY_TIMEOUT runs from when the subgroup is known complete (d21 5.2)."""
    pair = Pair(bandwidth=20_000)
    store = pair.serve(TrackStore(track("k.raw.s2")))
    rid = pair.cli.subscribe(store.name, now=pair.now, extra=[p.SubgroupDeliveryTimeout(300)])
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    fill_store(store, range(1), 20, size=1000)  # 20 kB + End of Group: ~1 s at 20 kB/s
    pair.settle(3.0)
    assert 0 < len(pair.objects(rid)) < 21
    ended = pair.events(pair.cli, ev.DataStreamEnded)
    assert [e.reset_code for e in ended] == [StreamResetCode.DELIVERY_TIMEOUT]


def test_object_head_and_payload_are_sent_as_one_object(chunking: str) -> None:
    """A stored object's ``head`` (e.g. a KVCS header) precedes its payload, uncopied."""
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.raw.s5")))
    store.append(0, 0, b"tensor-bytes", head=b"HEADER:")
    store.append(0, 1, b"x", head=b"H", datagram=False)
    rid = pair.cli.fetch(store.name, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.DataStreamEnded))
    assert [bytes(e.payload) for e in pair.objects(rid)] == [b"HEADER:tensor-bytes", b"Hx"]


FILTER_CASES = {
    # filter, objects expected for a subscription made when groups 0..2 exist ({2,2} largest),
    # then groups 3..5 are produced: (subscription-delivered, of groups 3..5 x 3 objects)
    "absent": (None, [(g, o) for g in range(3, 6) for o in range(3)]),
    "none": (p.LocationFilter.none(), [(g, o) for g in range(3, 6) for o in range(3)]),
    "next_object": (
        p.LocationFilter.next_object(),
        [(g, o) for g in range(3, 6) for o in range(3)],
    ),
    "relative_start_0": (
        p.LocationFilter.relative_start(0),
        [(g, o) for g in range(3, 6) for o in range(3)],
    ),
    "absolute_start_4": (
        p.LocationFilter.absolute_start(4, 1),
        [(4, 1), (4, 2)] + [(5, o) for o in range(3)],
    ),
    "absolute_group_end_3_4": (
        p.LocationFilter.absolute_group_end(3, 0, 4),
        [(g, o) for g in (3, 4) for o in range(3)],
    ),
    "absolute_range_3_4": (
        p.LocationFilter.absolute_range(3, 1, 4, 1),
        [(3, 1), (3, 2), (4, 0), (4, 1)],
    ),
}


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_every_location_filter_type_on_a_subscription(chunking: str, case: str) -> None:
    """d21 3.3.1 / wire reference 5.4: the live window of each filter type (no fill)."""
    lf, expected = FILTER_CASES[case]
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(3), 3, end_of_group=False)
    rid = pair.cli.subscribe(store.name, now=pair.now, location_filter=lf)
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    fill_store(store, range(3, 6), 3, end_of_group=False)
    pair.settle(0.5)
    got = [(e.location.group, e.location.object) for e in pair.objects(rid)]
    assert got == expected
    assert {e.delivery for e in pair.objects(rid)} <= {ev.Delivery.SUBSCRIPTION}


def test_relative_start_fill_joins_at_the_current_group(chunking: str) -> None:
    """Wire reference 6: NEXT_OBJECT + FILL{RELATIVE_START 1} = the current group, then live."""
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(3), 3, end_of_group=False)
    rid = pair.cli.subscribe(
        store.name,
        now=pair.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.relative_start(1)),
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    store.append(3, 0, payload(3, 0))
    pair.settle(0.5)
    got = [(e.location.group, e.location.object, e.delivery) for e in pair.objects(rid)]
    fill, live = ev.Delivery.FILL, ev.Delivery.SUBSCRIPTION
    assert got == [(2, 0, fill), (2, 1, fill), (2, 2, fill), (3, 0, live)]


def test_late_objects_below_the_live_start_are_fill_delivered(chunking: str) -> None:
    """Ambiguity A27: objects reaching the store after the fill was taken, below the live
    start (out-of-order production or upstream delivery), go out fill-delivered on a late
    fill stream named by the fill's Request ID; every object arrives exactly once."""
    pair = Pair(CHUNKINGS[chunking])
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(2), 3)
    # group 2: subgroup 1 ({2,3}, {2,4}) arrived, subgroup 0 ({2,0}..{2,2}) is late
    store.append(2, 3, payload(2, 3), subgroup_id=1)
    store.append(2, 4, payload(2, 4), subgroup_id=1)
    rid = pair.cli.subscribe(
        store.name,
        now=pair.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    assert pair.events(pair.cli, ev.SubscribeAccepted)[0].largest == Location(2, 4)
    pair.settle(0.2)
    for o in range(3):  # the late subgroup
        store.append(2, o, payload(2, o), subgroup_id=0)
        pair.settle(0.002)
    store.append(2, 5, payload(2, 5), subgroup_id=1)  # live again
    pair.settle(0.5)
    got = [(e.location.group, e.location.object) for e in pair.objects(rid)]
    assert len(got) == len(set(got)), "an object was delivered twice"
    normal = {
        (o.location.group, o.location.object)
        for o in store.objects_in(Location(0, 0))
        if o.status is ObjectStatus.NORMAL
    }
    assert set(got) == normal
    by = {(e.location.group, e.location.object): e for e in pair.objects(rid)}
    for o in range(3):
        assert by[(2, o)].delivery is ev.Delivery.FILL and by[(2, o)].via_request_id == rid
    assert by[(2, 5)].delivery is ev.Delivery.SUBSCRIPTION
    for e in pair.objects(rid):
        assert bytes(e.payload) == payload(e.location.group, e.location.object)
    # the late fill streams count in PUBLISH_DONE's Stream Count (d21 9.9)
    pair.srv.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=pair.now)
    pair.net.poke(pair.srv)
    pair.wait(lambda: pair.events(pair.cli, ev.PublishDoneReceived))
    done = pair.events(pair.cli, ev.PublishDoneReceived)[0]
    ended = [e for e in pair.events(pair.cli, ev.DataStreamEnded) if e.request_id == rid]
    assert done.stream_count == len(ended) >= 3
    _same_across_chunkings("late_fill", chunking, normalized(pair.net.events(pair.cli)))


def test_late_objects_outside_every_fill_are_not_sent() -> None:
    """Wire reference 5.4: below a NEXT_OBJECT start and outside the fill range: dropped."""
    pair = Pair()
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(3), 2, end_of_group=False)
    rid = pair.cli.subscribe(
        store.name,
        now=pair.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(2, 0)),
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    store.append(1, 5, payload(1, 5))  # below the fill's start: no stream for it
    store.append(2, 5, payload(2, 5))  # above Largest {2,1}: live
    pair.settle(0.3)
    got = sorted((e.location.group, e.location.object) for e in pair.objects(rid))
    assert got == [(2, 0), (2, 1), (2, 5)]


@pytest.mark.parametrize("kind", ["fetch", "fill"])
def test_a_served_range_is_a_snapshot_that_eviction_does_not_shrink(kind: str) -> None:
    """A FETCH or fill sends the objects in its range when it was processed: groups evicted
    from the store meanwhile (a relay's cache budget) are still sent whole."""
    pair = Pair(bandwidth=20_000)
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(6), 4, size=1000, end_of_group=False)
    if kind == "fetch":
        rid = pair.cli.fetch(store.name, now=pair.now)
    else:
        rid = pair.cli.subscribe(
            store.name,
            now=pair.now,
            location_filter=p.LocationFilter.next_object(),
            fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
        )
    pair.net.poke(pair.cli)
    pair.wait(lambda: len(pair.objects(rid)) >= 2)
    for g in range(6):  # the store forgets everything while the range is being sent
        store.evict_group(g)
    assert len(store) == 0
    pair.settle(3.0)
    got = [(e.location.group, e.location.object) for e in pair.objects(rid)]
    assert got == [(g, o) for g in range(6) for o in range(4)]
    for e in pair.objects(rid):
        assert bytes(e.payload) == payload(e.location.group, e.location.object, 1000)


def test_fill_without_inner_filter_uses_the_filter_in_effect() -> None:
    """Wire reference 6 item 2: a fill with no inner LOCATION_FILTER takes the subscription's
    filter in effect, i.e. after the REQUEST_UPDATE that carries it (sticky, 5.9)."""
    pair = Pair()
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(4), 2, end_of_group=False)
    rid = pair.cli.subscribe(
        store.name, now=pair.now, location_filter=p.LocationFilter.absolute_start(3, 0)
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    pair.cli.request_update(
        rid,
        p.Parameters.of(p.LocationFilter.absolute_start(1, 1), p.FillParameters(p.Parameters())),
        now=pair.now,
    )
    pair.net.poke(pair.cli)
    pair.settle(0.3)
    got = [(e.location.group, e.location.object, e.delivery) for e in pair.objects(rid)]
    fill = ev.Delivery.FILL
    assert got == [(1, 1, fill), (2, 0, fill), (2, 1, fill), (3, 0, fill), (3, 1, fill)]


def test_late_fill_objects_are_not_subject_to_delivery_timeouts() -> None:
    """d21 5.2 timeouts apply to subgroups and datagrams; a late fill stream (A27) that
    waits for bandwidth is neither reset nor does it mark a subgroup as timed out."""
    pair = Pair(bandwidth=20_000)
    store = pair.serve(TrackStore(track("k.raw.s0")))
    fill_store(store, range(1), 2, size=1000, end_of_group=False)
    store.append(1, 5, payload(1, 5, 1000), subgroup_id=1)
    rid = pair.cli.subscribe(
        store.name,
        now=pair.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
        extra=[p.ObjectDeliveryTimeout(50)],
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    for o in range(5):  # late, below the live start {1,6}; 5 KB at 20 KB/s: > 50 ms
        store.append(1, o, payload(1, o, 1000), subgroup_id=0)
    pair.settle(2.0)
    got = sorted((e.location.group, e.location.object) for e in pair.objects(rid))
    assert got == [(0, 0), (0, 1), *((1, o) for o in range(6))]
    fills = [e for e in pair.events(pair.cli, ev.DataStreamEnded) if e.delivery is ev.Delivery.FILL]
    assert len(fills) >= 2 and all(e.reset_code is None for e in fills)
    pair.srv.advance(pair.now)  # the application hands the object over now (d21 5.2)
    store.append(1, 6, payload(1, 6, 1000), subgroup_id=1)  # subgroup 1 still flows live
    pair.settle(0.5)
    assert (1, 6) in {(e.location.group, e.location.object) for e in pair.objects(rid)}
