"""A user's program written against the public API only (``import kvcs``).

``tests/test_public_api_types.py`` type-checks it with ``mypy --strict`` and runs it.
It serves a relay, connects a producer and a consumer, publishes and retrieves a
cache over QUIC on 127.0.0.1, and handles the public errors. ``assert_type`` pins
what each call returns; the lines in :func:`_misuse` are mistakes mypy must
report: each carries a ``type: ignore`` with its error code, and ``--strict``
(``--warn-unused-ignores``) fails once the API stops seeing the mistake, e.g.
because a parameter became ``**kwargs: Any`` or a return type became ``Any``.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import assert_type

import trio

import kvcs
import kvcs.trio

SCOPE_KEY = bytes(32)


async def publish_and_retrieve() -> kvcs.RetrievalComplete:
    """A relay, a producer and a consumer on asyncio; the retrieved cache is checked."""
    cache = kvcs.synthetic(kvcs.llama_descriptor(layers=2, kv_heads=2, head_dim=16), tokens=32)
    assert_type(cache, kvcs.CacheFile)
    cd = kvcs.CompatibilityDescriptor(cache.descriptor)
    tls = kvcs.self_signed(tempfile.mkdtemp())
    assert_type(tls, kvcs.TlsConfig)
    trust = kvcs.TlsConfig(cafile=tls.cafile)
    async with kvcs.serve_relay(
        "127.0.0.1:0", tls=tls, relay_config=kvcs.RelayConfig(), idle_timeout=30.0
    ) as relay:
        assert_type(relay, kvcs.RelayServer)
        async with (
            kvcs.connect(relay.url, tls=trust, timeout=10.0, reconnect=kvcs.Backoff()) as producer,
            kvcs.connect(relay.url, tls=trust, stack="qh3") as consumer,
        ):
            assert_type(producer, kvcs.MoqtClient)
            pub = await producer.publish_cache(cache.descriptor, SCOPE_KEY, cache.tokens)
            assert_type(pub, kvcs.CachePublication)
            dest = kvcs.KvDestination(cd, tokens=len(cache.tokens))
            retrieval = consumer.retrieve_cache(
                cache.descriptor,
                SCOPE_KEY,
                cache.tokens,
                destinations=dest.buffer,
                require_authenticity=False,
                tracks=kvcs.TrackSelection(),
                config=kvcs.ConsumerConfig(),
            )
            assert_type(retrieval, kvcs.CacheRetrieval)
            for layer in range(cd.layers):
                sections = kvcs.layer_sections(cache.k[layer], cache.v[layer], cd)
                assert_type(sections, kvcs.LayerSections)
                await pub.put_layer(layer, sections.k, sections.v)
            await pub.finish()
            ready = [layer async for layer in retrieval]
            assert_type(ready, list[int])
            result = await retrieval.result(timeout=30.0)
            assert_type(result, kvcs.RetrievalComplete)
            for layer in ready:
                k, v = dest.as_engine_arrays(layer)
                if not ((k == cache.k[layer]).all() and (v == cache.v[layer]).all()):
                    raise SystemExit(f"layer {layer} differs from the source")
    return result


async def errors() -> list[str]:
    """The typed errors a user catches, each with its one-line message."""
    seen: list[str] = []
    try:
        async with kvcs.connect("http://127.0.0.1:1/"):
            pass
    except kvcs.UrlError as exc:
        seen.append(f"UrlError: {exc}")
    try:
        async with kvcs.connect("moqt://127.0.0.1:1", stack="no-such-stack"):
            pass
    except kvcs.StackUnavailable as exc:
        seen.append(f"StackUnavailable: {exc}")
    try:
        async with kvcs.serve_relay("127.0.0.1:0", tls=kvcs.TlsConfig(certfile="/nonexistent")):
            pass
    except kvcs.TlsError as exc:
        seen.append(f"TlsError: {exc}")
    try:
        async with kvcs.connect("moqt://127.0.0.1:9", tls=kvcs.TlsConfig(verify=False), timeout=1):
            pass
    except kvcs.ConnectError as exc:
        seen.append(f"ConnectError: {exc}")
    try:
        kvcs.load("/nonexistent.npz")
    except kvcs.CacheFileError as exc:
        seen.append(f"CacheFileError: {exc}")
    return seen


async def on_trio() -> bool:
    """The same relay and session on trio through :mod:`kvcs.trio`."""
    tls = kvcs.self_signed(tempfile.mkdtemp())
    trust = kvcs.TlsConfig(cafile=tls.cafile)
    async with (
        kvcs.trio.serve_relay("127.0.0.1:0", tls=tls, stack="aioquic") as relay,
        kvcs.trio.connect(relay.url, tls=trust) as client,
    ):
        assert_type(client, kvcs.MoqtClient)
        return client.connected


def _misuse(client: kvcs.MoqtClient, relay: kvcs.RelayServer) -> None:
    """Never called: mistakes mypy must keep reporting (see the module docstring)."""
    kvcs.connect(relay.url, timeout="soon")  # type: ignore[arg-type]
    kvcs.connect(relay.url, tsl=kvcs.TlsConfig())  # type: ignore[call-arg]
    kvcs.connect(relay.url, kvcs.TlsConfig())  # type: ignore[call-arg]
    kvcs.serve_relay("127.0.0.1:0")  # type: ignore[call-arg]
    kvcs.trio.connect(relay.url, reconnect=True)  # type: ignore[arg-type]
    kvcs.trio.serve_relay(tls=kvcs.TlsConfig(), max_connections="many")  # type: ignore[arg-type]
    client.retrieve_cache(b"", SCOPE_KEY, [1])  # type: ignore[arg-type]
    client.retrieve_cache({}, SCOPE_KEY, [1], destination=None)  # type: ignore[call-arg]
    client.retrieve_cache({}, SCOPE_KEY, [1], layers=[0, 1])  # type: ignore[arg-type]
    relay.url.no_such_method()  # type: ignore[attr-defined]
    kvcs.load(1)  # type: ignore[arg-type]


def main() -> None:
    result = asyncio.run(publish_and_retrieve())
    print(f"asyncio: complete={result.complete} blocks={result.blocks}")
    for line in asyncio.run(errors()):
        print(line)
    print(f"trio: connected={trio.run(on_trio)}")


if __name__ == "__main__":
    main()
