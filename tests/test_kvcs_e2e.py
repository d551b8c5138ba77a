"""End to end, session to session over the loopback: KvcsPublisher -> KvcsConsumer.

Every consumer has its own client session to its own server session of the
publisher (``KvcsPublisher.attach`` on each), all on one virtual clock; the
consumers' timers are fired by ``kvcs_fixtures.World``. Data lands in
``kvcs.adapters.numpy_kv.KvDestination`` buffers and is compared bitwise (uint16 views of
the bfloat16 bit patterns) with the source engine arrays.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from kvcs_fixtures import (
    KEYS,
    KID,
    PRODUCER,
    PUB_A,
    PUB_B,
    ROGUE,
    SCOPE_KEY,
    Client,
    Conn,
    SourceCache,
    StoreServer,
    World,
    flip_bit,
    make_cd,
    manifest_store,
    prompt,
    rebuild_head,
    tampered_stores,
)

from kvcs.adapters.numpy_kv import KvDestination
from kvcs_core.kvcs.consumer import (
    ConsumerConfig,
    DiscardReason,
    KvcsConsumer,
    LayerReady,
    ManifestAccepted,
    ManifestDiscarded,
    ManifestRejectReason,
    ObjectDiscarded,
    PublicationRejected,
    PublicationSelected,
    RecomputeNeeded,
    RetrievalComplete,
)
from kvcs_core.kvcs.cose import sign_manifest
from kvcs_core.kvcs.payload import ObjectRejectReason
from kvcs_core.kvcs.publisher import MAX_MANIFEST_INTERVAL
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, ParameterType

# --- 1. the full-size cache, three consumers ---------------------------------------------

BIG_LAYERS = 32
BIG_TOKENS = 1024  # 64 blocks of 16: 128 MiB of K+V (bfloat16) per consumer
LAYER_PERIOD = 0.010  # one layer produced every 10 ms of virtual time
MID_JOIN_AFTER = 12  # the second consumer joins once layers 0..12 exist


def new_consumer(
    cache: SourceCache, tokens: list[int], dest_tokens: int | None = None, **kw: Any
) -> tuple[KvcsConsumer, KvDestination]:
    dest = KvDestination(cache.cd, dest_tokens or (len(tokens) // 16) * 16)
    kw.setdefault("producer_keys", KEYS)
    c = KvcsConsumer(cache.cd_json, SCOPE_KEY, tokens, destinations=dest.buffer, **kw)
    return c, dest


def data_requests(conn: Conn, kind: type) -> list[Any]:
    return [e for e in conn.requests(kind) if e.track.name.startswith((b"k.", b"v."))]


def event_order(client: Client) -> list[str]:
    """The client's events, condensed: ``L<n>`` for LayerReady, class names otherwise."""
    out = []
    for _, e in client.events:
        out.append(f"L{e.layer}" if isinstance(e, LayerReady) else type(e).__name__)
    return out


