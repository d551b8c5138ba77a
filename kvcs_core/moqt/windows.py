"""Which objects a subscription, FETCH or fill delivers: filter evaluation, pure functions.

Theory of operation
-------------------
An object passes a subscription when ``Forward AND LocationFilter AND every
RangeFilter`` (d21 section 3.3.3, wire reference 5.4); :func:`passes` is that
sentence. The two halves:

**Location filters** (d21 section 3.3.1, d22 typed LOCATION_FILTER, wire
reference 5.4) are resolved against Largest Object ``{LG, LO}`` once, when the
request is processed, into absolute inclusive bounds:

* :func:`subscription_window` follows the column "End for a subscription":
  NONE / absent -> ``{0,0}`` open; RELATIVE_START n -> ``{LG+1-n, 0}`` clamped
  to ``[0, 2**64-1]`` (``{0,0}`` with no Largest Object, Ambiguity A2 (c));
  ABSOLUTE_START -> ``{SG,SO}`` open; ABSOLUTE_GROUP_END -> to the end of group
  ``SG+EGD``; ABSOLUTE_RANGE -> to ``{SG+EGD, EO}``; NEXT_OBJECT ->
  ``{LG, LO+1}`` open, ``{0,0}`` when nothing exists. A subscription window is
  always valid, even when it lies wholly below Largest Object or is empty
  (d21 section 3.3.1): the publisher just sends nothing from it.
* :func:`fetch_range` follows the column "End for FETCH or fill": the same
  starts, but the end is clipped to Largest Object (nothing beyond
  Largest-at-processing is ever returned). It returns ``None`` when nothing is
  published yet, when the start lies after Largest Object, or when the range
  is empty: a FETCH answers REQUEST_ERROR(INVALID_RANGE 0x11), a fill opens
  no stream (wire reference 6 item 2). :func:`fill_range` picks the fill's
  filter: the LOCATION_FILTER inside FILL_PARAMETERS if present, else the
  subscription's. **Gotcha** (wire reference 6 item 2): FILL_PARAMETERS without
  an inner filter on a NEXT_OBJECT subscription inherits NEXT_OBJECT, whose
  start ``{LG, LO+1}`` lies past Largest Object, so there is no fill at all.

Exactly once (wire reference 6, A27): with one Largest Object ``L`` computed in
one atomic step, ``subscription_window(NEXT_OBJECT, L)`` starts right after
``L`` and ``fetch_range(ABSOLUTE_START {0,0}, L)`` ends at ``L``: together they
cover every Location once.

**Range filters** (d21 section 3.3.2, wire reference 5.5) are held in a
:class:`RangeFilterSet`: ranges are ORed within one parameter, parameters with
the same SetID are ANDed, the per-SetID results are ORed. SUBGROUP_FILTER looks
at the Subgroup ID, OBJECTID_FILTER at the Object ID, PRIORITY_FILTER at the
Publisher Priority, OBJECT_PROPERTY_FILTER at an even Object Property (found in
the properties or inside IMMUTABLE_PROPERTIES, wire reference 7.9); an object
lacking the property fails that filter (Ambiguity A25). TRACK_PROPERTY_FILTER
selects PUBLISHes of a SUBSCRIBE_TRACKS, not objects, so :meth:`RangeFilterSet.matches` leaves
it out and :meth:`RangeFilterSet.matches_track` evaluates it alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Protocol

import attrs

from kvcs_core.wire.codes import MAX_VI64, LocationFilterType, ParameterType, PropertyType
from kvcs_core.wire.errors import CodecError
from kvcs_core.wire.filters import (
    InvalidRangeFilter,
    LocationFilter,
    MessageParameter,
    Range,
    RangeFilter,
    RangeFilterRemove,
    invalid_filter_reason,
)
from kvcs_core.wire.kvp import KeyValuePairs, read_kvps
from kvcs_core.wire.names import Location
from kvcs_core.wire.params import FillParameters, Parameters

__all__ = [
    "EMPTY_RANGE_FILTERS",
    "FetchRange",
    "FilterableObject",
    "RangeFilterSet",
    "Window",
    "fetch_range",
    "fill_range",
    "passes",
    "property_values",
    "subscription_window",
]

_ORIGIN: Final = Location(0, 0)


class FilterableObject(Protocol):
    """What filters look at; :class:`~kvcs_core.moqt.track_store.StoredObject` is one."""

    @property
    def location(self) -> Location: ...

    @property
    def subgroup_id(self) -> int | None: ...

    @property
    def object_id(self) -> int: ...

    @property
    def publisher_priority(self) -> int: ...

    @property
    def properties(self) -> KeyValuePairs: ...


@attrs.frozen
class Window:
    """The Locations a subscription may deliver: ``start <= loc <= end`` (inclusive).

    ``end=None`` is open. With ``end_is_group_end`` the end is the whole group
    ``end.group`` (``end.object`` is then 2**64-1). ``end < start`` is an empty
    window (legal for a subscription, d21 section 3.3.1).
    """

    start: Location
    end: Location | None = None
    end_is_group_end: bool = False

    @property
    def is_empty(self) -> bool:
        """True when no Location can pass."""
        return self.end is not None and self.end < self.start

    @property
    def end_group(self) -> int | None:
        """The last group the window reaches, or ``None`` when open."""
        return None if self.end is None else self.end.group

    def contains(self, loc: Location) -> bool:
        """``start <= loc <= end``."""
        return self.start <= loc and (self.end is None or loc <= self.end)

    def past_end(self, loc: Location) -> bool:
        """True when ``loc`` is after the end: no later object can pass either."""
        return self.end is not None and loc > self.end


@attrs.frozen
class FetchRange:
    """The inclusive Locations a FETCH or fill covers; ``end`` never exceeds Largest Object."""

    start: Location
    end: Location

    def __attrs_post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"empty fetch range {self.start}..{self.end}")

    def contains(self, loc: Location) -> bool:
        """``start <= loc <= end``."""
        return self.start <= loc <= self.end


def _relative_start(groups_back: int, largest: Location | None) -> Location:
    if largest is None:
        return _ORIGIN  # Ambiguity A2 (c)
    g = largest.group + 1 - groups_back
    return Location(min(max(g, 0), MAX_VI64), 0)


def _next_object(largest: Location | None) -> Location | None:
    """``{LG, LO+1}``, ``{0,0}`` with no Largest; ``None`` when it would overflow."""
    if largest is None:
        return _ORIGIN
    if largest.object < MAX_VI64:
        return Location(largest.group, largest.object + 1)
    if largest.group < MAX_VI64:
        return Location(largest.group + 1, 0)
    return None


def _start(lf: LocationFilter | None, largest: Location | None) -> Location | None:
    """The start of any filter type; ``None`` only for NEXT_OBJECT after {max,max}."""
    if lf is None:
        return _ORIGIN
    ft = lf.filter_type
    if ft == LocationFilterType.NONE:
        return _ORIGIN
    if ft == LocationFilterType.RELATIVE_START:
        assert lf.start_group is not None  # guaranteed by LocationFilter
        return _relative_start(lf.start_group, largest)
    if ft == LocationFilterType.NEXT_OBJECT:
        return _next_object(largest)
    start = lf.start
    assert start is not None  # ABSOLUTE_* always carry SG and SO
    return start


def _filter_end(lf: LocationFilter | None) -> tuple[Location | None, bool]:
    """The filter's own inclusive end (before clipping) and whether it is a group end."""
    if lf is None:
        return None, False
    if lf.filter_type == LocationFilterType.ABSOLUTE_GROUP_END:
        eg = lf.end_group
        assert eg is not None
        return Location(eg, MAX_VI64), True
    if lf.filter_type == LocationFilterType.ABSOLUTE_RANGE:
        return lf.end, False
    return None, False


