"""A relay's Prometheus metrics over real QUIC on 127.0.0.1, everything in this process.

A relay (``serve_relay`` on port 0) with :class:`RelayMetrics` serving ``/metrics``
on a free TCP port of 127.0.0.1, a publisher and a consumer each on their own
QUIC connection. The endpoint is scraped over HTTP while the cache is being
produced and after the consumer left, and the figures are checked against what
the two clients themselves counted: objects and payload bytes in equal what the
publisher's session sent, bytes out at least what the consumer verified, the
connection and session counts. Then the exposition of a refused request (by
reason) and of an upstream link, and the ``stats`` fields.

Every scenario runs under a hard deadline (``asyncio.wait_for``); the HTTP
server is stopped in a ``finally``.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvcs.adapters.cachefile import CacheFile, llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import KvDestination, layer_sections
from kvcs.transports.quic import asyncio_binding as b
from kvcs.transports.quic.metrics import (
    METRICS,
    RelayCounters,
    RelayMetrics,
    parse_metrics_address,
    relay_counters,
    stats_fields,
)
from kvcs.transports.quic.tls import TlsConfig, self_signed

SCOPE_KEY = bytes(range(32))
LAYERS = 6
TOKENS = 64
WAIT = 20.0
SCENARIO_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return self_signed(tmp_path_factory.mktemp("tls"))


def _source() -> CacheFile:
    return synthetic(llama_descriptor(layers=LAYERS, kv_heads=2, head_dim=64), TOKENS, 7)


def _scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` (comment lines left out)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


async def _scrape_fresh(server: Any, metrics: RelayMetrics, url: str) -> dict[str, float]:
    """Refresh the snapshot on the loop (as ``kvcs relay`` does every tick), then scrape
    from another thread (the loop keeps running meanwhile)."""
    metrics.update(relay_counters(server))
    return await asyncio.to_thread(_scrape, url)


async def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _transfer_with_scrapes(tls: TlsConfig) -> None:
    source = _source()
    cd = source.cd
    trust = TlsConfig(cafile=tls.cafile)
    async with b.serve_relay("127.0.0.1:0", tls=tls) as server:
        metrics = RelayMetrics(relay_counters(server))
        host, port = metrics.serve("127.0.0.1", 0)
        assert host == "127.0.0.1" and port > 0
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            before = await _scrape_fresh(server, metrics, url)
            assert before["kvcs_relay_connections"] == 0
            assert before["kvcs_relay_objects_received_total"] == 0
            assert "kvcs_relay_upstream_connected" not in before  # no --upstream
            async with b.connect(server.url, tls=trust, timeout=WAIT) as producer:
                pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)
                dest = KvDestination(cd, TOKENS)
                async with b.connect(server.url, tls=trust, timeout=WAIT) as consumer:
                    retrieval = consumer.retrieve_cache(
                        source.descriptor,
                        SCOPE_KEY,
                        source.tokens,
                        destinations=dest.buffer,
                        require_authenticity=False,
                    )
                    during: dict[str, float] = {}

                    async def produce() -> None:
                        for layer in range(cd.layers):
                            s = layer_sections(source.k[layer], source.v[layer], cd)
                            await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
                            if layer == cd.layers // 2:  # mid-transfer: wait for it to arrive
                                await _until(
                                    lambda: len(retrieval.ready) >= 1, "a first usable layer"
                                )
                                during.update(await _scrape_fresh(server, metrics, url))
                            await asyncio.sleep(0.02)
                        await pub.finish()
                        await pub.drained(timeout=WAIT)

                    async def consume() -> None:
                        result = await retrieval.result(timeout=WAIT)
                        assert result.complete

                    await asyncio.gather(produce(), consume())
                    assert during["kvcs_relay_connections"] == 2
                    assert during["kvcs_relay_sessions"] == 2
                    assert during["kvcs_relay_tracks"] >= 3  # the manifest, K and V
                    assert during["kvcs_relay_subscriptions"] >= 1
                    assert during["kvcs_relay_objects_received_total"] > 0
                    assert during["kvcs_relay_objects_sent_total"] > 0
                    verified = retrieval.consumer.verified_objects
                    verified_bytes = verified * retrieval.consumer.data_length
                    assert verified == 2 * cd.layers * (TOKENS // cd.block_tokens)
                # the consumer has left; the producer's session is still up
                await _until(lambda: len(server.driver.endpoint.pumps) == 1, "the consumer's end")
                sent = producer.session.publisher
                await _until(
                    lambda: server.relay.stats().upstream_objects_received == sent.objects_sent,
                    "every object the producer sent to reach the relay",
                )
                after = await _scrape_fresh(server, metrics, url)
                assert after["kvcs_relay_objects_received_total"] == sent.objects_sent
                assert after["kvcs_relay_bytes_received_total"] == sent.payload_bytes_sent
                assert after["kvcs_relay_bytes_sent_total"] >= verified_bytes
                assert after["kvcs_relay_objects_sent_total"] >= verified
                assert after["kvcs_relay_connections"] == 1
                assert after["kvcs_relay_connections_accepted_total"] == 2
                assert after["kvcs_relay_connections_ended_total"] == 1
                assert after["kvcs_relay_sessions"] == 1
                assert after["kvcs_relay_sessions_total"] == 2
                assert after["kvcs_relay_cache_objects"] >= verified
                assert after["kvcs_relay_cache_bytes"] >= verified_bytes
                assert after["kvcs_relay_cache_budget_bytes"] == (
                    server.relay.config.cache_budget_bytes
                )
                assert after["kvcs_relay_evicted_groups_total"] == 0
                # the refusals, by reason, are those the relay core counted
                refused = {
                    m.group(1): v
                    for k, v in after.items()
                    if (
                        m := re.fullmatch(r'kvcs_relay_requests_refused_total\{reason="(\w+)"\}', k)
                    )
                }
                assert refused == {k: float(n) for k, n in server.relay.stats().refused}
                for name, _kind, _field, _help in METRICS:
                    assert f"kvcs_relay_{name}" in after, name
        finally:
            metrics.close()


def test_metrics_of_a_relay_match_what_the_clients_counted(tls: TlsConfig) -> None:
    asyncio.run(asyncio.wait_for(_transfer_with_scrapes(tls), SCENARIO_TIMEOUT))


async def _tree_with_upstream(tls: TlsConfig, tmp: Path) -> None:
    trust = TlsConfig(cafile=tls.cafile)
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as root,
        b.serve_relay("127.0.0.1:0", tls=tls, upstream=root.url, upstream_tls=trust) as leaf,
    ):
        metrics = RelayMetrics(relay_counters(leaf))
        _, port = metrics.serve("127.0.0.1", 0)
        try:
            got = await _scrape_fresh(leaf, metrics, f"http://127.0.0.1:{port}/metrics")
            assert got["kvcs_relay_upstream_connected"] == 1
            assert got["kvcs_relay_upstream_reconnects_total"] == 0
            assert got["kvcs_relay_upstream_sessions"] == 1
            assert got["kvcs_relay_connections"] == 1  # the link itself
            fields = stats_fields(relay_counters(leaf))
            assert fields["upstream"] == root.url and fields["upstream_connected"] is True
        finally:
            metrics.close()


def test_upstream_link_state_is_exposed(tls: TlsConfig, tmp_path: Path) -> None:
    asyncio.run(asyncio.wait_for(_tree_with_upstream(tls, tmp_path), SCENARIO_TIMEOUT))


def test_refusals_are_labelled_by_reason() -> None:
    zeros: dict[str, Any] = {a.name: 0 for a in attrs.fields(RelayCounters)}
    counters = RelayCounters(
        **{
            **zeros,
            "refused": (("DOES_NOT_EXIST", 3), ("EXCESSIVE_LOAD", 2)),
            "upstream": None,
            "upstream_connected": False,
        }
    )
    metrics = RelayMetrics(counters)
    families = {f.name: f for f in metrics.collect()}
    refused = families["kvcs_relay_requests_refused"]
    assert refused.type == "counter"
    assert {
        (s.labels["reason"], s.value) for s in refused.samples if s.name.endswith("_total")
    } == {
        ("DOES_NOT_EXIST", 3.0),
        ("EXCESSIVE_LOAD", 2.0),
    }
    assert "kvcs_relay_upstream_connected" not in families
    assert stats_fields(counters)["refused"] == {"DOES_NOT_EXIST": 3, "EXCESSIVE_LOAD": 2}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("[::1]:0", ("::1", 0)),
        ("localhost:80", ("localhost", 80)),
    ],
)
def test_metrics_address_parses(text: str, expected: tuple[str, int]) -> None:
    assert parse_metrics_address(text) == expected


@pytest.mark.parametrize(
    "text", ["9464", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", ":9464"]
)
def test_a_malformed_metrics_address_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="--metrics: not host:port"):
        parse_metrics_address(text)
