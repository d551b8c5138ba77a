"""The Message Parameter base class, LOCATION_FILTER and the range filters.

Theory of operation
-------------------
Split out of ``params.py`` (which imports this module) to keep both files
small. Everything here follows MOQT-22-WIRE.md:

* :class:`MessageParameter` is the common base of every parameter class
  (section 2.4): it knows its type code (``TYPE``, or ``kind`` for the range
  filters whose one class serves five codes) and how to write its value. The
  Type Delta and the count are written by ``params.encode_parameters``.
* :class:`LocationFilter` is the d22 typed LOCATION_FILTER (0x21, section 5.4):
  ``Location Filter Type (vi64)`` followed by exactly the vi64 fields that type
  names, no Length. An unknown type, or an EndGroupDelta that takes EndGroup
  past 2**64-1, is a PROTOCOL_VIOLATION (Ambiguity A2 (a) and (f)).
* The range filters 0x25-0x29 (section 5.5) are length-prefixed:
  ``SetID (8)``, ``[Property Type (vi64)]`` for 0x28/0x29, then delta-coded
  ranges ``Start, [End]`` where only the last End may be omitted. Their problems
  (delta overflow, odd property type, a value that stops inside a field, a
  priority above 255) are REQUEST_ERROR(INVALID_FILTER), not session errors
  (Appendix A), so the decoder never raises for them: it yields an
  :class:`InvalidRangeFilter` holding the raw value, which the session answers
  with INVALID_FILTER and which re-encodes byte for byte. Length 0 is
  :class:`RangeFilterRemove` ("remove this filter type", meaningful in
  REQUEST_UPDATE only; the session judges it elsewhere). Only a Length that runs
  past the enclosing message is a framing error (raised by the caller).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Final

import attrs

from kvcs_core.wire.codes import MAX_VI64, LocationFilterType, ParameterType
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.names import Location
from kvcs_core.wire.reader import read_bytes, read_vi64
from kvcs_core.wire.varint import Buffer, encode_vi64

__all__ = [
    "PROPERTY_FILTER_TYPES",
    "RANGE_FILTER_TYPES",
    "InvalidRangeFilter",
    "LocationFilter",
    "MessageParameter",
    "Range",
    "RangeFilter",
    "RangeFilterRemove",
    "invalid_filter_reason",
    "read_location_filter",
    "read_range_filter",
    "vi64_validator",
]


def vi64_validator(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    """attrs validator: ``value`` is an int in 0..2**64-1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VI64:
        raise EncodeError(f"{attr.name} {value!r} is not a vi64 (0..2**64-1)")


def _check_opt_vi64(value: int | None, what: str) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VI64
    ):
        raise EncodeError(f"{what} {value!r} is not a vi64 (0..2**64-1)")


class MessageParameter:
    """Common base of every Message Parameter class (d21 section 9.20).

    Subclasses are frozen attrs classes with a ``TYPE`` class attribute (the
    range-filter classes have a ``kind`` field instead) and write their value
    with :meth:`encode_value`.
    """

    __slots__ = ()
    TYPE: ClassVar[ParameterType]

    @property
    def type(self) -> ParameterType:
        """The parameter type code written on the wire."""
        return self.TYPE

    def encode_value(self, out: bytearray) -> None:
        """Append the value (everything after the Type Delta)."""
        raise NotImplementedError


# --- LOCATION_FILTER (0x21) ----------------------------------------------------

_LF_FIELD_COUNT: Final[dict[LocationFilterType, int]] = {
    LocationFilterType.NONE: 0,
    LocationFilterType.RELATIVE_START: 1,
    LocationFilterType.ABSOLUTE_START: 2,
    LocationFilterType.ABSOLUTE_GROUP_END: 3,
    LocationFilterType.ABSOLUTE_RANGE: 4,
    LocationFilterType.NEXT_OBJECT: 0,
}
_LF_NAMES: Final = ("start_group", "start_object", "end_group_delta", "end_object")


def _to_lf_type(value: int) -> LocationFilterType:
    try:
        return LocationFilterType(value)
    except ValueError:
        raise EncodeError(f"unknown Location Filter Type {value!r}") from None


