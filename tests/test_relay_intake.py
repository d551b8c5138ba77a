"""When the relay holds its intake from publishers (``kvcs_core.relay.intake``, #11).

The gate alone: it holds at the hold mark of evicted bytes that sessions still hold,
opens at half of it, stays held while sessions drain, gives up after ``stall`` seconds
without anything draining, and opens again once the bytes fall. Through a relay on the
loopback: a slow subscriber behind a small cache makes the relay name the publisher's
session in ``Relay.intake_held`` (the loopback has no flow control to hold, so the
objects keep coming and the decision is what is checked), and once the subscriber has
drained, intake is open again; ``RelayStats`` says so. A subscriber that stops reading
does not hold the publisher for longer than ``intake_stall``. A session that closes lets
go of what its queues held at once, so a gone subscriber holds neither memory nor the
publisher. A group evicted again and again while it grows counts once against a
subscriber's queue limit, not once per eviction.
"""

from __future__ import annotations

from typing import Any

import pytest
from relay_net import RelayNet, produce, track

from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import RelayConfig
from kvcs_core.relay.intake import IntakeGate, IntakeState
from kvcs_core.wire.codes import PublishDoneCode

SIZE = 2048


def test_the_gate_holds_at_the_mark_and_opens_at_half() -> None:
    gate = IntakeGate(1000, stall=1.0, poll=0.01)
    assert gate.deadline(0.0) is None
    assert not gate.update(999, 0, 0.0) and gate.state is IntakeState.OPEN
    assert gate.update(1000, 0, 0.1) and gate.held and gate.holds == 1
    assert gate.deadline(0.1) == pytest.approx(0.11)
    assert not gate.update(700, 300, 0.5)  # draining: still held
    assert not gate.update(700, 300, 1.4)  # nothing drained for 0.9 s: still held
    assert gate.update(500, 500, 1.5) and gate.state is IntakeState.OPEN
    assert gate.held_seconds == pytest.approx(1.4)
    assert gate.deadline(1.5) is None and gate.given_up == 0


def test_a_stalled_hold_is_given_up_until_the_bytes_fall() -> None:
    gate = IntakeGate(1000, stall=1.0, poll=0.01)
    gate.update(1200, 0, 0.0)
    assert not gate.update(1500, 0, 0.99)  # more arrived, nothing drained
    assert gate.update(1500, 0, 1.0) and gate.state is IntakeState.GIVEN_UP
    assert gate.given_up == 1 and gate.deadline(1.0) is None
    assert not gate.update(4000, 0, 5.0)  # given up: open whatever comes
    assert not gate.update(600, 3400, 6.0)
    assert gate.update(500, 3500, 6.1) and gate.state is IntakeState.OPEN
    assert gate.update(1000, 3500, 7.0) and gate.held and gate.holds == 2


def test_the_gate_refuses_nonsense() -> None:
    for args in ((0, 1.0, 0.1), (10, 0.0, 0.1), (10, 1.0, 0.0)):
        with pytest.raises(ValueError):
            IntakeGate(*args)


def _slow_subscriber(
    *, bandwidth: float, stall: float = 30.0, groups: int = 8
) -> tuple[RelayNet, Any, Any, int, list[bool], Any]:
    """A publisher -> relay (cache of two groups) -> one slow subscriber; ``held`` records,
    after every step, whether the publisher's session is named held."""
    rn = RelayNet()
    relay = rn.add_relay(
        RelayConfig(
            cache_budget_bytes=2 * 8 * (SIZE + 1024) + 8192,
            intake_hold_bytes=4 * SIZE,
            intake_stall=stall,
        )
    )
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("t")))
    slow = rn.add_subscriber(
        relay,
        relay_side=SessionConfig(role=Role.SERVER, max_queued_bytes_per_subscription=1 << 20),
        bandwidth=bandwidth,
    )
    rid = slow.subscribe_all(store.name)
    rn.settle(0.05)
    upstream = relay.sessions[0]  # the publisher's link, added first
    down = relay.sessions[1]  # the slow subscriber's, on the relay
    held: list[bool] = []
    rn.net.on_event(lambda _m, _e: held.append(upstream in relay.intake_held))
    for g in range(groups):
        produce(store, g, 8, size=SIZE)
    rn.settle(0.01)
    pub.end_track(store, rn.now)
    return rn, relay, slow, rid, held, down


def test_a_slow_subscriber_behind_a_full_cache_holds_the_publisher() -> None:
    rn, relay, slow, rid, held, _down = _slow_subscriber(bandwidth=20_000)
    rn.run_until(lambda: slow.done(rid) is not None, max_time=60)
    assert any(held), "the relay never held its intake"
    st = relay.stats()
    assert st.intake_holds >= 1 and st.intake_given_up == 0
    assert st.intake_held_seconds > 0
    assert slow.done(rid).status == PublishDoneCode.TRACK_ENDED
    rn.settle(0.1)
    st = relay.stats()
    assert not st.intake_held and relay.intake_held == frozenset()
    assert st.evicted_held_bytes == 0


def test_a_subscriber_that_stops_reading_holds_the_publisher_at_most_intake_stall() -> None:
    rn, relay, slow, _rid, held, _down = _slow_subscriber(bandwidth=20_000, stall=0.5)
    link = rn.net.link_of(rn.machine(slow.session))
    rn.run_until(lambda: any(held), max_time=10)
    link.set_bandwidth(1.0)  # it stopped reading
    rn.settle(2.0)
    st = relay.stats()
    assert st.intake_given_up >= 1, st
    assert not st.intake_held
    assert st.intake_held_seconds < 2.0


