"""Incremental decoding machinery shared by the subgroup and fetch stream decoders.

Theory of operation
-------------------
A data stream (d21 section 11.3 subgroup streams, section 11.4 fetch streams)
is a header followed by objects, each of which is a small *object header* and
an opaque payload of a length the header gives. The decoders here are built for
large payloads (KV-cache blocks of tens of KiB to MiB) arriving in QUIC-sized
chunks, so they do three things a naive "append everything to a buffer and
parse" reader does not:

* **Zero copy where possible.** Each concrete decoder supplies a *header
  parser* ``parse(buf, pos) -> (header_end, payload_length, item)`` that reads
  one stream header or object header from ``buf`` at ``pos`` and never looks at
  payload bytes. When the whole payload lies inside the chunk being fed, the
  item gets ``memoryview(chunk)[a:b]``: no copy, and the decoder (and the item)
  keeps a reference to the caller's buffer. Callers must therefore not mutate a
  buffer after feeding it.
* **One copy otherwise.** A payload that runs past the end of the chunk is
  copied exactly once. Normally the decoder keeps the pieces (the fed chunks
  themselves, no copy yet) and, when the last piece arrives, joins them with
  ``b"".join`` into one freshly allocated ``bytes`` of exactly the payload
  length, handed out as a (read-only) ``memoryview`` of it. This is the STYLE
  R8 ``ObjectAssembler`` with the destination allocated at the end instead of
  the start: no zero-fill pass and no per-chunk slice assignment, which measured
  more than twice as fast (``benchmarks/bench_wire_decode.py``). So that a peer
  sending tiny STREAM frames cannot make the kept pieces outweigh the payload,
  the first middle piece shorter than 512 bytes switches that payload to
  *buffer mode*: the pieces so far are copied into a ``bytearray`` and later
  chunks are appended to it (its growth is amortized; no view of it exists
  until the payload is complete, so resizing it is safe; the payload view is
  then writable). The buffer holds the bytes received, never the Object
  Payload Length the peer *declared*: a header claiming 64 MiB followed by a
  trickle of tiny frames costs what the frames carry, not 64 MiB. Memory held
  for a payload is thus the bytes received of it plus a bounded overhead per
  kept piece, and at most the unused parts of its first and last chunks.
* **Small carry-over.** An object header cut by a chunk boundary is kept in a
  small ``bytearray`` (the *tail*) and completed from a small window of the next
  chunk (64 bytes, then as much as the parser said it needs), never by copying
  the whole next chunk. The parser reports how many bytes it needs when it knows
  (a Properties Length), so a header fed one byte at a time is re-parsed only
  when enough bytes are there, never quadratically.

Bounds. Every quantity a peer controls is bounded before memory is committed:
an Object Payload Length over ``max_payload_size`` (default 64 MiB) and a
Properties Length over ``max_properties_size`` (default 128 KiB) are rejected
with PROTOCOL_VIOLATION as *local* limits (MOQT itself allows up to 2**64-1; a
single property value is at most 65535 bytes by the KVP rules of d21 section
8.3, so 128 KiB fits any object with two maximal properties plus small ones).
A header without properties is at most a few dozen bytes of vi64s, so the tail
never holds more than ``max_properties_size + 64`` bytes.

Errors. Malformed input raises :class:`CodecError` whose ``offset`` is the
offset in the *stream* (not in the chunk). After an error the decoder is dead:
every later ``feed``/``close`` raises the same error. No other exception type
leaves ``feed`` or ``close`` for any bytes; a strict prefix of a valid stream
never raises. ``close()`` (the FIN) inside a header or a payload is
PROTOCOL_VIOLATION (d21 section 11.3.1: "FIN in the middle of an object SHOULD
be a PROTOCOL_VIOLATION"; wire reference A19 for headers). A stream that ends
before its first byte carries nothing and ``close()`` accepts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, Generic, TypeVar

from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.kvp import EMPTY_KVPS, KeyValuePair, KeyValuePairs, read_kvps
from kvcs_core.wire.varint import MAX_VI64, Buffer, read_vi64

DEFAULT_MAX_PAYLOAD_SIZE: Final = 64 * 1024 * 1024
"""Local limit on one Object Payload Length (64 MiB); larger is PROTOCOL_VIOLATION."""

DEFAULT_MAX_PROPERTIES_SIZE: Final = 128 * 1024
"""Local limit on one Properties Length (128 KiB); larger is PROTOCOL_VIOLATION."""

_WINDOW: Final = 64
"""Bytes taken from a new chunk to complete a header cut at a chunk boundary."""

_MIN_PART: Final = 512
"""Smallest chunk kept by reference while a payload is assembled (see the docstring)."""

EMPTY_VIEW: Final = memoryview(b"")
"""The payload of objects without one (status objects, empty payloads)."""

FeedData = bytes | bytearray | memoryview
"""What ``feed`` accepts: any contiguous bytes-like object."""

_new = object.__new__
_set = object.__setattr__

T = TypeVar("T")


class Short(Incomplete):
    """Internal: the buffer ends before the header; ``need`` = bytes needed from ``pos`` 0."""

    def __init__(self, need: int) -> None:
        super().__init__()
        self.need = need


def byte_view(data: FeedData) -> tuple[Buffer, memoryview]:
    """``(indexable buffer, memoryview of unsigned bytes)`` for a fed chunk."""
    if isinstance(data, bytes | bytearray):
        return data, memoryview(data)
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv, mv


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The raw setter of slot ``name`` of a (frozen, slotted) attrs class.

    Decoders build items whose values are valid by construction; setting the
    slots directly skips validation and is faster than ``object.__setattr__``.
    """
    setter: Callable[[Any, Any], None] = cls.__dict__[name].__set__
    return setter


