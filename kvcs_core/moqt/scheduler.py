"""The send scheduler: which data stream or datagram flow sends its next object.

Theory of operation
-------------------
d21 section 5.1.2 (wire reference 9.1) schedules *objects*: the next object of
a subgroup stream, a datagram, the next object of a FETCH or fill stream. The
session keeps one *sender* per such stream or datagram flow, identified by an
opaque ``int``, and tells this scheduler, whenever a sender's head object
changes, the :class:`SendKey` of that head (:meth:`Scheduler.set_ready`), or
that it has nothing sendable (:meth:`Scheduler.set_idle`: empty, or blocked by
flow control, which makes an object unschedulable). :meth:`Scheduler.pop_best`
then names the sender that goes next; the session writes (part of) its head
and reports the sender again. Control and request streams are not scheduled
here: they always go first (wire reference 9.1, last paragraph).

Between two candidates, lower numbers being more urgent:

1. lower subscriber priority (of the request that caused the send; a fill's
   inner SUBSCRIBER_PRIORITY where given);
2. then lower publisher priority;
3. same subscription, different groups: the subscription's group order; a fill
   whose group order differs from the subscription's goes after the
   subscription-delivered objects;
4. same subscription, same group: a fill-delivered object beats a
   subscription-delivered one; else datagram before subgroup, then lower
   Object ID (datagrams) / lower Subgroup ID (subgroups).

Rules 3 and 4 only order senders of one subscription, so a key names its
*flow*: the subscription (or FETCH) its sender serves, fills included (a fill
belongs to its subscription's flow whatever Request ID names its stream).
Within a flow the total order is :attr:`SendKey.rank`::

    (subscriber priority, publisher priority,
     tier,            # 1 for a fill whose group order differs, else 0 (rule 3)
     group position,  # group ID, negated for a descending sender (rule 3)
     delivery,        # 0 fill, 1 datagram, 2 subgroup (rule 4)
     unit,            # Object ID (fill, datagram) / Subgroup ID (subgroup)
     seq)             # arrival order of the head object: FIFO among the rest

Read pairwise, rules 3 and 4 are not transitive when a fill's order differs
(subscription objects in groups 10 and 11 and a fill object in group 10 would
form a cycle), so the "tier" makes rule 3 win: such a fill waits for the
subscription-delivered objects even in the same group.

Across flows the text leaves the order to the implementation but says that all
should progress, so only rules 1 and 2 are compared there: among the flows
whose best sender has the best (subscriber, publisher) priority pair, the one
served least recently goes first (round robin, one pop per turn; a flow that
becomes ready joins at the back). Comparing group positions across flows would
let a descending subscription starve an ascending one. Senders given no flow
share the flow ``None``, where the full rank applies to all of them.

Only :meth:`Scheduler.pop_best` counts as a turn: a caller that peeks, sends
and re-keys the same sender never advances the round robin, so the data pump
should pop, send, then ``set_ready`` (more to send) or leave the sender out.

Complexity: every operation is O(log n) amortised. Both levels are binary
heaps with lazy deletion (a stale entry is skipped when it surfaces), compacted
when stale entries outnumber live ones; memory stays O(ready senders). A
sender that becomes ready while no other is (the usual case of a session that
serves one subscription: the pump drains it, then the next object arrives) is
held aside as the *solo* sender, out of both heaps: it is the best by
definition, and it is moved into the heaps, with the round-robin stamp it got
when it became ready, as soon as another sender becomes ready. The order is
the same either way.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Hashable, Iterator
from typing import Any

import attrs

from kvcs_core.wire.codes import MAX_VI64

__all__ = ["Delivery", "Scheduler", "SendKey"]


class Delivery(enum.IntEnum):
    """The *delivery* component of :attr:`SendKey.rank` (rule 4: fill, datagram, subgroup)."""

    FILL = 0
    DATAGRAM = 1
    SUBGROUP = 2


def _check_u8(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"{attr.name} {value!r} is not in 0..255")


def _check_vi64(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VI64:
        raise ValueError(f"{attr.name} {value!r} is not in 0..2**64-1")


def _check_int(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{attr.name} {value!r} is not an int")


@attrs.frozen(kw_only=True)
class SendKey:
    """Where a sender's head object stands in d21 section 5.1.2; see the module docstring.

    Raises:
        ValueError: a priority outside 0..255, an ID outside 0..2**64-1, a
            sender that is both a fill and a datagram flow, or
            ``fill_order_differs`` on something that is not a fill.
    """

    subscriber_priority: int = attrs.field(validator=_check_u8)
    """SUBSCRIBER_PRIORITY of the request that caused the send (0 = most urgent)."""
    publisher_priority: int = attrs.field(validator=_check_u8)
    """Publisher Priority of the head object."""
    group_id: int = attrs.field(validator=_check_vi64)
    """Group ID of the head object."""
    descending: bool = False
    """The sender delivers groups in descending order (its subscription's, or the fill's own)."""
    fill: bool = False
    """Fill- or FETCH-delivered (a fetch-format stream)."""
    datagram: bool = False
    """A datagram flow (subscription-delivered)."""
    subgroup_or_object: int = attrs.field(default=0, validator=_check_vi64)
    """Subgroup ID for a subgroup stream; Object ID of the head for datagrams and fills."""
    seq: int = attrs.field(default=0, validator=_check_int)
    """Arrival order of the head object (e.g. ``StoredObject.seq``); the final tie-break."""
    flow: Hashable = None
    """The subscription or FETCH served (rules 3-4 apply within one flow); ``None`` = shared."""
    fill_order_differs: bool = False
    """A fill whose group order differs from its subscription's (rule 3: it goes last)."""

    def __attrs_post_init__(self) -> None:
        if self.fill and self.datagram:
            raise ValueError("a sender is a fill/fetch stream or a datagram flow, not both")
        if self.fill_order_differs and not self.fill:
            raise ValueError("fill_order_differs applies to fills only")

    @classmethod
    def make(
        cls,
        *,
        subscriber_priority: int,
        publisher_priority: int,
        group_id: int,
        descending: bool = False,
        fill: bool = False,
        datagram: bool = False,
        subgroup_or_object: int = 0,
        seq: int = 0,
        flow: Hashable = None,
        fill_order_differs: bool = False,
    ) -> SendKey:
        """Keyword constructor (same as calling the class)."""
        return cls(
            subscriber_priority=subscriber_priority,
            publisher_priority=publisher_priority,
            group_id=group_id,
            descending=descending,
            fill=fill,
            datagram=datagram,
            subgroup_or_object=subgroup_or_object,
            seq=seq,
            flow=flow,
            fill_order_differs=fill_order_differs,
        )

    @property
    def priorities(self) -> tuple[int, int]:
        """``(subscriber_priority, publisher_priority)``: rules 1-2, compared across flows."""
        return (self.subscriber_priority, self.publisher_priority)

    @property
    def delivery(self) -> Delivery:
        """FILL, DATAGRAM or SUBGROUP."""
        if self.fill:
            return Delivery.FILL
        return Delivery.DATAGRAM if self.datagram else Delivery.SUBGROUP

    @property
    def rank(self) -> tuple[int, int, int, int, int, int, int]:
        """The total order within one flow (lower goes first): rules 1-4, then ``seq``."""
        return (
            self.subscriber_priority,
            self.publisher_priority,
            1 if self.fill_order_differs else 0,
            -self.group_id if self.descending else self.group_id,
            int(self.delivery),
            self.subgroup_or_object,
            self.seq,
        )


