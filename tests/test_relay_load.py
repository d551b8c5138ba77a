"""Bounded load (issue 10, "Must show"): 32 subscribers join and leave while a 128 MiB KV
cache is published through a relay whose cache budget is 32 MiB.

A real ``KvcsPublisher`` (32 layers x 4 blocks x K and V, 512 KiB objects) serves the
relay over the deterministic loopback; 32 subscribers use the exactly-once recipe
(NEXT_OBJECT + fill from {0,0}, wire reference 6) on both tracks, joining at every
layer of the production, and every fourth one leaves (cancels) half-way. Checked:

* after **every** input the relay gets, its accounted cache bytes are within the
  budget (payload buffers, properties, fixed overheads and evicted objects still
  being sent all count, :mod:`kvcs_core.relay.cache`);
* the object bytes the relay holds, its cache plus the objects it forwarded without
  keeping them that its sessions still queue (``RelayStats.transit_bytes``), stay
  within the budget plus a *fixed* ``OVERHEAD`` (independent of the publication's
  size): the re-fetches of evicted groups for late joiners are paced by
  ``RelayConfig.max_transit_bytes`` and continue as the subscribers drain;
* every subscriber that stays gets every object exactly once, bit-identical to what
  the publisher produced (late joiners get the groups evicted before they came as
  restores on a late fill, A27);
* the re-fetches are shared by the late joiners that lack the same groups: what the
  relay fetches from the publisher stays within ``UPSTREAM_BOUND`` (without pacing it
  was about 15 times the publication, one whole re-fetch per joiner).
"""

from __future__ import annotations

import struct
from typing import Any

from relay_net import RelayNet

from kvcs_core.kvcs.publisher import KvcsPublisher
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.relay import RelayConfig
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, RequestErrorCode
from kvcs_core.wire.names import FullTrackName, Location

LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM = 32, 4, 16, 8, 1024
OBJECT = BLOCK_TOKENS * HEADS * HEAD_DIM * 2 * 2  # K or V of one block: 512 KiB
TOTAL = LAYERS * BLOCKS * 2 * OBJECT  # 128 MiB
BUDGET = 32 << 20
TRANSIT = 8 << 20
OVERHEAD = 2 * TRANSIT
"""Stated fixed overhead beyond the budget: objects *in transit*, forwarded but not kept
(restores of evicted groups streaming to late joiners on their late fills, A27), held
only by the relay's session queues (one copy, shared by every session that sends it).
Paced re-fetches keep them within ``max_transit_bytes`` plus one group (a re-fetch is
asked for while its estimate fits); twice the allowance is stated, whatever TOTAL is."""
UPSTREAM_BOUND = 6 * TOTAL
"""What the relay may fetch from the publisher: the publication once live, plus the
shared re-fetches (measured about 4x; 15x before the re-fetches were paced and shared)."""
SUBSCRIBERS = 32

CD = {
    "kvsp": 0,
    "model": "test/load@1",
    "layers": LAYERS,
    "kv_heads": HEADS,
    "head_dim": HEAD_DIM * 2,
    "dtype": "float16",
    "block_tokens": BLOCK_TOKENS,
}


