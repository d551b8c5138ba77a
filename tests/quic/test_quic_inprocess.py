"""kvcs over real QUIC on 127.0.0.1, everything in this process.

A relay (``serve_relay`` on port 0), a publishing client and several consumers
each on their own UDP socket, for asyncio and trio and for aioquic and qh3; the
retrieved caches must be bit-identical to the source. Then plain MOQT through
the relay, namespace discovery, and the ways a connection must fail: a closed
port, an untrusted certificate, a server that does not speak ``moqt-22``.

Every scenario runs under a hard deadline on its loop (``_run``), so a hang is a
failure, never a stuck suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from aioquic.asyncio import serve
from aioquic.quic.configuration import QuicConfiguration

from kvcs.adapters.cachefile import CacheFile, llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import KvDestination, layer_sections
from kvcs.transports.quic import asyncio_binding, trio_binding
from kvcs.transports.quic.api import ConnectError, MoqtClient
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.kvcs.consumer import ManifestAccepted, PublicationSelected
from kvcs_core.kvcs.names import KVCS_NAMESPACE_TAG
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, PublishDoneCode
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

SCOPE_KEY = bytes(range(32))
LAYERS = 6
TOKENS = 96  # 6 blocks of 16 tokens
SCENARIO_TIMEOUT = 45.0
WAIT = 20.0  # the bound of every single wait inside a scenario

LOOPS = {"asyncio": asyncio_binding, "trio": trio_binding}
try:
    import qh3  # noqa: F401

    HAVE_QH3 = True
except ImportError:
    HAVE_QH3 = False

_QH3 = pytest.mark.skipif(not HAVE_QH3, reason="qh3 is not installed (import qh3 fails)")


def _stacks() -> list[Any]:
    return ["aioquic", pytest.param("qh3", marks=_QH3)]


def _run(loop: str, fn: Callable[[], Awaitable[Any]], timeout: float = SCENARIO_TIMEOUT) -> Any:
    """Run ``fn()`` on ``loop`` with a hard deadline."""
    if loop == "trio":

        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await fn()

        return trio.run(bounded)
    return asyncio.run(asyncio.wait_for(fn(), timeout))


async def _until(b: ModuleType, cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await b.sleep(0.01)


def _source(layers: int = LAYERS, tokens: int = TOKENS, seed: int = 3) -> CacheFile:
    return synthetic(llama_descriptor(layers=layers, kv_heads=2, head_dim=64), tokens, seed)


def _identical(source: CacheFile, dest: KvDestination, tokens: int) -> bool:
    for layer in range(source.cd.layers):
        k, v = dest.as_engine_arrays(layer)
        if not (
            np.array_equal(k[:, :tokens], source.k[layer, :, :tokens])
            and np.array_equal(v[:, :tokens], source.v[layer, :, :tokens])
        ):
            return False
    return True


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return self_signed(tmp_path_factory.mktemp("tls"))


def _trusting(tls: TlsConfig) -> TlsConfig:
    """What a client needs to verify the relay: the local CA, with verification on."""
    return TlsConfig(cafile=tls.cafile)


# --- publish through the relay to live and late consumers -----------------------------


async def _put_layers(
    pub: Any, source: CacheFile, after_layer: Callable[[], None] | None = None
) -> None:
    """Publish every layer of ``source`` on ``pub`` (``after_layer`` after each is queued),
    finish, and wait until all of it went out."""
    cd = source.cd
    for layer in range(cd.layers):
        s = layer_sections(source.k[layer], source.v[layer], cd)
        await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
        if after_layer is not None:
            after_layer()
    await pub.finish()
    await pub.drained(timeout=WAIT)


def _start_retrieval(client: Any, source: CacheFile, dest: KvDestination) -> Any:
    """``client`` starts retrieving ``source``'s cache into ``dest`` (unsigned manifests
    accepted); the running retrieval."""
    return client.retrieve_cache(
        source.descriptor,
        SCOPE_KEY,
        source.tokens,
        destinations=dest.buffer,
        require_authenticity=False,
    )


async def _retrieve_complete(client: Any, source: CacheFile, dest: KvDestination) -> None:
    """Retrieve ``source``'s cache into ``dest``; it must complete."""
    r = _start_retrieval(client, source, dest)
    result = await r.result(timeout=WAIT * 2)
    assert result.complete, r.events


