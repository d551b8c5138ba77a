"""The connector's network paths against a real ``kvcs relay`` (QUIC on 127.0.0.1), without
an engine: the scheduler's lookup (``published_blocks``) and the worker's publish and load
(``Worker``) through the same page layout vLLM's CPU backend uses.

The relay runs in its own process (stopped by its PID); the connector's loop threads run
here, as they do inside vLLM's processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvcs.adapters.cachefile import llama_descriptor
from kvcs.transports.quic import asyncio_binding
from kvcs.transports.quic.tls import TlsConfig
from kvcs.vllm._loop import EventLog, LoopThread
from kvcs.vllm.config import parse_settings
from kvcs.vllm.plan import Found, LoadSpec, SaveSpec
from kvcs.vllm.scheduler import Lookup, published_blocks
from kvcs.vllm.worker import Worker
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

ROOT = Path(__file__).resolve().parents[2]
KEY = "5c" * 32
LAYERS, H, D, B = 3, 2, 32, 16
PAGES = 16
DESCRIPTOR = llama_descriptor(
    layers=LAYERS, kv_heads=H, head_dim=D, block_tokens=B, dtype="float32"
)
CD = CompatibilityDescriptor(dict(DESCRIPTOR))
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("relay")
    p = subprocess.Popen(
        [sys.executable, "-m", "kvcs", "relay", "--listen", "127.0.0.1:0", "--self-signed",
         "--cert-dir", str(tmp / "tls"), "--json", "--run-for", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        line = p.stdout.readline().decode()
        info = json.loads(line)
        assert info["event"] == "listening", line
        yield info
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _worker(
    relay: dict[str, Any], role: str, log: Path | None = None, **extra: Any
) -> tuple[Worker, LoopThread]:
    s = parse_settings(
        role,
        {"relay": relay["url"], "ca": relay["ca"], "scope_key": KEY, "load_timeout": 20, **extra},
    )
    loop = LoopThread(s, f"test-{role}")
    return Worker(loop, CD, DESCRIPTOR, EventLog(log)), loop


def _pages() -> dict[str, torch.Tensor]:
    """One CPU_ATTN-shaped KV tensor per layer: ``[pages, heads, block, 2*head_dim]``."""
    return {n: torch.zeros(PAGES, H, B, 2 * D) for n in NAMES}


def _kv(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, b, _ = cache.size()
    k, v = cache.view((n, h, b * 2, -1)).chunk(2, dim=2)
    return k, v


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def published(relay: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A producer Worker that published 4 blocks of ``tokens`` from its pages."""
    log = tmp_path_factory.mktemp("prod") / "events.jsonl"
    worker, loop = _worker(relay, "kv_producer", log)
    caches = _pages()
    g = torch.Generator().manual_seed(3)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=g))
    worker.register(caches)
    tokens = tuple(range(1000, 1000 + 4 * B))
    ids = (9, 2, 11, 5)
    worker.start_saves([SaveSpec("p", tokens, ids)])
    for name in NAMES:
        worker.save_layer(name)
    worker.wait_saves()
    _wait(lambda: any(e["event"] == "published" for e in _events(log)), "the publication")
    try:
        yield tokens, ids, caches, log
    finally:
        loop.close()


def test_the_lookup_finds_the_published_prefix_of_a_prompt(
    relay: dict[str, Any], published: Any
) -> None:
    tokens = published[0]

    async def ask() -> list[Found]:
        async with asyncio_binding.connect(relay["url"], tls=TlsConfig(cafile=relay["ca"])) as c:
            key = bytes.fromhex(KEY)
            return [
                await published_blocks(c, key, CD, tokens),  # the same prompt: direct
                await published_blocks(c, key, CD, tokens[: 2 * B]),  # shorter: the index
                await published_blocks(c, key, CD, (*tokens[: 3 * B], *[7] * B)),  # diverges
                await published_blocks(c, key, CD, (*tokens, *[7] * B)),  # longer prompt
                await published_blocks(c, key, CD, tuple(range(B * 4))),  # unrelated
                await published_blocks(c, bytes(32), CD, tokens),  # another scope key
            ]

    found = asyncio.run(ask())
    assert [f.blocks for f in found] == [4, 2, 3, 4, 0, 0]
    # the same prompt and a longer one see the 4-block publication itself; a shorter or
    # diverging prompt only its index records (the publication is longer than they share)
    assert [f.exact for f in found[:4]] == [True, False, False, True]


def test_a_lookup_that_cannot_reach_a_relay_is_a_miss(tmp_path: Path) -> None:
    s = parse_settings(
        "kv_consumer",
        {"relay": "moqt://127.0.0.1:9", "scope_key": KEY, "lookup_timeout": 1.0,
         "connect_timeout": 0.5, "event_log": str(tmp_path / "e.jsonl")},
    )  # fmt: skip
    loop = LoopThread(s, "test-miss")
    try:
        lookup = Lookup(loop, CD, EventLog(s.event_log))
        assert lookup(tuple(range(4 * B))).result(10) == Found(0)
        (event,) = _events(tmp_path / "e.jsonl")
        assert event["event"] == "lookup" and event["blocks"] == 0 and event["error"]
    finally:
        loop.close()


