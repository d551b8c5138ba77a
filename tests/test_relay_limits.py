"""Issue 10, finding 8: phantom tracks, the Request ID record, request-rate limits.

A SUBSCRIBE for a track nobody publishes leaves no track record behind; the record of
the peer's Request IDs stays bounded when a peer skips IDs; one session opening
requests faster than ``RelayConfig.request_rate`` gets REQUEST_ERROR EXCESSIVE_LOAD
with a Retry Interval, and nobody else is affected.
"""

from __future__ import annotations

from relay_net import NS, RelayNet, produce, track

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.requests import RequestIdTracker
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import RelayConfig
from kvcs_core.wire.codes import RequestErrorCode
from kvcs_core.wire.names import FullTrackName


def _answers(sub: object, rids: set[int]) -> dict[int, ev.RequestFailed]:
    return {
        e.request_id: e
        for e in sub.events(ev.RequestFailed)  # type: ignore[attr-defined]
        if e.request_id in rids
    }


def test_subscribes_for_missing_tracks_leave_no_track_record() -> None:
    """600 SUBSCRIBEs for missing tracks with 4 kB names: each is refused DOES_NOT_EXIST
    and the relay keeps no record of any (6,008 records were left before)."""
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(request_rate=0))  # no rate limit here
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("real")))
    s = rn.add_subscriber(relay)
    real = s.subscribe_all(store.name)
    rn.run_until(lambda: s.accepted(real))
    rids: set[int] = set()
    for i in range(600):
        name = FullTrackName(NS, b"%05d" % i + b"x" * 4000)
        rids.add(s.session.subscribe(name, now=rn.now))
        if i % 50 == 49:
            rn.net.poke(s.session)
            rn.settle(0.01)
    rn.net.poke(s.session)
    rn.run_until(lambda: len(_answers(s, rids)) == len(rids))
    assert {e.code for e in _answers(s, rids).values()} == {RequestErrorCode.DOES_NOT_EXIST}
    assert relay.tracks() == (store.name,)  # only the track that is published and served
    produce(store, 0, 2)
    rn.run_until(lambda: len(s.normal(real)) == 2)  # the real track is unaffected


def test_a_track_left_by_everyone_with_nothing_cached_is_forgotten() -> None:
    rn = RelayNet()
    relay = rn.add_relay()
    rn.add_publisher(relay)
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(track("nobody"))
    rn.run_until(lambda: s.failed(rid) is not None)
    assert relay.tracks() == ()
    assert relay.track_stats(track("nobody")) is None


def test_request_id_record_is_bounded_when_a_peer_skips_ids() -> None:
    """A peer using IDs 0, 4, 8, ... (never 2) made the record grow for ever; it now
    stays at its limit, and the IDs skipped below count as used (Ambiguity A28)."""
    ids = RequestIdTracker(parity=0, limit=64)
    assert ids.accept(0)
    for rid in range(4, 400_000, 4):
        assert ids.accept(rid)
        assert ids.window <= 64
    assert not ids.accept(2)  # skipped long ago: counts as used
    assert not ids.accept(399_996)  # reused
    assert ids.accept(400_000)
    in_order = RequestIdTracker(parity=1, limit=4)
    for rid in range(1, 1001, 2):
        assert in_order.accept(rid)
    assert in_order.window == 0
    out_of_order = RequestIdTracker(parity=0, limit=8)
    assert all(out_of_order.accept(r) for r in (6, 4, 2, 0, 8))
    assert out_of_order.window == 0


def test_request_rate_limit_refuses_with_excessive_load_and_a_retry_interval() -> None:
    """One session opening 300 requests at once against a burst of 100: the excess is
    refused EXCESSIVE_LOAD with a Retry Interval; later, the bucket has refilled; another
    session is unaffected."""
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(request_rate=50.0, request_burst=100))
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("t")))
    produce(store, 0, 1)
    greedy = rn.add_subscriber(relay)
    polite = rn.add_subscriber(relay)
    rids = {greedy.session.track_status(store.name, now=rn.now) for _ in range(300)}
    rn.net.poke(greedy.session)
    rn.settle(0.05)
    refused = _answers(greedy, rids)
    assert len(refused) >= 190  # 300 - 100 (burst) - 0.05 s x 50/s refill
    assert {e.code for e in refused.values()} == {RequestErrorCode.EXCESSIVE_LOAD}
    assert all((e.retry_interval_ms or 0) > 0 for e in refused.values())
    ok = polite.subscribe_all(store.name)
    rn.run_until(lambda: polite.accepted(ok))
    rn.settle(1.0)  # 50 tokens back
    again = greedy.subscribe_all(store.name)
    rn.run_until(lambda: greedy.accepted(again))
    assert relay.stats().refused_for_rate == len(refused)