async def _consume(
    b: ModuleType, url: str, stack: str, tls: TlsConfig, source: CacheFile, ready: list[bool]
) -> KvDestination:
    """One consumer on its own connection; ``ready[0]`` once it has found the publication."""
    cd = source.cd
    dest = KvDestination(cd, TOKENS)
    async with b.connect(url, tls=_trusting(tls), stack=stack, timeout=WAIT) as client:
        r = _start_retrieval(client, source, dest)
        layers: list[int] = []

        async def watch() -> None:
            await _until(
                b,
                lambda: (
                    r.complete is not None
                    or any(isinstance(e, ManifestAccepted | PublicationSelected) for e in r.events)
                ),
                WAIT,
                "the consumer to find the publication",
            )
            ready[0] = True

        async def follow() -> None:
            async for layer in r:
                layers.append(layer)

        await b.gather(watch, follow)
        result = await r.result(timeout=WAIT)
        assert result.complete, r.events
        assert result.blocks == TOKENS // cd.block_tokens
        assert sorted(layers) == list(range(cd.layers))
    return dest


async def _publish_to_consumers(
    b: ModuleType, stack: str, tls: TlsConfig, relay_stack: str | None = None
) -> None:
    source = _source()
    cd = source.cd
    async with b.serve_relay("127.0.0.1:0", tls=tls, stack=relay_stack or stack) as server:
        assert server.address[0] == "127.0.0.1"
        assert server.address[1] != 0
        url = server.url
        async with b.connect(url, tls=_trusting(tls), stack=stack, timeout=WAIT) as producer:
            pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)
            live_ready, second_ready = [False], [False]
            results: dict[str, KvDestination] = {}

            async def live() -> None:
                results["live"] = await _consume(b, url, stack, tls, source, live_ready)

            async def second_live() -> None:
                results["live2"] = await _consume(b, url, stack, tls, source, second_ready)

            async def produce() -> None:
                # both live consumers subscribed before layer 0
                await _until(b, lambda: live_ready[0] and second_ready[0], WAIT, "live consumers")
                for layer in range(cd.layers):
                    s = layer_sections(source.k[layer], source.v[layer], cd)
                    await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
                    await b.sleep(0.01)
                await pub.finish()
                await pub.drained(timeout=WAIT)

            await b.gather(produce, live, second_live)
            assert pub.publisher.complete
            # late: after the cache is complete (a FETCH through the relay)
            results["late"] = await _consume(b, url, stack, tls, source, [False])
            assert server.relay.stats().cache_bytes > 0
    for name, dest in results.items():
        assert _identical(source, dest, TOKENS), f"{name}: not bit-identical"


@pytest.mark.parametrize("stack", _stacks())
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_publish_through_relay_live_and_late_consumers(
    loop: str, stack: str, tls: TlsConfig
) -> None:
    _run(loop, lambda: _publish_to_consumers(LOOPS[loop], stack, tls))


@_QH3
@pytest.mark.parametrize(("relay_stack", "client_stack"), [("qh3", "aioquic"), ("aioquic", "qh3")])
def test_relay_and_clients_on_different_stacks(
    relay_stack: str, client_stack: str, tls: TlsConfig
) -> None:
    """Interop between the two stacks; trio, where an exception escaping the endpoint
    would end the relay (qh3's server raised in ``datagrams_to_send`` with every
    aioquic client before :func:`kvcs.transports.quic.stack._qh3_datagrams`)."""
    _run("trio", lambda: _publish_to_consumers(trio_binding, client_stack, tls, relay_stack))


# --- plain MOQT through the relay ---------------------------------------------------------


