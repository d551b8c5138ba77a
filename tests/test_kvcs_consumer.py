"""KvcsConsumer over the loopback (profile 5.1 to 5.4).

A small publication fixture is built here from TrackStores, ``build_payload_parts``
and the manifest/COSE modules, and served by the auto-answering server of
``session_pair.Pair``; several Pairs can share one network (one clock) so that a
consumer can be attached to sessions to several servers. The consumer is fed by
a network callback and its timers are fired by :meth:`Harness.drive`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from session_pair import Pair

from kvcs_core.kvcs import _verify
from kvcs_core.kvcs._index_serving import IndexAnnouncer
from kvcs_core.kvcs._production import ManifestSigner
from kvcs_core.kvcs.consumer import (
    ConsumerConfig,
    DiscardReason,
    IndexLookupDone,
    IndexOptions,
    IndexSearchDone,
    KvcsConsumer,
    LayerReady,
    ManifestAccepted,
    ManifestRejectReason,
    ObjectDiscarded,
    PublicationRejected,
    PublicationSelected,
    RecomputeNeeded,
    RecomputeReason,
    RetrievalComplete,
    RetrievalMode,
    TrackSelection,
)
from kvcs_core.kvcs.cose import sign_manifest
from kvcs_core.kvcs.manifest import Manifest, Segment
from kvcs_core.kvcs.names import MANIFEST_COSE_TRACK, MANIFEST_TRACK, Component, KvcsNamespace
from kvcs_core.kvcs.payload import (
    _HEADER,
    HEADER_LEN,
    ObjectRejectReason,
    build_payload_parts,
    data_digest,
)
from kvcs_core.kvsp.codecs import Codec, encode_kv, encoded_size
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.kvsp.keys import block_keys, block_keys_sha256, scope_id
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import EndOfRange, LocationFilterType, ObjectStatus, ParameterType
from kvcs_core.wire.names import Location

L = 4
B = 4
CD = {
    "kvsp": 0,
    "model": "test/consumer@1",
    "layers": L,
    "kv_heads": 2,
    "head_dim": 4,
    "dtype": "float16",
    "block_tokens": B,
}
SECTION = 2 * B * 4 * 2  # kv_heads * block_tokens * head_dim * itemsize
SCOPE_KEY = bytes(range(32))
TOKENS = list(range(100, 100 + 4 * B + 2))  # 4 full blocks and a partial tail
PRODUCER = Ed25519PrivateKey.from_private_bytes(b"\x11" * 32)
KID = b"producer-1"
KEYS = {KID: PRODUCER.public_key()}
PUB_A = b"\xaa" * 16
PUB_B = b"\xbb" * 16
KV = (Component.K, Component.V)


class Fixture:
    """The original publisher of one publication: a manifest store and k/v raw stores.

    ``corrupt``: Objects whose stored Data no longer matches their header digest;
    ``forge``: Objects whose Data and header agree but differ from what the manifest
    lists (a relay that rewrites content).
    """

    def __init__(
        self,
        *,
        blocks: int = 4,
        pub_id: bytes = PUB_A,
        signed: bool = True,
        signing_key: Ed25519PrivateKey = PRODUCER,
        deterministic: bool = False,
        tag: bytes = b"A",
        tokens: Sequence[int] = TOKENS,
        corrupt: Sequence[tuple[Component, int, int]] = (),
        forge: Sequence[tuple[Component, int, int]] = (),
        misfit: str = "",
        list_digests: bool = True,
    ) -> None:
        self.cd = CompatibilityDescriptor(CD)
        self.keys = block_keys(SCOPE_KEY, self.cd, tokens)[:blocks]
        self.blocks = blocks
        self.ns = KvcsNamespace(scope_id(SCOPE_KEY), self.cd.compat_id, self.keys[-1], pub_id)
        self.signed = signed
        self.signing_key = signing_key
        self.deterministic = deterministic
        self.tag = tag
        self.corrupt = set(corrupt)
        self.forge = set(forge)
        self.misfit = misfit
        self.list_digests = list_digests
        """A manifest wrong in one way: tamper, compat, block-keys or tracks."""
        self.tracks = ("k.raw.s0", "v.raw.s0")
        name = MANIFEST_COSE_TRACK if signed else MANIFEST_TRACK
        self.manifest_store = TrackStore(self.ns.full_track_name(name))
        self.stores = {t: TrackStore(self.ns.full_track_name(t)) for t in self.tracks}
        self.digests: dict[str, list[list[str]]] = {t: [] for t in self.tracks}
        self.produced = 0
        self.version = 0
        self.produce_times: list[float] = []
        self.publish_manifest()

    @staticmethod
    def component(track: str) -> Component:
        return Component.K if track.startswith("k.") else Component.V

    def data(self, comp: Component, layer: int, block: int) -> bytes:
        seed = hashlib.sha256(b"%s|%d|%d|%d" % (self.tag, comp, layer, block)).digest()
        return (seed * (SECTION // 32))[:SECTION]

    def produce_layer(self, now: float = 0.0, *, manifest: bool = True) -> None:
        layer = self.produced
        for track in self.tracks:
            comp = self.component(track)
            store = self.stores[track]
            row = []
            for b in range(self.blocks):
                good = self.data(comp, layer, b)
                row.append(data_digest(good).hex())
                payload = good
                if (comp, layer, b) in self.corrupt or (comp, layer, b) in self.forge:
                    payload = bytes([good[0] ^ 0xFF]) + good[1:]
                signed_data = payload if (comp, layer, b) in self.forge else good
                head, _ = build_payload_parts(
                    component=comp,
                    layer=layer,
                    block_index=b,
                    token_start=b * B,
                    token_count=B,
                    codec=0,
                    data=signed_data,
                )
                store.append(layer, b, payload, head=head, publisher_priority=128 * layer // L)
            store.append(layer, self.blocks, status=ObjectStatus.END_OF_GROUP)
            self.digests[track].append(row)
        self.produced += 1
        self.produce_times.append(now)
        if self.produced == L:
            for store in self.stores.values():
                store.append(L, 0, status=ObjectStatus.END_OF_TRACK)
        if manifest:
            self.publish_manifest()

    def produce_all(self) -> Fixture:
        while self.produced < L:
            self.produce_layer()
        return self

    def manifest(self) -> Manifest:
        keys_hex = block_keys_sha256(self.keys, 0, self.blocks)
        if self.misfit == "block-keys":
            keys_hex = hashlib.sha256(b"other tokens").hexdigest()
        tracks: tuple[str, ...] = self.tracks
        if self.misfit == "tracks":
            tracks = ("kv.raw.s0",)
        seg = Segment(
            segment=0,
            first_block=0,
            blocks=self.blocks,
            block_keys_sha256=keys_hex,
            tracks=tracks,
            complete=self.produced == L,
            object_digests=(
                None if self.misfit == "tracks" or not self.list_digests else dict(self.digests)
            ),
        )
        compat = dict(CD, model="test/other@1") if self.misfit == "compat" else CD
        return Manifest(
            compat=compat,
            layers=L,
            block_tokens=B,
            deterministic=self.deterministic,
            segments=[seg],
        )

    def publish_manifest(self) -> None:
        body = self.manifest().encode()
        payload = sign_manifest(body, self.signing_key, KID) if self.signed else body
        if self.misfit == "tamper":  # same length, valid JSON, broken signature
            payload = payload.replace(b'"deterministic":false', b'"deterministic":true ')
        self.manifest_store.append(self.version, 0, payload, publisher_priority=0)
        self.manifest_store.append(self.version, 1, status=ObjectStatus.END_OF_GROUP)
        self.version += 1

    def serve(self, pair: Pair) -> Fixture:
        pair.serve(self.manifest_store)
        for store in self.stores.values():
            pair.serve(store)
        return self


def join(
    pair: Pair,
    *,
    latency: float = 0.005,
    bandwidth: float | None = None,
    server_config: SessionConfig | None = None,
    start: bool = True,
) -> Pair:
    """Another client/server Pair on ``pair``'s network (one clock for the consumer)."""
    other = Pair.__new__(Pair)
    other.net = pair.net
    other.cli = MoqtSession(SessionConfig(role=Role.CLIENT))
    other.srv = MoqtSession(server_config or SessionConfig(role=Role.SERVER))
    other.link = pair.net.connect(other.cli, other.srv, latency=latency, bandwidth=bandwidth)
    other.stores = {}
    other.namespaces = []
    other.auto_accept = True
    pair.net.on_event(other._on_event)
    if start:
        start_pair(other)
    return other


