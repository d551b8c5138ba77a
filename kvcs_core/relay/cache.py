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
* **Budget: everything held is counted** (:attr:`Cache.total_bytes`, the
  *accounted* bytes). An object costs its payload (the whole buffer its view
  pins, when that is larger than the view), its Object Properties
  (:data:`PROPERTY_OVERHEAD` + value bytes each) and :data:`OBJECT_OVERHEAD`;
  a group adds :data:`GROUP_OVERHEAD`, a cached track its Track Properties,
  and every track record the relay keeps :data:`TRACK_OVERHEAD` plus its name
  (:meth:`Cache.reserve`: a new track that cannot get room, even after
  eviction, is refused). A duplicate whose (mutable) properties
  replace the stored ones is charged the difference.
* **The budget holds after every input.** Whenever an append (or a new entry)
  takes the accounted bytes above the budget, whole groups are evicted at once
  (a group is the unit a late joiner or a FETCH asks for) until the cache is
  at ``evict_to`` of the budget. Victims are chosen by *tier*, then least
  recently used track, then oldest group first:

  ====  ==========================================================================
  tier  tracks
  ====  ==========================================================================
  0     no live upstream and no downstream subscription (cold copies)
  1     no live upstream, downstream subscriptions still served (e.g. finishing)
  2     live upstream; the group holding Largest Object (being produced) is kept
  ====  ==========================================================================

  Groups a waiting request needs kept (the range of an upstream FETCH that a
  downstream FETCH waits for, or a refill making the cache whole; the relay says
  so through the tier function) and the group being produced are *protected*:
  they go only when nothing else is left, in a last pass that stops at the
  budget. Groups re-fetched for a late SUBSCRIBE are not: each restored object
  reaches the fills that lack it as it arrives (a late fill, A27), so the cache
  never has to hold a late joiner's whole range. So an object
  larger than the budget, or larger than what can ever fit, is handed to the
  live subscribers (the store's listeners run on append) and then evicted with
  its group: forwarded, never kept. "Used" means a downstream request was
  served from the track. An evicted group becomes *unknown*, not
  non-existent (d21 section 7.1): Largest Object is kept, and the relay
  re-fetches evicted groups upstream when a request needs them.
* **Evicted groups** are remembered as a bounded set of Group ID intervals
  (:class:`GroupSet`, at most :data:`MAX_EVICTED_INTERVALS`; past that the two
  closest intervals merge, which only over-states what is unknown: the relay
  then re-fetches a little more). Queries on it cost O(intervals), never
  O(Group IDs): a peer choosing Group 2^62 makes nothing iterate to it.
  Groups evicted again while a re-fetch of them is in flight stay evicted when
  it completes.
* **Payload buffers.** A received payload is often a view into a larger
  transport chunk (a stack that hands over a batch of datagrams' stream data at
  once delivers chunks holding several objects and parts of others). The
  cache keeps such a payload as a copy in a buffer of its own, and a view that
  spans its whole buffer as it is: a cached view would pin its whole chunk for
  as long as the object is cached, and chunks pinned among freed ones leave the
  process holding far more than the cache (measured: a relay's peak RSS 415
  -> 375 MiB for a 256 MiB cache on qh3). One copy of the payload is kept
  either way; the chunk is freed once the session lets go of it.
* **Snapshots and queues are counted too.** A session serving a fill or a
  FETCH takes a *snapshot* of the range (references to the stored objects;
  :mod:`kvcs_core.moqt.publishing`), and a live subscription queues the
  objects it still has to send: eviction drops the cache's index, but those
  objects stay in memory until written. So an evicted object is not freed in
  the accounting: it becomes *pinned* (a weak reference per object, whose
  callback releases its cost the moment the last session lets go of it) and
  stays in :attr:`Cache.total_bytes` until then (:attr:`Cache.pinned_bytes`).
  Eviction therefore cannot lower the total below what sessions still hold:
  new objects that do not fit are forwarded but not kept (above), which is
  what keeps ``total_bytes <= budget`` true at all times. The exception is an
  object the cache *never kept* (evicted in the same step it arrived): it is
  in transit only (:attr:`Cache.transit_bytes`), held by the sessions
  forwarding it, not by this budget: a live object is bounded by the sessions'
  ``max_queued_bytes_per_subscription``, and restores of evicted groups (the
  bulk of it) by the relay's paced re-fetches, ``RelayConfig.max_transit_bytes``
  (:mod:`kvcs_core.relay.core`).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterator
from typing import Final

import attrs

from kvcs_core.moqt.events import ObjectReceived
from kvcs_core.moqt.track_store import StoredObject, TrackStore
from kvcs_core.wire.codes import MAX_VI64, GroupOrder, PropertyType
from kvcs_core.wire.kvp import KeyValuePairs, find_kvp
from kvcs_core.wire.names import FullTrackName, Location

OBJECT_OVERHEAD: Final = 512
"""Bytes charged per cached object besides its payload and properties (the stored object,
its Location, the payload view, index entries, a weak reference while pinned)."""
PROPERTY_OVERHEAD: Final = 96
"""Bytes charged per Object Property besides its value bytes."""
GROUP_OVERHEAD: Final = 1024
"""Bytes charged per cached group (its index and per-subgroup tables)."""
TRACK_OVERHEAD: Final = 4096
"""Bytes charged per cached track besides its name and Track Properties."""
MAX_EVICTED_INTERVALS: Final = 256
"""Intervals a track's evicted-group set keeps (past it, the closest two merge)."""

Spans = tuple[tuple[int, int], ...]
TierFn = Callable[["CacheEntry"], "tuple[int | None, int | None, Spans]"]
"""``entry -> (tier or None, protected group or None, wanted group spans)``. Tier ``None``:
every group of the track is protected (a request waits for it). Protected groups are
evicted only as a last resort, those in a wanted span (an upstream FETCH in flight brings
them for a waiting request) last of all."""


def _kvps_cost(props: KeyValuePairs) -> int:
    return sum(
        PROPERTY_OVERHEAD + (len(kv.value) if isinstance(kv.value, bytes) else 0) for kv in props
    )


def _own_buffer(view: memoryview) -> memoryview:
    """``view`` itself when it spans its whole buffer, else a copy in a buffer of its own
    (module docstring, "Payload buffers")."""
    base = view.obj
    if isinstance(base, bytes | bytearray) and len(base) == view.nbytes:
        return view
    return memoryview(bytes(view)) if view.nbytes else view


def _buffer_of(view: memoryview) -> tuple[int, int]:
    """``(key, bytes)`` of the buffer a payload view keeps alive: the whole exporting
    ``bytes`` / ``bytearray`` (a view into a transport chunk pins all of it, and several
    objects may share one chunk), else the view itself."""
    base = view.obj
    if isinstance(base, bytes | bytearray):
        return id(base), max(len(base), view.nbytes)
    return id(view), view.nbytes


def object_cost(obj: StoredObject) -> int:
    """Accounted bytes of one stored object besides its payload buffer (module docstring)."""
    return OBJECT_OVERHEAD + len(obj.head) + _kvps_cost(obj.properties)


def entry_cost(store: TrackStore) -> int:
    """Accounted bytes of a track's entry itself, no objects: its Track Properties (the
    track record is charged by :meth:`Cache.reserve`)."""
    return _kvps_cost(store.track_properties)


def track_cost(name: FullTrackName) -> int:
    """Accounted bytes of a track record the relay keeps: :data:`TRACK_OVERHEAD` plus
    its name."""
    return TRACK_OVERHEAD + len(name.name) + sum(len(f) + 32 for f in name.namespace.fields)


class GroupSet:
    """A set of Group IDs kept as at most ``limit`` disjoint closed intervals (sorted).

    Adding to a full set merges the two intervals with the smallest gap between them
    (the set grows: it may then hold IDs never added, which for the cache's evicted
    groups only means "unknown", the safe side). Every operation costs O(intervals).
    """

    __slots__ = ("_hi", "_lo", "limit")

    def __init__(self, limit: int = MAX_EVICTED_INTERVALS) -> None:
        self.limit = limit
        self._lo: list[int] = []
        self._hi: list[int] = []

    def __bool__(self) -> bool:
        return bool(self._lo)

    def __len__(self) -> int:
        """Number of intervals (not of IDs)."""
        return len(self._lo)

    def __contains__(self, gid: object) -> bool:
        if not isinstance(gid, int):
            return False
        i = bisect.bisect_right(self._lo, gid) - 1
        return i >= 0 and gid <= self._hi[i]

    def intervals(self) -> Iterator[tuple[int, int]]:
        return iter(tuple(zip(self._lo, self._hi, strict=True)))

    def add(self, gid: int) -> None:
        self.add_range(gid, gid)

    def add_range(self, lo: int, hi: int) -> None:
        if hi < lo:
            return
        los, his = self._lo, self._hi
        i = bisect.bisect_left(his, lo - 1)  # first interval that may touch [lo, hi]
        j = i
        while j < len(los) and los[j] <= hi + 1:
            lo = min(lo, los[j])
            hi = max(hi, his[j])
            j += 1
        los[i:j] = [lo]
        his[i:j] = [hi]
        while len(los) > self.limit:
            k = min(range(len(los) - 1), key=lambda n: los[n + 1] - his[n])
            his[k] = his[k + 1]
            del los[k + 1], his[k + 1]

    def discard_range(self, lo: int, hi: int) -> None:
        """Remove every ID in ``[lo, hi]``."""
        if hi < lo:
            return
        los, his = self._lo, self._hi
        i = bisect.bisect_left(his, lo)
        j = i
        keep_lo: list[int] = []
        keep_hi: list[int] = []
        while j < len(los) and los[j] <= hi:
            if los[j] < lo:
                keep_lo.append(los[j])
                keep_hi.append(lo - 1)
            if his[j] > hi:
                keep_lo.append(hi + 1)
                keep_hi.append(his[j])
            j += 1
        los[i:j] = keep_lo
        his[i:j] = keep_hi

    def span_within(self, lo: int, hi: int) -> tuple[int, int] | None:
        """``(smallest, largest)`` ID of the set within ``[lo, hi]``, or ``None``."""
        los, his = self._lo, self._hi
        i = bisect.bisect_left(his, lo)
        if i == len(los) or los[i] > hi:
            return None
        first = max(lo, los[i])
        k = bisect.bisect_right(los, hi) - 1
        last = min(hi, his[k])
        return first, last

    def first_run(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The first run of consecutive IDs of the set within ``[lo, hi]``, or ``None``."""
        los, his = self._lo, self._hi
        i = bisect.bisect_left(his, lo)
        if i == len(los) or los[i] > hi:
            return None
        return max(lo, los[i]), min(hi, his[i])

    def complement_within(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The intervals of ``[lo, hi]`` not in this set."""
        out: list[tuple[int, int]] = []
        cur = lo
        for a, b in self.intervals():
            if b < cur:
                continue
            if a > hi:
                break
            if a > cur:
                out.append((cur, a - 1))
            cur = b + 1
            if cur > hi:
                return out
        if cur <= hi:
            out.append((cur, hi))
        return out


@attrs.define(eq=False)
class CacheEntry:
    """One cached track: its store plus accounting (see the module docstring)."""

    store: TrackStore
    last_used: int = 0
    evicted: GroupSet = attrs.field(factory=GroupSet)
    """Groups evicted and not fetched again since: unknown, possibly partial."""
    cost: int = 0
    """Accounted bytes of this entry: its own overhead plus every group in ``groups``."""
    groups: dict[int, int] = attrs.field(factory=dict)
    """Accounted bytes per cached group (the store holds exactly these groups)."""
    refetching: list[tuple[int, int]] = attrs.field(factory=list)
    """Group intervals an upstream re-fetch is bringing back now."""
    reevicted: GroupSet = attrs.field(factory=GroupSet)
    """Groups evicted again while a re-fetch of them was in flight."""
    objects_received: int = 0
    bytes_received: int = 0
    duplicates: int = 0
    evicted_groups: int = 0
    evicted_bytes: int = 0
    group_bytes: dict[int, int] = attrs.field(factory=dict)
    """Per cached group: its objects' payload sizes plus their accounted costs."""
    largest_group: int = 0
    """The most ``group_bytes`` a group of this track ever reached (what a re-fetch of one
    group is estimated at, :meth:`RelayCore._pace`)."""


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


def _group_objects(store: TrackStore, gid: int) -> list[StoredObject]:
    return list(store.objects_in(Location(gid, 0), Location(gid, MAX_VI64)))


class Cache:
    """Every cached track and the shared byte budget (see the module docstring).

    Args:
        budget: accounted bytes allowed over all stores (module docstring).
        evict_to: eviction stops at ``evict_to * budget`` bytes.
    """

    def __init__(self, budget: int, evict_to: float) -> None:
        self.budget = budget
        self._low_water = int(budget * evict_to)
        self._entries: dict[FullTrackName, CacheEntry] = {}
        self._tick = 0
        self.total_bytes = 0
        """Accounted bytes held now: every entry's cost plus :attr:`pinned_bytes`."""
        self.pinned_bytes = 0
        """Accounted bytes of evicted objects that sessions still hold (module docstring)."""
        self.evicted_held_bytes = 0
        """Bytes of evicted objects that sessions still hold, payloads included (the
        payload buffers are in :attr:`buffer_bytes`, not :attr:`pinned_bytes`); with
        :attr:`transit_bytes`, what the relay's intake gate looks at
        (:attr:`held_outside_bytes`, :mod:`kvcs_core.relay.intake`)."""
        self.evicted_released_bytes = 0
        """Bytes released from :attr:`evicted_held_bytes` so far (monotonic)."""
        self.transit_released_bytes = 0
        """Bytes released from :attr:`transit_bytes` so far (monotonic)."""
        self._pins: dict[int, weakref.ref[StoredObject]] = {}
        self._buffers: dict[int, list[int]] = {}
        """Payload buffers held: key -> [objects holding it, its bytes] (each counted once)."""
        self.buffer_bytes = 0
        self.reserved_bytes = 0
        """Accounted bytes of track records (:meth:`reserve`), included in the total."""
        """Accounted bytes of payload buffers (included in :attr:`total_bytes`)."""
        self.peak_bytes = 0
        """The most ``total_bytes`` ever was after an input."""
        self.received_bytes = 0
        """Payload bytes appended or offered (duplicates included)."""
        self.received_objects = 0
        self.evicted_bytes = 0
        """Accounted bytes evicted so far."""
        self.evicted_groups = 0
        """Groups evicted so far (some may have been fetched again since)."""
        self.not_kept = 0
        """Objects forwarded but not kept (evicted in the step they arrived)."""
        self.transit_bytes = 0
        """Bytes of objects forwarded but never kept that sessions still hold (not part of
        :attr:`total_bytes`: bounded by the sessions' queue limits, module docstring)."""
        self._transit: dict[int, weakref.ref[StoredObject]] = {}
        self.emptied: list[FullTrackName] = []
        """Tracks whose last group was evicted since the owner last looked (it may forget
        them)."""

    # --- getters -------------------------------------------------------------------

    def get(self, name: FullTrackName) -> CacheEntry | None:
        return self._entries.get(name)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def over_budget(self) -> bool:
        return self.total_bytes > self.budget

    @property
    def held_outside_bytes(self) -> int:
        """Bytes sessions hold of objects the cache no longer keeps: evicted objects still
        held (:attr:`evicted_held_bytes`) and objects forwarded but never kept
        (:attr:`transit_bytes`), payloads included. Once pinned objects fill the budget,
        every new object is evicted in the step it arrives, so a stalled subscriber's
        queue grows in transit alone: both together are what its queue limit sees."""
        return self.evicted_held_bytes + self.transit_bytes

    @property
    def released_outside_bytes(self) -> int:
        """Bytes released from :attr:`held_outside_bytes` so far (monotonic: the intake
        gate sees sessions drain by it while new objects are evicted)."""
        return self.evicted_released_bytes + self.transit_released_bytes

    # --- commands ------------------------------------------------------------------

    def add(self, store: TrackStore) -> CacheEntry:
        """Start caching ``store`` (empty; replacing any entry of the same name)."""
        self.drop(store.name)
        self._tick += 1
        entry = CacheEntry(store, last_used=self._tick)
        self._entries[store.name] = entry
        cost = entry_cost(store)
        for gid in store.group_ids():
            objs = _group_objects(store, gid)
            gcost = GROUP_OVERHEAD + sum(object_cost(o) for o in objs)
            for o in objs:
                self._hold(o.payload)
            entry.groups[gid] = gcost
            size = entry.group_bytes[gid] = gcost + sum(o.size for o in objs)
            entry.largest_group = max(entry.largest_group, size)
            cost += gcost
        entry.cost = cost
        self.total_bytes += cost
        return entry

    def touch(self, entry: CacheEntry) -> None:
        """A downstream request was served from ``entry`` (LRU order)."""
        self._tick += 1
        entry.last_used = self._tick

    def append(self, entry: CacheEntry, e: ObjectReceived) -> StoredObject | None:
        """Cache one upstream object as received (its payload kept by reference where the
        view spans its buffer, else copied: module docstring, "Payload buffers").

        The caller keeps the budget with ``evict(tier_of, keep=<the result>)`` afterwards.

        Returns:
            The stored object when it is new, ``None`` for a duplicate.

        Raises:
            MalformedTrack: the object conflicts with what is cached (the store is
                unchanged; the caller drops the entry).
            ValueError: fields a store cannot hold (treated as malformed too).
        """
        store = entry.store
        before_n = len(store)
        payload = _own_buffer(e.payload)
        size = payload.nbytes
        self.received_bytes += size
        self.received_objects += 1
        entry.objects_received += 1
        entry.bytes_received += size
        loc = e.location
        old = store.get(loc)
        obj = store.append_received(  # fields the session's decoder already checked
            loc,
            payload,
            subgroup_id=e.subgroup_id,
            publisher_priority=e.publisher_priority,
            status=e.status,
            properties=e.properties,
        )
        gid = loc.group
        if len(store) == before_n:
            entry.duplicates += 1
            if old is not None and obj is not old:  # newer properties replaced the old
                delta = _kvps_cost(obj.properties) - _kvps_cost(old.properties)
                self._charge(entry, gid, delta)
            return None
        cost = object_cost(obj)
        if gid not in entry.groups:
            cost += GROUP_OVERHEAD
        self._charge(entry, gid, cost)
        self._hold(obj.payload)
        size = entry.group_bytes[gid] = entry.group_bytes.get(gid, 0) + cost + obj.size
        entry.largest_group = max(entry.largest_group, size)
        return obj

    def _hold(self, view: memoryview) -> int:
        key, size = _buffer_of(view)
        rec = self._buffers.get(key)
        if rec is None:
            rec = self._buffers[key] = [0, size]
            self.buffer_bytes += size
            self.total_bytes += size
        rec[0] += 1
        return key

    def _let_go(self, key: int) -> None:
        rec = self._buffers.get(key)
        if rec is None:
            return
        rec[0] -= 1
        if rec[0] <= 0:
            del self._buffers[key]
            self.buffer_bytes -= rec[1]
            self.total_bytes -= rec[1]

    def _charge(self, entry: CacheEntry, gid: int, delta: int) -> None:
        entry.groups[gid] = entry.groups.get(gid, 0) + delta
        entry.cost += delta
        self.total_bytes += delta

    def drop(self, name: FullTrackName) -> None:
        """Forget a track's cache entirely (malformed track, forgotten track)."""
        entry = self._entries.pop(name, None)
        if entry is None:
            return
        for gid in list(entry.groups):
            self._evict_group(entry, gid, keep=None)
        self.total_bytes -= entry.cost
        entry.cost = 0

    def refetching(self, entry: CacheEntry, groups: range) -> None:
        """An upstream FETCH now brings ``groups`` back (see :meth:`unevict`)."""
        entry.refetching.append((groups.start, groups.stop - 1))

    def unevict(self, entry: CacheEntry, groups: range) -> None:
        """Groups fetched again: they are whole (as far as upstream has them) again,
        except those evicted again while the fetch was in flight. O(intervals)."""
        lo, hi = groups.start, groups.stop - 1
        if (lo, hi) in entry.refetching:
            entry.refetching.remove((lo, hi))
        for a, b in entry.reevicted.complement_within(lo, hi):
            entry.evicted.discard_range(a, b)
        if not entry.refetching:
            entry.reevicted = GroupSet()

    def reserve(self, nbytes: int, tier_of: TierFn) -> bool:
        """Charge ``nbytes`` held outside the stores (a track record), evicting groups to
        make room; ``False`` (nothing charged) when even that leaves no room."""
        if self.total_bytes + nbytes > self.budget:
            self.total_bytes += nbytes
            self.evict(tier_of)
            self.total_bytes -= nbytes
            if self.total_bytes + nbytes > self.budget:
                return False
        self.reserved_bytes += nbytes
        self.total_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Undo a :meth:`reserve`."""
        self.reserved_bytes -= nbytes
        self.total_bytes -= nbytes

    def settle(self, tier_of: TierFn) -> None:
        """After an input: evict if over budget, note the peak."""
        if self.total_bytes > self.budget:
            self.evict(tier_of)
        self._peak()

    def evict(
        self, tier_of: TierFn, keep: StoredObject | None = None
    ) -> list[tuple[FullTrackName, int]]:
        """Bring the accounted bytes back within the budget (module docstring).

        Args:
            keep: the object just appended, if any: when its group is evicted it is
                forwarded but not kept (not pinned, counted in :attr:`not_kept`).

        Returns:
            ``(track, group)`` for every group evicted, in order.
        """
        out: list[tuple[FullTrackName, int]] = []
        if self.total_bytes <= self.budget:
            self._peak()
            return out
        candidates: list[tuple[int, int, CacheEntry, int | None, Spans]] = []
        for entry in self._entries.values():
            if not entry.groups:
                continue
            tier, protected, spans = tier_of(entry)
            if tier is None:
                candidates.append((3, entry.last_used, entry, None, spans))
            else:
                candidates.append((tier, entry.last_used, entry, protected, spans))
        candidates.sort(key=lambda c: (c[0], c[1]))
        # pass 1: unprotected groups, down to the low-water mark
        for tier, _used, entry, protected, spans in candidates:
            if tier == 3:
                continue
            for gid in sorted(entry.groups):
                if self.total_bytes <= self._low_water:
                    break
                if gid == protected or any(a <= gid <= b for a, b in spans):
                    continue
                self._evict_group(entry, gid, keep)
                out.append((entry.store.name, gid))
        # pass 2 (last resort): protected groups too, down to the budget; wanted ones last
        for _tier, _used, entry, _protected, spans in candidates:
            order = sorted(entry.groups, key=lambda g: (any(a <= g <= b for a, b in spans), g))
            for gid in order:
                if self.total_bytes <= self.budget:
                    break
                self._evict_group(entry, gid, keep)
                out.append((entry.store.name, gid))
        self._peak()
        return out

    def _evict_group(self, entry: CacheEntry, gid: int, keep: StoredObject | None) -> None:
        store = entry.store
        objs = _group_objects(store, gid)
        store.evict_group(gid)
        gcost = entry.groups.pop(gid, 0)
        entry.group_bytes.pop(gid, None)
        if not entry.groups:
            self.emptied.append(store.name)
        entry.cost -= gcost
        self.total_bytes -= gcost
        self.evicted_bytes += gcost
        self.evicted_groups += 1
        entry.evicted.add(gid)
        entry.evicted_groups += 1
        entry.evicted_bytes += gcost
        if any(a <= gid <= b for a, b in entry.refetching):
            entry.reevicted.add(gid)
        for obj in objs:
            bkey, _size = _buffer_of(obj.payload)
            if obj is keep:
                self.not_kept += 1
                self._let_go(bkey)  # forwarded, never kept: in transit only
                self._in_transit(obj)
                continue
            self._pin(obj, object_cost(obj), bkey)

    def _in_transit(self, obj: StoredObject) -> None:
        """Count a forwarded, never kept object in :attr:`transit_bytes` while it lives."""
        key, cost = id(obj), OBJECT_OVERHEAD + obj.size
        transit = self._transit

        def release(_ref: object, key: int = key, cost: int = cost) -> None:
            if transit.pop(key, None) is not None:
                self.transit_bytes -= cost
                self.transit_released_bytes += cost

        transit[key] = weakref.ref(obj, release)
        self.transit_bytes += cost

    def _pin(self, obj: StoredObject, cost: int, bkey: int) -> None:
        """Count ``obj`` (and its buffer) until the last reference to it goes."""
        key = id(obj)
        pins = self._pins

        held = cost + obj.size

        def release(
            _ref: object, key: int = key, cost: int = cost, bkey: int = bkey, held: int = held
        ) -> None:
            if pins.pop(key, None) is not None:
                self.pinned_bytes -= cost
                self.evicted_held_bytes -= held
                self.evicted_released_bytes += held
                self.total_bytes -= cost
                self._let_go(bkey)

        pins[key] = weakref.ref(obj, release)
        self.pinned_bytes += cost
        self.evicted_held_bytes += held
        self.total_bytes += cost

    def _peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)