@attrs.frozen
class LocationFilter(MessageParameter):
    """LOCATION_FILTER (0x21), d22 typed form (wire reference 5.4).

    The optional fields are present exactly as ``filter_type`` requires:
    NONE and NEXT_OBJECT none; RELATIVE_START ``start_group`` (groups back);
    ABSOLUTE_START ``start_group, start_object``; ABSOLUTE_GROUP_END adds
    ``end_group_delta``; ABSOLUTE_RANGE adds ``end_object`` (inclusive).
    Prefer the class-method constructors.
    """

    TYPE: ClassVar[ParameterType] = ParameterType.LOCATION_FILTER
    filter_type: LocationFilterType = attrs.field(converter=_to_lf_type)
    start_group: int | None = None
    start_object: int | None = None
    end_group_delta: int | None = None
    end_object: int | None = None

    def __attrs_post_init__(self) -> None:
        n = _LF_FIELD_COUNT[self.filter_type]
        for i, (name, value) in enumerate(zip(_LF_NAMES, self._values(), strict=True)):
            if (value is not None) != (i < n):
                need = "needs" if i < n else "must not have"
                raise EncodeError(f"{self.filter_type.name} filter {need} {name}")
            _check_opt_vi64(value, name)
        if self.end_group_delta is not None:
            assert self.start_group is not None
            if self.start_group + self.end_group_delta > MAX_VI64:
                raise EncodeError("EndGroupDelta takes EndGroup past 2**64-1")

    def _values(self) -> tuple[int | None, int | None, int | None, int | None]:
        return (self.start_group, self.start_object, self.end_group_delta, self.end_object)

    @classmethod
    def none(cls) -> LocationFilter:
        """NONE (0x0): no filter; in REQUEST_UPDATE it removes the filter."""
        return cls(LocationFilterType.NONE)

    @classmethod
    def next_object(cls) -> LocationFilter:
        """NEXT_OBJECT (0x5): start at {LG, LO+1} (the live edge)."""
        return cls(LocationFilterType.NEXT_OBJECT)

    @classmethod
    def relative_start(cls, groups_back: int) -> LocationFilter:
        """RELATIVE_START (0x1): start at {LG + 1 - groups_back, 0}."""
        return cls(LocationFilterType.RELATIVE_START, groups_back)

    @classmethod
    def absolute_start(cls, group: int, obj: int) -> LocationFilter:
        """ABSOLUTE_START (0x2): start at {group, obj}; open end."""
        return cls(LocationFilterType.ABSOLUTE_START, group, obj)

    @classmethod
    def absolute_group_end(cls, group: int, obj: int, end_group: int) -> LocationFilter:
        """ABSOLUTE_GROUP_END (0x3): {group, obj} to the end of ``end_group`` (absolute)."""
        if end_group < group:
            raise EncodeError(f"end group {end_group} is before start group {group}")
        return cls(LocationFilterType.ABSOLUTE_GROUP_END, group, obj, end_group - group)

    @classmethod
    def absolute_range(
        cls, group: int, obj: int, end_group: int, end_object: int
    ) -> LocationFilter:
        """ABSOLUTE_RANGE (0x4): {group, obj} to {end_group, end_object}, inclusive."""
        if end_group < group:
            raise EncodeError(f"end group {end_group} is before start group {group}")
        return cls(LocationFilterType.ABSOLUTE_RANGE, group, obj, end_group - group, end_object)

    @property
    def end_group(self) -> int | None:
        """StartGroup + EndGroupDelta, for the two types that have an end group."""
        if self.end_group_delta is None or self.start_group is None:
            return None
        return self.start_group + self.end_group_delta

    @property
    def start(self) -> Location | None:
        """The absolute start for types 0x2-0x4, else ``None`` (it depends on Largest)."""
        if self.start_object is None or self.start_group is None:
            return None
        return Location(self.start_group, self.start_object)

    @property
    def end(self) -> Location | None:
        """The inclusive end of an ABSOLUTE_RANGE, else ``None``."""
        eg = self.end_group
        if eg is None or self.end_object is None:
            return None
        return Location(eg, self.end_object)

    def encode_value(self, out: bytearray) -> None:
        """Append ``Location Filter Type`` and its fields (no Length)."""
        out += encode_vi64(self.filter_type)
        for v in self._values():
            if v is not None:
                out += encode_vi64(v)


def read_location_filter(buf: Buffer, pos: int) -> tuple[LocationFilter, int]:
    """Read a d22 LOCATION_FILTER value at ``pos`` (Incomplete on a short buffer).

    An unknown Location Filter Type and an EndGroupDelta overflow are PV.
    """
    start = pos
    t, pos = read_vi64(buf, pos)
    try:
        ft = LocationFilterType(t)
    except ValueError:
        # Ambiguity A2 (a): unknown Location Filter Type -> PV.
        raise CodecError(f"unknown Location Filter Type {t:#x}", offset=start) from None
    vals: list[int | None] = [None, None, None, None]
    for i in range(_LF_FIELD_COUNT[ft]):
        vals[i], pos = read_vi64(buf, pos)
    sg, egd = vals[0], vals[2]
    if sg is not None and egd is not None and sg + egd > MAX_VI64:
        # Ambiguity A2 (f): EndGroupDelta overflow -> PV.
        raise CodecError("LOCATION_FILTER EndGroupDelta overflows 2**64-1", offset=start)
    return LocationFilter(ft, vals[0], vals[1], vals[2], vals[3]), pos


