"""RENDEZVOUS_TIMEOUT at the relay (wire reference 5.7, d21 9.20.7; issue 10 finding 11).

A SUBSCRIBE for a track with no publisher carrying RENDEZVOUS_TIMEOUT is held until a
publisher appears (then served as usual) or the timeout passes (REQUEST_ERROR TIMEOUT);
without it the answer is DOES_NOT_EXIST at once; the number held is bounded.
"""

from __future__ import annotations

from relay_net import NS, RelayNet, Subscriber, payload, produce, track

from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import RelayConfig
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import RequestErrorCode
from kvcs_core.wire.names import FullTrackName


def held_subscribe(s: Subscriber, name: FullTrackName, ms: int) -> int:
    rid = s.session.subscribe(
        name,
        now=s.rn.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
        extra=[p.RendezvousTimeout(ms)],
    )
    s.rn.net.poke(s.session)
    return rid


def test_held_until_the_timeout_then_timeout_error() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    s = rn.add_subscriber(relay)
    start = rn.now
    rid = held_subscribe(s, track("later"), 500)
    rn.settle(0.3)
    assert s.failed(rid) is None and not s.accepted(rid)  # held: no answer yet
    rn.run_until(lambda: s.failed(rid) is not None, max_time=2.0)
    failed = s.failed(rid)
    assert failed is not None and failed.code == RequestErrorCode.TIMEOUT
    assert rn.now - start >= 0.5
    assert relay.tracks() == ()  # nothing left behind
    assert relay.get_timer() is None


def test_without_the_parameter_does_not_exist_at_once() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(track("later"))
    rn.settle(0.05)
    failed = s.failed(rid)
    assert failed is not None and failed.code == RequestErrorCode.DOES_NOT_EXIST


def test_a_publisher_appearing_serves_the_held_subscribe() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    s = rn.add_subscriber(relay)
    rid = held_subscribe(s, track("later"), 5_000)
    rn.settle(0.2)
    assert s.failed(rid) is None
    pub = rn.add_publisher(relay, namespaces=())
    store = pub.serve(TrackStore(track("later")))
    produce(store, 0, 3)
    pub.session.publish_namespace(NS, now=rn.now)  # a publisher of the track appears
    rn.net.poke(pub.session)
    rn.run_until(lambda: s.accepted(rid) and len(s.normal(rid)) == 3, max_time=3.0)
    assert s.normal(rid)[next(iter(s.normal(rid)))] == payload(0, 0)
    rn.settle(6.0)  # past the rendezvous timeout: nothing fires any more
    assert s.failed(rid) is None


def test_a_route_that_does_not_have_it_yet_holds_too() -> None:
    """The publisher of the namespace answers DOES_NOT_EXIST: the SUBSCRIBE stays held;
    when the publisher later announces again (a new PUBLISH_NAMESPACE), it is served."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    s = rn.add_subscriber(relay)
    rid = held_subscribe(s, track("soon"), 300)
    rn.settle(0.1)
    assert s.failed(rid) is None
    rn.run_until(lambda: s.failed(rid) is not None, max_time=2.0)
    assert s.failed(rid).code == RequestErrorCode.TIMEOUT
    assert pub.requests  # the route was asked


def test_held_subscribes_are_bounded() -> None:
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(max_rendezvous=2))
    s = rn.add_subscriber(relay)
    rids = [held_subscribe(s, track(f"t{i}"), 10_000) for i in range(3)]
    rn.settle(0.1)
    assert [s.failed(r) is not None for r in rids] == [False, False, True]
    assert s.failed(rids[2]).code == RequestErrorCode.DOES_NOT_EXIST
    s.session.cancel(rids[0], now=rn.now)  # a cancelled one frees its place
    rn.net.poke(s.session)
    rn.settle(0.1)
    r4 = held_subscribe(s, track("t4"), 10_000)
    rn.settle(0.1)
    assert s.failed(r4) is None
    assert relay.config.rendezvous_cap == 30.0
