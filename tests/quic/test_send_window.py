"""The send window of a connection (``max_outstanding``, :mod:`kvcs.transports.quic.pump`),
and datagrams read together handed to qh3 in one call (``QuicStack.receive_many``).

A publisher over real QUIC on 127.0.0.1 (aioquic and qh3) whose connection may hold at
most 256 KiB in its stack, unsent or in flight, sends a cache of several MiB through a
relay to a consumer: after every flush the producer's connection holds no more than that
bound plus one write, it did hold data (the check looked at something), and the cache
arrives bit for bit. The stacks report bytes in flight; a stack that cannot
(``bytes_in_flight`` left at its default) reports 0. With qh3 the datagrams each
endpoint reads together reach the connection in batches (``receive_many_datagrams``),
and the cache still arrives bit for bit.
"""

from __future__ import annotations

import asyncio
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
from kvcs.transports.quic.pump import DEFAULT_MAX_OUTSTANDING, SessionPump
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
