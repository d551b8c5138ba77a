"""The caching relay over the loopback: fan-out, exactly once, cache, namespaces, endings.

Every scenario builds a network with :mod:`relay_net`: a publisher session serving
TrackStores (or a KvcsPublisher), relays that own one session per link, and
subscriber sessions using the exactly-once recipe (NEXT_OBJECT +
FILL{ABSOLUTE_START 0,0}, wire reference 6). Payload bytes are checked object by
object; the publisher's egress is read from its link endpoint.
"""

from __future__ import annotations

import struct
from typing import Any

from _vectors import load_vectors
from relay_net import NS, RelayNet, Subscriber, payload, produce, track

from kvcs.transports.loopback import Chunking
from kvcs_core.kvcs.manifest import parse_manifest
from kvcs_core.kvcs.names import Component
from kvcs_core.kvcs.payload import VerifiedObject, verify_object
from kvcs_core.kvcs.publisher import KvcsPublisher
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import Relay, RelayConfig
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import (
    ObjectStatus,
    PropertyType,
    PublishDoneCode,
    RequestErrorCode,
    StreamResetCode,
)
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

GROUPS, OBJECTS, SIZE = 6, 5, 256
SMALL = 36_000
"""A cache budget that holds about 7 of the 10 groups of one_track(10, 4) (accounted bytes)."""


def expected(
    groups: int = GROUPS, objects: int = OBJECTS, size: int = SIZE
) -> dict[Location, bytes]:
    return {Location(g, o): payload(g, o, size) for g in range(groups) for o in range(objects)}


def fan_out(n: int, *, seed: int = 5) -> tuple[RelayNet, Relay, Any, list[tuple[Subscriber, int]]]:
    """1 publisher -> 1 relay -> ``n`` subscribers joining before, during and after."""
    rn = RelayNet(seed=seed)
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("video")))
    subs = [rn.add_subscriber(relay) for _ in range(n)]
    joined: list[tuple[Subscriber, int]] = []
    before = max(1, n // 3)
    for s in subs[:before]:
        joined.append((s, s.subscribe_all(store.name)))
    rn.settle(0.05)
    during = subs[before : before + max(0, (n - before) // 2)]
    for g in range(GROUPS):
        for o in range(OBJECTS):
            store.append(g, o, payload(g, o, SIZE))
            if during and (g, o) in ((1, 2), (2, 0), (3, 4), (4, 1)):
                s = during.pop(0)
                joined.append((s, s.subscribe_all(store.name)))
            rn.settle(0.001)
        store.append(g, OBJECTS, status=ObjectStatus.END_OF_GROUP)
    for s in during:
        joined.append((s, s.subscribe_all(store.name)))
    rn.settle(0.05)
    pub.end_track(store, rn.now)
    rn.settle(0.2)
    for s in subs[len(joined) :]:  # after production
        joined.append((s, s.subscribe_all(store.name)))
    rn.run_until(lambda: all(s.done(rid) is not None for s, rid in joined), max_time=10)
    return rn, relay, pub, joined


def test_fan_out_exactly_once_8_subscribers() -> None:
    _rn, relay, pub, joined = fan_out(8)
    assert len(joined) == 8
    want = expected()
    for s, rid in joined:
        assert s.normal(rid) == want
        assert s.done(rid).status == 0x2  # TRACK_ENDED, as the publisher said
    # aggregation: one upstream SUBSCRIBE for the eight subscribers
    assert sum(isinstance(e, ev.SubscribeRequested) for e in pub.requests) == 1
    stats = relay.track_stats(track("video"))
    assert stats is not None and stats.complete and stats.duplicates == 0


def test_publisher_egress_does_not_grow_with_subscribers() -> None:
    """Aggregation: the publisher sends the same bytes for 1 and for 8 subscribers."""
    egress = {}
    for n in (1, 8):
        rn, _relay, pub, joined = fan_out(n)
        assert len(joined) == n
        egress[n] = rn.endpoint(pub.session).bytes_sent
    assert egress[1] == egress[8]
    assert egress[1] < GROUPS * OBJECTS * SIZE * 1.1


def _bandwidth_run(*, drain_before_end: bool) -> list[tuple[Subscriber, int]]:
    rn = RelayNet(seed=9, chunking=Chunking.random(seed=3, max_size=97), bandwidth=2e6)
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("audio")))
    subs = [rn.add_subscriber(relay) for _ in range(4)]
    joined = [(subs[0], subs[0].subscribe_all(store.name))]
    for g in range(4):
        produce(store, g, 6, size=900)
        if g + 1 < len(subs):
            joined.append((subs[g + 1], subs[g + 1].subscribe_all(store.name)))
        rn.settle(0.003)
    if drain_before_end:
        rn.settle(0.05)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: all(s.done(rid) is not None for s, rid in joined))
    rn.settle(0.5)  # PUBLISH_DONE (control) may overtake objects still in flight: d21 9.9
    return joined


def test_fan_out_under_random_chunking_and_bandwidth() -> None:
    joined = _bandwidth_run(drain_before_end=True)
    want = expected(4, 6, 900)
    for s, rid in joined:
        assert s.normal(rid) == want
        assert s.done(rid).status == 0x2


def test_tail_in_flight_when_publish_done_overtakes_data() -> None:
    joined = _bandwidth_run(drain_before_end=False)
    want = expected(4, 6, 900)
    for s, rid in joined:
        assert s.normal(rid) == want


def one_track(
    groups: int = 4, objects: int = 3, *, end: bool = True, config: RelayConfig | None = None
) -> tuple[RelayNet, Relay, Any, TrackStore, Subscriber, int]:
    """A track produced while one subscriber watches through the relay (it gets cached)."""
    rn = RelayNet()
    relay = rn.add_relay(config)
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("t")))
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(store.name)
    rn.settle(0.02)
    for g in range(groups):
        produce(store, g, objects, size=SIZE)
        rn.settle(0.002)
    if end:
        pub.end_track(store, rn.now)
        rn.run_until(lambda: s.done(rid) is not None)
    else:
        rn.settle(0.05)
    return rn, relay, pub, store, s, rid


def test_fetch_served_from_cache() -> None:
    rn, relay, pub, store, _s, _rid = one_track(5, 3)
    egress = rn.endpoint(pub.session).bytes_sent
    late = rn.add_subscriber(relay)
    rid = late.fetch(store.name, p.LocationFilter.absolute_group_end(1, 0, 3))
    rn.run_until(lambda: any(e.request_id == rid for e in late.events(ev.DataStreamEnded)))
    got = [(e.location.group, e.location.object) for e in late.objects(rid)]
    assert got == [(g, o) for g in range(1, 4) for o in range(3)]
    assert all(
        bytes(e.payload) == payload(*t, SIZE) for e, t in zip(late.objects(rid), got, strict=True)
    )
    ok = late.events(ev.FetchAccepted)[0]
    assert ok.end_location == Location(3, 2) and not ok.end_of_track
    assert not any(isinstance(e, ev.FetchRequested) for e in pub.requests)
    assert rn.endpoint(pub.session).bytes_sent == egress  # nothing asked upstream


def test_fetch_of_an_uncached_track_goes_upstream_once() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("archive")))
    for g in range(3):
        produce(store, g, 4, size=SIZE)
    a, b = rn.add_subscriber(relay), rn.add_subscriber(relay)
    ra = a.fetch(store.name)
    rb = b.fetch(store.name)
    rn.run_until(
        lambda: all(
            any(e.request_id == r for e in x.events(ev.DataStreamEnded))
            for x, r in ((a, ra), (b, rb))
        )
    )
    for x, r in ((a, ra), (b, rb)):
        assert x.normal(r) == expected(3, 4)
    # equal FETCHes share one upstream FETCH; the objects are now cached
    assert sum(isinstance(e, ev.FetchRequested) for e in pub.requests) == 1
    assert relay.track_stats(store.name).cached_objects == 12


