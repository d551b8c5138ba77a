"""Cut-through relaying (#11): the relay forwards what it is still receiving.

A SUBSCRIBE whose fill the relay must get from upstream is answered as soon as the
upstream's SUBSCRIBE_OK tells where the fill ends; the downstream fill then follows
the upstream one object by object. A FETCH that misses the cache is answered at the
upstream's FETCH_OK and its objects are forwarded as they arrive. Every object still
reaches every subscriber exactly once, bit for bit (wire reference 6, A27); a FETCH
whose source fails is reset, never ended short as if complete.

The publisher sits behind a slow link (``UPLINK`` bytes/s), so the upstream transfer
takes seconds of simulated time; the subscriber's link is fast.
"""

from __future__ import annotations

from relay_net import RelayNet, Subscriber, payload, produce, track

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import Relay
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import PublishDoneCode
from kvcs_core.wire.names import Location

GROUPS, OBJECTS, SIZE = 10, 8, 4000
UPLINK = 200_000.0
"""Bytes/s from the publisher to the relay: the 320 kB track takes about 1.6 s."""
TRANSFER = GROUPS * OBJECTS * SIZE / UPLINK


def _expected(groups: range) -> dict[Location, bytes]:
    return {Location(g, o): payload(g, o, SIZE) for g in groups for o in range(OBJECTS)}


def _setup() -> tuple[RelayNet, Relay, TrackStore]:
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay, bandwidth=UPLINK)
    store = pub.serve(TrackStore(track("cut")))
    for g in range(GROUPS):
        produce(store, g, OBJECTS, size=SIZE)
    return rn, relay, store


def _once(sub: Subscriber, rid: int) -> dict[Location, bytes]:
    """The subscriber's objects of ``rid``; each Location at most once."""
    got = [e for e in sub.objects(rid) if e.payload.nbytes]
    locations = [e.location for e in got]
    assert len(locations) == len(set(locations)), "an object arrived twice"
    return {e.location: bytes(e.payload) for e in got}


def test_a_subscribe_is_answered_before_the_upstream_fill_arrives() -> None:
    rn, relay, store = _setup()
    start = rn.now
    sub = rn.add_subscriber(relay)
    rid = sub.subscribe_all(store.name)
    rn.run_until(lambda: sub.accepted(rid), max_time=10)
    answered = rn.now - start
    rn.run_until(lambda: bool(sub.objects(rid)), max_time=10)
    first = rn.now - start
    rn.run_until(lambda: len(_once(sub, rid)) == GROUPS * OBJECTS, max_time=30)
    whole = rn.now - start
    # before: SUBSCRIBE_OK only once the whole fill was in the cache (about TRANSFER s)
    assert answered < TRANSFER / 4, (answered, whole)
    assert first < TRANSFER / 4, (first, whole)
    assert whole >= TRANSFER * 0.9
    # live objects after the fill: each once, nothing lost between fill and live part
    for g in range(GROUPS, GROUPS + 2):
        produce(store, g, OBJECTS, size=SIZE)
    rn.run_until(lambda: len(_once(sub, rid)) == (GROUPS + 2) * OBJECTS, max_time=30)
    assert _once(sub, rid) == _expected(range(GROUPS + 2))
    rn.settle(0.5)
    assert _once(sub, rid) == _expected(range(GROUPS + 2))


def test_subscribers_joining_during_the_upstream_fill_each_get_every_object_once() -> None:
    rn, relay, store = _setup()
    subs: list[tuple[Subscriber, int]] = []
    for _ in range(3):  # one at the start, two while the fill streams through
        sub = rn.add_subscriber(relay)
        subs.append((sub, sub.subscribe_all(store.name)))
        rn.settle(TRANSFER / 4)
    produce(store, GROUPS, OBJECTS, size=SIZE)  # live meanwhile
    want = _expected(range(GROUPS + 1))
    rn.run_until(lambda: all(len(_once(s, r)) == len(want) for s, r in subs), max_time=30)
    rn.settle(0.5)
    for s, r in subs:
        assert _once(s, r) == want


