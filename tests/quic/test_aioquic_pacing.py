"""aioquic's pacer keeps its bursts at any rate (``stack.keep_pacing_bursts``).

aioquic floors a packet's pacing time at one microsecond but sizes its token bucket from
the unfloored rate, so with a congestion window of tens of MB over a millisecond round
trip (loopback after a long slow start) its bucket holds less than one packet and every
wake of the event loop sends one datagram. With kvcs's connections the bucket holds the
burst aioquic means (2 to 16 packets) at the floored time, and below the floor the pacer
is aioquic's own, unchanged.

Two real aioquic connections, client and server, exchange datagrams in memory on a
simulated clock (no sockets, no sleeping); the client's congestion window is set to what
such a run reached (32 MiB) and its pacer's rate updated by real acknowledgements.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcs.transports.quic.config import quic_configuration
from kvcs.transports.quic.stack import keep_pacing_bursts, load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed

recovery = pytest.importorskip("aioquic.quic.recovery")

ADDR_C = ("127.0.0.1", 40001)
ADDR_S = ("127.0.0.1", 40002)
ONE_WAY = 0.0005
"""Seconds each datagram takes on the simulated path (a 1 ms round trip)."""
WAKE_COST = 0.00005
"""Simulated seconds between an event loop's wakes at the soonest (its own work)."""
MSS = 1200
WAKES = 100
"""Simulated event-loop wakes."""


def test_pacer_bucket_holds_its_burst_at_the_floored_packet_time() -> None:
    pacer = recovery.QuicPacketPacer(max_datagram_size=MSS)
    keep_pacing_bursts(pacer)
    pacer.update_rate(congestion_window=32 << 20, smoothed_rtt=0.001)
    assert pacer.packet_time == pytest.approx(recovery.K_MICRO_SECOND)  # aioquic's floor
    assert pacer.bucket_max >= 16 * pacer.packet_time - 1e-12


@pytest.mark.parametrize(("window", "rtt"), [(12_000, 0.1), (1 << 20, 0.01), (1 << 20, 0.002)])
def test_pacer_below_the_floor_is_aioquics_own(window: int, rtt: float) -> None:
    own = recovery.QuicPacketPacer(max_datagram_size=MSS)
    kept = recovery.QuicPacketPacer(max_datagram_size=MSS)
    keep_pacing_bursts(kept)
    own.update_rate(congestion_window=window, smoothed_rtt=rtt)
    kept.update_rate(congestion_window=window, smoothed_rtt=rtt)
    assert own.packet_time > recovery.K_MICRO_SECOND
    assert (kept.packet_time, kept.bucket_max) == (own.packet_time, own.bucket_max)


def _deliver(sender: Any, receiver: Any, to: tuple[str, int], now: float) -> int:
    out = sender.datagrams_to_send(now=now)
    for data, _ in out:
        receiver.receive_datagram(data, to, now=now + ONE_WAY)
    return len(out)


def _connected(tmp_path: Path) -> tuple[Any, Any, float]:
    """A kvcs aioquic client and server after their handshake; ``(client, server, now)``."""
    stack = load_stack("aioquic")
    client = stack.connection(
        configuration=quic_configuration(stack, is_client=True, tls=TlsConfig(verify=False))
    )
    now = 1000.0
    client.connect(ADDR_S, now=now)
    server = stack.connection(  # as a server endpoint makes it for the client's first Initial
        configuration=quic_configuration(stack, is_client=False, tls=self_signed(tmp_path)),
        original_destination_connection_id=client._peer_cid.cid,
    )
    for _ in range(20):
        moved = _deliver(client, server, ADDR_C, now)
        now += ONE_WAY
        moved += _deliver(server, client, ADDR_S, now)
        now += ONE_WAY
        if not moved and client._handshake_complete:
            break
    assert client._handshake_complete
    return client, server, now


def test_a_fast_connection_sends_bursts_per_wake(tmp_path: Path) -> None:
    client, server, now = _connected(tmp_path)
    client._loss._cc.congestion_window = 32 << 20  # where Reno's slow start got on loopback
    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"\x5a" * (4 << 20))
    for _ in range(3):  # acknowledged round trips: the pacer's rate from the real RTT
        _deliver(client, server, ADDR_C, now)
        now += ONE_WAY
        _deliver(server, client, ADDR_S, now)
        now += ONE_WAY
    client._loss._cc.congestion_window = 32 << 20  # as it was, whatever the ACKs added
    pacer = client._loss._pacer
    assert pacer.packet_time == pytest.approx(recovery.K_MICRO_SECOND)  # past the floor

    sent = 0
    for _ in range(WAKES):  # an event loop: woken by the pacer's timer, no sooner than it can
        timer = client.get_timer()
        now = max(now + WAKE_COST, timer if timer is not None else now)
        sent += len(client.datagrams_to_send(now=now))
    assert sent >= 8 * WAKES  # aioquic's own pacer: one datagram per wake here
    assert sent <= 17 * WAKES  # never more than its largest burst (and the one it started)