def test_three_consumers_before_during_and_after_production() -> None:
    cache = SourceCache(make_cd(layers=BIG_LAYERS), BIG_TOKENS, seed=7)
    tokens = prompt(BIG_TOKENS)
    pub = cache.publisher(tokens, PUB_A)
    world = World()
    conns = [world.connect(pub) for _ in range(3)]

    early_c, early_dest = new_consumer(cache, tokens)
    early = world.add_consumer(early_c, conns[0], dest=early_dest)
    world.drive(lambda: early_c.manifest is not None)
    start = world.now
    produced: list[float] = []
    mid: Client | None = None
    for layer in range(BIG_LAYERS):
        world.run_to(start + layer * LAYER_PERIOD)
        cache.put(pub, layer, world.now)
        produced.append(world.now)
        world.poke_servers()
        if layer == MID_JOIN_AFTER:
            mid_c, mid_dest = new_consumer(cache, tokens)
            mid = world.add_consumer(mid_c, conns[1], dest=mid_dest)
    assert mid is not None
    assert pub.complete
    world.finish(early, mid, max_time=60)

    # every layer is produced (the manifest says complete): completed retrieval. The
    # publication is not finish()ed yet: see test_consumer_after_finish_gets_the_manifest
    late_c, late_dest = new_consumer(cache, tokens)
    late = world.add_consumer(late_c, conns[2], dest=late_dest)
    world.finish(late, max_time=60)
    pub.finish(now=world.now)
    world.poke_servers()
    world.run_to(world.now + 0.1)

    for client in (early, mid, late):
        done = client.done_event()
        assert (done.publication_id, done.blocks, done.complete) == (PUB_A, 64, True)
        assert not client.of((ObjectDiscarded, RecomputeNeeded, PublicationRejected))
        assert sorted(e.layer for e in client.of(LayerReady)) == list(range(BIG_LAYERS))
        assert client.dest is not None
        cache.check(client.dest)

    # the live ones could use layer 0 long before the last layer existed
    for client in (early, mid):
        t0 = client.at(LayerReady)[0]
        assert client.of(LayerReady)[0].layer == 0
        assert t0 < produced[-1], (t0, produced[-1])
    # the cost of producer authenticity (issue 10 finding 4): a layer is usable once a
    # verified manifest version lists its digests, and the publisher lists them every
    # 8 completed layers (profile 3.6), so layer 0 waits for layer 7's version
    interval = MAX_MANIFEST_INTERVAL
    assert produced[interval - 1] <= early.at(LayerReady)[0] < produced[interval - 1] + LAYER_PERIOD
    # the early consumer got each layer about as it was produced, in order
    assert [e.layer for e in early.of(LayerReady)] == list(range(BIG_LAYERS))
    order = event_order(early)
    assert order[0] == "PublicationSelected" and order[1] == "ManifestAccepted"
    assert order[-1] == "RetrievalComplete"
    # the mid-production joiner got the layers produced before it joined by the fill
    # (a few round trips of 10 ms: SUBSCRIBE_NAMESPACE, manifest, data subscriptions)
    assert mid.at(LayerReady)[0] < produced[MID_JOIN_AFTER] + 0.06

    # retrieval modes, as the publisher saw them: SUBSCRIBE (exactly-once) for the live
    # consumers, FETCH for the one that came after completion
    for conn in conns[:2]:
        subs = data_requests(conn, ev.SubscribeRequested)
        assert sorted(s.track.name for s in subs) == [b"k.raw.s0", b"v.raw.s0"]
        for s in subs:
            assert s.params.get(p.LocationFilter) == p.LocationFilter.next_object()
            inner = s.params.get(p.FillParameters).params.get(p.LocationFilter)
            assert inner == p.LocationFilter.absolute_start(0, 0)
        assert not data_requests(conn, ev.FetchRequested)
    fetches = data_requests(conns[2], ev.FetchRequested)
    assert sorted(f.track.name for f in fetches) == [b"k.raw.s0", b"v.raw.s0"]
    for f in fetches:
        assert f.params.get(p.LocationFilter) == p.LocationFilter.absolute_group_end(
            0, 0, BIG_LAYERS - 1
        )
    assert not data_requests(conns[2], ev.SubscribeRequested)
    # recorded event order of the early (live) consumer, for the report
    print("early consumer events:", " ".join(order))
    print("mid consumer events:", " ".join(event_order(mid)))
    print("late consumer events:", " ".join(event_order(late)))


def test_consumer_after_finish_gets_the_manifest() -> None:
    cache = SourceCache(make_cd(layers=2, kv_heads=2, head_dim=8), 64)
    tokens = prompt(64)
    pub = cache.produce_all(cache.publisher(tokens, PUB_A), finish=True)
    world = World()
    conn = world.connect(pub)
    c, dest = new_consumer(cache, tokens)
    client = world.add_consumer(c, conn, dest=dest)
    world.finish(client)
    assert not client.of(PublicationRejected)
    assert client.done_event().complete
    cache.check(dest)


# --- 2. partial prefix ---------------------------------------------------------------------

PREFIX_CD = make_cd(layers=8)
PREFIX_TOKENS = 1024  # 64 blocks
SHARED = 40  # the consumer's prompt diverges after block 40


def diverging_prompt(shared_blocks: int, extra_blocks: int = 2) -> list[int]:
    return prompt(PREFIX_TOKENS)[: shared_blocks * 16] + [7] * (extra_blocks * 16)


