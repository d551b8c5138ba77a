"""Shared builders for the end-to-end KVCS tests (``test_kvcs_e2e.py``).

* :class:`SourceCache`: a synthetic engine cache (HND ``[layers, kv_heads, tokens,
  head_dim]`` of raw bfloat16 bit patterns) and its per-layer K/V sections, made with
  ``kvcs.adapters.numpy_kv.layer_sections`` exactly as a publisher would.
* :class:`World`: one loopback :class:`~kvcs.transports.loopback.Network` (one virtual
  clock) with any number of links, each a client session (the consumer side) and a
  server session (the publisher side). A server session is answered by
  :class:`~kvcs_core.kvcs.publisher.KvcsPublisher`\\ s attached to it and/or by a
  :class:`StoreServer` (a hand-built or tampered set of TrackStores). Consumers are
  fed the events of their client sessions, their events are logged with the virtual
  time, and their timers are fired by the drive loop (the network only drives
  sessions).
* Tampering helpers: :func:`copy_store` (TrackStore objects are immutable, so a
  tampered copy is built), :func:`header_fields` / :func:`rebuild_head` to forge
  object headers, :func:`manifest_store` for forged or re-signed manifests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvcs.adapters.numpy_kv import KvDestination, LayerSections, layer_sections
from kvcs.transports.loopback import Network
from kvcs_core.kvcs.consumer import KvcsConsumer, RetrievalComplete
from kvcs_core.kvcs.cose import sign_manifest
from kvcs_core.kvcs.manifest import Manifest
from kvcs_core.kvcs.publisher import KvcsPublisher, ManifestSigner
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import StoredObject, TrackStore
from kvcs_core.wire.codes import ObjectStatus, RequestErrorCode
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

SCOPE_KEY = bytes(range(32))
PRODUCER = Ed25519PrivateKey.from_private_bytes(b"\x11" * 32)
ROGUE = Ed25519PrivateKey.from_private_bytes(b"\x22" * 32)
KID = b"producer-1"
KEYS = {KID: PRODUCER.public_key()}
SIGNER = ManifestSigner(PRODUCER, KID)
PUB_A = b"\xaa" * 16
PUB_B = b"\xbb" * 16


def make_cd(
    layers: int = 32, kv_heads: int = 8, head_dim: int = 128, block_tokens: int = 16
) -> dict[str, Any]:
    return {
        "kvsp": 0,
        "model": "test/e2e@1",
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": "bfloat16",
        "block_tokens": block_tokens,
    }


def prompt(n_tokens: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n_tokens))


class SourceCache:
    """Random bfloat16 bit patterns (NaN patterns included: compared bitwise)."""

    def __init__(self, cd: Mapping[str, Any], tokens: int, seed: int = 1) -> None:
        self.cd_json = dict(cd)
        self.cd = CompatibilityDescriptor(self.cd_json)
        self.tokens = tokens
        self.blocks = tokens // self.cd.block_tokens
        rng = np.random.default_rng(seed)
        shape = (self.cd.layers, self.cd.kv_heads, tokens, self.cd.head_dim)
        self.k = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        self.v = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        self._sections: dict[int, LayerSections] = {}

    def sections(self, layer: int) -> LayerSections:
        """The layer's K/V sections (one gather copy, kept alive: the publisher holds them
        by reference)."""
        got = self._sections.get(layer)
        if got is None:
            got = layer_sections(self.k[layer], self.v[layer], self.cd)
            self._sections[layer] = got
        return got

    def put(self, pub: KvcsPublisher, layer: int, now: float) -> None:
        s = self.sections(layer)
        pub.put_layer(layer, s.k, s.v, now=now)

    def publisher(
        self,
        tokens: Sequence[int],
        pub_id: bytes = PUB_A,
        *,
        signed: bool = True,
        deterministic: bool = False,
        **kw: Any,
    ) -> KvcsPublisher:
        return KvcsPublisher(
            self.cd_json,
            SCOPE_KEY,
            tokens,
            pub_id,
            signer=SIGNER if signed else None,
            deterministic=deterministic,
            **kw,
        )

    def produce_all(
        self, pub: KvcsPublisher, now: float = 0.0, *, finish: bool = False
    ) -> KvcsPublisher:
        """Put every remaining layer (complete); ``finish``: also end the manifest track
        (see ``test_consumer_after_finish_gets_the_manifest`` for why not by default)."""
        for layer in range(pub.segments[0].next_layer, self.cd.layers):
            self.put(pub, layer, now)
        if finish:
            pub.finish(now=now)
        return pub

    def check(self, dest: KvDestination, blocks: int | None = None) -> None:
        """Every layer's K and V in ``dest``: blocks 0..blocks-1 bit-identical to the
        source (via the engine arrays), the rest untouched (zero)."""
        n = self.blocks if blocks is None else blocks
        t = n * self.cd.block_tokens
        for layer in range(self.cd.layers):
            k, v = dest.as_engine_arrays(layer)
            assert k.dtype == np.uint16 and v.dtype == np.uint16
            assert np.array_equal(k[:, :t], self.k[layer, :, :t]), f"K of layer {layer}"
            assert np.array_equal(v[:, :t], self.v[layer, :, :t]), f"V of layer {layer}"
            assert not k[:, t:].any() and not v[:, t:].any(), f"layer {layer} beyond {n}"


# --------------------------------------------------------------------------- serving


class StoreServer:
    """Answers a server session from TrackStores (like ``session_pair.Pair``).

    ``extra_announcements``: namespace suffixes (field tuples) announced on every
    SUBSCRIBE_NAMESPACE besides those of the served stores (e.g. of the wrong shape).
    """

    def __init__(self, stores: Iterable[TrackStore] = ()) -> None:
        self.stores: dict[FullTrackName, TrackStore] = {}
        self.namespaces: list[TrackNamespace] = []
        self.extra_announcements: list[tuple[bytes, ...]] = []
        for s in stores:
            self.serve(s)

    def serve(self, store: TrackStore) -> None:
        self.stores[store.name] = store
        if store.name.namespace not in self.namespaces:
            self.namespaces.append(store.name.namespace)

    def handle_session_event(self, srv: MoqtSession, e: Any, now: float) -> bool:
        if isinstance(e, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
            store = self.stores.get(e.track)
            if store is None:
                return False
            if isinstance(e, ev.SubscribeRequested):
                srv.accept_subscribe(e.request_id, store, now=now)
            elif isinstance(e, ev.FetchRequested):
                srv.accept_fetch(e.request_id, store, now=now)
            else:
                srv.accept_track_status(e.request_id, store, now=now)
            return True
        if isinstance(e, ev.SubscribeNamespaceRequested):
            srv.accept_request(e.request_id, now=now)
            for ns in self.namespaces:
                if e.prefix.is_prefix_of(ns):
                    srv.send_namespace(e.request_id, ns.suffix_after(e.prefix), now=now)
            for fields in self.extra_announcements:
                srv.send_namespace(e.request_id, TrackNamespace(fields), now=now)
            return True
        return False


@attrs.define(eq=False)
class Conn:
    """One link: the consumer-side client session and the publisher-side server session."""

    cli: MoqtSession
    srv: MoqtSession
    link: Any
    handlers: list[Any]
    """Publishers / StoreServers answering ``srv``, asked in order."""
    server_events: list[Any] = attrs.field(factory=list)
    """Every non-object event of ``srv`` (requests as the publisher saw them)."""
    client_events: list[Any] = attrs.field(factory=list)
    """Every non-object event of ``cli``."""

    def requests(self, kind: type | tuple[type, ...]) -> list[Any]:
        return [e for e in self.server_events if isinstance(e, kind)]


@attrs.define(eq=False)
class Client:
    """A consumer, its sessions and its event log ``(virtual time, event)``."""

    consumer: KvcsConsumer
    conns: list[Conn]
    dest: KvDestination | None = None
    events: list[tuple[float, Any]] = attrs.field(factory=list)

    def of(self, kind: type | tuple[type, ...]) -> list[Any]:
        return [e for _, e in self.events if isinstance(e, kind)]

    def at(self, kind: type) -> list[float]:
        return [t for t, e in self.events if isinstance(e, kind)]

    def done_event(self) -> RetrievalComplete:
        done = self.of(RetrievalComplete)
        assert len(done) == 1, self.events
        result: RetrievalComplete = done[0]
        return result


class World:
    """A loopback network with publisher links and consumers on one virtual clock."""

    def __init__(self, seed: int = 5) -> None:
        # events are not kept by the network: ObjectReceived would pin every payload
        self.net = Network(seed=seed, keep_events=False)
        self.conns: list[Conn] = []
        self.clients: list[Client] = []
        self._by_cli: dict[int, Conn] = {}
        self._by_srv: dict[int, Conn] = {}
        self.net.on_event(self._on_event)

    @property
    def now(self) -> float:
        return self.net.now

    # --- set-up ----------------------------------------------------------------------

    def connect(
        self,
        *handlers: Any,
        latency: float = 0.005,
        bandwidth: float | None = None,
        server_config: SessionConfig | None = None,
    ) -> Conn:
        """A new link whose server session is answered by ``handlers`` (publishers are
        attached to it here)."""
        cli = MoqtSession(SessionConfig(role=Role.CLIENT))
        srv = MoqtSession(server_config or SessionConfig(role=Role.SERVER))
        link = self.net.connect(cli, srv, latency=latency, bandwidth=bandwidth, zero_copy=True)
        conn = Conn(cli, srv, link, list(handlers))
        self.conns.append(conn)
        self._by_cli[id(cli)] = conn
        self._by_srv[id(srv)] = conn
        cli.start(now=self.now)
        srv.start(now=self.now)
        self.net.poke(cli)
        self.net.poke(srv)
        self.net.run_until(lambda: cli.setup_complete and srv.setup_complete, max_time=self.now + 5)
        for h in handlers:
            if isinstance(h, KvcsPublisher):
                h.attach(srv, now=self.now)
        self.net.poke(srv)
        self.net.run_for(0)
        return conn

    def add_consumer(
        self,
        consumer: KvcsConsumer,
        *conns: Conn,
        dest: KvDestination | None = None,
    ) -> Client:
        client = Client(consumer, list(conns), dest)
        self.clients.append(client)
        for c in conns:
            consumer.attach(c.cli, now=self.now)
        self._pump(client)
        self.net.run_for(0)
        return client

    # --- routing ---------------------------------------------------------------------

    def _on_event(self, machine: Any, e: Any) -> None:
        now = self.net.now
        conn = self._by_srv.get(id(machine))
        if conn is not None:
            if not isinstance(e, ev.ObjectReceived):
                conn.server_events.append(e)
            handled = [h.handle_session_event(machine, e, now) for h in conn.handlers]
            if not any(handled) and isinstance(
                e, ev.SubscribeNamespaceRequested | ev.SubscribeRequested | ev.FetchRequested
            ):
                machine.reject_request(
                    e.request_id, RequestErrorCode.DOES_NOT_EXIST, "not here", now=now
                )
            return
        conn = self._by_cli.get(id(machine))
        if conn is None:
            return
        if not isinstance(e, ev.ObjectReceived):
            conn.client_events.append(e)
        consumed = False
        for client in self.clients:
            if conn in client.conns:
                consumed = client.consumer.handle_session_event(machine, e, now) or consumed
                self._pump(client)
        if not consumed and isinstance(e, ev.PublishNamespaceRequested):
            machine.accept_request(e.request_id, now=now)

    def _pump(self, client: Client) -> None:
        while (e := client.consumer.next_event()) is not None:
            client.events.append((self.net.now, e))

    def poke_servers(self) -> None:
        for c in self.conns:
            self.net.poke(c.srv)

    # --- driving ---------------------------------------------------------------------

    def _advance(self, limit: float, until: Callable[[], bool], max_steps: int) -> bool:
        self.net.run_for(0)
        for _ in range(max_steps):
            if until():
                return True
            timers = [(t, cl) for cl in self.clients if (t := cl.consumer.get_timer()) is not None]
            tc = min((t for t, _ in timers), default=None)
            tn = self.net.next_time()
            nxt = min((t for t in (tc, tn) if t is not None), default=None)
            if nxt is None or nxt > limit:
                return False
            if tc is not None and (tn is None or tc <= tn):
                if tc > self.net.now:
                    self.net.run_for(tc - self.net.now)
                for t, cl in timers:
                    if t <= self.net.now:
                        cl.consumer.handle_timer(self.net.now)
                        self._pump(cl)
                self.net.run_for(0)
            else:
                self.net.step()
        raise AssertionError("too many steps")

    def drive(
        self, until: Callable[[], bool], max_time: float = 30.0, max_steps: int = 2_000_000
    ) -> None:
        if not self._advance(self.net.now + max_time, until, max_steps):
            raise AssertionError(f"not reached by t={self.net.now:.3f}")

    def run_to(self, t: float, max_steps: int = 2_000_000) -> None:
        """Run everything (sessions and consumer timers) up to virtual time ``t``."""
        self._advance(t, lambda: False, max_steps)
        if t > self.net.now:
            self.net.run_for(t - self.net.now)

    def finish(self, *clients: Client, max_time: float = 30.0) -> None:
        targets = clients or tuple(self.clients)
        self.drive(lambda: all(cl.consumer.done for cl in targets), max_time)


# --------------------------------------------------------------------------- tampering


def copy_store(
    store: TrackStore,
    replace: Callable[[StoredObject], tuple[bytes, bytes] | None] | None = None,
    *,
    name: FullTrackName | None = None,
) -> TrackStore:
    """A copy of ``store`` (optionally under another name); ``replace(obj)`` may return a
    new ``(head, payload)`` for a Normal object (``None``: keep it)."""
    out = TrackStore(
        name or store.name,
        default_publisher_priority=store.default_publisher_priority,
        group_order=store.group_order,
        track_properties=store.track_properties,
    )
    for obj in store.objects_in(Location(0, 0)):
        head, payload = obj.head, obj.payload
        if replace is not None and obj.status is ObjectStatus.NORMAL:
            new = replace(obj)
            if new is not None:
                head, payload = new[0], memoryview(new[1])
        out.append(
            obj.group_id,
            obj.object_id,
            payload,
            head,
            subgroup_id=obj.subgroup_id,
            publisher_priority=obj.publisher_priority,
            status=obj.status,
            properties=obj.properties,
        )
    return out


# profile 3.5 header: Magic(4) Version(1) Component(1) Flags(2) Layer(4) Block(4)
# TokenStart(8) TokenCount(4) Codec(2) Reserved(2) DataLength(4) Digest(32), big-endian
_HEADER = struct.Struct(">4sBBHIIQIHHI32s")
assert _HEADER.size == 68


def header_fields(head: bytes) -> dict[str, Any]:
    names = (
        "magic", "version", "component", "flags", "layer", "block", "token_start",
        "token_count", "codec", "reserved", "data_length", "digest",
    )  # fmt: skip
    return dict(zip(names, _HEADER.unpack(head), strict=True))


def rebuild_head(head: bytes, **changes: Any) -> bytes:
    fields = header_fields(head)
    fields.update(changes)
    return _HEADER.pack(*fields.values())


def tampered_stores(
    pub: KvcsPublisher,
    edits: Mapping[tuple[str, int, int], Callable[[bytes, bytes], tuple[bytes, bytes]]],
    *,
    manifest: TrackStore | None = None,
) -> StoreServer:
    """A StoreServer holding copies of every track of ``pub``; ``edits[(track, layer,
    block)](head, data)`` gives the tampered ``(head, data)`` of that Object."""
    server = StoreServer()
    for track in pub.track_names:
        store = pub.store(track)
        assert store is not None
        if track == pub.manifest_track and manifest is not None:
            server.serve(manifest)
            continue

        def replace(obj: StoredObject, track: str = track) -> tuple[bytes, bytes] | None:
            edit = edits.get((track, obj.group_id, obj.object_id))
            if edit is None:
                return None
            return edit(obj.head, bytes(obj.payload))

        server.serve(copy_store(store, replace))
    return server


def manifest_store(
    pub: KvcsPublisher,
    *,
    manifest: Manifest | None = None,
    key: Ed25519PrivateKey | None = PRODUCER,
    track: str | None = None,
    finished: bool = True,
) -> TrackStore:
    """A manifest track for ``pub``'s namespace holding one version (Group 0): ``manifest``
    (default: the publisher's latest), signed with ``key`` (``None``: plain JSON) on
    ``track`` (default ``manifest.cose`` when signed, else ``manifest``)."""
    body = (manifest or pub.manifest).encode()
    payload = body if key is None else sign_manifest(body, key, KID)
    name = track or ("manifest" if key is None else "manifest.cose")
    store = TrackStore(FullTrackName(pub.namespace, name.encode()), default_publisher_priority=0)
    store.append(0, 0, payload, publisher_priority=0)
    store.append(0, 1, status=ObjectStatus.END_OF_GROUP, publisher_priority=0)
    if finished:
        store.append(1, 0, status=ObjectStatus.END_OF_TRACK, publisher_priority=0)
    return store


def flip_bit(data: bytes, index: int = 1234, bit: int = 3) -> bytes:
    buf = bytearray(data)
    buf[index % len(buf)] ^= 1 << bit
    return bytes(buf)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
