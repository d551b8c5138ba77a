"""Backpressure from a full relay cache to the publisher, over real QUIC (#11).

A relay on 127.0.0.1 with a 4 MiB cache serves a 24 MiB cache published live to two
consumers, on aioquic and on qh3. The relay cannot send to one of them for a while (its
connection's send budget is set to nothing, as a congested path would do): that
consumer's queues keep references into the cache, the cache evicts groups they still
hold, and at the hold mark (2 MiB: ``RelayConfig.intake_hold_bytes`` capped at half the
budget) the relay holds its intake from the publisher (``Relay.intake_held``: the pump
stops taking the publisher's data, so QUIC flow control stops it). The numbers are the
defaults scaled down by four (the relay's receive window, ``RELAY_MAX_DATA`` by
default, is set to 4 MiB here, and the subscriptions' queue limit to 10 MiB), so that
the bound is what it is with the defaults: what the relay's sessions hold of objects the
cache no longer keeps (``RelayStats.held_outside_bytes``: evicted, or forwarded and never
kept) stays within the hold mark plus one window.

While held, the relay takes no more than that window from the publisher, which keeps
data unsent, and what the sessions hold outside the cache stays within the hold mark plus
the window. When the consumer's path opens again it drains, the relay releases the
publisher, and both consumers complete bit for bit; no hold was given up.

The same through a two-relay tree, the consumers at a leaf relay with the small cache:
the leaf's feed is its upstream link to the root relay (a QUIC client connection), so
holding that link stops the root, whose cache keeps what the leaf has not taken yet. (A
credit-holding stack, aioquic, still delivers what it had granted after a hold starts;
the leaf once released its hold on each such input, took 8.8 MiB beyond the bound here,
and in the CLI with an 8 MiB leaf cache ended its consumer incomplete.)

The same scenario where the stack cannot hold (``QuicStack.hold_input`` refusing): the
relay decides to hold, nothing stops the publisher, and the slow consumer's subscription
passes its queue limit (PUBLISH_DONE TOO_FAR_BEHIND).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from test_quic_inprocess import (
    HAVE_QH3,
    SCOPE_KEY,
    WAIT,
    _identical,
    _put_layers,
    _run,
    _start_retrieval,
    _trusting,
    tls,
)

from kvcs.adapters.cachefile import CacheFile, llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import KvDestination
from kvcs.transports.quic import _setup as setup_mod
from kvcs.transports.quic import asyncio_binding
from kvcs.transports.quic import stack as stack_mod
from kvcs.transports.quic.apps import ClientApp
from kvcs.transports.quic.endpoint import QuicEndpoint
from kvcs.transports.quic.pump import SessionPump
from kvcs.transports.quic.tls import TlsConfig
from kvcs_core.kvcs.consumer import ManifestAccepted
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import SessionConfig
from kvcs_core.relay import RelayConfig
from kvcs_core.wire.codes import PublishDoneCode

__all__ = ["tls"]  # fixture

STACKS = ["aioquic", pytest.param("qh3", marks=pytest.mark.skipif(not HAVE_QH3, reason="no qh3"))]

LAYERS, TOKENS = 6, 1024
"""24 MiB: 6 layers x 1024 tokens x 4 KiB (8 KV heads x 128 x bf16, K and V)."""
BUDGET = 4 << 20
HOLD = BUDGET // 2
"""The hold mark: ``RelayConfig.intake_hold_bytes`` (8 MiB) capped at half the budget."""
WINDOW = 4 << 20
"""The relay's receive window per connection in this test."""
QUEUE_LIMIT = 10 << 20
"""The subscriptions' queue limit: the default scaled down by four."""
SLACK = 1 << 20
"""Accounting overheads and one object in flight beyond hold mark plus window."""


def _source() -> CacheFile:
    return synthetic(llama_descriptor(layers=LAYERS, block_tokens=64), TOKENS, seed=11)


