"""Connection lifecycle over real QUIC on 127.0.0.1, everything in this process.

Sessions that stay quiet longer than the idle timeout (keep-alive PINGs), links that
come back after their peer restarts (reconnection with backoff, publications and
upstream sessions restored), a session the server closes right after SETUP, the
per-address connection limit, failure isolation inside the endpoint, the log line
of every connection that ends, and trio with and without strict exception groups.

Idle timeouts are short (``IDLE`` s) so that "idle for twice the idle timeout" stays
quick; every scenario runs under a hard deadline on its loop, every wait is on a
condition with a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio
from test_quic_inprocess import _until

from kvcs.adapters.cachefile import CacheFile, llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import KvDestination, layer_sections
from kvcs.transports.quic import asyncio_binding, trio_binding
from kvcs.transports.quic._setup import relay_endpoint
from kvcs.transports.quic.api import CachePublication, ConnectError, MoqtClient
from kvcs.transports.quic.apps import RelayApp
from kvcs.transports.quic.config import quic_configuration
from kvcs.transports.quic.endpoint import CONNECTION_REFUSED, QuicEndpoint
from kvcs.transports.quic.groups import single_errors, sole
from kvcs.transports.quic.pump import SessionPump, keepalive_interval
from kvcs.transports.quic.reconnect import Backoff
from kvcs.transports.quic.stack import load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.moqt import events as ev
from kvcs_core.wire.names import TrackNamespace

SCOPE_KEY = bytes(range(32))
LAYERS = 4
TOKENS = 48  # 3 blocks of 16 tokens
IDLE = 1.0
SCENARIO_TIMEOUT = 60.0
WAIT = 20.0
FAST = Backoff(initial=0.1, maximum=0.5)

LOOPS = {"asyncio": asyncio_binding, "trio": trio_binding}


def _run(
    loop: str,
    fn: Callable[[], Awaitable[Any]],
    timeout: float = SCENARIO_TIMEOUT,
    *,
    strict: bool | None = None,
) -> Any:
    """Run ``fn()`` on ``loop`` with a hard deadline (trio: with ``strict`` exception
    groups or without, as trio before 0.25 behaved; ``None``: this trio's default)."""
    if loop == "trio":

        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await fn()

        if strict is None:
            return trio.run(bounded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # strict_exception_groups=False is deprecated
            return trio.run(bounded, strict_exception_groups=strict)
    return asyncio.run(asyncio.wait_for(fn(), timeout))


def _source(seed: int = 7) -> CacheFile:
    return synthetic(llama_descriptor(layers=LAYERS, kv_heads=2, head_dim=64), TOKENS, seed)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return self_signed(tmp_path_factory.mktemp("tls"))


def _trusting(tls: TlsConfig) -> TlsConfig:
    return TlsConfig(cafile=tls.cafile)


def _free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


async def _publish_all(client: MoqtClient, source: CacheFile) -> CachePublication:
    pub = await client.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)
    cd = source.cd
    for layer in range(cd.layers):
        s = layer_sections(source.k[layer], source.v[layer], cd)
        await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
    await pub.finish()
    await pub.drained(timeout=WAIT)
    return pub


async def _fetch(b: ModuleType, url: str, tls: TlsConfig, source: CacheFile) -> None:
    """A consumer on its own connection; the cache must arrive complete, bit for bit."""
    dest = KvDestination(source.cd, TOKENS)
    async with b.connect(url, tls=_trusting(tls), timeout=WAIT, idle_timeout=IDLE) as c:
        r = c.retrieve_cache(
            source.descriptor,
            SCOPE_KEY,
            source.tokens,
            destinations=dest.buffer,
            require_authenticity=False,
        )
        result = await r.result(timeout=WAIT, strict=False)
    assert result.complete, r.events
    for layer in range(source.cd.layers):
        k, v = dest.as_engine_arrays(layer)
        assert np.array_equal(k[:, :TOKENS], source.k[layer, :, :TOKENS]), layer
        assert np.array_equal(v[:, :TOKENS], source.v[layer, :, :TOKENS]), layer


async def _relay_until_stopped(
    b: ModuleType, box: dict[str, Any], listen: str, tls: TlsConfig
) -> None:
    """A relay in a task of its own (so it can stop while others run on): its server in
    ``box["relay"]`` until ``box["stop"]`` is set; then ``box["stopped"]``."""
    async with b.serve_relay(listen, tls=tls, idle_timeout=IDLE) as server:
        box["relay"] = server
        await _until(b, lambda: box.get("stop", False), SCENARIO_TIMEOUT, "the stop signal")
    box["stopped"] = True


async def _idle(b: ModuleType, seconds: float) -> None:
    """Let the sessions be quiet for ``seconds`` (the point of the scenario, not a wait
    for something to happen)."""
    await b.sleep(seconds)


# --- exception groups ------------------------------------------------------------------


def test_sole_picks_one_typed_exception_out_of_a_group() -> None:
    err = ConnectError("no session")
    assert sole(ExceptionGroup("g", [err])) is err
    nested = BaseExceptionGroup("outer", [ExceptionGroup("inner", [ValueError("a")]), err])
    assert isinstance(sole(nested), ValueError)
    ki = KeyboardInterrupt()
    assert sole(BaseExceptionGroup("g", [ValueError("x"), ki])) is ki
    assert sole(err) is err
    with pytest.raises(ConnectError) as info, single_errors():
        raise ExceptionGroup("g", [err])
    assert info.value is err
    assert info.value.__context__ is None  # not chained to the group it came in


@pytest.mark.parametrize("strict", [True, False], ids=["strict-groups", "old-trio-groups"])
def test_trio_errors_are_single_typed_errors_with_and_without_strict_groups(
    strict: bool, tls: TlsConfig, tmp_path: Path
) -> None:
    """trio >= 0.25 wraps every error leaving a nursery in an ExceptionGroup: callers still
    get ConnectError (closed port, wrong CA) and the bare error of a gather job."""
    b = trio_binding
    port = _free_port()
    other = self_signed(tmp_path / "other")

    async def go() -> None:
        with pytest.raises(ConnectError) as closed:
            async with b.connect(
                f"moqt://127.0.0.1:{port}", tls=TlsConfig(verify=False), timeout=1.0
            ):
                pass
        assert f"127.0.0.1:{port}" in str(closed.value)
        async with b.serve_relay("127.0.0.1:0", tls=tls) as server:
            with pytest.raises(ConnectError) as wrong:
                async with b.connect(server.url, tls=TlsConfig(cafile=other.cafile), timeout=WAIT):
                    pass
            assert "certificate" in str(wrong.value).lower()

        async def bad() -> None:
            raise ValueError("one job failed")

        async def good() -> int:
            return 1

        with pytest.raises(ValueError, match="one job failed"):
            await b.gather(good, bad)

    _run("trio", go, strict=strict)


# --- backoff ----------------------------------------------------------------------------


def test_backoff_is_exponential_bounded_and_jittered() -> None:
    b = Backoff(initial=0.5, maximum=8.0, factor=2.0, jitter=0.5)
    assert [b.delay(n, 0.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert b.delay(10_000, 0.0) == 8.0  # bounded, no overflow
    assert b.delay(3, 0.999) == pytest.approx(4.0 * (1 - 0.5 * 0.999))
    for n in range(20):
        for u in (0.0, 0.25, 0.5, 0.99):
            assert 0.25 <= b.delay(n, u) <= 8.0
    with pytest.raises(ValueError):
        Backoff(jitter=1.5)
    with pytest.raises(ValueError):
        Backoff(initial=2.0, maximum=1.0)


def test_keepalive_interval_is_a_third_of_the_idle_timeout() -> None:
    assert keepalive_interval(30.0) == 10.0
    assert keepalive_interval(30.0, 3.0) == 1.0  # the peer's shorter timeout counts
    assert keepalive_interval(600.0) == 15.0  # capped


# --- idle sessions stay up ----------------------------------------------------------------


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_idle_publisher_still_serves_a_late_consumer(loop: str, tls: TlsConfig) -> None:
    b = LOOPS[loop]
    source = _source()

    async def go() -> None:
        async with (
            b.serve_relay("127.0.0.1:0", tls=tls, idle_timeout=IDLE) as server,
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT, idle_timeout=IDLE) as producer,
        ):
            await _publish_all(producer, source)
            first = producer.pump
            await _idle(b, 2.5 * IDLE)
            assert producer.pump is first and not producer.closed, first.close_reason
            assert server.connections == 1  # the publisher's connection is still there
            await _fetch(b, server.url, tls, source)

    _run(loop, go)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_idle_two_relay_tree_still_delivers(loop: str, tls: TlsConfig) -> None:
    b = LOOPS[loop]
    source = _source(seed=8)

    async def go() -> None:
        async with (
            b.serve_relay("127.0.0.1:0", tls=tls, idle_timeout=IDLE) as root,
            b.serve_relay(
                "127.0.0.1:0",
                tls=tls,
                idle_timeout=IDLE,
                upstream=root.url,
                upstream_tls=_trusting(tls),
            ) as leaf,
            b.connect(root.url, tls=_trusting(tls), timeout=WAIT, idle_timeout=IDLE) as producer,
        ):
            assert leaf.upstream is not None
            link = leaf.upstream.pump
            await _idle(b, 2.5 * IDLE)
            assert leaf.upstream.pump is link and leaf.upstream.connected, link.close_reason
            await _publish_all(producer, source)
            await _idle(b, 2.5 * IDLE)
            await _fetch(b, leaf.url, tls, source)
            assert leaf.upstream.pump is link  # kept alive, never reopened

    _run(loop, go)


# --- links come back ----------------------------------------------------------------------


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_root_relay_restarted_under_a_leaf_is_reconnected(
    loop: str, tls: TlsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The root stops and starts again on the same port: the leaf's upstream link comes
    back on its own, and the leaf then delivers a publication made at the new root."""
    b = LOOPS[loop]
    source = _source(seed=9)
    caplog.set_level(logging.INFO, logger="kvcs.quic")

    box: dict[str, Any] = {}

    async def scenario() -> None:
        await _until(b, lambda: "relay" in box, WAIT, "the root to start")
        root = box["relay"]
        root_listen = f"127.0.0.1:{root.address[1]}"
        async with b.serve_relay(
            "127.0.0.1:0",
            tls=tls,
            idle_timeout=IDLE,
            upstream=root.url,
            upstream_tls=_trusting(tls),
            upstream_reconnect=FAST,
        ) as leaf:
            up = leaf.upstream
            assert up is not None and up.link is not None
            first = up.pump
            box["stop"] = True  # the root stops (CONNECTION_CLOSE to the leaf)
            await _until(b, lambda: box.get("stopped", False), WAIT, "the root to stop")
            await _until(b, lambda: first.terminated, WAIT, "the leaf to see the root go")
            async with b.serve_relay(root_listen, tls=tls, idle_timeout=IDLE) as new_root:
                await _until(
                    b,
                    lambda: up.link is not None and up.link.reconnects >= 1 and up.connected,
                    WAIT,
                    "the leaf to reconnect to the new root",
                )
                assert up.pump is not first
                async with b.connect(
                    new_root.url, tls=_trusting(tls), timeout=WAIT, idle_timeout=IDLE
                ) as producer:
                    await _publish_all(producer, source)
                    await _fetch(b, leaf.url, tls, source)

    async def go() -> None:
        await b.gather(lambda: _relay_until_stopped(b, box, "127.0.0.1:0", tls), scenario)

    _run(loop, go)
    ended = [
        r
        for r in caplog.records
        if "ended" in r.getMessage() and "connection with" in r.getMessage()
    ]
    assert ended, "no log line for the connection that ended"
    assert any("reconnecting" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_publisher_announces_again_after_its_relay_restarts(loop: str, tls: TlsConfig) -> None:
    """A publisher with ``reconnect`` whose relay restarts comes back and serves its
    publication through the new relay."""
    b = LOOPS[loop]
    source = _source(seed=10)
    port = _free_port()

    async def go() -> None:
        listen = f"127.0.0.1:{port}"
        box: dict[str, Any] = {}

        async def scenario() -> None:
            await _until(b, lambda: "relay" in box, WAIT, "the relay to start")
            async with b.connect(
                box["relay"].url,
                tls=_trusting(tls),
                timeout=WAIT,
                idle_timeout=IDLE,
                reconnect=FAST,
            ) as producer:
                pub = await _publish_all(producer, source)
                first = producer.pump
                box["stop"] = True  # the relay stops
                await _until(b, lambda: first.terminated, WAIT, "the publisher to see it go")
                assert not producer.closed  # reconnecting, not over
                await _until(b, lambda: box.get("stopped", False), WAIT, "the relay to stop")
                async with b.serve_relay(listen, tls=tls, idle_timeout=IDLE) as again:
                    await _until(
                        b,
                        lambda: (
                            producer.connected
                            and pub.publisher.namespace in again.relay.namespaces()
                        ),
                        WAIT,
                        "the publication to be announced on the new relay",
                    )
                    assert producer.pump is not first
                    await _fetch(b, again.url, tls, source)

        await b.gather(lambda: _relay_until_stopped(b, box, listen, tls), scenario)

    _run(loop, go)


# --- a session closed during setup ---------------------------------------------------------


class _CloseAfterSetup(RelayApp):
    """A relay that closes every session right after its SETUP went out: the client
    reads SERVER_SETUP and the CONNECTION_CLOSE in one batch."""

    def __init__(self, relay: Any) -> None:
        super().__init__(relay)
        self.due: list[tuple[float, SessionPump]] = []

    def handle_session_event(self, pump: SessionPump, event: ev.SessionEvent, now: float) -> None:
        if isinstance(event, ev.SetupCompleted):
            self.due.append((now, pump))  # closed on the next timer, after SERVER_SETUP is sent
            return
        super().handle_session_event(pump, event, now)

    def handle_timer(self, now: float) -> None:
        due, self.due = self.due, []
        for _, pump in due:
            pump.close(0x3, "refused for the test", now)  # MOQT UNAUTHORIZED
        super().handle_timer(now)

    def get_timer(self) -> float | None:
        timers = [t for t, _ in self.due]
        relay = super().get_timer()
        if relay is not None:
            timers.append(relay)
        return min(timers) if timers else None


@contextlib.asynccontextmanager
async def _closing_server(b: ModuleType, tls: TlsConfig) -> Any:
    endpoint = relay_endpoint(
        tls=tls, stack="aioquic", relay_config=None, max_datagram_size=None, max_connections=8
    )
    endpoint.app = _CloseAfterSetup(endpoint.app.relay)  # type: ignore[attr-defined]
    async with b.open_endpoint(endpoint, "127.0.0.1", 0) as driver:
        yield f"moqt://127.0.0.1:{driver.udp.address[1]}"


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_session_closed_right_after_setup_is_a_connect_error(loop: str, tls: TlsConfig) -> None:
    b = LOOPS[loop]

    async def go() -> None:
        async with _closing_server(b, tls) as url:
            with pytest.raises(ConnectError) as info:
                async with b.connect(url, tls=_trusting(tls), timeout=WAIT) as client:
                    # should the close arrive only now, the requests say so (no
                    # LocalProtocolError)
                    await client.discover(TrackNamespace.of("kvcs-1"), quiet=0.2)
            assert "refused for the test" in str(info.value), str(info.value)

    _run(loop, go)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_layers_iteration_has_a_deadline(loop: str, tls: TlsConfig) -> None:
    """A publication whose layers never come: ``layers(timeout=...)`` ends in time."""
    b = LOOPS[loop]
    source = _source(seed=11)

    async def go() -> None:
        async with (
            b.serve_relay("127.0.0.1:0", tls=tls) as server,
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as producer,
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as consumer,
        ):
            await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)
            r = consumer.retrieve_cache(
                source.descriptor, SCOPE_KEY, source.tokens, require_authenticity=False
            )
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                async for _ in r.layers(timeout=1.0):
                    pass
            assert time.monotonic() - t0 < 10

    _run(loop, go)


# --- per-address connection limit ----------------------------------------------------------


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_one_address_cannot_lock_out_another(
    loop: str, tls: TlsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Connections over the per-address limit are refused at once (CONNECTION_REFUSED with
    a reason); a client from another address (127.0.0.2) still gets in; the full server
    refuses at once too."""
    b = LOOPS[loop]
    caplog.set_level(logging.WARNING, logger="kvcs.quic")

    async def go() -> None:
        async with (
            b.serve_relay(
                "127.0.0.1:0", tls=tls, max_connections=16, max_connections_per_address=3
            ) as server,
            contextlib.AsyncExitStack() as stack,
        ):
            url = server.url
            for _ in range(3):  # kept alive with PINGs, as in the attack
                await stack.enter_async_context(b.connect(url, tls=_trusting(tls), timeout=WAIT))
            t0 = time.monotonic()
            with pytest.raises(ConnectError) as info:
                async with b.connect(url, tls=_trusting(tls), timeout=WAIT):
                    pass
            assert time.monotonic() - t0 < WAIT / 2, "refused only by the client's timeout"
            assert "too many connections from this address" in str(info.value), str(info.value)
            assert f"{CONNECTION_REFUSED:#x}" in str(info.value)
            assert server.driver.endpoint.refused >= 1
            other = await stack.enter_async_context(
                b.connect(url, tls=_trusting(tls), timeout=WAIT, bind="127.0.0.2")
            )
            assert other.connected
            assert server.connections == 4

    _run(loop, go)
    assert any("refusing a new connection from 127.0.0.1" in r.getMessage() for r in caplog.records)


def test_a_full_endpoint_refuses_at_once_and_caps_each_address(tls: TlsConfig) -> None:
    async def go() -> None:
        b = asyncio_binding
        # 8 connections in all: no address may hold more than a quarter (2)
        async with (
            b.serve_relay(
                "127.0.0.1:0", tls=tls, max_connections=8, max_connections_per_address=32
            ) as server,
            contextlib.AsyncExitStack() as stack,
        ):
            assert server.driver.endpoint.max_connections_per_address == 2
            for host in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"):
                for _ in range(2):
                    await stack.enter_async_context(
                        b.connect(server.url, tls=_trusting(tls), timeout=WAIT, bind=host)
                    )
            t0 = time.monotonic()
            with pytest.raises(ConnectError, match="server full"):
                async with b.connect(
                    server.url, tls=_trusting(tls), timeout=WAIT, bind="127.0.0.6"
                ):
                    pass
            assert time.monotonic() - t0 < WAIT / 2

    _run("asyncio", go)


# --- failure isolation and the end of every connection --------------------------------------


class _StackError(Exception):
    """Stands for qh3's QuicConnectionError (any exception of the stack)."""


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_stack_exception_during_event_handling_ends_one_connection(
    loop: str, tls: TlsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The stack raises from ``send_stream_data`` while a session reacts to what arrived
    (qh3: "connection is closed"): that connection ends, logged; the event loop never
    sees the exception and the other session on the same socket goes on."""
    b = LOOPS[loop]
    caplog.set_level(logging.WARNING, logger="kvcs.quic")
    loop_errors: list[Any] = []

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise _StackError("injected: connection is closed")

    async def go() -> None:
        if loop == "asyncio":
            asyncio.get_running_loop().set_exception_handler(
                lambda _l, ctx: loop_errors.append(ctx)
            )
        async with (
            b.serve_relay("127.0.0.1:0", tls=tls) as server,
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as first,
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT, via=first) as second,
        ):
            # the relay answers SUBSCRIBE_NAMESPACE: our session writes its reply-side
            # state from inside event handling, on the reader's callback
            first.pump.quic.send_stream_data = boom
            with contextlib.suppress(ConnectError, TimeoutError):
                await first.discover(TrackNamespace.of("x"), quiet=0.2, timeout=5)
            await first.driver.wait_for(lambda: first.closed, WAIT)
            assert "injected" in (first.pump.close_reason or ""), first.pump.close_reason
            assert not second.closed
            assert await second.discover(TrackNamespace.of("none"), quiet=0.2) == []

    _run(loop, go)
    assert not loop_errors, loop_errors
    assert any("injected" in r.getMessage() for r in caplog.records)


def test_every_ended_connection_is_logged_with_its_reason(
    tls: TlsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcs.quic")

    async def go() -> None:
        b = asyncio_binding
        async with b.serve_relay("127.0.0.1:0", tls=tls, idle_timeout=IDLE) as server:
            async with b.connect(server.url, tls=_trusting(tls), timeout=WAIT, idle_timeout=IDLE):
                pass  # a clean close by the client
            await _until(b, lambda: server.connections == 0, WAIT, "the server to see the close")
            async with b.connect(
                server.url, tls=_trusting(tls), timeout=WAIT, idle_timeout=IDLE
            ) as quiet:
                quiet.pump.keepalive = False  # a client that never PINGs: the idle timeout
                for pump in server.driver.endpoint.pumps:
                    pump.keepalive = False
                await _until(b, lambda: quiet.pump.terminated, WAIT, "the idle timeout")

    _run("asyncio", go)
    lines = [r.getMessage() for r in caplog.records if "ended" in r.getMessage()]
    assert any("closed by us" in m and "bye" in m for m in lines), lines
    assert any("closed by the peer" in m and "bye" in m for m in lines), lines
    idle = [r for r in caplog.records if "idle timeout" in r.getMessage()]
    assert idle and all(r.levelno == logging.WARNING for r in idle), lines


def test_endpoint_limits_are_capped_for_small_servers() -> None:
    st = load_stack("aioquic")
    cfg = quic_configuration(st, is_client=True, tls=TlsConfig(verify=False))
    ep = QuicEndpoint(st, cfg, RelayApp.__new__(RelayApp), max_connections=256)
    assert ep.max_connections_per_address == 32
    ep = QuicEndpoint(st, cfg, RelayApp.__new__(RelayApp), max_connections=2)
    assert ep.max_connections_per_address == 1