def test_fetch_with_no_publisher_is_does_not_exist() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    rn.add_publisher(relay)
    s = rn.add_subscriber(relay)
    rid = s.fetch(track("x", TrackNamespace.of("elsewhere")))
    rn.run_until(lambda: s.failed(rid) is not None)
    assert s.failed(rid).code == RequestErrorCode.DOES_NOT_EXIST


def test_subscribe_with_no_publisher_and_upstream_refusal() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    s = rn.add_subscriber(relay)
    nowhere = s.subscribe_all(track("x", TrackNamespace.of("elsewhere")))
    missing = s.subscribe_all(track("not-served"))  # the namespace matches, the track does not
    rn.run_until(lambda: s.failed(nowhere) is not None and s.failed(missing) is not None)
    assert s.failed(nowhere).code == RequestErrorCode.DOES_NOT_EXIST
    assert s.failed(missing).code == RequestErrorCode.DOES_NOT_EXIST  # the publisher's answer
    assert [e.track for e in pub.requests] == [track("not-served")]


def test_late_subscriber_after_publisher_left_is_served_from_cache() -> None:
    rn, relay, pub, store, _s, _rid = one_track(4, 3)
    rn.cut(pub.session)
    rn.settle(0.05)
    assert relay.namespaces() == ()
    late = rn.add_subscriber(relay)
    rid = late.subscribe_all(store.name)
    rn.run_until(lambda: late.done(rid) is not None)
    assert late.normal(rid) == expected(4, 3)
    assert late.done(rid).status == 0x2  # the track had ended (End of Track cached)
    f = late.fetch(store.name, p.LocationFilter.absolute_group_end(2, 0, 3))
    rn.run_until(lambda: any(e.request_id == f for e in late.events(ev.DataStreamEnded)))
    assert sorted(late.normal(f)) == [Location(g, o) for g in (2, 3) for o in range(3)]


def test_upstream_cut_mid_group_ends_downstream_and_keeps_the_cache() -> None:
    rn, relay, pub, store, s, rid = one_track(3, 3, end=False)
    store.append(3, 0, payload(3, 0, SIZE))
    store.append(3, 1, payload(3, 1, SIZE))
    rn.settle(0.02)
    rn.cut(pub.session)
    rn.run_until(lambda: s.done(rid) is not None)
    assert s.done(rid).status == 0x0  # INTERNAL_ERROR: the relay lost its source
    have = s.normal(rid)
    assert have == {
        **expected(3, 3),
        Location(3, 0): payload(3, 0, SIZE),
        Location(3, 1): payload(3, 1, SIZE),
    }
    late = rn.add_subscriber(relay)
    r2 = late.subscribe_all(store.name)
    rn.run_until(lambda: late.done(r2) is not None)
    assert late.normal(r2) == have  # what was cached, then the same status
    assert late.done(r2).status == 0x0


def test_publish_done_status_is_passed_on() -> None:
    rn, relay, pub, store, s, rid = one_track(2, 2, end=False)
    other = rn.add_subscriber(relay)
    r2 = other.subscribe_all(store.name)
    rn.settle(0.02)
    for up_rid in list(pub.served):
        pub.session.end_subscription(up_rid, PublishDoneCode.EXPIRED, "expired", now=rn.now)
    rn.net.poke(pub.session)
    rn.run_until(lambda: s.done(rid) is not None and other.done(r2) is not None)
    assert s.done(rid).status == other.done(r2).status == PublishDoneCode.EXPIRED
    assert s.normal(rid) == other.normal(r2) == expected(2, 2)


def test_subscribe_namespace_through_the_relay() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    s = rn.add_subscriber(relay)
    rid = s.session.subscribe_namespace(TrackNamespace.of("relay-test"), now=rn.now)
    rn.net.poke(s.session)
    rn.settle(0.02)
    assert any(e.request_id == rid for e in s.events(ev.RequestAccepted))
    pub = rn.add_publisher(relay)  # announces NS after the SUBSCRIBE_NAMESPACE
    other_ns = TrackNamespace.of("relay-test", "pub-b")
    pub.session.publish_namespace(other_ns, now=rn.now)
    pub.session.publish_namespace(TrackNamespace.of("unrelated"), now=rn.now)
    rn.net.poke(pub.session)
    rn.settle(0.02)
    got = [e.namespace for e in s.events(ev.NamespaceAnnounced)]
    assert got == [NS, other_ns]  # full namespaces (prefix + suffix), no "unrelated"
    # d22 (A13): the PUBLISH_NAMESPACE itself is never forwarded downstream
    assert not s.events(ev.PublishNamespaceRequested)
    late = rn.add_subscriber(relay)
    r2 = late.session.subscribe_namespace(TrackNamespace.of("relay-test", "pub-a"), now=rn.now)
    rn.net.poke(late.session)
    rn.settle(0.02)
    assert [e.namespace for e in late.events(ev.NamespaceAnnounced)] == [NS]
    rn.cut(pub.session)
    rn.settle(0.02)
    assert sorted(e.namespace.fields for e in s.events(ev.NamespaceWithdrawn)) == sorted(
        [NS.fields, other_ns.fields]
    )
    assert [e.request_id for e in late.events(ev.NamespaceWithdrawn)] == [r2]


def tree() -> tuple[RelayNet, Relay, Relay, Relay, Any]:
    """publisher -> relay A -> relays B and C."""
    rn = RelayNet()
    a, b, c = rn.add_relay(), rn.add_relay(), rn.add_relay()
    pub = rn.add_publisher(a)
    rn.link_relays(a, b)
    rn.link_relays(a, c)
    return rn, a, b, c, pub


def test_two_level_tree() -> None:
    rn, a, b, c, pub = tree()
    store = pub.serve(TrackStore(track("tree")))
    subs = [rn.add_subscriber(r) for r in (b, b, c, c, c)]
    joined = [(subs[0], subs[0].subscribe_all(store.name))]
    rn.settle(0.02)
    for g in range(5):
        produce(store, g, 4, size=SIZE)
        if g + 1 < len(subs):
            x = subs[g + 1]
            joined.append((x, x.subscribe_all(store.name)))
        rn.settle(0.003)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: all(x.done(r) is not None for x, r in joined))
    for x, r in joined:
        assert x.normal(r) == expected(5, 4)
        assert x.done(r).status == 0x2
    # one SUBSCRIBE per hop: the publisher saw one (from A), A got one from B and one from C
    assert sum(isinstance(e, ev.SubscribeRequested) for e in pub.requests) == 1
    data = 5 * 4 * SIZE
    assert a.upstream_bytes_received == b.upstream_bytes_received == c.upstream_bytes_received
    assert a.upstream_bytes_received == data


def test_namespace_discovery_through_a_tree() -> None:
    rn, _a, b, _c, pub = tree()
    s = rn.add_subscriber(b)
    rid = s.session.subscribe_namespace(TrackNamespace.of("relay-test"), now=rn.now)
    rn.net.poke(s.session)
    rn.settle(0.05)
    assert [(e.request_id, e.namespace) for e in s.events(ev.NamespaceAnnounced)] == [(rid, NS)]
    store = pub.serve(TrackStore(track("found")))
    produce(store, 0, 2)
    r = s.subscribe_all(store.name)
    rn.run_until(lambda: len(s.normal(r)) == 2)
    rn.cut(pub.session)
    rn.run_until(lambda: bool(s.events(ev.NamespaceWithdrawn)))


def test_late_joiner_under_a_child_relay_after_the_origin_left() -> None:
    rn, _a, b, c, pub = tree()
    store = pub.serve(TrackStore(track("kept")))
    s = rn.add_subscriber(b)
    r = s.subscribe_all(store.name)
    rn.settle(0.02)
    for g in range(3):
        produce(store, g, 3)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: s.done(r) is not None)
    rn.cut(pub.session)
    rn.settle(0.05)
    late = rn.add_subscriber(c)  # C never had the track: it asks A, which has it cached
    r2 = late.subscribe_all(store.name)
    rn.run_until(lambda: late.done(r2) is not None)
    assert late.normal(r2) == expected(3, 3, 256)
    assert late.done(r2).status == 0x2


