"""MOQT over WebTransport (HTTP/3) on the same QUIC stack: the session-level glue (sans-I/O).

Theory of operation
-------------------
MOQT runs over native QUIC or over a WebTransport session (wire reference
3.1 and 3.2): the client sends an extended CONNECT (``:protocol
webtransport``) whose ``WT-Available-Protocols`` header offers ``moqt-22``; the
server answers 200 with ``WT-Protocol: "moqt-22"``; MOQT then uses the
session's streams and datagrams exactly as it uses QUIC's, AUTHORITY and PATH
setup options are not used, and the session ends with
CLOSE_WEBTRANSPORT_SESSION carrying the MOQT error code.

:class:`WebTransportLink` does this on an aioquic-style ``H3Connection`` (aioquic
and qh3 both have one, implementing the WebTransport draft their
``enable_webtransport`` flag selects): it turns the connection's QUIC events
into neutral items (stream data, resets, STOP_SENDING, datagrams, the end of
the session) that :class:`~.pump.SessionPump` maps to core transport events,
and carries out opens, writes, aborts, datagrams and the close. One
WebTransport session per connection (one MOQT session); further CONNECTs get
409, other requests 404.

Stream error codes travel in the HTTP/3 error-code space; the WebTransport
mapping (``first + n + n // 0x1e``, reserved codepoints skipped) converts both
ways; an HTTP/3 code that carries no WebTransport code reaches the core as 0.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import attrs

from .config import H3_ALPN
from .stack import ALPN, QuicStack

log = logging.getLogger("kvcs.quic")

WT_FIRST = 0x52E4A40FA8DB
WT_LAST = 0x52E5AC983162
WEBTRANSPORT_STREAM_FRAME = 0x41
"""HTTP/3 frame type that opens a WebTransport bidi stream."""
CLOSE_WEBTRANSPORT_SESSION = 0x2843
"""Capsule type that ends a WebTransport session with a 32-bit code and a reason."""
MAX_CAPSULE_BUFFER = 16 * 1024


def quic_varint(value: int) -> bytes:
    """RFC 9000 section 16 variable-length integer (capsules use these, not MOQT's vi64)."""
    for prefix, size in ((0, 1), (1, 2), (2, 4), (3, 8)):
        if value < 1 << (8 * size - 2):
            return (value | (prefix << (8 * size - 2))).to_bytes(size, "big")
    raise ValueError("varint too large")


def read_quic_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode an RFC 9000 varint at ``pos``; ``IndexError`` if truncated."""
    size = 1 << (buf[pos] >> 6)
    if pos + size > len(buf):
        raise IndexError("truncated varint")
    value = int.from_bytes(buf[pos : pos + size], "big") & ((1 << (8 * size - 2)) - 1)
    return value, pos + size


def wt_to_http(code: int) -> int:
    """A WebTransport application error code (32 bits) as an HTTP/3 error code."""
    code &= 0xFFFFFFFF
    return WT_FIRST + code + code // 0x1E


def http_to_wt(code: int) -> int | None:
    """The WebTransport code an HTTP/3 error code carries, ``None`` if it carries none."""
    if not WT_FIRST <= code <= WT_LAST or (code - 0x21) % 0x1F == 0:
        return None
    shifted = code - WT_FIRST
    return shifted - shifted // 0x1F


@attrs.frozen
class Data:
    stream_id: int
    data: bytes
    fin: bool


@attrs.frozen
class Reset:
    stream_id: int
    code: int


@attrs.frozen
class StopSending:
    stream_id: int
    code: int


@attrs.frozen
class Datagram:
    data: bytes


@attrs.frozen
class Established:
    """The CONNECT was answered 200 with ``moqt-22``: MOQT may start."""


@attrs.frozen
class Ended:
    """The WebTransport session is over (CLOSE_WEBTRANSPORT_SESSION or the CONNECT stream ended,
    or the server refused it)."""

    code: int
    reason: str


Item = Data | Reset | StopSending | Datagram | Established | Ended


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k == name:
            return v
    return None


def _offers_moqt(value: bytes | None) -> bool:
    """Does a ``WT-Available-Protocols`` structured-field list offer ``moqt-22``?"""
    if value is None:
        return False
    items = [part.strip().split(b";")[0].strip() for part in value.split(b",")]
    return b'"' + ALPN.encode() + b'"' in items


class WebTransportLink:
    """One WebTransport session carrying one MOQT session over an HTTP/3 connection."""

    def __init__(
        self, stack: QuicStack, quic: Any, *, authority: str = "", path: str = "/"
    ) -> None:
        if stack.h3_connection is None or stack.h3_events is None:
            raise RuntimeError(f"{stack.name} has no HTTP/3 layer")
        self.quic = quic
        self.h3 = stack.h3_connection(quic, enable_webtransport=True)
        self._events = stack.events
        self._h3_events: Any = stack.h3_events
        self.is_client = bool(quic.configuration.is_client)
        self.session_id: int | None = None
        self.established = False
        self.ended = False
        self._wt_streams: set[int] = set()
        self._capsules = bytearray()
        if self.is_client:
            self.session_id = quic.get_next_available_stream_id()
            self.h3.send_headers(
                self.session_id,
                [
                    (b":method", b"CONNECT"),
                    (b":protocol", b"webtransport"),
                    (b":scheme", b"https"),
                    (b":authority", authority.encode()),
                    (b":path", (path or "/").encode()),
                    (b"wt-available-protocols", b'"' + ALPN.encode() + b'"'),
                ],
            )

    # --- QUIC -> items --------------------------------------------------------------------

    def handle(self, qe: Any) -> Iterator[Item]:
        ev, h3ev = self._events, self._h3_events
        if isinstance(qe, ev.StreamReset) and qe.stream_id in self._wt_streams:
            yield Reset(qe.stream_id, http_to_wt(qe.error_code) or 0)
        elif isinstance(qe, ev.StopSendingReceived) and qe.stream_id in self._wt_streams:
            yield StopSending(qe.stream_id, http_to_wt(qe.error_code) or 0)
        for he in self.h3.handle_event(qe):
            if isinstance(he, h3ev.WebTransportStreamDataReceived):
                if he.session_id == self.session_id and self.established:
                    self._wt_streams.add(he.stream_id)
                    yield Data(he.stream_id, he.data, he.stream_ended)
            elif isinstance(he, h3ev.DatagramReceived):
                if he.stream_id == self.session_id and self.established:
                    yield Datagram(he.data)
            elif isinstance(he, h3ev.HeadersReceived):
                yield from self._on_headers(he)
            elif isinstance(he, h3ev.DataReceived) and he.stream_id == self.session_id:
                yield from self._on_session_data(he.data, he.stream_ended)

    def _on_headers(self, he: Any) -> Iterator[Item]:
        headers = list(he.headers)
        if self.is_client:
            if he.stream_id != self.session_id:
                return
            status = _header(headers, b":status")
            protocol = _header(headers, b"wt-protocol")
            if status == b"200" and protocol in (None, b'"' + ALPN.encode() + b'"'):
                self.established = True
                yield Established()
            else:
                self.ended = True
                yield Ended(0, f"WebTransport CONNECT refused (status {status!r})")
            return
        method, proto = _header(headers, b":method"), _header(headers, b":protocol")
        if method != b"CONNECT" or proto != b"webtransport":
            self.h3.send_headers(he.stream_id, [(b":status", b"404")], end_stream=True)
            return
        if self.session_id is not None:
            self.h3.send_headers(he.stream_id, [(b":status", b"409")], end_stream=True)
            return
        if not _offers_moqt(_header(headers, b"wt-available-protocols")):
            self.h3.send_headers(he.stream_id, [(b":status", b"400")], end_stream=True)
            log.info("WebTransport CONNECT without moqt-22 in WT-Available-Protocols refused")
            return
        self.session_id = he.stream_id
        self.h3.send_headers(
            he.stream_id,
            [
                (b":status", b"200"),
                (b"wt-protocol", b'"' + ALPN.encode() + b'"'),
                (b"sec-webtransport-http3-draft", b"draft02"),
            ],
        )
        self.established = True
        yield Established()

    def _on_session_data(self, data: bytes, fin: bool) -> Iterator[Item]:
        self._capsules += data
        del self._capsules[:-MAX_CAPSULE_BUFFER]
        if fin and not self.ended:
            self.ended = True
            code, reason = self._close_capsule()
            yield Ended(code, reason)

    def _close_capsule(self) -> tuple[int, str]:
        buf = bytes(self._capsules)
        pos = 0
        try:
            while pos < len(buf):
                ctype, pos = read_quic_varint(buf, pos)
                length, pos = read_quic_varint(buf, pos)
                body = buf[pos : pos + length]
                pos += length
                if ctype == CLOSE_WEBTRANSPORT_SESSION and len(body) >= 4:
                    return int.from_bytes(body[:4], "big"), body[4:].decode("utf-8", "replace")
        except IndexError:  # a truncated capsule: the session just ended
            pass
        return 0, "WebTransport session ended"

    # --- commands ---------------------------------------------------------------------------

    def open_stream(self, uni: bool) -> int:
        assert self.session_id is not None
        sid: int = self.h3.create_webtransport_stream(self.session_id, is_unidirectional=uni)
        self._wt_streams.add(sid)
        if not uni:
            self._mark_bidi(sid)
        return sid

    def _mark_bidi(self, sid: int) -> None:
        """Make the HTTP/3 layer read the peer's half of a bidi stream we opened as
        WebTransport data. aioquic and qh3 only recognise a WebTransport bidi stream from
        its first bytes (WEBTRANSPORT_STREAM + session ID), which only the opener sends,
        so without this the answers on our request streams would be parsed as HTTP/3
        frames. (Their private per-stream state: the one place this module reaches in.)"""
        streams = getattr(self.h3, "_stream", None)
        stream_cls = getattr(sys.modules[type(self.h3).__module__], "H3Stream", None)
        if not isinstance(streams, dict) or stream_cls is None:
            return
        stream = streams.get(sid)
        if stream is None:
            stream = streams[sid] = stream_cls(sid)
        stream.frame_type = WEBTRANSPORT_STREAM_FRAME
        stream.session_id = self.session_id

    def reset(self, stream_id: int, code: int) -> None:
        self.quic.reset_stream(stream_id, wt_to_http(code))

    def stop(self, stream_id: int, code: int) -> None:
        self.quic.stop_stream(stream_id, wt_to_http(code))

    def datagram(self, data: bytes) -> None:
        if self.session_id is not None:
            self.h3.send_datagram(self.session_id, data)

    def close(self, code: int, reason: str) -> None:
        """CLOSE_WEBTRANSPORT_SESSION with the MOQT code, then FIN the CONNECT stream."""
        if self.session_id is None or self.ended:
            return
        self.ended = True
        body = (code & 0xFFFFFFFF).to_bytes(4, "big") + reason.encode()[:1024]
        capsule = quic_varint(CLOSE_WEBTRANSPORT_SESSION) + quic_varint(len(body)) + body
        self.h3.send_data(self.session_id, capsule, end_stream=True)


__all__ = ["H3_ALPN", "WebTransportLink", "http_to_wt", "wt_to_http"]
