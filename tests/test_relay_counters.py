"""The relay core's operator counters (``Relay.stats()``), over the loopback.

What ``kvcs relay --metrics`` and the ``stats`` lines expose comes from these pure
getters: objects and payload bytes sent (counted by each session's publisher,
kept when the session is gone), objects received, sessions added, cached
objects, evicted groups and refused requests by error code. Each is checked
against what the other end of the loopback counted itself.
"""

from __future__ import annotations

from relay_net import RelayNet, produce, track
from test_relay import expected, fan_out, one_track

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import RelayConfig
from kvcs_core.wire.codes import ObjectStatus, RequestErrorCode


def test_objects_and_bytes_in_and_out_match_both_ends() -> None:
    rn, relay, pub, joined = fan_out(4)
    received = [e for s, _rid in joined for e in s.events(ev.ObjectReceived)]
    st = relay.stats()
    # every object the subscribers received was handed over once by the relay
    assert st.objects_sent == len(received)
    assert st.bytes_sent == sum(len(e.payload) for e in received)
    assert st.bytes_sent >= len(joined) * sum(len(v) for v in expected().values())
    # what came in is exactly what the publisher's session sent
    assert st.upstream_objects_received == pub.session.publisher.objects_sent
    assert st.upstream_bytes_received == pub.session.publisher.payload_bytes_sent
    assert st.sessions_added == 1 + len(joined) == st.sessions
    assert st.upstream_sessions == 1  # the publisher's link is the relay's upstream
    store_objects = len(relay._tracks[track("video")].entry.store)
    assert st.cached_objects == store_objects > 0
    # a subscriber leaves: the totals keep what its session sent
    s, _ = joined[0]
    rn.cut(s.session)
    rn.settle(0.05)
    after = relay.stats()
    assert after.sessions == st.sessions - 1 and after.sessions_added == st.sessions_added
    assert after.objects_sent == st.objects_sent and after.bytes_sent == st.bytes_sent


def test_refusals_are_counted_by_error_code() -> None:
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(request_rate=50.0, request_burst=10))
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("t")))
    produce(store, 0, 1)
    s = rn.add_subscriber(relay)
    rids = [s.session.track_status(store.name, now=rn.now) for _ in range(30)]
    rn.net.poke(s.session)
    rn.settle(0.05)
    failed = [e for e in s.events(ev.RequestFailed) if e.request_id in rids]
    by_code = {
        code.name: sum(1 for e in failed if e.code == code)
        for code in {RequestErrorCode(e.code) for e in failed}
    }
    st = relay.stats()
    assert by_code.get("EXCESSIVE_LOAD", 0) == st.refused_for_rate > 0
    assert dict(st.refused) == by_code
    assert [name for name, _ in st.refused] == sorted(by_code)


def test_evicted_groups_are_counted() -> None:
    _rn, relay, _pub, store, _s, _rid = one_track(
        10, 4, config=RelayConfig(cache_budget_bytes=36_000)
    )
    st = relay.stats()
    per_track = relay.track_stats(store.name)
    assert per_track is not None
    assert st.evicted_groups == per_track.evicted_groups > 0
    assert st.cached_objects == per_track.cached_objects
    assert st.cached_objects < 10 * 4  # some groups are gone


def test_status_objects_count_as_objects() -> None:
    _rn, relay, _pub, joined = fan_out(1)
    ((s, _rid),) = joined
    statuses = [e for e in s.events(ev.ObjectReceived) if e.status is not ObjectStatus.NORMAL]
    assert statuses  # End of Group / End of Track
    assert relay.stats().objects_sent == len(s.events(ev.ObjectReceived))