def start_pair(pair: Pair) -> None:
    """Send both SETUPs and run until they are exchanged."""
    pair.cli.start(now=pair.net.now)
    pair.srv.start(now=pair.net.now)
    pair.net.poke(pair.cli)
    pair.net.poke(pair.srv)
    pair.net.run_until(lambda: pair.cli.setup_complete and pair.srv.setup_complete, max_time=5)


class Harness:
    """Feeds a consumer the events of its client sessions and fires its timers."""

    def __init__(self, consumer: KvcsConsumer, *pairs: Pair) -> None:
        self.consumer = consumer
        self.net = pairs[0].net
        self.pairs = pairs
        self.clients = [pr.cli for pr in pairs]
        self.events: list[tuple[float, Any]] = []
        self.consumed: list[Any] = []
        self.net.on_event(self._on_event)
        for cli in self.clients:
            consumer.attach(cli, now=self.net.now)
        self.pump()

    def _on_event(self, machine: Any, e: Any) -> None:
        if any(machine is c for c in self.clients):
            if self.consumer.handle_session_event(machine, e, self.net.now):
                self.consumed.append(e)
            self.pump()

    def pump(self) -> None:
        while (e := self.consumer.next_event()) is not None:
            self.events.append((self.net.now, e))

    def of(self, kind: type) -> list[Any]:
        return [e for _, e in self.events if isinstance(e, kind)]

    def at(self, kind: type) -> list[float]:
        return [t for t, e in self.events if isinstance(e, kind)]

    def _advance(self, limit: float, until: Callable[[], bool]) -> bool:
        self.net.run_for(0)  # drain commands issued outside the loop (attach, add_publication)
        for _ in range(200_000):
            if until():
                return True
            tc, tn = self.consumer.get_timer(), self.net.next_time()
            nxt = min((t for t in (tc, tn) if t is not None), default=None)
            if nxt is None or nxt > limit:
                return False
            if tc is not None and (tn is None or tc <= tn):
                if tc > self.net.now:
                    self.net.run_for(tc - self.net.now)
                self.consumer.handle_timer(self.net.now)
                self.pump()
                self.net.run_for(0)
            else:
                self.net.step()
        raise AssertionError("too many steps")

    def drive(self, until: Callable[[], bool], max_time: float = 20.0) -> None:
        if not self._advance(self.net.now + max_time, until):
            raise AssertionError(f"not reached by t={self.net.now:.3f}; events {self.events}")

    def run_for(self, duration: float) -> None:
        target = self.net.now + duration
        self._advance(target, lambda: False)
        if target > self.net.now:
            self.net.run_for(target - self.net.now)

    def finish(self, max_time: float = 20.0) -> RetrievalComplete:
        self.drive(lambda: self.consumer.done, max_time)
        done = self.of(RetrievalComplete)
        assert len(done) == 1
        return done[0]


def consumer(tokens: Sequence[int] = TOKENS, **kw: Any) -> KvcsConsumer:
    kw.setdefault("producer_keys", KEYS)
    return KvcsConsumer(CD, SCOPE_KEY, tokens, **kw)


def assert_all_data(
    c: KvcsConsumer, fx: Fixture, layers: range = range(L), blocks: int = 4
) -> None:
    for layer in layers:
        assert c.layer_ready(layer)
        for comp in KV:
            for b in range(blocks):
                view = c.data(layer, comp, b)
                assert view is not None and bytes(view) == fx.data(comp, layer, b)


def server_requests(pair: Pair, kind: type) -> list[Any]:
    return pair.events(pair.srv, kind)


# --- discovery -----------------------------------------------------------------------------


def test_discovery_prefers_the_longest_prefix() -> None:
    pair = Pair()
    long_fx = Fixture(blocks=4, pub_id=PUB_A).produce_all().serve(pair)
    Fixture(blocks=2, pub_id=PUB_B).produce_all().serve(pair)
    c = consumer()
    h = Harness(c, pair)
    done = h.finish()
    sel = h.of(PublicationSelected)
    assert [(s.publication_id, s.blocks, s.primary) for s in sel] == [(PUB_A, 4, True)]
    first_ns = server_requests(pair, ev.SubscribeNamespaceRequested)[0]
    assert first_ns.prefix.fields[3] == c.block_keys[3]  # Anchor Key of the longest prefix
    assert (done.publication_id, done.blocks, done.complete) == (PUB_A, 4, True)
    assert [e.layer for e in h.of(LayerReady)] == list(range(L))
    assert_all_data(c, long_fx)
    # every request was closed and nothing is pending
    assert c.get_timer() is None