_Rank = tuple[int, int, int, int, int, int, int]


class _Flow:
    """Ready senders of one flow, in a lazy-deletion heap of (rank, entry, sender)."""

    __slots__ = ("head", "heap", "live", "order", "stamp", "token")

    def __init__(self, order: int, stamp: int) -> None:
        self.heap: list[tuple[_Rank, int, int]] = []
        self.live = 0
        self.order = order  # creation number: tie-break between equal stamps
        self.stamp = stamp  # round-robin time of the last service (or of arrival)
        self.token = -1  # entry number of this flow's valid global-heap entry, -1 none
        self.head: tuple[int, int] = (0, 0)  # priorities carried by that entry


class Scheduler:
    """Priority queue of ready senders (d21 section 5.1.2); see the module docstring.

    Sender ids are opaque ints chosen by the caller. A sender is either *ready*
    (it has a key) or not known here (idle, blocked, in service, finished).
    """

    def __init__(self) -> None:
        # sender -> (flow, entry number, its SendKey or None when set by rank)
        self._senders: dict[int, tuple[Hashable, int, SendKey | None]] = {}
        self._flows: dict[Hashable, _Flow] = {}
        # (subscriber priority, publisher priority, stamp, flow order, token, flow id)
        self._global: list[tuple[int, int, int, int, int, Hashable]] = []
        self._entries = 0  # unique numbers for heap entries (versions)
        self._flow_orders = 0
        self._clock = 0  # round-robin clock, advanced by every pop
        self._solo: tuple[int, Hashable, _Rank, SendKey | None, int] | None = None
        """(sender, flow, rank, key, stamp) of the only ready sender, kept out of the heaps."""

    # --- getters ---------------------------------------------------------------

    def __len__(self) -> int:
        """Number of ready senders."""
        return len(self._senders)

    def __contains__(self, sender_id: object) -> bool:
        return sender_id in self._senders

    def key_of(self, sender_id: int) -> SendKey | None:
        """The key of a ready sender (``None``: not ready, or made ready by rank)."""
        entry = self._senders.get(sender_id)
        return None if entry is None else entry[2]

    def senders_of(self, flow: Hashable) -> Iterator[int]:
        """The ready senders of ``flow``, in no particular order (a snapshot)."""
        solo = self._solo
        if solo is not None:
            return iter([solo[0]] if solo[1] == flow else [])
        f = self._flows.get(flow)
        if f is None:
            return iter(())
        return iter([s for _, e, s in f.heap if self._valid(e, s)])

    def peek_best(self) -> int | None:
        """The sender that :meth:`pop_best` would return, without removing it (not a turn)."""
        if self._solo is not None:
            return self._solo[0]
        top = self._top_flow()
        return None if top is None else top[1].heap[0][2]

    # --- commands ---------------------------------------------------------------

    def set_ready(self, sender_id: int, key: SendKey) -> None:
        """Make ``sender_id`` ready with ``key``, or replace its key (it may change flow)."""
        self._ready(sender_id, key.flow, key.rank, key)

    def set_ready_rank(self, sender_id: int, flow: Hashable, rank: _Rank) -> None:
        """:meth:`set_ready` from the parts of a key the order uses: ``rank`` is what
        :attr:`SendKey.rank` would be (the caller vouches for its ranges). For the data
        pump, which re-keys a sender after every pull: no key object is built."""
        self._ready(sender_id, flow, rank, None)

    def _ready(self, sender_id: int, fid: Hashable, rank: _Rank, key: SendKey | None) -> None:
        solo = self._solo
        if solo is not None:
            if solo[0] == sender_id:  # re-keyed: still the only one
                self._solo = (sender_id, fid, rank, key, solo[4] if solo[1] == fid else self._clock)
                self._senders[sender_id] = (fid, -1, key)
                return
            self._unsolo(solo)
        elif not self._senders:
            self._solo = (sender_id, fid, rank, key, self._clock)
            self._senders[sender_id] = (fid, -1, key)
            return
        self._push(sender_id, fid, rank, key, None)

    def _unsolo(self, solo: tuple[int, Hashable, _Rank, SendKey | None, int]) -> None:
        """Another sender becomes ready: the solo one goes into the heaps first."""
        self._solo = None
        del self._senders[solo[0]]
        self._push(solo[0], solo[1], solo[2], solo[3], solo[4])

    def _push(
        self, sender_id: int, fid: Hashable, rank: _Rank, key: SendKey | None, stamp: int | None
    ) -> None:
        old = self._senders.pop(sender_id, None)
        flows = self._flows
        if old is not None:
            if old[0] == fid:
                flows[fid].live -= 1  # same flow: keep its round-robin place
            else:
                self._drop(old[0])
        flow = flows.get(fid)
        if flow is None:
            flow = flows[fid] = _Flow(self._flow_orders, self._clock if stamp is None else stamp)
            self._flow_orders += 1
        self._entries = entry = self._entries + 1
        self._senders[sender_id] = (fid, entry, key)
        heapq.heappush(flow.heap, (rank, entry, sender_id))
        flow.live += 1
        self._refresh(fid, flow)

    def update_key(self, sender_id: int, key: SendKey) -> bool:
        """Replace the key of a ready sender; ``False`` (and nothing done) if it is not ready.

        Priority changes apply best-effort to objects not yet scheduled
        (SUBSCRIBER_PRIORITY in REQUEST_UPDATE, wire reference 5.7).
        """
        if sender_id not in self._senders:
            return False
        self.set_ready(sender_id, key)
        return True

    def set_idle(self, sender_id: int) -> None:
        """Take ``sender_id`` out of the queue (nothing sendable now); unknown ids are ignored."""
        old = self._senders.pop(sender_id, None)
        if old is not None:
            solo = self._solo
            if solo is not None and solo[0] == sender_id:
                self._solo = None
            else:
                self._drop(old[0])

    def pop_best(self) -> int | None:
        """Remove and return the sender that sends next, or ``None`` when none is ready.

        The sender is no longer ready: report it again with :meth:`set_ready`
        once it has a new head object (or :meth:`set_idle`, a no-op, if not).
        """
        solo = self._solo
        if solo is not None:
            self._solo = None
            del self._senders[solo[0]]
            self._clock += 1
            return solo[0]
        top = self._top_flow()
        if top is None:
            return None
        fid, flow = top
        _, _, sender_id = heapq.heappop(flow.heap)
        del self._senders[sender_id]
        flow.live -= 1
        heapq.heappop(self._global)  # this flow's entry; it gets a new one below
        self._clock += 1
        flow.stamp = self._clock
        flow.token = -1
        self._refresh(fid, flow)
        return sender_id

    def clear(self) -> None:
        """Forget every sender."""
        self._solo = None
        self._senders.clear()
        self._flows.clear()
        self._global.clear()

    # --- internals ---------------------------------------------------------------

    def _valid(self, entry: int, sender_id: int) -> bool:
        cur = self._senders.get(sender_id)
        return cur is not None and cur[1] == entry

    def _drop(self, fid: Hashable) -> None:
        flow = self._flows[fid]
        flow.live -= 1
        self._refresh(fid, flow)

    def _refresh(self, fid: Hashable, flow: _Flow) -> None:
        """Restore the invariants of ``flow`` after a change.

        Its heap top is a valid entry (or the heap is empty and the flow gone),
        and exactly one valid global entry carries its head priorities and stamp.
        """
        heap = flow.heap
        while heap and not self._valid(heap[0][1], heap[0][2]):
            heapq.heappop(heap)
        if not heap:
            del self._flows[fid]
            return
        if len(heap) > 2 * flow.live + 16:
            flow.heap = heap = [e for e in heap if self._valid(e[1], e[2])]
            heapq.heapify(heap)
        rank = heap[0][0]
        head = (rank[0], rank[1])
        if flow.token >= 0 and flow.head == head:
            return  # its global entry is still right
        self._entries += 1
        flow.token = self._entries
        flow.head = head
        heapq.heappush(self._global, (*head, flow.stamp, flow.order, flow.token, fid))
        if len(self._global) > 2 * len(self._flows) + 16:
            self._global = [e for e in self._global if self._global_valid(e)]
            heapq.heapify(self._global)

    def _global_valid(self, e: tuple[int, int, int, int, int, Hashable]) -> bool:
        flow = self._flows.get(e[5])
        return flow is not None and flow.token == e[4]

    def _top_flow(self) -> tuple[Hashable, _Flow] | None:
        g = self._global
        while g:
            e = g[0]
            flow = self._flows.get(e[5])
            if flow is not None and flow.token == e[4]:
                return e[5], flow
            heapq.heappop(g)
        return None