def payload_repr(view: memoryview) -> str:
    """Short repr of a payload: its length and first bytes (STYLE R3)."""
    head = bytes(view[:8]).hex()
    return f"<{view.nbytes} bytes {head}{'…' if view.nbytes > 8 else ''}>"


def rebase(e: CodecError, base: int) -> CodecError:
    """``e`` with its offset moved by ``base`` (buffer offset -> stream offset)."""
    return CodecError(e.reason, code=e.code, offset=base + e.offset if e.offset >= 0 else -1)


def _set_payload_slot(item: Any, view: memoryview) -> None:
    _set(item, "payload", view)


class ObjectStreamDecoder(Generic[T]):
    """Base of the incremental stream decoders: buffering, payload assembly, errors.

    Subclasses set ``self._parse`` to a header parser (see the module docstring),
    stored as a plain function ``parse(self, buf, pos)`` so that the decoder holds
    no reference cycle (a dropped decoder frees its buffers at once); the parser
    replaces ``self._parse`` when the stream header is done. An item returned
    with a payload length above 0 has its ``payload`` slot still unset; the
    base class sets it with ``self._set_payload``, which a subclass may replace
    by the item class's raw slot setter.

    Offsets: ``_offset`` is the stream offset of the first byte not yet fed,
    except while a payload is being assembled, when the bytes fed on the fast
    path are not added to it; then the stream position is ``_pay_end - _room``.
    """

    __slots__ = (
        "_abuf",
        "_closed",
        "_error",
        "_need",
        "_offset",
        "_parse",
        "_parts",
        "_pay_end",
        "_pitem",
        "_room",
        "_set_payload",
        "_tail",
        "max_payload_size",
        "max_properties_size",
    )

    def __init__(
        self,
        *,
        max_payload_size: int = DEFAULT_MAX_PAYLOAD_SIZE,
        max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
    ) -> None:
        if max_payload_size < 0 or max_properties_size < 0:
            raise ValueError("limits must not be negative")
        self.max_payload_size: int = max_payload_size
        self.max_properties_size: int = max_properties_size
        self._parse: Callable[[Any, Buffer, int], tuple[int, int, T]]
        self._set_payload: Callable[[Any, memoryview], None] = _set_payload_slot
        self._tail = bytearray()
        self._need = 0
        self._pitem: T | None = None  # the item waiting for a payload spanning chunks
        self._parts: list[Buffer] | None = None  # its pieces so far (parts mode)
        self._abuf: bytearray | None = None  # or the bytes so far (buffer mode)
        self._room = 0  # payload bytes still missing
        self._pay_end = 0  # stream offset where that payload ends
        self._offset = 0
        self._error: CodecError | None = None
        self._closed = False

    # --- public -------------------------------------------------------------

    @property
    def at_item_boundary(self) -> bool:
        """True when no header or payload is partly received (FIN here is clean)."""
        return self._pitem is None and not self._tail

    @property
    def bytes_received(self) -> int:
        """Stream bytes fed so far."""
        return self._pay_end - self._room if self._pitem is not None else self._offset

    def _read_properties(self, buf: Buffer, p: int) -> tuple[KeyValuePairs, int]:
        """``Properties Length (vi64)`` + KVPs at ``p`` (object headers of both stream
        kinds); a length over ``max_properties_size`` is PV (a local limit)."""
        at = p
        plen, p = read_vi64(buf, p)
        if plen > self.max_properties_size:
            raise CodecError(
                f"Properties Length {plen} exceeds the local limit"
                f" max_properties_size={self.max_properties_size}",
                offset=at,
            )
        pe = p + plen
        if pe > len(buf):
            raise Short(pe)
        return (read_kvps(buf, p, pe, what="Object Properties") if plen else EMPTY_KVPS), pe

    def _read_payload_length(self, buf: Buffer, p: int) -> tuple[int, int]:
        """``Object Payload Length (vi64)`` at ``p``; over ``max_payload_size`` is PV."""
        b = buf[p]
        if b < 0x80:
            length, end = b, p + 1
        else:
            length, end = read_vi64(buf, p)
        if length > self.max_payload_size:
            raise CodecError(
                f"Object Payload Length {length} exceeds the local limit"
                f" max_payload_size={self.max_payload_size}",
                offset=p,
            )
        return length, end

    def feed(self, data: FeedData) -> list[T]:
        """Consume the next stream bytes; return every item completed by them.

        The first item is the stream header, then objects (and, on fetch streams,
        End-of-Range markers) in stream order. Bytes of an unfinished item are kept.
        Payload views may point into ``data``: do not mutate it afterwards.

        Raises:
            CodecError: the stream is malformed (and stays failed).
        """
        parts = self._parts
        if parts is not None and type(data) is bytes:
            # Hot path: the middle of a payload that spans chunks. The chunk is
            # kept by reference and copied once, when the payload is complete.
            n = len(data)
            room = self._room
            if _MIN_PART <= n < room:
                parts.append(data)
                self._room = room - n
                return []
        return self._feed(data)

    def close(self) -> None:
        """The stream ended with FIN; raise if it ended inside an item.

        Raises:
            CodecError: PROTOCOL_VIOLATION when the FIN cuts a header or a payload.
        """
        if self._error is not None:
            raise self._error
        if self._closed:
            return
        self._closed = True
        if self._pitem is not None:
            raise self._fail(
                CodecError(f"FIN inside an object payload ({self._room} bytes missing)", offset=0),
                self.bytes_received,
            )
        if self._tail:
            raise self._fail(
                CodecError("FIN inside a header or object header", offset=0),
                self._offset - len(self._tail),
            )

    # --- machinery ------------------------------------------------------------

    def _fail(self, e: CodecError, base: int) -> CodecError:
        err = rebase(e, base) if base else e
        self._error = err
        self._parts = None
        self._abuf = None
        self._pitem = None
        self._tail = bytearray()
        return err

    def _feed(self, data: FeedData) -> list[T]:
        if self._error is not None:
            raise self._error
        if type(data) is bytes:
            buf: Buffer = data
            mv = memoryview(data)
        else:
            buf, mv = byte_view(data)
        n = len(buf)
        out: list[T] = []
        if n == 0:
            return out
        if self._closed:
            raise self._fail(CodecError("stream data after FIN", offset=0), self._offset)
        base = self._pay_end - self._room if self._pitem is not None else self._offset
        self._offset = base + n
        pos = 0
        if self._pitem is not None:
            pos = self._continue_payload(mv, n, out)
            if pos >= n:
                return out
        if self._tail:
            pos = self._complete_tail(mv, pos, n, base, out)
            if pos >= n:
                return out
        setp = self._set_payload
        try:
            while pos < n:
                start = pos
                try:
                    hp, plen, item = self._parse(self, buf, pos)
                except Incomplete as e:
                    self._need = e.need - start if isinstance(e, Short) else n - start + 1
                    self._tail = bytearray(mv[start:n])
                    break
                if plen == 0:
                    out.append(item)
                    pos = hp
                    continue
                end = hp + plen
                if end <= n:
                    setp(item, mv[hp:end])
                    out.append(item)
                    pos = end
                else:
                    self._begin_payload(item, plen, mv[hp:n], base + end)
                    break
        except CodecError as e:
            raise self._fail(e, base) from None
        return out

    def _begin_payload(self, item: T, plen: int, first: memoryview, end: int) -> None:
        k = len(first)
        self._parts = [first] if k else []
        self._pitem = item
        self._room = plen - k
        self._pay_end = end

    def _continue_payload(self, mv: memoryview, n: int, out: list[T]) -> int:
        room = self._room
        parts = self._parts
        if n < room:
            if parts is not None:
                if n >= _MIN_PART:
                    parts.append(mv)
                    self._room = room - n
                    return n
                # A small piece: switch to buffer mode, so that the pieces kept
                # never outweigh the payload. The buffer holds the bytes received,
                # never the length the peer declared (which is not yet evidence).
                abuf = bytearray().join(parts)
                self._parts = None
                self._abuf = abuf
            else:
                assert self._abuf is not None
                abuf = self._abuf
            abuf += mv
            self._room = room - n
            return n
        item = self._pitem
        assert item is not None
        if parts is not None and not parts:
            # The whole payload lies in this one chunk (its header ended the previous
            # one): hand the view through, no copy (STYLE.md R8 fast path).
            self._set_payload(item, mv[:room])
        elif parts is not None:
            # One copy, into a buffer of exactly the payload length, never resized.
            parts.append(mv[:room])
            self._set_payload(item, memoryview(b"".join(parts)))
        else:
            done = self._abuf
            assert done is not None
            done += mv[:room]
            self._set_payload(item, memoryview(done))
            self._abuf = None
        out.append(item)
        self._parts = None
        self._pitem = None
        self._room = 0
        return room

    def _complete_tail(self, mv: memoryview, pos: int, n: int, base: int, out: list[T]) -> int:
        """Finish the header kept in the tail with bytes of the new chunk; return new pos."""
        tail = self._tail
        t = len(tail)
        avail = n - pos
        need = self._need
        if t + avail < need:
            tail += mv[pos:n]
            return n
        take = max(need - t, _WINDOW)
        while True:
            take = min(take, avail)
            w = tail + mv[pos : pos + take]
            try:
                hp, plen, item = self._parse(self, w, 0)
                break
            except Incomplete as e:
                need = e.need if isinstance(e, Short) else len(w) + 1
                if take >= avail or need > t + avail:
                    tail += mv[pos:n]
                    self._need = need
                    return n
                take = max(need - t + _WINDOW, 2 * take)
            except CodecError as e:
                raise self._fail(e, base + pos - t) from None
        # The tail alone was incomplete, so the header ends inside the new chunk.
        pos += hp - t
        self._tail = bytearray()
        if plen == 0:
            out.append(item)
            return pos
        end = pos + plen
        if end <= n:
            self._set_payload(item, mv[pos:end])
            out.append(item)
            return end
        self._begin_payload(item, plen, mv[pos:n], base + end)
        return n


