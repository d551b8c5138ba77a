"""Fetch and fill streams: FETCH_HEADER, fetch objects, End-of-Range markers.

Theory of operation
-------------------
A fetch stream (d21 sections 11.4.1, 11.4.1.1 and 11.4.1.2; wire reference 7.5)
answers a FETCH, or carries a fill for a SUBSCRIBE, REQUEST_UPDATE or PUBLISH
(d21 section 3.4). It starts with ``FETCH_HEADER { 0x05, Request ID }`` and then
carries *items* until FIN, each starting with Serialization Flags (vi64)::

    [Group ID Delta] [Subgroup ID] [Object ID Delta] [Priority (8)]
    [Properties Length, KVPs] Object Payload Length [Payload]

Flags below 128 are bits (mode 0x03, Object ID Delta 0x04, Group ID Delta 0x08,
Priority 0x10, Properties 0x20, Datagram 0x40); there is no Object Status on
fetch streams. Flags 0x8C, 0x10C and 0x20C are End-of-Range markers that carry
two *absolute* vi64 (Group ID, Object ID) and nothing else, no payload length
(wire reference A4). Any other value of 128 or more is PROTOCOL_VIOLATION.

Decoding follows the pseudo-code of wire reference 7.5 exactly:

* the first item that is an object must carry 0x08 and 0x04, both absolute;
  it must not refer to a prior Subgroup ID (mode 1/2) or priority (no 0x10);
* with 0x08 the Group ID is ``prior + delta + 1`` in Ascending order and
  ``prior - (delta + 1)`` in Descending order, which is why the decoder needs
  the request's effective group order (a fixed :class:`GroupOrder` or a
  callable given the Request ID once the header is read); the Object ID is
  then the absolute delta, or ``prior + 1`` literally when 0x04 is clear;
* without 0x08 the Object ID is ``prior + delta`` with 0x04 (no +1, wire
  reference A5) and ``prior + 1`` without;
* after a marker the "prior" Group and Object IDs are the marker's, while the
  prior Subgroup ID and priority stay those of the last real object (using
  them before any real object is PROTOCOL_VIOLATION); a Datagram-preference
  object has no Subgroup ID and leaves the prior one unchanged;
* a computed Group, Subgroup or Object ID outside 0..2**64-1 is
  PROTOCOL_VIOLATION.

The order checks of d21 section 11.4.1 (ascending Object IDs within a group,
groups in the requested order) make a track *malformed* (d21 section 12.1),
which is not a session error: the decoder returns the IDs as sent and leaves
that judgement, and the gap semantics of wire reference A24, to the caller.

:class:`FetchStreamWriter` encodes exactly as wire reference 7.5 "Encoder
(what both aiomoqt and our reference do)" says: the first object ``0x1C`` plus
mode; the same group with ``ID + 1`` omits 0x04; a group change sets 0x08 and
0x04 with an absolute Object ID; the priority byte only when it changes;
subgroup mode 0 for Subgroup ID 0, 1 for "same as prior", 2 for "prior + 1",
else 3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs

from kvcs_core.wire._objstream import (
    DEFAULT_MAX_PAYLOAD_SIZE,
    DEFAULT_MAX_PROPERTIES_SIZE,
    EMPTY_VIEW,
    ObjectStreamDecoder,
    as_props,
    as_view,
    check_bool,
    check_priority,
    check_vi64,
    payload_repr,
    slot_setter,
)
from kvcs_core.wire.codes import EndOfRange, GroupOrder, UniStreamType
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.kvp import EMPTY_KVPS, KeyValuePair, KeyValuePairs, kvps_bytes
from kvcs_core.wire.names import Location
from kvcs_core.wire.varint import MAX_VI64, Buffer, encode_vi64, read_vi64

__all__ = [
    "EndOfRangeMarker",
    "FetchHeader",
    "FetchItem",
    "FetchObject",
    "FetchStreamDecoder",
    "FetchStreamWriter",
    "GroupOrderSource",
    "encode_fetch_header",
    "encode_fetch_stream",
]

# Serialization Flags bits (d21 section 11.4.1.1; wire reference 7.5).
SF_MODE: Final = 0x03
SF_OBJECT_DELTA: Final = 0x04
SF_GROUP_DELTA: Final = 0x08
SF_PRIORITY: Final = 0x10
SF_PROPERTIES: Final = 0x20
SF_DATAGRAM: Final = 0x40

_END_OF_RANGE: Final[dict[int, EndOfRange]] = {k.value: k for k in EndOfRange}
_MAX: Final = MAX_VI64
_FETCH_HEADER: Final = int(UniStreamType.FETCH_HEADER)
_new = object.__new__
_set = object.__setattr__

GroupOrderSource = GroupOrder | Callable[[int], GroupOrder]
"""A fixed group order, or a callable mapping the FETCH_HEADER Request ID to one."""


def _as_fetch_props(value: Iterable[KeyValuePair] | None) -> KeyValuePairs:
    props = as_props(value)
    return EMPTY_KVPS if props is None else props


@attrs.frozen
class FetchHeader:
    """FETCH_HEADER: the Request ID of the FETCH (or of the subscription being filled)."""

    request_id: int

    def __attrs_post_init__(self) -> None:
        check_vi64(self.request_id, "Request ID")


@attrs.frozen
class FetchObject:
    """One object of a fetch stream (d21 section 11.4.1).

    ``subgroup_id`` is ``None`` exactly when ``datagram`` is true (forwarding
    preference Datagram, flag 0x40). ``properties`` is a tuple, empty when
    absent. ``payload`` is a memoryview; equality compares its contents and the
    hash leaves it out.
    """

    group_id: int
    object_id: int
    subgroup_id: int | None
    publisher_priority: int
    properties: KeyValuePairs = attrs.field(default=EMPTY_KVPS, converter=_as_fetch_props)
    payload: memoryview = attrs.field(
        default=EMPTY_VIEW, converter=as_view, repr=payload_repr, hash=False
    )
    datagram: bool = False

    def __attrs_post_init__(self) -> None:
        check_vi64(self.group_id, "Group ID")
        check_vi64(self.object_id, "Object ID")
        check_priority(self.publisher_priority)
        check_bool(self.datagram, "datagram")
        if self.datagram:
            if self.subgroup_id is not None:
                raise EncodeError("a Datagram-preference fetch object has no Subgroup ID")
        elif self.subgroup_id is None:
            raise EncodeError("subgroup_id is required unless datagram=True")
        else:
            check_vi64(self.subgroup_id, "Subgroup ID")

    @property
    def location(self) -> Location:
        """``Location(group_id, object_id)``."""
        return Location(self.group_id, self.object_id)


def _as_eor(value: int) -> EndOfRange:
    try:
        return EndOfRange(value)
    except ValueError:
        raise EncodeError(f"{value!r} is not an End-of-Range kind (0x8C, 0x10C, 0x20C)") from None


@attrs.frozen
class EndOfRangeMarker:
    """End of Non-Existent / Unknown / Timed-Out Range through ``location`` (inclusive)."""

    kind: EndOfRange = attrs.field(converter=_as_eor)
    location: Location

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.location, Location):
            raise EncodeError("an End-of-Range marker needs a Location")


FetchItem = FetchHeader | FetchObject | EndOfRangeMarker
"""What :class:`FetchStreamDecoder` returns: the header first, then objects and markers."""

_FO_GROUP_ID = slot_setter(FetchObject, "group_id")
_FO_OBJECT_ID = slot_setter(FetchObject, "object_id")
_FO_SUBGROUP_ID = slot_setter(FetchObject, "subgroup_id")
_FO_PRIORITY = slot_setter(FetchObject, "publisher_priority")
_FO_PROPERTIES = slot_setter(FetchObject, "properties")
_FO_PAYLOAD = slot_setter(FetchObject, "payload")
_FO_DATAGRAM = slot_setter(FetchObject, "datagram")


# --- encoding --------------------------------------------------------------------


_FLAG_ZERO_SUB: Final = encode_vi64(0)  # Serialization Flags 0: Subgroup ID 0, all "prior"
_FLAG_SAME_SUB: Final = encode_vi64(1)  # mode 1: the prior object's Subgroup ID


def encode_fetch_header(request_id: int) -> bytes:
    """``05`` + Request ID."""
    return b"\x05" + encode_vi64(check_vi64(request_id, "Request ID"))


def _order(group_order: object) -> GroupOrder:
    try:
        return GroupOrder(group_order)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise EncodeError(f"group order {group_order!r} is not Ascending or Descending") from None


class FetchStreamWriter:
    """Writes one fetch (or fill) stream: header, object prefixes, End-of-Range markers.

    Send ``header_bytes()``, then per object ``object_prefix(...)`` followed by
    its payload buffer (scatter/gather), and ``end_of_range(...)`` for markers,
    in the request's group order; then FIN. Raises :class:`EncodeError` for
    input that cannot be encoded, including items out of order (Group IDs not
    in ``group_order``, Object IDs not ascending within a group).
    """

    __slots__ = ("_desc", "_g", "_o", "_prio", "_sub", "group_order", "request_id")

    def __init__(self, request_id: int, group_order: GroupOrder) -> None:
        self.request_id: Final = check_vi64(request_id, "Request ID")
        self.group_order: Final = _order(group_order)
        self._desc = self.group_order is GroupOrder.DESCENDING
        self._g = -1  # prior Group ID (object or marker); -1: nothing written yet
        self._o = -1
        self._sub = -1  # Subgroup ID of the last real non-datagram object
        self._prio = -1  # priority of the last real object

    def header_bytes(self) -> bytes:
        """The FETCH_HEADER; send it first."""
        return encode_fetch_header(self.request_id)

    def _position(self, group_id: int, object_id: int, what: str) -> tuple[int, int, int]:
        """(flags, group delta, object delta) for the next item at ``{group, object}``."""
        check_vi64(group_id, "Group ID")
        check_vi64(object_id, "Object ID")
        g0 = self._g
        if g0 < 0:
            return SF_GROUP_DELTA | SF_OBJECT_DELTA, group_id, object_id
        if group_id == g0:
            o0 = self._o
            if object_id <= o0:
                raise EncodeError(
                    f"{what} {{{group_id},{object_id}}} does not follow {{{g0},{o0}}}"
                    " (Object IDs ascend within a group)"
                )
            if object_id == o0 + 1:
                return 0, 0, 0
            return SF_OBJECT_DELTA, 0, object_id - o0
        if self._desc:
            if group_id > g0:
                raise EncodeError(f"{what} group {group_id} after {g0} in Descending order")
            gd = g0 - group_id - 1
        else:
            if group_id < g0:
                raise EncodeError(f"{what} group {group_id} after {g0} in Ascending order")
            gd = group_id - g0 - 1
        return SF_GROUP_DELTA | SF_OBJECT_DELTA, gd, object_id

    def object_prefix(
        self,
        group_id: int,
        object_id: int,
        *,
        subgroup_id: int | None,
        publisher_priority: int,
        properties: Iterable[KeyValuePair] | None = None,
        payload_length: int,
        datagram: bool = False,
    ) -> bytes:
        """Everything of a fetch object before its payload."""
        if (
            # fast path: the next object of the same group, same priority and subgroup,
            # no properties -- every value was checked when the previous one was written
            type(object_id) is int
            and object_id == self._o + 1
            and group_id == self._g
            and publisher_priority == self._prio
            and datagram is False
            and not properties
            and subgroup_id in (0, self._sub)
            and type(payload_length) is int
            and 0 <= payload_length <= MAX_VI64
        ):
            self._o = object_id
            self._sub = subgroup_id  # mode 0 makes 0 the prior Subgroup ID too
            return (_FLAG_SAME_SUB if subgroup_id else _FLAG_ZERO_SUB) + encode_vi64(payload_length)
        check_bool(datagram, "datagram")
        check_priority(publisher_priority)
        check_vi64(payload_length, "Object Payload Length")
        props = as_props(properties)
        flags, gd, od = self._position(group_id, object_id, "object")
        sub = self._sub
        if datagram:
            if subgroup_id is not None:
                raise EncodeError("a Datagram-preference fetch object has no Subgroup ID")
            flags |= SF_DATAGRAM
            sg_field = -1
        else:
            if subgroup_id is None:
                raise EncodeError("subgroup_id is required unless datagram=True")
            check_vi64(subgroup_id, "Subgroup ID")
            sg_field = -1
            if subgroup_id == 0:
                pass
            elif sub >= 0 and subgroup_id == sub:
                flags |= 1
            elif sub >= 0 and subgroup_id == sub + 1:
                flags |= 2
            else:
                flags |= 3
                sg_field = subgroup_id
        if publisher_priority != self._prio:
            flags |= SF_PRIORITY
        if props:
            flags |= SF_PROPERTIES
        out = bytearray(encode_vi64(flags))
        if flags & SF_GROUP_DELTA:
            out += encode_vi64(gd)
        if sg_field >= 0:
            out += encode_vi64(sg_field)
        if flags & SF_OBJECT_DELTA:
            out += encode_vi64(od)
        if flags & SF_PRIORITY:
            out.append(publisher_priority)
        if props:
            pb = kvps_bytes(props)
            out += encode_vi64(len(pb))
            out += pb
        out += encode_vi64(payload_length)
        self._g = group_id
        self._o = object_id
        self._prio = publisher_priority
        if not datagram:
            self._sub = subgroup_id  # type: ignore[assignment]
        return bytes(out)

    def end_of_range(self, kind: EndOfRange, location: Location) -> bytes:
        """An End-of-Range marker through ``location``: flags + two absolute vi64 (A4)."""
        k = _as_eor(kind)
        if not isinstance(location, Location):
            raise EncodeError("end_of_range needs a Location")
        self._position(location.group, location.object, "End-of-Range marker")
        self._g = location.group
        self._o = location.object
        return encode_vi64(k) + encode_vi64(location.group) + encode_vi64(location.object)

    def item_bytes(self, item: FetchObject | EndOfRangeMarker) -> bytes:
        """An object (prefix and payload, copied) or a marker as one string (convenience)."""
        if isinstance(item, EndOfRangeMarker):
            return self.end_of_range(item.kind, item.location)
        return (
            self.object_prefix(
                item.group_id,
                item.object_id,
                subgroup_id=item.subgroup_id,
                publisher_priority=item.publisher_priority,
                properties=item.properties,
                payload_length=item.payload.nbytes,
                datagram=item.datagram,
            )
            + item.payload
        )


def encode_fetch_stream(
    request_id: int, group_order: GroupOrder, items: Iterable[FetchObject | EndOfRangeMarker]
) -> bytes:
    """A whole fetch stream as one byte string (tests, fixtures; copies payloads)."""
    w = FetchStreamWriter(request_id, group_order)
    out = bytearray(w.header_bytes())
    for it in items:
        out += w.item_bytes(it)
    return bytes(out)


# --- decoding --------------------------------------------------------------------


class FetchStreamDecoder(ObjectStreamDecoder[FetchItem]):
    """Incremental decoder of one fetch/fill stream, from its first byte (``05``).

    ``group_order`` is the request's effective group order, or a callable that
    receives the Request ID once the FETCH_HEADER is read and returns it
    (exceptions it raises propagate unchanged). ``feed`` returns the
    :class:`FetchHeader` first, then :class:`FetchObject` s and
    :class:`EndOfRangeMarker` s; payload views follow the rules of
    :class:`~kvcs_core.wire.subgroup.SubgroupStreamDecoder` (views of fed
    chunks: do not mutate a buffer after feeding it).
    """

    __slots__ = ("_desc", "_g", "_o", "_order_src", "_prio", "_request_id", "_sub", "group_order")

    def __init__(
        self,
        group_order: GroupOrderSource,
        *,
        max_payload_size: int = DEFAULT_MAX_PAYLOAD_SIZE,
        max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
    ) -> None:
        super().__init__(max_payload_size=max_payload_size, max_properties_size=max_properties_size)
        if isinstance(group_order, int):
            group_order = _order(group_order)
        elif not callable(group_order):
            raise TypeError("group_order must be a GroupOrder or a callable")
        self._order_src: GroupOrderSource = group_order
        self.group_order: GroupOrder | None = None
        """The effective group order, once known."""
        self._request_id = -1
        self._desc = False
        self._g = -1
        self._o = -1
        self._sub = -1
        self._prio = -1
        self._parse = FetchStreamDecoder._parse_header
        self._set_payload = _FO_PAYLOAD

    @property
    def request_id(self) -> int | None:
        """The FETCH_HEADER Request ID once received."""
        return self._request_id if self._request_id >= 0 else None

    def _parse_header(self, buf: Buffer, pos: int) -> tuple[int, int, Any]:
        t, p = read_vi64(buf, pos)
        if t != _FETCH_HEADER:
            raise CodecError(f"stream type {t:#x} is not FETCH_HEADER (0x05)", offset=pos)
        rid, p = read_vi64(buf, p)
        src = self._order_src
        order = src if isinstance(src, GroupOrder) else _order(src(rid))
        self.group_order = order
        self._desc = order is GroupOrder.DESCENDING
        self._request_id = rid
        h = _new(FetchHeader)
        _set(h, "request_id", rid)
        self._parse = FetchStreamDecoder._parse_object
        return p, 0, h

    def _parse_object(self, buf: Buffer, pos: int) -> tuple[int, int, Any]:
        # Hot path: flag bits are literals here (0x03 SF_MODE, 0x04 SF_OBJECT_DELTA,
        # 0x08 SF_GROUP_DELTA, 0x10 SF_PRIORITY, 0x20 SF_PROPERTIES, 0x40 SF_DATAGRAM).
        try:
            b = buf[pos]
            if b < 0x80:
                f = b
                p = pos + 1
            else:
                f, p = read_vi64(buf, pos)
                if f >= 0x80:
                    kind = _END_OF_RANGE.get(f)
                    if kind is None:  # wire reference 7.5: any other value >= 128 is PV
                        raise CodecError(f"unknown Serialization Flags {f:#x}", offset=pos)
                    # A4 "End-of-Range markers": two absolute vi64, no Object Payload Length.
                    g, p = read_vi64(buf, p)
                    o, p = read_vi64(buf, p)
                    self._g = g
                    self._o = o
                    loc = _new(Location)
                    _set(loc, "group", g)
                    _set(loc, "object", o)
                    m = _new(EndOfRangeMarker)
                    _set(m, "kind", kind)
                    _set(m, "location", loc)
                    return p, 0, m
            g0 = self._g
            if g0 < 0 and f & 0x0C != 0x0C:
                raise CodecError(
                    f"first fetch object (flags {f:#x}) must carry Group ID and Object ID"
                    " (0x08 and 0x04)",
                    offset=pos,
                )
            gd = 0
            if f & 0x08:
                b = buf[p]
                if b < 0x80:
                    gd = b
                    p += 1
                else:
                    gd, p = read_vi64(buf, p)
            sg: int | None
            if f & 0x40:
                sg = None
            else:
                mode = f & 0x03
                if mode == 0:
                    sg = 0
                elif mode == 3:
                    sg, p = read_vi64(buf, p)
                else:
                    s0 = self._sub
                    if s0 < 0:
                        raise CodecError(
                            f"fetch object (flags {f:#x}) refers to the prior Subgroup ID"
                            " but no object with one precedes it",
                            offset=pos,
                        )
                    sg = s0 if mode == 1 else s0 + 1
                    if sg > _MAX:
                        raise CodecError("Subgroup ID overflows 2**64-1", offset=pos)
            od = 0
            if f & 0x04:
                b = buf[p]
                if b < 0x80:
                    od = b
                    p += 1
                else:
                    od, p = read_vi64(buf, p)
            if g0 < 0:
                g = gd
                o = od
            elif f & 0x08:
                g = g0 - gd - 1 if self._desc else g0 + gd + 1
                if g < 0 or g > _MAX:
                    raise CodecError(
                        f"Group ID {g0} {'-' if self._desc else '+'} ({gd} + 1) is out of range",
                        offset=pos,
                    )
                o = od if f & 0x04 else self._o + 1
            else:  # A5 "Fetch Object ID arithmetic": same group + 0x04 is prior + delta, no +1
                g = g0
                o = self._o + od if f & 0x04 else self._o + 1
            if o > _MAX:
                raise CodecError("Object ID overflows 2**64-1", offset=pos)
            if f & 0x10:
                prio = buf[p]
                p += 1
            else:
                prio = self._prio
                if prio < 0:
                    raise CodecError(
                        f"fetch object (flags {f:#x}) refers to the prior priority"
                        " but no object precedes it",
                        offset=pos,
                    )
            props: KeyValuePairs = EMPTY_KVPS
            if f & 0x20:
                props, p = self._read_properties(buf, p)
            length, p = self._read_payload_length(buf, p)
        except IndexError:
            raise Incomplete from None
        self._g = g
        self._o = o
        self._prio = prio
        if sg is not None:
            self._sub = sg
        obj = _new(FetchObject)
        _FO_GROUP_ID(obj, g)
        _FO_OBJECT_ID(obj, o)
        _FO_SUBGROUP_ID(obj, sg)
        _FO_PRIORITY(obj, prio)
        _FO_PROPERTIES(obj, props)
        _FO_DATAGRAM(obj, f & 0x40 != 0)
        if not length:
            _FO_PAYLOAD(obj, EMPTY_VIEW)  # else the base class sets the payload view
        return p, length, obj
