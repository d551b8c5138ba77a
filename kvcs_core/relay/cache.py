"""The relay cache: one TrackStore per track, a byte budget over all of them.

Theory of operation
-------------------
Caching rules (d21 section 7.1, wire reference 10 "Caching"): the key is
(Full Track Name, Group ID, Object ID) and the value every field of the object
as received: Subgroup ID (or the Datagram forwarding preference), Publisher
Priority, Object Status, Object Properties and the payload. A
:class:`~kvcs_core.moqt.track_store.TrackStore` is exactly that, so a cached
track *is* a TrackStore: fed with the upstream's ``ObjectReceived`` events and
served downstream by the sessions with ``accept_subscribe`` / ``accept_fetch``
(the sessions compute windows and fills from its Largest Object, A27).

* **Zero copy.** The store keeps the ``memoryview`` the upstream session
  delivered (a view of the transport's buffer); every downstream session
  writes that same view (scatter/gather). Payloads are never copied, split,
  merged or read (d21 section 7.1: payloads are opaque).
* **Duplicates** (an object delivered by a subscription and a fill, by two
  publishers of one track, by a refetch) are no-ops in the store. A duplicate
  with a different Subgroup ID, priority, status, forwarding preference or
  payload, or an object beyond End of Group / End of Track, is a *malformed
  track* (d21 section 12.1, wire reference 7.10): the store raises
  :class:`~kvcs_core.moqt.track_store.MalformedTrack`, stays unchanged, and the
  relay drops the whole entry ("never cache objects of a malformed track").
* **Budget and eviction.** :attr:`Cache.total_bytes` is the sum of the stores'
  payload bytes. When it passes the budget, whole groups are evicted (a group
  is the unit a late joiner or a FETCH asks for) until the cache is at
  ``evict_to`` of the budget. Victims are chosen by *tier*, then least recently
  used track, then oldest group first:

  ====  ==========================================================================
  tier  tracks
  ====  ==========================================================================
  0     no live upstream and no downstream subscription (cold copies)
  1     no live upstream, downstream subscriptions still served (e.g. finishing)
  2     live upstream; the group holding Largest Object (being produced) is kept
  ====  ==========================================================================

  A track that a waiting request needs right now (an upstream FETCH in flight,
  a SUBSCRIBE waiting for evicted groups) is not evictable at all (the relay
  says so through the tier function). "Used" means a downstream request was
  served from the track. An evicted group becomes *unknown*, not non-existent
  (d21 section 7.1): Largest Object is kept, and the relay re-fetches evicted
  groups upstream when a request needs them.
* **Eviction never shortens a response in progress.** A session serving a
  fill or a FETCH takes a *snapshot* of the range when it is processed (the
  list of stored objects, by reference; :mod:`kvcs_core.moqt.publishing`), and
  a live subscription queues the objects it still has to send: eviction only
  drops the cache's own index, the objects being sent keep their payload
  buffers alive until written. The budget counts what the cache holds, not
  what sessions are still writing (bounded per session by its queue limit, and
  for snapshots by the ranges being served). When every remaining group is
  protected the cache may stay above budget.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvcs_core.moqt.events import ObjectReceived
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire.codes import GroupOrder, PropertyType
from kvcs_core.wire.kvp import KeyValuePairs, find_kvp
from kvcs_core.wire.names import FullTrackName

TierFn = Callable[["CacheEntry"], "tuple[int, int | None] | None"]
"""``entry -> (tier, protected group or None)``, or ``None``: do not evict from it now."""


@attrs.define(eq=False)
class CacheEntry:
    """One cached track: its store plus accounting (see the module docstring)."""

    store: TrackStore
    last_used: int = 0
    evicted: set[int] = attrs.field(factory=set)
    """Groups evicted and not fetched again since: unknown, possibly partial."""
    objects_received: int = 0
    bytes_received: int = 0
    duplicates: int = 0
    evicted_groups: int = 0
    evicted_bytes: int = 0


def store_for(name: FullTrackName, track_properties: KeyValuePairs) -> TrackStore:
    """A TrackStore for a track whose Track Properties came from upstream (d21 7.6).

    DEFAULT_PUBLISHER_PRIORITY and DEFAULT_PUBLISHER_GROUP_ORDER are taken from the
    properties, which are kept and passed on unchanged in SUBSCRIBE_OK / FETCH_OK.

    Raises:
        ValueError: a property value the store cannot hold (priority > 255, an
            unknown group order): the relay treats the track as malformed.
    """
    prio = find_kvp(track_properties, PropertyType.DEFAULT_PUBLISHER_PRIORITY)
    order = find_kvp(track_properties, PropertyType.DEFAULT_PUBLISHER_GROUP_ORDER)
    return TrackStore(
        name,
        default_publisher_priority=prio if isinstance(prio, int) else 128,
        group_order=GroupOrder(order) if isinstance(order, int) else GroupOrder.ASCENDING,
        track_properties=track_properties,
    )


class Cache:
    """Every cached track and the shared byte budget (see the module docstring).

    Args:
        budget: payload bytes allowed over all stores.
        evict_to: eviction stops at ``evict_to * budget`` bytes.
    """

    def __init__(self, budget: int, evict_to: float) -> None:
        self.budget = budget
        self._low_water = int(budget * evict_to)
        self._entries: dict[FullTrackName, CacheEntry] = {}
        self._tick = 0
        self.total_bytes = 0
        """Payload bytes held now over every store."""
        self.peak_bytes = 0
        """The most ``total_bytes`` ever was."""
        self.received_bytes = 0
        """Payload bytes appended or offered (duplicates included)."""
        self.received_objects = 0
        self.evicted_bytes = 0

    # --- getters -------------------------------------------------------------------

    def get(self, name: FullTrackName) -> CacheEntry | None:
        return self._entries.get(name)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def over_budget(self) -> bool:
        return self.total_bytes > self.budget

    # --- commands ------------------------------------------------------------------

    def add(self, store: TrackStore) -> CacheEntry:
        """Start caching ``store`` (replacing any entry of the same name)."""
        self.drop(store.name)
        self._tick += 1
        entry = CacheEntry(store, last_used=self._tick)
        self._entries[store.name] = entry
        self.total_bytes += store.total_bytes
        self._peak()
        return entry

    def touch(self, entry: CacheEntry) -> None:
        """A downstream request was served from ``entry`` (LRU order)."""
        self._tick += 1
        entry.last_used = self._tick

    def append(self, entry: CacheEntry, e: ObjectReceived) -> bool:
        """Cache one upstream object as received (payload view kept, not copied).

        Returns:
            ``True`` for a new object, ``False`` for a duplicate.

        Raises:
            MalformedTrack: the object conflicts with what is cached (the store is
                unchanged; the caller drops the entry).
            ValueError: fields a store cannot hold (treated as malformed too).
        """
        store = entry.store
        before_n = len(store)
        payload = e.payload
        size = payload.nbytes
        self.received_bytes += size
        self.received_objects += 1
        entry.objects_received += 1
        entry.bytes_received += size
        sg = e.subgroup_id
        loc = e.location
        store.append_received(  # fields the session's decoder already checked
            loc,
            payload,
            subgroup_id=sg,
            publisher_priority=e.publisher_priority,
            status=e.status,
            properties=e.properties,
        )
        if len(store) == before_n:
            entry.duplicates += 1
            return False
        # a new object holds its payload (no head: the relay appends what it received)
        total = self.total_bytes = self.total_bytes + size
        self.peak_bytes = max(self.peak_bytes, total)
        return True

    def drop(self, name: FullTrackName) -> None:
        """Forget a track's cache entirely (malformed track)."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            self.total_bytes -= entry.store.total_bytes

    def unevict(self, entry: CacheEntry, groups: range) -> None:
        """Groups fetched again: they are whole (as far as upstream has them) again."""
        for g in groups:
            entry.evicted.discard(g)

    def evict(self, tier_of: TierFn) -> list[tuple[FullTrackName, int]]:
        """Evict whole groups until at the low-water mark (module docstring).

        Returns:
            ``(track, group)`` for every group evicted, in order.
        """
        out: list[tuple[FullTrackName, int]] = []
        if self.total_bytes <= self.budget:
            return out
        candidates: list[tuple[int, int, CacheEntry, int | None]] = []
        for entry in self._entries.values():
            if not entry.store.total_bytes:
                continue
            tier = tier_of(entry)
            if tier is not None:
                candidates.append((tier[0], entry.last_used, entry, tier[1]))
        candidates.sort(key=lambda c: (c[0], c[1]))
        for _tier, _used, entry, protected in candidates:
            store = entry.store
            for gid in store.group_ids():
                if self.total_bytes <= self._low_water:
                    return out
                if gid == protected:
                    continue
                freed = store.evict_group(gid)
                self.total_bytes -= freed
                self.evicted_bytes += freed
                entry.evicted.add(gid)
                entry.evicted_groups += 1
                entry.evicted_bytes += freed
                out.append((store.name, gid))
        return out

    def _peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)