def _serve_track(client: MoqtClient, store: TrackStore) -> list[Any]:
    """Make ``client`` the publisher of ``store``'s track: accept SUBSCRIBE and FETCH."""
    requests: list[Any] = []

    def watch(pump: Any, e: Any, now: float) -> None:
        if pump is not client.pump:
            return
        s = client.session
        if isinstance(e, ev.SubscribeRequested) and e.track == store.name:
            requests.append(e)
            s.accept_subscribe(e.request_id, store, now=now)
            if store.end_of_track is not None:
                s.end_subscription(e.request_id, PublishDoneCode.TRACK_ENDED, now=now)
        elif isinstance(e, ev.FetchRequested) and e.track == store.name:
            requests.append(e)
            s.accept_fetch(e.request_id, store, now=now)

    client.app.watchers.append(watch)
    return requests


def _collect(client: MoqtClient) -> list[ev.ObjectReceived]:
    got: list[ev.ObjectReceived] = []

    def watch(pump: Any, e: Any, now: float) -> None:
        if pump is client.pump and isinstance(e, ev.ObjectReceived):
            got.append(_private_copy(e))

    client.app.watchers.append(watch)
    return got


def _private_copy(e: ev.ObjectReceived) -> ev.ObjectReceived:
    """Keep a private copy of the payload (the session may reuse its buffer)."""
    return attrs.evolve(e, payload=memoryview(bytes(e.payload)))


def _payload(g: int, o: int) -> bytes:
    return bytes([g & 0xFF, o & 0xFF]) * 700  # > one QUIC packet


async def _plain_moqt(b: ModuleType, tls: TlsConfig) -> None:
    ns = TrackNamespace.of("plain-test", "room-1")
    name = FullTrackName(ns, b"chat")
    store = TrackStore(name)
    async with b.serve_relay("127.0.0.1:0", tls=tls) as server:
        url = server.url
        async with (
            b.connect(url, tls=_trusting(tls), timeout=WAIT) as pub,
            b.connect(url, tls=_trusting(tls), timeout=WAIT) as sub,
        ):
            served = _serve_track(pub, store)
            got = _collect(sub)
            answered: dict[str, Any] = {}

            def on_answer(pump: Any, e: Any, now: float) -> None:
                if pump is sub.pump and isinstance(e, ev.SubscribeAccepted | ev.RequestFailed):
                    answered.setdefault("e", e)

            sub.app.watchers.append(on_answer)
            ns_ok: list[Any] = []

            def on_ns(pump: Any, e: Any, now: float) -> None:
                if pump is pub.pump and isinstance(e, ev.RequestAccepted | ev.RequestFailed):
                    ns_ok.append(e)

            pub.app.watchers.append(on_ns)
            ns_rid = pub.session.publish_namespace(ns, now=pub.driver.now())
            pub.driver.wake()
            await pub.driver.wait_for(lambda: any(e.request_id == ns_rid for e in ns_ok), WAIT)
            assert isinstance(ns_ok[0], ev.RequestAccepted), ns_ok
            # objects before the subscriber arrives, then live ones
            for o in range(3):
                store.append(0, o, _payload(0, o))
            rid = sub.session.subscribe(
                name,
                now=sub.driver.now(),
                location_filter=p.LocationFilter.next_object(),
                fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
            )
            sub.driver.wake()
            await sub.driver.wait_for(lambda: "e" in answered, WAIT)
            assert isinstance(answered["e"], ev.SubscribeAccepted), answered["e"]
            assert answered["e"].request_id == rid
            assert served, "the relay did not forward the SUBSCRIBE to the publisher"
            for g in (1, 2):
                for o in range(3):
                    store.append(g, o, _payload(g, o))
                    pub.driver.wake()
                    await b.sleep(0.005)
            want = {Location(g, o) for g in range(3) for o in range(3)}
            await sub.driver.wait_for(lambda: {e.location for e in got} >= want, WAIT)
            normal = [e for e in got if e.status == ObjectStatus.NORMAL]
            assert sorted(e.location for e in normal) == sorted(want)  # each exactly once
            for e in normal:
                assert bytes(e.payload) == _payload(e.location.group, e.location.object)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_plain_moqt_subscribe_through_relay(loop: str, tls: TlsConfig) -> None:
    _run(loop, lambda: _plain_moqt(LOOPS[loop], tls))


# --- discovery --------------------------------------------------------------------------------