def test_cache_budget_evicts_and_refetches_on_demand() -> None:
    budget = 36_000
    rn, relay, pub, store, s, rid = one_track(10, 4, config=RelayConfig(cache_budget_bytes=budget))
    assert s.normal(rid) == expected(10, 4)  # live delivery never waits for the cache
    stats = relay.stats()
    assert stats.evicted_bytes > 0
    assert stats.peak_cache_bytes <= budget + SIZE
    assert relay.cache_bytes <= budget
    egress = rn.endpoint(pub.session).bytes_sent
    late = rn.add_subscriber(relay)
    r2 = late.subscribe_all(store.name)
    rn.run_until(lambda: late.done(r2) is not None)
    assert late.normal(r2) == expected(10, 4)  # evicted groups were fetched again
    assert any(isinstance(e, ev.FetchRequested) for e in pub.requests)
    assert rn.endpoint(pub.session).bytes_sent > egress
    ts = relay.track_stats(store.name)
    assert ts is not None and ts.evicted_groups > 0


def test_evicted_groups_without_upstream_are_holes() -> None:
    rn, relay, pub, store, _s, _rid = one_track(10, 4, config=RelayConfig(cache_budget_bytes=SMALL))
    rn.cut(pub.session)
    rn.settle(0.02)
    late = rn.add_subscriber(relay)
    r2 = late.subscribe_all(store.name)
    rn.run_until(lambda: late.done(r2) is not None)
    got = late.normal(r2)
    assert got and len(got) < 40  # only what is still cached, each once
    assert all(got[loc] == payload(loc.group, loc.object, SIZE) for loc in got)
    assert late.done(r2).status == 0x2


# --- an ended track is served from the cache alone ------------------------------------------


def _upstream_requests(pub: Any) -> int:
    return sum(isinstance(e, ev.SubscribeRequested | ev.FetchRequested) for e in pub.requests)


def _fetched(s: Subscriber, rid: int) -> bool:
    return any(e.request_id == rid for e in s.events(ev.DataStreamEnded))


def _ended_track(rn: RelayNet, relay: Relay, groups: int = 4, objects: int = 3) -> Any:
    """A publisher whose track is produced and ended (End of Track) before anyone asks."""
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("done")))
    for g in range(groups):
        produce(store, g, objects, size=SIZE)
    pub.end_track(store, rn.now)
    return pub, store


def _late_requests_stay_local(
    rn: RelayNet, relay: Relay, pub: Any, store: TrackStore, want: dict[Location, bytes]
) -> None:
    """Late SUBSCRIBEs (whole-track fill) and FETCHes get everything from the cache: the
    publisher sees no new request."""
    ts = relay.track_stats(store.name)
    assert ts is not None and ts.complete
    before, received = _upstream_requests(pub), ts.objects_received
    for _ in range(2):
        late = rn.add_subscriber(relay)
        rid = late.subscribe_all(store.name)
        whole = late.fetch(store.name)
        part = late.fetch(store.name, p.LocationFilter.absolute_group_end(1, 0, 2))
        rn.run_until(
            lambda late=late, rid=rid, whole=whole, part=part: (
                late.done(rid) is not None and _fetched(late, whole) and _fetched(late, part)
            )
        )
        assert late.normal(rid) == want
        assert late.done(rid).status == PublishDoneCode.TRACK_ENDED
        assert late.normal(whole) == want
        assert late.normal(part) == {k: v for k, v in want.items() if 1 <= k.group <= 2}
    assert _upstream_requests(pub) == before  # zero new upstream requests
    ts = relay.track_stats(store.name)
    assert ts is not None and ts.complete and ts.objects_received == received


def test_a_track_that_ended_before_the_relay_subscribed_is_served_from_the_cache() -> None:
    """The relay's SUBSCRIBE gets the whole track on the fill, which cannot carry the End of
    Track object (wire reference 7.5, 7.8), then PUBLISH_DONE TRACK_ENDED: complete."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub, store = _ended_track(rn, relay)
    first = rn.add_subscriber(relay)
    rid = first.subscribe_all(store.name)
    rn.run_until(lambda: first.done(rid) is not None)
    assert first.normal(rid) == expected(4, 3)
    assert first.done(rid).status == PublishDoneCode.TRACK_ENDED
    assert _upstream_requests(pub) == 1
    _late_requests_stay_local(rn, relay, pub, store, expected(4, 3))


def test_a_track_fetched_whole_with_end_of_track_is_served_from_the_cache() -> None:
    """A FETCH from {0,0} answered with End Of Track makes the cache whole and the track
    over (a KVCS consumer FETCHes complete segments); a partial FETCH does not."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub, store = _ended_track(rn, relay)
    first = rn.add_subscriber(relay)
    part = first.fetch(store.name, p.LocationFilter.absolute_group_end(1, 0, 3))
    rn.run_until(lambda: _fetched(first, part))
    ts = relay.track_stats(store.name)
    assert ts is not None and not ts.complete  # groups 1..3 only: not whole from {0,0}
    rid = first.fetch(store.name, p.LocationFilter.absolute_group_end(0, 0, 3))
    rn.run_until(lambda: _fetched(first, rid))
    assert first.normal(rid) == expected(4, 3)
    assert _upstream_requests(pub) == 2
    _late_requests_stay_local(rn, relay, pub, store, expected(4, 3))


def test_a_live_track_stays_complete_when_its_subscriber_leaves_before_the_end() -> None:
    """The subscriber got End of Track and left before the upstream PUBLISH_DONE; with
    idle_forward off the relay must not pause (FORWARD=0) the whole feed: nothing is left to
    save, and the pause made the ended cache look not whole."""
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(idle_forward=False))
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("t")))
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(store.name)
    rn.settle(0.02)
    for g in range(3):
        produce(store, g, 3, size=SIZE)
        rn.settle(0.002)
    store.append(3, 0, status=ObjectStatus.END_OF_TRACK)  # no PUBLISH_DONE yet
    rn.run_until(lambda: any(e.status is ObjectStatus.END_OF_TRACK for e in s.objects(rid)))
    s.session.cancel(rid, now=rn.now)
    rn.net.poke(s.session)
    rn.settle(0.02)
    assert not any(isinstance(e, ev.RequestUpdated) for e in rn.net.events(pub.session))
    for up_rid in list(pub.served):
        pub.session.end_subscription(up_rid, PublishDoneCode.TRACK_ENDED, now=rn.now)
    rn.net.poke(pub.session)
    rn.settle(0.05)
    _late_requests_stay_local(rn, relay, pub, store, expected(3, 3))


def test_a_track_cut_or_evicted_is_not_complete() -> None:
    """The upstream lost mid-way, or evicted groups: late requests still go upstream."""
    rn, relay, pub, store, _s, _rid = one_track(3, 3, end=False)
    rn.cut(pub.session)
    rn.settle(0.05)
    ts = relay.track_stats(store.name)
    assert ts is not None and not ts.complete
    rn, relay, pub, store, _s, _rid = one_track(10, 4, config=RelayConfig(cache_budget_bytes=SMALL))
    ts = relay.track_stats(store.name)
    assert ts is not None and not ts.complete and ts.evicted_groups > 0
    before = _upstream_requests(pub)
    late = rn.add_subscriber(relay)
    # a range the budget can hold (a FETCH is answered from the cache once its upstream
    # FETCH completed: a range larger than the budget cannot be, cache docstring)
    rid = late.fetch(store.name, p.LocationFilter.absolute_group_end(0, 0, 4))
    rn.run_until(lambda: _fetched(late, rid))
    assert late.normal(rid) == {k: v for k, v in expected(10, 4).items() if k.group <= 4}
    assert _upstream_requests(pub) > before


# --- a KVCS publication through the relay ---------------------------------------------------

KVSP = load_vectors("kvsp-vectors.json")


def kv_section(cd: dict[str, Any], layer: int, block: int, which: int) -> bytes:
    n = cd["kv_heads"] * cd["block_tokens"] * cd["head_dim"]
    values = [((layer * 7 + block * 13 + which * 5 + i) % 29 - 14) / 8 for i in range(n)]
    return struct.pack(f"<{n}e", *values)


