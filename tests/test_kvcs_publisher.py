"""KvcsPublisher over the loopback, with a plain MoqtSession as the consumer.

The consumer side is a bare session driven by hand (no consumer machine yet):
it subscribes with the profile's recipes (5.2: NEXT_OBJECT + FILL{ABSOLUTE_START
0,0} for data, NEXT_OBJECT + FILL{RELATIVE_START 1} for the manifest; 5.3:
FETCH of layers a..b) and checks every Object with ``payload.verify_object``,
every manifest with ``parse_manifest`` (and ``verify_manifest`` for
``manifest.cose``) against what it received.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest
from _vectors import load_vectors
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from kvcs.transports.loopback import Chunking, Network
from kvcs_core import kvsp
from kvcs_core.kvcs.cose import verify_manifest
from kvcs_core.kvcs.manifest import Manifest, parse_manifest
from kvcs_core.kvcs.names import Component, KvcsNamespace
from kvcs_core.kvcs.payload import HEADER_LEN, VerifiedObject, verify_object
from kvcs_core.kvcs.publisher import (
    RAW_KV_WITH_KV_Q8,
    AttachState,
    KvcsPublisher,
    LayerOrderError,
    ManifestSigner,
    OfferError,
    PublicationFinishedError,
    PublisherError,
    SectionMismatchError,
    SegmentError,
    TrackOffer,
)
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, PublishDoneCode, RequestErrorCode
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

VEC = load_vectors("kvsp-vectors.json")
SCOPE_KEY = bytes.fromhex(VEC["inputs"]["scope_key"])
VEC_CD: dict[str, Any] = VEC["inputs"]["compat"]
VEC_TOKENS: list[int] = VEC["inputs"]["tokens"]
PUB_ID = bytes(range(100, 116))


def make_cd(layers: int = 12) -> dict[str, Any]:
    return {**VEC_CD, "layers": layers}


def section(cd: dict[str, Any], layer: int, block: int, which: int) -> bytes:
    """A float16 K (which=0) or V (which=1) section with finite, distinct values."""
    n = cd["kv_heads"] * cd["block_tokens"] * cd["head_dim"]
    values = [((layer * 7 + block * 13 + which * 5 + i) % 29 - 14) / 8 for i in range(n)]
    return struct.pack(f"<{n}e", *values)


def layer_sections(
    cd: dict[str, Any], layer: int, blocks: range
) -> tuple[list[bytes], list[bytes]]:
    return (
        [section(cd, layer, b, 0) for b in blocks],
        [section(cd, layer, b, 1) for b in blocks],
    )


class Rig:
    """One publisher-side session (server) and consumer sessions (clients), one link each."""

    def __init__(self, pub: KvcsPublisher, consumers: int = 1, chunking: Any = None) -> None:
        self.pub = pub
        self.pubs = [pub]
        """Every publication served on the producer sessions; events go to each in turn."""
        self.net = Network(seed=7)
        self.cons: list[MoqtSession] = []
        self.prods: list[MoqtSession] = []
        self.unhandled: list[tuple[MoqtSession, Any]] = []
        self.refuse_namespace = False
        for _ in range(consumers):
            c = MoqtSession(SessionConfig(role=Role.CLIENT))
            s = MoqtSession(SessionConfig(role=Role.SERVER))
            self.net.connect(c, s, latency=0.002, chunking=chunking or Chunking.WHOLE)
            self.cons.append(c)
            self.prods.append(s)
        self.net.on_event(self._on_event)
        for m in (*self.cons, *self.prods):
            m.start(now=0.0)
            self.net.poke(m)
        self.net.run_until(
            lambda: all(m.setup_complete for m in (*self.cons, *self.prods)), max_time=5
        )
        for s in self.prods:
            pub.attach(s, now=self.now)
            self.net.poke(s)
        self.settle()

    @property
    def now(self) -> float:
        return self.net.now

    @property
    def con(self) -> MoqtSession:
        return self.cons[0]

    def _on_event(self, machine: Any, e: Any) -> None:
        now = self.net.now
        if machine in self.prods:
            handled = [q.handle_session_event(machine, e, now) for q in self.pubs]
            if not any(handled):
                self.unhandled.append((machine, e))
                if isinstance(e, ev.SubscribeNamespaceRequested | ev.SubscribeRequested):
                    machine.reject_request(
                        e.request_id, RequestErrorCode.DOES_NOT_EXIST, "not here", now=now
                    )
        elif isinstance(e, ev.PublishNamespaceRequested):
            if self.refuse_namespace:
                machine.reject_request(e.request_id, RequestErrorCode.UNAUTHORIZED, now=now)
            else:
                machine.accept_request(e.request_id, now=now)

    def settle(self, duration: float = 0.2) -> None:
        for s in self.prods:
            self.net.poke(s)
        self.net.run_for(duration)

    def events(self, kind: Any, con: MoqtSession | None = None) -> list[Any]:
        return [e for e in self.net.events(con or self.con) if isinstance(e, kind)]

    def objects(self, rid: int, con: MoqtSession | None = None) -> list[ev.ObjectReceived]:
        return [e for e in self.events(ev.ObjectReceived, con) if e.request_id == rid]

    def track(self, name: str) -> FullTrackName:
        return FullTrackName(self.pub.namespace, name.encode())

    def subscribe_live(self, name: str, con: MoqtSession | None = None) -> int:
        """Profile 5.2, data tracks: NEXT_OBJECT + FILL{ABSOLUTE_START 0,0}."""
        c = con or self.con
        rid = c.subscribe(
            self.track(name),
            now=self.now,
            location_filter=p.LocationFilter.next_object(),
            fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
        )
        self.net.poke(c)
        return rid

    def subscribe_manifest(self, name: str, con: MoqtSession | None = None) -> int:
        """Profile 5.2, manifest: NEXT_OBJECT + FILL{RELATIVE_START 1}."""
        c = con or self.con
        rid = c.subscribe(
            self.track(name),
            now=self.now,
            location_filter=p.LocationFilter.next_object(),
            fill=p.Parameters.of(p.LocationFilter.relative_start(1)),
        )
        self.net.poke(c)
        return rid

    def put(self, layer: int, *, segment: int = 0) -> None:
        seg = self.pub.segments[segment]
        k, v = layer_sections(self.pub.descriptor.to_json(), layer, _blocks(seg))
        self.pub.put_layer(layer, k, v, segment=segment, now=self.now)
        self.settle(0.05)


def _blocks(seg: Any) -> range:
    return range(seg.first_block, seg.first_block + seg.blocks)


def check_objects(
    rig: Rig, name: str, objects: list[ev.ObjectReceived], *, segment: int = 0
) -> dict[tuple[int, int], VerifiedObject]:
    """Verify every normal Object (profile 3.5) and its Data against what was put."""
    desc = rig.pub.descriptor
    cd = desc.to_json()
    seg = rig.pub.segments[segment]
    comp_token, codec_name, _ = name.split(".")
    comp = Component.from_token(comp_token)
    codec = kvsp.codec_from_name(codec_name)
    out: dict[tuple[int, int], VerifiedObject] = {}
    for o in objects:
        if o.status is not ObjectStatus.NORMAL:
            continue
        g, oid = o.location.group, o.location.object
        got = verify_object(
            o.payload,
            group_id=g,
            object_id=oid,
            expected_component=comp,
            expected_codec=codec,
            expected_token_count=desc.block_tokens,
            expected_token_start=(seg.first_block + oid) * desc.block_tokens,
        )
        assert isinstance(got, VerifiedObject), got
        assert (g, oid) not in out, f"{name} {g},{oid} delivered twice"
        ks = section(cd, g, seg.first_block + oid, 0)
        vs = section(cd, g, seg.first_block + oid, 1)
        if codec is kvsp.Codec.RAW:
            want = {Component.K: ks, Component.V: vs, Component.KV: ks + vs}[comp]
        else:
            want = b"".join(bytes(x) for x in kvsp.encode_kv(codec, desc, ks, vs))
        assert bytes(got.data) == want
        out[(g, oid)] = got
    return out


def received_manifests(rig: Rig, rid: int, keys: Any = None) -> list[tuple[int, Manifest]]:
    out = []
    for o in rig.objects(rid):
        if o.status is not ObjectStatus.NORMAL:
            continue
        payload = bytes(o.payload)
        if keys is not None:
            verified = verify_manifest(payload, keys)
            assert isinstance(verified, bytes), verified
            payload = verified
        m = parse_manifest(payload)
        m.check_compat_id(rig.pub.kvcs_namespace)
        out.append((o.location.group, m))
    return out


# --- namespace, names, vectors ---------------------------------------------------------------


def test_namespace_keys_and_payload_match_the_kvsp_vectors() -> None:
    pub = KvcsPublisher(VEC_CD, SCOPE_KEY, VEC_TOKENS, bytes(16))
    assert [f.hex() for f in pub.namespace.fields] == VEC["namespace_fields_hex"]
    assert pub.namespace.fields == kvsp.namespace_fields(
        kvsp.scope_id(SCOPE_KEY), bytes.fromhex(VEC["compat_id"]), pub.anchor_key, bytes(16)
    )
    assert KvcsNamespace.from_track_namespace(pub.namespace) == pub.kvcs_namespace
    assert [k.hex() for k in pub.block_keys] == VEC["block_keys"]
    assert pub.anchor_key.hex() == VEC["anchor_key"]
    # tokens 8 and 9 are a partial tail: two blocks only
    assert pub.segments[0].blocks == 2 and pub.token_count == 10
    assert pub.track_names == ("manifest", "k.raw.s0", "v.raw.s0")
    seg = pub.manifest.segments[0]
    assert seg.block_keys_sha256 == VEC["block_keys_sha256"]
    assert (seg.first_block, seg.blocks, seg.complete) == (0, 2, False)
    assert pub.manifest.compat == VEC_CD and pub.manifest.deterministic is False

    ex = VEC["object_payload_example"]
    data = bytes.fromhex(ex["data_hex"])
    cd = VEC_CD
    pub.put_layer(0, *layer_sections(cd, 0, range(2)), now=0.0)
    k1 = [section(cd, 1, 0, 0), data]
    v1 = [section(cd, 1, 0, 1), section(cd, 1, 1, 1)]
    pub.put_layer(1, k1, v1, now=0.0)
    store = pub.store("k.raw.s0")
    assert store is not None
    obj = store.get(Location(ex["layer"], ex["block_index"]))
    assert obj is not None
    assert obj.payload_bytes().hex() == ex["payload_hex"]
    assert len(obj.head) == HEADER_LEN and obj.payload.obj is data  # header apart, no copy
    # raw k and v Data digests chain to the KVSP layer digest (profile 3.5, binding 5)
    v_store = pub.store("v.raw.s0")
    assert v_store is not None
    v_obj = v_store.get(Location(1, 1))
    assert v_obj is not None
    both = hashlib.sha256(bytes(obj.payload) + bytes(v_obj.payload)).digest()
    assert both == kvsp.layer_digest(kvsp.CompatibilityDescriptor(cd), data, v1[1])


# --- live retrieval ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunking", ["whole", "random"])
def test_live_subscribers_get_every_object_once_with_priorities_and_ends(chunking: str) -> None:
    layers, blocks = 12, 3
    cd = make_cd(layers)
    tokens = list(range(blocks * cd["block_tokens"] + 1))
    pub = KvcsPublisher(cd, SCOPE_KEY, tokens, PUB_ID)
    rig = Rig(pub, chunking=Chunking.random(seed=5, max_size=41) if chunking == "random" else None)
    assert pub.attach_state(rig.prods[0]) is AttachState.ACCEPTED
    for layer in range(4):
        rig.put(layer)
    k_rid = rig.subscribe_live("k.raw.s0")
    v_rid = rig.subscribe_live("v.raw.s0")
    m_rid = rig.subscribe_manifest("manifest")
    rig.settle(0.05)  # the subscriptions are in place mid-production (at layer 4)
    assert len(rig.events(ev.SubscribeAccepted)) == 3
    for layer in range(4, layers):
        rig.put(layer)
    rig.settle(0.5)

    for rid, name in ((k_rid, "k.raw.s0"), (v_rid, "v.raw.s0")):
        objs = rig.objects(rid)
        verified = check_objects(rig, name, objs)
        assert set(verified) == {(g, o) for g in range(layers) for o in range(blocks)}
        deliveries = {o.delivery for o in objs}
        assert deliveries == {ev.Delivery.FILL, ev.Delivery.SUBSCRIPTION}
        for o in objs:  # floor(128 * g / L) on the wire; End of Track (Group L) has L-1's
            g = o.location.group
            want = 128 * min(g, layers - 1) // layers
            assert o.publisher_priority == want, (o.location, o.publisher_priority)
        live = [o for o in objs if o.delivery is ev.Delivery.SUBSCRIPTION]
        assert [o.subgroup_id for o in live] == [0] * len(live)
        # ascending Object order within every Group, End of Group after the last block
        by_group: dict[int, list[ev.ObjectReceived]] = {}
        for o in live:
            by_group.setdefault(o.location.group, []).append(o)
        for g, group in by_group.items():
            if g == layers:
                assert [(o.location.object, o.status) for o in group] == [
                    (0, ObjectStatus.END_OF_TRACK)
                ]
                continue
            assert [o.location.object for o in group] == sorted(o.location.object for o in group)
            assert group[-1].status is ObjectStatus.END_OF_GROUP
            assert group[-1].location.object == blocks
        assert set(by_group) == set(range(4, layers + 1))
        dones = [d for d in rig.events(ev.PublishDoneReceived) if d.request_id == rid]
        assert [d.status for d in dones] == [PublishDoneCode.TRACK_ENDED]

    # manifest versions: start, after 8 completed layers, at completion
    versions = received_manifests(rig, m_rid)
    assert [g for g, _ in versions] == [0, 1, 2] == list(range(pub.manifest_versions))
    assert pub.manifest_versions == 3
    assert versions[0][1].segments[0].completed_groups("k.raw.s0") == 0
    assert versions[1][1].segments[0].completed_groups("k.raw.s0") == 8
    final = versions[-1][1]
    assert final == pub.manifest and final.complete
    assert final.layers == layers and final.block_tokens == cd["block_tokens"]
    k_ver = check_objects(rig, "k.raw.s0", rig.objects(k_rid))
    v_ver = check_objects(rig, "v.raw.s0", rig.objects(v_rid))
    for _, m in versions:
        for name, got in (("k.raw.s0", k_ver), ("v.raw.s0", v_ver)):
            n = m.segments[0].completed_groups(name)
            assert n is not None
            for g in range(n):
                for b in range(blocks):
                    assert m.digest_of(name, g, b) == got[(g, b)].header.data_digest
    manifest_objs = rig.objects(m_rid)
    assert {o.publisher_priority for o in manifest_objs} == {0}


def test_signed_manifest_verifies_and_plain_manifest_does_not_exist() -> None:
    cd = make_cd(3)
    key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    pub = KvcsPublisher(
        cd,
        SCOPE_KEY,
        VEC_TOKENS,
        PUB_ID,
        signer=ManifestSigner(key, b"producer-1"),
        deterministic=True,
    )
    assert pub.manifest_track == "manifest.cose"
    rig = Rig(pub)
    plain = rig.subscribe_manifest("manifest")
    signed = rig.subscribe_manifest("manifest.cose")
    rig.settle()
    failed = rig.events(ev.RequestFailed)
    assert [(f.request_id, f.code) for f in failed] == [(plain, RequestErrorCode.DOES_NOT_EXIST)]
    for layer in range(3):
        rig.put(layer)
    rig.settle()
    keys = {b"producer-1": key.public_key()}
    versions = received_manifests(rig, signed, keys)
    assert [g for g, _ in versions] == [0, 1]
    assert versions[-1][1].complete and versions[-1][1].deterministic
    # a wrong key refuses the version
    other = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key()
    o = next(o for o in rig.objects(signed) if o.status is ObjectStatus.NORMAL)
    assert not isinstance(verify_manifest(bytes(o.payload), {b"producer-1": other}), bytes)


def test_es256_signer() -> None:
    key = ec.derive_private_key(12345, ec.SECP256R1())
    pub = KvcsPublisher(make_cd(2), SCOPE_KEY, VEC_TOKENS, PUB_ID, signer=ManifestSigner(key, b"k"))
    store = pub.store("manifest.cose")
    assert store is not None and pub.store("manifest") is None
    first = store.get(Location(0, 0))
    assert first is not None
    payload = verify_manifest(first.payload_bytes(), {b"k": key.public_key()})
    assert isinstance(payload, bytes) and parse_manifest(payload) == pub.manifest


# --- completed retrieval ----------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), [(2, 5), (0, 0), (4, 7)])
def test_fetch_layers_a_to_b(a: int, b: int) -> None:
    layers, blocks = 8, 2
    cd = make_cd(layers)
    pub = KvcsPublisher(cd, SCOPE_KEY, list(range(blocks * 4)), PUB_ID)
    rig = Rig(pub)
    for layer in range(layers):
        rig.put(layer)
    rid = rig.con.fetch(
        rig.track("v.raw.s0"),
        now=rig.now,
        location_filter=p.LocationFilter.absolute_group_end(a, 0, b),
    )
    rig.settle()
    objs = rig.objects(rid)
    assert [(o.location.group, o.location.object) for o in objs] == [
        (g, o) for g in range(a, b + 1) for o in range(blocks)
    ]
    assert all(o.delivery is ev.Delivery.FETCH for o in objs)
    assert [o.publisher_priority for o in objs] == [
        128 * g // layers for g in range(a, b + 1) for _ in range(blocks)
    ]
    check_objects(rig, "v.raw.s0", objs)
    ok = rig.events(ev.FetchAccepted)
    assert len(ok) == 1 and ok[0].end_location == Location(b, blocks - 1)
    assert ok[0].end_of_track is (b == layers - 1)


def test_track_status_and_late_subscriber_after_the_end() -> None:
    cd = make_cd(4)
    pub = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID)
    rig = Rig(pub)
    for layer in range(4):
        rig.put(layer)
    rig.con.track_status(rig.track("k.raw.s0"), now=rig.now)
    rid = rig.subscribe_live("k.raw.s0")
    rig.settle()
    status = [e for e in rig.events(ev.RequestAccepted) if e.kind is ev.RequestKind.TRACK_STATUS]
    assert len(status) == 1
    largest = status[0].params.get(p.LargestObject)
    assert largest is not None and largest.location == Location(4, 0)  # End of Track
    objs = rig.objects(rid)
    assert {o.delivery for o in objs} == {ev.Delivery.FILL}
    assert set(check_objects(rig, "k.raw.s0", objs)) == {(g, o) for g in range(4) for o in (0, 1)}
    dones = [d for d in rig.events(ev.PublishDoneReceived) if d.request_id == rid]
    assert [d.status for d in dones] == [PublishDoneCode.TRACK_ENDED]


# --- segments ----------------------------------------------------------------------------------


def test_second_segment_via_append_tokens() -> None:
    cd = make_cd(3)
    pub = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID)  # 2 blocks + tokens 8, 9
    rig = Rig(pub)
    m_rid = rig.subscribe_manifest("manifest")
    early = rig.subscribe_live("k.raw.s1")
    rig.settle()
    assert [f.code for f in rig.events(ev.RequestFailed) if f.request_id == early] == [
        RequestErrorCode.DOES_NOT_EXIST
    ]
    for layer in range(3):
        rig.put(layer)
    assert pub.append_tokens([10], now=rig.now) is None  # 8..10: still no full block
    assert pub.manifest_versions == 2
    assert pub.append_tokens(range(11, 18), now=rig.now) == 1  # 8..17: blocks 2, 3 (+ tail)
    seg = pub.segments[1]
    assert (seg.first_block, seg.blocks, seg.token_start) == (2, 2, 8)
    assert seg.tracks == ("k.raw.s1", "v.raw.s1")
    assert pub.block_keys == kvsp.block_keys(SCOPE_KEY, kvsp.CompatibilityDescriptor(cd), range(18))
    assert pub.namespace.fields[3] == pub.block_keys[1]  # the anchor stays the first prompt's
    k1 = rig.subscribe_live("k.raw.s1")
    v1 = rig.subscribe_live("v.raw.s1")
    rig.settle()
    for layer in range(3):
        rig.put(layer, segment=1)
    rig.settle()
    for rid, name in ((k1, "k.raw.s1"), (v1, "v.raw.s1")):
        got = check_objects(rig, name, rig.objects(rid), segment=1)
        assert set(got) == {(g, o) for g in range(3) for o in range(2)}
        assert got[(0, 1)].header.token_start == 12
    versions = received_manifests(rig, m_rid)
    assert [g for g, _ in versions] == [0, 1, 2, 3]
    added, done = versions[2][1], versions[3][1]
    assert [s.complete for s in added.segments] == [True, False]
    assert [s.complete for s in done.segments] == [True, True]
    s1 = done.segments[1]
    assert (s1.first_block, s1.blocks) == (2, 2)
    assert s1.block_keys_sha256 == kvsp.block_keys_sha256(pub.block_keys, 2, 2)
    k1_got = check_objects(rig, "k.raw.s1", rig.objects(k1), segment=1)
    for g in range(3):
        for o in range(2):
            assert done.digest_of("k.raw.s1", g, o) == k1_got[(g, o)].header.data_digest
    pub.finish(now=rig.now)
    rig.settle()
    ends = [o for o in rig.objects(m_rid) if o.status is ObjectStatus.END_OF_TRACK]
    assert [o.location for o in ends] == [Location(3, 1)]  # right after the last version
    assert [d.status for d in rig.events(ev.PublishDoneReceived) if d.request_id == m_rid] == [
        PublishDoneCode.TRACK_ENDED
    ]
    with pytest.raises(PublicationFinishedError):
        pub.append_tokens(range(100), now=rig.now)


# --- the q8 kv track -----------------------------------------------------------------------------


def test_kv_q8_track_carries_quantized_k_then_v() -> None:
    cd = make_cd(2)
    pub = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID, offer=RAW_KV_WITH_KV_Q8)
    assert pub.track_names == ("manifest", "k.raw.s0", "v.raw.s0", "kv.q8.s0")
    rig = Rig(pub)
    rid = rig.subscribe_live("kv.q8.s0")
    rig.settle()
    for layer in range(2):
        rig.put(layer)
    rig.settle()
    got = check_objects(rig, "kv.q8.s0", rig.objects(rid))
    assert set(got) == {(g, o) for g in range(2) for o in range(2)}
    desc = pub.descriptor
    k, v = kvsp.decode_kv(kvsp.Codec.Q8, desc, got[(1, 0)].data)
    ks, vs = section(cd, 1, 0, 0), section(cd, 1, 0, 1)
    for dec, orig in ((k, ks), (v, vs)):
        a = kvsp.to_float32(desc.dtype, dec)
        b = kvsp.to_float32(desc.dtype, orig)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.02
    assert got[(0, 0)].header.codec == kvsp.Codec.Q8
    assert pub.manifest.segments[0].tracks == ("k.raw.s0", "v.raw.s0", "kv.q8.s0")


# --- namespace discovery and routing ------------------------------------------------------------


def test_subscribe_namespace_and_routing_of_other_namespaces() -> None:
    pub = KvcsPublisher(make_cd(2), SCOPE_KEY, VEC_TOKENS, PUB_ID)
    rig = Rig(pub)
    kns = pub.kvcs_namespace
    rid = rig.con.subscribe_namespace(kns.content_prefix(), now=rig.now)
    rig.settle()
    announced = [e for e in rig.events(ev.NamespaceAnnounced) if e.request_id == rid]
    assert [e.namespace for e in announced] == [pub.namespace]
    assert [e.request_id for e in rig.events(ev.RequestAccepted)] == [rid]
    # a prefix of another token prefix (another anchor) is not ours: routed elsewhere
    other = TrackNamespace.of(b"kvcs-1", kns.scope_id, kns.compat_id, bytes(32))
    rid2 = rig.con.subscribe_namespace(other, now=rig.now)
    # a track in another namespace is not ours either; an unknown track in ours is refused
    stranger = FullTrackName(other + TrackNamespace.of(PUB_ID), b"k.raw.s0")
    rid3 = rig.con.subscribe(stranger, now=rig.now)
    rid4 = rig.con.subscribe(rig.track("k.q8.s0"), now=rig.now)
    rid5 = rig.con.fetch(rig.track("kv.raw.s0"), now=rig.now)
    rig.net.poke(rig.con)
    rig.settle()
    unhandled = [type(e) for _, e in rig.unhandled if not isinstance(e, ev.SetupCompleted)]
    assert unhandled == [ev.SubscribeNamespaceRequested, ev.SubscribeRequested]
    # a request the peer cancelled before it was answered: handled, nothing to answer
    gone = ev.SubscribeRequested(request_id=999, track=rig.track("k.raw.s0"), params=p.Parameters())
    assert pub.handle_session_event(rig.prods[0], gone, rig.now) is True
    stray = MoqtSession(SessionConfig(role=Role.SERVER))
    assert pub.handle_session_event(stray, gone, rig.now) is False  # not attached
    failed = {f.request_id: f.code for f in rig.events(ev.RequestFailed)}
    assert failed == {
        rid2: RequestErrorCode.DOES_NOT_EXIST,
        rid3: RequestErrorCode.DOES_NOT_EXIST,
        rid4: RequestErrorCode.DOES_NOT_EXIST,
        rid5: RequestErrorCode.DOES_NOT_EXIST,
    }


def test_several_sessions_and_a_refused_publish_namespace() -> None:
    cd = make_cd(3)
    pub = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID)
    rig = Rig(pub, consumers=3)
    assert set(pub.sessions) == set(rig.prods)
    rids = [rig.subscribe_live("k.raw.s0", con=c) for c in rig.cons[:2]]
    rig.settle()
    for layer in range(3):
        rig.put(layer)
    rig.settle()
    for c, rid in zip(rig.cons[:2], rids, strict=True):
        got = check_objects(rig, "k.raw.s0", rig.objects(rid, c))
        assert set(got) == {(g, o) for g in range(3) for o in range(2)}
    with pytest.raises(PublisherError):
        pub.attach(rig.prods[0], now=rig.now)
    # a second publication on the same sessions: events are routed by namespace
    c0, c1 = rig.cons[:2]
    whole = c0.subscribe_namespace(pub.namespace, now=rig.now)  # the suffix is empty
    content = c1.subscribe_namespace(pub.kvcs_namespace.content_prefix(), now=rig.now)
    rig.settle()
    pub2 = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, bytes(16))  # same prefix, other production
    rig.pubs.append(pub2)
    rig.refuse_namespace = True
    pub2.attach(rig.prods[1], now=rig.now)  # announced on the established SUBSCRIBE_NAMESPACE
    rig.settle()
    assert pub2.attach_state(rig.prods[1]) is AttachState.REFUSED
    assert pub2.attach_refusal(rig.prods[1]) == (RequestErrorCode.UNAUTHORIZED, "")
    assert pub.attach_refusal(rig.prods[1]) is None
    assert pub.attach_state(rig.prods[1]) is AttachState.ACCEPTED
    assert [e.namespace for e in rig.events(ev.NamespaceAnnounced, c0)] == [pub.namespace]
    seen = [(e.request_id, e.namespace) for e in rig.events(ev.NamespaceAnnounced, c1)]
    assert seen == [(content, pub.namespace), (content, pub2.namespace)]
    assert whole in {e.request_id for e in rig.events(ev.RequestAccepted, c0)}
    # a fresh SUBSCRIBE_NAMESPACE covering both: offered to each, accepted once, two NAMESPACEs
    c2, p2 = rig.cons[2], rig.prods[2]
    rig.refuse_namespace = False
    pub2.attach(p2, now=rig.now)
    scope = c2.subscribe_namespace(pub.kvcs_namespace.scope_prefix(), now=rig.now)
    rig.net.poke(c2)
    rig.settle()
    assert [e.namespace for e in rig.events(ev.NamespaceAnnounced, c2)] == [
        pub.namespace,
        pub2.namespace,
    ]
    oks = [e for e in rig.events(ev.RequestAccepted, c2) if e.request_id == scope]
    assert len(oks) == 1 and not rig.events(ev.RequestFailed, c2)
    rid2 = rig.subscribe_live("k.raw.s0", con=c1)
    other = c1.subscribe(
        FullTrackName(pub2.namespace, b"k.raw.s0"),
        now=rig.now,
        location_filter=p.LocationFilter.next_object(),
        fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
    )
    rig.net.poke(c1)
    rig.settle()
    pub2.put_layer(0, *layer_sections(cd, 0, range(2)), now=rig.now)
    rig.settle()
    assert len(check_objects(rig, "k.raw.s0", rig.objects(rid2, c1))) == 6  # pub's, filled
    assert {o.location for o in rig.objects(other, c1)} == {
        Location(0, 0),
        Location(0, 1),
        Location(0, 2),  # pub2's live layer 0 + End of Group
    }
    rig.prods[0].close(now=rig.now)
    rig.settle()
    assert pub.attach_state(rig.prods[0]) is None
    assert pub.sessions == (rig.prods[1], rig.prods[2])


# --- misuse ------------------------------------------------------------------------------------


def test_errors_for_misuse_publish_nothing() -> None:
    cd = make_cd(4)
    pub = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID)
    k, v = layer_sections(cd, 0, range(2))
    store = pub.store("k.raw.s0")
    assert store is not None
    with pytest.raises(LayerOrderError) as info:
        pub.put_layer(1, k, v, now=0.0)
    assert isinstance(info.value, LocalProtocolError)
    assert len(store) == 0
    pub.put_layer(0, k, v, now=0.0)
    with pytest.raises(LayerOrderError):
        pub.put_layer(0, k, v, now=0.0)  # again
    with pytest.raises(LayerOrderError):
        pub.put_layer(2, k, v, now=0.0)  # skips layer 1
    with pytest.raises(SectionMismatchError):
        pub.put_layer(1, k[:1], v[:1], now=0.0)  # one block short
    with pytest.raises(SectionMismatchError):
        pub.put_layer(1, [k[0], k[1][:-2]], v, now=0.0)  # a short section
    with pytest.raises(SectionMismatchError):
        pub.put_layer(1, [k[0], memoryview(k[1] * 2)[::2]], v, now=0.0)  # not contiguous
    with pytest.raises(SegmentError):
        pub.put_layer(1, k, v, segment=1, now=0.0)
    assert len(store) == 3 and pub.segments[0].next_layer == 1
    with pytest.raises(SegmentError):
        pub.finish(now=0.0)
    for layer in range(1, 4):
        pub.put_layer(layer, k, v, now=0.0)
    with pytest.raises(LayerOrderError):
        pub.put_layer(4, k, v, now=0.0)  # the segment is complete
    assert pub.complete and store.end_of_track == Location(4, 0)
    pub.finish(now=0.0)
    pub.finish(now=0.0)  # idempotent
    # q8 refuses non-finite values, before anything is stored
    q8 = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID, offer=RAW_KV_WITH_KV_Q8)
    bad = struct.pack("<e", float("inf")) + k[0][2:]
    with pytest.raises(SectionMismatchError):
        q8.put_layer(0, [bad, k[1]], v, now=0.0)
    assert q8.total_bytes == len(q8.manifest.encode())


def test_construction_errors() -> None:
    cd = make_cd(2)
    with pytest.raises(PublisherError):
        KvcsPublisher(cd, SCOPE_KEY, [1, 2, 3], PUB_ID)  # no full block
    with pytest.raises(PublisherError):
        KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, b"short")
    with pytest.raises(OfferError):
        KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID, offer=[TrackOffer("k", "raw")])
    with pytest.raises(OfferError):
        TrackOffer("kv", "zstd")
    with pytest.raises(PublisherError):
        KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID, manifest_interval=9)
    with pytest.raises(kvsp.KvspError):
        KvcsPublisher({**cd, "layers": 0}, SCOPE_KEY, VEC_TOKENS, PUB_ID)
    only_kv = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID, offer=[TrackOffer("kv", "raw")])
    assert only_kv.track_names == ("manifest", "kv.raw.s0")


def test_manifest_interval_eviction_and_digest_listing() -> None:
    cd = make_cd(5)
    pub = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID, manifest_interval=2)
    store = pub.store("manifest")
    assert store is not None
    seen: list[tuple[int, bytes]] = []
    store.subscribe_listener(
        lambda o: (
            seen.append((o.group_id, o.payload_bytes()))
            if o.status is ObjectStatus.NORMAL
            else None
        )
    )
    for layer in range(5):
        pub.put_layer(layer, *layer_sections(cd, layer, range(2)), now=0.0)
    # after layers 2 and 4 (two completed each), at completion (layer 5)
    assert pub.manifest_versions == 4 and [g for g, _ in seen] == [1, 2, 3]
    listed = [parse_manifest(m).segments[0].completed_groups("k.raw.s0") for _, m in seen]
    assert listed == [2, 4, 5]
    # superseded versions are evicted: a late joiner's fill gets the latest only
    assert store.group_ids() == (3,) and len(store) == 1  # Object 0 only (no End of Group)
    rig = Rig(pub)
    rid = rig.subscribe_manifest("manifest")
    rig.settle()
    assert [g for g, _ in received_manifests(rig, rid)] == [3]

    bare = KvcsPublisher(cd, SCOPE_KEY, VEC_TOKENS, PUB_ID, list_digests=False)
    bare.put_layer(0, *layer_sections(cd, 0, range(2)), now=0.0)
    assert bare.manifest.segments[0].object_digests is None
    assert b"object_digests" not in bare.manifest.encode()