@attrs.define
class Seen:
    held_at: float | None = None
    max_held_outside: int = 0
    taken_while_held: int | None = None
    publisher_unsent_while_held: int = 0
    nothing_to_hold_back: bool = False
    """(Tree) the root had sent the leaf all it had received at some look while held."""
    released: bool = False
    too_far_behind: int = 0


async def _taken_while_held(
    relay: Any,
    seen: Seen,
    *,
    unbroken: bool,
    span: float = 0.5,
    probe: Callable[[], None] | None = None,
) -> int | None:
    """What the relay took from the publisher during ``span`` seconds of one unbroken hold
    (``unbroken``), or in the ``span`` seconds after it decided to hold.

    The fast consumer may fall behind too (on a loaded machine) and hold evicted objects
    for a moment; when it catches up the gate opens and takes more, then holds again. Such
    a span measures two holds, not one, so it is started again at the next hold. Where the
    transport cannot hold, the slow subscription is ended and the gate opens: there the
    span after the decision is what shows that nothing stopped the publisher. ``probe`` is
    called at every look during the span."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        st = relay.stats()
        if not st.intake_held:
            await asyncio.sleep(0.002)
            continue
        holds, at, start = st.intake_holds, st.upstream_bytes_received, time.monotonic()
        while time.monotonic() - start < span:  # held: the publisher is stopped
            await asyncio.sleep(0.005)
            st = relay.stats()
            seen.max_held_outside = max(seen.max_held_outside, st.held_outside_bytes)
            if probe is not None:
                probe()
            if unbroken and (not st.intake_held or st.intake_holds != holds):
                break
        else:
            return int(st.upstream_bytes_received - at)
    return None


@attrs.define
class Stall:
    """One scenario's pieces for :func:`_stall_and_watch`."""

    relay: Any
    """The relay whose cache is small (its stats are watched)."""
    driver: Any
    pub: Any
    fast: Any
    slow: Any
    slow_path: SessionPump
    """The relay's side of the slow consumer's connection."""
    source: CacheFile
    dests: list[KvDestination]


async def _stall_and_watch(
    stall: Stall,
    seen: Seen,
    *,
    unbroken: bool,
    probe: Callable[[], None] | None = None,
    after_hold: Callable[[], None] | None = None,
) -> tuple[Any, list[bool]]:
    """Both consumers retrieve; once they subscribed, the relay cannot send the slow one
    object data until it has held its intake for one span (``probe`` at every look of it,
    ``after_hold`` after it); everything is published meanwhile. Returns the relay's
    stats and ``[fast complete, slow complete, fast identical, slow identical]``."""
    relay, slow_path, source = stall.relay, stall.slow_path, stall.source

    def count_too_far_behind(_pump: SessionPump, event: Any, _now: float) -> None:
        if type(event) is ev.PublishDoneReceived and event.status == PublishDoneCode.TOO_FAR_BEHIND:
            seen.too_far_behind += 1

    app: ClientApp = stall.slow.app
    app.watchers.append(count_too_far_behind)
    normal_unsent = slow_path.max_unsent
    retrievals = [
        _start_retrieval(c, source, d)
        for c, d in ((stall.fast, stall.dests[0]), (stall.slow, stall.dests[1]))
    ]
    # both consumers found the publication and subscribed to its tracks
    await stall.driver.wait_for(
        lambda: all(any(isinstance(e, ManifestAccepted) for e in r.events) for r in retrievals),
        WAIT,
    )
    await asyncio.sleep(0.3)  # their data SUBSCRIBEs reach the relay(s)
    slow_path.max_unsent = 0  # the relay cannot send it object data for now

    async def watch() -> None:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            st = relay.stats()
            seen.max_held_outside = max(seen.max_held_outside, st.held_outside_bytes)
            if st.intake_held and seen.held_at is None:
                seen.held_at = time.monotonic()
                seen.taken_while_held = await _taken_while_held(
                    relay, seen, unbroken=unbroken, probe=probe
                )
                if after_hold is not None:
                    after_hold()
                slow_path.max_unsent = normal_unsent  # the path opens again
                st = relay.stats()
            if seen.held_at is not None and not st.intake_held:
                seen.released = True
                return
            await asyncio.sleep(0.002)
        slow_path.max_unsent = normal_unsent

    results = await asyncio.gather(
        _put_layers(stall.pub, source),
        watch(),
        *(r.result(timeout=WAIT * 2, strict=False) for r in retrievals),
    )
    stats = relay.stats()
    done = [bool(r.complete) for r in results[2:]]
    same = [_identical(source, d, TOKENS) for d in stall.dests]
    return stats, [*done, *same]


