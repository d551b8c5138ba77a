"""TrackStore: storage, ordering, conflicts and malformed tracks, listeners, eviction."""

from __future__ import annotations

import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.track_store import (
    BeyondEnd,
    ConflictingObject,
    MalformedTrack,
    StoredObject,
    TrackStore,
    as_payload_view,
)
from kvcs_core.wire.codes import MAX_VI64, GroupOrder, ObjectStatus, PropertyType
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

NAME = FullTrackName(TrackNamespace.of("kvcs-1", "scope"), b"k.f16.s0")
EOG = ObjectStatus.END_OF_GROUP
EOT = ObjectStatus.END_OF_TRACK


def store(**kw: object) -> TrackStore:
    return TrackStore(NAME, **kw)  # type: ignore[arg-type]


def locs(objs: object) -> list[tuple[int, int]]:
    return [(o.location.group, o.location.object) for o in objs]  # type: ignore[attr-defined]


# --- basics -----------------------------------------------------------------------


def test_append_returns_stored_object_by_reference() -> None:
    s = store()
    buf = bytearray(b"hello")
    obj = s.append(0, 0, buf)
    assert isinstance(obj, StoredObject)
    assert obj.location == Location(0, 0)
    assert obj.payload.obj is buf  # no copy: a view of the caller's buffer
    assert bytes(obj.payload) == b"hello"
    assert obj.subgroup_id == 0
    assert obj.publisher_priority == 128
    assert obj.status is ObjectStatus.NORMAL
    assert obj.datagram is False
    assert obj.properties == ()
    assert (obj.group_id, obj.object_id, obj.size) == (0, 0, 5)
    assert s.get(Location(0, 0)) is obj
    assert Location(0, 0) in s
    assert Location(0, 1) not in s
    assert "5 bytes" in repr(obj)
    assert len(s) == 1
    assert s.total_bytes == 5


def test_payload_views_are_flat_bytes_without_copy() -> None:
    floats = array.array("f", [1.0, 2.0])
    s = store()
    obj = s.append(0, 0, memoryview(floats))
    assert obj.payload.format == "B"
    assert obj.payload.nbytes == 8
    assert obj.payload.obj is floats
    with pytest.raises(ValueError, match="contiguous"):
        as_payload_view(memoryview(b"abcdef")[::2])


def test_seq_is_arrival_order_and_largest_counts_status_objects() -> None:
    s = store()
    assert s.largest is None
    a = s.append(1, 0, b"a")
    b = s.append(0, 5, b"b")
    assert (a.seq, b.seq) == (0, 1)
    assert s.largest == Location(1, 0)
    c = s.append(1, 1, status=EOG)
    assert c.seq == 2
    assert s.largest == Location(1, 1)
    assert s.group_ids() == (0, 1)


def test_default_priority_and_explicit_priority() -> None:
    s = store(default_publisher_priority=7)
    assert s.append(0, 0, b"x").publisher_priority == 7
    assert s.append(1, 0, b"x", publisher_priority=0).publisher_priority == 0
    with pytest.raises(ValueError):
        s.append(2, 0, b"x", publisher_priority=256)
    with pytest.raises(ValueError):
        store(default_publisher_priority=-1)


def test_track_properties_must_agree_with_arguments() -> None:
    prio = KeyValuePair(PropertyType.DEFAULT_PUBLISHER_PRIORITY, 64)
    order = KeyValuePair(PropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, 2)
    s = store(
        default_publisher_priority=64,
        group_order=GroupOrder.DESCENDING,
        track_properties=[prio, order],
    )
    assert s.track_properties == (prio, order)
    assert s.group_order is GroupOrder.DESCENDING
    with pytest.raises(ValueError, match="PRIORITY"):
        store(track_properties=[prio])
    with pytest.raises(ValueError, match="GROUP_ORDER"):
        store(default_publisher_priority=64, track_properties=[prio, order])