def test_a_fetch_that_misses_the_cache_is_forwarded_as_it_arrives() -> None:
    rn, relay, store = _setup()
    lf = p.LocationFilter.absolute_range(0, 0, GROUPS - 1, OBJECTS - 1)
    start = rn.now
    first_sub = rn.add_subscriber(relay)
    rid = first_sub.fetch(store.name, lf)
    rn.run_until(lambda: first_sub.accepted(rid), max_time=10)
    answered = rn.now - start
    rn.run_until(lambda: bool(first_sub.objects(rid)), max_time=10)
    first = rn.now - start
    # a second FETCH of the same range joins the upstream one where it has got to
    rn.settle(TRANSFER / 3)
    late = rn.add_subscriber(relay)
    rid2 = late.fetch(store.name, lf)
    want = _expected(range(GROUPS))
    rn.run_until(
        lambda: len(_once(first_sub, rid)) == len(want) and len(_once(late, rid2)) == len(want),
        max_time=30,
    )
    whole = rn.now - start
    assert answered < TRANSFER / 4, (answered, whole)
    assert first < TRANSFER / 4, (first, whole)
    rn.settle(0.5)
    for s, r in ((first_sub, rid), (late, rid2)):
        assert _once(s, r) == want
        ends = [e for e in s.events(ev.DataStreamEnded) if e.request_id == r]
        assert [e.reset_code for e in ends] == [None]  # one fetch stream, FIN'd


def test_a_forwarded_fetch_whose_upstream_is_lost_is_reset_not_ended_short() -> None:
    rn, relay, store = _setup()
    lf = p.LocationFilter.absolute_range(0, 0, GROUPS - 1, OBJECTS - 1)
    sub = rn.add_subscriber(relay)
    rid = sub.fetch(store.name, lf)
    rn.run_until(lambda: len(sub.objects(rid)) > OBJECTS, max_time=10)
    (pub_session,) = list(rn.publishers)
    rn.cut(pub_session)
    rn.run_until(
        lambda: any(e.request_id == rid for e in sub.events(ev.DataStreamEnded)), max_time=10
    )
    (end,) = [e for e in sub.events(ev.DataStreamEnded) if e.request_id == rid]
    assert end.reset_code is not None  # the consumer knows the response is incomplete
    assert len(_once(sub, rid)) < GROUPS * OBJECTS
    assert sub.done(rid) is None or sub.done(rid).status != PublishDoneCode.TRACK_ENDED


def test_fetch_objects_that_overtake_the_fetch_ok_do_not_stop_cut_through() -> None:
    """The upstream FETCH's first objects reach the relay before its FETCH_OK (they travel
    on another stream: picoquic delivered them so in about 3 of 4 late transfers through
    a pquic tree). They are cached when the answer makes the store, and the downstream
    FETCH is still answered at that FETCH_OK and forwarded as the rest arrives, not
    after the whole upstream FETCH."""
    rn, relay, store = _setup()
    held: list[tuple[object, ev.SessionEvent, float]] = []
    objects_before_ok = 0
    handle = relay.handle_session_event

    def overtaking(session: object, event: ev.SessionEvent, now: float) -> bool:
        nonlocal objects_before_ok
        if isinstance(event, ev.FetchAccepted) and not held and objects_before_ok == 0:
            held.append((session, event, now))  # the answer comes after 3 of its objects
            return True
        if isinstance(event, ev.ObjectReceived) and held and objects_before_ok < 3:
            objects_before_ok += 1
            done = handle(session, event, now)  # type: ignore[arg-type]
            if objects_before_ok == 3:
                s, answer, _ = held[0]
                handle(s, answer, now)  # type: ignore[arg-type]
            return done
        return handle(session, event, now)  # type: ignore[arg-type]

    relay.handle_session_event = overtaking  # type: ignore[method-assign]
    lf = p.LocationFilter.absolute_range(0, 0, GROUPS - 1, OBJECTS - 1)
    start = rn.now
    sub = rn.add_subscriber(relay)
    rid = sub.fetch(store.name, lf)
    rn.run_until(lambda: bool(sub.objects(rid)), max_time=10)
    first = rn.now - start
    want = _expected(range(GROUPS))
    rn.run_until(lambda: len(_once(sub, rid)) == len(want), max_time=30)
    assert objects_before_ok == 3 and held, "the FETCH_OK was not overtaken"
    # before: the first object only once the whole upstream FETCH was in (about TRANSFER s)
    assert first < TRANSFER / 4, (first, rn.now - start)
    rn.settle(0.5)
    assert _once(sub, rid) == want
    ends = [e for e in sub.events(ev.DataStreamEnded) if e.request_id == rid]
    assert [e.reset_code for e in ends] == [None]