def test_discovery_falls_back_to_a_shorter_prefix() -> None:
    pair = Pair()
    fx = Fixture(blocks=2, pub_id=PUB_B).produce_all().serve(pair)
    cfg = ConsumerConfig(discovery_timeout=0.2)
    c = consumer(config=cfg)
    h = Harness(c, pair)
    done = h.finish()
    anchors = [e.prefix.fields[3] for e in server_requests(pair, ev.SubscribeNamespaceRequested)]
    assert anchors[:2] == [c.block_keys[3], c.block_keys[1]]  # prefixes 4, then 2
    sel = h.of(PublicationSelected)[0]
    assert (sel.publication_id, sel.blocks) == (PUB_B, 2)
    assert h.at(PublicationSelected)[0] >= cfg.discovery_timeout
    assert (done.blocks, done.complete) == (2, True)
    assert_all_data(c, fx, blocks=2)


@pytest.mark.parametrize("one_way", [0.005, 0.4])
def test_direct_discovery_waits_for_the_relays_answer_not_a_round_trip(one_way: float) -> None:
    """Profile 5.1: the whole prompt is published. With a one-way delay of 0.4 s the
    relay's answer to SUBSCRIBE_NAMESPACE and its NAMESPACE come 0.8 s after the request,
    later than ``discovery_timeout`` (0.5 s): the consumer still waits for them and takes
    the publication on the first prefix it asks, with no shorter prefix and no index
    lookup. (Counted from the request, the prefix was given up at 0.5 s: the index search
    and the shorter prefixes were asked first.)"""
    pair = Pair(latency=one_way)
    fx = Fixture(blocks=4, pub_id=PUB_A).produce_all().serve(pair)
    cfg = ConsumerConfig()
    assert 2 * one_way > cfg.discovery_timeout or one_way < 0.1
    c = consumer(config=cfg, index=IndexOptions())
    h = Harness(c, pair)
    done = h.finish()
    asked = server_requests(pair, ev.SubscribeNamespaceRequested)
    assert [e.prefix.fields[0] for e in asked] == [b"kvcs-1"]  # the whole prompt only
    assert c.index_lookups == 0
    sel = h.of(PublicationSelected)
    assert [(e.publication_id, e.blocks) for e in sel] == [(PUB_A, 4)]
    assert h.at(PublicationSelected)[0] >= 2 * one_way
    assert (done.blocks, done.complete) == (4, True)
    assert_all_data(c, fx)


def test_an_unanswered_discovery_request_is_bounded_by_the_answer_timeout() -> None:
    """A server that never answers SUBSCRIBE_NAMESPACE: each direct prefix (4, 2, 1) is
    given up ``discovery_answer_timeout`` after its request, then recompute."""
    pair = Pair()
    cfg = ConsumerConfig(discovery_timeout=0.1, discovery_answer_timeout=0.7)
    c = consumer(config=cfg, index=None)
    pair.auto_accept = False
    h = Harness(c, pair)
    done = h.finish()
    assert (done.blocks, done.complete) == (0, False)
    assert len(server_requests(pair, ev.SubscribeNamespaceRequested)) == 3
    (t,) = h.at(RecomputeNeeded)
    assert 3 * 0.7 <= t < 3 * 0.7 + 0.1
    with pytest.raises(ValueError):
        ConsumerConfig(discovery_answer_timeout=0)


def test_no_publication_means_recompute() -> None:
    pair = Pair()
    c = consumer(config=ConsumerConfig(discovery_timeout=0.1))
    h = Harness(c, pair)
    done = h.finish()
    need = h.of(RecomputeNeeded)
    assert len(need) == 1 and need[0].reason is RecomputeReason.NO_PUBLICATION
    assert need[0].blocks == (0, 1, 2, 3) and need[0].layers == tuple(range(L))
    assert (done.publication_id, done.blocks, done.complete) == (None, 0, False)
    asked = [e.prefix.fields[0] for e in server_requests(pair, ev.SubscribeNamespaceRequested)]
    assert asked.count(b"kvcs-1") == 3  # direct prefixes 4, 2, 1
    # and the KVSP index (binding 9): a bitwise binary search over 1..4 that finds nothing
    assert asked.count(b"kvcs-idx-1") == c.index_lookups == 3  # lengths 4, 2, then 1
    assert c.index_shared_blocks == 0


def served_index(pair: Pair, fx: Fixture) -> None:
    """The fixture's signed KVSP index records (every prefix length), on ``pair``'s server."""
    announcer = IndexAnnouncer(
        fx.ns, fx.keys, stride=1, signer=ManifestSigner(key=PRODUCER, kid=KID)
    )
    for ns in announcer.namespaces:
        pair.serve(announcer._stores[ns])


@pytest.mark.parametrize("one_way", [0.005, 0.4])
def test_an_index_lookup_waits_for_the_relays_answer_not_a_round_trip(one_way: float) -> None:
    """Binding 9: a publication shares our first 2 blocks only (its prompt then differs),
    so direct discovery of the whole prompt finds nothing and the index search finds it.
    With a one-way delay of 0.4 s every answer comes 0.8 s after its request, longer than
    the lookup ``timeout`` (0.3 s): the lookups still wait for the relay's answers
    (``answer_timeout``) and conclude from them, and the same 2 blocks are found."""
    pair = Pair(latency=one_way)
    other = [*TOKENS[: 2 * B], *range(900, 900 + 2 * B)]
    fx = Fixture(blocks=4, pub_id=PUB_B, tokens=other).produce_all().serve(pair)
    served_index(pair, fx)
    opts = IndexOptions()
    assert 2 * one_way < opts.answer_timeout
    c = consumer(config=ConsumerConfig(discovery_timeout=max(0.1, 4 * one_way)), index=opts)
    h = Harness(c, pair)
    done = h.finish()
    lookups = [(e.length, e.shared) for e in h.of(IndexLookupDone)]
    assert lookups == [(4, False), (2, True), (3, False)]  # bit by bit over 1..4
    assert c.index_shared_blocks == 2
    sel = h.of(PublicationSelected)[0]
    assert (sel.publication_id, sel.blocks) == (PUB_B, 2)
    assert (done.blocks, done.complete) == (2, True)
    assert_all_data(c, fx, blocks=2)
    # "not shared" (length 3: the server answers, no NAMESPACE follows) is concluded
    # ``timeout`` after the answer, not ``answer_timeout`` after the request
    _, found, missed = h.at(IndexLookupDone)
    assert missed - found <= 2 * (2 * one_way) + opts.timeout + 0.05