async def _discover_until(
    client: MoqtClient, prefix: TrackNamespace, want: set[TrackNamespace]
) -> list[TrackNamespace]:
    """discover(prefix), asked again (bounded) while announcements may still travel."""
    deadline = time.monotonic() + WAIT
    while True:
        found = await client.discover(prefix, quiet=0.3)
        assert set(found) <= want, found
        if set(found) == want or time.monotonic() > deadline:
            return found


async def _discover(b: ModuleType, tls: TlsConfig) -> None:
    sources = [_source(layers=2, tokens=32, seed=s) for s in (11, 12)]
    unrelated = TrackNamespace.of("unrelated", "x")
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        pubs = []
        for src in sources:
            c = await stack.enter_async_context(
                b.connect(server.url, tls=_trusting(tls), timeout=WAIT)
            )
            pubs.append(await c.publish_cache(src.descriptor, SCOPE_KEY, src.tokens))
        other = await stack.enter_async_context(
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT)
        )
        other.session.publish_namespace(unrelated, now=other.driver.now())
        other.driver.wake()
        looker = await stack.enter_async_context(
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT)
        )
        want = {pub.publisher.namespace for pub in pubs}
        prefix = TrackNamespace.of(KVCS_NAMESPACE_TAG)
        found = await _discover_until(looker, prefix, want)
        assert len(found) == len(want) and set(found) == want, found  # each once
        assert all(prefix.is_prefix_of(ns) for ns in found)
        assert await _discover_until(looker, TrackNamespace.of("unrelated"), {unrelated}) == [
            unrelated
        ]
        assert await looker.discover(TrackNamespace.of("nothing-here"), quiet=0.2) == []


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_discover_lists_published_namespaces(loop: str, tls: TlsConfig) -> None:
    _run(loop, lambda: _discover(LOOPS[loop], tls))


async def _first_and_withdraw(b: ModuleType, tls: TlsConfig) -> None:
    src = _source(layers=2, tokens=32, seed=13)
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as server,
        b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as producer,
        b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as looker,
    ):
        pub = await producer.publish_cache(src.descriptor, SCOPE_KEY, src.tokens)
        ns = pub.publisher.namespace
        prefix = TrackNamespace.of(KVCS_NAMESPACE_TAG)
        assert await _discover_until(looker, prefix, {ns}) == [ns]
        # first=True: back at the first announcement, long before a quiet period of 30 s
        t0 = time.monotonic()
        assert await looker.discover(prefix, quiet=30.0, timeout=60.0, first=True) == [ns]
        assert time.monotonic() - t0 < 20.0
        # and without one it still waits for the relay's answer plus the quiet time
        assert await looker.discover(TrackNamespace.of("none"), quiet=0.2, first=True) == []
        # withdraw: the namespace is no longer announced, nor kept for a new session
        await pub.withdraw()
        assert pub.publisher not in producer.publications
        assert all(p is not pub.publisher for p, _ in producer.app.publishers)
        deadline = time.monotonic() + WAIT
        while await looker.discover(prefix, quiet=0.3):
            assert time.monotonic() < deadline, "the withdrawn namespace is still announced"


async def _forget(b: ModuleType, tls: TlsConfig) -> None:
    src = _source(layers=2, tokens=32, seed=14)
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as server,
        b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as producer,
        b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as consumer,
    ):
        pub = await producer.publish_cache(src.descriptor, SCOPE_KEY, src.tokens)
        for layer in range(src.cd.layers):
            s = layer_sections(src.k[layer], src.v[layer], src.cd)
            await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
        await pub.finish()
        r = consumer.retrieve_cache(
            src.descriptor, SCOPE_KEY, src.tokens, require_authenticity=False
        )
        assert (await r.result(timeout=WAIT)).complete
        assert r.handle in consumer.app.consumers
        r.forget()
        assert r.handle not in consumer.app.consumers
        r.forget()  # twice is harmless


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_finished_retrieval_is_forgotten(loop: str, tls: TlsConfig) -> None:
    _run(loop, lambda: _forget(LOOPS[loop], tls))


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_discover_first_and_a_withdrawn_publication(loop: str, tls: TlsConfig) -> None:
    _run(loop, lambda: _first_and_withdraw(LOOPS[loop], tls))


# --- connections that must fail ------------------------------------------------------------