def test_kvcs_publication_through_the_relay() -> None:
    layers, blocks = 8, 3
    cd = {**KVSP["inputs"]["compat"], "layers": layers}
    tokens = list(range(blocks * cd["block_tokens"] + 1))
    kpub = KvcsPublisher(cd, bytes.fromhex(KVSP["inputs"]["scope_key"]), tokens, bytes(16))
    rn = RelayNet()
    relay = rn.add_relay()

    def serve(session: Any, e: Any, now: float) -> None:
        if not kpub.handle_session_event(session, e, now) and isinstance(
            e, ev.SubscribeNamespaceRequested | ev.SubscribeRequested | ev.FetchRequested
        ):
            session.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, now=now)

    origin = rn.add_origin(relay, serve)
    kpub.attach(origin, now=rn.now)
    rn.net.poke(origin)
    rn.settle(0.02)
    # the publication, and its KVSP index (binding 9: one namespace per block)
    assert kpub.index is not None and len(kpub.index.namespaces) == blocks
    assert set(relay.namespaces()) == {kpub.namespace, *kpub.index.namespaces}

    def name(t: str) -> FullTrackName:
        return FullTrackName(kpub.namespace, t.encode())

    consumers = [rn.add_subscriber(relay) for _ in range(3)]
    subs: list[tuple[Subscriber, str, int]] = []

    def join(c: Subscriber) -> None:
        for t in ("k.raw.s0", "v.raw.s0"):
            subs.append((c, t, c.subscribe_all(name(t))))

    join(consumers[0])  # before production
    rn.settle(0.02)
    for layer in range(layers):
        k = [kv_section(cd, layer, b, 0) for b in range(blocks)]
        v = [kv_section(cd, layer, b, 1) for b in range(blocks)]
        kpub.put_layer(layer, k, v, now=rn.now)
        rn.net.poke(origin)
        if layer == 3:
            join(consumers[1])  # mid-production
        rn.settle(0.003)
    kpub.finish(now=rn.now)
    rn.net.poke(origin)
    rn.settle(0.05)
    join(consumers[2])  # after the publication completed
    m = consumers[2].session.subscribe(
        name(kpub.manifest_track),
        now=rn.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.relative_start(1)),
    )
    rn.net.poke(consumers[2].session)
    rn.run_until(lambda: all(c.done(r) is not None for c, _t, r in subs))
    for c, t, r in subs:
        comp = Component.K if t.startswith("k.") else Component.V
        got = c.normal(r)
        assert len(got) == layers * blocks
        for loc, data in got.items():
            obj = verify_object(
                data,
                group_id=loc.group,
                object_id=loc.object,
                expected_component=comp,
                expected_token_count=cd["block_tokens"],
                expected_token_start=loc.object * cd["block_tokens"],
            )
            assert isinstance(obj, VerifiedObject), obj
            assert bytes(obj.data) == kv_section(
                cd, loc.group, loc.object, int(comp is Component.V)
            )
        assert c.done(r).status == PublishDoneCode.TRACK_ENDED
    rn.run_until(lambda: bool(consumers[2].normal(m)))
    (manifest,) = consumers[2].normal(m).values()
    assert parse_manifest(manifest).segments[0].complete
    assert relay.upstream_bytes_received == sum(
        relay.track_stats(name(t)).bytes_received for t in ("k.raw.s0", "v.raw.s0", "manifest")
    )


def test_a_finished_kvcs_publication_is_served_to_late_consumers_from_the_cache() -> None:
    """Issue #5: a consumer joining late gets the whole cache from the nearest relay. The
    publication is finished before anyone asks: each consumer SUBSCRIBEs to the manifest
    and FETCHes the complete data tracks; only the first one's requests go upstream."""
    layers, blocks = 4, 2
    cd = {**KVSP["inputs"]["compat"], "layers": layers}
    tokens = list(range(blocks * cd["block_tokens"] + 1))
    kpub = KvcsPublisher(cd, bytes.fromhex(KVSP["inputs"]["scope_key"]), tokens, bytes(16))
    rn = RelayNet()
    relay = rn.add_relay()
    asked: list[Any] = []

    def serve(session: Any, e: Any, now: float) -> None:
        if isinstance(e, ev.SubscribeRequested | ev.FetchRequested):
            asked.append(e)
        if not kpub.handle_session_event(session, e, now) and isinstance(
            e, ev.SubscribeNamespaceRequested | ev.SubscribeRequested | ev.FetchRequested
        ):
            session.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, now=now)

    origin = rn.add_origin(relay, serve)
    kpub.attach(origin, now=rn.now)
    for layer in range(layers):
        k = [kv_section(cd, layer, b, 0) for b in range(blocks)]
        v = [kv_section(cd, layer, b, 1) for b in range(blocks)]
        kpub.put_layer(layer, k, v, now=rn.now)
    kpub.finish(now=rn.now)
    rn.net.poke(origin)
    rn.settle(0.02)

    def name(t: str) -> FullTrackName:
        return FullTrackName(kpub.namespace, t.encode())

    data = ("k.raw.s0", "v.raw.s0")
    got: list[tuple[dict[Location, bytes], ...]] = []
    for i in range(3):
        c = rn.add_subscriber(relay)
        m = c.subscribe_all(name(kpub.manifest_track))
        fetches = [
            c.fetch(name(t), p.LocationFilter.absolute_group_end(0, 0, layers - 1)) for t in data
        ]
        rn.run_until(
            lambda c=c, m=m, fetches=fetches: (
                c.done(m) is not None and all(_fetched(c, f) for f in fetches)
            )
        )
        assert c.done(m).status == PublishDoneCode.TRACK_ENDED
        got.append((c.normal(m), *(c.normal(f) for f in fetches)))
        if i == 0:
            assert sorted(type(e).__name__ for e in asked) == [
                "FetchRequested",
                "FetchRequested",
                "SubscribeRequested",
            ]
    assert len(asked) == 3  # the late consumers asked the origin nothing
    assert got[0] == got[1] == got[2]
    (manifest,) = got[0][0].values()
    assert parse_manifest(manifest).segments[0].complete
    for t, objs in zip(data, got[0][1:], strict=True):
        assert len(objs) == layers * blocks
        which = int(t.startswith("v."))
        for loc, payload_bytes in objs.items():
            obj = verify_object(
                payload_bytes,
                group_id=loc.group,
                object_id=loc.object,
                expected_component=Component.V if which else Component.K,
                expected_token_count=cd["block_tokens"],
                expected_token_start=loc.object * cd["block_tokens"],
            )
            assert isinstance(obj, VerifiedObject), obj
            assert bytes(obj.data) == kv_section(cd, loc.group, loc.object, which)
    for t in (kpub.manifest_track, *data):
        ts = relay.track_stats(name(t))
        assert ts is not None and ts.complete, t


# --- malformed tracks, slow subscribers, PUBLISH, TRACK_STATUS, failover ----------------------


def test_conflicting_publishers_make_a_malformed_track() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    p1, p2 = rn.add_publisher(relay), rn.add_publisher(relay)
    s1, s2 = p1.serve(TrackStore(track("t"))), p2.serve(TrackStore(track("t")))
    for g in range(2):
        for o in range(3):
            s1.append(g, o, payload(g, o))
            s2.append(g, o, payload(g, o))
    a = rn.add_subscriber(relay)
    ra = a.subscribe_all(s1.name)
    rn.run_until(lambda: a.accepted(ra))
    # the two publishers now disagree about {2,0}: the track is malformed (d21 12.1)
    s1.append(2, 0, b"one")
    s2.append(2, 0, b"two")
    rn.run_until(lambda: a.done(ra) is not None)
    assert a.done(ra).status == PublishDoneCode.MALFORMED_TRACK
    stats = relay.track_stats(s1.name)
    assert stats is None or stats.cached_bytes == 0  # nothing of it is cached (forgotten)
    assert relay.cache_bytes == 0


