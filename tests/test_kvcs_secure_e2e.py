"""Protected publications end to end over the loopback (KVSP binding 8, secure objects).

Session to session, on the virtual clock of ``kvcs_fixtures.World``: a
publisher with ``protection`` and a consumer that decrypts with keys derived
from the scope key; tampered or moved Objects are discarded with a reason and
recovered from a second publication; ``require_encryption`` refuses what is
not protected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kvcs_fixtures import (
    KEYS,
    PUB_A,
    PUB_B,
    SCOPE_KEY,
    SourceCache,
    StoreServer,
    World,
    make_cd,
    prompt,
)

from kvcs.adapters.numpy_kv import KvDestination
from kvcs_core.kvcs.consumer import (
    DiscardReason,
    KvcsConsumer,
    ManifestRejectReason,
    ObjectDiscarded,
    PublicationRejected,
    RecomputeNeeded,
)
from kvcs_core.kvcs.protection import ObjectProtection
from kvcs_core.kvcs.publisher import KvcsPublisher
from kvcs_core.moqt.track_store import StoredObject, TrackStore
from kvcs_core.secobj import (
    AeadLimits,
    CipherSuite,
    LimitReached,
    key_id_properties,
    read_key_id,
)
from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import Location

CD = make_cd(layers=4, kv_heads=2, head_dim=8)
TOKENS = 64  # 4 blocks
BAD_LAYER, BAD_BLOCK = 2, 1


def cache() -> SourceCache:
    return SourceCache(CD, TOKENS, seed=11)


def protected(
    src: SourceCache, pub_id: bytes, suite: CipherSuite = CipherSuite.AES_128_GCM_SHA256_128
) -> KvcsPublisher:
    pub = src.publisher(
        prompt(TOKENS), pub_id, deterministic=True, protection=ObjectProtection(suite, 3)
    )
    return src.produce_all(pub)


def consumer(src: SourceCache, **kw: Any) -> tuple[KvcsConsumer, KvDestination]:
    dest = KvDestination(src.cd, TOKENS)
    kw.setdefault("producer_keys", KEYS)
    c = KvcsConsumer(src.cd_json, SCOPE_KEY, prompt(TOKENS), destinations=dest.buffer, **kw)
    return c, dest


def run(*servers: Any, src: SourceCache, **kw: Any) -> Any:
    world = World()
    conns = [world.connect(s, latency=0.005 * (i + 1)) for i, s in enumerate(servers)]
    c, dest = consumer(src, **kw)
    client = world.add_consumer(c, *conns, dest=dest)
    world.finish(client)
    return client


def copy_with(
    store: TrackStore,
    edit: Callable[[StoredObject], tuple[int, bytes, tuple[Any, ...]] | None],
) -> TrackStore:
    """A copy of ``store``; ``edit(obj)`` may give a Normal Object a new (group, payload,
    properties); ``None`` keeps it."""
    out = TrackStore(
        store.name,
        default_publisher_priority=store.default_publisher_priority,
        group_order=store.group_order,
        track_properties=store.track_properties,
    )
    moved: list[tuple[StoredObject, int, bytes, tuple[Any, ...]]] = []
    for obj in store.objects_in(Location(0, 0)):
        change = edit(obj) if obj.status is ObjectStatus.NORMAL else None
        if change is not None:
            moved.append((obj, *change))
            continue
        out.append(
            obj.group_id,
            obj.object_id,
            obj.payload,
            obj.head,
            subgroup_id=obj.subgroup_id,
            publisher_priority=obj.publisher_priority,
            status=obj.status,
            properties=obj.properties,
        )
    for obj, group, payload, props in moved:
        if Location(group, obj.object_id) in out:
            continue  # its place is taken by the genuine Object moved there
        out.append(
            group,
            obj.object_id,
            payload,
            subgroup_id=obj.subgroup_id,
            publisher_priority=obj.publisher_priority,
            properties=props,
        )
    return out


def server_with(pub: KvcsPublisher, track: str, edit: Any) -> StoreServer:
    server = StoreServer()
    for name in pub.track_names:
        store = pub.store(name)
        assert store is not None
        server.serve(copy_with(store, edit) if name == track else store)
    return server


@pytest.mark.parametrize("suite", list(CipherSuite))
def test_protected_publication_is_retrieved_bit_identical(suite: CipherSuite) -> None:
    src = cache()
    pub = protected(src, PUB_A, suite)
    for name in pub.track_names:
        store = pub.store(name)
        assert store is not None
        for obj in store.objects_in(Location(0, 0)):
            if obj.status is ObjectStatus.NORMAL:
                assert obj.head == b""
                found = read_key_id(obj.properties)
                assert found == (3, b"")
            else:
                assert obj.properties == () and obj.size == 0  # status Objects in clear
    client = run(pub, src=src, require_encryption=True, cipher_suite=suite)
    assert client.done_event().complete
    assert not client.of(ObjectDiscarded)
    src.check(client.dest)


def test_no_plaintext_in_the_stores_of_a_protected_publication() -> None:
    src = cache()
    block = bytes(src.sections(BAD_LAYER).k[BAD_BLOCK])[:256]
    model = str(src.cd_json["model"]).encode()

    def payloads(pub: KvcsPublisher) -> bytes:
        out = bytearray()
        for name in pub.track_names:
            store = pub.store(name)
            assert store is not None
            for obj in store.objects_in(Location(0, 0)):
                out += obj.payload_bytes()
        return bytes(out)

    clear = payloads(src.produce_all(src.publisher(prompt(TOKENS), PUB_A)))
    assert block in clear and model in clear  # the search can find them
    sealed = payloads(protected(src, PUB_B))
    assert block not in sealed and model not in sealed


def _flip(obj: StoredObject) -> tuple[int, bytes, tuple[Any, ...]] | None:
    if (obj.group_id, obj.object_id) != (BAD_LAYER, BAD_BLOCK):
        return None
    data = bytearray(obj.payload_bytes())
    data[100] ^= 0x04
    return obj.group_id, bytes(data), obj.properties


def _strip(obj: StoredObject) -> tuple[int, bytes, tuple[Any, ...]] | None:
    if (obj.group_id, obj.object_id) != (BAD_LAYER, BAD_BLOCK):
        return None
    return obj.group_id, obj.payload_bytes(), ()


def _rekey(obj: StoredObject) -> tuple[int, bytes, tuple[Any, ...]] | None:
    if (obj.group_id, obj.object_id) != (BAD_LAYER, BAD_BLOCK):
        return None
    return obj.group_id, obj.payload_bytes(), key_id_properties(9)


def _bad_property(obj: StoredObject) -> tuple[int, bytes, tuple[Any, ...]] | None:
    if (obj.group_id, obj.object_id) != (BAD_LAYER, BAD_BLOCK):
        return None
    # IMMUTABLE_PROPERTIES whose only pair runs past its end
    return obj.group_id, obj.payload_bytes(), (KeyValuePair(0x0B, b"\x03\x09"),)


@pytest.mark.parametrize(
    ("edit", "reason", "kw"),
    [
        (_flip, DiscardReason.DECRYPTION_FAILED, {}),
        (_strip, DiscardReason.NOT_PROTECTED, {}),
        (_rekey, DiscardReason.DECRYPTION_FAILED, {}),  # another Key ID: another key
        (_rekey, DiscardReason.UNKNOWN_KEY_ID, {"key_ids": [3]}),  # not an accepted Key ID
        (_bad_property, DiscardReason.UNKNOWN_KEY_ID, {}),
    ],
    ids=["flipped-ciphertext", "key-id-removed", "key-id-changed", "key-id-unknown", "malformed"],
)
def test_tampered_object_is_discarded_and_recovered(
    edit: Any, reason: DiscardReason, kw: dict[str, Any]
) -> None:
    src = cache()
    bad = server_with(protected(src, PUB_A), "k.raw.s0", edit)
    client = run(bad, protected(src, PUB_B), src=src, require_encryption=True, **kw)
    discarded = client.of(ObjectDiscarded)
    assert [(d.reason, d.publication_id, d.track, d.layer, d.block) for d in discarded] == [
        (reason, PUB_A, "k.raw.s0", BAD_LAYER, BAD_BLOCK)
    ]
    assert discarded[0].detail
    done = client.done_event()
    assert done.complete and not client.of(RecomputeNeeded)
    src.check(client.dest)  # recovered bit-identical from PUB_B


def test_object_moved_to_another_group_is_detected() -> None:
    src = cache()
    pub = protected(src, PUB_A)
    store = pub.store("k.raw.s0")
    assert store is not None
    genuine = store.get(Location(BAD_LAYER - 1, BAD_BLOCK))
    assert genuine is not None

    def move(obj: StoredObject) -> tuple[int, bytes, tuple[Any, ...]] | None:
        if (obj.group_id, obj.object_id) == (BAD_LAYER, BAD_BLOCK):
            # replaced by the (valid, genuine) ciphertext of the Object one Group below
            return obj.group_id, genuine.payload_bytes(), genuine.properties
        return None

    client = run(server_with(pub, "k.raw.s0", move), protected(src, PUB_B), src=src)
    discarded = client.of(ObjectDiscarded)
    assert [(d.reason, d.layer, d.block) for d in discarded] == [
        (DiscardReason.DECRYPTION_FAILED, BAD_LAYER, BAD_BLOCK)
    ]
    assert client.done_event().complete
    src.check(client.dest)


def test_protected_objects_are_used_without_require_and_plain_ones_refused_with_it() -> None:
    src = cache()
    plain = src.produce_all(src.publisher(prompt(TOKENS), PUB_A, deterministic=True))
    # without require_encryption, an unprotected publication is used as before
    client = run(plain, src=src)
    assert client.done_event().complete
    # with it, its manifest is refused (no Key ID), then the publication
    src2 = cache()
    plain2 = src2.produce_all(src2.publisher(prompt(TOKENS), PUB_A, deterministic=True))
    client2 = run(plain2, src=src2, require_encryption=True)
    rejected = client2.of(PublicationRejected)
    assert [r.reason for r in rejected] == [ManifestRejectReason.NOT_PROTECTED]
    assert client2.of(RecomputeNeeded)
    assert not client2.done_event().complete


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"key_ids": [4]}, ManifestRejectReason.DECRYPTION_FAILED),  # unknown Key ID 3
        (
            {"cipher_suite": CipherSuite.AES_256_GCM_SHA512_128},
            ManifestRejectReason.DECRYPTION_FAILED,
        ),
    ],
    ids=["unknown-key-id", "other-suite"],
)
def test_manifest_that_does_not_open_rejects_the_publication(
    kw: dict[str, Any], reason: ManifestRejectReason
) -> None:
    src = cache()
    client = run(protected(src, PUB_A), src=src, **kw)
    assert [r.reason for r in client.of(PublicationRejected)] == [reason]
    assert client.of(RecomputeNeeded)


def test_publisher_refuses_a_layer_past_the_key_limit_and_stores_nothing_of_it() -> None:
    src = cache()
    tiny = ObjectProtection(CipherSuite.AES_128_GCM_SHA256_128, 0, AeadLimits(600, 10))
    pub = src.publisher(prompt(TOKENS), PUB_A, protection=tiny)
    with pytest.raises(LimitReached):
        for layer in range(src.cd.layers):
            src.put(pub, layer, 0.0)
    stuck = pub.segments[0].next_layer
    assert 0 < stuck < src.cd.layers
    for name in ("k.raw.s0", "v.raw.s0"):
        store = pub.store(name)
        assert store is not None
        assert store.get(Location(stuck - 1, 0)) is not None
        assert store.get(Location(stuck, 0)) is None  # neither track holds the refused layer