# --- range filters (0x25-0x29) --------------------------------------------------

RANGE_FILTER_TYPES: Final[frozenset[ParameterType]] = frozenset(
    {
        ParameterType.SUBGROUP_FILTER,
        ParameterType.OBJECTID_FILTER,
        ParameterType.PRIORITY_FILTER,
        ParameterType.OBJECT_PROPERTY_FILTER,
        ParameterType.TRACK_PROPERTY_FILTER,
    }
)
"""The five range-filter parameter types (section 5.5)."""

PROPERTY_FILTER_TYPES: Final[frozenset[ParameterType]] = frozenset(
    {ParameterType.OBJECT_PROPERTY_FILTER, ParameterType.TRACK_PROPERTY_FILTER}
)
"""Range filters that carry a Property Type after the SetID."""

Range = tuple[int, int | None]
"""One inclusive range ``(start, end)``; ``end`` is ``None`` for an open last range."""


def _to_range_kind(value: int) -> ParameterType:
    if value not in RANGE_FILTER_TYPES:
        raise EncodeError(f"{value!r} is not a range-filter parameter type (0x25-0x29)")
    return ParameterType(value)


def _to_ranges(value: Iterable[tuple[int, int | None]]) -> tuple[Range, ...]:
    return tuple((s, e) for s, e in value)


@attrs.frozen
class RangeFilter(MessageParameter):
    """A range filter 0x25-0x29 (wire reference 5.5), with absolute inclusive ranges.

    ``property_type`` is present (and even) exactly for OBJECT_PROPERTY_FILTER
    and TRACK_PROPERTY_FILTER. Ranges must ascend (each start at or after the
    previous end); only the last may be open (``end=None``). On the wire they are
    delta coded: ranges 3-5 and 10-15 are ``03 02 05 05``.
    """

    TYPES: ClassVar[frozenset[ParameterType]] = RANGE_FILTER_TYPES
    kind: ParameterType = attrs.field(converter=_to_range_kind)
    set_id: int
    property_type: int | None = None
    ranges: tuple[Range, ...] = attrs.field(default=(), converter=_to_ranges)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.set_id, bool) or not isinstance(self.set_id, int):
            raise EncodeError(f"SetID {self.set_id!r} is not an int")
        if not 0 <= self.set_id <= 255:
            raise EncodeError(f"SetID {self.set_id} outside 0..255")
        if self.kind in PROPERTY_FILTER_TYPES:
            if self.property_type is None:
                raise EncodeError(f"{self.kind.name} needs a property_type")
            _check_opt_vi64(self.property_type, "property_type")
            if self.property_type & 1:
                raise EncodeError(f"property_type {self.property_type:#x} is odd")
        elif self.property_type is not None:
            raise EncodeError(f"{self.kind.name} has no property_type")
        prev_end = 0
        last = len(self.ranges) - 1
        for i, (s, e) in enumerate(self.ranges):
            if s is None:
                raise EncodeError(f"range {i} has no start")
            _check_opt_vi64(s, "range start")
            _check_opt_vi64(e, "range end")
            if s < prev_end:
                raise EncodeError(f"range {i} starts at {s}, before the previous end {prev_end}")
            if e is None:
                if i != last:
                    raise EncodeError("only the last range may omit its end")
            elif e < s:
                raise EncodeError(f"range {i} ends ({e}) before it starts ({s})")
            else:
                prev_end = e
            if self.kind == ParameterType.PRIORITY_FILTER and max(s, e or 0) > 255:
                raise EncodeError("PRIORITY_FILTER values are at most 255")

    @property
    def type(self) -> ParameterType:
        """The parameter type code (``kind``)."""
        return self.kind

    def value_bytes(self) -> bytes:
        """The value after its Length: SetID, [Property Type], delta-coded ranges."""
        out = bytearray((self.set_id,))
        if self.property_type is not None:
            out += encode_vi64(self.property_type)
        prev_end = 0
        for s, e in self.ranges:
            out += encode_vi64(s - prev_end)
            if e is not None:
                out += encode_vi64(e - s)
                prev_end = e
        return bytes(out)

    def encode_value(self, out: bytearray) -> None:
        """Append ``Length`` and the value."""
        raw = self.value_bytes()
        out += encode_vi64(len(raw))
        out += raw