@pytest.mark.parametrize("live", [False, True], ids=["completed", "live"])
@pytest.mark.parametrize("filters", [16, 0], ids=["filters", "no-filters"])
def test_partial_prefix_gets_exactly_the_shared_blocks(live: bool, filters: int) -> None:
    cache = SourceCache(PREFIX_CD, PREFIX_TOKENS, seed=3)
    pub = cache.publisher(prompt(PREFIX_TOKENS), PUB_A)
    if not live:
        cache.produce_all(pub)
    world = World()
    conn = world.connect(
        pub, server_config=SessionConfig(role=Role.SERVER, max_filter_ranges=filters)
    )
    tokens = diverging_prompt(SHARED)
    c, dest = new_consumer(cache, tokens)
    assert c.prompt_blocks == SHARED + 2
    client = world.add_consumer(c, conn, dest=dest)
    # the publication's prefix is longer than ours: it is found by a KVSP index lookup
    c.add_publication(pub.namespace, blocks=SHARED, now=world.now)
    if live:
        world.drive(lambda: c.manifest is not None)
        for layer in range(cache.cd.layers):
            world.run_to(world.now + LAYER_PERIOD)
            cache.put(pub, layer, world.now)
            world.poke_servers()
    world.finish(client)
    done = client.done_event()
    assert (done.publication_id, done.blocks, done.complete) == (PUB_A, SHARED, True)
    assert not client.of((ObjectDiscarded, RecomputeNeeded))
    assert sorted(e.layer for e in client.of(LayerReady)) == list(range(cache.cd.layers))
    cache.check(dest, blocks=SHARED)  # blocks 0..SHARED-1 exact, nothing beyond

    kind = ev.SubscribeRequested if live else ev.FetchRequested
    reqs = data_requests(conn, kind)
    assert sorted(r.track.name for r in reqs) == [b"k.raw.s0", b"v.raw.s0"]
    other = ev.FetchRequested if live else ev.SubscribeRequested
    assert not data_requests(conn, other)
    for r in reqs:
        objid = [f for f in r.params.all(p.RangeFilter) if f.kind == ParameterType.OBJECTID_FILTER]
        if filters:
            assert [f.ranges for f in objid] == [((0, SHARED - 1),)]
        else:
            assert objid == []
    if filters:
        assert c.excess_objects == 0
    else:
        assert c.excess_objects > 0  # the peer could not filter: excess Objects discarded


# --- 3. bad data -----------------------------------------------------------------------------

SMALL_CD = make_cd(layers=4, kv_heads=2, head_dim=8)
SMALL_TOKENS = 64  # 4 blocks
BAD_LAYER, BAD_BLOCK = 2, 1


def small_cache() -> SourceCache:
    return SourceCache(SMALL_CD, SMALL_TOKENS, seed=11)


def two_publications(
    primary: Any, cache: SourceCache, *, primary_latency: float = 0.005
) -> tuple[World, Conn, Conn, KvcsConsumer, Client]:
    """``primary`` (a StoreServer or publisher) on session 0; a second, deterministic,
    healthy publication of the same cache (PUB_B) on session 1, announced later."""
    tokens = prompt(SMALL_TOKENS)
    pub_b = cache.produce_all(cache.publisher(tokens, PUB_B, deterministic=True))
    world = World()
    conn_a = world.connect(primary, latency=primary_latency)
    conn_b = world.connect(pub_b, latency=0.02)
    c, dest = new_consumer(cache, tokens, recovery_time_bound=2.0)
    client = world.add_consumer(c, conn_a, conn_b, dest=dest)
    world.finish(client)
    return world, conn_a, conn_b, c, client


def tampered_primary(cache: SourceCache, edit: Any, track: str = "k.raw.s0") -> StoreServer:
    tokens = prompt(SMALL_TOKENS)
    pub_a = cache.produce_all(cache.publisher(tokens, PUB_A, deterministic=True))
    return tampered_stores(pub_a, {(track, BAD_LAYER, BAD_BLOCK): edit})


def _flip(head: bytes, data: bytes) -> tuple[bytes, bytes]:
    return head, flip_bit(data)


def _wrong_layer(head: bytes, data: bytes) -> tuple[bytes, bytes]:
    return rebuild_head(head, layer=BAD_LAYER + 1), data


def _wrong_block(head: bytes, data: bytes) -> tuple[bytes, bytes]:
    return rebuild_head(head, block=BAD_BLOCK + 1), data


def _truncated(head: bytes, data: bytes) -> tuple[bytes, bytes]:
    return head, data[:-100]


def _unknown_codec(head: bytes, data: bytes) -> tuple[bytes, bytes]:
    return rebuild_head(head, codec=0x7777), data