def test_an_unanswered_index_lookup_is_bounded_by_the_answer_timeout() -> None:
    """A server that never answers SUBSCRIBE_NAMESPACE: each lookup is concluded "not
    shared" ``answer_timeout`` after its request, and the search ends (recompute)."""
    pair = Pair()
    c = consumer(
        config=ConsumerConfig(discovery_timeout=0.1),
        index=IndexOptions(timeout=0.2, answer_timeout=0.7),
    )
    h = Harness(c, pair)
    pair.auto_accept = False  # the server answers nothing from here on
    done = h.finish()
    assert (done.blocks, done.complete) == (0, False)
    lookups = h.at(IndexLookupDone)
    assert [e.shared for e in h.of(IndexLookupDone)] == [False, False, False]
    assert lookups[1] - lookups[0] >= 0.7


def test_an_index_stride_longer_than_the_prompt_makes_no_lookup() -> None:
    pair = Pair()
    cfg = ConsumerConfig(discovery_timeout=0.1)
    c = consumer(config=cfg, index=IndexOptions(stride=8))  # 4 blocks: no multiple of 8
    h = Harness(c, pair)
    done = h.finish()
    assert (done.blocks, done.complete) == (0, False)
    asked = [e.prefix.fields[0] for e in server_requests(pair, ev.SubscribeNamespaceRequested)]
    assert asked == [b"kvcs-1"] * 3 and c.index_lookups == 0
    assert [e.lookups for e in h.of(IndexSearchDone)] == [0]
    # the shorter direct prefixes still got their discovery_timeout
    assert h.at(RecomputeNeeded)[0] >= 2 * cfg.discovery_timeout


# --- manifests -----------------------------------------------------------------------------


def test_manifest_cose_is_verified() -> None:
    pair = Pair()
    Fixture().produce_all().serve(pair)
    c = consumer()
    h = Harness(c, pair)
    h.finish()
    acc = h.of(ManifestAccepted)
    assert acc and acc[0].authenticated and acc[0].complete and acc[0].publication_id == PUB_A
    names = [e.track.name for e in server_requests(pair, ev.SubscribeRequested)]
    assert names[0] == b"manifest.cose"
    sub = server_requests(pair, ev.SubscribeRequested)[0]
    assert sub.params.get(p.LocationFilter).filter_type is LocationFilterType.NEXT_OBJECT
    inner = sub.params.get(p.FillParameters).params.get(p.LocationFilter)
    assert inner == p.LocationFilter.relative_start(1)


@pytest.mark.parametrize("how", ["wrong-key", "unsigned"])
def test_unauthentic_manifest_is_refused_when_authenticity_is_required(how: str) -> None:
    pair = Pair()
    if how == "wrong-key":
        rogue = Ed25519PrivateKey.from_private_bytes(b"\x22" * 32)
        Fixture(signing_key=rogue).produce_all().serve(pair)
    else:
        Fixture(signed=False).produce_all().serve(pair)
    c = consumer(config=ConsumerConfig(discovery_timeout=0.1))
    h = Harness(c, pair)
    done = h.finish()
    rej = h.of(PublicationRejected)
    want = (
        ManifestRejectReason.BAD_SIGNATURE
        if how == "wrong-key"
        else (ManifestRejectReason.UNSIGNED)
    )
    assert [(r.publication_id, r.reason) for r in rej] == [(PUB_A, want)]
    assert not h.of(ManifestAccepted) and not h.of(LayerReady)
    assert h.of(RecomputeNeeded)[0].reason is RecomputeReason.NO_PUBLICATION
    assert not done.complete
    names = [e.track.name for e in server_requests(pair, ev.SubscribeRequested)]
    assert b"manifest" not in names  # the unsigned track is never asked for


@pytest.mark.parametrize(
    ("misfit", "reason"),
    [
        ("tamper", ManifestRejectReason.BAD_SIGNATURE),
        ("compat", ManifestRejectReason.COMPAT_MISMATCH),
        ("block-keys", ManifestRejectReason.BLOCK_KEYS_MISMATCH),
        ("tracks", ManifestRejectReason.MISSING_TRACKS),
    ],
)
def test_manifest_that_does_not_verify_or_fit_rejects_the_publication(
    misfit: str, reason: ManifestRejectReason
) -> None:
    pair = Pair()
    Fixture(misfit=misfit).produce_all().serve(pair)
    c = consumer(config=ConsumerConfig(discovery_timeout=0.1))
    h = Harness(c, pair)
    done = h.finish()
    assert [(r.publication_id, r.reason) for r in h.of(PublicationRejected)] == [(PUB_A, reason)]
    assert not h.of(ManifestAccepted) and not done.complete
    assert not server_requests(pair, ev.FetchRequested)  # no data of it was asked for


def test_plain_manifest_is_accepted_when_authenticity_is_not_required() -> None:
    pair = Pair()
    fx = Fixture(signed=False).produce_all().serve(pair)
    c = consumer(producer_keys=None, require_authenticity=False)
    h = Harness(c, pair)
    done = h.finish()
    names = [e.track.name for e in server_requests(pair, ev.SubscribeRequested)][:2]
    assert names == [b"manifest.cose", b"manifest"]
    acc = h.of(ManifestAccepted)[0]
    assert not acc.authenticated
    assert done.complete
    assert_all_data(c, fx)


# --- live retrieval ------------------------------------------------------------------------


def test_live_retrieval_while_the_publisher_produces_layers() -> None:
    pair = Pair()
    fx = Fixture().serve(pair)
    fx.produce_layer(pair.now)  # layer 0 exists before the consumer subscribes: the fill
    c = consumer()
    h = Harness(c, pair)
    h.drive(lambda: c.manifest is not None)
    for _ in range(1, L):
        h.run_for(0.05)
        fx.produce_layer(pair.now)
    done = h.finish()
    assert done.complete
    ready = h.of(LayerReady)
    assert [e.layer for e in ready] == list(range(L))
    assert h.at(LayerReady)[0] < fx.produce_times[-1], "layer 0 must be usable before the last"
    assert_all_data(c, fx)
    data_subs = [
        e
        for e in server_requests(pair, ev.SubscribeRequested)
        if e.track.name.startswith((b"k.", b"v."))
    ]
    assert sorted(e.track.name for e in data_subs) == [b"k.raw.s0", b"v.raw.s0"]
    for sub in data_subs:  # the exactly-once pattern of profile 5.2
        assert sub.params.get(p.LocationFilter) == p.LocationFilter.next_object()
        inner = sub.params.get(p.FillParameters).params.get(p.LocationFilter)
        assert inner == p.LocationFilter.absolute_start(0, 0)
    assert not server_requests(pair, ev.FetchRequested)
    assert c.excess_objects == 0
    assert len(h.of(ManifestAccepted)) >= 2  # later versions arrived on the subscription


