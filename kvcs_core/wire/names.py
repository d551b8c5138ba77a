"""Locations, Track Namespaces, Track Names and their text form.

Theory of operation
-------------------
* ``Location`` (d21 section 8.2): ``{Group, Object}``, two vi64, ordered
  lexicographically.
* ``TrackNamespace`` (d21 sections 2.4.1 and 8.7): 0 to 32 fields, each at least
  one byte; the sum of the field lengths is at most 4096 bytes, and so is the sum
  of the namespace and the Track Name (the "full track name"). The empty
  namespace is legal only as a prefix ("everything"). Equality is bytewise,
  field by field. Prefix matching (d21 section 7.5) is field-wise: ``(foo)``
  matches ``(foo, bar)`` but never ``(foobar)``.
* Text form (d21 section 8.8, not on the wire): fields joined by ``-``, then
  ``--`` and the track name; ``a-z A-Z 0-9 _`` are literal and every other byte
  is ``.`` plus two lowercase hex digits. Parsing is strict so that the mapping
  is a bijection: an escape must be exactly two lowercase hex digits and a byte
  with a literal form must not be escaped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvcs_core.wire.errors import CodecError, EncodeError
from kvcs_core.wire.reader import read_bytes, read_vi64
from kvcs_core.wire.varint import MAX_VI64, Buffer, encode_vi64

MAX_NAMESPACE_FIELDS = 32
"""d21 section 2.4.1: a namespace has at most 32 fields."""
MAX_FULL_NAME_BYTES = 4096
"""d21 section 2.4.1: namespace field bytes plus track name bytes, at most 4096."""


def _check_vi64(value: int, what: str) -> int:
    if not 0 <= value <= MAX_VI64:
        raise EncodeError(f"{what} {value} is outside 0..2**64-1")
    return value


@attrs.frozen(order=False)
class Location:
    """A position in a track: ``(group, object)``; compares lexicographically.

    The comparisons are written out (not attrs-generated): they sit on the hot path
    of every object a session sends or stores.
    """

    group: int = attrs.field()
    object: int = attrs.field()

    @group.validator
    def _v_group(self, _a: Any, value: int) -> None:
        _check_vi64(value, "Group ID")

    @object.validator
    def _v_object(self, _a: Any, value: int) -> None:
        _check_vi64(value, "Object ID")

    @classmethod
    def trusted(cls, group: int, object_id: int) -> Location:
        """Build without validation: for values a decoder already bounded (hot paths)."""
        loc = object.__new__(cls)
        object.__setattr__(loc, "group", group)
        object.__setattr__(loc, "object", object_id)
        return loc

    def __lt__(self, other: Location) -> bool:
        return (self.group, self.object) < (other.group, other.object)

    def __le__(self, other: Location) -> bool:
        return (self.group, self.object) <= (other.group, other.object)

    def __gt__(self, other: Location) -> bool:
        return (self.group, self.object) > (other.group, other.object)

    def __ge__(self, other: Location) -> bool:
        return (self.group, self.object) >= (other.group, other.object)

    def __str__(self) -> str:
        return f"{{{self.group},{self.object}}}"


def _validate_fields(fields: tuple[bytes, ...]) -> None:
    if len(fields) > MAX_NAMESPACE_FIELDS:
        raise EncodeError(f"namespace has {len(fields)} fields (max {MAX_NAMESPACE_FIELDS})")
    total = 0
    for f in fields:
        if not isinstance(f, bytes):
            raise EncodeError(f"namespace field {f!r} is not bytes")
        if not f:
            raise EncodeError("namespace field is empty")
        total += len(f)
    if total > MAX_FULL_NAME_BYTES:
        raise EncodeError(f"namespace is {total} bytes (max {MAX_FULL_NAME_BYTES})")


def _as_field(f: bytes | str) -> bytes:
    return f.encode() if isinstance(f, str) else bytes(f)


def _as_fields(fs: Iterable[bytes | str]) -> tuple[bytes, ...]:
    return tuple(_as_field(f) for f in fs)


@attrs.frozen
class TrackNamespace:
    """An ordered tuple of 0..32 non-empty byte strings (d21 section 2.4.1)."""

    fields: tuple[bytes, ...] = attrs.field(converter=_as_fields)

    def __attrs_post_init__(self) -> None:
        _validate_fields(self.fields)

    @classmethod
    def of(cls, *fields: bytes | str) -> TrackNamespace:
        """``TrackNamespace.of("kvcs-1", b"\\x01...")``: str fields are UTF-8 encoded."""
        return cls(fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def byte_length(self) -> int:
        """Sum of the field lengths (what the 4096-byte limit counts)."""
        return sum(len(f) for f in self.fields)

    def is_prefix_of(self, other: TrackNamespace) -> bool:
        """Field-wise prefix test of d21 section 7.5 (the empty namespace matches all)."""
        n = len(self.fields)
        return n <= len(other.fields) and other.fields[:n] == self.fields

    def suffix_after(self, prefix: TrackNamespace) -> TrackNamespace:
        """The fields after ``prefix`` (what NAMESPACE and PUBLISH_SKIPPED carry)."""
        if not prefix.is_prefix_of(self):
            raise ValueError(f"{prefix} is not a prefix of {self}")
        return TrackNamespace(self.fields[len(prefix.fields) :])

    def __add__(self, other: TrackNamespace) -> TrackNamespace:
        return TrackNamespace(self.fields + other.fields)

    def __str__(self) -> str:
        return "-".join(_escape(f) for f in self.fields)


@attrs.frozen
class FullTrackName:
    """A Track Namespace plus a Track Name (which may be empty)."""

    namespace: TrackNamespace
    name: bytes = attrs.field(converter=_as_field)

    def __attrs_post_init__(self) -> None:
        if self.namespace.byte_length + len(self.name) > MAX_FULL_NAME_BYTES:
            raise EncodeError(f"full track name exceeds {MAX_FULL_NAME_BYTES} bytes")

    def __str__(self) -> str:
        return to_text(self)


# --- wire encoding ---------------------------------------------------------


def encode_namespace(ns: TrackNamespace, out: bytearray) -> None:
    """Append the Track Namespace structure: field count, then (length, bytes) each."""
    out += encode_vi64(len(ns.fields))
    for f in ns.fields:
        out += encode_vi64(len(f))
        out += f


def encode_track_name(name: bytes, out: bytearray) -> None:
    """Append ``Track Name Length (vi64), Track Name``."""
    out += encode_vi64(len(name))
    out += name


def encode_location(loc: Location, out: bytearray) -> None:
    """Append ``Group (vi64), Object (vi64)``."""
    out += encode_vi64(loc.group)
    out += encode_vi64(loc.object)


def read_location(buf: Buffer, pos: int) -> tuple[Location, int]:
    """``Group (vi64), Object (vi64)``."""
    g, pos = read_vi64(buf, pos)
    o, pos = read_vi64(buf, pos)
    return Location(g, o), pos


def read_namespace(buf: Buffer, pos: int) -> tuple[TrackNamespace, int]:
    """A Track Namespace; more than 32 fields, an empty field or over 4096 bytes is PV."""
    start = pos
    count, pos = read_vi64(buf, pos)
    if count > MAX_NAMESPACE_FIELDS:
        raise CodecError(f"Track Namespace has {count} fields (max 32)", offset=start)
    fields: list[bytes] = []
    total = 0
    for _ in range(count):
        fstart = pos
        length, pos = read_vi64(buf, pos)
        if length == 0:
            raise CodecError("empty Track Namespace field", offset=fstart)
        total += length
        if total > MAX_FULL_NAME_BYTES:
            raise CodecError("Track Namespace exceeds 4096 bytes", offset=fstart)
        value, pos = read_bytes(buf, pos, length)
        fields.append(bytes(value))
    ns = TrackNamespace.__new__(TrackNamespace)
    object.__setattr__(ns, "fields", tuple(fields))  # already validated above
    return ns, pos


def read_track_name(buf: Buffer, pos: int, ns: TrackNamespace) -> tuple[bytes, int]:
    """A Track Name following ``ns``; namespace plus name over 4096 bytes is PV."""
    start = pos
    length, pos = read_vi64(buf, pos)
    if ns.byte_length + length > MAX_FULL_NAME_BYTES:
        raise CodecError("full track name exceeds 4096 bytes", offset=start)
    value, pos = read_bytes(buf, pos, length)
    return bytes(value), pos


# --- text form (d21 section 8.8) ---------------------------------------------

_LITERAL = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_HEX = frozenset(b"0123456789abcdef")


def _escape(field: bytes) -> str:
    return "".join(chr(b) if b in _LITERAL else f".{b:02x}" for b in field)


def _unescape(text: str) -> bytes:
    raw = text.encode("ascii", errors="strict") if text.isascii() else None
    if raw is None:
        raise ValueError(f"non-ASCII character in track name text {text!r}")
    out = bytearray()
    i = 0
    while i < len(raw):
        b = raw[i]
        if b in _LITERAL:
            out.append(b)
            i += 1
        elif b == 0x2E:  # '.'
            hx = raw[i + 1 : i + 3]
            if len(hx) != 2 or not set(hx) <= _HEX:
                raise ValueError(
                    f"bad escape at {i} in {text!r}: need '.' and two lowercase hex digits"
                )
            value = int(hx, 16)
            if value in _LITERAL:
                raise ValueError(f"byte {chr(value)!r} must not be escaped (at {i} in {text!r})")
            out.append(value)
            i += 3
        else:
            raise ValueError(f"character {chr(b)!r} must be escaped (at {i} in {text!r})")
    return bytes(out)


def to_text(name: FullTrackName) -> str:
    """Text form: ``field-field--name`` (d21 section 8.8)."""
    return f"{name.namespace}--{_escape(name.name)}"


def namespace_from_text(text: str) -> TrackNamespace:
    """Parse the text form of a namespace (fields joined by ``-``); strict."""
    if text == "":
        return TrackNamespace(())
    return TrackNamespace(tuple(_unescape(f) for f in text.split("-")))


def from_text(text: str) -> FullTrackName:
    """Parse ``field-field--name``; raises ``ValueError`` for anything not canonical."""
    ns_text, sep, name_text = text.partition("--")
    if not sep:
        raise ValueError(f"{text!r} has no '--' between namespace and track name")
    if "-" in name_text:
        raise ValueError(f"'-' must be escaped in a track name: {text!r}")
    try:
        return FullTrackName(namespace_from_text(ns_text), _unescape(name_text))
    except EncodeError as e:
        raise ValueError(str(e)) from None
