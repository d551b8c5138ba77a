"""The send window of a connection (``max_outstanding``, :mod:`kvcs.transports.quic.pump`),
and datagrams read together handed to qh3 in one call (``QuicStack.receive_many``).

A publisher over real QUIC on 127.0.0.1 (aioquic and qh3) whose connection may hold at
most 256 KiB in its stack, unsent or in flight, sends a cache of several MiB through a
relay to a consumer: after every flush the producer's connection holds no more than that
bound plus one write, it did hold data (the check looked at something), and the cache
arrives bit for bit. A relay shares its send budget (``send_budget``) among its
connections: serving four consumers and a producer, each connection's window is a fifth
of the budget, what the relay holds for each consumer and for all of them together
stays within it, every consumer gets the cache bit for bit, and the windows widen
again as consumers leave. The stacks report bytes in flight; a stack that cannot
(``bytes_in_flight`` left at its default) reports 0. With qh3 the datagrams each
endpoint reads together reach the connection in batches (``receive_many_datagrams``),
and the cache still arrives bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from test_quic_inprocess import (
    HAVE_QH3,
    SCOPE_KEY,
    WAIT,
    _identical,
    _put_layers,
    _retrieve_complete,
    _run,
    _source,
    _trusting,
    tls,
)

from kvcs.adapters.numpy_kv import KvDestination
from kvcs.transports.quic import asyncio_binding
from kvcs.transports.quic import stack as stack_mod
from kvcs.transports.quic.endpoint import QuicEndpoint
from kvcs.transports.quic.pump import DEFAULT_MAX_OUTSTANDING, DEFAULT_SEND_BUDGET, SessionPump
from kvcs.transports.quic.stack import QuicStack, load_stack
from kvcs.transports.quic.tls import TlsConfig

__all__ = ["tls"]  # fixture

WINDOW = 256 * 1024
"""The bound the test sets: far below the cache (8 layers x 512 KiB)."""
ONE_WRITE = 64 * 1024
"""What one pull may add past the bound's check (an object's header and a chunk)."""

STACKS = ["aioquic", pytest.param("qh3", marks=pytest.mark.skipif(not HAVE_QH3, reason="no qh3"))]


def test_default_window_is_a_few_mib() -> None:
    assert 1 << 20 <= DEFAULT_MAX_OUTSTANDING <= 16 << 20
    assert DEFAULT_MAX_OUTSTANDING <= DEFAULT_SEND_BUDGET <= 32 << 20


@pytest.mark.parametrize("stack", STACKS)
def test_stack_reports_bytes_in_flight(stack: str) -> None:
    st = load_stack(stack)
    assert isinstance(st, QuicStack)
    assert st.bytes_in_flight is not QuicStack.__attrs_attrs__.bytes_in_flight.default


@pytest.mark.parametrize("stack", STACKS)
def test_a_publisher_holds_at_most_its_send_window(
    stack: str, tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, int] = {"max": 0, "flushes": 0}
    watched: list[SessionPump] = []
    original_flush = SessionPump.flush

    def flush(pump: SessionPump, now: float) -> int:
        pulled = original_flush(pump, now)
        if pump in watched:
            held = pump.unsent_bytes() + pump.stack.bytes_in_flight(pump.quic)
            seen["max"] = max(seen["max"], held)
            seen["flushes"] += 1
        return pulled

    monkeypatch.setattr(SessionPump, "flush", flush)
    _run("asyncio", lambda: _publish_with_window(stack, tls, watched), 90)
    assert seen["flushes"] > 0
    assert 0 < seen["max"] <= WINDOW + ONE_WRITE, seen


async def _publish_with_window(stack: str, tls: TlsConfig, watched: list[SessionPump]) -> None:
    b = asyncio_binding
    layers, tokens = 8, 1024
    source = _source(layers=layers, tokens=tokens)
    cd = source.cd
    dest = KvDestination(cd, tokens)
    async with b.serve_relay("127.0.0.1:0", tls=tls, stack=stack) as server:
        url = server.url
        async with (
            b.connect(url, tls=_trusting(tls), stack=stack, timeout=WAIT) as producer,
            b.connect(url, tls=_trusting(tls), stack=stack, timeout=WAIT) as consumer,
        ):
            pump: Any = producer.pump
            pump.max_outstanding = WINDOW
            watched.append(pump)
            pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)

            await asyncio.gather(
                _put_layers(pub, source), _retrieve_complete(consumer, source, dest)
            )
    assert _identical(source, dest, tokens), "not bit-identical"


@pytest.mark.skipif(not HAVE_QH3, reason="no qh3")
def test_qh3_takes_datagrams_read_together_in_one_call(
    tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_stack("aioquic").receive_many is None  # aioquic: one call per datagram
    sizes: list[int] = []
    batched = stack_mod._qh3_receive_many

    def counting(conn: Any, datagrams: list[bytes], addr: Any, now: float) -> None:
        sizes.append(len(datagrams))
        batched(conn, datagrams, addr, now)

    monkeypatch.setattr(stack_mod, "_qh3_receive_many", counting)
    assert load_stack("qh3").receive_many is counting
    _run("asyncio", lambda: _publish_with_window(stack="qh3", tls=tls, watched=[]), 90)
    assert sizes and max(sizes) > 1 and min(sizes) > 1, sizes[:20]


CONSUMERS = 4
SHARE = 256 * 1024
"""Each of the relay's five connections' share of the budget the test sets."""


@pytest.mark.parametrize("stack", STACKS)
def test_a_relay_shares_one_send_budget_among_its_consumers(
    stack: str, tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {"max": 0, "total": 0, "flushes": 0, "shares": set()}
    relay_pumps: list[SessionPump] = []
    original_flush = SessionPump.flush

    def flush(pump: SessionPump, now: float) -> int:
        pulled = original_flush(pump, now)
        if pump in relay_pumps:
            held = [p.unsent_bytes() + p.stack.bytes_in_flight(p.quic) for p in relay_pumps]
            seen["max"] = max(seen["max"], *held)
            seen["total"] = max(seen["total"], sum(held))
            seen["flushes"] += 1
            seen["shares"].add(pump.window_share)
        return pulled

    monkeypatch.setattr(SessionPump, "flush", flush)
    widened = _run("asyncio", lambda: _fan_out(stack, tls, relay_pumps), 120)
    assert seen["flushes"] > 0
    assert seen["shares"] == {SHARE}, seen["shares"]
    assert 0 < seen["max"] <= SHARE + ONE_WRITE, seen
    assert seen["total"] <= (CONSUMERS + 1) * (SHARE + ONE_WRITE), seen
    wider = (CONSUMERS + 1) * SHARE // 2  # the producer's and one consumer's connections
    assert widened == [wider, wider], widened


async def _fan_out(stack: str, tls: TlsConfig, relay_pumps: list[SessionPump]) -> list[int]:
    """Four consumers retrieve a cache through a relay whose connections share a small
    send budget; then three leave. Returns the windows of the two connections left."""
    b = asyncio_binding
    layers, tokens = 8, 1024
    source = _source(layers=layers, tokens=tokens)
    dests = [KvDestination(source.cd, tokens) for _ in range(CONSUMERS)]

    def connect() -> Any:
        return b.connect(server.url, tls=_trusting(tls), stack=stack, timeout=WAIT)

    async with b.serve_relay("127.0.0.1:0", tls=tls, stack=stack) as server:
        endpoint: QuicEndpoint = server.driver.endpoint
        endpoint.max_unsent = 64 * 1024  # so that the share, not the floor, binds
        endpoint.send_budget = (CONSUMERS + 1) * SHARE
        async with connect() as producer, connect() as staying:
            async with contextlib.AsyncExitStack() as leaving:
                others = [
                    await leaving.enter_async_context(connect()) for _ in range(CONSUMERS - 1)
                ]
                relay_pumps.extend(endpoint.pumps)
                assert len(relay_pumps) == CONSUMERS + 1
                pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)
                await asyncio.gather(
                    _put_layers(pub, source),
                    *(
                        _retrieve_complete(c, source, d)
                        for c, d in zip([staying, *others], dests, strict=True)
                    ),
                )
                relay_pumps.clear()
            # the relay lets the connections that ended go as it reaps them
            await server.driver.wait_for(lambda: len(endpoint.pumps) == 2, WAIT)
            widened = [p.window_share for p in endpoint.pumps]
    assert all(_identical(source, d, tokens) for d in dests), "not bit-identical"
    return [w for w in widened if w is not None]