# --- completed retrieval -------------------------------------------------------------------


def diverging_tokens(shared_blocks: int) -> list[int]:
    return TOKENS[: shared_blocks * B] + [7] * B  # block `shared_blocks` differs


@pytest.mark.parametrize("filters", [16, 0])
def test_completed_retrieval_fetches_layers_a_to_b(filters: int) -> None:
    pair = Pair(server_config=SessionConfig(role=Role.SERVER, max_filter_ranges=filters))
    fx = Fixture(blocks=4).produce_all().serve(pair)
    tokens = diverging_tokens(3)
    c = consumer(tokens, layers=range(1, 3))
    h = Harness(c, pair)
    c.add_publication(fx.ns.to_track_namespace(), blocks=3, now=pair.now)  # a KVSP index hit
    done = h.finish()
    assert (done.publication_id, done.blocks, done.layers, done.complete) == (
        PUB_A,
        3,
        range(1, 3),
        True,
    )
    fetches = server_requests(pair, ev.FetchRequested)
    assert sorted(f.track.name for f in fetches) == [b"k.raw.s0", b"v.raw.s0"]
    for f in fetches:
        assert f.params.get(p.LocationFilter) == p.LocationFilter.absolute_group_end(1, 0, 2)
        assert f.params.get(p.GroupOrderParam).order == 1  # ascending
        objid = [r for r in f.params.all(p.RangeFilter) if r.kind == ParameterType.OBJECTID_FILTER]
        if filters:
            assert [r.ranges for r in objid] == [((0, 2),)]
        else:
            assert objid == []
    assert_all_data(c, fx, layers=range(1, 3), blocks=3)
    assert not c.layer_ready(0) and not c.layer_ready(3)
    # without filters the 4th block of a layer came and was dropped quietly (the FETCH
    # is cancelled once everything needed is verified, so the last one may not come)
    assert (c.excess_objects > 0) == (not filters)
    assert not h.of(ObjectDiscarded)


# --- verification and recovery --------------------------------------------------------------


def test_corrupted_object_is_discarded_with_a_reason_then_recomputed() -> None:
    pair = Pair()
    Fixture(corrupt=[(Component.K, 1, 2)]).produce_all().serve(pair)
    c = consumer(recovery_time_bound=0.5)
    h = Harness(c, pair)
    done = h.finish()
    bad = h.of(ObjectDiscarded)
    assert [(b.reason, b.check, b.track, b.layer, b.block) for b in bad] == [
        (DiscardReason.PAYLOAD_CHECK, ObjectRejectReason.DIGEST_MISMATCH, "k.raw.s0", 1, 2)
    ]
    need = h.of(RecomputeNeeded)
    assert [(n.reason, n.layers, n.blocks) for n in need] == [
        (RecomputeReason.RECOVERY_TIMEOUT, (1,), (2,))
    ]
    assert [e.layer for e in h.of(LayerReady)] == [0, 2, 3]
    assert c.data(1, Component.K, 2) is None
    assert not done.complete


def test_forged_object_is_discarded_and_recovered_from_another_relay() -> None:
    pair = Pair()
    bad_relay = Fixture(forge=[(Component.V, 2, 1)]).produce_all().serve(pair)
    other = join(pair)
    good = Fixture().produce_all().serve(other)
    same = [fx.manifest_store.get(Location(L, 0)) for fx in (bad_relay, good)]
    assert same[0] is not None and same[1] is not None
    assert same[0].payload_bytes() == same[1].payload_bytes()  # the same publication
    c = consumer()
    h = Harness(c, pair, other)
    done = h.finish()
    bad = h.of(ObjectDiscarded)
    assert [(b.check, b.layer, b.block, b.session) for b in bad] == [
        (ObjectRejectReason.LISTED_DIGEST_MISMATCH, 2, 1, 0)
    ]
    assert done.complete and not h.of(RecomputeNeeded)
    assert_all_data(c, good)


@pytest.mark.parametrize("how", ["authenticated", "hold-unauthenticated", "unauthenticated"])
def test_digest_listed_after_verification_is_checked_then(how: str) -> None:
    """Live: a relay's forged Object verifies on its own; the next manifest version lists
    the producer's digest, the Object is discarded and recovered from the other relay.

    With a producer key required (the default of ``consumer()``) the Objects are held
    until a verified version lists them, whatever ``hold_until_listed`` says: the
    forgery is never reported usable (issue 10 finding 4)."""
    hold = how != "unauthenticated"
    pair = Pair()
    bad = Fixture(forge=[(Component.V, 1, 2)]).serve(pair)
    other = join(pair)
    good = Fixture().serve(other)
    both = (bad, good)
    for fx in both:
        fx.produce_layer(pair.now)
    if how == "authenticated":
        c = consumer(require_authenticity=True, config=ConsumerConfig(hold_until_listed=False))
    else:
        c = consumer(
            producer_keys=None,
            require_authenticity=False,
            config=ConsumerConfig(hold_until_listed=hold),
        )
    h = Harness(c, pair, other)
    h.drive(lambda: c.manifest is not None and len(other.events(other.cli, ev.NamespaceAnnounced)))
    for _ in range(1, L):
        for fx in both:
            fx.produce_layer(pair.now, manifest=False)  # data first, its digests later
        h.run_for(0.05)
        for fx in both:
            fx.publish_manifest()
        h.run_for(0.05)
    done = h.finish()
    assert done.complete and not h.of(RecomputeNeeded)
    assert_all_data(c, good)
    bad_events = h.of(ObjectDiscarded)
    assert [(b.reason, b.check, b.track, b.layer, b.block, b.session) for b in bad_events] == [
        (DiscardReason.LISTED_DIGEST_MISMATCH, None, "v.raw.s0", 1, 2, 0)
    ]
    ready = [e.layer for e in h.of(LayerReady)]
    # without holding, layer 1 was ready (forged), then not, then ready again (recovered)
    assert ready.count(1) == (1 if hold else 2)
    assert sorted(set(ready)) == list(range(L))
    if hold:  # nothing is usable before a manifest version lists its digest
        accepted = [(t, e.version) for t, e in h.events if isinstance(e, ManifestAccepted)]
        for t, e in h.events:
            if isinstance(e, LayerReady):
                assert any(v >= e.layer + 1 and ta <= t for ta, v in accepted)