# --- validation helpers for the public constructors and encoders ---------------


def check_vi64(value: object, what: str) -> int:
    """``value`` if it is an int in 0..2**64-1, else :class:`EncodeError`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise EncodeError(f"{what} must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_VI64:
        raise EncodeError(f"{what} {value} is outside 0..2**64-1")
    return value


def check_priority(value: object, what: str = "Publisher Priority") -> int:
    """``value`` if it is an int in 0..255 (an 8-bit field), else :class:`EncodeError`."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0xFF:
        raise EncodeError(f"{what} {value!r} is not an integer in 0..255")
    return value


def check_bool(value: object, what: str) -> bool:
    """``value`` if it is a bool, else :class:`EncodeError`."""
    if not isinstance(value, bool):
        raise EncodeError(f"{what} must be a bool, not {value!r}")
    return value


def as_view(value: bytes | bytearray | memoryview) -> memoryview:
    """Converter for payload fields: any bytes-like object becomes a byte memoryview."""
    try:
        _, mv = byte_view(value)
    except TypeError:
        raise EncodeError(f"payload must be bytes-like, not {type(value).__name__}") from None
    return mv


def as_props(value: Iterable[KeyValuePair] | None) -> KeyValuePairs | None:
    """Converter for Properties fields: ``None`` or a tuple of pairs, types non-decreasing."""
    if value is None:
        return None
    pairs = tuple(value)
    prev = 0
    for p in pairs:
        if not isinstance(p, KeyValuePair):
            raise EncodeError(f"property {p!r} is not a KeyValuePair")
        if p.type < prev:
            raise EncodeError(f"property types must not decrease ({p.type:#x} after {prev:#x})")
        prev = p.type
    return pairs


def as_status(value: int) -> ObjectStatus:
    """Converter for Object Status fields (0x0, 0x3, 0x4 only; d21 section 11.1.2)."""
    try:
        return ObjectStatus(value)
    except ValueError:
        raise EncodeError(f"unknown Object Status {value!r}") from None


STATUS_BY_VALUE: Final[dict[int, ObjectStatus]] = {s.value: s for s in ObjectStatus}
