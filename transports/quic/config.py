"""QUIC settings for MOQT endpoints, and ``moqt://`` URLs.

``quic_configuration`` builds the stack's ``QuicConfiguration`` the same way
for every kvcs endpoint: ALPN ``moqt-22``, DATAGRAM frames on (MOQT object
datagrams), flow-control windows large enough for multi-megabyte layers in
flight, and TLS from a :class:`~.tls.TlsConfig`. :func:`parse_url` splits a
``moqt://authority/path?query`` URL (wire reference section 1: native QUIC
sends the authority in AUTHORITY and ``path-abempty`` plus query in PATH;
default port 443).
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import urlsplit

import attrs

from .stack import ALPN, QuicStack
from .tls import TlsConfig, TlsError

H3_ALPN = "h3"
"""ALPN of HTTP/3, over which WebTransport (and so MOQT over WebTransport) runs."""

DEFAULT_PORT = 443
MAX_DATA = 64 * 1024 * 1024
MAX_STREAM_DATA = 16 * 1024 * 1024
RELAY_MAX_DATA = 16 * 1024 * 1024
"""A relay's receive window per connection (where its stack can hold input): what a
publisher may still send after the relay holds its intake (``Relay.intake_held``) must
fit, with ``RelayConfig.intake_hold_bytes``, within a subscriber's queue limit
(``SessionConfig.max_queued_bytes_per_subscription``, 64 MiB): 8 + 16 MiB here."""
MAX_DATAGRAM_FRAME = 65536
DEFAULT_IDLE_TIMEOUT = 30.0
"""QUIC idle timeout (seconds) of every kvcs connection unless configured: a peer silent
that long is taken as gone. Connections keep themselves alive meanwhile with PINGs
(:mod:`.pump`), so a quiet session never reaches it."""


class UrlError(ValueError):
    """A URL that is not ``moqt://host[:port][/path]``."""


@attrs.frozen
class MoqtUrl:
    host: str
    port: int
    path: str
    """``path-abempty`` plus ``?query`` (empty for the root)."""
    webtransport: bool = False
    """``https://``: MOQT over a WebTransport session (extended CONNECT to ``path``)."""

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"


def parse_url(url: str) -> MoqtUrl:
    """Parse ``moqt://host[:port][/path][?query]`` (native QUIC) or ``https://...``
    (WebTransport, wire reference 3.1); raise :class:`UrlError` otherwise."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed [IPv6] bracket
        raise UrlError(f"not a URL: {url!r} ({exc})") from None
    if parts.scheme not in ("moqt", "https"):
        raise UrlError(f"not a moqt:// (or https:// for WebTransport) URL: {url!r}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise UrlError(f"bad port in {url!r}") from exc
    if not parts.hostname:
        raise UrlError(f"no host in {url!r}")
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return MoqtUrl(parts.hostname, port, path, webtransport=parts.scheme == "https")


def parse_hostport(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair; raise :class:`UrlError` when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UrlError(f"not host:port: {text!r}")
    return host, int(port)


def quic_configuration(
    stack: QuicStack,
    *,
    is_client: bool,
    tls: TlsConfig | None = None,
    server_name: str | None = None,
    max_datagram_size: int | None = None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    webtransport: bool = False,
    max_data: int = MAX_DATA,
) -> Any:
    """A ``QuicConfiguration`` of ``stack`` for a kvcs client or server.

    ``max_data``: the connection's receive window (bytes; :data:`RELAY_MAX_DATA` for a
    relay whose stack can hold its input).

    ``idle_timeout``: seconds of silence from the peer after which QUIC ends the
    connection (``max_idle_timeout``, RFC 9000 section 10.1; must be > 0).

    ``webtransport``: a client offers only ``h3`` (WebTransport); a server offers
    ``moqt-22`` and ``h3``, so both kinds of client reach it on one port.
    """
    if webtransport:
        alpns = [H3_ALPN] if is_client else [ALPN, H3_ALPN]
    else:
        alpns = [ALPN]
    if not idle_timeout > 0:
        raise ValueError(f"the idle timeout must be > 0 s, not {idle_timeout!r}")
    cfg = stack.configuration(is_client=is_client, alpn_protocols=alpns)
    cfg.max_datagram_frame_size = MAX_DATAGRAM_FRAME
    cfg.max_data = max_data
    cfg.max_stream_data = min(max_data, stack.max_stream_data or MAX_STREAM_DATA)
    cfg.idle_timeout = idle_timeout
    if max_datagram_size is not None:
        cfg.max_datagram_size = max_datagram_size
    tls = tls or TlsConfig()
    tls.check()
    if is_client:
        cfg.server_name = server_name
        if not tls.verify:
            cfg.verify_mode = ssl.CERT_NONE
        elif tls.cafile is not None:
            cfg.load_verify_locations(cafile=tls.cafile)
    else:
        if tls.certfile is None:
            raise TlsError("a server needs a certificate (or a self-signed one)")
        try:
            cfg.load_cert_chain(tls.certfile, tls.keyfile)
        except (ValueError, OSError) as exc:
            raise TlsError(f"cannot load certificate/key: {exc}") from exc
    return cfg
