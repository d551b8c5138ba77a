"""Key-Value-Pair lists (d21 section 8.3): Setup Options and Properties.

Theory of operation
-------------------
A KVP list has no count: it is bounded by an outer byte length (the end of a
SETUP or of a message's Track Properties, an object's Properties Length, the
value of IMMUTABLE_PROPERTIES). Each pair is::

    Delta Type (vi64)   # type = previous type in this list + delta (first: 0 + delta)
    [Length (vi64)]     # only when the *resolved* type is odd; at most 65535
    Value               # even type: one vi64; odd type: Length bytes

so types never decrease and a repeated type has delta 0. Unknown types are
skippable by parity, which is why a KVP list needs no per-type knowledge to
decode. A resolved type over 2**64-1, an odd length over 65535, or a pair that
runs past the outer bound is a PROTOCOL_VIOLATION.

Message Parameters look similar but are *not* KVPs (their value encoding is
fixed per type and they are counted): see ``params.py``.
"""

from __future__ import annotations

import attrs

from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.reader import read_bytes, read_vi64
from kvcs_core.wire.varint import MAX_VI64, Buffer, encode_vi64

MAX_KVP_VALUE_LENGTH = 65535
"""d21 section 8.3: the Length of an odd-typed pair is at most 65535."""


def _check_type(_inst: object, _a: object, value: int) -> None:
    if not 0 <= value <= MAX_VI64:
        raise EncodeError(f"KVP type {value} outside 0..2**64-1")


@attrs.frozen
class KeyValuePair:
    """One pair. Even ``type``: ``value`` is an int; odd ``type``: bytes."""

    type: int = attrs.field(validator=_check_type)
    value: int | bytes

    def __attrs_post_init__(self) -> None:
        if self.type & 1:
            if not isinstance(self.value, bytes):
                raise EncodeError(f"odd KVP type {self.type:#x} needs a bytes value")
            if len(self.value) > MAX_KVP_VALUE_LENGTH:
                raise EncodeError(f"KVP value of {len(self.value)} bytes exceeds 65535")
        elif not isinstance(self.value, int) or isinstance(self.value, bool):
            raise EncodeError(f"even KVP type {self.type:#x} needs an int value")
        elif not 0 <= self.value <= MAX_VI64:
            raise EncodeError(f"KVP value {self.value} outside 0..2**64-1")


KeyValuePairs = tuple[KeyValuePair, ...]
"""A KVP list in wire order (types non-decreasing)."""

EMPTY_KVPS: KeyValuePairs = ()


def encode_kvps(pairs: KeyValuePairs, out: bytearray) -> None:
    """Append ``pairs`` (types must be non-decreasing) with delta-coded types."""
    prev = 0
    for p in pairs:
        if p.type < prev:
            raise EncodeError(f"KVP types must not decrease ({p.type:#x} after {prev:#x})")
        out += encode_vi64(p.type - prev)
        prev = p.type
        if p.type & 1:
            assert isinstance(p.value, bytes)  # guaranteed by KeyValuePair
            out += encode_vi64(len(p.value))
            out += p.value
        else:
            assert isinstance(p.value, int)
            out += encode_vi64(p.value)


def kvps_bytes(pairs: KeyValuePairs) -> bytes:
    """``encode_kvps`` into a new bytes object."""
    out = bytearray()
    encode_kvps(pairs, out)
    return bytes(out)


def read_kvps(buf: Buffer, start: int, end: int, *, what: str = "KVP list") -> KeyValuePairs:
    """Decode the KVP list occupying exactly ``buf[start:end]``.

    The caller has made sure that ``end <= len(buf)``; a pair that runs past
    ``end`` is therefore malformed (PROTOCOL_VIOLATION), never "need more".
    """
    if start == end:
        return EMPTY_KVPS
    sub = buf[start:end]
    pos = 0
    prev = 0
    pairs: list[KeyValuePair] = []
    n = len(sub)
    try:
        while pos < n:
            at = pos
            delta, pos = read_vi64(sub, pos)
            t = prev + delta
            if t > MAX_VI64:
                raise CodecError(f"{what}: type overflows 2**64-1", offset=start + at)
            prev = t
            if t & 1:
                length, pos = read_vi64(sub, pos)
                if length > MAX_KVP_VALUE_LENGTH:
                    raise CodecError(
                        f"{what}: value length {length} exceeds 65535", offset=start + at
                    )
                value, pos = read_bytes(sub, pos, length)
                pair = KeyValuePair.__new__(KeyValuePair)
                object.__setattr__(pair, "type", t)
                object.__setattr__(pair, "value", bytes(value))
            else:
                v, pos = read_vi64(sub, pos)
                pair = KeyValuePair.__new__(KeyValuePair)
                object.__setattr__(pair, "type", t)
                object.__setattr__(pair, "value", v)
            pairs.append(pair)
    except Incomplete:
        raise CodecError(f"{what} runs past its length", offset=start + pos) from None
    return tuple(pairs)


def find_kvp(pairs: KeyValuePairs, type_: int) -> int | bytes | None:
    """Value of the first pair of ``type_``, or ``None``."""
    for p in pairs:
        if p.type == type_:
            return p.value
    return None