def subscription_window(lf: LocationFilter | None, largest: Location | None) -> Window:
    """Resolve a subscription's LOCATION_FILTER (wire reference 5.4, "End for a subscription").

    Args:
        lf: the filter, ``None`` when absent (same as NONE).
        largest: Largest Object at processing time, ``None`` when nothing exists.
    """
    start = _start(lf, largest)
    if start is None:
        # NEXT_OBJECT after {2**64-1, 2**64-1}: nothing can follow; an empty window.
        return Window(Location(MAX_VI64, MAX_VI64), Location(MAX_VI64, MAX_VI64 - 1))
    end, group_end = _filter_end(lf)
    return Window(start, end, group_end)


def fetch_range(lf: LocationFilter | None, largest: Location | None) -> FetchRange | None:
    """Resolve a FETCH's (or fill's) LOCATION_FILTER ("End for FETCH or fill").

    Returns:
        The range clipped to ``largest``, or ``None``: nothing published, a
        start after Largest Object (always so for NEXT_OBJECT), or an empty
        range. FETCH answers REQUEST_ERROR(INVALID_RANGE); a fill opens nothing.
    """
    if largest is None:
        return None
    start = _start(lf, largest)
    if start is None or start > largest:
        return None
    end, _ = _filter_end(lf)
    end = largest if end is None else min(end, largest)
    if end < start:
        return None
    return FetchRange(start, end)


