"""Primitive readers shared by every decoder in ``wire``.

Theory of operation
-------------------
Each reader takes a buffer and a position and returns ``(value, new position)``.
A reader that runs off the end raises :class:`Incomplete` (the caller turns it
into "need more bytes"); one that finds a malformed value raises
:class:`CodecError`. Fixed-width fields exist only where d21 section 8 says so
(wire reference 2.1): the u16 control Message Length and the u8 priorities,
End Of Track, SetID and uint8 parameters.

``read_bytes`` returns a *view* (a slice of the buffer), never a copy, so that
object payloads reach the caller without copying. Callers that keep a small
field beyond the call copy it with ``bytes(...)``.
"""

from __future__ import annotations

from kvcs_core.wire.errors import CodecError, Incomplete
from kvcs_core.wire.varint import Buffer, read_vi64

__all__ = ["Buffer", "read_bytes", "read_length_prefixed", "read_u8", "read_u16", "read_vi64"]


def read_u8(buf: Buffer, pos: int) -> tuple[int, int]:
    """One raw byte."""
    try:
        return buf[pos], pos + 1
    except IndexError:
        raise Incomplete from None


def read_u16(buf: Buffer, pos: int) -> tuple[int, int]:
    """Two raw bytes, big-endian."""
    if pos + 2 > len(buf):
        raise Incomplete
    return (buf[pos] << 8) | buf[pos + 1], pos + 2


def read_bytes(buf: Buffer, pos: int, length: int) -> tuple[Buffer, int]:
    """``length`` raw bytes as a slice of ``buf`` (a view when ``buf`` is a memoryview)."""
    end = pos + length
    if end > len(buf):
        raise Incomplete
    return buf[pos:end], end


def read_length_prefixed(
    buf: Buffer, pos: int, *, limit: int, what: str
) -> tuple[Buffer, int]:
    """A vi64 length followed by that many bytes; a length over ``limit`` is PV."""
    start = pos
    length, pos = read_vi64(buf, pos)
    if length > limit:
        raise CodecError(f"{what} length {length} exceeds {limit}", offset=start)
    return read_bytes(buf, pos, length)
