"""The KVSP index (binding 9, issue #15) over real QUIC on 127.0.0.1, through relays.

A signed 1000-token publication (16-token blocks: 62 blocks, 4 layers) is published
through an in-process ``kvcs relay`` (``serve_relay``); consumers whose prompts the
publication only partly shares find it through the index (its Anchor Key is
``K_61``, which none of them can compute), through the same relay or through a
two-relay tree (consumer -> leaf -> root <- publisher):

* a 700-token prefix of the publication's prompt (43 full blocks),
* a prompt sharing the first 700 tokens and then differing (block 43 differs),
* a prompt sharing only the first block.

Each receives exactly the shared full blocks, bit for bit, with at most
``ceil(log2 m) + 1`` lookups for its ``m`` blocks. A forging relay that rewrites the
index records it forwards (a genuine signed record of another block, and a record
signed by a key that is not the producer's, naming another publication) is
detected (``IndexRecordDiscarded``), nothing it forged is used, and the consumer
falls back: to the shorter prefix whose record is genuine, or, with an honest relay
beside it, to that relay's records.

With 62 index namespaces the relay's session holds more than 64 requests of the
publisher, so its request table is swept while the manifest's fill (about 34 KB,
4 layers) is still arriving after its PUBLISH_DONE: a sweep that forgot the
draining subscription dropped that fill (no manifest, "no publication found").

Every wait has a deadline; relays and clients are closed by their context managers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
from auth_keys import ALL_ACTIONS, claim, ed25519_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvcs.adapters.cachefile import CacheFile, llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import layer_sections
from kvcs.transports.cli.token import scope_claim
from kvcs.transports.quic import asyncio_binding as b
from kvcs.transports.quic.api import MoqtClient
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.auth import Authorizer, issue_token
from kvcs_core.kvcs._verify import unverified_cose_payload
from kvcs_core.kvcs.consumer import (
    IndexLookupDone,
    IndexOptions,
    IndexRecordDiscarded,
    IndexRejectReason,
    IndexSearchDone,
)
from kvcs_core.kvcs.cose import sign_manifest
from kvcs_core.kvcs.index import IndexRecord, encode_record, parse_record
from kvcs_core.kvcs.names import Component, KvcsNamespace
from kvcs_core.kvcs.publisher import ManifestSigner
from kvcs_core.kvsp.keys import scope_id
from kvcs_core.moqt import events as ev
from kvcs_core.relay import RelayConfig
from kvcs_core.wire.codes import ObjectStatus

LAYERS, TOKENS, BLOCK = 4, 1000, 16
SCOPE_KEY = bytes(range(32))
KID = b"producer"
WAIT = 30.0
INDEX = IndexOptions()
"""The library's defaults: 0.3 s per lookup once the relay has answered. (Before lookups
waited for the relay's answers, a loaded two-core CI machine once made a lookup miss its
0.3 s, counted it as "not shared", and the search settled on a shorter prefix.)"""
PUB_ID = bytes(range(16, 32))
PRODUCER = Ed25519PrivateKey.generate()
ROGUE = Ed25519PrivateKey.generate()


def source() -> CacheFile:
    desc = llama_descriptor(layers=LAYERS, kv_heads=2, head_dim=64, block_tokens=BLOCK)
    return synthetic(desc, TOKENS, 11)


SRC = source()
PROMPTS: dict[str, tuple[list[int], int]] = {
    "prefix-700": (list(SRC.tokens[:700]), 700 // BLOCK),
    "shares-700-then-differs": (list(SRC.tokens[:700]) + [7] * 300, 700 // BLOCK),
    "shares-first-block": (list(SRC.tokens[:BLOCK]) + [5] * 200, 1),
}


@asynccontextmanager
async def relays(tmp: Path, tree: bool) -> AsyncIterator[tuple[str, str, TlsConfig]]:
    """(publisher's relay URL, consumer's relay URL, trust): one relay, or a leaf whose
    upstream is the root."""
    tls = self_signed(tmp / "tls")
    trust = TlsConfig(cafile=tls.cafile)
    async with b.serve_relay("127.0.0.1:0", tls=tls) as root:
        if not tree:
            yield root.url, root.url, trust
            return
        async with b.serve_relay(
            "127.0.0.1:0", tls=tls, upstream=root.url, upstream_tls=trust
        ) as leaf:
            yield root.url, leaf.url, trust


async def publish(client: MoqtClient, stride: int = 1) -> Any:
    pub = await client.publish_cache(
        SRC.descriptor, SCOPE_KEY, SRC.tokens, publication_id=PUB_ID,
        signer=ManifestSigner(PRODUCER, KID), index_stride=stride,
    )  # fmt: skip
    for layer in range(LAYERS):
        s = layer_sections(SRC.k[layer], SRC.v[layer], SRC.cd)
        await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
    await pub.finish()
    return pub


@attrs.frozen
class Got:
    blocks: int
    complete: bool
    lookups: int
    verified: int
    identical: bool
    events: list[Any]


async def retrieve(
    client: MoqtClient,
    tokens: list[int],
    also: tuple[MoqtClient, ...] = (),
    index: IndexOptions | None = INDEX,
    src: CacheFile = SRC,
) -> Got:
    r = client.retrieve_cache(
        src.descriptor, SCOPE_KEY, tokens, also=also, producer_keys={KID: PRODUCER.public_key()},
        index=index,
    )  # fmt: skip
    res = await r.result(timeout=WAIT, strict=False)
    c = r.consumer
    identical = True
    for layer in range(src.descriptor["layers"]):
        s = layer_sections(src.k[layer], src.v[layer], src.cd)
        for comp, ref in ((Component.K, s.k), (Component.V, s.v)):
            for blk in range(res.blocks):
                got = c.data(layer, comp, blk)
                identical = identical and got is not None and bytes(got) == bytes(ref[blk])
    return Got(res.blocks, res.complete, c.index_lookups, c.verified_objects, identical, r.events)


def check(got: Got, tokens: list[int], shared: int) -> None:
    m = len(tokens) // BLOCK
    assert got.complete, got.events[-5:]
    assert got.blocks == shared, got.events[-5:]
    assert got.verified == 2 * LAYERS * shared  # exactly the shared full blocks
    assert got.identical
    assert 1 <= got.lookups <= math.ceil(math.log2(m)) + 1
    done = [e for e in got.events if isinstance(e, IndexSearchDone)]
    assert len(done) == 1 and done[0].shared_blocks == shared and done[0].lookups == got.lookups
    assert done[0].publications == (PUB_ID,)


@pytest.mark.parametrize("tree", [False, True], ids=["one-relay", "two-relay-tree"])
def test_partial_prompts_find_the_longer_publication_through_the_index(
    tmp_path: Path, tree: bool
) -> None:
    async def scenario() -> dict[str, Got]:
        out: dict[str, Got] = {}
        async with relays(tmp_path, tree) as (pub_url, url, trust), AsyncExitStack() as stack:
            producer = await stack.enter_async_context(b.connect(pub_url, tls=trust))
            await publish(producer)
            whole = await stack.enter_async_context(b.connect(url, tls=trust))
            out["whole"] = await retrieve(whole, list(SRC.tokens))
            for name, (tokens, _shared) in PROMPTS.items():
                async with b.connect(url, tls=trust) as client:
                    out[name] = await retrieve(client, tokens)
        return out

    results = asyncio.run(asyncio.wait_for(scenario(), 120))
    for name, (tokens, shared) in PROMPTS.items():
        check(results[name], tokens, shared)
    # the whole prompt is found directly: no lookup
    whole = results["whole"]
    assert whole.complete and whole.blocks == TOKENS // BLOCK and whole.identical
    assert whole.lookups == 0


def test_with_a_stride_the_prefix_is_rounded_down_to_its_multiples(tmp_path: Path) -> None:
    tokens, _ = PROMPTS["shares-700-then-differs"]  # 43 blocks shared

    async def scenario() -> Got:
        async with AsyncExitStack() as stack:
            _pub_url, url, trust = await stack.enter_async_context(relays(tmp_path, False))
            producer = await stack.enter_async_context(b.connect(url, tls=trust))
            c = await stack.enter_async_context(b.connect(url, tls=trust))
            pub = await publish(producer, stride=4)
            assert len(pub.publisher.index.namespaces) == 62 // 4 + 1  # and the last block
            return await retrieve(c, tokens, index=IndexOptions(stride=4))

    got = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert got.complete and got.blocks == 40 and got.identical  # 40 = 4 x 10 <= 43
    assert got.verified == 2 * LAYERS * 40
    lookups = [e.length for e in got.events if isinstance(e, IndexLookupDone)]
    # bit by bit over the multiples of 4 (4 x 8, 12, 10, 11), then one more at the
    # publication's block count (62, indexed as its last block: the prompt's 62 blocks
    # could have shared it whole)
    assert lookups == [32, 48, 40, 44, 62]
    assert got.lookups <= math.ceil(math.log2(len(tokens) // BLOCK // 4 + 1)) + 1


def test_a_publication_beyond_the_relays_request_bound_is_indexed_and_found(
    tmp_path: Path,
) -> None:
    """1103 blocks (17,648 tokens), more than the 1024 requests a relay lets one session
    hold, each index entry being one: with the default bound of 512 records the stride
    doubles to 4 (276 records), and the consumers' search, told nothing, finds the
    longest multiple of 4 they share, and one more lookup the whole publication (its last
    block, 1103, is off the stride). With one record per block, the entries past the
    relay's bound were never announced and such a search settled on a short prefix (the
    demo's consumers got 451 of 1062 blocks)."""
    blocks = 1103
    desc = llama_descriptor(layers=1, kv_heads=1, head_dim=16, block_tokens=BLOCK)
    src = synthetic(desc, blocks * BLOCK, 5)
    prompts = {
        "extends-it": (list(src.tokens) + [3] * 100, blocks),
        "shares-701-then-differs": (list(src.tokens[: 701 * BLOCK]) + [9] * 99, 700),
    }

    async def scenario() -> tuple[int, int, dict[str, Got]]:
        out: dict[str, Got] = {}
        async with relays(tmp_path, False) as (pub_url, url, trust), AsyncExitStack() as stack:
            producer = await stack.enter_async_context(b.connect(pub_url, tls=trust))
            pub = await producer.publish_cache(
                src.descriptor, SCOPE_KEY, src.tokens, publication_id=PUB_ID,
                signer=ManifestSigner(PRODUCER, KID),
            )  # fmt: skip
            s = layer_sections(src.k[0], src.v[0], src.cd)
            await pub.put_layer(0, s.k, s.v, timeout=WAIT)
            await pub.finish()
            index = pub.publisher.index
            assert index is not None
            for name, (tokens, _shared) in prompts.items():
                async with b.connect(url, tls=trust) as client:
                    out[name] = await retrieve(client, tokens, src=src)
            return index.stride, len(index.namespaces), out

    stride, records, got = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert (stride, records) == (4, blocks // 4 + 1)
    for name, (tokens, shared) in prompts.items():
        g = got[name]
        assert g.complete and g.blocks == shared and g.identical, (name, g.events[-5:])
        assert g.verified == 2 * shared
        m = len(tokens) // BLOCK
        assert 1 <= g.lookups <= math.ceil(math.log2(m + 1)) + 1
    lookups = [e.length for e in got["extends-it"].events if isinstance(e, IndexLookupDone)]
    assert lookups[-1] == blocks  # the one more lookup, at the publication's block count


# --- a forging relay ---------------------------------------------------------------------


def forger(relay: Any, genuine: dict[int, bytes], forged: list[int]) -> None:
    """Rewrite every index record the relay receives for a block other than 0, taking turns:
    every second one becomes the producer's genuine signed record of block 0 (a replay,
    once that is known), the others a record naming another publication, signed by a key
    that is not the producer's (with the producer's ``kid``). Block 0's genuine record is
    kept (and remembered). (Turns, not block parity: the lookups of a bitwise search are
    mostly at even lengths, so odd block indices.)"""
    original: Callable[..., bool] = relay.handle_session_event
    rogue_ns = KvcsNamespace(*(bytes([0xEE]) * n for n in (16, 16, 32, 16)))

    def handle(session: Any, event: Any, now: float) -> bool:
        if type(event) is ev.ObjectReceived and event.status is ObjectStatus.NORMAL:
            raw = unverified_cose_payload(event.payload)
            record = None if raw is None else parse_record(raw)
            if isinstance(record, IndexRecord):
                i = record.block_index
                genuine.setdefault(i, bytes(event.payload))
                if i > 0:
                    if len(forged) % 2 and 0 in genuine:
                        bad = genuine[0]
                    else:
                        lie = attrs.evolve(
                            record,
                            namespace=attrs.evolve(rogue_ns, scope_id=record.namespace.scope_id,
                                                   compat_id=record.namespace.compat_id),
                        )  # fmt: skip
                        bad = sign_manifest(encode_record(lie), ROGUE, KID)
                    forged.append(i)
                    event = attrs.evolve(event, payload=memoryview(bad))
        return original(session, event, now)

    relay.handle_session_event = handle


def test_a_relay_forging_index_records_is_detected_and_the_consumer_falls_back(
    tmp_path: Path,
) -> None:
    tokens, shared = PROMPTS["shares-700-then-differs"]
    genuine: dict[int, bytes] = {}
    forged: list[int] = []

    async def scenario() -> tuple[Got, Got]:
        tls = self_signed(tmp_path / "tls")
        trust = TlsConfig(cafile=tls.cafile)
        async with (
            b.serve_relay("127.0.0.1:0", tls=tls) as honest,
            b.serve_relay("127.0.0.1:0", tls=tls) as bad,
        ):
            forger(bad.relay, genuine, forged)
            async with (
                b.connect(bad.url, tls=trust) as to_bad,
                b.connect(honest.url, tls=trust) as to_honest,
            ):
                await publish(to_bad)
                await publish(to_honest)
                # block 0's genuine record goes through the forger first (it is kept)
                async with b.connect(bad.url, tls=trust) as c0:
                    await retrieve(c0, PROMPTS["shares-first-block"][0])
                async with b.connect(bad.url, tls=trust) as c1:
                    alone = await retrieve(c1, tokens)
                async with (
                    b.connect(bad.url, tls=trust) as c2,
                    b.connect(honest.url, tls=trust) as c3,
                ):
                    beside = await retrieve(c2, tokens, also=(c3,))
        return alone, beside

    alone, beside = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert forged, "the forger rewrote no record"
    reasons = {e.reason for e in alone.events if isinstance(e, IndexRecordDiscarded)}
    assert reasons == {IndexRejectReason.WRONG_BLOCK, IndexRejectReason.BAD_SIGNATURE}, reasons
    # through the forger alone: every lookup past block 0 is refused; only the genuine
    # block-0 record is used, and that one block arrives, verified, bit for bit
    assert alone.complete and alone.blocks == 1 and alone.identical
    assert alone.verified == 2 * LAYERS
    lookups = [e for e in alone.events if isinstance(e, IndexLookupDone)]
    assert all(not e.shared for e in lookups if e.length > 1)
    # with the honest relay beside it, its genuine records give the whole shared prefix
    assert any(isinstance(e, IndexRecordDiscarded) for e in beside.events)
    check(beside, tokens, shared)


def test_the_index_is_withdrawn_with_the_publication(tmp_path: Path) -> None:
    """``KvcsPublisher.withdraw`` cancels the publication's and its index's
    PUBLISH_NAMESPACEs (the relay forgets them all); closing the session does the same."""

    async def scenario() -> tuple[int, int, int, int]:
        tls = self_signed(tmp_path / "tls")
        trust = TlsConfig(cafile=tls.cafile)
        async with b.serve_relay("127.0.0.1:0", tls=tls) as relay:
            def count() -> int:
                return len(relay.relay.namespaces())

            async with b.connect(relay.url, tls=trust) as producer:
                pub = await publish(producer)
                await producer.driver.wait_for(lambda: count() == 63, WAIT)
                announced = count()
                pub.publisher.withdraw(now=producer.driver.now())
                producer.driver.wake()
                await producer.driver.wait_for(lambda: count() == 0, WAIT)
                withdrawn = count()
            async with b.connect(relay.url, tls=trust) as again:
                await publish(again)
                await again.driver.wait_for(lambda: count() == 63, WAIT)
                republished = count()
            await asyncio.sleep(0.2)
            for _ in range(100):  # the relay sees the session end
                if count() == 0:
                    break
                await asyncio.sleep(0.05)
            return announced, withdrawn, republished, count()

    announced, withdrawn, republished, closed = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert (announced, withdrawn, republished, closed) == (63, 0, 63, 0)


def test_the_index_under_authorization(tmp_path: Path) -> None:
    """A relay that enforces CAT tokens: the claim ``kvcs token issue`` grants covers the
    scope's index (``kvcs-idx-1``) too, so the publisher's index is accepted and a
    partial prompt is found through it; a token for the publications alone gets its
    lookups refused, finds nothing and says so (RecomputeNeeded), nothing else."""
    tokens, shared = PROMPTS["shares-700-then-differs"]
    key = ed25519_key()
    sid = scope_id(SCOPE_KEY)
    now = time.time()
    grant = scope_claim(set(ALL_ACTIONS), (b"kvcs-1", sid))
    full = issue_token(key, grant, now=now, expires_in=600)
    narrow = issue_token(key, claim((b"kvcs-1", sid)), now=now, expires_in=600)

    async def scenario() -> tuple[int, Got, Got]:
        tls = self_signed(tmp_path / "tls")
        trust = TlsConfig(cafile=tls.cafile)
        config = RelayConfig(authorizer=Authorizer([key.public()], time.time))
        async with (
            b.serve_relay("127.0.0.1:0", tls=tls, relay_config=config) as relay,
            b.connect(relay.url, tls=trust, token=full) as producer,
        ):
            pub = await publish(producer)
            index = pub.publisher.index
            session = producer.session
            await producer.driver.wait_for(lambda: index.accepted(session) == 62, WAIT)
            accepted = index.accepted(session)
            async with b.connect(relay.url, tls=trust, token=full) as c:
                allowed = await retrieve(c, tokens)
            async with b.connect(relay.url, tls=trust, token=narrow) as c:
                refused = await retrieve(c, tokens)
        return accepted, allowed, refused

    accepted, allowed, refused = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert accepted == 62
    check(allowed, tokens, shared)
    assert refused.blocks == 0 and not refused.complete and refused.verified == 0
    assert refused.lookups >= 1