@pytest.mark.parametrize(
    ("edit", "check"),
    [
        (_flip, ObjectRejectReason.DIGEST_MISMATCH),
        (_wrong_layer, ObjectRejectReason.LAYER_MISMATCH),
        (_wrong_block, ObjectRejectReason.BLOCK_INDEX_MISMATCH),
        (_truncated, ObjectRejectReason.DATA_TRUNCATED),
        (_unknown_codec, ObjectRejectReason.CODEC_MISMATCH),
    ],
    ids=["flipped-bit", "wrong-layer", "wrong-block", "truncated", "unknown-codec"],
)
def test_bad_object_is_discarded_and_recovered_from_a_second_publication(
    edit: Any, check: ObjectRejectReason
) -> None:
    cache = small_cache()
    _, _, conn_b, _, client = two_publications(tampered_primary(cache, edit), cache)
    bad = client.of(ObjectDiscarded)
    assert [(b.reason, b.check, b.publication_id, b.track, b.layer, b.block) for b in bad] == [
        (DiscardReason.PAYLOAD_CHECK, check, PUB_A, "k.raw.s0", BAD_LAYER, BAD_BLOCK)
    ], bad
    assert bad[0].detail
    sel = [(s.publication_id, s.primary) for s in client.of(PublicationSelected)]
    assert sel == [(PUB_A, True), (PUB_B, False)]
    done = client.done_event()
    assert (done.publication_id, done.complete) == (PUB_A, True)
    assert not client.of(RecomputeNeeded)
    assert sorted(set(e.layer for e in client.of(LayerReady))) == list(range(4))
    assert client.dest is not None
    cache.check(client.dest)  # the lost block came, bit-identical, from PUB_B
    recovered = data_requests(conn_b, ev.FetchRequested)
    assert recovered and all(
        f.params.get(p.LocationFilter).start_group <= BAD_LAYER for f in recovered
    )


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("compat", ManifestRejectReason.COMPAT_MISMATCH),
        ("wrong-key", ManifestRejectReason.BAD_SIGNATURE),
        ("unsigned", ManifestRejectReason.UNSIGNED),
    ],
)
def test_bad_manifest_rejects_the_publication_and_another_is_used(
    how: str, reason: ManifestRejectReason
) -> None:
    cache = small_cache()
    tokens = prompt(SMALL_TOKENS)
    pub_a = cache.produce_all(cache.publisher(tokens, PUB_A, deterministic=True))
    if how == "compat":
        other = dict(SMALL_CD, model="test/other@1")  # does not hash to namespace field 2
        bad = attrs.evolve(pub_a.manifest, compat=other)
        store = manifest_store(pub_a, manifest=bad, finished=False)
    elif how == "wrong-key":
        store = manifest_store(pub_a, key=ROGUE, finished=False)
    else:
        store = manifest_store(pub_a, key=None, finished=False)
    server = tampered_stores(pub_a, {}, manifest=store)
    _, conn_a, _, _, client = two_publications(server, cache)
    rej = client.of(PublicationRejected)
    assert [(r.publication_id, r.reason) for r in rej] == [(PUB_A, reason)]
    assert rej[0].detail
    assert not [e for e in client.of(ManifestAccepted) if e.publication_id == PUB_A]
    assert not data_requests(conn_a, (ev.FetchRequested, ev.SubscribeRequested))
    manifest_reqs = [e.track.name for e in conn_a.requests(ev.SubscribeRequested)]
    assert b"manifest" not in manifest_reqs  # unsigned never asked for: authenticity required
    done = client.done_event()
    assert (done.publication_id, done.complete) == (PUB_B, True)
    assert client.dest is not None
    cache.check(client.dest)


