"""The objects of one track, held once and shared by every session that serves it.

Theory of operation
-------------------
A :class:`TrackStore` is the publisher-side store of one track (and, later, a
relay's cache of it). It is pure and in memory: it holds *references* to the
payload buffers its caller appends (as byte ``memoryview`` objects, never a
copy, STYLE.md R8), so the caller must neither mutate nor resize a buffer once
it is appended; a ``bytearray`` stays pinned (``BufferError`` on resize) while
the store holds it. Memory is bounded by the caller: an original publisher
keeps what it publishes, a relay calls :meth:`TrackStore.evict_group`.

Caching rules (d21 section 7.1, wire reference 10 and 7.10):

* The key is ``(Group ID, Object ID)`` (:class:`~kvcs_core.wire.names.Location`).
  Re-appending an identical object is a no-op that returns the stored one. A
  duplicate whose forwarding preference, Subgroup ID, priority, status, payload
  or ``IMMUTABLE_PROPERTIES`` differ makes the track *malformed*
  (:class:`ConflictingObject`). Other properties may change: a newer set
  replaces the stored set, never merged (d21 section 8.4); listeners are not
  called again for it.
* End of Group and End of Track (d21 section 11.1.2, wire reference 7.8) are
  status objects with no payload and no properties; they are stored like any
  object, so a relay can forward them. An object beyond a group's End of Group
  or beyond the track's End of Track, a marker placed below an object that
  already exists, or a priority change within a subgroup also makes the track
  malformed (:class:`BeyondEnd`, :class:`ConflictingObject`; d21 section 12.1).
  A relay catches :class:`MalformedTrack` to end downstream subscriptions with
  PUBLISH_DONE(MALFORMED_TRACK) and does not cache the offending object: the
  store is left unchanged when it raises.
* :attr:`TrackStore.largest` is the Largest Object of d21 section 3.1.3, the
  largest Location appended (status objects count). Eviction does not lower
  it: an evicted Location becomes *unknown*, not non-existent (d21 section 7.1).
  Because d22 moves Largest Object on an object's first byte (Ambiguity A27),
  a relay that sees a header before the whole object may call
  :meth:`TrackStore.observe_largest`; the session then waits for that object
  before ending a fill at it.

Bulk path: :meth:`TrackStore.append_group` stores a whole new group at once
(an original publisher that produces one group per step): Objects ``0..n-1`` of
subgroup 0 with one priority, then optionally its End of Group. It validates
once per group, before anything is stored (so a failing call stores nothing),
then stores and announces the objects one at a time exactly as the matching
sequence of :meth:`TrackStore.append` calls would (same objects, same sequence
numbers, same listener calls in the same order).

Listeners and re-entrancy: :meth:`TrackStore.append` stores the object, then
calls every listener synchronously, in registration order (a session enqueues
the object for its live subscriptions). A listener must not append to the same
store; doing so raises ``RuntimeError``. A listener may add or remove
listeners: one removed during a notification is not called afterwards, one
added is called from the next object on. If listeners raise, the rest are still
called and the first exception (or an ``ExceptionGroup`` of all of them) is
re-raised after the last one: the object stays stored.

Filling and eviction watchers (cut-through relaying): a cache that has
answered requests for objects still on their way from upstream marks the store
:attr:`TrackStore.filling` (:meth:`TrackStore.set_filling`); a session keeps
the fetch-format streams of such requests open while it is set, sending each
object as it arrives, and finishes them when it is cleared. Watchers
(:meth:`TrackStore.watch`) are told when the store settles (filling cleared)
and when a group is evicted (a session then counts what its queues still hold
of that group, the only bytes a slow subscriber costs beyond the cache).

Range iteration (:meth:`TrackStore.objects_in`) is lazy and tolerant of
concurrent appends and evictions: the cursor re-finds its place by bisection on
each step, so an object appended ahead of the cursor is yielded, one appended
behind it is not, and an evicted one is skipped.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

import attrs

from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.wire.codes import MAX_VI64, GroupOrder, ObjectStatus, PropertyType
from kvcs_core.wire.kvp import KeyValuePair, KeyValuePairs
from kvcs_core.wire.names import FullTrackName, Location

__all__ = [
    "BeyondEnd",
    "ConflictingObject",
    "ListenerHandle",
    "MalformedTrack",
    "StoreChange",
    "StoredObject",
    "TrackStore",
    "as_payload_view",
]

_EMPTY: Final = memoryview(b"")


class StoreChange(enum.IntEnum):
    """What a watcher (:meth:`TrackStore.watch`) is told about."""

    SETTLED = 1
    """The store stopped filling: no object announced as on its way will come now."""
    EVICTED = 2
    """A group was evicted (the value passed along is its Group ID)."""


class MalformedTrack(LocalProtocolError, ValueError):
    """An append that would make the track malformed (d21 section 12.1); the store is unchanged.

    A :class:`~kvcs_core.moqt.errors.LocalProtocolError` for an original
    publisher (its own misuse) and a ``ValueError``; a relay catches it to
    detect a malformed upstream track.

    Attributes:
        location: the Location of the offending object.
    """

    def __init__(self, location: Location, reason: str) -> None:
        super().__init__(f"malformed track at {location}: {reason}")
        self.location: Final = location
        self.reason: Final = reason


class ConflictingObject(MalformedTrack):
    """The same Location again with different content, or a priority change in a subgroup."""


class BeyondEnd(MalformedTrack):
    """An object beyond End of Group / End of Track, or a marker below an existing object."""


def as_payload_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte (``"B"``) memoryview of ``payload`` without copying it.

    Raises:
        ValueError: ``payload`` is not a C-contiguous bytes-like object.
    """
    try:
        mv = payload if isinstance(payload, memoryview) else memoryview(payload)
    except TypeError:
        raise ValueError(f"payload must be bytes-like, not {type(payload).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError("payload must be a C-contiguous buffer (no copy is made)")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _payload_repr(view: memoryview) -> str:
    return f"<{view.nbytes} bytes>"


def _check_priority(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"{what} {value!r} is not in 0..255")
    return value


@attrs.frozen
class StoredObject:
    """One object as stored (d21 section 11.1): immutable, payload by reference.

    Equality compares payload contents; the hash leaves the payload out.
    """

    location: Location
    """``{Group ID, Object ID}``."""
    subgroup_id: int | None
    """The Subgroup ID, or ``None`` for Datagram forwarding preference."""
    publisher_priority: int
    """Resolved Publisher Priority (the track default applied), 0 = most urgent."""
    status: ObjectStatus
    """NORMAL, END_OF_GROUP or END_OF_TRACK."""
    properties: KeyValuePairs
    """Object Properties in wire order (empty for status objects)."""
    payload: memoryview = attrs.field(repr=_payload_repr, hash=False)
    """The caller's buffer as a byte memoryview (empty for status objects)."""
    datagram: bool
    """Forwarding preference: ``True`` = Datagram, ``False`` = Subgroup."""
    seq: int
    """Arrival order within the store, strictly increasing from 0."""
    head: bytes = attrs.field(default=b"", repr=False)
    """Bytes of the object payload that precede ``payload`` (e.g. a KVCS object header
    before the tensor data): the object's payload is ``head + payload``, kept apart so
    that neither is copied to join them (scatter/gather, STYLE.md R8)."""

    @property
    def group_id(self) -> int:
        """``location.group``."""
        return self.location.group

    @property
    def object_id(self) -> int:
        """``location.object``."""
        return self.location.object

    @property
    def size(self) -> int:
        """Payload length in bytes (``head`` included)."""
        return len(self.head) + self.payload.nbytes

    def payload_bytes(self) -> bytes:
        """The whole object payload as one bytes object (a copy: tests and rare paths)."""
        return self.head + bytes(self.payload)


def _normal_object_builder() -> Callable[
    [Location, int, memoryview, int, bytes, KeyValuePairs], StoredObject
]:
    new = object.__new__
    names: tuple[str, ...] = ("location", "subgroup_id", "publisher_priority", "status")
    names += ("properties", "payload", "datagram", "seq", "head")
    (loc, sg, prio, status, props, payload, dgram, seq, head) = (
        getattr(StoredObject, name).__set__ for name in names
    )
    normal = ObjectStatus.NORMAL

    def build(
        location: Location,
        priority: int,
        view: memoryview,
        number: int,
        octets: bytes,
        properties: KeyValuePairs,
    ) -> StoredObject:
        obj: StoredObject = new(StoredObject)
        loc(obj, location)
        sg(obj, 0)
        prio(obj, priority)
        status(obj, normal)
        props(obj, properties)
        payload(obj, view)
        dgram(obj, False)
        seq(obj, number)
        head(obj, octets)
        return obj

    return build


_normal_object: Final = _normal_object_builder()
"""``StoredObject(location, 0, priority, NORMAL, properties, payload, False, seq, head)`` for values
``append_group`` has checked: the slots are filled directly (the per-Object path)."""


@attrs.frozen
class ListenerHandle:
    """What :meth:`TrackStore.subscribe_listener` returns; pass it to ``remove_listener``."""

    id: int


Listener = Callable[[StoredObject], None]
Watcher = Callable[[StoreChange, int], None]


def _immutable(props: KeyValuePairs) -> tuple[KeyValuePair, ...]:
    return tuple(p for p in props if p.type == PropertyType.IMMUTABLE_PROPERTIES)


class _Group:
    """The stored objects of one group, Object IDs kept sorted."""

    __slots__ = ("end", "ids", "objects", "subgroup_first", "subgroup_priority")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.objects: dict[int, StoredObject] = {}
        self.end: int | None = None  # Object ID of an End of Group / End of Track here
        self.subgroup_priority: dict[int, int] = {}
        self.subgroup_first: dict[int, int] = {}  # Subgroup ID -> its lowest Object ID seen

    def insert(self, obj: StoredObject) -> None:
        oid = obj.location.object
        if not self.ids or oid > self.ids[-1]:
            self.ids.append(oid)
        else:
            bisect.insort(self.ids, oid)
        self.objects[oid] = obj


class TrackStore:
    """All known objects of one track; see the module docstring.

    Args:
        name: the Full Track Name.
        default_publisher_priority: DEFAULT_PUBLISHER_PRIORITY (Track Property
            0x0E), applied to objects appended without a priority.
        group_order: DEFAULT_PUBLISHER_GROUP_ORDER (Track Property 0x22).
        track_properties: the Track Properties sent in SUBSCRIBE_OK, PUBLISH,
            FETCH_OK and TRACK_STATUS answers. If they carry 0x0E or 0x22, the
            values must agree with the two arguments above.

    Raises:
        ValueError: a priority outside 0..255 or disagreeing Track Properties.
    """

    def __init__(
        self,
        name: FullTrackName,
        *,
        default_publisher_priority: int = 128,
        group_order: GroupOrder = GroupOrder.ASCENDING,
        track_properties: Iterable[KeyValuePair] = (),
    ) -> None:
        self.name: Final = name
        self.default_publisher_priority: Final = _check_priority(
            default_publisher_priority, "default_publisher_priority"
        )
        self.group_order: Final = GroupOrder(group_order)
        self.track_properties: Final[KeyValuePairs] = tuple(track_properties)
        for p in self.track_properties:
            if p.type == PropertyType.DEFAULT_PUBLISHER_PRIORITY and p.value != (
                self.default_publisher_priority
            ):
                raise ValueError("DEFAULT_PUBLISHER_PRIORITY property disagrees with the argument")
            if p.type == PropertyType.DEFAULT_PUBLISHER_GROUP_ORDER and p.value != self.group_order:
                raise ValueError(
                    "DEFAULT_PUBLISHER_GROUP_ORDER property disagrees with the argument"
                )
        self._groups: dict[int, _Group] = {}
        self._group_ids: list[int] = []  # sorted
        self._largest: Location | None = None
        self._end_of_track: Location | None = None
        self._next_seq = 0
        self._total_bytes = 0
        self._count = 0
        self._listeners: dict[int, Listener] = {}
        self._next_listener = 0
        self._notifying = False
        self._watchers: dict[int, Watcher] = {}
        self._filling = False

    # --- getters ---------------------------------------------------------------

    @property
    def largest(self) -> Location | None:
        """Largest Object (d21 section 3.1.3): the largest Location known; ``None`` if none."""
        return self._largest

    @property
    def end_of_track(self) -> Location | None:
        """Location of the End of Track object, once appended."""
        return self._end_of_track

    @property
    def total_bytes(self) -> int:
        """Sum of the payload lengths of the objects stored now."""
        return self._total_bytes

    def __len__(self) -> int:
        """Number of objects stored now (status objects included)."""
        return self._count

    def __contains__(self, location: object) -> bool:
        return isinstance(location, Location) and self.get(location) is not None

    def group_ids(self) -> tuple[int, ...]:
        """The Group IDs with at least one stored object, ascending."""
        return tuple(self._group_ids)

    def get(self, location: Location) -> StoredObject | None:
        """The stored object at ``location``, or ``None`` (unknown or evicted)."""
        grp = self._groups.get(location.group)
        return None if grp is None else grp.objects.get(location.object)

    def group_end(self, group_id: int) -> Location | None:
        """Location of the End of Group (or End of Track) object of ``group_id``, if known."""
        grp = self._groups.get(group_id)
        if grp is not None and grp.end is not None:
            return Location(group_id, grp.end)
        eot = self._end_of_track
        if eot is not None and eot.group == group_id:
            return eot
        return None

    def objects_in(
        self,
        start: Location,
        end: Location | None = None,
        order: GroupOrder = GroupOrder.ASCENDING,
    ) -> Iterator[StoredObject]:
        """Stored objects with ``start <= location <= end``, lazily.

        Within a group Object IDs ascend; groups ascend or descend by ``order``
        (d21 section 11.4.1). ``end=None`` means :attr:`largest` *at the time of
        this call* (so a fill's end is fixed when it is computed, A27). Gaps
        (unknown, evicted or non-existent Locations) are simply skipped. The
        iterator tolerates appends and evictions between steps (module docstring).
        """
        if end is None:
            end = self._largest
        if end is None or end < start:
            return iter(())
        if order == GroupOrder.DESCENDING:
            return self._iter_descending(start, end)
        return self._iter_ascending(start, end)

    def _iter_ascending(self, start: Location, end: Location) -> Iterator[StoredObject]:
        g = start.group
        while True:
            i = bisect.bisect_left(self._group_ids, g)
            if i == len(self._group_ids):
                return
            gid = self._group_ids[i]
            if gid > end.group:
                return
            yield from self._iter_group(gid, start, end)
            if gid == MAX_VI64:
                return
            g = gid + 1

    def _iter_descending(self, start: Location, end: Location) -> Iterator[StoredObject]:
        g = end.group
        while True:
            i = bisect.bisect_right(self._group_ids, g) - 1
            if i < 0:
                return
            gid = self._group_ids[i]
            if gid < start.group:
                return
            yield from self._iter_group(gid, start, end)
            if gid == 0:
                return
            g = gid - 1

    def _iter_group(self, gid: int, start: Location, end: Location) -> Iterator[StoredObject]:
        nxt = start.object if gid == start.group else 0
        hi = end.object if gid == end.group else MAX_VI64
        while True:
            grp = self._groups.get(gid)
            if grp is None:
                return
            i = bisect.bisect_left(grp.ids, nxt)
            if i == len(grp.ids):
                return
            oid = grp.ids[i]
            if oid > hi:
                return
            yield grp.objects[oid]
            if oid == MAX_VI64:
                return
            nxt = oid + 1

    # --- listeners ---------------------------------------------------------------

    def subscribe_listener(self, callback: Listener) -> ListenerHandle:
        """Call ``callback(obj)`` after every new object is stored (never for no-op re-appends)."""
        handle = ListenerHandle(self._next_listener)
        self._next_listener += 1
        self._listeners[handle.id] = callback
        return handle

    def remove_listener(self, handle: ListenerHandle) -> None:
        """Stop calling a listener (or watcher); removing one already gone does nothing."""
        self._listeners.pop(handle.id, None)
        self._watchers.pop(handle.id, None)

    def watch(self, callback: Watcher) -> ListenerHandle:
        """Call ``callback(change, value)`` on every :class:`StoreChange` (module docstring).

        Remove it with :meth:`remove_listener`, like an object listener."""
        handle = ListenerHandle(self._next_listener)
        self._next_listener += 1
        self._watchers[handle.id] = callback
        return handle

    @property
    def filling(self) -> bool:
        """Objects answered for are still on their way into the store (module docstring)."""
        return self._filling

    def set_filling(self, on: bool) -> None:
        """Mark the store filling, or settled; settling tells every watcher."""
        was, self._filling = self._filling, on
        if was and not on:
            self._tell(StoreChange.SETTLED, 0)

    def _tell(self, change: StoreChange, value: int) -> None:
        for wid, cb in tuple(self._watchers.items()):
            if wid in self._watchers:
                cb(change, value)

    def _notify(self, obj: StoredObject) -> None:
        errors: list[Exception] = []
        self._notify_into(obj, errors)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("track store listeners failed", errors)

    def _notify_into(self, obj: StoredObject, errors: list[Exception]) -> None:
        """Call every listener with ``obj``; what they raise is appended to ``errors``."""
        self._notifying = True
        try:
            for lid, cb in tuple(self._listeners.items()):
                if lid not in self._listeners:
                    continue  # removed by an earlier listener
                try:
                    cb(obj)
                except Exception as e:  # re-raised below, after every listener ran
                    errors.append(e)
        finally:
            self._notifying = False

    # --- commands ---------------------------------------------------------------

    def append(
        self,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview = b"",
        head: bytes = b"",
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int | None = None,
        status: ObjectStatus = ObjectStatus.NORMAL,
        properties: Iterable[KeyValuePair] = (),
        datagram: bool = False,
    ) -> StoredObject:
        """Store one object and tell the listeners.

        Args:
            group_id, object_id: its Location.
            payload: the payload, held by reference (empty for status objects).
            subgroup_id: Subgroup ID for Subgroup preference; must be 0 or
                ``None`` with ``datagram=True`` (stored as ``None``).
            publisher_priority: ``None`` = the priority of the subgroup if it
                already holds objects (so an End of Group need not repeat it),
                else the track's default.
            status: NORMAL, END_OF_GROUP or END_OF_TRACK.
            properties: Object Properties (Normal objects only).
            datagram: Datagram forwarding preference.

        Returns:
            The stored object (the existing one for an identical re-append).

        Raises:
            ConflictingObject: same Location, different content; or a
                different priority in a subgroup that already has one.
            BeyondEnd: beyond End of Group / End of Track, or such a marker
                below an existing object.
            ValueError: invalid arguments (IDs, priority, a status object with
                a payload or properties, a datagram with a Subgroup ID).
            RuntimeError: called from inside a listener of this store.
        """
        if self._notifying:
            raise RuntimeError("a TrackStore listener must not append to the store")
        loc = Location(group_id, object_id)
        status = ObjectStatus(status)
        props = tuple(properties)
        for p in props:
            if not isinstance(p, KeyValuePair):
                raise ValueError(f"property {p!r} is not a KeyValuePair")
        view = as_payload_view(payload)
        if datagram:
            if subgroup_id not in (0, None):
                raise ValueError("a Datagram-preference object has no Subgroup ID")
            sg: int | None = None
        else:
            if subgroup_id is None or not 0 <= subgroup_id <= MAX_VI64:
                raise ValueError(f"subgroup_id {subgroup_id!r} is not a vi64")
            sg = subgroup_id
        if status is not ObjectStatus.NORMAL:
            if view.nbytes:
                raise ValueError(f"a {status.name} object has no payload")
            if props:
                raise ValueError(f"a {status.name} object has no properties")
            view = _EMPTY

        return self._store(loc, sg, publisher_priority, status, props, view, datagram, bytes(head))

    def append_received(
        self,
        location: Location,
        payload: memoryview,
        *,
        subgroup_id: int | None,
        publisher_priority: int,
        status: ObjectStatus,
        properties: KeyValuePairs,
    ) -> StoredObject:
        """:meth:`append` for an object a session decoded (a relay's cache): trusted fields.

        The wire decoder has already checked what :meth:`append` re-checks: the
        Location and Subgroup ID are vi64, the priority is 0..255, ``status`` is an
        :class:`ObjectStatus`, ``properties`` a tuple of ``KeyValuePair`` and
        ``payload`` a byte view (empty for status objects). ``subgroup_id`` ``None``
        means Datagram forwarding preference. Everything that depends on what the
        store already holds is checked as in :meth:`append` (conflicts, duplicates,
        End of Group / End of Track), with the same exceptions.
        """
        if self._notifying:
            raise RuntimeError("a TrackStore listener must not append to the store")
        if status is not ObjectStatus.NORMAL:
            if payload.nbytes or properties:
                raise ValueError(f"a {status.name} object has no payload or properties")
            payload = _EMPTY
        return self._store(
            location,
            subgroup_id,
            publisher_priority,
            status,
            properties,
            payload,
            subgroup_id is None,
            b"",
        )

    def _store(
        self,
        loc: Location,
        sg: int | None,
        publisher_priority: int | None,
        status: ObjectStatus,
        props: KeyValuePairs,
        view: memoryview,
        datagram: bool,
        head: bytes,
    ) -> StoredObject:
        """The part of :meth:`append` that depends on what the store holds."""
        group_id, object_id = loc.group, loc.object
        grp = self._groups.get(group_id)
        if publisher_priority is None:
            # a subgroup has one priority (d21 section 5.1): inherit it, else the track default
            known = None if grp is None or sg is None else grp.subgroup_priority.get(sg)
            publisher_priority = self.default_publisher_priority if known is None else known
        prio = _check_priority(publisher_priority, "publisher_priority")
        if head and status is not ObjectStatus.NORMAL:
            raise ValueError(f"a {status.name} object has no payload")
        cand = StoredObject(loc, sg, prio, status, props, view, datagram, self._next_seq, head)
        if grp is not None:
            existing = grp.objects.get(object_id)
            if existing is not None:
                return self._reappend(grp, existing, cand)
        self._check_ends(loc, grp, status)
        if sg is not None and grp is not None:
            known = grp.subgroup_priority.get(sg)
            if known is not None and known != prio:
                raise ConflictingObject(
                    loc, f"priority {prio} in subgroup {sg}, which has priority {known}"
                )

        obj = cand
        self._next_seq += 1
        if grp is None:
            grp = self._groups[group_id] = _Group()
            if not self._group_ids or group_id > self._group_ids[-1]:
                self._group_ids.append(group_id)
            else:
                bisect.insort(self._group_ids, group_id)
        grp.insert(obj)
        if sg is not None:
            grp.subgroup_priority[sg] = prio
            first = grp.subgroup_first.get(sg)
            if first is None or object_id < first:
                grp.subgroup_first[sg] = object_id
        if status is not ObjectStatus.NORMAL:
            grp.end = object_id
            if status is ObjectStatus.END_OF_TRACK:
                self._end_of_track = loc
        self._count += 1
        self._total_bytes += obj.size
        if self._largest is None or loc > self._largest:
            self._largest = loc
        self._notify(obj)
        return obj

    def append_group(
        self,
        group_id: int,
        payloads: Sequence[bytes | bytearray | memoryview],
        heads: Sequence[bytes] | None = None,
        *,
        publisher_priority: int | None = None,
        end_of_group: bool = True,
        properties: Iterable[KeyValuePair] = (),
    ) -> tuple[StoredObject, ...]:
        """Store a whole new group: Objects ``0..n-1`` in subgroup 0, then End of Group.

        The trusted bulk path of an original publisher (module docstring): the
        same as ``append(group_id, i, payloads[i], heads[i],
        publisher_priority=publisher_priority)`` for every ``i`` in order, then
        ``append(group_id, n, status=END_OF_GROUP, ...)`` when ``end_of_group``,
        except that every check runs once, before anything is stored, and that
        listener errors are re-raised after the last object (each object is
        stored and announced to every listener even if one raised; the first
        exception, or an ``ExceptionGroup`` of all of them, is re-raised).

        Args:
            group_id: a Group ID that holds no stored object.
            payloads: the Object payloads in Object ID order, held by reference.
            heads: per Object, the octets that precede its payload (see
                :attr:`StoredObject.head`); ``None`` = none.
            publisher_priority: one priority for the whole group (subgroup 0);
                ``None`` = the track's default.
            end_of_group: also store End of Group at Object ID ``n``.
            properties: the same Object Properties on every Normal Object (e.g. the
                Secure Object Key ID); End of Group has none.

        Returns:
            The stored objects, End of Group included.

        Raises:
            ValueError: an invalid Group ID or priority, a payload that is not a
                C-contiguous buffer, a head that is not bytes, ``heads`` of
                another length, or a group that already holds objects (append
                to it one object at a time).
            BeyondEnd: the group reaches beyond End of Track.
            RuntimeError: called from inside a listener of this store.
        """
        if self._notifying:
            raise RuntimeError("a TrackStore listener must not append to the store")
        n = len(payloads)
        if heads is not None and len(heads) != n:
            raise ValueError(f"{len(heads)} heads for {n} payloads")
        last = n if end_of_group else n - 1
        if last < 0:
            return ()
        last_loc = Location(group_id, last)  # validates the Group ID (and n) once
        if group_id in self._groups:
            raise ValueError(f"group {group_id} already holds objects: append them one by one")
        eot = self._end_of_track
        if eot is not None and last_loc > eot:
            raise BeyondEnd(last_loc, f"object after End of Track at {eot}")
        prio = _check_priority(
            self.default_publisher_priority if publisher_priority is None else publisher_priority,
            "publisher_priority",
        )
        props = tuple(properties)
        for pair in props:
            if not isinstance(pair, KeyValuePair):
                raise ValueError(f"a property must be a KeyValuePair, not {type(pair).__name__}")
        views: list[memoryview] = []
        for p in payloads:
            if type(p) is memoryview and p.format == "B" and p.ndim == 1 and p.c_contiguous:
                views.append(p)
            else:
                views.append(as_payload_view(p))
        if heads is None:
            head_list: Sequence[bytes] = (b"",) * n
        else:
            for h in heads:
                if type(h) is not bytes:
                    raise ValueError(f"a head must be bytes, not {type(h).__name__}")
            head_list = heads

        # every check passed: store and announce one object at a time, like append()
        groups, listeners = self._groups, self._listeners
        grp = self._new_group(group_id, prio, 0)
        largest = self._largest
        # every Location of this group is beyond a Largest Object in an earlier group
        beyond = largest is None or largest.group < group_id
        errors: list[Exception] = []
        out: list[StoredObject] = []
        trusted = Location.trusted
        for oid in range(n):
            if listeners and groups.get(group_id) is not grp:
                grp = self._new_group(group_id, prio, oid)  # a listener evicted the group
            view, head = views[oid], head_list[oid]
            loc = trusted(group_id, oid)
            obj = _normal_object(loc, prio, view, self._next_seq, head, props)
            self._next_seq += 1
            grp.ids.append(oid)
            grp.objects[oid] = obj
            self._count += 1
            self._total_bytes += len(head) + view.nbytes
            if beyond or loc > self._largest:  # type: ignore[operator]
                self._largest = loc
            out.append(obj)
            if listeners:
                self._notify_into(obj, errors)
        if end_of_group:
            if listeners and groups.get(group_id) is not grp:
                grp = self._new_group(group_id, prio, n)
            obj = StoredObject(
                last_loc, 0, prio, ObjectStatus.END_OF_GROUP, (), _EMPTY, False, self._next_seq
            )
            self._next_seq += 1
            grp.ids.append(n)
            grp.objects[n] = obj
            grp.end = n
            self._count += 1
            if self._largest is None or last_loc > self._largest:
                self._largest = last_loc
            out.append(obj)
            if self._listeners:
                self._notify_into(obj, errors)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("track store listeners failed", errors)
        return tuple(out)

    def _new_group(self, group_id: int, priority: int, first: int) -> _Group:
        """An empty group for ``append_group``, subgroup 0 set up as its first append would."""
        grp = self._groups[group_id] = _Group()
        if not self._group_ids or group_id > self._group_ids[-1]:
            self._group_ids.append(group_id)
        else:
            bisect.insort(self._group_ids, group_id)
        grp.subgroup_priority[0] = priority
        grp.subgroup_first[0] = first
        return grp

    def _reappend(self, grp: _Group, existing: StoredObject, cand: StoredObject) -> StoredObject:
        loc = existing.location
        diffs = [
            what
            for what, same in (
                ("forwarding preference", existing.datagram == cand.datagram),
                ("Subgroup ID", existing.subgroup_id == cand.subgroup_id),
                ("publisher priority", existing.publisher_priority == cand.publisher_priority),
                ("status", existing.status == cand.status),
                (
                    "payload",
                    (existing.head, existing.payload) == (cand.head, cand.payload)
                    or existing.payload_bytes() == cand.payload_bytes(),
                ),
                (
                    "immutable properties",
                    _immutable(existing.properties) == _immutable(cand.properties),
                ),
            )
            if not same
        ]
        if diffs:
            raise ConflictingObject(loc, "duplicate with a different " + ", ".join(diffs))
        if existing.properties == cand.properties:
            return existing
        # d21 section 8.4: a newer set of (mutable) properties replaces the cached set.
        updated = attrs.evolve(existing, properties=cand.properties)
        grp.objects[loc.object] = updated
        return updated

    def _check_ends(self, loc: Location, grp: _Group | None, status: ObjectStatus) -> None:
        eot = self._end_of_track
        if eot is not None and loc > eot:
            raise BeyondEnd(loc, f"object after End of Track at {eot}")
        if grp is not None and grp.end is not None and loc.object > grp.end:
            raise BeyondEnd(loc, f"object after End of Group at {{{loc.group},{grp.end}}}")
        if (
            status is ObjectStatus.END_OF_GROUP
            and grp is not None
            and grp.ids
            and grp.ids[-1] > loc.object
        ):
            raise BeyondEnd(loc, f"End of Group below object {{{loc.group},{grp.ids[-1]}}}")
        largest = self._largest
        if status is ObjectStatus.END_OF_TRACK and largest is not None and largest > loc:
            raise BeyondEnd(loc, f"End of Track below Largest Object {largest}")

    def observe_largest(self, location: Location) -> None:
        """Raise :attr:`largest` to ``location`` without storing an object (A27).

        For a relay that has read an object's header but not yet its payload
        (d22 moves Largest Object on the first byte).

        Raises:
            BeyondEnd: ``location`` is after End of Track.
        """
        eot = self._end_of_track
        if eot is not None and location > eot:
            raise BeyondEnd(location, f"object after End of Track at {eot}")
        if self._largest is None or location > self._largest:
            self._largest = location

    def subgroup_first(self, group_id: int, subgroup_id: int) -> int | None:
        """The lowest Object ID stored in a subgroup (None if none): whether a stream that
        starts at some object starts at the subgroup's first (FIRST_OBJECT, d21 11.3.1)."""
        grp = self._groups.get(group_id)
        return None if grp is None else grp.subgroup_first.get(subgroup_id)

    def evict_group(self, group_id: int) -> int:
        """Forget every object of ``group_id``; they become *unknown* (d21 section 7.1).

        :attr:`largest` and :attr:`end_of_track` are kept. An End of Group marker of
        the group is forgotten with it.

        Returns:
            The payload bytes freed (0 for a group that is not stored).
        """
        grp = self._groups.pop(group_id, None)
        if grp is None:
            return 0
        i = bisect.bisect_left(self._group_ids, group_id)
        del self._group_ids[i]
        freed = sum(o.size for o in grp.objects.values())
        self._total_bytes -= freed
        self._count -= len(grp.objects)
        if self._watchers:
            self._tell(StoreChange.EVICTED, group_id)
        return freed

    def __repr__(self) -> str:
        return (
            f"<TrackStore {self.name} objects={self._count} bytes={self._total_bytes} "
            f"largest={self._largest}>"
        )
