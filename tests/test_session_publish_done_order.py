"""PUBLISH_DONE that overtakes the subscription's data streams (d21 9.9, wire reference 4.5).

Over QUIC the request stream and the data streams are independent: the control
message can arrive while subgroup streams are still in flight. The session keeps
receiving until Stream Count streams have ended, and only then reports
``PublishDoneReceived``, so an application (a KVCS consumer, a relay) that treats
the event as "nothing more comes" loses nothing. On the loopback the control plane
is carried free of bandwidth, so a bandwidth-limited link reproduces the overtaking.
"""

from __future__ import annotations

from session_harness import TRACK, World
from session_pair import Pair, fill_store, track

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.moqt.transport_io import StreamData
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, PublishDoneCode


def test_publish_done_reported_after_the_last_object_it_counts() -> None:
    pair = Pair(bandwidth=100_000, latency=0.002)
    store = pair.serve(TrackStore(track("k.raw.s0")))
    rid = pair.cli.subscribe(
        store.name, now=pair.now, location_filter=p.LocationFilter.next_object()
    )
    pair.wait(lambda: pair.events(pair.cli, ev.SubscribeAccepted))
    fill_store(store, range(6), 8, size=4000)  # 192 kB: about 2 s at 100 kB/s
    pair.net.poke(pair.srv)
    pair.srv.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=pair.now)
    pair.wait(lambda: pair.events(pair.cli, ev.PublishDoneReceived), max_time=30)

    log = pair.net.events(pair.cli)
    done_at = next(i for i, e in enumerate(log) if isinstance(e, ev.PublishDoneReceived))
    objects_at = [
        i for i, e in enumerate(log) if isinstance(e, ev.ObjectReceived) and e.request_id == rid
    ]
    assert len(objects_at) == 6 * 8 + 6  # every object and End of Group
    assert max(objects_at) < done_at
    done = log[done_at]
    assert (done.status, done.stream_count) == (PublishDoneCode.TRACK_ENDED, 6)
    # the control message did overtake the data: the publisher sent it before the
    # last stream's bytes left (so the ordering above is the session's doing)
    assert pair.now > 1.5


def test_a_publish_done_long_before_the_data_waits_while_the_data_still_arrives() -> None:
    """#11: aiomoqt's publisher writes a whole track into its QUIC stack at once and sends
    PUBLISH_DONE at once; over a slow path the data takes far longer than the grace to
    arrive. The grace runs from the last byte the subscription's streams delivered, so
    nothing still arriving is cut off (wire reference 4.5: the subscriber keeps state *at
    least* that long)."""
    w = World()
    v = w.pair(bandwidth=50_000.0, latency=0.01)
    w.setup(v)
    rid = v.cli.subscribe(TRACK, now=w.now, location_filter=p.LocationFilter.next_object())
    w.net.poke(v.cli)
    w.net.run_until(lambda: bool(w.events(v.cli, ev.SubscribeAccepted)))
    for o in range(60):  # 240 kB on one subgroup stream: about 5 s at 50 kB/s
        v.store.append(0, o, bytes([o]) * 4000)
    v.store.append(0, 60, status=ObjectStatus.END_OF_GROUP)
    w.net.poke(v.srv)
    w.run(0.2)
    done = m.encode_message(m.PublishDone(PublishDoneCode.TRACK_ENDED, 1, b""))
    v.cli.handle_transport_event(StreamData(stream=v.cli.requests[rid].stream, data=done), w.now)
    w.net.poke(v.cli)
    w.run(8.0)
    objects = w.events(v.cli, ev.ObjectReceived)
    got = sorted(e.location.object for e in objects if e.status is ObjectStatus.NORMAL)
    assert got == list(range(60))  # before: cut off 2 s after PUBLISH_DONE (27 arrived)
    assert len(w.events(v.cli, ev.PublishDoneReceived)) == 1  # once the stream ended