def test_a_closed_subscriber_lets_go_of_its_queues_and_the_publisher() -> None:
    rn, relay, slow, _rid, held, down = _slow_subscriber(bandwidth=20_000)
    rn.run_until(lambda: any(held), max_time=10)
    assert relay.stats().evicted_held_bytes > 0
    rn.cut(slow.session)
    rn.settle(0.1)
    st = relay.stats()
    assert st.evicted_held_bytes == 0, st
    assert not st.intake_held
    assert down.publisher.queued_bytes == 0


def test_a_group_evicted_as_it_grows_counts_once_against_the_queue_limit() -> None:
    """A subscriber that is behind on one large group (evicted again with every object
    that arrives, while the cache holds only a part of it) is charged what it queues of
    the group, not that once per eviction: with a limit above the group it is served."""
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(cache_budget_bytes=6 * (SIZE + 1024) + 8192))
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("big")))
    slow = rn.add_subscriber(
        relay,
        relay_side=SessionConfig(role=Role.SERVER, max_queued_bytes_per_subscription=80 * SIZE),
        bandwidth=50_000,
    )
    rid = slow.subscribe_all(store.name)
    rn.settle(0.05)
    produce(store, 0, 60, size=SIZE)  # one group of 60 objects, ten times the cache
    rn.settle(0.01)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: slow.done(rid) is not None, max_time=60)
    assert slow.done(rid).status == PublishDoneCode.TRACK_ENDED
    assert len(slow.normal(rid)) == 60


def test_what_a_stalled_subscriber_holds_beyond_a_full_cache_is_what_the_gate_sees() -> None:
    """Once pinned objects fill the budget, every new object is evicted the step it arrives
    and forwarded without being kept: a stalled subscriber's queue grows there, not in the
    evicted count (which stops at about the budget). The gate sees both together, so it
    holds for as long as the subscriber's queue beyond the cache is above the resume mark,
    and opens only once it has drained below it."""
    rn, relay, slow, rid, _held, down = _slow_subscriber(bandwidth=20_000, stall=1000, groups=40)
    link = rn.net.link_of(rn.machine(slow.session))
    budget = relay.config.cache_budget_bytes
    resume = relay.config.intake_hold_bytes // 2
    link.set_bandwidth(1000)  # it all but stopped reading: what it was sent stays queued
    rn.settle(1.0)
    st = relay.stats()
    queued = down.publisher.queued_bytes
    assert queued > 4 * budget, (queued, budget)  # most of it beyond the cache
    assert st.evicted_held_bytes < budget  # the evicted part alone stops at the budget
    assert st.held_outside_bytes >= queued - budget, (st, queued)
    assert st.intake_held

    openings: list[int] = []  # the subscriber's queue beyond the cache when intake opened
    was_held = [True]

    def look(_m: Any, _e: Any) -> None:
        held_now = relay.stats().intake_held
        if was_held[0] and not held_now:
            openings.append(down.publisher.queued_bytes - budget)
        was_held[0] = held_now

    rn.net.on_event(look)
    link.set_bandwidth(20_000)  # it reads again, slowly
    rn.run_until(lambda: slow.done(rid) is not None, max_time=120)
    assert slow.done(rid).status == PublishDoneCode.TRACK_ENDED
    assert openings, "intake never opened again"
    assert max(openings) <= resume, (openings, resume)
    rn.settle(0.1)
    st = relay.stats()
    assert st.held_outside_bytes == 0 and st.transit_bytes == 0, st


def test_a_hold_names_the_feeding_session_for_as_long_as_it_lasts() -> None:
    """While the gate holds, every input (the objects a transport still delivers within
    the credit it had granted, as aioquic does) leaves the publisher's session named in
    ``Relay.intake_held``, which it feeds for the whole hold: a hold is released only
    when the gate opens."""
    rn = RelayNet()
    relay = rn.add_relay(
        RelayConfig(
            cache_budget_bytes=2 * 8 * (SIZE + 1024) + 8192,
            intake_hold_bytes=4 * SIZE,
            intake_stall=30.0,
        )
    )
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("t")))
    slow = rn.add_subscriber(
        relay,
        relay_side=SessionConfig(role=Role.SERVER, max_queued_bytes_per_subscription=1 << 20),
        bandwidth=20_000,
    )
    rid = slow.subscribe_all(store.name)
    rn.settle(0.05)
    upstream = relay.sessions[0]
    steps: list[tuple[bool, bool]] = []  # (the gate holds, the publisher is named held)
    rn.net.on_event(
        lambda _m, _e: steps.append((relay.stats().intake_held, upstream in relay.intake_held))
    )
    for g in range(8):
        produce(store, g, 8, size=SIZE)
    # the track stays open (its subscription feeds the relay) until the hold ended
    rn.run_until(lambda: relay.stats().intake_holds >= 1 and not relay.stats().intake_held)
    during = [named for held, named in steps if held]
    assert len(during) > 10, steps  # the objects kept coming while held
    assert all(during), f"released while held in {during.count(False)} of {len(during)} steps"
    assert not any(named for held, named in steps if not held)
    pub.end_track(store, rn.now)
    rn.run_until(lambda: slow.done(rid) is not None, max_time=60)
    assert slow.done(rid).status == PublishDoneCode.TRACK_ENDED
    assert len(slow.normal(rid)) == 64