def test_invalid_arguments() -> None:
    s = store()
    with pytest.raises(ValueError):
        s.append(-1, 0, b"x")
    with pytest.raises(ValueError):
        s.append(0, MAX_VI64 + 1, b"x")
    with pytest.raises(ValueError, match="no payload"):
        s.append(0, 0, b"x", status=EOG)
    with pytest.raises(ValueError, match="no properties"):
        s.append(0, 0, status=EOT, properties=[KeyValuePair(2, 1)])
    with pytest.raises(ValueError, match="Subgroup ID"):
        s.append(0, 0, b"x", datagram=True, subgroup_id=3)
    with pytest.raises(ValueError):
        s.append(0, 0, b"x", subgroup_id=None)
    with pytest.raises(ValueError):
        s.append(0, 0, b"x", properties=["nope"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        s.append(0, 0, b"x", status=7)  # type: ignore[arg-type]
    assert len(s) == 0


def test_datagram_objects_have_no_subgroup() -> None:
    s = store()
    obj = s.append(0, 0, b"x", datagram=True)
    assert obj.subgroup_id is None
    assert obj.datagram
    assert s.append(0, 1, b"y", datagram=True, subgroup_id=None).subgroup_id is None


# --- duplicates and conflicts -------------------------------------------------------------


def test_identical_reappend_is_a_noop() -> None:
    s = store()
    seen: list[StoredObject] = []
    s.subscribe_listener(seen.append)
    first = s.append(0, 0, b"abc", publisher_priority=3)
    again = s.append(0, 0, bytearray(b"abc"), publisher_priority=3)
    assert again is first
    assert seen == [first]
    assert len(s) == 1
    assert s.total_bytes == 3


@pytest.mark.parametrize(
    ("kw", "what"),
    [
        ({"payload": b"abd"}, "payload"),
        ({"subgroup_id": 1}, "Subgroup ID"),
        ({"publisher_priority": 4}, "priority"),
        ({"datagram": True, "subgroup_id": None}, "forwarding preference"),
        (
            {"properties": [KeyValuePair(PropertyType.IMMUTABLE_PROPERTIES, b"\x02\x05")]},
            "immutable",
        ),
    ],
)
def test_conflicting_duplicates(kw: dict[str, object], what: str) -> None:
    s = store()
    s.append(0, 0, b"abc", publisher_priority=3)
    args: dict[str, object] = {"payload": b"abc", "publisher_priority": 3, **kw}
    payload = args.pop("payload")
    with pytest.raises(ConflictingObject, match=what) as ei:
        s.append(0, 0, payload, **args)  # type: ignore[arg-type]
    assert ei.value.location == Location(0, 0)
    assert len(s) == 1


def test_conflicting_status_duplicate() -> None:
    s = store()
    s.append(0, 0, b"")
    with pytest.raises(ConflictingObject, match="status"):
        s.append(0, 0, status=EOG)


def test_mutable_properties_are_replaced_without_notifying() -> None:
    s = store()
    seen: list[StoredObject] = []
    s.subscribe_listener(seen.append)
    old = s.append(0, 0, b"x", properties=[KeyValuePair(0x40, 1)])
    new = s.append(0, 0, b"x", properties=[KeyValuePair(0x40, 2)])
    assert new.properties == (KeyValuePair(0x40, 2),)
    assert new.seq == old.seq
    assert s.get(Location(0, 0)) is new
    assert seen == [old]


def test_no_priority_inherits_the_subgroups() -> None:
    s = store(default_publisher_priority=100)
    s.append(2, 0, b"a", subgroup_id=0, publisher_priority=32)
    assert s.append(2, 1, b"b").publisher_priority == 32
    assert s.append(2, 2, status=EOG).publisher_priority == 32
    assert s.append(2, 0, b"a").publisher_priority == 32  # identical re-append
    assert s.append(3, 0, b"c").publisher_priority == 100  # new subgroup: track default
    assert s.append(4, 0, b"x", datagram=True).publisher_priority == 100  # datagram: default


def test_priority_change_within_a_subgroup_is_malformed() -> None:
    s = store()
    s.append(0, 0, b"a", subgroup_id=1, publisher_priority=5)
    s.append(0, 1, b"b", subgroup_id=2, publisher_priority=6)  # another subgroup: fine
    s.append(0, 2, b"c", datagram=True, publisher_priority=9)  # datagrams: own priority
    with pytest.raises(ConflictingObject, match="subgroup 1"):
        s.append(0, 3, b"d", subgroup_id=1, publisher_priority=6)
    s.append(1, 0, b"e", subgroup_id=1, publisher_priority=6)  # another group: fine


def test_malformed_track_errors_are_local_protocol_errors_and_value_errors() -> None:
    assert issubclass(ConflictingObject, MalformedTrack)
    assert issubclass(BeyondEnd, MalformedTrack)
    assert issubclass(MalformedTrack, LocalProtocolError)
    assert issubclass(MalformedTrack, ValueError)


# --- End of Group / End of Track ---------------------------------------------------------


def test_end_of_group() -> None:
    s = store()
    s.append(3, 0, b"a")
    s.append(3, 1, b"b")
    assert s.group_end(3) is None
    marker = s.append(3, 2, status=EOG)
    assert marker.payload.nbytes == 0
    assert s.group_end(3) == Location(3, 2)
    with pytest.raises(BeyondEnd):
        s.append(3, 3, b"c")
    with pytest.raises(BeyondEnd):
        s.append(3, 5, status=EOG)  # a second, later marker
    s.append(4, 0, b"d")  # later groups are fine
    assert s.append(3, 2, status=EOG) is marker  # identical re-append


def test_end_of_group_below_an_existing_object() -> None:
    s = store()
    s.append(0, 5, b"a")
    with pytest.raises(BeyondEnd, match="below"):
        s.append(0, 4, status=EOG)
    assert s.group_end(0) is None


def test_end_of_track() -> None:
    s = store()
    s.append(0, 0, b"a")
    s.append(1, 0, b"b")
    eot = s.append(1, 1, status=EOT)
    assert s.end_of_track == Location(1, 1) == eot.location
    assert s.group_end(1) == Location(1, 1)
    assert s.group_end(0) is None
    for g, o in ((1, 2), (2, 0)):
        with pytest.raises(BeyondEnd, match="End of Track"):
            s.append(g, o, b"x")
    with pytest.raises(BeyondEnd):
        s.append(5, 0, status=EOT)
    s.append(0, 1, b"late but before the end")  # below End of Track: fine
    with pytest.raises(BeyondEnd):
        s.observe_largest(Location(2, 0))


def test_end_of_track_below_largest() -> None:
    s = store()
    s.append(2, 0, b"a")
    with pytest.raises(BeyondEnd, match="Largest"):
        s.append(1, 9, status=EOT)
    assert s.end_of_track is None


def test_observe_largest() -> None:
    s = store()
    s.observe_largest(Location(4, 2))
    assert s.largest == Location(4, 2)
    s.observe_largest(Location(1, 0))
    assert s.largest == Location(4, 2)
    s.append(3, 0, b"x")
    assert s.largest == Location(4, 2)
    assert s.get(Location(4, 2)) is None


# --- listeners ---------------------------------------------------------------------------


def test_listeners_called_in_order_and_removable() -> None:
    s = store()
    calls: list[tuple[str, tuple[int, int]]] = []
    h1 = s.subscribe_listener(lambda o: calls.append(("a", (o.group_id, o.object_id))))
    s.subscribe_listener(lambda o: calls.append(("b", (o.group_id, o.object_id))))
    s.append(0, 0, b"x")
    s.remove_listener(h1)
    s.remove_listener(h1)  # idempotent
    s.append(0, 1, b"y")
    assert calls == [("a", (0, 0)), ("b", (0, 0)), ("b", (0, 1))]


def test_listener_removed_during_notification_is_not_called() -> None:
    s = store()
    calls: list[str] = []
    handles = {}

    def first(_o: StoredObject) -> None:
        calls.append("first")
        s.remove_listener(handles["second"])
        handles["third"] = s.subscribe_listener(lambda _o: calls.append("third"))

    s.subscribe_listener(first)
    handles["second"] = s.subscribe_listener(lambda _o: calls.append("second"))
    s.append(0, 0, b"x")
    assert calls == ["first"]  # second removed; third added: from the next object on
    s.append(0, 1, b"x")
    assert calls == ["first", "first", "third"]


def test_listener_must_not_append() -> None:
    s = store()

    def bad(o: StoredObject) -> None:
        s.append(o.group_id, o.object_id + 1, b"nope")

    s.subscribe_listener(bad)
    with pytest.raises(RuntimeError, match="listener"):
        s.append(0, 0, b"x")
    assert len(s) == 1  # the first object stays stored
    assert s.get(Location(0, 1)) is None


def test_listener_errors_propagate_after_every_listener_ran() -> None:
    s = store()
    calls: list[str] = []

    def boom(_o: StoredObject) -> None:
        raise KeyError("boom")

    s.subscribe_listener(boom)
    s.subscribe_listener(lambda _o: calls.append("after"))
    with pytest.raises(KeyError):
        s.append(0, 0, b"x")
    assert calls == ["after"]
    assert len(s) == 1
    s.subscribe_listener(boom)
    with pytest.raises(ExceptionGroup):
        s.append(0, 1, b"y")
    # the store keeps working
    s2 = store()
    s2.append(0, 0, b"x")


# --- append_group (the bulk path) -----------------------------------------------------------


def _state(s: TrackStore) -> tuple[object, ...]:
    objs = tuple(s.objects_in(Location(0, 0)))
    return (
        objs,
        [(o.seq, o.head, o.payload_bytes()) for o in objs],
        len(s),
        s.total_bytes,
        s.largest,
        s.end_of_track,
        s.group_ids(),
        [s.group_end(g) for g in s.group_ids()],
        [s.subgroup_first(g, 0) for g in s.group_ids()],
    )


@pytest.mark.parametrize("end_of_group", [True, False])
@pytest.mark.parametrize("priority", [None, 7])
def test_append_group_equals_appends_one_by_one(end_of_group: bool, priority: int | None) -> None:
    payloads = [b"a", bytearray(b"bb"), memoryview(b"ccc"), array.array("H", [1, 2])]
    heads = [b"h0", b"", b"h2", b"h3"]
    one, bulk = store(default_publisher_priority=9), store(default_publisher_priority=9)
    calls_one: list[object] = []
    calls_bulk: list[object] = []
    for each, calls in ((one, calls_one), (bulk, calls_bulk)):
        each.append(0, 0, b"earlier group")
        each.subscribe_listener(lambda o, c=calls, x=each: c.append((o, len(x), x.largest)))
    for oid, (p, h) in enumerate(zip(payloads, heads, strict=True)):
        one.append(2, oid, p, h, publisher_priority=priority)
    if end_of_group:
        one.append(2, len(payloads), status=EOG, publisher_priority=priority)
    stored = bulk.append_group(
        2, payloads, heads, publisher_priority=priority, end_of_group=end_of_group
    )
    assert _state(bulk) == _state(one)
    assert calls_bulk == calls_one  # same objects, same store state seen by listeners
    assert stored == tuple(bulk.objects_in(Location(2, 0)))
    assert stored[1].payload.obj is payloads[1]  # by reference
    assert {o.publisher_priority for o in stored} == {9 if priority is None else priority}
    assert all(o.subgroup_id == 0 and not o.datagram and o.properties == () for o in stored)
    # the group is what append() would have made
    with pytest.raises(ConflictingObject):
        bulk.append(2, 1, b"other", publisher_priority=priority)
    if end_of_group:
        with pytest.raises(BeyondEnd):
            bulk.append(2, 5, b"x")


def test_append_group_without_heads_and_empty() -> None:
    s = store()
    objs = s.append_group(0, [b"x", b"y"])
    assert [o.head for o in objs] == [b"", b"", b""]
    assert s.group_end(0) == Location(0, 2)
    assert s.append_group(1, [], end_of_group=False) == ()
    assert s.group_ids() == (0,)
    (marker,) = s.append_group(1, [])  # a group that is only its End of Group
    assert marker.status is EOG and s.group_end(1) == Location(1, 0)
    assert s.append_group(5, [b"later"], end_of_group=False)[0].location == Location(5, 0)
    s.append_group(3, [b"in between"])  # groups need not come in order
    assert s.group_ids() == (0, 1, 3, 5)
    assert s.largest == Location(5, 0)


def test_append_group_checks_everything_before_storing() -> None:
    s = store()
    s.append(1, 0, b"x")
    before = _state(s)
    bad_calls: list[tuple[object, dict[str, object]]] = [
        ((1, [b"a"]), {}),  # the group holds objects
        ((2, [b"a", b"b"], [b"h"]), {}),  # heads of another length
        ((2, [b"a", 5]), {}),  # not a buffer
        ((2, [b"a", memoryview(bytes(8))[::2]]), {}),  # not contiguous
        ((2, [b"a", b"b"], [b"h", bytearray(b"h")]), {}),  # a head that is not bytes
        ((2, [b"a"]), {"publisher_priority": 256}),
        ((-1, [b"a"]), {}),
        ((MAX_VI64 + 1, [b"a"]), {}),  # not a vi64
    ]
    for args, kw in bad_calls:
        with pytest.raises(ValueError):
            s.append_group(*args, **kw)  # type: ignore[arg-type]
        assert _state(s) == before, args
    s.append(4, 1, status=EOT)
    s.evict_group(4)  # End of Track is still known
    with pytest.raises(BeyondEnd):
        s.append_group(4, [b"a", b"b"])  # End of Group would be beyond End of Track
    with pytest.raises(BeyondEnd):
        s.append_group(5, [b"a"], end_of_group=False)
    assert s.group_ids() == (1,)
    s.append_group(4, [b"a"])  # its End of Group is at End of Track: not beyond it
    s.append_group(3, [b"fine"])


def test_append_group_listener_errors_come_after_the_whole_group() -> None:
    s = store()
    seen: list[int] = []

    def boom(o: StoredObject) -> None:
        seen.append(o.object_id)
        if o.object_id == 1:
            raise KeyError("boom")

    s.subscribe_listener(boom)
    with pytest.raises(KeyError):
        s.append_group(0, [b"a", b"b", b"c"])
    assert seen == [0, 1, 2, 3] and len(s) == 4  # every object stored and announced
    s.subscribe_listener(lambda _o: (_ for _ in ()).throw(ValueError("every time")))
    with pytest.raises(ExceptionGroup) as info:
        s.append_group(1, [b"a", b"b"], end_of_group=False)
    assert len(info.value.exceptions) == 3  # KeyError at object 1, ValueError at 0 and 1


def test_append_group_from_a_listener_and_eviction_during_it() -> None:
    s = store()
    s.subscribe_listener(lambda o: s.append_group(9, [b"x"]) if o.object_id == 0 else None)
    with pytest.raises(RuntimeError, match="listener"):
        s.append_group(0, [b"a"])
    assert s.group_ids() == (0,) and len(s) == 2

    t = store()

    def evict(o: StoredObject) -> None:
        if o.location == Location(0, 1):
            t.evict_group(0)

    t.subscribe_listener(evict)
    t.append_group(0, [b"a", b"b", b"c"])
    # as with append(): what follows the eviction is stored in a group of its own
    assert locs(t.objects_in(Location(0, 0))) == [(0, 2), (0, 3)]
    assert t.subgroup_first(0, 0) == 2 and len(t) == 2 and t.total_bytes == 1
    assert t.group_end(0) == Location(0, 3)


# --- eviction ------------------------------------------------------------------------------


def test_evict_group() -> None:
    s = store()
    s.append(0, 0, b"aa")
    s.append(0, 1, b"bbb")
    s.append(0, 2, status=EOG)
    s.append(1, 0, b"c")
    assert s.evict_group(0) == 5
    assert s.evict_group(0) == 0
    assert s.evict_group(42) == 0
    assert s.total_bytes == 1
    assert len(s) == 1
    assert s.group_ids() == (1,)
    assert s.get(Location(0, 0)) is None
    assert s.group_end(0) is None  # unknown now, not non-existent
    assert s.largest == Location(1, 0)
    again = s.append(0, 0, b"different payload is not a conflict any more")
    assert again.seq == 4


def test_eviction_keeps_end_of_track() -> None:
    s = store()
    s.append(0, 0, b"a")
    s.append(0, 1, status=EOT)
    s.evict_group(0)
    assert s.end_of_track == Location(0, 1)
    assert s.group_end(0) == Location(0, 1)
    with pytest.raises(BeyondEnd):
        s.append(1, 0, b"x")


# --- range iteration -----------------------------------------------------------------------


def _grid() -> TrackStore:
    s = store()
    for g in (0, 1, 3):
        for o in (0, 1, 2):
            s.append(g, o, bytes([g, o]))
    return s


def test_objects_in_ascending_and_descending() -> None:
    s = _grid()
    assert locs(s.objects_in(Location(0, 2), Location(3, 0))) == [
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
        (3, 0),
    ]
    assert locs(s.objects_in(Location(0, 2), Location(3, 0), GroupOrder.DESCENDING)) == [
        (3, 0),
        (1, 0),
        (1, 1),
        (1, 2),
        (0, 2),
    ]
    assert locs(s.objects_in(Location(2, 0))) == [(3, 0), (3, 1), (3, 2)]
    assert locs(s.objects_in(Location(1, 1), Location(1, 1))) == [(1, 1)]
    assert locs(s.objects_in(Location(2, 0), Location(2, 9))) == []
    assert locs(s.objects_in(Location(3, 1), Location(3, 0))) == []
    assert locs(s.objects_in(Location(4, 0))) == []
    assert locs(store().objects_in(Location(0, 0))) == []


def test_objects_in_end_none_is_largest_at_call_time() -> None:
    s = _grid()
    it = s.objects_in(Location(3, 0))
    s.append(3, 3, b"later")
    s.append(4, 0, b"later")
    assert locs(it) == [(3, 0), (3, 1), (3, 2)]


def test_objects_in_tolerates_concurrent_appends_and_evictions() -> None:
    s = _grid()
    it = s.objects_in(Location(0, 0), Location(9, 9))
    assert locs([next(it), next(it)]) == [(0, 0), (0, 1)]
    s.append(0, 5, b"ahead, same group")
    s.append(0, 0, b"\x00\x00")  # behind the cursor (no-op anyway)
    s.append(2, 0, b"ahead, new group")
    s.evict_group(1)
    assert locs(it) == [(0, 2), (0, 5), (2, 0), (3, 0), (3, 1), (3, 2)]

    it = s.objects_in(Location(0, 0), Location(9, 9), GroupOrder.DESCENDING)
    assert locs([next(it)]) == [(3, 0)]
    s.evict_group(3)  # evicted mid-group: the rest of the group is skipped
    s.append(1, 7, b"ahead in descending order")
    assert locs(it) == [(2, 0), (1, 7), (0, 0), (0, 1), (0, 2), (0, 5)]


def test_objects_in_extreme_ids() -> None:
    s = store()
    s.append(MAX_VI64, MAX_VI64, b"x")
    s.append(0, 0, b"y")
    top = Location(MAX_VI64, MAX_VI64)
    assert locs(s.objects_in(Location(0, 0), top)) == [(0, 0), (MAX_VI64, MAX_VI64)]
    assert locs(s.objects_in(Location(0, 0), top, GroupOrder.DESCENDING)) == [
        (MAX_VI64, MAX_VI64),
        (0, 0),
    ]


@st.composite
def _populations(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    keys = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), unique=True, max_size=30))
    return [(g, o, draw(st.integers(0, 5))) for g, o in keys]