def test_namespace_of_the_wrong_shape_is_ignored() -> None:
    cache = small_cache()
    tokens = prompt(SMALL_TOKENS)
    pub = cache.produce_all(cache.publisher(tokens, PUB_A))
    junk = StoreServer()
    junk.extra_announcements = [
        (b"\xcc" * 15,),  # Publication ID one octet short
        (b"\xcc" * 16, b"extra"),  # six fields
        (),  # the prefix itself: four fields
    ]
    world = World()
    conn_junk = world.connect(junk)  # announces first
    conn_pub = world.connect(pub, latency=0.02)
    c, dest = new_consumer(cache, tokens)
    client = world.add_consumer(c, conn_junk, conn_pub, dest=dest)
    world.finish(client)
    assert len(conn_junk.requests(ev.SubscribeNamespaceRequested)) >= 1
    announced = [
        e.namespace for e in conn_junk.client_events if isinstance(e, ev.NamespaceAnnounced)
    ]
    assert len(announced) >= 3 and {len(ns.fields) for ns in announced} >= {4, 6}
    assert [(s.publication_id, s.primary) for s in client.of(PublicationSelected)] == [
        (PUB_A, True)
    ]
    assert not client.of((PublicationRejected, ObjectDiscarded, ManifestDiscarded))
    assert not conn_junk.requests((ev.SubscribeRequested, ev.FetchRequested))
    done = client.done_event()
    assert (done.publication_id, done.complete) == (PUB_A, True)
    cache.check(dest)


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("wrong-key", ManifestRejectReason.BAD_SIGNATURE),
        ("compat", ManifestRejectReason.COMPAT_MISMATCH),
    ],
)
def test_bad_later_manifest_version_is_discarded_and_the_publication_kept(
    how: str, reason: ManifestRejectReason
) -> None:
    cache = small_cache()
    tokens = prompt(SMALL_TOKENS)
    pub_a = cache.produce_all(cache.publisher(tokens, PUB_A))
    store = manifest_store(pub_a, finished=False)  # version 0: good
    server = tampered_stores(pub_a, {}, manifest=store)
    world = World()
    conn = world.connect(server, bandwidth=8_000)  # slow: ~2 s for the 16 KiB of data
    c, dest = new_consumer(cache, tokens)
    client = world.add_consumer(c, conn, dest=dest)
    world.drive(lambda: bool(client.of(ManifestAccepted)))
    body = pub_a.manifest
    key = PRODUCER
    if how == "wrong-key":
        key = ROGUE
    else:
        body = attrs.evolve(body, compat=dict(SMALL_CD, model="test/other@1"))
    payload = sign_manifest(body.encode(), key, KID)
    store.append(1, 0, payload, publisher_priority=0)
    store.append(1, 1, status=ObjectStatus.END_OF_GROUP, publisher_priority=0)
    world.poke_servers()
    world.finish(client)
    disc = client.of(ManifestDiscarded)
    assert [(d.publication_id, d.version, d.reason) for d in disc] == [(PUB_A, 1, reason)]
    assert client.at(ManifestDiscarded)[0] < client.at(RetrievalComplete)[0]
    assert not client.of(PublicationRejected)
    done = client.done_event()
    assert (done.publication_id, done.complete) == (PUB_A, True)
    cache.check(dest)


def test_a_silently_dead_session_is_left_for_another_after_a_stall() -> None:
    """A relay that stops answering (no close: a killed process) stalls the retrieval;
    after ``stall_timeout`` the consumer asks the other session, not the dead one again,
    even though the dead one had delivered part of the cache (profile 5.4 recovery)."""
    cache = small_cache()
    tokens = prompt(SMALL_TOKENS)
    # a version per layer: signed layers are usable once listed (issue 10 finding 4)
    pub = cache.publisher(tokens, PUB_A, manifest_interval=1)
    world = World()
    conn_a = world.connect(pub)
    conn_b = world.connect(pub, latency=0.02)
    c, dest = new_consumer(
        cache, tokens, recovery_time_bound=0.5, config=ConsumerConfig(stall_timeout=1.0)
    )
    client = world.add_consumer(c, conn_a, conn_b, dest=dest)
    world.drive(lambda: c.manifest is not None)
    cache.put(pub, 0, world.now)
    cache.put(pub, 1, world.now)
    world.poke_servers()
    world.drive(lambda: c.layer_ready(1))
    conn_a.link.set_latency(1e6)  # session 0 goes silent: nothing it sends arrives any more
    for layer in range(2, SMALL_CD["layers"]):
        cache.put(pub, layer, world.now)
    world.poke_servers()
    world.finish(client, max_time=30)
    done = client.done_event()
    assert done.complete, client.events
    assert not client.of(RecomputeNeeded)
    cache.check(dest)
    asked_b = data_requests(conn_b, (ev.SubscribeRequested, ev.FetchRequested))
    assert asked_b, "the healthy session was never asked"