async def _scenario(
    stack: str, tls: TlsConfig, seen: Seen, *, holds: bool = True
) -> tuple[Any, list[bool]]:
    b = asyncio_binding
    source = _source()
    dests = [KvDestination(source.cd, TOKENS) for _ in range(2)]
    config = RelayConfig(cache_budget_bytes=BUDGET, intake_stall=30.0)

    def connect() -> Any:
        return b.connect(server.url, tls=_trusting(tls), stack=stack, timeout=WAIT)

    async with b.serve_relay("127.0.0.1:0", tls=tls, stack=stack, relay_config=config) as server:
        endpoint: QuicEndpoint = server.driver.endpoint
        endpoint.configuration.max_data = WINDOW
        endpoint.configuration.max_stream_data = WINDOW
        endpoint.session_config = lambda role: SessionConfig(
            role=role, max_queued_bytes_per_subscription=QUEUE_LIMIT
        )
        async with connect() as producer, connect() as fast, connect() as slow:
            assert len(endpoint.pumps) == 3
            slow_path: SessionPump = endpoint.pumps[2]  # the relay's side, accepted third
            publisher_pump: SessionPump = producer.pump
            pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)

            def look_at_publisher() -> None:
                seen.publisher_unsent_while_held = publisher_pump.unsent_bytes()

            stall = Stall(server.relay, server.driver, pub, fast, slow, slow_path, source, dests)
            return await _stall_and_watch(stall, seen, unbroken=holds, after_hold=look_at_publisher)


QH3_FAULT = "reserved stream is missing"
"""qh3 2.1's own fault (``stack`` module docstring): its core drops the connection."""


