"""Session configuration: role, advertised setup options and every local limit.

Theory of operation
-------------------
Everything a peer can make a session hold is bounded here, with the reason for
each default (STYLE.md R8). Limits are local policy, not wire rules; exceeding
one has a defined outcome, named next to the limit. Setup options we advertise
(d21 section 9.1) are taken from this configuration as well.
"""

from __future__ import annotations

import enum

import attrs


class Role(enum.IntEnum):
    """Which end of the QUIC connection this session is (d21 section 6.4.2.1: Request ID parity)."""

    CLIENT = 0
    SERVER = 1


@attrs.frozen(kw_only=True)
class SessionConfig:
    """How one MOQT session behaves. All durations are seconds (the wire uses ms)."""

    role: Role
    implementation: bytes = b"kvcs-py/0.1"
    """MOQT_IMPLEMENTATION setup option (d21 section 9.1)."""
    authority: bytes | None = None
    """AUTHORITY setup option: clients over native QUIC only."""
    path: bytes | None = None
    """PATH setup option: clients over native QUIC only."""
    webtransport: bool = False
    """The session runs over WebTransport: AUTHORITY and PATH must not be used (wire
    reference 3.1); received ones close the session INVALID_AUTHORITY / INVALID_PATH."""
    max_filter_ranges: int = 16
    """MAX_FILTER_RANGES we accept in one subscription or fetch (0 = no range filters).
    More -> REQUEST_ERROR INVALID_FILTER."""
    max_request_updates: int = 16
    """MAX_REQUEST_UPDATES: unanswered REQUEST_UPDATEs we accept per request stream.
    More -> close TOO_MANY_REQUEST_UPDATES."""
    max_auth_token_cache_size: int = 0
    """MAX_AUTH_TOKEN_CACHE_SIZE we advertise (0: no token aliases)."""
    setup_tokens: tuple[tuple[int, bytes], ...] = ()
    """Authorization tokens (Token Type, Token Value) we send in our SETUP, each as
    USE_VALUE (wire reference 5.3), e.g. a CAT (type 0x01, :mod:`kvcs_core.auth`)."""

    setup_timeout: float = 10.0
    """Peer SETUP not received this long after start -> close CONTROL_MESSAGE_TIMEOUT."""
    request_timeout: float = 30.0
    """A request of ours unanswered this long -> close CONTROL_MESSAGE_TIMEOUT (d21 12.2).
    It runs from when the request's stream is opened within the peer's stream credit
    (``max_held_requests``), never while the request waits for that credit."""
    max_held_requests: int = 1024
    """Requests of ours held locally, unsent, while the peer's bidirectional stream
    credit (QUIC MAX_STREAMS, reported by the transport as ``StreamCredit``) is used up;
    they go out in order as the credit grows. Only the application's own requests are
    held (nothing the peer sends adds one). One more -> the request method raises
    ``LocalProtocolError`` ("too many requests waiting for stream credit") and nothing is
    sent. Kept well below the peer's Request ID window (ours: ``max_request_id_window``):
    REQUEST_UPDATEs on open requests go out while older requests are held, so the peer
    sees those IDs out of order (Ambiguity A28)."""

    max_control_message_size: int = 65535
    """Largest control message body we accept (the wire allows 65535). A larger Length
    -> close PROTOCOL_VIOLATION before the body is buffered."""
    max_concurrent_peer_requests: int = 1024
    """Requests the peer may have open on this session at once (each holds state).
    More -> REQUEST_ERROR EXCESSIVE_LOAD with a Retry Interval (d21 section 9.1)."""
    max_request_id_window: int = 4096
    """Peer Request IDs remembered above the low watermark (they arrive out of order,
    Ambiguity A28). A peer that skips IDs fills it; then the watermark moves up and
    the IDs it skipped count as used (a later one closes INVALID_REQUEST_ID)."""
    max_peer_data_streams: int = 4096
    """Data streams the peer may have open towards us at once. More -> the new
    stream is stopped (STOP_SENDING EXCESSIVE_LOAD); QUIC's own stream limit
    normally bounds this first."""
    max_pre_setup_bytes: int = 256 * 1024
    """Bytes buffered on request and data streams that arrive before the peer's
    SETUP (d21 section 6.3: SHOULD buffer). More -> close PROTOCOL_VIOLATION."""
    max_unknown_alias_bytes: int = 256 * 1024
    """Bytes buffered on subgroup streams whose Track Alias is not known yet
    (the SUBSCRIBE_OK may still be on its way). More -> STOP_SENDING the stream."""
    max_payload_size: int = 64 * 1024 * 1024
    """Largest object payload we accept (local limit; more -> PROTOCOL_VIOLATION)."""
    max_queued_bytes_per_subscription: int = 64 * 1024 * 1024
    """Bytes of objects queued towards the peer for one live subscription before
    it counts as too far behind -> PUBLISH_DONE TOO_FAR_BEHIND (d21 section 5.2)."""
    max_datagram_size: int = 1200
    """Largest QUIC DATAGRAM payload we send (the path's datagram size; the adapter knows
    better and should set it). An object whose datagram would be larger is dropped
    silently (wire reference 7.6)."""
    publish_done_grace: float = 2.0
    """After PUBLISH_DONE, how long to keep receiving a subscription's streams still in
    flight when fewer than its Stream Count have been seen (d21 9.9)."""
    retry_interval_ms: int = 1000
    """Retry Interval we suggest when refusing for load (d21 section 9.4.2)."""