def _slow_and_fast(budget: int) -> tuple[Subscriber, int, Subscriber, int]:
    """A fast and a slow (20 kB/s, 4000-byte queue limit) subscriber of a 5-group track
    through a relay with cache budget ``budget``."""
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(cache_budget_bytes=budget, evict_to=0.5))
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("t")))
    fast = rn.add_subscriber(relay)
    slow = rn.add_subscriber(
        relay,
        relay_side=SessionConfig(role=Role.SERVER, max_queued_bytes_per_subscription=4000),
        bandwidth=20_000,
    )
    rf, rs = fast.subscribe_all(store.name), slow.subscribe_all(store.name)
    rn.settle(0.05)
    for g in range(5):
        produce(store, g, 8, size=SIZE)
    rn.settle(0.01)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: fast.done(rf) is not None and slow.done(rs) is not None, max_time=60)
    return fast, rf, slow, rs


def test_a_slow_subscriber_is_served_at_its_pace_from_the_cache() -> None:
    """#11: a subscriber behind on a track the relay holds in its cache is never dropped:
    its queue holds references into the cache, which bounds the memory."""
    fast, rf, slow, rs = _slow_and_fast(1 << 30)
    assert slow.done(rs).status == PublishDoneCode.TRACK_ENDED
    assert slow.normal(rs) == expected(5, 8)
    assert fast.done(rf).status == PublishDoneCode.TRACK_ENDED
    assert fast.normal(rf) == expected(5, 8)


def test_a_slow_subscriber_is_ended_alone_when_the_cache_evicts_its_queue() -> None:
    """What only its queue still holds (the cache evicted it) counts against the slow
    subscriber's limit: past it, it alone ends TOO_FAR_BEHIND (d21 5.2)."""
    fast, rf, slow, rs = _slow_and_fast(4 * 8 * SIZE)  # two groups and the track record
    assert slow.done(rs).status == PublishDoneCode.TOO_FAR_BEHIND
    assert fast.done(rf).status == PublishDoneCode.TRACK_ENDED
    assert fast.normal(rf) == expected(5, 8)


def test_a_published_track_is_served() -> None:
    """PUBLISH (d21 9.8) to the relay: accepted as the track's feed; the objects the
    publisher had before are FETCHed so that late subscribers get the whole track."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay, namespaces=())
    store = pub.serve(TrackStore(track("pushed")))
    produce(store, 0, 3)
    pub.session.publish(store, now=rn.now)
    rn.net.poke(pub.session)
    rn.settle(0.05)
    produce(store, 1, 3)
    rn.settle(0.02)
    s = rn.add_subscriber(relay)
    r = s.subscribe_all(store.name)
    rn.settle(0.02)
    produce(store, 2, 3)
    rn.settle(0.05)
    assert s.normal(r) == expected(3, 3, 256)
    assert any(isinstance(e, ev.FetchRequested) for e in pub.requests)


def test_track_status_through_the_relay() -> None:
    rn, relay, pub, store, s, _rid = one_track(3, 2, end=False)
    assert relay.track_stats(store.name).upstream_live
    rid = s.session.track_status(store.name, now=rn.now)
    other = pub.serve(TrackStore(track("other")))
    produce(other, 0, 4)
    rid2 = s.session.track_status(other.name, now=rn.now)  # not cached: asked upstream
    rn.net.poke(s.session)
    rn.settle(0.05)
    answers = {e.request_id: e for e in s.events(ev.RequestAccepted)}
    assert answers[rid].params.get(p.LargestObject).location == Location(2, 2)
    assert answers[rid2].params.get(p.LargestObject).location == Location(0, 4)


def test_failover_to_another_publisher_keeps_subscribers() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    p1 = rn.add_publisher(relay)
    store = p1.serve(TrackStore(track("t")))
    s = rn.add_subscriber(relay)
    r = s.subscribe_all(store.name)
    rn.settle(0.02)
    produce(store, 0, 3)
    produce(store, 1, 3)
    rn.settle(0.02)
    p2 = rn.add_publisher(relay)  # a second source of the namespace, same objects
    p2.serve(store)
    rn.cut(p1.session)
    rn.settle(0.02)
    produce(store, 2, 3)
    rn.settle(0.02)
    p2.end_track(store, rn.now)
    rn.run_until(lambda: s.done(r) is not None)
    assert s.normal(r) == expected(3, 3, 256)
    assert s.done(r).status == PublishDoneCode.TRACK_ENDED
    # the second publisher was asked only for what the cache did not have
    sub = next(e for e in p2.requests if isinstance(e, ev.SubscribeRequested))
    inner = sub.params.get(p.FillParameters).params.get(p.LocationFilter)
    assert inner.start == Location(1, 4)  # right after the cached Largest Object


def test_upstream_namespace_subscriptions_are_aggregated() -> None:
    rn, a, b, _c, _pub = tree()
    narrow, broad = rn.add_subscriber(b), rn.add_subscriber(b)
    rn_ = narrow.session.subscribe_namespace(NS, now=rn.now)
    rn.net.poke(narrow.session)
    rn.settle(0.02)
    rb = broad.session.subscribe_namespace(TrackNamespace.of("relay-test"), now=rn.now)
    rn.net.poke(broad.session)
    rn.settle(0.05)
    assert [e.request_id for e in narrow.events(ev.NamespaceAnnounced)] == [rn_]
    assert [e.namespace for e in broad.events(ev.NamespaceAnnounced)] == [NS]
    assert not narrow.events(ev.NamespaceWithdrawn)  # the broader prefix took over quietly
    # A holds one SUBSCRIBE_NAMESPACE from B: the broad one (the narrow one was cancelled)
    assert b.namespaces() == (NS,)
    held = [
        rec.namespace
        for session in a.sessions
        for rec in session.requests.values()
        if rec.kind is ev.RequestKind.SUBSCRIBE_NAMESPACE
        and not rec.mine
        and rec.state is RequestState.ESTABLISHED
    ]
    assert held == [TrackNamespace.of("relay-test")]
    more = TrackNamespace.of("relay-test", "pub-z")
    for pub_session in rn.publishers:
        pub_session.publish_namespace(more, now=rn.now)
        rn.net.poke(pub_session)
    rn.settle(0.05)
    assert [e.namespace for e in broad.events(ev.NamespaceAnnounced)] == [NS, more]
    assert [e.namespace for e in narrow.events(ev.NamespaceAnnounced)] == [NS]
    assert rb in {e.request_id for e in broad.events(ev.NamespaceAnnounced)}


def test_a_publisher_may_connect_as_a_downstream_session() -> None:
    """Routing follows PUBLISH_NAMESPACE, whichever side opened the connection."""
    rn = RelayNet()
    relay = rn.add_relay()
    edge = rn.add_subscriber(relay)  # a client of the relay that turns out to publish
    store = TrackStore(track("from-edge"))
    produce(store, 0, 3)
    edge.session.publish_namespace(NS, now=rn.now)
    rn.net.poke(edge.session)
    rn.settle(0.02)

    def serve(e: Any, now: float) -> None:
        if isinstance(e, ev.SubscribeRequested):
            edge.session.accept_subscribe(e.request_id, store, now=now)

    rn.handlers[edge.session] = serve
    s = rn.add_subscriber(relay)
    r = s.subscribe_all(store.name)
    rn.run_until(lambda: len(s.normal(r)) == 3)
    assert s.normal(r) == expected(1, 3, 256)


def test_track_state_is_bounded() -> None:
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(max_tracks=2))
    pub = rn.add_publisher(relay)
    for n in "abc":
        produce(pub.serve(TrackStore(track(n))), 0, 2)
    s = rn.add_subscriber(relay)
    for n in "abc":  # one after the other: a finished FETCH leaves its track idle
        r = s.fetch(track(n))
        rn.run_until(lambda r=r: len(s.normal(r)) == 2)
    assert len(relay.tracks()) == 2  # the least recently used idle track was forgotten
    live = [s.subscribe_all(track(n)) for n in "ab"]
    rn.run_until(lambda: all(s.accepted(r) for r in live))
    late = s.subscribe_all(track("c"))  # every known track is busy now
    rn.run_until(lambda: s.failed(late) is not None)
    assert s.failed(late).code == RequestErrorCode.EXCESSIVE_LOAD


# --- REQUEST_UPDATE propagation (wire reference 10, 4.5, 5.8, 5.9) ---------------------------


def _updates(rn: RelayNet, pub: Any) -> list[ev.RequestUpdated]:
    return [e for e in rn.net.events(pub.session) if isinstance(e, ev.RequestUpdated)]


def _subscribe(s: Subscriber, name: FullTrackName, *, forward: bool, fill: bool = False) -> int:
    rid = s.session.subscribe(
        name,
        now=s.rn.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)) if fill else None,
        forward=forward,
    )
    s.rn.net.poke(s.session)
    return rid


def _update(s: Subscriber, rid: int, *params: p.Parameter) -> int:
    uid = s.session.request_update(rid, p.Parameters.of(*params), now=s.rn.now)
    s.rn.net.poke(s.session)
    return uid


def test_upstream_forward_follows_the_downstream_forward_state() -> None:
    """Upstream Forward is 1 iff a downstream subscription forwards; resuming refills the
    cache, and every subscriber still gets every object exactly once."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("fw")))
    produce(store, 0, 3)
    produce(store, 1, 3)
    a = rn.add_subscriber(relay)
    ra = _subscribe(a, store.name, forward=False)
    rn.run_until(lambda: a.accepted(ra))
    # a Forward 0 subscriber is answered at once, with the upstream's Largest Object
    assert a.events(ev.SubscribeAccepted)[0].largest == Location(1, 3)
    (up,) = [e for e in pub.requests if isinstance(e, ev.SubscribeRequested)]
    assert up.params.get(p.Forward) == p.Forward(0)  # nobody forwards: neither does the relay
    produce(store, 2, 3)
    rn.settle(0.05)
    assert relay.upstream_bytes_received == 0
    assert a.objects(ra) == []
    # the subscriber starts forwarding with a fill: the relay resumes upstream with a fill
    uid = _update(
        a,
        ra,
        p.Forward(1),
        p.FillParameters(p.Parameters.of(p.LocationFilter.absolute_start(0, 0))),
    )
    rn.settle(0.05)
    (resume,) = _updates(rn, pub)
    assert resume.params.get(p.Forward) == p.Forward(1)
    inner = resume.params.get(p.FillParameters).params.get(p.LocationFilter)
    assert inner.start == Location(0, 0)
    produce(store, 3, 3)
    rn.settle(0.05)
    assert a.normal(ra) == expected(4, 3)  # exactly once, fill + late fill + live
    vias = {e.via_request_id for e in a.objects(ra) if e.delivery is ev.Delivery.FILL}
    assert vias <= {uid}
    # a second subscriber joins; then nobody forwards any more: the relay pauses upstream
    b = rn.add_subscriber(relay)
    rb = b.subscribe_all(store.name)
    rn.run_until(lambda: b.accepted(rb))
    _update(a, ra, p.Forward(0))
    b.session.cancel(rb, now=rn.now)
    rn.net.poke(b.session)
    rn.settle(0.05)
    assert [u.params.get(p.Forward) for u in _updates(rn, pub)] == [p.Forward(1), p.Forward(0)]
    received = relay.upstream_bytes_received
    produce(store, 4, 3)
    rn.settle(0.05)
    assert relay.upstream_bytes_received == received  # paused
    assert relay.track_stats(store.name).downstream_subscriptions == 1
    # a late joiner that forwards resumes it; it waits for the cache to be whole again
    c = rn.add_subscriber(relay)
    rc = c.subscribe_all(store.name)
    rn.run_until(lambda: c.accepted(rc))
    third = _updates(rn, pub)[2]
    assert third.params.get(p.Forward) == p.Forward(1)
    assert third.params.get(p.FillParameters).params.get(p.LocationFilter).start == Location(3, 0)
    produce(store, 5, 3)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: c.done(rc) is not None)
    assert c.normal(rc) == expected(6, 3)
    assert c.done(rc).status == PublishDoneCode.TRACK_ENDED
    assert a.normal(ra) == expected(4, 3)  # paused: nothing more reached it
    stats = relay.track_stats(store.name)
    assert stats is not None and stats.complete