@pytest.mark.parametrize("stack", STACKS)
def test_a_full_cache_holds_the_publisher_and_nobody_is_dropped(
    stack: str, tls: TlsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    seen = Seen()
    stats, ok = _run("asyncio", lambda: _scenario(stack, tls, seen), 120)
    if any(QH3_FAULT in r.getMessage() for r in caplog.records):
        # the relay's connection to the stalled consumer ended inside qh3 2.1 itself (a
        # stream reservation outliving its stream), which kvcs cannot prevent from outside;
        # seen on a loaded machine, about 1 run in 10: the scenario says nothing then
        pytest.xfail(f"qh3 2.1 fault {QH3_FAULT!r} dropped a connection: {ok}, {seen}")
    assert seen.held_at is not None, seen
    assert stats.intake_holds >= 1 and stats.intake_given_up == 0, stats
    assert seen.released, seen
    # held, the relay took at most what the publisher had credit for, and then stopped
    assert seen.taken_while_held is not None and seen.taken_while_held <= WINDOW, seen
    assert seen.publisher_unsent_while_held > 0, seen
    # what the slow consumer's queues held outside the cache stayed under its limit
    assert seen.max_held_outside <= HOLD + WINDOW + SLACK, seen
    assert seen.too_far_behind == 0, seen
    assert ok == [True, True, True, True], (ok, seen)
    assert stats.upstream_bytes_received >= LAYERS * TOKENS * 4096


@pytest.mark.skipif(not HAVE_QH3, reason="no qh3")
def test_without_a_hold_the_slow_consumer_passes_its_queue_limit(
    tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack_mod, "_qh3_hold_input", lambda conn, held: False)
    seen = Seen()
    _stats, _ok = _run("asyncio", lambda: _scenario("qh3", tls, seen, holds=False), 120)
    # the relay decided to hold, but the transport could not: intake went on
    assert seen.held_at is not None and seen.taken_while_held is not None, seen
    assert seen.taken_while_held > WINDOW, seen
    assert seen.max_held_outside > QUEUE_LIMIT or seen.too_far_behind > 0, seen


async def _tree_scenario(stack: str, tls: TlsConfig, seen: Seen) -> tuple[Any, list[bool]]:
    """The same through a two-relay tree: the publisher at a root relay (its default
    cache), both consumers at a leaf relay whose cache is ``BUDGET``. The leaf's feed is
    its upstream link, a QUIC client connection to the root: holding it is what stops
    the root, whose own cache then keeps what the leaf has not taken."""
    b = asyncio_binding
    source = _source()
    dests = [KvDestination(source.cd, TOKENS) for _ in range(2)]

    def connect(url: str) -> Any:
        return b.connect(url, tls=_trusting(tls), stack=stack, timeout=WAIT)

    leaf_config = RelayConfig(cache_budget_bytes=BUDGET, intake_stall=30.0)
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls, stack=stack) as root,
        b.serve_relay(
            "127.0.0.1:0",
            tls=tls,
            stack=stack,
            relay_config=leaf_config,
            upstream=root.url,
            upstream_tls=_trusting(tls),
        ) as leaf,
    ):
        endpoint: QuicEndpoint = leaf.driver.endpoint
        endpoint.session_config = lambda role: SessionConfig(
            role=role, max_queued_bytes_per_subscription=QUEUE_LIMIT
        )
        async with (
            connect(root.url) as producer,
            connect(leaf.url) as fast,
            connect(leaf.url) as slow,
        ):
            accepted = [p for p in endpoint.pumps if not p.quic.configuration.is_client]
            assert len(accepted) == 2
            slow_path: SessionPump = accepted[1]  # the leaf's side, accepted second
            root_pumps = list(root.driver.endpoint.pumps)
            pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)

            def look_at_root() -> None:
                # data for the leaf that flow control keeps back at the root, or nothing
                # left there to hold back (it sent all it had)
                unsent = sum(p.unsent_bytes() for p in root_pumps)
                seen.publisher_unsent_while_held = max(seen.publisher_unsent_while_held, unsent)
                rs = root.relay.stats()
                if rs.bytes_sent >= rs.upstream_bytes_received:
                    seen.nothing_to_hold_back = True

            stall = Stall(leaf.relay, leaf.driver, pub, fast, slow, slow_path, source, dests)
            return await _stall_and_watch(stall, seen, unbroken=True, probe=look_at_root)


@pytest.mark.parametrize("stack", STACKS)
def test_a_full_leaf_cache_holds_its_upstream_relay_and_nobody_is_dropped(
    stack: str, tls: TlsConfig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # both relays' windows (the leaf's upstream link takes its endpoint's) scaled down
    monkeypatch.setattr(setup_mod, "RELAY_MAX_DATA", WINDOW)
    seen = Seen()
    stats, ok = _run("asyncio", lambda: _tree_scenario(stack, tls, seen), 120)
    if any(QH3_FAULT in r.getMessage() for r in caplog.records):
        pytest.xfail(f"qh3 2.1 fault {QH3_FAULT!r} dropped a connection: {ok}, {seen}")
    assert seen.held_at is not None, seen
    assert stats.intake_holds >= 1 and stats.intake_given_up == 0, stats
    assert seen.released, seen
    assert seen.taken_while_held is not None and seen.taken_while_held <= WINDOW, seen
    assert seen.publisher_unsent_while_held > 0 or seen.nothing_to_hold_back, seen
    assert seen.max_held_outside <= HOLD + WINDOW + SLACK, seen
    assert seen.too_far_behind == 0, seen
    assert ok == [True, True, True, True], (ok, seen)