def test_a_load_writes_the_verified_blocks_into_the_consumers_pages(
    relay: dict[str, Any], published: Any, tmp_path: Path
) -> None:
    tokens, src_ids, src, _ = published
    worker, loop = _worker(relay, "kv_consumer", tmp_path / "c.jsonl")
    try:
        caches = _pages()
        worker.register(caches)
        dst_ids = (3, 14, 0)
        worker.start_loads([LoadSpec("c", tokens[: 3 * B], 0, dst_ids)])
        for name in NAMES:
            worker.wait_layer(name)
        assert worker.load_errors() == set()
        for name in NAMES:
            (ks, vs), (kd, vd) = _kv(src[name]), _kv(caches[name])
            assert torch.equal(kd[list(dst_ids)], ks[list(src_ids[:3])])
            assert torch.equal(vd[list(dst_ids)], vs[list(src_ids[:3])])
            others = [i for i in range(PAGES) if i not in dst_ids]
            assert not caches[name][others].any()
    finally:
        loop.close()


def test_blocks_computed_locally_are_not_overwritten(
    relay: dict[str, Any], published: Any, tmp_path: Path
) -> None:
    tokens = published[0]
    worker, loop = _worker(relay, "kv_consumer", tmp_path / "c.jsonl")
    try:
        caches = _pages()
        for t in caches.values():
            t[4].fill_(1.5)  # block 0, already computed (a local prefix-cache hit)
        worker.register(caches)
        worker.start_loads([LoadSpec("c", tokens[: 2 * B], 1, (4, 6))])
        for name in NAMES:
            worker.wait_layer(name)
        assert worker.load_errors() == set()
        for name in NAMES:
            assert bool((caches[name][4] == 1.5).all())
            assert caches[name][6].any()
    finally:
        loop.close()


def test_a_prefix_that_is_not_published_becomes_load_errors(
    relay: dict[str, Any], published: Any, tmp_path: Path
) -> None:
    worker, loop = _worker(relay, "kv_consumer", tmp_path / "c.jsonl")
    try:
        caches = _pages()
        worker.register(caches)
        t0 = time.monotonic()
        worker.start_loads([LoadSpec("x", tuple(range(2 * B)), 0, (1, 2))])
        for name in NAMES:
            worker.wait_layer(name)
        assert worker.load_errors() == {1, 2}
        assert time.monotonic() - t0 < 20  # well within load_timeout
        assert not any(t.any() for t in caches.values())  # nothing was written
        events = {e["event"]: e for e in _events(tmp_path / "c.jsonl")}
        assert events["load_errors"]["block_ids"] == [1, 2]
        assert events["load_done"]["loaded_blocks"] == 0
    finally:
        with contextlib.suppress(Exception):
            loop.close()


def _keys(tmp: Path) -> tuple[Path, Path, Path]:
    """A producer's signing key, its public key, and another public key (PEM files)."""
    out = []
    for name in ("producer", "other"):
        priv = Ed25519PrivateKey.generate()
        (tmp / f"{name}.pem").write_bytes(
            priv.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (tmp / f"{name}.pub").write_bytes(
            priv.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        out.append(tmp / f"{name}.pem")
    return out[0], out[0].with_suffix(".pub"), out[1].with_suffix(".pub")


def test_a_signed_encrypted_publication_loads_only_with_the_producers_key(
    relay: dict[str, Any], tmp_path: Path
) -> None:
    sign, public, other = _keys(tmp_path)
    producer, ploop = _worker(
        relay, "kv_producer", tmp_path / "p.jsonl", sign_key=str(sign), encrypt=True
    )
    try:
        src = _pages()
        g = torch.Generator().manual_seed(5)
        for t in src.values():
            t.copy_(torch.randn(t.shape, generator=g))
        producer.register(src)
        tokens = tuple(range(5000, 5000 + 2 * B))
        producer.start_saves([SaveSpec("p", tokens, (7, 8))])
        for name in NAMES:
            producer.save_layer(name)
        producer.wait_saves()
        _wait(lambda: any(e["event"] == "published" for e in _events(tmp_path / "p.jsonl")),
              "the publication")  # fmt: skip
        for key, ok in ((public, True), (other, False)):
            consumer, cloop = _worker(
                relay, "kv_consumer", producer_key=str(key), encrypt=True, lookup_timeout=2.0,
                recovery_time=0.5,
            )  # fmt: skip
            try:
                caches = _pages()
                consumer.register(caches)
                consumer.start_loads([LoadSpec("c", tokens, 0, (1, 2))])
                for name in NAMES:
                    consumer.wait_layer(name)
                errors = consumer.load_errors()
                if ok:
                    assert errors == set()
                    for name in NAMES:
                        (ks, _), (kd, _) = _kv(src[name]), _kv(caches[name])
                        assert torch.equal(kd[[1, 2]], ks[[7, 8]])
                else:  # a manifest that does not verify with the trusted key: never used
                    assert errors == {1, 2}
                    assert not any(t.any() for t in caches.values())
            finally:
                cloop.close()
    finally:
        ploop.close()