def fill_range(
    inner: LocationFilter | None,
    subscription: LocationFilter | None,
    largest: Location | None,
) -> FetchRange | None:
    """The fill range of FILL_PARAMETERS (wire reference 6 item 2).

    Args:
        inner: the LOCATION_FILTER inside FILL_PARAMETERS, ``None`` if absent.
        subscription: the subscription's filter in effect (after the RU that
            carried FILL_PARAMETERS was applied), ``None`` if it has none.
        largest: the same Largest Object the subscription window was resolved
            against (one atomic step, A27).
    """
    return fetch_range(inner if inner is not None else subscription, largest)


# --- range filters ---------------------------------------------------------------

_OBJECT_KINDS: Final = frozenset(
    {
        ParameterType.SUBGROUP_FILTER,
        ParameterType.OBJECTID_FILTER,
        ParameterType.PRIORITY_FILTER,
        ParameterType.OBJECT_PROPERTY_FILTER,
    }
)


def _in_ranges(value: int, ranges: tuple[Range, ...]) -> bool:
    for s, e in ranges:  # ascending; ORed
        if value < s:
            return False
        if e is None or value <= e:
            return True
    return False


def property_values(props: KeyValuePairs, property_type: int) -> list[int]:
    """Every value of even ``property_type`` in ``props`` and inside IMMUTABLE_PROPERTIES.

    An unparsable IMMUTABLE_PROPERTIES value is skipped (judging it malformed is
    the receiver's business, wire reference 7.9).
    """
    out: list[int] = []
    for p in props:
        if p.type == property_type and isinstance(p.value, int):
            out.append(p.value)
        elif p.type == PropertyType.IMMUTABLE_PROPERTIES and isinstance(p.value, bytes):
            try:
                inner = read_kvps(p.value, 0, len(p.value), what="IMMUTABLE_PROPERTIES")
            except CodecError:
                continue
            out.extend(
                q.value for q in inner if q.type == property_type and isinstance(q.value, int)
            )
    return out


def _filter_matches(f: RangeFilter, obj: FilterableObject) -> bool:
    kind = f.kind
    if kind == ParameterType.OBJECTID_FILTER:
        return _in_ranges(obj.object_id, f.ranges)
    if kind == ParameterType.SUBGROUP_FILTER:
        sg = obj.subgroup_id
        return sg is not None and _in_ranges(sg, f.ranges)
    if kind == ParameterType.PRIORITY_FILTER:
        return _in_ranges(obj.publisher_priority, f.ranges)
    return _property_matches(f, obj.properties)


def _property_matches(f: RangeFilter, props: KeyValuePairs) -> bool:
    assert f.property_type is not None  # guaranteed for 0x28 / 0x29 by RangeFilter
    return any(_in_ranges(v, f.ranges) for v in property_values(props, f.property_type))


def _by_set(filters: Iterable[RangeFilter]) -> dict[int, tuple[RangeFilter, ...]]:
    sets: dict[int, list[RangeFilter]] = {}
    for f in filters:
        sets.setdefault(f.set_id, []).append(f)
    return {k: tuple(v) for k, v in sorted(sets.items())}


def _as_filters(value: Iterable[RangeFilter]) -> tuple[RangeFilter, ...]:
    return tuple(value)


