"""OBJECT_DATAGRAM and padding datagrams (d21 sections 11.2.1 and 11.5).

Theory of operation
-------------------
A QUIC DATAGRAM carries one object or padding, and is complete by definition,
so :func:`decode_datagram` is one-shot: a datagram that ends early is malformed
(PROTOCOL_VIOLATION), never "need more bytes". Layout (wire reference 7.6)::

    Type Flags (vi64)  Track Alias (vi64)  Group ID (vi64)
    [Object ID (vi64)]              # absent with ZERO_OBJECT_ID (0x04): ID 0
    [Publisher Priority (8)]        # absent with DEFAULT_PRIORITY (0x08)
    [Properties Length (vi64), KVPs]  # with PROPERTIES (0x01); Length 0 is PV
    [Object Status (vi64)]          # with STATUS (0x20): no payload follows
    [Object Payload]                # without STATUS: the rest of the datagram

Flags are judged by value (wire reference A20). PROTOCOL_VIOLATION: bit 0x10
(reserved); any value of 0x40 or more other than the padding type (undefined
bits; wire reference A19 for unknown types); STATUS with END_OF_GROUP; a
Properties Length of 0; properties with a non-Normal status; an unknown Object
Status; bytes after the Object Status. The 24 valid values are 0x00-0x0F and
0x20, 0x21, 0x24, 0x25, 0x28, 0x29, 0x2C, 0x2D.

A padding datagram is the vi64 0x132B3E29 followed by zero bytes (d21 section
11.5); the receiver discards the rest, so its content is not checked.
:class:`PaddingDatagram` counts the bytes after the type.

The payload of a decoded datagram is a view of the buffer passed in (zero
copy). The encoder chooses ZERO_OBJECT_ID whenever the Object ID is 0 and
DEFAULT_PRIORITY exactly when ``publisher_priority`` is ``None``;
:func:`encode_datagram_header` returns everything but the payload for
scatter/gather sending.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import attrs

from kvcs_core.wire._objstream import (
    EMPTY_VIEW,
    STATUS_BY_VALUE,
    FeedData,
    as_props,
    as_view,
    byte_view,
    check_bool,
    check_priority,
    check_vi64,
    payload_repr,
)
from kvcs_core.wire.codes import PADDING_DATAGRAM_TYPE, ObjectStatus
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.kvp import KeyValuePair, KeyValuePairs, kvps_bytes, read_kvps
from kvcs_core.wire.varint import encode_vi64, read_vi64

__all__ = [
    "ObjectDatagram",
    "PaddingDatagram",
    "decode_datagram",
    "encode_datagram",
    "encode_datagram_header",
    "padding_datagram",
]

# OBJECT_DATAGRAM Type Flags bits (d21 section 11.2.1; wire reference 7.6).
DG_PROPERTIES: Final = 0x01
DG_END_OF_GROUP: Final = 0x02
DG_ZERO_OBJECT_ID: Final = 0x04
DG_DEFAULT_PRIORITY: Final = 0x08
DG_RESERVED: Final = 0x10
DG_STATUS: Final = 0x20

_PADDING_TYPE_BYTES: Final = encode_vi64(PADDING_DATAGRAM_TYPE)
_new = object.__new__
_set = object.__setattr__


def _as_dgram_props(value: Iterable[KeyValuePair] | None) -> KeyValuePairs | None:
    props = as_props(value)
    return props if props else None  # an empty list cannot be sent (Length 0 is PV)


def _as_opt_status(value: int | None) -> ObjectStatus | None:
    if value is None:
        return None
    st = STATUS_BY_VALUE.get(value) if isinstance(value, int) else None
    if st is None:
        raise EncodeError(f"unknown Object Status {value!r}")
    return st


@attrs.frozen
class ObjectDatagram:
    """One object in a QUIC DATAGRAM (d21 section 11.2.1).

    ``publisher_priority=None`` means DEFAULT_PRIORITY (the track default).
    ``properties`` is ``None`` or a non-empty tuple (an empty one is stored as
    ``None``). ``status`` is ``None`` for a payload datagram, else the Object
    Status of a STATUS datagram (then the payload is empty and ``end_of_group``
    false).
    """

    track_alias: int
    group_id: int
    object_id: int
    publisher_priority: int | None = None
    properties: KeyValuePairs | None = attrs.field(default=None, converter=_as_dgram_props)
    status: ObjectStatus | None = attrs.field(default=None, converter=_as_opt_status)
    end_of_group: bool = False
    payload: memoryview = attrs.field(
        default=EMPTY_VIEW, converter=as_view, repr=payload_repr, hash=False
    )

    def __attrs_post_init__(self) -> None:
        check_vi64(self.track_alias, "Track Alias")
        check_vi64(self.group_id, "Group ID")
        check_vi64(self.object_id, "Object ID")
        if self.publisher_priority is not None:
            check_priority(self.publisher_priority)
        check_bool(self.end_of_group, "end_of_group")
        if self.status is not None:
            if self.end_of_group:
                raise EncodeError("a STATUS datagram cannot set END_OF_GROUP")
            if self.payload.nbytes:
                raise EncodeError("a STATUS datagram has no payload")
            if self.properties and self.status is not ObjectStatus.NORMAL:
                raise EncodeError(f"a {self.status.name} object cannot have properties")

    @property
    def type_flags(self) -> int:
        """The Type Flags this datagram is sent with."""
        f = 0
        if self.properties:
            f |= DG_PROPERTIES
        if self.end_of_group:
            f |= DG_END_OF_GROUP
        if self.object_id == 0:
            f |= DG_ZERO_OBJECT_ID
        if self.publisher_priority is None:
            f |= DG_DEFAULT_PRIORITY
        if self.status is not None:
            f |= DG_STATUS
        return f


@attrs.frozen
class PaddingDatagram:
    """A padding datagram: type 0x132B3E29 and ``length`` bytes that are discarded."""

    length: int = 0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.length, int) or self.length < 0:
            raise EncodeError(f"padding length {self.length!r} must be a non-negative int")


def padding_datagram(n: int) -> bytes:
    """A padding datagram of ``n`` zero bytes after its type (``5 + n`` bytes in all)."""
    if not isinstance(n, int) or n < 0:
        raise EncodeError(f"padding length {n!r} must be a non-negative int")
    return _PADDING_TYPE_BYTES + bytes(n)


def encode_datagram_header(d: ObjectDatagram) -> bytes:
    """Everything of ``d`` but its payload (which follows it, unframed, to the end)."""
    flags = d.type_flags
    out = bytearray(encode_vi64(flags))
    out += encode_vi64(d.track_alias)
    out += encode_vi64(d.group_id)
    if not flags & DG_ZERO_OBJECT_ID:
        out += encode_vi64(d.object_id)
    if d.publisher_priority is not None:
        out.append(d.publisher_priority)
    if d.properties:
        pb = kvps_bytes(d.properties)
        out += encode_vi64(len(pb))
        out += pb
    if d.status is not None:
        out += encode_vi64(d.status)
    return bytes(out)


def encode_datagram(d: ObjectDatagram | PaddingDatagram) -> bytes:
    """The whole datagram (copies the payload; use the header form to avoid that)."""
    if isinstance(d, PaddingDatagram):
        return padding_datagram(d.length)
    if not isinstance(d, ObjectDatagram):
        raise EncodeError(f"cannot encode {type(d).__name__} as a datagram")
    return encode_datagram_header(d) + d.payload


def decode_datagram(buf: FeedData) -> ObjectDatagram | PaddingDatagram:
    """Decode one whole QUIC DATAGRAM payload; the object payload is a view of ``buf``.

    Raises:
        CodecError: PROTOCOL_VIOLATION for any malformed or truncated datagram.
    """
    b, mv = byte_view(buf)
    n = len(b)
    p = 0
    try:
        flags, p = read_vi64(b, 0)
        if flags == PADDING_DATAGRAM_TYPE:  # 7.7 Padding: the content is discarded unread
            return PaddingDatagram(n - p)
        if flags >= 0x40:
            raise CodecError(
                f"datagram type {flags:#x} is neither OBJECT_DATAGRAM nor padding", offset=0
            )
        if flags & DG_RESERVED:
            raise CodecError(f"datagram Type Flags {flags:#x} set reserved bit 0x10", offset=0)
        if flags & DG_STATUS and flags & DG_END_OF_GROUP:
            raise CodecError(
                f"datagram Type Flags {flags:#x} combine STATUS and END_OF_GROUP", offset=0
            )
        alias, p = read_vi64(b, p)
        group, p = read_vi64(b, p)
        if flags & DG_ZERO_OBJECT_ID:
            oid = 0
        else:
            oid, p = read_vi64(b, p)
        prio: int | None
        if flags & DG_DEFAULT_PRIORITY:
            prio = None
        else:
            if p >= n:
                raise Incomplete
            prio = b[p]
            p += 1
        props: KeyValuePairs | None = None
        if flags & DG_PROPERTIES:
            at = p
            plen, p = read_vi64(b, p)
            if plen == 0:
                raise CodecError("datagram PROPERTIES with Properties Length 0", offset=at)
            pe = p + plen
            if pe > n:
                raise CodecError(
                    f"Properties Length {plen} runs past the end of the datagram", offset=at
                )
            props = read_kvps(b, p, pe, what="Object Properties")
            p = pe
        status: ObjectStatus | None = None
        payload = EMPTY_VIEW
        if flags & DG_STATUS:
            at = p
            sv, p = read_vi64(b, p)
            status = STATUS_BY_VALUE.get(sv)
            if status is None:  # Appendix A "Objects": unknown Object Status SHOULD be PV
                raise CodecError(f"unknown Object Status {sv:#x}", offset=at)
            if props and status is not ObjectStatus.NORMAL:
                raise CodecError(f"properties on a {status.name} datagram", offset=at)
            if p != n:  # wire reference 7.6: with STATUS nothing follows the Object Status
                raise CodecError(f"{n - p} bytes after the Object Status", offset=p)
        elif p < n:
            payload = mv[p:n]
    except Incomplete:
        raise CodecError("datagram ends inside its header", offset=n) from None
    d = _new(ObjectDatagram)
    _set(d, "track_alias", alias)
    _set(d, "group_id", group)
    _set(d, "object_id", oid)
    _set(d, "publisher_priority", prio)
    _set(d, "properties", props)
    _set(d, "status", status)
    _set(d, "end_of_group", bool(flags & DG_END_OF_GROUP))
    _set(d, "payload", payload)
    return d
