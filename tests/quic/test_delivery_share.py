"""Delivery's share of a relay's turn (``QuicEndpoint.service``, #11 "every hop pipelined").

A relay taking in a publisher reads a batch of datagrams per turn, while a paced stack
sends one burst per connection per call, so a live subscriber got one datagram for every
sixteen taken in. ``service`` now asks the connections that still have stream data waiting
again, at the driver's clock, while they produce datagrams and until it has sent as many
as were received for a connection since the last call.

The connections here are stand-ins for a paced stack (16 datagrams per burst, one burst
per millisecond of the clock) routed by their connection ID, so what is counted is
exactly the endpoint's policy: without a clock, or with nothing received, one burst per
call, as before; with both, bursts until the received count is matched, never asking a
connection with nothing waiting, and stopping as soon as a round produces nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvcs.transports.quic.apps import ClientApp
from kvcs.transports.quic.config import quic_configuration
from kvcs.transports.quic.endpoint import MAX_FAIR_ROUNDS, QuicEndpoint
from kvcs.transports.quic.stack import load_stack
from kvcs.transports.quic.tls import TlsConfig

BURST = 16
REFILL = 0.001
ADDR = ("127.0.0.1", 4433)


class PacedConnection:
    """What the endpoint sees of a connection whose stack paces: a burst per ``REFILL``."""

    announced = True
    handshake_complete = True
    terminated = False

    def __init__(self, backlog: int) -> None:
        self.events: deque[Any] = deque()
        self.backlog = backlog
        self.last: float | None = None
        self.asked = 0
        self.received = 0

    @property
    def sending(self) -> bool:
        return self.backlog > 0

    def flush(self, now: float) -> int:
        return 0

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        self.asked += 1
        if self.last is not None and now - self.last < REFILL:
            return []  # the pacer's bucket is empty
        n = min(BURST, self.backlog)
        self.backlog -= n
        self.last = now
        return [(b"d", ADDR)] * n

    def feed_datagrams(self, datagrams: list[bytes], addr: Any, now: float) -> bool:
        self.received += len(datagrams)
        return False

    def fail(self, what: str, exc: BaseException, now: float) -> None:
        raise AssertionError(f"{what}: {exc!r}")


class Clock:
    def __init__(self, step: float) -> None:
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def _endpoint(*conns: PacedConnection) -> QuicEndpoint:
    st = load_stack("aioquic")
    cfg = quic_configuration(st, is_client=True, tls=TlsConfig(), server_name="localhost")
    endpoint = QuicEndpoint(st, cfg, ClientApp())
    cid_length = cfg.connection_id_length
    for i, conn in enumerate(conns):
        endpoint.pumps.append(conn)  # type: ignore[arg-type]
        endpoint._by_cid[bytes([i + 1]) * cid_length] = conn  # type: ignore[assignment]
    return endpoint


def _datagrams_for(i: int, n: int, cid_length: int) -> list[tuple[bytes, Any]]:
    """``n`` short-header datagrams for connection ``i`` (RFC 9000 section 17.3)."""
    return [(b"\x40" + bytes([i + 1]) * cid_length + b"payload", ADDR)] * n


def test_without_a_clock_a_call_sends_one_burst() -> None:
    delivering = PacedConnection(backlog=10_000)
    feeding = PacedConnection(backlog=0)
    endpoint = _endpoint(delivering, feeding)
    cid_length = endpoint.configuration.connection_id_length
    endpoint.receive_datagrams(_datagrams_for(1, 200, cid_length), 0.0)
    assert feeding.received == 200
    assert len(endpoint.service(0.0)) == BURST


def test_with_a_clock_delivery_is_sent_as_many_as_were_received() -> None:
    delivering = PacedConnection(backlog=10_000)
    feeding = PacedConnection(backlog=0)
    endpoint = _endpoint(delivering, feeding)
    endpoint.clock = Clock(step=1.5 * REFILL)  # building a burst outlasts the refill
    cid_length = endpoint.configuration.connection_id_length
    endpoint.receive_datagrams(_datagrams_for(1, 200, cid_length), 0.0)
    out = endpoint.service(0.0)
    assert 200 <= len(out) < 200 + BURST
    assert feeding.asked == 1  # nothing waiting there: asked once, by the usual round
    # the next call, with nothing received meanwhile: one burst again
    endpoint.clock.t += 1.0
    assert len(endpoint.service(endpoint.clock.t)) == BURST


def test_junk_buys_no_delivery_rounds() -> None:
    delivering = PacedConnection(backlog=10_000)
    endpoint = _endpoint(delivering)
    endpoint.clock = Clock(step=1.5 * REFILL)
    endpoint.receive_datagrams([(b"\x40" + b"\xee" * 8, ADDR)] * 200, 0.0)  # unknown IDs
    assert len(endpoint.service(0.0)) == BURST


def test_a_round_that_produces_nothing_ends_the_share() -> None:
    delivering = PacedConnection(backlog=10_000)
    feeding = PacedConnection(backlog=0)
    endpoint = _endpoint(delivering, feeding)
    endpoint.clock = Clock(step=REFILL / 100)  # the pacer has not refilled yet
    cid_length = endpoint.configuration.connection_id_length
    endpoint.receive_datagrams(_datagrams_for(1, 200, cid_length), 0.0)
    assert len(endpoint.service(0.0)) == BURST
    assert delivering.asked == 2  # the usual round, then one that produced nothing


def test_the_share_is_bounded_in_rounds() -> None:
    delivering = PacedConnection(backlog=1_000_000)
    feeding = PacedConnection(backlog=0)
    endpoint = _endpoint(delivering, feeding)
    endpoint.clock = Clock(step=1.5 * REFILL)
    cid_length = endpoint.configuration.connection_id_length
    endpoint.receive_datagrams(_datagrams_for(1, 100_000, cid_length), 0.0)
    out = endpoint.service(0.0)
    assert len(out) == BURST * (1 + MAX_FAIR_ROUNDS)