def test_downstream_fill_update_refetches_evicted_groups() -> None:
    """An RU whose fill needs objects the cache evicted: the relay FETCHes them upstream
    and the subscriber gets them fill-delivered (A27), each object once."""
    rn, relay, pub, store, s, rid = one_track(
        8, 4, end=False, config=RelayConfig(cache_budget_bytes=36_000)
    )
    assert relay.stats().evicted_bytes > 0
    late = rn.add_subscriber(relay)
    r2 = _subscribe(late, store.name, forward=True)
    rn.run_until(lambda: late.accepted(r2))
    produce(store, 8, 4)
    rn.settle(0.05)
    assert sorted(late.normal(r2)) == [Location(8, o) for o in range(4)]
    assert not any(isinstance(e, ev.FetchRequested) for e in pub.requests)
    # the part before its live start (Largest was {7,4}, End of Group) as a fill
    fill = p.Parameters.of(p.LocationFilter.absolute_range(0, 0, 7, 4))
    uid = _update(late, r2, p.FillParameters(fill))
    rn.settle(0.1)
    assert any(isinstance(e, ev.FetchRequested) for e in pub.requests)  # evicted: refetched
    assert late.normal(r2) == expected(9, 4)
    assert {e.via_request_id for e in late.objects(r2) if e.delivery is ev.Delivery.FILL} == {uid}
    assert s.normal(rid) == expected(9, 4)


