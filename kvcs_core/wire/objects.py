"""The MOQT draft-22 data plane: stream classification, padding, and one import point.

Theory of operation
-------------------
Objects travel on unidirectional *data streams* and in QUIC DATAGRAMs (d21
section 11, wire reference 7). The first vi64 of a unidirectional stream says
what it is (d21 section 6.4.1 Table 2, wire reference 3.3):

* ``0x05``: a fetch or fill stream (``fetch.py``, d21 section 11.4.1);
* a value below 128 with bit 0x10 set: a subgroup stream, the value being the
  SUBGROUP_HEADER Type Flags (``subgroup.py``, d21 section 11.3.1);
* ``0x2F00``: the control stream (decoded by the control-stream decoder, not
  here);
* ``0x132B3E28``: a padding stream (d21 section 11.5): the receiver discards
  everything after the type;
* anything else: close the session, PROTOCOL_VIOLATION (wire reference A19).

:func:`peek_uni_stream_type` classifies a stream from its first bytes without
consuming them. :class:`DataStreamDecoder` takes a data stream from its first
byte and hands it to the right decoder; a control stream is refused with a
CodecError because it belongs to the control decoder (classify first with
:func:`peek_uni_stream_type`). Datagrams are in ``datagram.py``.

The decoders are sans-I/O, incremental and zero-copy: see ``_objstream`` for
how chunks, payload views, assembly and the local limits work.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from kvcs_core.wire._objstream import (
    DEFAULT_MAX_PAYLOAD_SIZE,
    DEFAULT_MAX_PROPERTIES_SIZE,
    FeedData,
    byte_view,
)
from kvcs_core.wire.codes import UniStreamType
from kvcs_core.wire.datagram import (
    ObjectDatagram,
    PaddingDatagram,
    decode_datagram,
    encode_datagram,
    encode_datagram_header,
    padding_datagram,
)
from kvcs_core.wire.errors import NEED_MORE, CodecError, EncodeError, Incomplete, NeedMore
from kvcs_core.wire.fetch import (
    EndOfRangeMarker,
    FetchHeader,
    FetchItem,
    FetchObject,
    FetchStreamDecoder,
    FetchStreamWriter,
    GroupOrderSource,
    encode_fetch_header,
    encode_fetch_stream,
)
from kvcs_core.wire.subgroup import (
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupItem,
    SubgroupObject,
    SubgroupStreamDecoder,
    SubgroupStreamWriter,
    encode_subgroup_header,
    encode_subgroup_stream,
)
from kvcs_core.wire.varint import Buffer, encode_vi64, read_vi64

__all__ = [
    "DEFAULT_MAX_PAYLOAD_SIZE",
    "DEFAULT_MAX_PROPERTIES_SIZE",
    "DataStreamDecoder",
    "DataStreamItem",
    "EndOfRangeMarker",
    "FetchHeader",
    "FetchItem",
    "FetchObject",
    "FetchStreamDecoder",
    "FetchStreamWriter",
    "GroupOrderSource",
    "ObjectDatagram",
    "PaddingDatagram",
    "PaddingStreamHeader",
    "SubgroupHeader",
    "SubgroupIdMode",
    "SubgroupItem",
    "SubgroupObject",
    "SubgroupStreamDecoder",
    "SubgroupStreamWriter",
    "UniStreamKind",
    "decode_datagram",
    "encode_datagram",
    "encode_datagram_header",
    "encode_fetch_header",
    "encode_fetch_stream",
    "encode_subgroup_header",
    "encode_subgroup_stream",
    "padding_datagram",
    "padding_stream",
    "peek_uni_stream_type",
]

_PADDING_STREAM: Final = int(UniStreamType.PADDING)
_PADDING_STREAM_BYTES: Final = encode_vi64(_PADDING_STREAM)


class UniStreamKind(enum.IntEnum):
    """What a unidirectional stream is, from its first vi64 (d21 section 6.4.1 Table 2)."""

    CONTROL = 0
    SUBGROUP = 1
    FETCH = 2
    PADDING = 3


def _classify(t: int) -> UniStreamKind:
    if t == UniStreamType.FETCH_HEADER:
        return UniStreamKind.FETCH
    if t < 0x80 and t & 0x10:
        return UniStreamKind.SUBGROUP
    if t == UniStreamType.CONTROL:
        return UniStreamKind.CONTROL
    if t == _PADDING_STREAM:
        return UniStreamKind.PADDING
    # A19 "Codes not stated": an unknown unidirectional stream type closes the session with PV.
    raise CodecError(f"unknown unidirectional stream type {t:#x}", offset=0)


def peek_uni_stream_type(buf: FeedData) -> UniStreamKind | NeedMore:
    """Classify a unidirectional stream by its first vi64, consuming nothing.

    Returns :data:`NEED_MORE` until the whole vi64 is there. A SUBGROUP result
    only says the value has the SUBGROUP_HEADER shape (< 128, bit 0x10); the
    subgroup decoder still rejects mode 0b11.

    Raises:
        CodecError: PROTOCOL_VIOLATION for an unknown stream type (wire reference A19).
    """
    b, _ = byte_view(buf)
    try:
        t, _ = read_vi64(b, 0)
    except Incomplete:
        return NEED_MORE
    return _classify(t)


@attrs.frozen
class PaddingStreamHeader:
    """The start of a padding stream (type 0x132B3E28); the rest is discarded."""


def padding_stream(n: int) -> bytes:
    """A padding stream's type followed by ``n`` zero bytes."""
    if not isinstance(n, int) or n < 0:
        raise EncodeError(f"padding length {n!r} must be a non-negative int")
    return _PADDING_STREAM_BYTES + bytes(n)


