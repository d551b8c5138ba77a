"""Which QUIC implementation carries the sessions: aioquic or qh3, chosen by name.

Theory of operation
-------------------
kvcs drives a QUIC stack through the sans-I/O ``QuicConnection`` API that aioquic
defined and qh3 (a fork with a native packet and crypto core) kept: construct a
connection from a ``QuicConfiguration``, feed it datagrams, timers and stream
writes, take datagrams and events out. Everything stack-specific that kvcs needs
is collected in one :class:`QuicStack` value, so the pump, the endpoint and the
event-loop drivers never import a stack themselves, and a third stack with the
same API plugs in by building one more :class:`QuicStack`.

The only thing the two stacks expose differently is how many written stream
bytes still wait for their first transmission (the backpressure signal): qh3
offers ``get_send_buffer_size``; for aioquic it is read from each stream's
sender (``_buffer_stop - highest_offset``: bytes queued but never sent).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import attrs

ALPN = "moqt-22"
"""The ALPN of MOQT draft-22 over native QUIC (wire reference section 1)."""

STACKS = ("aioquic", "qh3")


class StackUnavailable(RuntimeError):
    """The requested QUIC stack is not installed."""


@attrs.frozen
class QuicStack:
    """The handful of names kvcs takes from a QUIC implementation."""

    name: str
    configuration: Callable[..., Any]
    connection: Callable[..., Any]
    events: ModuleType
    pull_header: Callable[[bytes, int], Any]
    """``(datagram, host_cid_length) -> header`` (raises ``ValueError`` on garbage)."""
    encode_version_negotiation: Callable[..., bytes]
    packet_type_initial: Any
    unsent_bytes: Callable[[Any, int], int]
    """``(connection, stream_id) -> bytes written but not yet sent once``."""


def _aioquic_unsent(conn: Any, stream_id: int) -> int:
    stream = conn._streams.get(stream_id)
    if stream is None:
        return 0
    sender = stream.sender
    return max(0, int(sender._buffer_stop) - int(sender.highest_offset))


def _qh3_unsent(conn: Any, stream_id: int) -> int:
    return int(conn.get_send_buffer_size(stream_id))


def load_stack(name: str = "aioquic") -> QuicStack:
    """Import and describe a QUIC stack by name (``aioquic`` or ``qh3``)."""
    if name not in STACKS:
        raise StackUnavailable(f"unknown QUIC stack {name!r} (choose from {', '.join(STACKS)})")
    try:
        config_mod = importlib.import_module(f"{name}.quic.configuration")
        conn_mod = importlib.import_module(f"{name}.quic.connection")
        events_mod = importlib.import_module(f"{name}.quic.events")
        packet_mod = importlib.import_module(f"{name}.quic.packet")
    except ImportError as exc:
        raise StackUnavailable(f"QUIC stack {name!r} is not installed ({exc})") from exc
    if name == "aioquic":
        buffer_cls = importlib.import_module("aioquic.buffer").Buffer
        unsent = _aioquic_unsent
    else:
        buffer_cls = importlib.import_module("qh3._hazmat").Buffer
        unsent = _qh3_unsent
    pull = packet_mod.pull_quic_header

    def pull_header(data: bytes, cid_length: int) -> Any:
        return pull(buffer_cls(data=data), host_cid_length=cid_length)

    return QuicStack(
        name=name,
        configuration=config_mod.QuicConfiguration,
        connection=conn_mod.QuicConnection,
        events=events_mod,
        pull_header=pull_header,
        encode_version_negotiation=packet_mod.encode_quic_version_negotiation,
        packet_type_initial=packet_mod.QuicPacketType.INITIAL,
        unsent_bytes=unsent,
    )