def section(layer: int, block: int, which: int) -> bytes:
    n = BLOCK_TOKENS * HEADS * HEAD_DIM * 2
    unit = struct.pack("<4H", layer, block, which, 0x5A5A)
    return unit * (n * 2 // len(unit))


class Watcher:
    """A subscriber's two subscriptions, checked object by object as they arrive."""

    def __init__(self, session: MoqtSession, stores: dict[FullTrackName, Any]) -> None:
        self.session = session
        self.stores = stores
        self.rids: dict[int, FullTrackName] = {}
        self.got: dict[int, set[Location]] = {}
        self.done: set[int] = set()
        self.bad: list[str] = []
        self.left = False

    def subscribe(self, name: FullTrackName, now: float) -> None:
        rid = self.session.subscribe(
            name,
            now=now,
            location_filter=p.LocationFilter.next_object(),
            fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
        )
        self.rids[rid] = name
        self.got[rid] = set()

    def on_event(self, e: Any, _now: float) -> None:
        if isinstance(e, ev.ObjectReceived) and e.request_id in self.rids:
            if e.status is not ObjectStatus.NORMAL:
                return
            seen = self.got[e.request_id]
            if e.location in seen:
                self.bad.append(f"{e.location} twice")
            seen.add(e.location)
            stored = self.stores[self.rids[e.request_id]].get(e.location)
            if stored is None or stored.payload_bytes() != bytes(e.payload):
                self.bad.append(f"{e.location} differs")
        elif isinstance(e, ev.PublishDoneReceived | ev.RequestFailed) and e.request_id in self.rids:
            self.done.add(e.request_id)

    @property
    def finished(self) -> bool:
        return self.left or len(self.done) == len(self.rids) == 2


def test_32_subscribers_join_and_leave_a_128_mib_publication_under_a_32_mib_budget() -> None:
    tokens = list(range(BLOCKS * BLOCK_TOKENS + 1))
    kpub = KvcsPublisher(CD, bytes(32), tokens, bytes(16))
    rn = RelayNet(keep_events=False, zero_copy=True, latency=0.001)
    relay = rn.add_relay(
        RelayConfig(cache_budget_bytes=BUDGET, request_rate=0, max_transit_bytes=TRANSIT)
    )
    peak = {"cache": 0, "held": 0, "transit": 0}

    on_event = relay.handle_session_event

    def checked(session: Any, e: Any, now: float) -> bool:
        out = on_event(session, e, now)
        cache = relay.cache_bytes
        assert cache <= BUDGET, f"cache {cache} > budget after {e!r}"
        transit = relay.stats().transit_bytes
        held = cache + transit  # every object byte the relay holds
        peak["transit"] = max(peak["transit"], transit)
        peak["cache"] = max(peak["cache"], cache)
        peak["held"] = max(peak["held"], held)
        return out

    relay.handle_session_event = checked  # type: ignore[method-assign]

    def serve(session: Any, e: Any, now: float) -> None:
        if not kpub.handle_session_event(session, e, now) and isinstance(
            e, ev.SubscribeNamespaceRequested | ev.SubscribeRequested | ev.FetchRequested
        ):
            session.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, now=now)

    origin = rn.add_origin(relay, serve)
    kpub.attach(origin, now=rn.now)
    rn.net.poke(origin)
    rn.settle(0.02)
    names = [FullTrackName(kpub.namespace, t.encode()) for t in ("k.raw.s0", "v.raw.s0")]
    stores: dict[FullTrackName, Any] = {}
    watchers: list[Watcher] = []
    for _ in range(SUBSCRIBERS):
        s = rn.add_subscriber(relay)
        w = Watcher(s.session, stores)
        rn.handlers[s.session] = w.on_event
        watchers.append(w)

    def join(w: Watcher) -> None:
        for name in names:
            w.subscribe(name, rn.now)
        rn.net.poke(w.session)

    for layer in range(LAYERS):
        kpub.put_layer(
            layer,
            [section(layer, b, 0) for b in range(BLOCKS)],
            [section(layer, b, 1) for b in range(BLOCKS)],
            now=rn.now,
        )
        if not stores:
            stores.update({n: kpub.store(n.name) for n in names})
        rn.net.poke(origin)
        join(watchers[layer])  # one subscriber joins at every layer
        for w in watchers[: layer + 1]:
            if watchers.index(w) % 4 == 3 and not w.left and layer >= watchers.index(w) + 4:
                for rid in w.rids:  # every fourth one leaves four layers after joining
                    w.session.cancel(rid, now=rn.now)
                w.left = True
                rn.net.poke(w.session)
        rn.settle(0.004)
    kpub.finish(now=rn.now)
    rn.net.poke(origin)
    rn.run_until(lambda: all(w.finished for w in watchers), max_time=120)

    stayed = [w for w in watchers if not w.left]
    assert len(stayed) == 25  # the last one joined too late to leave
    everything = {Location(g, o) for g in range(LAYERS) for o in range(BLOCKS)}
    for w in stayed:
        assert not w.bad, w.bad[:3]
        for rid in w.rids:
            assert w.got[rid] == everything  # every object, once, bit-identical
    stats = relay.stats()
    assert stats.evicted_bytes > 0  # the budget was binding
    assert peak["cache"] <= BUDGET
    assert peak["held"] <= BUDGET + OVERHEAD, peak
    assert peak["transit"] <= OVERHEAD, peak
    # everyone left: nothing served, nothing in transit (cold copies stay within budget)
    assert relay.cache_bytes <= BUDGET and stats.downstream_subscriptions == 0
    assert stats.transit_bytes == 0
    assert 0 < stats.refetch_bytes_received < stats.upstream_bytes_received <= UPSTREAM_BOUND
    print(
        f"published {TOTAL >> 20} MiB, budget {BUDGET >> 20} MiB: peak cache "
        f"{peak['cache'] / 2**20:.1f} MiB, peak in transit {peak['transit'] / 2**20:.1f} MiB, "
        f"peak cache + in transit {peak['held'] / 2**20:.1f} MiB, upstream received "
        f"{stats.upstream_bytes_received / 2**20:.1f} MiB "
        f"({stats.refetch_bytes_received / 2**20:.1f} MiB re-fetched)"
    )