def test_new_group_request_goes_upstream_when_it_asks_for_a_new_group() -> None:
    """NEW_GROUP_REQUEST (wire reference 5.8): forwarded when 0 or > Largest Group on a
    DYNAMIC_GROUPS track, not while an equal or larger one is outstanding."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    props = (KeyValuePair(PropertyType.DYNAMIC_GROUPS, 1),)
    store = pub.serve(TrackStore(track("dyn"), track_properties=props))
    produce(store, 0, 2)
    produce(store, 1, 2)
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(store.name)
    rn.run_until(lambda: s.accepted(rid))
    _update(s, rid, p.NewGroupRequest(0))
    rn.settle(0.05)
    _update(s, rid, p.NewGroupRequest(0))  # outstanding: not again
    _update(s, rid, p.NewGroupRequest(1))  # not above Largest Group 1: not forwarded
    rn.settle(0.05)
    assert [u.params.get(p.NewGroupRequest) for u in _updates(rn, pub)] == [p.NewGroupRequest(0)]
    produce(store, 2, 2)  # Largest Group grew: the request is answered
    rn.settle(0.05)
    _update(s, rid, p.NewGroupRequest(5))
    rn.settle(0.05)
    assert [u.params.get(p.NewGroupRequest) for u in _updates(rn, pub)] == [
        p.NewGroupRequest(0),
        p.NewGroupRequest(5),
    ]
    plain = pub.serve(TrackStore(track("static")))
    produce(plain, 0, 1)
    r2 = s.subscribe_all(plain.name)
    rn.run_until(lambda: s.accepted(r2))
    _update(s, r2, p.NewGroupRequest(0))  # no DYNAMIC_GROUPS: never forwarded
    rn.settle(0.05)
    assert len(_updates(rn, pub)) == 2


# --- faults: a subscriber resetting mid-stream; eviction under a response in progress --------


def test_a_subscriber_resetting_mid_stream_leaves_the_others_whole() -> None:
    """One subscriber cancels its subscription mid-group, another STOP_SENDINGs one data
    stream mid-object: the relay resets exactly those streams with CANCELLED, the others
    receive every object exactly once, and the relay's accounting stays within budget."""
    budget = 40_000
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(cache_budget_bytes=budget))
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("faults")))
    a, b, c = (rn.add_subscriber(relay, bandwidth=400_000) for _ in range(3))
    ra, rb, rc = (x.subscribe_all(store.name) for x in (a, b, c))
    rn.run_until(lambda: all(x.accepted(r) for x, r in ((a, ra), (b, rb), (c, rc))))
    size = 4000
    produce(store, 0, 8, size=size)
    produce(store, 1, 8, size=size)
    rn.run_until(lambda: len(c.normal(rc)) >= 10)  # group 1 is on its way (400 KB/s)
    assert 0 < len(b.normal(rb)) < 16 and len(c.normal(rc)) < 16
    b.session.cancel(rb, now=rn.now)
    rn.net.poke(b.session)
    # C abandons the data stream it is receiving now (group 1), mid-object
    (open_ref,) = [
        ref
        for ref, st in c.session.receiver.streams.items()
        if st.request is not None and st.request.request_id == rc and st.group_id == 1
    ]
    rn.stop_sending(c.session, open_ref, StreamResetCode.CANCELLED)
    have_c = len(c.normal(rc))
    for g in range(2, 12):
        produce(store, g, 8, size=size)
        rn.settle(0.01)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: a.done(ra) is not None and c.done(rc) is not None)
    rn.settle(0.2)
    want = expected(12, 8, size)
    assert a.normal(ra) == want and a.done(ra).status == PublishDoneCode.TRACK_ENDED
    # C lost the rest of group 1's stream, nothing else, and nothing twice
    got_c = c.normal(rc)
    assert all(got_c[loc] == want[loc] for loc in got_c)
    assert set(want) - set(got_c) <= {Location(1, o) for o in range(8)}
    assert len(got_c) > have_c
    assert all(Location(g, o) in got_c for g in range(2, 12) for o in range(8))
    assert c.done(rc).status == PublishDoneCode.TRACK_ENDED
    resets = [e for e in c.events(ev.DataStreamEnded) if e.reset_code is not None]
    assert [(e.group_id, e.reset_code) for e in resets] == [(1, StreamResetCode.CANCELLED)]
    # B: its streams were reset with CANCELLED, its request is over on the relay side
    assert b.done(rb) is None and len(b.normal(rb)) < 16
    assert {e.reset_code for e in b.events(ev.DataStreamEnded)} <= {
        None,
        StreamResetCode.CANCELLED,
    }
    relay_b = rn.endpoint(b.session).peer.machine  # the relay's session towards B
    cancelled = [e for e in rn.net.events(relay_b) if isinstance(e, ev.RequestCancelled)]
    assert [(e.request_id, e.code) for e in cancelled] == [(rb, StreamResetCode.CANCELLED)]
    assert relay_b.requests[rb].state is RequestState.FAILED
    # accounting: one copy, within budget; no subscription left
    stats = relay.stats()
    assert stats.evicted_bytes > 0
    assert relay.cache_bytes <= budget and stats.peak_cache_bytes <= budget + size
    assert stats.downstream_subscriptions == 0
    assert relay.track_stats(store.name).duplicates == 0
    assert relay.upstream_bytes_received == 12 * 8 * size  # the publisher sent each once


def test_eviction_during_a_fill_and_a_fetch_served_from_the_cache() -> None:
    """A fill and a FETCH served from the cache to slow subscribers keep every object
    while the live track pushes the cache past its budget and evicts their groups."""
    size, budget = 1000, 90_000
    rn, relay, pub, _store, _s, _rid = one_track(
        6, 4, end=False, config=RelayConfig(cache_budget_bytes=budget)
    )
    assert relay.stats().evicted_bytes == 0  # 6 x 4 x 256 B fit
    big = pub.serve(TrackStore(track("big")))
    live = rn.add_subscriber(relay)
    rl = live.subscribe_all(big.name)
    rn.run_until(lambda: live.accepted(rl))
    for g in range(6):
        produce(big, g, 4, size=size)
    rn.settle(0.05)
    slow_fill = rn.add_subscriber(relay, bandwidth=10_000)
    slow_fetch = rn.add_subscriber(relay, bandwidth=10_000)
    rf = slow_fill.subscribe_all(big.name)
    rx = slow_fetch.fetch(big.name)
    rn.run_until(lambda: slow_fill.accepted(rf) and slow_fetch.accepted(rx))
    egress = rn.endpoint(pub.session).bytes_sent
    for g in range(6, 30):  # the cache passes its budget: early groups of "big" are evicted
        produce(big, g, 4, size=size)
        rn.settle(0.005)
    assert relay.stats().evicted_bytes > 0
    assert len(slow_fill.normal(rf)) < 24 and len(slow_fetch.normal(rx)) < 24  # still sending
    assert relay.track_stats(big.name).evicted_groups > 0
    pub.end_track(big, rn.now)
    rn.run_until(
        lambda: (
            slow_fill.done(rf) is not None
            and any(e.request_id == rx for e in slow_fetch.events(ev.DataStreamEnded))
        ),
        max_time=60,
    )
    assert slow_fill.normal(rf) == expected(30, 4, size)
    assert slow_fetch.normal(rx) == expected(6, 4, size)  # the range as it was: {0,0}..{5,4}
    assert live.normal(rl) == expected(30, 4, size)
    # nothing was fetched again: the responses kept the evicted objects themselves
    assert not any(isinstance(e, ev.FetchRequested) for e in pub.requests)
    assert rn.endpoint(pub.session).bytes_sent - egress < 25 * 4 * (size + 32)
    assert relay.cache_bytes <= budget


# --- SUBSCRIBE_TRACKS (d21 9.18, wire reference 4.4 and 10) ----------------------------------