_LOC = st.builds(Location, st.integers(0, 7), st.integers(0, 7))


@settings(max_examples=150)
@given(_populations(), _LOC, st.none() | _LOC, st.sampled_from(GroupOrder))
def test_objects_in_matches_brute_force(
    pop: list[tuple[int, int, int]], start: Location, end: Location | None, order: GroupOrder
) -> None:
    s = store()
    for g, o, n in pop:
        s.append(g, o, bytes(n))
    assert s.total_bytes == sum(n for _, _, n in pop)
    assert len(s) == len(pop)
    assert s.largest == (max((Location(g, o) for g, o, _ in pop), default=None))
    seqs = [s.get(Location(g, o)).seq for g, o, _ in pop]  # type: ignore[union-attr]
    assert seqs == list(range(len(pop)))
    hi = end if end is not None else s.largest
    want = sorted(
        ((g, o) for g, o, _ in pop if hi is not None and start <= Location(g, o) <= hi),
        key=lambda t: (t[0] if order is GroupOrder.ASCENDING else -t[0], t[1]),
    )
    assert locs(s.objects_in(start, end, order)) == want


@settings(max_examples=100)
@given(_populations(), st.lists(st.integers(0, 6), max_size=4))
def test_eviction_matches_model(pop: list[tuple[int, int, int]], evict: list[int]) -> None:
    s = store()
    model: dict[tuple[int, int], int] = {}
    for g, o, n in pop:
        s.append(g, o, bytes(n))
        model[(g, o)] = n
    largest = s.largest
    for g in evict:
        freed = s.evict_group(g)
        gone = {k: v for k, v in model.items() if k[0] == g}
        assert freed == sum(gone.values())
        for k in gone:
            del model[k]
    assert s.total_bytes == sum(model.values())
    assert len(s) == len(model)
    assert s.largest == largest
    assert locs(s.objects_in(Location(0, 0), Location(9, 9))) == sorted(model)
    assert s.group_ids() == tuple(sorted({g for g, _ in model}))