def _closed_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_connect_to_closed_port_fails_with_connect_error(loop: str) -> None:
    b = LOOPS[loop]
    port = _closed_port()
    timeout = 1.0

    async def go() -> None:
        with pytest.raises(ConnectError) as info:
            async with b.connect(
                f"moqt://127.0.0.1:{port}", tls=TlsConfig(verify=False), timeout=timeout
            ):
                pass
        assert f"127.0.0.1:{port}" in str(info.value)

    t0 = time.monotonic()
    _run(loop, go, timeout=15)
    assert time.monotonic() - t0 < timeout + 10  # bounded by the timeout, not by QUIC's idle


@pytest.mark.parametrize(
    ("loop", "relay_stack", "client_stack"),
    [
        ("asyncio", "aioquic", "aioquic"),
        ("trio", "aioquic", "aioquic"),
        pytest.param("asyncio", "qh3", "qh3", marks=_QH3),
        pytest.param("trio", "qh3", "qh3", marks=_QH3),
        pytest.param("trio", "qh3", "aioquic", marks=_QH3),
        pytest.param("trio", "aioquic", "qh3", marks=_QH3),
    ],
)
def test_client_trusting_the_wrong_ca_fails_with_a_certificate_error(
    loop: str, relay_stack: str, client_stack: str, tls: TlsConfig, tmp_path: Path
) -> None:
    b = LOOPS[loop]
    other = self_signed(tmp_path / "other")  # a different local CA

    async def go() -> None:
        async with b.serve_relay("127.0.0.1:0", tls=tls, stack=relay_stack) as server:
            with pytest.raises(ConnectError) as info:
                async with b.connect(
                    server.url,
                    tls=TlsConfig(cafile=other.cafile),
                    stack=client_stack,
                    timeout=WAIT,
                ):
                    pass
            assert "certificate" in str(info.value).lower(), str(info.value)
            # and the relay is still fine for a client that trusts the right CA
            async with b.connect(
                server.url, tls=_trusting(tls), stack=client_stack, timeout=WAIT
            ) as c:
                assert c.session.setup_complete

    _run(loop, go)


@pytest.mark.parametrize("stack", _stacks())
def test_server_without_moqt_alpn_is_refused(stack: str, tls: TlsConfig) -> None:
    async def go() -> None:
        cfg = QuicConfiguration(is_client=False, alpn_protocols=["h3"])
        assert tls.certfile is not None
        cfg.load_cert_chain(tls.certfile, tls.keyfile)
        server = await serve("127.0.0.1", 0, configuration=cfg)
        try:
            port = server._transport.get_extra_info("sockname")[1]
            t0 = time.monotonic()
            with pytest.raises(ConnectError) as info:
                async with asyncio_binding.connect(
                    f"moqt://127.0.0.1:{port}", tls=_trusting(tls), stack=stack, timeout=WAIT
                ):
                    pass
            assert time.monotonic() - t0 < WAIT, "refused only by the timeout"
            assert str(info.value)
        finally:
            server.close()

    _run("asyncio", go)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_failing_stack_ends_one_connection_not_the_endpoint(loop: str, tls: TlsConfig) -> None:
    """An exception from the QUIC stack of one connection drops that connection only: the
    other session on the same UDP socket (``via``) and event loop goes on."""
    b = LOOPS[loop]

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected stack failure")

    async def go() -> None:
        async with (
            b.serve_relay("127.0.0.1:0", tls=tls) as server,
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT) as first,
            b.connect(server.url, tls=_trusting(tls), timeout=WAIT, via=first) as second,
        ):
            # through the stack binding, so that it fails the same way on aioquic and on
            # qh3 (whose datagrams the binding takes from the native core, not from
            # ``QuicConnection.datagrams_to_send``)
            first.pump.stack = attrs.evolve(first.pump.stack, datagrams_to_send=boom)
            first.driver.wake()
            await first.driver.wait_for(lambda: first.closed, WAIT)
            assert "injected stack failure" in (first.pump.close_reason or "")
            assert not second.closed
            assert await second.discover(TrackNamespace.of("none"), quiet=0.2) == []

    _run(loop, go)