@pytest.mark.parametrize("authenticated", [True, False])
def test_a_signed_manifest_that_lists_no_digests_authenticates_no_object(
    authenticated: bool,
) -> None:
    """A complete segment whose verified manifest lists no ``object_digests``: with a
    producer key, no Object can be shown to be the producer's, so none is usable
    (NOT_LISTED, then recompute); without one, the Data Digests are all there is."""
    pair = Pair()
    fx = Fixture(list_digests=False).produce_all().serve(pair)
    if authenticated:
        c = consumer(recovery_time_bound=0.5)
    else:
        c = consumer(producer_keys=None, require_authenticity=False, recovery_time_bound=0.5)
    h = Harness(c, pair)
    done = h.finish()
    if not authenticated:
        assert done.complete and not h.of(ObjectDiscarded)
        assert_all_data(c, fx)
        return
    assert not done.complete and not h.of(LayerReady)
    reasons = {e.reason for e in h.of(ObjectDiscarded)}
    assert reasons == {DiscardReason.NOT_LISTED}
    need = h.of(RecomputeNeeded)
    assert len(need) == 1 and need[0].layers == tuple(range(L))


def test_live_subscription_after_production_completes_with_the_fill() -> None:
    """Profile 5.2's third rule: fill FIN + complete manifest (no End of Track is seen)."""
    pair = Pair()
    fx = Fixture().produce_all().serve(pair)
    c = consumer(config=ConsumerConfig(retrieval=RetrievalMode.LIVE))
    h = Harness(c, pair)
    done = h.finish()
    assert done.complete
    assert_all_data(c, fx)
    assert not server_requests(pair, ev.FetchRequested)
    h.run_for(0.05)  # let the cancellations reach the server
    subs = [
        e.request_id
        for e in server_requests(pair, ev.SubscribeRequested)
        if e.track.name.startswith((b"k.", b"v."))
    ]
    cancelled = {e.request_id for e in server_requests(pair, ev.RequestCancelled)}
    assert len(subs) == 2 and set(subs) <= cancelled  # closed once nothing more was needed


def test_a_stalled_publication_is_bounded_by_the_stall_and_recovery_timeouts() -> None:
    pair = Pair()
    fx = Fixture().serve(pair)
    fx.produce_layer(pair.now)
    c = consumer(recovery_time_bound=1.0, config=ConsumerConfig(stall_timeout=2.0))
    h = Harness(c, pair)
    h.drive(lambda: c.manifest is not None)
    h.run_for(0.05)
    fx.produce_layer(pair.now)  # then the producer dies silently
    h.drive(lambda: c.layer_ready(1))
    last = pair.now
    done = h.finish()
    need = h.of(RecomputeNeeded)
    assert [(n.reason, n.layers, n.blocks) for n in need] == [
        (RecomputeReason.RECOVERY_TIMEOUT, (2, 3), (0, 1, 2, 3))
    ]
    assert h.at(RecomputeNeeded)[0] <= last + 2.0 + 1.0 + 0.01
    assert not done.complete and c.layer_ready(0) and c.layer_ready(1)


def test_recovery_from_a_cut_link_on_a_second_session() -> None:
    pair = Pair(bandwidth=20_000)
    fx = Fixture().produce_all().serve(pair)
    other = join(pair, bandwidth=20_000)
    Fixture().produce_all().serve(other)
    c = consumer()
    h = Harness(c, pair, other)
    h.drive(lambda: len(h.of(LayerReady)) >= 1)
    assert not c.done
    cut_at = pair.now
    pair.link.cut()
    done = h.finish()
    assert done.complete and not h.of(RecomputeNeeded)
    assert_all_data(c, fx)
    late = [e for e in server_requests(other, ev.FetchRequested)]
    assert late, "the second session served the rest"
    assert h.at(RetrievalComplete)[0] > cut_at


def test_recompute_needed_after_the_time_bound_when_nothing_can_serve() -> None:
    pair = Pair(bandwidth=20_000)
    Fixture().produce_all().serve(pair)
    c = consumer(recovery_time_bound=1.5)
    h = Harness(c, pair)
    h.drive(lambda: len(h.of(LayerReady)) >= 1)
    ready_before = {e.layer for e in h.of(LayerReady)}
    cut_at = pair.now
    pair.link.cut()
    done = h.finish()
    need = h.of(RecomputeNeeded)
    assert len(need) == 1 and need[0].reason is RecomputeReason.RECOVERY_TIMEOUT
    assert h.at(RecomputeNeeded)[0] == pytest.approx(cut_at + 1.5)
    assert set(need[0].layers) == set(range(L)) - ready_before
    assert need[0].blocks
    assert not done.complete and done.publication_id == PUB_A


@pytest.mark.parametrize("deterministic", [False, True])
def test_publications_are_mixed_only_when_both_are_deterministic(deterministic: bool) -> None:
    pair = Pair(bandwidth=20_000)
    tag_b = b"A" if deterministic else b"B"  # deterministic publications are bit-identical
    fx_a = Fixture(pub_id=PUB_A, deterministic=deterministic).produce_all().serve(pair)
    other = join(pair, latency=0.05, bandwidth=20_000)
    Fixture(pub_id=PUB_B, deterministic=deterministic, tag=tag_b).produce_all().serve(other)
    c = consumer(recovery_time_bound=1.0)
    h = Harness(c, pair, other)
    h.drive(lambda: len(h.of(LayerReady)) >= 1)
    assert h.of(PublicationSelected)[0].publication_id == PUB_A
    pair.link.cut()
    done = h.finish()
    alt = [s for s in h.of(PublicationSelected) if not s.primary]
    assert [s.publication_id for s in alt] == [PUB_B]
    if deterministic:
        assert done.complete
        assert_all_data(c, fx_a)
    else:
        assert not done.complete
        assert h.of(RecomputeNeeded)[0].reason is RecomputeReason.RECOVERY_TIMEOUT
        assert not server_requests(other, ev.FetchRequested)  # B's data was never asked for