@attrs.frozen
class RangeFilterSet:
    """The range filters in effect for one request (d21 section 3.3.2); immutable.

    Raises:
        ValueError: a non-RangeFilter item, or the same (type, SetID, Property
            Type) twice (REQUEST_ERROR(INVALID_FILTER) territory, checked by the
            session before it builds the set).
    """

    filters: tuple[RangeFilter, ...] = attrs.field(default=(), converter=_as_filters)
    _object_sets: dict[int, tuple[RangeFilter, ...]] = attrs.field(init=False, eq=False, repr=False)
    _track_sets: dict[int, tuple[RangeFilter, ...]] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        for f in self.filters:
            if not isinstance(f, RangeFilter):
                raise ValueError(f"{f!r} is not a RangeFilter")
        reason = invalid_filter_reason(self.filters)
        if reason is not None:
            raise ValueError(reason)
        obj = _by_set(f for f in self.filters if f.kind in _OBJECT_KINDS)
        trk = _by_set(f for f in self.filters if f.kind == ParameterType.TRACK_PROPERTY_FILTER)
        object.__setattr__(self, "_object_sets", obj)
        object.__setattr__(self, "_track_sets", trk)

    @classmethod
    def from_params(cls, params: Iterable[MessageParameter]) -> RangeFilterSet:
        """The range filters of a SUBSCRIBE / FETCH / FILL parameter block.

        Other parameter types are ignored; so is a Length-0 range filter
        (:class:`RangeFilterRemove`, meaningful only in REQUEST_UPDATE).

        Raises:
            ValueError: an :class:`InvalidRangeFilter` or a repeated (type, SetID).
        """
        filters: list[RangeFilter] = []
        for p in params:
            if isinstance(p, InvalidRangeFilter):
                raise ValueError(f"invalid {p.kind.name}: {p.reason}")
            if isinstance(p, RangeFilter):
                filters.append(p)
        return cls(filters)

    @property
    def is_empty(self) -> bool:
        """No range filter at all: everything matches."""
        return not self.filters

    @property
    def filters_objects(self) -> bool:
        """Some object-level filter exists (else :meth:`matches` is always True)."""
        return bool(self._object_sets)

    @property
    def total_ranges(self) -> int:
        """Number of ranges over all filters (checked against MAX_FILTER_RANGES)."""
        return sum(len(f.ranges) for f in self.filters)

    def matches(self, obj: FilterableObject) -> bool:
        """OR over SetIDs of (AND over that SetID's object filters of (OR over ranges)).

        True when there is no object-level filter. A filter with no ranges
        matches nothing (an empty OR); an object without the Subgroup ID or
        property a filter looks at fails it (A25).
        """
        if not self._object_sets:
            return True
        return any(all(_filter_matches(f, obj) for f in fs) for fs in self._object_sets.values())

    def matches_track(self, track_properties: KeyValuePairs) -> bool:
        """TRACK_PROPERTY_FILTER alone, same SetID logic: does SUBSCRIBE_TRACKS yield this track?"""
        if not self._track_sets:
            return True
        return any(
            all(_property_matches(f, track_properties) for f in fs)
            for fs in self._track_sets.values()
        )

    def apply_update(self, params: Iterable[MessageParameter]) -> RangeFilterSet:
        """The set after a REQUEST_UPDATE (wire reference 5.5 and 5.9), or for a fill.

        A range-filter type present in ``params`` replaces *all* earlier filters
        of that type by the ones in ``params``; a Length-0 instance
        (:class:`RangeFilterRemove`) removes them; types absent stay unchanged.
        The same rule gives a fill's filters from the subscription's and the
        FILL_PARAMETERS inner block (wire reference 5.6: inner values override,
        omitted ones are inherited): ``subscription.apply_update(inner)``.

        Raises:
            ValueError: an :class:`InvalidRangeFilter` or a repeated (type, SetID).
        """
        present: set[ParameterType] = set()
        new: list[RangeFilter] = []
        for p in params:
            if isinstance(p, InvalidRangeFilter):
                raise ValueError(f"invalid {p.kind.name}: {p.reason}")
            if isinstance(p, RangeFilterRemove):
                present.add(p.kind)
            elif isinstance(p, RangeFilter):
                present.add(p.kind)
                new.append(p)
        if not present:
            return self
        kept = [f for f in self.filters if f.kind not in present]
        return RangeFilterSet([*kept, *new])


EMPTY_RANGE_FILTERS: Final = RangeFilterSet()
"""No range filter: everything matches."""


def passes(
    obj: FilterableObject,
    window: Window,
    range_filters: RangeFilterSet | None,
    forward: bool,
) -> bool:
    """``Forward AND LocationFilter AND every RangeFilter`` (d21 section 3.3.3).

    Status objects (End of Group, End of Track) are judged like any object: the
    text makes no exception for them.
    """
    return (
        forward
        and window.contains(obj.location)
        and (range_filters is None or range_filters.matches(obj))
    )


def request_ranges(params: Parameters) -> int:
    """Ranges of every range filter of a request, FILL_PARAMETERS included: what
    MAX_FILTER_RANGES bounds for one subscription or fetch (d21 section 9.1)."""
    ranges = sum(len(f.ranges) for f in params if isinstance(f, RangeFilter))
    for fill in params.all(FillParameters):
        ranges += sum(len(f.ranges) for f in fill.params if isinstance(f, RangeFilter))
    return ranges
