"""Subgroup streams: SUBGROUP_HEADER and its objects (d21 section 11.3.1).

Theory of operation
-------------------
A subgroup stream is a unidirectional stream whose first vi64 is the Type
Flags of its SUBGROUP_HEADER (d21 section 6.4.1 Table 2, wire reference 7.2)::

    Type Flags (vi64)  Track Alias (vi64)  Group ID (vi64)
    [Subgroup ID (vi64)]            # SUBGROUP_ID_MODE == 0b10
    [Publisher Priority (8)]        # DEFAULT_PRIORITY clear

Flags are judged by value (wire reference A20: ``80 50`` is 0x50): 0x10 must be
set, the value must be below 128 and mode 0b11 is reserved; anything else is
PROTOCOL_VIOLATION. Mode 0b01 means "Subgroup ID = Object ID of the first
object on *this stream*" (wire reference A18), so a decoded header of that mode
has ``subgroup_id=None``; :attr:`SubgroupStreamDecoder.header` fills it in once
the first object is seen.

Objects follow until FIN (d21 section 11.3.1 Figure 26, wire reference 7.3)::

    Object ID Delta (vi64)          # first: ID = delta; later: previous ID + delta + 1
    [Properties Length (vi64), KVPs]  # iff the header's PROPERTIES flag
    Object Payload Length (vi64)
    [Object Status (vi64)]          # iff the length is 0
    [Object Payload]

PROTOCOL_VIOLATION: an Object ID over 2**64-1; an unknown Object Status
(Appendix A "SHOULD PV"); properties on a non-Normal object (with the flag its
Properties Length must be 0); FIN inside an object (d21 section 11.3.1, SHOULD).
Properties such as PRIOR_OBJECT_ID_GAP are returned as plain pairs: their
meaning (and the malformed-track rules of d21 section 12.1) belongs to the
layer above.

Encoding is scatter/gather: :class:`SubgroupStreamWriter` returns small header
byte strings, and the caller writes the payload buffer it already has after
them. Decoding is incremental and zero-copy (see ``_objstream``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Final

import attrs

from kvcs_core.wire._objstream import (
    DEFAULT_MAX_PAYLOAD_SIZE,
    DEFAULT_MAX_PROPERTIES_SIZE,
    EMPTY_VIEW,
    STATUS_BY_VALUE,
    ObjectStreamDecoder,
    as_props,
    as_status,
    as_view,
    check_bool,
    check_priority,
    check_vi64,
    payload_repr,
    slot_setter,
)
from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.kvp import KeyValuePair, KeyValuePairs, kvps_bytes
from kvcs_core.wire.varint import MAX_VI64, Buffer, encode_vi64, read_vi64

__all__ = [
    "SubgroupHeader",
    "SubgroupIdMode",
    "SubgroupItem",
    "SubgroupObject",
    "SubgroupStreamDecoder",
    "SubgroupStreamWriter",
    "encode_subgroup_header",
    "encode_subgroup_stream",
]

# SUBGROUP_HEADER Type Flags bits (d21 section 11.3.1; wire reference 7.2).
FLAG_PROPERTIES: Final = 0x01
MODE_MASK: Final = 0x06
FLAG_END_OF_GROUP: Final = 0x08
FLAG_SUBGROUP_HEADER: Final = 0x10
FLAG_DEFAULT_PRIORITY: Final = 0x20
FLAG_FIRST_OBJECT: Final = 0x40

_NORMAL: Final = ObjectStatus.NORMAL
_new = object.__new__
_set = object.__setattr__


class SubgroupIdMode(enum.IntEnum):
    """SUBGROUP_ID_MODE, ``(flags & 0x06) >> 1``; 0b11 is reserved (PV)."""

    ZERO = 0
    """No Subgroup ID field; the Subgroup ID is 0."""
    FIRST_OBJECT_ID = 1
    """No field; the Subgroup ID is the Object ID of the first object on this stream."""
    EXPLICIT = 2
    """The Subgroup ID field is present."""


_MODES: Final = (SubgroupIdMode.ZERO, SubgroupIdMode.FIRST_OBJECT_ID, SubgroupIdMode.EXPLICIT)


def _as_mode(value: int) -> SubgroupIdMode:
    try:
        return SubgroupIdMode(value)
    except ValueError:
        raise EncodeError(f"SUBGROUP_ID_MODE {value!r} is reserved or unknown") from None


@attrs.frozen
class SubgroupHeader:
    """SUBGROUP_HEADER (d21 section 11.3.1); :attr:`type_flags` is derived from the fields.

    ``subgroup_id`` is 0 for mode ZERO, the field for EXPLICIT, and for
    FIRST_OBJECT_ID either ``None`` (not known yet: the decoded form) or the ID
    of the first object (then the writer checks it). ``publisher_priority=None``
    sets DEFAULT_PRIORITY: the track's DEFAULT_PUBLISHER_PRIORITY applies.
    """

    track_alias: int
    group_id: int
    subgroup_id_mode: SubgroupIdMode = attrs.field(default=SubgroupIdMode.ZERO, converter=_as_mode)
    subgroup_id: int | None = None
    publisher_priority: int | None = None
    has_properties: bool = False
    end_of_group: bool = False
    first_object: bool = True

    def __attrs_post_init__(self) -> None:
        check_vi64(self.track_alias, "Track Alias")
        check_vi64(self.group_id, "Group ID")
        mode = self.subgroup_id_mode
        if mode is SubgroupIdMode.ZERO:
            if self.subgroup_id is None:
                _set(self, "subgroup_id", 0)
            elif self.subgroup_id != 0:
                raise EncodeError("SUBGROUP_ID_MODE ZERO needs subgroup_id 0 (or None)")
        elif mode is SubgroupIdMode.EXPLICIT:
            if self.subgroup_id is None:
                raise EncodeError("SUBGROUP_ID_MODE EXPLICIT needs a subgroup_id")
            check_vi64(self.subgroup_id, "Subgroup ID")
        elif self.subgroup_id is not None:
            check_vi64(self.subgroup_id, "Subgroup ID")
        if self.publisher_priority is not None:
            check_priority(self.publisher_priority)
        check_bool(self.has_properties, "has_properties")
        check_bool(self.end_of_group, "end_of_group")
        check_bool(self.first_object, "first_object")

    @property
    def type_flags(self) -> int:
        """The Type Flags (= stream type) this header is sent with."""
        f = FLAG_SUBGROUP_HEADER | (self.subgroup_id_mode << 1)
        if self.has_properties:
            f |= FLAG_PROPERTIES
        if self.end_of_group:
            f |= FLAG_END_OF_GROUP
        if self.publisher_priority is None:
            f |= FLAG_DEFAULT_PRIORITY
        if self.first_object:
            f |= FLAG_FIRST_OBJECT
        return f


@attrs.frozen
class SubgroupObject:
    """One object of a subgroup stream (d21 section 11.3.1 Figure 26).

    ``properties`` is ``None`` on a stream without the PROPERTIES flag, else a
    (possibly empty) tuple. ``payload`` is a memoryview (empty for status
    objects); see the decoder for what it points into. Equality compares payload
    contents; the hash leaves the payload out.
    """

    object_id: int
    properties: KeyValuePairs | None = attrs.field(default=None, converter=as_props)
    status: ObjectStatus = attrs.field(default=ObjectStatus.NORMAL, converter=as_status)
    payload: memoryview = attrs.field(
        default=EMPTY_VIEW, converter=as_view, repr=payload_repr, hash=False
    )

    def __attrs_post_init__(self) -> None:
        check_vi64(self.object_id, "Object ID")
        if self.status is not ObjectStatus.NORMAL:
            if self.payload.nbytes:
                raise EncodeError(f"a {self.status.name} object has no payload")
            if self.properties:
                raise EncodeError(f"a {self.status.name} object cannot have properties")


SubgroupItem = SubgroupHeader | SubgroupObject
"""What :class:`SubgroupStreamDecoder` returns: the header first, then objects."""

_SO_OBJECT_ID = slot_setter(SubgroupObject, "object_id")
_SO_PROPERTIES = slot_setter(SubgroupObject, "properties")
_SO_STATUS = slot_setter(SubgroupObject, "status")
_SO_PAYLOAD = slot_setter(SubgroupObject, "payload")


# --- encoding --------------------------------------------------------------------


def encode_subgroup_header(h: SubgroupHeader) -> bytes:
    """The SUBGROUP_HEADER bytes (Type Flags, alias, group, [subgroup], [priority])."""
    out = bytearray(encode_vi64(h.type_flags))
    out += encode_vi64(h.track_alias)
    out += encode_vi64(h.group_id)
    if h.subgroup_id_mode is SubgroupIdMode.EXPLICIT:
        assert h.subgroup_id is not None  # guaranteed by SubgroupHeader
        out += encode_vi64(h.subgroup_id)
    if h.publisher_priority is not None:
        out.append(h.publisher_priority)
    return bytes(out)


class SubgroupStreamWriter:
    """Writes one subgroup stream: header bytes, then object prefixes (scatter/gather).

    The caller sends ``header_bytes()``, then for each object
    ``object_prefix(...)`` followed by the payload buffer itself (never
    concatenated here), then FIN. Object IDs must ascend; the writer computes
    the deltas. Raises :class:`EncodeError` for anything that cannot be encoded
    or would make the track malformed (an object after End of Group/Track).
    """

    __slots__ = ("_ended", "_next", "header")

    def __init__(self, header: SubgroupHeader) -> None:
        if not isinstance(header, SubgroupHeader):
            raise EncodeError("SubgroupStreamWriter needs a SubgroupHeader")
        self.header: Final = header
        self._next = -1  # smallest Object ID allowed next; -1 before the first object
        self._ended = False

    def header_bytes(self) -> bytes:
        """The SUBGROUP_HEADER; send it first."""
        return encode_subgroup_header(self.header)

    def object_prefix(
        self,
        object_id: int,
        *,
        payload_length: int,
        status: ObjectStatus = ObjectStatus.NORMAL,
        properties: Iterable[KeyValuePair] | None = None,
    ) -> bytes:
        """Everything of an object before its payload: delta, [properties], length, [status]."""
        if self._ended:  # it would make the track malformed (d21 section 12.1, ref 7.10)
            raise EncodeError("no object may follow an End of Group/End of Track object")
        check_vi64(object_id, "Object ID")
        nxt = self._next
        if nxt < 0:
            h = self.header
            if (
                h.subgroup_id_mode is SubgroupIdMode.FIRST_OBJECT_ID
                and h.subgroup_id is not None
                and object_id != h.subgroup_id
            ):
                raise EncodeError(
                    f"mode FIRST_OBJECT_ID with subgroup_id {h.subgroup_id}: the first object"
                    f" must have that ID, not {object_id}"
                )
            delta = object_id
        else:
            delta = object_id - nxt
            if delta < 0:
                raise EncodeError(f"Object IDs must ascend: {object_id} after {nxt - 1}")
        st = STATUS_BY_VALUE.get(status) if isinstance(status, int) else None
        if st is None:
            raise EncodeError(f"unknown Object Status {status!r}")
        check_vi64(payload_length, "Object Payload Length")
        props = as_props(properties)
        if st is not _NORMAL:
            if payload_length:
                raise EncodeError(f"a {st.name} object has no payload")
            if props:
                raise EncodeError(f"a {st.name} object cannot have properties")
        out = encode_vi64(delta)
        if self.header.has_properties:
            pb = kvps_bytes(props) if props else b""
            out += encode_vi64(len(pb)) + pb
        elif props:
            raise EncodeError("properties on a stream whose header lacks the PROPERTIES flag")
        if payload_length:
            out += encode_vi64(payload_length)
        else:
            out += b"\x00" + encode_vi64(st)
        self._next = object_id + 1
        if st is not _NORMAL:
            self._ended = True
        return out

    def object_bytes(self, obj: SubgroupObject) -> bytes:
        """Prefix and payload of ``obj`` in one string (convenience; copies the payload)."""
        return (
            self.object_prefix(
                obj.object_id,
                payload_length=obj.payload.nbytes,
                status=obj.status,
                properties=obj.properties,
            )
            + obj.payload
        )


def encode_subgroup_stream(header: SubgroupHeader, objects: Iterable[SubgroupObject]) -> bytes:
    """A whole subgroup stream as one byte string (tests, fixtures; copies payloads)."""
    w = SubgroupStreamWriter(header)
    out = bytearray(w.header_bytes())
    for o in objects:
        out += w.object_bytes(o)
    return bytes(out)


# --- decoding --------------------------------------------------------------------


class SubgroupStreamDecoder(ObjectStreamDecoder[SubgroupItem]):
    """Incremental decoder of one subgroup stream, from its first byte (the Type Flags).

    ``feed(chunk)`` returns the items completed so far: the
    :class:`SubgroupHeader` first, then :class:`SubgroupObject` s. A payload
    inside one chunk is a view of that chunk (the decoder keeps references to
    fed buffers: do not mutate them after feeding); one spanning chunks is
    assembled once into a bytearray of exactly its length. ``close()`` at FIN
    raises PROTOCOL_VIOLATION inside an object. ``max_payload_size`` and
    ``max_properties_size`` are local limits (PROTOCOL_VIOLATION beyond).
    """

    __slots__ = ("_has_props", "_header", "_prev", "_subgroup_id")

    def __init__(
        self,
        *,
        max_payload_size: int = DEFAULT_MAX_PAYLOAD_SIZE,
        max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
    ) -> None:
        super().__init__(max_payload_size=max_payload_size, max_properties_size=max_properties_size)
        self._header: SubgroupHeader | None = None
        self._has_props = False
        self._prev = -1
        self._subgroup_id: int | None = None
        self._parse = SubgroupStreamDecoder._parse_header
        self._set_payload = _SO_PAYLOAD

    @property
    def header(self) -> SubgroupHeader | None:
        """The header once received, with ``subgroup_id`` resolved when it is known."""
        h = self._header
        if h is not None and h.subgroup_id is None and self._subgroup_id is not None:
            h2 = _new(SubgroupHeader)
            for a in attrs.fields(SubgroupHeader):
                _set(h2, a.name, getattr(h, a.name))
            _set(h2, "subgroup_id", self._subgroup_id)
            return h2
        return h

    @property
    def subgroup_id(self) -> int | None:
        """The Subgroup ID, or ``None`` before it is known (mode FIRST_OBJECT_ID)."""
        return self._subgroup_id

    @property
    def last_object_id(self) -> int | None:
        """ID of the last object decoded, or ``None``."""
        return self._prev if self._prev >= 0 else None

    def _parse_header(self, buf: Buffer, pos: int) -> tuple[int, int, Any]:
        flags, p = read_vi64(buf, pos)
        # Judged by value: "80 50" is 0x50 (A20 "Non-minimal vi64 in Type Flags").
        if flags >= 0x80 or not flags & FLAG_SUBGROUP_HEADER:
            raise CodecError(
                f"stream type {flags:#x} is not a SUBGROUP_HEADER (needs bit 0x10 and < 128)",
                offset=pos,
            )
        mode = (flags & MODE_MASK) >> 1
        if mode == 3:
            raise CodecError(f"SUBGROUP_ID_MODE 0b11 is reserved (flags {flags:#x})", offset=pos)
        alias, p = read_vi64(buf, p)
        group, p = read_vi64(buf, p)
        sg: int | None
        if mode == 2:
            sg, p = read_vi64(buf, p)
        else:
            sg = 0 if mode == 0 else None
        prio: int | None
        if flags & FLAG_DEFAULT_PRIORITY:
            prio = None
        else:
            if p >= len(buf):
                raise Incomplete
            prio = buf[p]
            p += 1
        h = _new(SubgroupHeader)
        _set(h, "track_alias", alias)
        _set(h, "group_id", group)
        _set(h, "subgroup_id_mode", _MODES[mode])
        _set(h, "subgroup_id", sg)
        _set(h, "publisher_priority", prio)
        _set(h, "has_properties", bool(flags & FLAG_PROPERTIES))
        _set(h, "end_of_group", bool(flags & FLAG_END_OF_GROUP))
        _set(h, "first_object", bool(flags & FLAG_FIRST_OBJECT))
        self._header = h
        self._has_props = bool(flags & FLAG_PROPERTIES)
        self._subgroup_id = sg
        self._parse = SubgroupStreamDecoder._parse_object
        return p, 0, h

    def _parse_object(self, buf: Buffer, pos: int) -> tuple[int, int, Any]:
        props: KeyValuePairs | None
        try:
            b = buf[pos]
            if b < 0x80:
                delta = b
                p = pos + 1
            else:
                delta, p = read_vi64(buf, pos)
            props = None
            if self._has_props:
                props, p = self._read_properties(buf, p)
            length, p = self._read_payload_length(buf, p)
            if length:
                status = _NORMAL
            else:
                at = p
                b = buf[p]
                if b < 0x80:
                    sv = b
                    p += 1
                else:
                    sv, p = read_vi64(buf, p)
                st = STATUS_BY_VALUE.get(sv)
                if st is None:  # Appendix A "Objects": unknown Object Status SHOULD be PV
                    raise CodecError(f"unknown Object Status {sv:#x}", offset=at)
                if props and st is not _NORMAL:  # wire reference 7.3: props only on Normal
                    raise CodecError(f"properties on a {st.name} object", offset=pos)
                status = st
        except IndexError:
            raise Incomplete from None
        prev = self._prev
        if prev < 0:
            oid = delta
            if self._subgroup_id is None:
                self._subgroup_id = oid  # mode FIRST_OBJECT_ID (wire reference A18)
        else:
            oid = prev + delta + 1
            if oid > MAX_VI64:
                raise CodecError("Object ID overflows 2**64-1", offset=pos)
        self._prev = oid
        obj = _new(SubgroupObject)
        _SO_OBJECT_ID(obj, oid)
        _SO_PROPERTIES(obj, props)
        _SO_STATUS(obj, status)
        if not length:
            _SO_PAYLOAD(obj, EMPTY_VIEW)  # else the base class sets the payload view
        return p, length, obj