def test_unknown_range_marker_makes_objects_missing_and_they_are_recovered() -> None:
    """Synthetic fetch answer on session 0 (the loopback publisher never sends markers)."""
    pair = Pair()
    fx = Fixture().produce_all().serve(pair)
    other = join(pair, latency=0.02)
    Fixture().produce_all().serve(other)
    c = consumer(config=ConsumerConfig(retrieval=RetrievalMode.COMPLETED))
    h = Harness(c, pair, other)
    h.drive(lambda: c.manifest is not None)
    pair.auto_accept = False  # from now on session 0's FETCHes are answered by hand
    h.drive(lambda: len(other.events(other.cli, ev.NamespaceAnnounced)) == 1)
    h.drive(lambda: len(server_requests(pair, ev.FetchRequested)) == 2)
    now = pair.now
    for f in server_requests(pair, ev.FetchRequested):
        comp = Fixture.component(f.track.name.decode())
        rid = f.request_id
        feed = [
            ev.FetchAccepted(
                request_id=rid, end_of_track=True, end_location=Location(3, 3), track_properties=()
            )
        ]
        for layer in range(L):
            for b in range(4):
                if layer == 1 and b >= 2:
                    continue
                head, view = build_payload_parts(
                    component=comp,
                    layer=layer,
                    block_index=b,
                    token_start=b * B,
                    token_count=B,
                    codec=0,
                    data=fx.data(comp, layer, b),
                )
                feed.append(
                    ev.ObjectReceived(
                        request_id=rid,
                        delivery=ev.Delivery.FETCH,
                        location=Location(layer, b),
                        subgroup_id=0,
                        publisher_priority=0,
                        status=ObjectStatus.NORMAL,
                        properties=(),
                        payload=memoryview(head + bytes(view)),
                        via_request_id=rid,
                    )
                )
            if layer == 1:
                feed.append(
                    ev.RangeMarkerReceived(
                        request_id=rid,
                        kind=EndOfRange.UNKNOWN,
                        location=Location(1, 3),
                        via_request_id=rid,
                    )
                )
        feed.append(
            ev.DataStreamEnded(
                request_id=rid,
                delivery=ev.Delivery.FETCH,
                via_request_id=rid,
                group_id=None,
                reset_code=None,
            )
        )
        for e in feed:
            assert c.handle_session_event(pair.cli, e, now)
        h.pump()
    done = h.finish()
    assert done.complete and not h.of(RecomputeNeeded)
    assert_all_data(c, fx)
    again = server_requests(other, ev.FetchRequested)  # the recovery, from layer 1 on
    assert [(f.track.name, f.params.get(p.LocationFilter)) for f in again] == [
        (b"k.raw.s0", p.LocationFilter.absolute_group_end(1, 0, 3)),
        (b"v.raw.s0", p.LocationFilter.absolute_group_end(1, 0, 3)),
    ]
    assert len(server_requests(pair, ev.FetchRequested)) == 2  # session 0 not asked again


def test_destination_buffers_are_filled_exactly() -> None:
    pair = Pair()
    fx = Fixture().produce_all().serve(pair)
    guard = b"\x5a" * 7
    bufs = {
        (layer, comp): bytearray(4 * SECTION) + bytearray(guard)
        for layer in range(L)
        for comp in KV
    }
    c = consumer(destinations=bufs)
    h = Harness(c, pair)
    assert h.finish().complete
    for (layer, comp), buf in bufs.items():
        want = b"".join(fx.data(comp, layer, b) for b in range(4))
        assert bytes(buf[: 4 * SECTION]) == want
        assert bytes(buf[4 * SECTION :]) == guard
    assert c.data(0, Component.K, 0) is None  # nothing else is kept


def test_unusable_destinations_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="need"):
        consumer(destinations=lambda layer, comp: bytearray(SECTION))
    with pytest.raises(ValueError, match="not writable"):
        consumer(destinations=lambda layer, comp: memoryview(bytes(4 * SECTION)))
    with pytest.raises(ValueError, match="no usable destination"):
        consumer(destinations={(0, Component.K): bytearray(4 * SECTION)})


def test_events_of_other_requests_are_not_consumed() -> None:
    pair = Pair()
    Fixture().produce_all().serve(pair)
    c = consumer()
    h = Harness(c, pair)
    rid = pair.cli.track_status(Fixture().stores["k.raw.s0"].name, now=pair.now)
    h.finish()
    mine = [e for e in pair.events(pair.cli) if getattr(e, "request_id", None) == rid]
    assert mine and not any(e in h.consumed for e in mine)
    assert all(getattr(e, "request_id", -1) != rid for e in h.consumed)


def test_constructor_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="full block"):
        consumer(TOKENS[: B - 1])
    with pytest.raises(ValueError, match="producer_keys"):
        consumer(producer_keys=None)
    with pytest.raises(ValueError, match="layers"):
        consumer(layers=range(2, 9))
    with pytest.raises(ValueError, match="max_objects"):
        consumer(config=ConsumerConfig(max_objects=10))


# --- end to end with KvcsPublisher -----------------------------------------------------------


def float16_section(seed: int) -> bytes:
    """A K or V section of valid float16 values (q8 needs finite numbers)."""
    n = SECTION // 2
    return struct.pack(f"<{n}e", *(((seed * 31 + i * 7) % 97 - 48) / 16 for i in range(n)))


def served_by_publisher(publisher: Any) -> Pair:
    pair = Pair()
    pair.auto_accept = False  # the publisher answers instead

    def on_event(machine: Any, e: Any) -> None:
        if machine is pair.srv:
            publisher.handle_session_event(pair.srv, e, pair.now)
        elif machine is pair.cli and isinstance(e, ev.PublishNamespaceRequested):
            pair.cli.accept_request(e.request_id, now=pair.now)

    pair.net.on_event(on_event)
    publisher.attach(pair.srv, now=pair.now)
    return pair


def sections(layer: int) -> tuple[list[bytes], list[bytes]]:
    return (
        [float16_section(1000 * layer + 10 * b + 1) for b in range(4)],
        [float16_section(1000 * layer + 10 * b + 2) for b in range(4)],
    )


def test_end_to_end_live_with_the_kvcs_publisher() -> None:
    publisher_mod = pytest.importorskip("kvcs_core.kvcs.publisher")
    pub = publisher_mod.KvcsPublisher(
        CD, SCOPE_KEY, TOKENS, PUB_A,
        signer=publisher_mod.ManifestSigner(PRODUCER, KID), manifest_interval=1,
    )  # fmt: skip
    pair = served_by_publisher(pub)
    pub.put_layer(0, *sections(0), now=pair.now)
    c = consumer()
    h = Harness(c, pair)
    h.drive(lambda: c.manifest is not None)
    put_times = []
    for layer in range(1, L):
        h.run_for(0.05)
        put_times.append(pair.now)
        pub.put_layer(layer, *sections(layer), now=pair.now)
    done = h.finish()
    assert done.complete and h.of(ManifestAccepted)[0].authenticated
    assert h.at(LayerReady)[0] < put_times[-1]
    for layer in range(L):
        ks, vs = sections(layer)
        for b in range(4):
            assert bytes(c.data(layer, Component.K, b) or b"") == ks[b]
            assert bytes(c.data(layer, Component.V, b) or b"") == vs[b]
    assert not h.of(ObjectDiscarded)


