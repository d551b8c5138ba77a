"""Filter evaluation: subscription windows, FETCH / fill ranges, range filters, exactly once."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcs_core.moqt.windows import (
    EMPTY_RANGE_FILTERS,
    FetchRange,
    RangeFilterSet,
    Window,
    fetch_range,
    fill_range,
    passes,
    property_values,
    subscription_window,
)
from kvcs_core.wire.codes import MAX_VI64, ParameterType, PropertyType
from kvcs_core.wire.filters import (
    InvalidRangeFilter,
    LocationFilter,
    RangeFilter,
    RangeFilterRemove,
)
from kvcs_core.wire.kvp import KeyValuePair, KeyValuePairs, kvps_bytes
from kvcs_core.wire.names import Location
from kvcs_core.wire.params import SubscriberPriority

L = Location
LF = LocationFilter
SUB = ParameterType.SUBGROUP_FILTER
OID = ParameterType.OBJECTID_FILTER
PRI = ParameterType.PRIORITY_FILTER
OPF = ParameterType.OBJECT_PROPERTY_FILTER
TPF = ParameterType.TRACK_PROPERTY_FILTER


@attrs.frozen
class Obj:
    """A minimal FilterableObject."""

    location: Location
    subgroup_id: int | None = 0
    publisher_priority: int = 128
    properties: KeyValuePairs = ()

    @property
    def object_id(self) -> int:
        return self.location.object


# --- subscription windows ----------------------------------------------------------


@pytest.mark.parametrize(
    ("lf", "largest", "want"),
    [
        (None, None, Window(L(0, 0))),
        (None, L(5, 3), Window(L(0, 0))),
        (LF.none(), L(5, 3), Window(L(0, 0))),
        (LF.relative_start(0), L(5, 3), Window(L(6, 0))),  # next group
        (LF.relative_start(1), L(5, 3), Window(L(5, 0))),  # current group
        (LF.relative_start(3), L(5, 3), Window(L(3, 0))),
        (LF.relative_start(9), L(5, 3), Window(L(0, 0))),  # clamped at 0
        (LF.relative_start(2), None, Window(L(0, 0))),  # A2 (c)
        (LF.relative_start(0), L(MAX_VI64, 0), Window(L(MAX_VI64, 0))),  # clamped at max
        (LF.absolute_start(0, 0), L(5, 3), Window(L(0, 0))),
        (LF.absolute_start(2, 7), None, Window(L(2, 7))),
        (LF.absolute_group_end(2, 1, 4), L(9, 9), Window(L(2, 1), L(4, MAX_VI64), True)),
        (LF.absolute_group_end(2, 1, 4), None, Window(L(2, 1), L(4, MAX_VI64), True)),
        (LF.absolute_range(2, 1, 4, 6), L(0, 0), Window(L(2, 1), L(4, 6))),
        (LF.next_object(), L(5, 3), Window(L(5, 4))),
        (LF.next_object(), None, Window(L(0, 0))),
        (LF.next_object(), L(5, MAX_VI64), Window(L(6, 0))),
    ],
)
def test_subscription_window(
    lf: LocationFilter | None, largest: Location | None, want: Window
) -> None:
    assert subscription_window(lf, largest) == want


def test_subscription_window_next_object_at_the_very_end_is_empty() -> None:
    w = subscription_window(LF.next_object(), L(MAX_VI64, MAX_VI64))
    assert w.is_empty
    assert not w.contains(L(MAX_VI64, MAX_VI64))


def test_window_helpers() -> None:
    w = Window(L(2, 1), L(4, MAX_VI64), True)
    assert w.end_group == 4
    assert w.contains(L(2, 1)) and w.contains(L(4, 99)) and w.contains(L(3, 0))
    assert not w.contains(L(2, 0)) and not w.contains(L(5, 0))
    assert w.past_end(L(5, 0)) and not w.past_end(L(4, 7)) and not w.past_end(L(0, 0))
    assert not w.is_empty
    open_w = Window(L(1, 0))
    assert open_w.end_group is None and not open_w.past_end(L(MAX_VI64, MAX_VI64))
    # A subscription filter is always valid, even empty (d21 3.3.1).
    empty = subscription_window(LF.absolute_range(5, 10, 5, 3), L(9, 9))
    assert empty.is_empty and not empty.contains(L(5, 5))


# --- FETCH and fill ranges -------------------------------------------------------------


@pytest.mark.parametrize(
    ("lf", "largest", "want"),
    [
        (None, L(5, 3), (L(0, 0), L(5, 3))),
        (LF.none(), L(5, 3), (L(0, 0), L(5, 3))),
        (LF.relative_start(1), L(5, 3), (L(5, 0), L(5, 3))),
        (LF.relative_start(9), L(5, 3), (L(0, 0), L(5, 3))),
        (LF.relative_start(0), L(5, 3), None),  # next group: past Largest
        (LF.absolute_start(2, 7), L(5, 3), (L(2, 7), L(5, 3))),
        (LF.absolute_start(5, 3), L(5, 3), (L(5, 3), L(5, 3))),
        (LF.absolute_start(5, 4), L(5, 3), None),  # start > Largest: INVALID_RANGE
        (LF.absolute_group_end(1, 0, 2), L(5, 3), (L(1, 0), L(2, MAX_VI64))),
        (LF.absolute_group_end(1, 0, 7), L(5, 3), (L(1, 0), L(5, 3))),  # clipped
        (LF.absolute_range(1, 2, 3, 4), L(5, 3), (L(1, 2), L(3, 4))),
        (LF.absolute_range(1, 2, 5, 9), L(5, 3), (L(1, 2), L(5, 3))),  # clipped
        (LF.absolute_range(5, 9, 5, 3), L(9, 9), None),  # empty range
        (LF.next_object(), L(5, 3), None),  # always past Largest
        (None, None, None),  # nothing published
        (LF.absolute_start(0, 0), None, None),
        (LF.next_object(), None, None),
    ],
)
def test_fetch_range(
    lf: LocationFilter | None, largest: Location | None, want: tuple[Location, Location] | None
) -> None:
    got = fetch_range(lf, largest)
    assert (None if got is None else (got.start, got.end)) == want
    if got is not None:
        assert largest is not None and got.end <= largest


def test_fetch_range_object() -> None:
    r = FetchRange(L(1, 0), L(2, 0))
    assert r.contains(L(1, 5)) and not r.contains(L(2, 1)) and not r.contains(L(0, 9))
    with pytest.raises(ValueError):
        FetchRange(L(2, 0), L(1, 0))


def test_fill_range_inner_filter_wins_else_subscription() -> None:
    largest = L(7, 3)
    # whole-track recipe: inner ABSOLUTE_START {0,0} (inner NONE is equivalent)
    assert fill_range(LF.absolute_start(0, 0), LF.next_object(), largest) == FetchRange(
        L(0, 0), L(7, 3)
    )
    assert fill_range(LF.none(), LF.next_object(), largest) == FetchRange(L(0, 0), L(7, 3))
    # no inner filter: the subscription's, by FETCH rules
    assert fill_range(None, LF.absolute_start(6, 1), largest) == FetchRange(L(6, 1), L(7, 3))
    assert fill_range(None, None, largest) == FetchRange(L(0, 0), L(7, 3))
    # the gotcha: a NEXT_OBJECT subscription without an inner filter gets no fill
    assert fill_range(None, LF.next_object(), largest) is None
    assert fill_range(LF.relative_start(1), LF.next_object(), None) is None


# --- exactly once --------------------------------------------------------------------------

_COORD = st.one_of(st.integers(0, 6), st.sampled_from([MAX_VI64 - 1, MAX_VI64]))
_LOCS = st.builds(Location, _COORD, _COORD)


def _neighbourhood(largest: Location) -> list[Location]:
    out = []
    for g in {0, 1, largest.group - 1, largest.group, largest.group + 1, MAX_VI64}:
        for o in {0, 1, largest.object - 1, largest.object, largest.object + 1, MAX_VI64}:
            if 0 <= g <= MAX_VI64 and 0 <= o <= MAX_VI64:
                out.append(L(g, o))
    return out


@settings(max_examples=300)
@given(
    st.none() | _LOCS, st.one_of(st.none(), st.just(LF.none()), st.just(LF.absolute_start(0, 0)))
)
def test_next_object_plus_fill_from_start_partition_every_location(
    largest: Location | None, inner: LocationFilter | None
) -> None:
    """Whole-track recipe (wire reference 6): no overlap, no gap, for any Largest Object."""
    live = subscription_window(LF.next_object(), largest)
    fill = fill_range(
        inner if inner is not None else LF.absolute_start(0, 0), LF.next_object(), largest
    )
    if largest is None:
        assert fill is None
        assert live == Window(L(0, 0))
        return
    assert fill is not None
    for loc in [*_neighbourhood(largest), L(0, 0), L(MAX_VI64, MAX_VI64)]:
        in_fill = fill.contains(loc)
        in_live = live.contains(loc)
        assert in_fill != in_live, loc  # exactly one of them
        assert in_fill == (loc <= largest)


@settings(max_examples=300)
@given(_LOCS, st.integers(0, 8))
def test_next_object_plus_fill_relative_start_n(largest: Location, n: int) -> None:
    """Last-N-groups recipe: fill {LG+1-N,0}..L and live {LG,LO+1}.. meet without overlap."""
    live = subscription_window(LF.next_object(), largest)
    fill = fill_range(LF.relative_start(n), LF.next_object(), largest)
    first = L(min(max(largest.group + 1 - n, 0), MAX_VI64), 0)
    if n == 0 and largest.group < MAX_VI64:
        assert fill is None  # next group: past Largest Object (clamped only at 2**64-1)
    for loc in [*_neighbourhood(largest), first]:
        in_fill = fill is not None and fill.contains(loc)
        assert not (in_fill and live.contains(loc))
        if loc >= first and n > 0:
            assert in_fill or live.contains(loc)


# --- range filters ------------------------------------------------------------------------


def rf(
    kind: ParameterType, set_id: int, *ranges: tuple[int, int | None], prop: int | None = None
) -> RangeFilter:
    return RangeFilter(kind, set_id, prop, ranges)


def test_no_filters_match_everything() -> None:
    assert EMPTY_RANGE_FILTERS.is_empty
    assert EMPTY_RANGE_FILTERS.matches(Obj(L(0, 0)))
    assert EMPTY_RANGE_FILTERS.total_ranges == 0
    assert RangeFilterSet().matches_track(())


def test_ranges_are_ored_within_a_filter() -> None:
    s = RangeFilterSet([rf(OID, 0, (3, 5), (10, 15), (20, None))])
    hits = [o for o in range(30) if s.matches(Obj(L(0, o)))]
    assert hits == [3, 4, 5, *range(10, 16), *range(20, 30)]
    assert s.total_ranges == 3


def test_same_set_id_is_anded_and_set_ids_are_ored() -> None:
    s = RangeFilterSet(
        [
            rf(OID, 0, (0, 4)),
            rf(SUB, 0, (1, 1)),  # set 0: objects 0-4 of subgroup 1
            rf(PRI, 7, (0, 10)),  # set 7: any urgent object
        ]
    )
    assert s.matches(Obj(L(0, 2), subgroup_id=1))
    assert not s.matches(Obj(L(0, 2), subgroup_id=0))
    assert not s.matches(Obj(L(0, 5), subgroup_id=1))
    assert s.matches(Obj(L(0, 99), subgroup_id=0, publisher_priority=3))
    assert not s.matches(Obj(L(0, 99), subgroup_id=0, publisher_priority=11))


def test_subgroup_filter_fails_objects_without_subgroup() -> None:
    s = RangeFilterSet([rf(SUB, 0, (0, None))])
    assert s.matches(Obj(L(0, 0), subgroup_id=0))
    assert not s.matches(Obj(L(0, 0), subgroup_id=None))  # datagram


def test_filter_without_ranges_matches_nothing() -> None:
    s = RangeFilterSet([rf(OID, 0)])
    assert not s.matches(Obj(L(0, 0)))
    s2 = RangeFilterSet([rf(OID, 0), rf(OID, 1, (0, 0))])
    assert s2.matches(Obj(L(0, 0)))


def test_object_property_filter() -> None:
    s = RangeFilterSet([rf(OPF, 0, (5, 9), prop=0x40)])
    assert s.matches(Obj(L(0, 0), properties=(KeyValuePair(0x40, 7),)))
    assert not s.matches(Obj(L(0, 0), properties=(KeyValuePair(0x40, 4),)))
    assert not s.matches(Obj(L(0, 0)))  # A25: lacking the property fails
    assert not s.matches(Obj(L(0, 0), properties=(KeyValuePair(0x42, 7),)))
    # repeated property: any value in range passes
    assert s.matches(Obj(L(0, 0), properties=(KeyValuePair(0x40, 1), KeyValuePair(0x40, 8))))
    # found inside IMMUTABLE_PROPERTIES too (wire reference 7.9)
    imm = KeyValuePair(PropertyType.IMMUTABLE_PROPERTIES, kvps_bytes((KeyValuePair(0x40, 6),)))
    assert s.matches(Obj(L(0, 0), properties=(imm,)))
    broken = KeyValuePair(PropertyType.IMMUTABLE_PROPERTIES, b"\x41\x09")  # runs past its end
    assert not s.matches(Obj(L(0, 0), properties=(broken,)))
    assert property_values((KeyValuePair(0x40, 1), imm), 0x40) == [1, 6]


def test_track_property_filter_is_separate() -> None:
    s = RangeFilterSet([rf(TPF, 0, (1, 1), prop=0x30), rf(OID, 0, (0, 0))])
    # matches() looks only at the object filters
    assert s.matches(Obj(L(0, 0)))
    assert not s.matches(Obj(L(0, 1)))
    assert s.matches_track((KeyValuePair(0x30, 1),))
    assert not s.matches_track((KeyValuePair(0x30, 0),))
    assert not s.matches_track(())
    assert s.total_ranges == 2


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match="repeats"):
        RangeFilterSet([rf(OID, 0, (0, 1)), rf(OID, 0, (2, 3))])
    with pytest.raises(ValueError):
        RangeFilterSet([RangeFilterRemove(OID)])  # type: ignore[list-item]
    bad = InvalidRangeFilter(OID, b"\x00\x80")
    with pytest.raises(ValueError, match="invalid"):
        RangeFilterSet.from_params([bad])
    with pytest.raises(ValueError, match="invalid"):
        RangeFilterSet().apply_update([bad])


def test_from_params_keeps_only_range_filters() -> None:
    a = rf(OID, 0, (0, 3))
    s = RangeFilterSet.from_params([SubscriberPriority(3), a, RangeFilterRemove(SUB)])
    assert s.filters == (a,)


def test_apply_update() -> None:
    base = RangeFilterSet([rf(OID, 0, (0, 3)), rf(OID, 1, (9, 9)), rf(SUB, 0, (0, 0))])
    # present type replaces ALL earlier filters of that type
    new = base.apply_update([rf(OID, 2, (5, 6))])
    assert sorted((f.kind, f.set_id) for f in new.filters) == [(SUB, 0), (OID, 2)]
    # Length 0 removes the type; others unchanged
    removed = base.apply_update([RangeFilterRemove(SUB)])
    assert [(f.kind, f.set_id) for f in removed.filters] == [(OID, 0), (OID, 1)]
    # absent: unchanged (the very same set)
    assert base.apply_update([SubscriberPriority(1)]) is base
    assert base.apply_update([]) is base


# brute-force reference for matches(): the d21 3.3.2 sentence, written independently
def _reference(filters: list[RangeFilter], obj: Obj) -> bool:
    object_filters = [f for f in filters if f.kind != TPF]
    if not object_filters:
        return True

    def value_ok(f: RangeFilter) -> bool:
        if f.kind == OID:
            vals = [obj.object_id]
        elif f.kind == SUB:
            vals = [] if obj.subgroup_id is None else [obj.subgroup_id]
        elif f.kind == PRI:
            vals = [obj.publisher_priority]
        else:
            vals = [p.value for p in obj.properties if p.type == f.property_type]  # type: ignore[misc]
        return any(s <= v and (e is None or v <= e) for v in vals for s, e in f.ranges)  # type: ignore[operator]

    set_ids = {f.set_id for f in object_filters}
    return any(all(value_ok(f) for f in object_filters if f.set_id == sid) for sid in set_ids)


@st.composite
def _filters(draw: st.DrawFn) -> list[RangeFilter]:
    out: dict[tuple[ParameterType, int], RangeFilter] = {}
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from([SUB, OID, PRI, OPF]))
        set_id = draw(st.integers(0, 2))
        bounds = sorted(draw(st.lists(st.integers(0, 12), max_size=6)))
        ranges: list[tuple[int, int | None]] = [
            (bounds[i], bounds[i + 1]) for i in range(0, len(bounds) - 1, 2)
        ]
        if draw(st.booleans()):
            ranges.append((ranges[-1][1] if ranges else 0, None))  # type: ignore[arg-type]
        prop = 0x40 if kind == OPF else None
        out[(kind, set_id)] = RangeFilter(kind, set_id, prop, ranges)
    return list(out.values())


_OBJS = st.builds(
    Obj,
    st.builds(Location, st.integers(0, 3), st.integers(0, 13)),
    st.none() | st.integers(0, 13),
    st.integers(0, 13),
    st.lists(
        st.builds(KeyValuePair, st.sampled_from([0x40, 0x42]), st.integers(0, 13)), max_size=2
    ).map(lambda ps: tuple(sorted(ps, key=lambda p: p.type))),
)


@settings(max_examples=400)
@given(_filters(), _OBJS)
def test_matches_equals_brute_force(filters: list[RangeFilter], obj: Obj) -> None:
    s = RangeFilterSet(filters)
    assert s.matches(obj) == _reference(filters, obj)
    assert s.total_ranges == sum(len(f.ranges) for f in filters)


@settings(max_examples=200)
@given(_filters(), _filters(), st.sets(st.sampled_from([SUB, OID, PRI, OPF])))
def test_apply_update_equals_model(
    before: list[RangeFilter], update: list[RangeFilter], removes: set[ParameterType]
) -> None:
    params = [*update, *(RangeFilterRemove(k) for k in removes)]
    after = RangeFilterSet(before).apply_update(params)
    touched = {f.kind for f in update} | removes
    want = [f for f in before if f.kind not in touched] + [f for f in update]
    assert sorted(map(repr, after.filters)) == sorted(map(repr, want))


def test_passes_is_forward_and_window_and_filters() -> None:
    w = Window(L(1, 0), L(2, 5))
    s = RangeFilterSet([rf(OID, 0, (0, 3))])
    assert passes(Obj(L(1, 2)), w, s, True)
    assert not passes(Obj(L(1, 2)), w, s, False)  # Forward 0
    assert not passes(Obj(L(0, 2)), w, s, True)  # before the window
    assert not passes(Obj(L(2, 6)), w, None, True)  # after it
    assert not passes(Obj(L(1, 4)), w, s, True)  # range filter
    assert passes(Obj(L(1, 4)), w, None, True)
