"""MOQT over WebTransport (HTTP/3) on the relay's port, beside native QUIC (wire reference 3.1).

The relay offers ALPN ``moqt-22`` and ``h3`` on one UDP port; a client with an
``https://`` URL opens a WebTransport session (extended CONNECT with
``WT-Available-Protocols: "moqt-22"``) and runs MOQT over its streams and
datagrams. Everything real: UDP on 127.0.0.1, aioquic or qh3.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import pytest
import trio
from aioquic.asyncio import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import HeadersReceived
from aioquic.quic.configuration import QuicConfiguration

from kvcs.adapters.cachefile import llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import KvDestination, layer_sections
from kvcs.transports.quic import asyncio_binding, trio_binding
from kvcs.transports.quic.stack import load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs.transports.quic.webtransport import http_to_wt, wt_to_http

CACHE = synthetic(llama_descriptor(layers=3, kv_heads=2, head_dim=16), tokens=48, seed=4)
SCOPE = bytes(range(32))
DEADLINE = 40.0

try:
    load_stack("qh3")
    STACKS = ["aioquic", "qh3"]
except Exception:
    STACKS = ["aioquic", pytest.param("qh3", marks=pytest.mark.skip(reason="qh3 not installed"))]


def _check(dest: KvDestination) -> None:
    for layer in range(CACHE.cd.layers):
        k, v = dest.as_engine_arrays(layer)
        assert (k == CACHE.k[layer]).all() and (v == CACHE.v[layer]).all()


async def _publish(pub: Any) -> None:
    for layer in range(CACHE.cd.layers):
        s = layer_sections(CACHE.k[layer], CACHE.v[layer], CACHE.cd)
        await pub.put_layer(layer, s.k, s.v)
    await pub.finish()


@pytest.mark.parametrize("stack", STACKS)
def test_webtransport_consumer_beside_native_publisher_asyncio(stack: str) -> None:
    async def main() -> tuple[bool, bool]:
        tls = self_signed(tempfile.mkdtemp())
        trust = TlsConfig(cafile=tls.cafile)
        async with asyncio_binding.serve_relay("127.0.0.1:0", tls=tls, stack=stack) as relay:
            wt_url = f"https://127.0.0.1:{relay.address[1]}/moq"
            async with (
                asyncio_binding.connect(relay.url, tls=trust, stack=stack) as producer,
                asyncio_binding.connect(wt_url, tls=trust, stack=stack) as consumer,
            ):
                assert consumer.pump.wt is not None and consumer.pump.alpn == "h3"
                assert producer.pump.wt is None and producer.pump.alpn == "moqt-22"
                pub = await producer.publish_cache(CACHE.descriptor, SCOPE, CACHE.tokens)
                dest = KvDestination(CACHE.cd, tokens=48)
                got = consumer.retrieve_cache(
                    CACHE.descriptor,
                    SCOPE,
                    CACHE.tokens,
                    destinations=dest.buffer,
                    require_authenticity=False,
                )
                await _publish(pub)
                result = await got.result(timeout=20)
                _check(dest)
                # the session over WebTransport sent neither PATH nor AUTHORITY
                relay_side = [p for p in relay.driver.endpoint.pumps if p.wt is not None]
                setup = relay_side[0].session.peer_setup
                return result.complete, setup.path is None and setup.authority is None

    complete, no_path = asyncio.run(asyncio.wait_for(main(), DEADLINE))
    assert complete and no_path


def test_webtransport_publisher_to_native_consumer_trio() -> None:
    async def main() -> bool:
        tls = self_signed(tempfile.mkdtemp())
        with trio.fail_after(DEADLINE):
            async with trio_binding.serve_relay("127.0.0.1:0", tls=tls) as relay:
                wt_url = f"https://127.0.0.1:{relay.address[1]}/"
                insecure = TlsConfig(verify=False)
                async with (
                    trio_binding.connect(wt_url, tls=insecure) as producer,
                    trio_binding.connect(relay.url, tls=insecure) as consumer,
                ):
                    pub = await producer.publish_cache(CACHE.descriptor, SCOPE, CACHE.tokens)
                    await _publish(pub)
                    dest = KvDestination(CACHE.cd, tokens=48)
                    got = consumer.retrieve_cache(
                        CACHE.descriptor,
                        SCOPE,
                        CACHE.tokens,
                        destinations=dest.buffer,
                        require_authenticity=False,
                    )
                    result = await got.result(timeout=20)
                    _check(dest)
                    return bool(result.complete)

    assert trio.run(main)


def test_a_connect_without_moqt_in_wt_available_protocols_is_refused() -> None:
    """A plain WebTransport client that does not offer moqt-22 gets 400; a GET gets 404."""

    class Client(QuicConnectionProtocol):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.h3 = H3Connection(self._quic, enable_webtransport=True)
            self.status: dict[int, asyncio.Future[bytes]] = {}

        def quic_event_received(self, event: Any) -> None:
            for he in self.h3.handle_event(event):
                if isinstance(he, HeadersReceived) and he.stream_id in self.status:
                    fut = self.status[he.stream_id]
                    if not fut.done():
                        fut.set_result(dict(he.headers).get(b":status", b""))

        async def request(self, headers: list[tuple[bytes, bytes]]) -> bytes:
            sid = self._quic.get_next_available_stream_id()
            self.status[sid] = asyncio.get_running_loop().create_future()
            self.h3.send_headers(sid, headers, end_stream=False)
            self.transmit()
            return await asyncio.wait_for(self.status[sid], 10)

    async def main() -> tuple[bytes, bytes]:
        tls = self_signed(tempfile.mkdtemp())
        async with asyncio_binding.serve_relay("127.0.0.1:0", tls=tls) as relay:
            cfg = QuicConfiguration(
                is_client=True, alpn_protocols=["h3"], max_datagram_frame_size=65536
            )
            cfg.load_verify_locations(cafile=tls.cafile)
            port = relay.address[1]
            async with connect(
                "127.0.0.1", port, configuration=cfg, create_protocol=Client
            ) as client:
                base = [
                    (b":scheme", b"https"),
                    (b":authority", f"127.0.0.1:{port}".encode()),
                    (b":path", b"/"),
                ]
                no_moqt = await client.request(  # type: ignore[attr-defined]
                    [
                        (b":method", b"CONNECT"),
                        (b":protocol", b"webtransport"),
                        *base,
                        (b"wt-available-protocols", b'"moqt-21"'),
                    ]
                )
                get = await client.request(  # type: ignore[attr-defined]
                    [(b":method", b"GET"), *base]
                )
                return no_moqt, get

    no_moqt, get = asyncio.run(asyncio.wait_for(main(), DEADLINE))
    assert (no_moqt, get) == (b"400", b"404")


def test_webtransport_error_code_mapping() -> None:
    for code in (0, 1, 0x1D, 0x1E, 0x1F, 0x3C, 0x10, 0x8, 0xFFFF, 2**32 - 1):
        h = wt_to_http(code)
        assert http_to_wt(h) == code
        assert (h - 0x21) % 0x1F != 0  # never a reserved HTTP/3 codepoint
    assert http_to_wt(0x100) is None  # H3_NO_ERROR carries no WebTransport code