def test_end_to_end_completed_kv_q8_into_destinations() -> None:
    publisher_mod = pytest.importorskip("kvcs_core.kvcs.publisher")
    pub = publisher_mod.KvcsPublisher(
        CD, SCOPE_KEY, TOKENS, PUB_A,
        offer=publisher_mod.RAW_KV_WITH_KV_Q8,
        signer=publisher_mod.ManifestSigner(PRODUCER, KID),
    )  # fmt: skip
    for layer in range(L):
        pub.put_layer(layer, *sections(layer), now=0.0)
    pair = served_by_publisher(pub)
    cd = CompatibilityDescriptor(CD)
    obj_len = 2 * encoded_size(Codec.Q8, cd)
    bufs: dict[tuple[int, Component], bytearray] = {}

    def dest(layer: int, comp: Component) -> bytearray:
        return bufs.setdefault((layer, comp), bytearray(4 * obj_len))

    c = consumer(tracks=TrackSelection(codec="q8", joint=True), destinations=dest)
    h = Harness(c, pair)
    assert h.finish().complete
    assert sorted(e.track.name for e in server_requests(pair, ev.FetchRequested)) == [b"kv.q8.s0"]
    for layer in range(L):
        ks, vs = sections(layer)
        want = b"".join(
            bytes(part) for b in range(4) for part in encode_kv(Codec.Q8, cd, ks[b], vs[b])
        )
        assert bytes(bufs[(layer, Component.KV)]) == want


def test_numpy_kv_destination_receives_the_data() -> None:
    """``kvcs.adapters.numpy_kv.KvDestination.buffer`` is a destinations callable as it is."""
    numpy_kv = pytest.importorskip("kvcs.adapters.numpy_kv")
    pair = Pair()
    fx = Fixture().produce_all().serve(pair)
    cd = CompatibilityDescriptor(CD)
    dest = numpy_kv.KvDestination(cd, 4 * B)
    c = consumer(destinations=dest.buffer)
    h = Harness(c, pair)
    assert h.finish().complete
    for layer in range(L):
        for comp in KV:
            for b in range(4):
                assert bytes(dest.section(layer, comp, b)) == fx.data(comp, layer, b)


def test_a_session_attached_before_its_setup_is_used_once_set_up() -> None:
    pair = Pair()  # a first session that serves nothing
    late = join(pair, start=False)
    fx = Fixture().produce_all().serve(late)
    c = consumer()
    h = Harness(c, pair, late)  # attached while SETUP is still to come
    assert not late.cli.setup_complete
    start_pair(late)
    done = h.finish()
    assert done.complete
    assert_all_data(c, fx)
    assert c.session_index(late.cli) == 1


# --- the per-Object check (``_verify.check_object``) ---------------------------------------


def _check_case() -> tuple[bytes, dict[str, Any]]:
    data = bytes(range(256)) * 2
    head, _ = build_payload_parts(
        component=Component.V,
        layer=3,
        block_index=5,
        token_start=7 * 16,
        token_count=16,
        codec=int(Codec.RAW),
        data=data,
    )
    context = {
        "layer": 3,
        "object_id": 5,
        "component": Component.V,
        "codec": int(Codec.RAW),
        "block_tokens": 16,
        "token_start": 7 * 16,
        "listed_digest": hashlib.sha256(data).digest(),
        "data_length": len(data),
    }
    return head + data, context


def _header_mutations() -> list[tuple[str, int, int]]:
    """(name, offset, size) of every header field: each is changed in turn below."""
    return [
        ("magic", 0, 4), ("version", 4, 1), ("component", 5, 1), ("flags", 6, 2),
        ("layer", 8, 4), ("block", 12, 4), ("token start", 16, 8), ("token count", 24, 4),
        ("codec", 28, 2), ("reserved", 30, 2), ("data length", 32, 4), ("digest", 36, 32),
    ]  # fmt: skip


def test_check_object_fast_path_agrees_with_the_full_check() -> None:
    """Every mutation gets the same verdict from ``check_object`` (fast path first) as
    from the full, ordered check; Flags and Reserved are ignored on receipt."""
    assert _verify._EXPECTED.size == HEADER_LEN == _HEADER.size
    payload, ctx = _check_case()
    cases: list[tuple[str, bytes, dict[str, Any]]] = [("valid", payload, ctx)]
    cases.append(("not listed", payload, {**ctx, "listed_digest": None}))
    cases.append(("listed differs", payload, {**ctx, "listed_digest": bytes(32)}))
    for what in ("layer", "object_id", "component", "codec", "block_tokens", "token_start"):
        cases.append((f"expected {what}", payload, {**ctx, what: int(ctx[what]) + 1}))
    cases.append(("codec's length", payload, {**ctx, "data_length": ctx["data_length"] - 2}))
    for name, offset, size in _header_mutations():
        for delta in (1, 0x80):
            buf = bytearray(payload)
            buf[offset + size - 1] ^= delta
            cases.append((f"{name} ^ {delta}", bytes(buf), ctx))
    buf = bytearray(payload)
    buf[HEADER_LEN + 7] ^= 1
    cases.append(("data bit", bytes(buf), ctx))
    cases.append(("data bit, not listed", bytes(buf), {**ctx, "listed_digest": None}))
    cases += [
        ("truncated", payload[:-1], ctx),
        ("trailing", payload + b"\0", ctx),
        ("header only", payload[:HEADER_LEN], ctx),
        ("short header", payload[:10], ctx),
        ("empty", b"", ctx),
    ]
    accepted = 0
    for name, raw, context in cases:
        views = [memoryview(raw), memoryview(bytearray(raw))]
        if len(raw) % 2 == 0:
            views.append(memoryview(raw).cast("H"))  # not a byte view: the full check
        for view in views:
            fast = _verify.check_object(view, **context)
            full = _verify._full_check(view, **context)
            if isinstance(full, _verify.ObjectVerdict):
                assert fast == full, name
            else:
                assert isinstance(fast, tuple), name
                assert (bytes(fast[0]), fast[1]) == (bytes(full[0]), full[1]), name
                assert fast[0].obj is view.obj  # a view of the payload, no copy
                accepted += 1
    # valid, not listed, Flags and Reserved changes: accepted in every view
    assert accepted == 3 * (2 + 2 * 2)