def test_subscribe_tracks_publishes_known_and_later_tracks() -> None:
    """The relay PUBLISHes every matching track it knows and every later one, skips the
    ones the subscriber already SUBSCRIBEd to, and each PUBLISH delivers every object
    once (FILL_PARAMETERS in the SUBSCRIBE_TRACKS, A10)."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    a = pub.serve(TrackStore(track("a")))
    x = pub.serve(TrackStore(track("x")))
    for st in (a, x):
        produce(st, 0, 3)
    early = rn.add_subscriber(relay)
    ra = early.subscribe_all(a.name)  # the relay knows "a" and has it live
    rn.run_until(lambda: early.accepted(ra))
    t = rn.add_subscriber(relay)
    t.accept_publishes()
    rx = t.subscribe_all(x.name)  # T takes "x" the SUBSCRIBE way
    rn.run_until(lambda: t.accepted(rx))
    b = pub.serve(TrackStore(track("b")))  # unknown to the relay so far
    produce(b, 0, 2)
    rt = t.subscribe_tracks(TrackNamespace.of("relay-test"))
    rn.settle(0.05)
    assert [e.request_id for e in t.events(ev.RequestAccepted)] == [rt]
    published = {e.track: e for e in t.events(ev.PublishRequested)}
    assert set(published) == {a.name, b.name}  # "a" from the cache, "b" learnt upstream
    assert [e.track for e in t.events(ev.PublishSkippedReceived)] == [x.name]
    # the relay asked the publisher with SUBSCRIBE_TRACKS; its PUBLISHes of "a" and "x",
    # which the relay already subscribes to, were refused as duplicates
    assert any(isinstance(e, ev.SubscribeTracksRequested) for e in pub.requests)
    refused = [e for e in rn.net.events(pub.session) if isinstance(e, ev.RequestFailed)]
    assert [e.code for e in refused] == [RequestErrorCode.UNINTERESTED] * 2
    c = pub.serve(TrackStore(track("c")))  # a later track
    rn.settle(0.02)
    produce(c, 0, 2)
    for st in (a, b):
        produce(st, 1, 3)
    rn.settle(0.05)
    published = {e.track: e for e in t.events(ev.PublishRequested)}
    assert set(published) == {a.name, b.name, c.name}
    for st, groups, objects in ((a, 2, 3), (b, 1, 2), (c, 1, 2)):
        got = t.normal(published[st.name].request_id)
        want = {Location(g, o): payload(g, o) for g in range(groups) for o in range(objects)}
        if st is a:
            want.update({Location(1, o): payload(1, o) for o in range(3)})
        if st is b:
            want.update({Location(1, o): payload(1, o) for o in range(3)})
        assert got == want, st.name
    # the publisher's end reaches the PUBLISH-created subscriptions as PUBLISH_DONE
    pub.end_track(a, rn.now)
    rn.run_until(lambda: t.done(published[a.name].request_id) is not None)
    assert t.done(published[a.name].request_id).status == PublishDoneCode.TRACK_ENDED
    assert early.done(ra).status == PublishDoneCode.TRACK_ENDED
    assert relay.track_stats(a.name).duplicates == 0


def test_subscribe_tracks_skips_the_subscribers_own_tracks_and_follows_a_prefix_change() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    a = pub.serve(TrackStore(track("a")))
    produce(a, 0, 1)
    # an edge publisher connected as a downstream peer, publishing its own namespace
    edge = rn.add_subscriber(relay)
    edge_ns = TrackNamespace.of("relay-test", "edge")
    own = TrackStore(track("mine", edge_ns))
    produce(own, 0, 1)
    edge.session.publish_namespace(edge_ns, now=rn.now)
    rn.net.poke(edge.session)
    rn.settle(0.02)

    def serve(e: Any, now: float) -> None:
        if isinstance(e, ev.SubscribeRequested):
            edge.session.accept_subscribe(e.request_id, own, now=now)
        elif isinstance(e, ev.PublishRequested):
            edge.session.accept_publish(e.request_id, now=now)

    rn.handlers[edge.session] = serve
    other = rn.add_subscriber(relay)
    ro = other.subscribe_all(own.name)  # the relay now knows the edge's track
    rn.run_until(lambda: len(other.normal(ro)) == 1)
    rt = edge.subscribe_tracks(NS, fill=False)  # "relay-test/pub-a" only
    rn.settle(0.05)
    assert [e.track for e in edge.events(ev.PublishRequested)] == [a.name]
    assert edge.events(ev.PublishSkippedReceived) == []
    # widen the prefix: its own track is skipped, not PUBLISHed back to it
    edge.session.request_update(
        rt,
        p.Parameters.of(p.TrackNamespacePrefix(TrackNamespace.of("relay-test"))),
        now=rn.now,
    )
    rn.net.poke(edge.session)
    rn.settle(0.05)
    assert [e.track for e in edge.events(ev.PublishRequested)] == [a.name]
    assert [e.track for e in edge.events(ev.PublishSkippedReceived)] == [own.name]


def test_subscribe_tracks_through_a_relay_tree() -> None:
    rn, a, b, _c, pub = tree()
    t = rn.add_subscriber(b)
    t.accept_publishes()
    rt = t.subscribe_tracks(TrackNamespace.of("relay-test"))
    rn.settle(0.05)
    store = pub.serve(TrackStore(track("deep")))
    rn.settle(0.05)
    (pr,) = t.events(ev.PublishRequested)
    assert pr.track == store.name
    for g in range(3):
        produce(store, g, 3)
        rn.settle(0.005)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: t.done(pr.request_id) is not None)
    assert t.normal(pr.request_id) == expected(3, 3, 256)
    assert t.done(pr.request_id).status == PublishDoneCode.TRACK_ENDED
    assert rt in {e.request_id for e in t.events(ev.RequestAccepted)}
    assert a.upstream_bytes_received == b.upstream_bytes_received == 9 * 256


def test_namespace_prefix_update_through_the_relay() -> None:
    """TRACK_NAMESPACE_PREFIX on a SUBSCRIBE_NAMESPACE (wire reference 5.8): suffixes are
    relative to the new prefix after the REQUEST_OK, on both sessions."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    s = rn.add_subscriber(relay)
    rid = s.session.subscribe_namespace(NS, now=rn.now)
    rn.net.poke(s.session)
    rn.settle(0.02)
    assert [e.namespace for e in s.events(ev.NamespaceAnnounced)] == [NS]
    s.session.request_update(
        rid, p.Parameters.of(p.TrackNamespacePrefix(TrackNamespace.of("relay-test"))), now=rn.now
    )
    rn.net.poke(s.session)
    rn.settle(0.02)
    other = TrackNamespace.of("relay-test", "pub-b")
    pub.session.publish_namespace(other, now=rn.now)
    rn.net.poke(pub.session)
    rn.settle(0.02)
    assert [e.namespace for e in s.events(ev.NamespaceAnnounced)] == [NS, other]
    rn.cut(pub.session)
    rn.settle(0.02)
    assert sorted(e.namespace.fields for e in s.events(ev.NamespaceWithdrawn)) == sorted(
        [NS.fields, other.fields]
    )
    assert not s.session.is_closed


def test_cancelled_subscribe_tracks_gets_no_more_publishes() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    t = rn.add_subscriber(relay)
    t.accept_publishes()
    rt = t.subscribe_tracks(TrackNamespace.of("relay-test"), fill=False)
    rn.settle(0.02)
    first = pub.serve(TrackStore(track("one")))
    rn.settle(0.02)
    assert [e.track for e in t.events(ev.PublishRequested)] == [first.name]
    (pr,) = t.events(ev.PublishRequested)
    assert pr.params.get(p.Forward) == p.Forward(1)
    assert pr.params.get(p.GroupOrderParam) is not None  # written explicitly (B3)
    t.session.cancel(rt, now=rn.now)
    rn.net.poke(t.session)
    rn.settle(0.02)
    pub.serve(TrackStore(track("two")))
    produce(first, 0, 2)
    rn.settle(0.05)
    assert [e.track for e in t.events(ev.PublishRequested)] == [first.name]
    assert sorted(t.normal(pr.request_id)) == [Location(0, 0), Location(0, 1)]  # lives on


def test_a_delivery_timeout_runs_from_when_the_relay_got_the_object() -> None:
    """d21 5.2: OBJECT_DELIVERY_TIMEOUT starts when the relay received the object, not when
    its downstream session last did something (it may have been idle for long)."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("timed")))
    s = rn.add_subscriber(relay)
    rid = s.session.subscribe(
        store.name,
        now=rn.now,
        location_filter=p.LocationFilter.next_object(),
        extra=[p.ObjectDeliveryTimeout(100)],
    )
    rn.net.poke(s.session)
    rn.run_until(lambda: s.accepted(rid))
    rn.settle(2.0)  # everyone idle for much longer than the timeout
    produce(store, 0, 3)
    rn.settle(0.1)
    assert sorted(s.normal(rid)) == [Location(0, o) for o in range(3)]
    assert all(e.reset_code is None for e in s.events(ev.DataStreamEnded))


def test_late_objects_from_out_of_order_upstream_delivery_reach_a_late_joiner() -> None:
    """A27 through the relay: subgroup 1 of a group reaches the cache before subgroup 0; a
    subscriber joining in between (live start after {2,4}) gets subgroup 0 fill-delivered
    when it arrives, every object once."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("ooo")))
    first = rn.add_subscriber(relay)
    r1 = first.subscribe_all(store.name)
    rn.run_until(lambda: first.accepted(r1))
    produce(store, 0, 3)
    produce(store, 1, 3)
    for o in (3, 4):  # subgroup 1 of group 2 arrives first
        store.append(2, o, payload(2, o), subgroup_id=1)
    rn.settle(0.02)
    late = rn.add_subscriber(relay)
    r2 = late.subscribe_all(store.name)
    rn.run_until(lambda: late.accepted(r2))
    assert late.events(ev.SubscribeAccepted)[0].largest == Location(2, 4)
    for o in range(3):  # subgroup 0 now: below the late joiner's live start
        store.append(2, o, payload(2, o), subgroup_id=0)
    store.append(2, 5, payload(2, 5), subgroup_id=1)
    rn.settle(0.05)
    want = {**expected(2, 3), **{Location(2, o): payload(2, o) for o in range(6)}}
    assert first.normal(r1) == want
    assert late.normal(r2) == want
    by = {e.location: e for e in late.objects(r2)}
    assert all(by[Location(2, o)].delivery is ev.Delivery.FILL for o in range(3))
    assert by[Location(2, 5)].delivery is ev.Delivery.SUBSCRIPTION