@attrs.frozen
class RangeFilterRemove(MessageParameter):
    """A range filter with Length 0: remove every filter of ``kind`` (REQUEST_UPDATE)."""

    TYPES: ClassVar[frozenset[ParameterType]] = RANGE_FILTER_TYPES
    kind: ParameterType = attrs.field(converter=_to_range_kind)

    @property
    def type(self) -> ParameterType:
        """The parameter type code (``kind``)."""
        return self.kind

    def encode_value(self, out: bytearray) -> None:
        """Append a zero Length."""
        out.append(0)


def _parse_range_value(kind: ParameterType, raw: bytes) -> RangeFilter | str:
    """Parse a non-empty range-filter value; the reason it is invalid, or the filter."""
    n = len(raw)
    pos = 1  # SetID (8)
    ptype: int | None = None
    ranges: list[Range] = []
    try:
        if kind in PROPERTY_FILTER_TYPES:
            ptype, pos = read_vi64(raw, pos)
            if ptype & 1:
                return f"odd Property Type {ptype:#x}"
        prev_end = 0
        while pos < n:
            sd, pos = read_vi64(raw, pos)
            s = prev_end + sd
            if s > MAX_VI64:
                return "range Start delta overflows 2**64-1"
            if pos == n:
                ranges.append((s, None))
                break
            ed, pos = read_vi64(raw, pos)
            e = s + ed
            if e > MAX_VI64:
                return "range End delta overflows 2**64-1"
            ranges.append((s, e))
            prev_end = e
    except Incomplete:
        return "value ends inside a field"
    if kind == ParameterType.PRIORITY_FILTER and any(max(s, e or 0) > 255 for s, e in ranges):
        return "PRIORITY_FILTER value above 255"
    return RangeFilter(kind, raw[0], ptype, ranges)


@attrs.frozen
class InvalidRangeFilter(MessageParameter):
    """A range filter whose value is malformed: answer REQUEST_ERROR(INVALID_FILTER).

    Range-filter problems are request errors, not session errors (Appendix A),
    so decoding yields this instead of raising. It re-encodes ``raw`` unchanged.
    Constructing one from a ``raw`` that is in fact valid is an EncodeError;
    ``reason`` is filled in from the parser when left empty and is not compared.
    """

    TYPES: ClassVar[frozenset[ParameterType]] = RANGE_FILTER_TYPES
    kind: ParameterType = attrs.field(converter=_to_range_kind)
    raw: bytes = attrs.field(converter=bytes)
    reason: str = attrs.field(default="", eq=False)

    def __attrs_post_init__(self) -> None:
        if not self.raw:
            raise EncodeError("an empty range-filter value is RangeFilterRemove")
        parsed = _parse_range_value(self.kind, self.raw)
        if isinstance(parsed, RangeFilter):
            raise EncodeError("raw is a valid range filter: use RangeFilter")
        if not self.reason:
            object.__setattr__(self, "reason", parsed)

    @property
    def type(self) -> ParameterType:
        """The parameter type code (``kind``)."""
        return self.kind

    def encode_value(self, out: bytearray) -> None:
        """Append ``Length`` and the raw value."""
        out += encode_vi64(len(self.raw))
        out += self.raw


def read_range_filter(
    buf: Buffer, pos: int, kind: ParameterType
) -> tuple[RangeFilter | RangeFilterRemove | InvalidRangeFilter, int]:
    """Read a length-prefixed range-filter value of type ``kind`` at ``pos``.

    Never raises for a malformed value (see :class:`InvalidRangeFilter`); raises
    Incomplete when the Length runs past the buffer.
    """
    length, pos = read_vi64(buf, pos)
    if length == 0:
        return RangeFilterRemove(kind), pos
    view, pos = read_bytes(buf, pos, length)
    raw = bytes(view)
    parsed = _parse_range_value(kind, raw)
    if isinstance(parsed, str):
        return InvalidRangeFilter(kind, raw, parsed), pos
    return parsed, pos


def invalid_filter_reason(params: Iterable[MessageParameter]) -> str | None:
    """Why a parameter block's range filters earn REQUEST_ERROR(INVALID_FILTER), if they do.

    Checks for an :class:`InvalidRangeFilter` and for the same (type, SetID,
    Property Type) twice in one message (section 5.5). The MAX_FILTER_RANGES
    budget is the session's business.
    """
    seen: set[tuple[int, int, int | None]] = set()
    for p in params:
        if isinstance(p, InvalidRangeFilter):
            return f"{p.kind.name}: {p.reason}"
        if isinstance(p, RangeFilter):
            key = (p.kind, p.set_id, p.property_type)
            if key in seen:
                return f"{p.kind.name} repeats SetID {p.set_id}"
            seen.add(key)
    return None
