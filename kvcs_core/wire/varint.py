"""The MOQT variable-length integer, ``vi64`` (d21 section 8.1).

Theory of operation
-------------------
The number of leading 1-bits of the first byte is the number of bytes that
follow (0 to 8); the value is the remaining low bits of the first byte followed
by those bytes, big-endian. A first byte of 0xFF carries no value bits: the
eight following bytes are the whole 64-bit value. So there are nine forms
(1 to 9 bytes) holding 7, 14, 21, 28, 35, 42, 49, 56 and 64 bits.

Encoders emit the minimal form. Decoders accept any form that can hold the
value ("padded" long forms such as ``80 25`` for 37), everywhere: stream types,
message types, flags and deltas are judged by value (wire reference A20).

This is *not* the QUIC varint: the two agree only below 64.

The readers work on anything indexable by int and sliceable (``bytes``,
``bytearray``, ``memoryview`` of format ``B``) and raise :class:`Incomplete`
when the buffer ends inside the integer.
"""

from __future__ import annotations

from typing import Final

from kvcs_core.wire.errors import EncodeError, Incomplete

Buffer = bytes | bytearray | memoryview
"""Anything the readers accept. A memoryview must have format ``B``."""

MAX_VI64: Final = (1 << 64) - 1

# For each first byte: how many bytes follow, and the mask of its value bits.
_EXTRA: Final[tuple[int, ...]] = tuple(
    next((n for n in range(8) if not b & (0x80 >> n)), 8) for b in range(256)
)
_MASK: Final[tuple[int, ...]] = tuple(
    (0xFF >> (_EXTRA[b] + 1)) if _EXTRA[b] < 8 else 0 for b in range(256)
)
_SMALL: Final[tuple[bytes, ...]] = tuple(bytes([v]) for v in range(128))
# Prefix bits OR-ed into the first byte of the n-byte form (n = 1..8).
_PREFIX: Final[tuple[int, ...]] = (0, 0x00, 0x80, 0xC0, 0xE0, 0xF0, 0xF8, 0xFC, 0xFE)


def encode_vi64(value: int) -> bytes:
    """Minimal vi64 encoding of ``value`` (0 .. 2**64-1)."""
    if 0 <= value < 0x80:
        return _SMALL[value]
    if value < 0:
        raise EncodeError(f"vi64 cannot encode negative value {value}")
    if value < 0x4000:
        return bytes((0x80 | (value >> 8), value & 0xFF))
    for n in range(3, 9):
        if value < 1 << (7 * n):
            raw = bytearray(value.to_bytes(n, "big"))
            raw[0] |= _PREFIX[n]
            return bytes(raw)
    if value > MAX_VI64:
        raise EncodeError(f"vi64 cannot encode {value} (over 2**64-1)")
    return b"\xff" + value.to_bytes(8, "big")


def vi64_size(value: int) -> int:
    """Length in bytes of the minimal encoding of ``value``."""
    if value < 0x80:
        return 1
    for n in range(2, 9):
        if value < 1 << (7 * n):
            return n
    return 9


def read_vi64(buf: Buffer, pos: int) -> tuple[int, int]:
    """Decode one vi64 at ``pos``; return ``(value, position after it)``.

    Raises:
        Incomplete: the buffer ends inside the integer.
    """
    try:
        b0 = buf[pos]
    except IndexError:
        raise Incomplete from None
    if b0 < 0x80:
        return b0, pos + 1
    n = _EXTRA[b0]
    end = pos + 1 + n
    if end > len(buf):
        raise Incomplete
    if n == 1:
        return ((b0 & 0x3F) << 8) | buf[pos + 1], end
    return ((b0 & _MASK[b0]) << (8 * n)) | int.from_bytes(buf[pos + 1 : end], "big"), end


def decode_vi64(buf: Buffer) -> tuple[int, int] | None:
    """Decode a vi64 at the start of ``buf``; ``None`` if ``buf`` is too short.

    Returns ``(value, bytes used)``.
    """
    try:
        return read_vi64(buf, 0)
    except Incomplete:
        return None
