"""The relay's work and memory are bounded by what it holds, never by a peer's numbers.

Issue 10, findings 3 and 5: a Group ID of 2^62 must not make anything iterate up to it;
the cache budget counts everything the cache holds (payload buffers, Object Properties,
per-object overhead) and holds after every input, also when one object or one group is
larger than the budget.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from relay_net import RelayNet, payload, track

from kvcs_core.moqt.events import Delivery, ObjectReceived
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import Relay, RelayConfig
from kvcs_core.relay.cache import GROUP_OVERHEAD, Cache, GroupSet
from kvcs_core.relay.core import next_after
from kvcs_core.wire.codes import MAX_VI64, ObjectStatus
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import Location

G62 = 1 << 62


@pytest.fixture
def guard() -> Iterator[None]:
    """Ends a runaway loop: SIGALRM raises in the main thread after 20 s of wall time
    (a pure-Python loop checks for signals between bytecodes), so a regression fails
    instead of hanging the suite."""

    def _expired(_sig: int, _frame: Any) -> None:
        raise TimeoutError("the relay did unbounded work")

    old = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def watch(relay: Relay) -> list[int]:
    """Check the budget after every input the relay gets; returns the totals seen."""
    seen: list[int] = []
    budget = relay.config.cache_budget_bytes
    on_event, on_timer = relay.handle_session_event, relay.handle_timer

    def checked_event(session: Any, e: Any, now: float) -> bool:
        out = on_event(session, e, now)
        seen.append(relay.cache_bytes)
        assert relay.cache_bytes <= budget, f"{relay.cache_bytes} > {budget} after {e!r}"
        return out

    def checked_timer(now: float) -> None:
        on_timer(now)
        seen.append(relay.cache_bytes)
        assert relay.cache_bytes <= budget

    relay.handle_session_event = checked_event  # type: ignore[method-assign]
    relay.handle_timer = checked_timer  # type: ignore[method-assign]
    return seen


# --- finding 3: no loop up to a peer-chosen Group ID ----------------------------------------


def test_fill_across_group_2_62_after_eviction_is_bounded(guard: None) -> None:
    """Groups 0, 2^62, 2^62+1, 2^62+2 of 400 kB under a 1 MiB budget, then a SUBSCRIBE
    with a fill from {0,0}: the evicted groups are re-fetched without iterating over the
    2^62 Group IDs between them (this hung the relay at 100% CPU)."""
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(cache_budget_bytes=1 << 20))
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("far")))
    first = rn.add_subscriber(relay)
    r1 = first.subscribe_all(store.name)
    rn.run_until(lambda: first.accepted(r1))
    groups = [0, G62, G62 + 1, G62 + 2]
    for g in groups:
        store.append(g, 0, payload(g, 0, 400_000))
        store.append(g, 1, status=ObjectStatus.END_OF_GROUP)
        rn.settle(0.01)
    rn.run_until(lambda: len(first.normal(r1)) == 4)
    ts = relay.track_stats(store.name)
    assert ts is not None and ts.evicted_groups > 0  # four 400 kB groups do not fit 1 MiB
    late = rn.add_subscriber(relay)
    r2 = late.subscribe_all(store.name)
    rn.run_until(lambda: late.accepted(r2) and len(late.normal(r2)) == 4)
    got = late.normal(r2)
    assert sorted(loc.group for loc in got) == groups
    assert all(got[loc] == payload(loc.group, 0, 400_000) for loc in got)


def test_group_set_is_bounded_and_never_iterates_ids(guard: None) -> None:
    s = GroupSet(limit=8)
    for g in range(0, 1000, 2):  # 500 separate groups: merged into at most 8 intervals
        s.add(g)
    assert len(s) <= 8
    assert all(g in s for g in range(0, 1000, 2))  # never forgets an evicted group
    s.add(G62)
    s.add_range(G62 + 10, (1 << 64) - 1)
    assert s.span_within(1, (1 << 64) - 1) is not None
    s.discard_range(0, (1 << 64) - 1)
    assert not s
    assert s.complement_within(0, (1 << 64) - 1) == [(0, (1 << 64) - 1)]


# --- finding 5: the budget counts everything and holds at all times -------------------------


def test_object_properties_are_counted() -> None:
    """Objects with 60 kB of properties and empty payloads: the accounted bytes include
    the properties (they were "cache 4 bytes" before), and stay within the budget."""
    budget = 4 << 20
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(cache_budget_bytes=budget))
    seen = watch(relay)
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("props")))
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(store.name)
    rn.run_until(lambda: s.accepted(rid))
    props = (KeyValuePair(0x41, b"p" * 60_000),)
    n = 300  # 18 MB of properties
    for g in range(n):
        store.append(g, 0, b"", properties=props)
        rn.settle(0.001)
    rn.run_until(lambda: len(s.normal(rid)) == n)
    assert max(seen) > 50 * 60_000  # the properties are what is held
    assert relay.stats().evicted_bytes > 0
    assert relay.cache_bytes <= budget


def test_a_group_larger_than_the_budget_is_forwarded_not_kept() -> None:
    """A 4 MB group under a 1 MiB budget (a 60 MB group stayed cached under 1 MiB): live
    subscribers get all of it, the cache never holds more than its budget, and an object
    larger than the whole budget is not kept at all."""
    budget = 1 << 20
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(cache_budget_bytes=budget))
    watch(relay)
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("big")))
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(store.name)
    rn.run_until(lambda: s.accepted(rid))
    for o in range(16):
        store.append(0, o, payload(0, o, 256_000))
        rn.settle(0.002)
    store.append(0, 16, payload(0, 16, 2 * budget))  # alone larger than the budget
    rn.run_until(lambda: len(s.normal(rid)) == 17)
    got = s.normal(rid)
    assert all(got[loc] == payload(0, loc.object, len(got[loc])) for loc in got)
    entry = relay._cache.get(store.name)
    assert entry is not None and entry.store.total_bytes < budget
    assert relay._cache.not_kept >= 1
    rn.settle(0.05)
    assert relay.cache_bytes <= budget


def test_evicted_objects_still_being_sent_are_counted_until_released() -> None:
    """Eviction does not free what a session still holds: a pinned object stays in the
    accounting until its last reference goes (cache docstring)."""
    store = TrackStore(track("pin"))
    for o in range(4):
        store.append(0, o, payload(0, o, 100_000))
    cache = Cache(budget=10_000_000, evict_to=0.9)
    entry = cache.add(store)  # accounted from the store's objects
    held = cache.total_bytes
    assert held >= 400_000
    snapshot = list(store.objects_in(Location(0, 0)))  # what a session's fill holds
    cache._evict_group(entry, 0, keep=None)
    assert store.total_bytes == 0  # the index is gone ...
    assert cache.total_bytes == held - GROUP_OVERHEAD  # ... the objects are still held
    assert cache.pinned_bytes > 0
    del snapshot
    assert cache.pinned_bytes == 0 and cache.buffer_bytes == 0
    assert cache.total_bytes == entry.cost


# --- found by fuzz/fuzz_relay.py ----------------------------------------------------------


def test_an_object_below_its_subgroups_last_one_is_not_sent_live() -> None:
    """Objects of one subgroup reaching a store out of order (Object 5, then 2): the live
    subgroup stream cannot go back (d21 11.3.1); the session used to raise EncodeError
    (negative Object ID delta) out of ``poll_data``. Now the late one is not sent live."""
    rn = RelayNet()
    relay = rn.add_relay()
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("order")))
    s = rn.add_subscriber(relay)
    rid = s.subscribe_all(store.name)
    rn.run_until(lambda: s.accepted(rid))
    store.append(0, 5, payload(0, 5))
    store.append(0, 2, payload(0, 2))
    store.append(0, 6, payload(0, 6))
    rn.settle(0.05)
    got = s.normal(rid)
    assert Location(0, 5) in got and Location(0, 6) in got
    assert all(got[loc] == payload(loc.group, loc.object) for loc in got)


# --- in transit: paced re-fetches for late joiners ------------------------------------------


def _late_joiner(
    budget: int, transit: int, groups: int, size: int, joiners: int = 1
) -> tuple[Relay, list[int], list[dict[Location, bytes]]]:
    """``groups`` groups of one ``size`` object through a relay with ``budget``, then
    ``joiners`` late joiners on a slow link (8 MB/s, slower than the upstream): the
    relay's in-transit bytes (``RelayStats.transit_bytes``) after every input, and what
    each joiner got."""
    rn = RelayNet()
    relay = rn.add_relay(RelayConfig(cache_budget_bytes=budget, max_transit_bytes=transit))
    watch(relay)
    seen: list[int] = []
    on_event, on_timer = relay.handle_session_event, relay.handle_timer

    def checked_event(session: Any, e: Any, now: float) -> bool:
        out = on_event(session, e, now)
        seen.append(relay.stats().transit_bytes)
        return out

    def checked_timer(now: float) -> None:
        on_timer(now)
        seen.append(relay.stats().transit_bytes)

    relay.handle_session_event = checked_event  # type: ignore[method-assign]
    relay.handle_timer = checked_timer  # type: ignore[method-assign]
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("paced")))
    first = rn.add_subscriber(relay)
    r1 = first.subscribe_all(store.name)
    rn.run_until(lambda: first.accepted(r1))
    for g in range(groups):
        store.append(g, 0, payload(g, 0, size))
        store.append(g, 1, status=ObjectStatus.END_OF_GROUP)
        rn.settle(0.002)
    rn.run_until(lambda: len(first.normal(r1)) == groups)
    ts = relay.track_stats(store.name)
    assert ts is not None and ts.evicted_groups > groups // 2  # the budget was binding
    late = [rn.add_subscriber(relay, bandwidth=8e6) for _ in range(joiners)]
    rids = [s.subscribe_all(store.name) for s in late]
    rn.run_until(
        lambda: all(len(s.normal(r)) == groups for s, r in zip(late, rids, strict=True)),
        max_time=60,
    )
    return relay, seen, [s.normal(r) for s, r in zip(late, rids, strict=True)]


def test_refetches_for_a_late_joiner_are_paced_by_the_transit_allowance() -> None:
    """32 groups of 100 kB under a 1 MiB budget, a late joiner on a slow link: its evicted
    groups come back paced, never more than ``max_transit_bytes`` (plus one group) in
    transit at once (the whole evicted range was fetched at once, over 2 MB queued for the
    slow joiner), and it still gets every object once, bit-identical."""
    allowance, size, groups = 256_000, 100_000, 32
    relay, seen, (got,) = _late_joiner(1 << 20, allowance, groups, size)
    assert sorted(loc.group for loc in got) == list(range(groups))
    assert all(got[loc] == payload(loc.group, 0, size) for loc in got)
    assert max(seen) > 0  # restores did travel
    assert max(seen) <= allowance + size + 4096, max(seen)
    stats = relay.stats()
    assert stats.refetch_bytes_received >= (groups // 2) * size
    assert stats.transit_bytes == 0


def test_an_object_larger_than_the_transit_allowance_is_refetched_one_at_a_time() -> None:
    """Objects of 600 kB with a 256 kB allowance: each still goes through, one group at a
    time (never two in transit at once)."""
    size, groups = 600_000, 8
    _relay, seen, (got,) = _late_joiner(2 << 20, 256_000, groups, size)
    assert sorted(loc.group for loc in got) == list(range(groups))
    assert all(got[loc] == payload(loc.group, 0, size) for loc in got)
    assert 0 < max(seen) <= size + 4096, max(seen)


def test_late_joiners_share_the_refetches() -> None:
    """Three late joiners lacking the same evicted groups: one re-fetch serves them all
    (the upstream sends each evicted group about once, not once per joiner)."""
    size, groups = 100_000, 32
    relay, seen, gots = _late_joiner(1 << 20, 256_000, groups, size, joiners=3)
    for got in gots:
        assert sorted(loc.group for loc in got) == list(range(groups))
        assert all(got[loc] == payload(loc.group, 0, size) for loc in got)
    assert max(seen) <= 256_000 + size + 4096
    assert relay.stats().refetch_bytes_received <= 1.5 * groups * size


def test_a_stalled_late_joiner_holds_back_no_other() -> None:
    """A late joiner that stops reading (a 2 kB/s link) holds the restores it was sent: the
    transit allowance stays full. Another late joiner still gets every object, because
    after ``transit_stall`` with nothing draining the relay asks for one more group."""
    size, groups = 100_000, 24
    rn = RelayNet()
    relay = rn.add_relay(
        RelayConfig(cache_budget_bytes=1 << 20, max_transit_bytes=256_000, transit_stall=0.05)
    )
    pub = rn.add_publisher(relay)
    store = pub.serve(TrackStore(track("stall")))
    first = rn.add_subscriber(relay)
    r1 = first.subscribe_all(store.name)
    rn.run_until(lambda: first.accepted(r1))
    for g in range(groups):
        store.append(g, 0, payload(g, 0, size))
        store.append(g, 1, status=ObjectStatus.END_OF_GROUP)
        rn.settle(0.002)
    rn.run_until(lambda: len(first.normal(r1)) == groups)
    stalled = rn.add_subscriber(relay, bandwidth=2e3)
    rs = stalled.subscribe_all(store.name)
    rn.run_until(lambda: relay.stats().transit_bytes > 0)
    late = rn.add_subscriber(relay, bandwidth=8e6)
    r2 = late.subscribe_all(store.name)
    rn.run_until(lambda: len(late.normal(r2)) == groups, max_time=30)
    got = late.normal(r2)
    assert all(got[loc] == payload(loc.group, 0, size) for loc in got)
    assert len(stalled.normal(rs)) < groups  # it really stopped reading


def test_nothing_follows_the_last_location() -> None:
    """A peer may publish at {2^64-1, 2^64-1}; the location after it does not exist
    (its Group ID + 1 is no vi64). The relay asked for it when it subscribed upstream
    again with a fill from "right after what it caches" and raised EncodeError out of
    ``handle_session_event`` (found by the fuzz campaign; its input is in the relay
    corpus as ``regress-last-location-refill.bin``, which ``test_fuzz_smoke`` runs)."""
    assert next_after(Location(3, 4)) == Location(3, 5)
    assert next_after(Location(3, MAX_VI64)) == Location(4, 0)
    assert next_after(Location(MAX_VI64, MAX_VI64 - 1)) == Location(MAX_VI64, MAX_VI64)
    assert next_after(Location(MAX_VI64, MAX_VI64)) is None


def test_the_cache_keeps_payloads_in_buffers_of_their_own() -> None:
    """A received payload that is a view into a larger chunk is kept as a copy, so the
    chunk is not pinned while the object is cached; a view spanning its whole buffer is
    kept as it is (cache docstring, "Payload buffers")."""
    cache = Cache(budget=10_000_000, evict_to=0.9)
    entry = cache.add(TrackStore(track("own")))
    chunk = bytes(range(256)) * 64  # one transport chunk holding two payloads and more
    whole = bytes(5000)

    def received(obj: int, view: memoryview) -> ObjectReceived:
        return ObjectReceived.trusted(
            1, Delivery.SUBSCRIPTION, Location(0, obj), 0, 128, ObjectStatus.NORMAL, (), view, 1
        )

    shared = memoryview(chunk)
    for obj, view in enumerate((shared[100:4100], shared[4100:9000], memoryview(whole))):
        assert cache.append(entry, received(obj, view)) is not None
    kept = [entry.store.get(Location(0, o)) for o in range(3)]
    assert all(o is not None for o in kept)
    first, second, third = (o.payload for o in kept if o is not None)
    assert bytes(first) == chunk[100:4100] and bytes(second) == chunk[4100:9000]
    assert first.obj is not chunk and second.obj is not chunk
    assert len(first.obj) == 4000 and len(second.obj) == 4900  # type: ignore[arg-type]
    assert third.obj is whole  # already its own buffer: no copy
    assert cache.buffer_bytes == 4000 + 4900 + 5000
