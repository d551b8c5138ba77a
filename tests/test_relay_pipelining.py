"""Every hop pipelined (#11): through one relay and through a two-relay tree, a live
subscriber gets each group (a KVCS layer) about as the producer finishes it.

The producer makes one group every ``PERIOD`` seconds; each hop is a link of
``LINK`` bytes/s, so one group crosses a hop in about a quarter of a period. A
subscriber that joins before production, and one that joins half-way (the relays
must then fetch the part already produced on their upstream fill while the live
part flows), must each hold group ``g`` within one period of its production: no hop
may store a group, or the fill, before forwarding it (cut-through).
"""

from __future__ import annotations

import itertools

import pytest
from relay_net import RelayNet, Subscriber, payload, produce, track

from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import Relay
from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.names import Location

GROUPS, OBJECTS, SIZE = 16, 8, 4000
PERIOD = 0.4
LINK = 4 * OBJECTS * SIZE / PERIOD
"""Bytes/s of every link: one group takes a quarter of a period per hop."""
JOIN_AT = GROUPS // 2


def _got_group(sub: Subscriber, rid: int, g: int) -> bool:
    got = sub.normal(rid)
    return all(Location(g, o) in got for o in range(OBJECTS))


def _network(hops: int) -> tuple[RelayNet, Relay, TrackStore]:
    """A publisher, ``hops`` relays in a chain; returns the network, the last relay (the
    subscribers' one) and the publisher's store."""
    rn = RelayNet(bandwidth=LINK, latency=0.005)
    relays = [rn.add_relay() for _ in range(hops)]
    for parent, child in itertools.pairwise(relays):
        rn.link_relays(parent, child)
    pub = rn.add_publisher(relays[0])
    store = pub.serve(TrackStore(track("pipelined")))
    return rn, relays[-1], store


def _want() -> dict[Location, bytes]:
    return {Location(g, o): payload(g, o, SIZE) for g in range(GROUPS) for o in range(OBJECTS)}


@pytest.mark.parametrize("hops", [1, 2], ids=["one-relay", "two-relay-tree"])
def test_a_live_subscriber_gets_each_group_within_a_period_of_its_production(hops: int) -> None:
    rn, leaf, store = _network(hops)
    sub = rn.add_subscriber(leaf)
    rid = sub.subscribe_all(store.name)
    rn.settle(0.1)
    delays: list[float] = []
    start = rn.now
    for g in range(GROUPS):
        rn.settle(max(0.0, start + g * PERIOD - rn.now))
        produced = rn.now
        produce(store, g, OBJECTS, size=SIZE)
        rn.run_until(lambda g=g: _got_group(sub, rid, g), max_time=PERIOD * 4)
        delays.append(rn.now - produced)
    rn.settle(1.0)
    assert sub.normal(rid) == _want()
    assert max(delays) < PERIOD, delays


@pytest.mark.parametrize("hops", [1, 2], ids=["one-relay", "two-relay-tree"])
def test_a_subscriber_joining_mid_production_is_fed_while_the_relays_fill(hops: int) -> None:
    """The first subscriber comes half-way: every relay must get the groups already made
    on its upstream fill; the subscriber's first objects come as that fill arrives, not
    once it is complete at every hop, and it then keeps up with production."""
    rn, leaf, store = _network(hops)
    start = rn.now
    joined: tuple[Subscriber, int] | None = None
    first_after = -1.0
    delays: list[float] = []
    for g in range(GROUPS):
        rn.settle(max(0.0, start + g * PERIOD - rn.now))
        produced = rn.now
        produce(store, g, OBJECTS, size=SIZE)
        if g == JOIN_AT:
            new = rn.add_subscriber(leaf)
            joined = (new, new.subscribe_all(store.name))
            at = rn.now
            rn.run_until(lambda j=joined: bool(j[0].objects(j[1])), max_time=PERIOD * 4)
            first_after = rn.now - at
        if joined is not None:
            rn.run_until(lambda g=g, j=joined: _got_group(*j, g), max_time=PERIOD * 8)
            delays.append(rn.now - produced)
    assert joined is not None
    sub, rid = joined
    rn.settle(1.0)
    assert sub.normal(rid) == _want()  # each object once: the fill, then the live part
    # before cut-through, the first object came only after the whole fill of JOIN_AT
    # groups (two periods per hop at this link speed) had been stored at every hop
    assert first_after < PERIOD / 2, first_after
    assert max(delays[-3:]) < PERIOD, delays  # caught up: live again


@pytest.mark.parametrize("hops", [1, 2], ids=["one-relay", "two-relay-tree"])
def test_groups_produced_interleaved_go_out_one_stream_per_group(hops: int) -> None:
    """A producer with several groups (layers) in flight sends their objects interleaved.
    A relay used to FIN a subgroup's stream as soon as an object of another group came
    (assuming groups in order), so each group went out over many streams, which the next
    hop could receive out of order (seen with ``kvcs publish`` through two relays: objects
    lost). Now each group keeps one stream, ended by its End of Group."""
    rn, leaf, store = _network(hops)
    sub = rn.add_subscriber(leaf)
    rid = sub.subscribe_all(store.name)
    rn.settle(0.1)
    for o in range(OBJECTS):  # every group at once, one object of each in turn
        for g in range(GROUPS):
            store.append(g, o, payload(g, o, SIZE))
            rn.settle(0.001)
    for g in range(GROUPS):
        store.append(g, OBJECTS, status=ObjectStatus.END_OF_GROUP)
    (pub,) = rn.publishers.values()
    pub.end_track(store, rn.now)
    rn.run_until(lambda: sub.done(rid) is not None, max_time=30)
    assert sub.normal(rid) == _want()
    done = sub.done(rid)
    assert done is not None
    assert done.stream_count <= GROUPS + 1, done  # before: about one stream per object


def test_an_object_that_reaches_the_store_below_its_stream_is_sent_not_dropped() -> None:
    """A relay's store can get a subgroup's objects out of order (its upstream split the
    subgroup over streams that arrived out of order). One below the Object ID its
    subgroup stream has reached cannot go on that stream (d21 11.3.1); it used to be
    dropped from the live path (the subscriber never got it). It goes on a stream of its
    own."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("stray")))
    sub = rn.add_subscriber(relay)
    rid = sub.subscribe_all(store.name)
    rn.settle(0.1)
    for o in (0, 1, 3, 5, 2, 4, 6, 7):  # the subgroup as two streams received interleaved
        store.append(0, o, payload(0, o, SIZE))
        rn.settle(0.01)
    store.append(0, OBJECTS, status=ObjectStatus.END_OF_GROUP)
    rn.run_until(lambda: len(sub.normal(rid)) == OBJECTS, max_time=10)
    assert sub.normal(rid) == {Location(0, o): payload(0, o, SIZE) for o in range(OBJECTS)}