def test_repr_mentions_the_track() -> None:
    s = store()
    s.append(0, 0, b"abc")
    assert "k.2ef16.2es0 objects=1 bytes=3 largest={0,0}" in repr(s)


def test_append_received_matches_append_and_checks_what_the_store_holds() -> None:
    a = TrackStore(FullTrackName(TrackNamespace.of("ns"), b"a"))
    b = TrackStore(FullTrackName(TrackNamespace.of("ns"), b"b"))
    props = (KeyValuePair(0x41, b"x"),)
    rows = [
        (Location(0, 0), b"p0", 0, 7, ObjectStatus.NORMAL, props),
        (Location(0, 1), b"p1", 0, 7, ObjectStatus.NORMAL, ()),
        (Location(0, 2), b"", 0, 7, ObjectStatus.END_OF_GROUP, ()),
        (Location(1, 0), b"d", None, 9, ObjectStatus.NORMAL, ()),
    ]
    for loc, data, sg, prio, status, pr in rows:
        a.append(
            loc.group,
            loc.object,
            data,
            subgroup_id=sg,
            publisher_priority=prio,
            status=status,
            properties=pr,
            datagram=sg is None,
        )
        b.append_received(
            loc,
            memoryview(data),
            subgroup_id=sg,
            publisher_priority=prio,
            status=status,
            properties=pr,
        )
    got_a = [
        (
            o.location,
            o.subgroup_id,
            o.publisher_priority,
            o.status,
            o.properties,
            bytes(o.payload),
            o.datagram,
        )
        for o in a.objects_in(Location(0, 0))
    ]
    got_b = [
        (
            o.location,
            o.subgroup_id,
            o.publisher_priority,
            o.status,
            o.properties,
            bytes(o.payload),
            o.datagram,
        )
        for o in b.objects_in(Location(0, 0))
    ]
    assert got_a == got_b and len(got_b) == 4
    assert b.largest == a.largest
    # a duplicate is the stored object; a conflict and an object beyond End of Group raise
    again = b.append_received(
        Location(0, 1),
        memoryview(b"p1"),
        subgroup_id=0,
        publisher_priority=7,
        status=ObjectStatus.NORMAL,
        properties=(),
    )
    assert bytes(again.payload) == b"p1" and len(b) == 4
    with pytest.raises(ConflictingObject):
        b.append_received(
            Location(0, 1),
            memoryview(b"XX"),
            subgroup_id=0,
            publisher_priority=7,
            status=ObjectStatus.NORMAL,
            properties=(),
        )
    with pytest.raises(BeyondEnd):
        b.append_received(
            Location(0, 5),
            memoryview(b"late"),
            subgroup_id=0,
            publisher_priority=7,
            status=ObjectStatus.NORMAL,
            properties=(),
        )