DataStreamItem = SubgroupItem | FetchItem | PaddingStreamHeader
"""Anything :class:`DataStreamDecoder` returns."""


class _PaddingStreamDecoder:
    """Counts and discards the bytes after a padding stream's type."""

    __slots__ = ("_closed", "_head", "discarded")

    def __init__(self) -> None:
        self._head: bytearray | None = bytearray()
        self._closed = False
        self.discarded = 0

    @property
    def at_item_boundary(self) -> bool:
        return self._head is None or not self._head

    def feed(self, data: FeedData) -> list[DataStreamItem]:
        if self._closed:
            raise CodecError("stream data after FIN")
        b, mv = byte_view(data)
        head = self._head
        if head is None:
            self.discarded += len(b)
            return []
        head += mv[:16]
        try:
            t, p = read_vi64(head, 0)
        except Incomplete:
            return []
        if t != _PADDING_STREAM:
            raise CodecError(f"stream type {t:#x} is not a padding stream", offset=0)
        self.discarded += len(head) - p + max(0, len(b) - 16)
        self._head = None
        return [PaddingStreamHeader()]

    def close(self) -> None:
        self._closed = True
        if self._head:
            raise CodecError("FIN inside the padding stream type", offset=0)


class DataStreamDecoder:
    """Incremental decoder of any data stream, from the stream's first byte.

    It classifies the stream by its first vi64 (:func:`peek_uni_stream_type`)
    and then behaves as a :class:`SubgroupStreamDecoder` or
    :class:`FetchStreamDecoder`, or, for a padding stream, returns one
    :class:`PaddingStreamHeader` and counts the rest in :attr:`discarded`.
    ``fetch_group_order`` is the group order source a fetch stream needs (a
    :class:`~.codes.GroupOrder` or a callable given the Request ID). A control stream
    (0x2F00) is refused with a CodecError: classify streams first and give the
    control stream to the control-stream decoder. Payload views point into fed
    buffers: do not mutate a buffer after feeding it.
    """

    __slots__ = ("_closed", "_error", "_fetch_order", "_head", "_inner", "_limits", "kind")

    def __init__(
        self,
        *,
        fetch_group_order: GroupOrderSource,
        max_payload_size: int = DEFAULT_MAX_PAYLOAD_SIZE,
        max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
    ) -> None:
        self._fetch_order = fetch_group_order
        self._limits = (max_payload_size, max_properties_size)
        self._head = bytearray()
        self._inner: SubgroupStreamDecoder | FetchStreamDecoder | _PaddingStreamDecoder | None
        self._inner = None
        self._error: CodecError | None = None
        self._closed = False
        self.kind: UniStreamKind | None = None
        """What the stream is, once its first vi64 is in."""

    @property
    def at_item_boundary(self) -> bool:
        """True when no item is partly received."""
        inner = self._inner
        return not self._head if inner is None else inner.at_item_boundary

    @property
    def decoder(self) -> SubgroupStreamDecoder | FetchStreamDecoder | None:
        """The subgroup or fetch decoder in use (its ``header`` etc.), once known."""
        inner = self._inner
        return None if isinstance(inner, _PaddingStreamDecoder) else inner

    @property
    def discarded(self) -> int:
        """Padding bytes discarded so far (padding streams only)."""
        inner = self._inner
        return inner.discarded if isinstance(inner, _PaddingStreamDecoder) else 0

    def feed(self, data: FeedData) -> list[DataStreamItem]:
        """Consume stream bytes; return the items completed (header first)."""
        inner = self._inner
        if inner is not None:
            return inner.feed(data)  # type: ignore[return-value]
        if self._error is not None:
            raise self._error
        b, mv = byte_view(data)
        if not len(b):
            return []
        if self._closed:
            self._error = CodecError("stream data after FIN", offset=len(self._head))
            raise self._error
        head = self._head
        probe: Buffer = b if not head else head + mv[:9]
        try:
            t, _ = read_vi64(probe, 0)
            kind = _classify(t)
        except Incomplete:
            head += mv
            return []
        except CodecError as e:
            self._error = e
            raise
        if kind is UniStreamKind.CONTROL:
            self._error = CodecError(
                "the control stream (0x2F00) is not a data stream: classify with"
                " peek_uni_stream_type and use the control-stream decoder",
                offset=0,
            )
            raise self._error
        self.kind = kind
        pay, props = self._limits
        new: SubgroupStreamDecoder | FetchStreamDecoder | _PaddingStreamDecoder
        if kind is UniStreamKind.SUBGROUP:
            new = SubgroupStreamDecoder(max_payload_size=pay, max_properties_size=props)
        elif kind is UniStreamKind.FETCH:
            new = FetchStreamDecoder(
                self._fetch_order, max_payload_size=pay, max_properties_size=props
            )
        else:
            new = _PaddingStreamDecoder()
        self._inner = new
        self._head = bytearray()
        out: list[DataStreamItem] = []
        if head:
            out += new.feed(bytes(head))
        out += new.feed(data)
        return out

    def close(self) -> None:
        """FIN: raise CodecError if the stream ends inside an item."""
        inner = self._inner
        if inner is not None:
            inner.close()
            return
        if self._error is not None:
            raise self._error
        self._closed = True
        if self._head:
            self._error = CodecError("FIN inside the stream type", offset=0)
            raise self._error
