"""The send scheduler: the four rules of d21 5.1.2, a brute-force reference, fairness."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcs_core.moqt.scheduler import Delivery, Scheduler, SendKey


def key(**kw: Any) -> SendKey:
    base: dict[str, Any] = {"subscriber_priority": 128, "publisher_priority": 128, "group_id": 0}
    base.update(kw)
    return SendKey(**base)


def drain(s: Scheduler) -> list[int]:
    out = []
    while (sid := s.pop_best()) is not None:
        out.append(sid)
    return out


def order_of(keys: dict[int, SendKey]) -> list[int]:
    s = Scheduler()
    for sid, k in keys.items():
        s.set_ready(sid, k)
    return drain(s)


# --- the four rules -------------------------------------------------------------------


def test_rule1_subscriber_priority_first() -> None:
    assert order_of(
        {
            1: key(subscriber_priority=200, publisher_priority=0, flow="a"),
            2: key(subscriber_priority=10, publisher_priority=255, flow="b"),
        }
    ) == [2, 1]


def test_rule2_publisher_priority_next() -> None:
    assert order_of(
        {
            1: key(publisher_priority=9, flow="a"),
            2: key(publisher_priority=3, flow="b"),
            3: key(publisher_priority=3, subscriber_priority=127, group_id=99, flow="a"),
        }
    ) == [3, 2, 1]


def test_rule3_group_order_within_a_subscription() -> None:
    asc = {i: key(group_id=g, subgroup_or_object=0, flow=1) for i, g in enumerate([5, 2, 9])}
    assert order_of(asc) == [1, 0, 2]
    desc = {i: key(group_id=g, descending=True, flow=1) for i, g in enumerate([5, 2, 9])}
    assert order_of(desc) == [2, 0, 1]
    # priorities still win over group order (rules 1-2 come first)
    assert order_of(
        {
            1: key(group_id=1, publisher_priority=50, flow=1),
            2: key(group_id=7, publisher_priority=1, flow=1),
        }
    ) == [2, 1]


def test_rule3_fill_with_other_group_order_goes_after_subscription() -> None:
    keys = {
        1: key(group_id=10, flow=1),  # subscription, ascending
        2: key(group_id=11, flow=1),
        3: key(group_id=3, fill=True, descending=True, fill_order_differs=True, flow=1),
        4: key(group_id=10, fill=True, descending=True, fill_order_differs=True, flow=1),
    }
    # the differing fill waits for every subscription-delivered object, even in group 10;
    # among its own objects it follows its own (descending) order
    assert order_of(keys) == [1, 2, 4, 3]


def test_rule4_same_group_fill_then_datagram_then_subgroup() -> None:
    keys = {
        1: key(group_id=4, subgroup_or_object=0, flow=1),  # subgroup 0
        2: key(group_id=4, subgroup_or_object=7, datagram=True, flow=1),  # datagram object 7
        3: key(group_id=4, subgroup_or_object=9, fill=True, flow=1),  # fill
        4: key(group_id=4, subgroup_or_object=2, flow=1),  # subgroup 2
        5: key(group_id=4, subgroup_or_object=3, datagram=True, flow=1),  # datagram object 3
    }
    assert order_of(keys) == [3, 5, 2, 1, 4]


def test_rule3_before_rule4_with_same_order_fill() -> None:
    # a same-order fill in a later group does not beat the subscription's earlier group
    keys = {1: key(group_id=2, flow=1), 2: key(group_id=3, fill=True, flow=1)}
    assert order_of(keys) == [1, 2]


def test_seq_breaks_remaining_ties_fifo() -> None:
    keys = {1: key(seq=9, flow=1), 2: key(seq=4, flow=1), 3: key(seq=6, flow=1)}
    assert order_of(keys) == [2, 3, 1]


def test_rank_components() -> None:
    k = key(group_id=5, descending=True, fill=True, subgroup_or_object=3, seq=7)
    assert k.delivery is Delivery.FILL
    assert k.rank == (128, 128, 0, -5, 0, 3, 7)
    assert k.priorities == (128, 128)
    assert key(datagram=True).delivery is Delivery.DATAGRAM
    assert key().delivery is Delivery.SUBGROUP
    assert SendKey.make(subscriber_priority=1, publisher_priority=2, group_id=3) == SendKey(
        subscriber_priority=1, publisher_priority=2, group_id=3
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"subscriber_priority": 256},
        {"publisher_priority": -1},
        {"group_id": 2**64},
        {"subgroup_or_object": -1},
        {"subscriber_priority": True},
        {"fill": True, "datagram": True},
        {"fill_order_differs": True},
        {"seq": "x"},
    ],
)
def test_sendkey_validation(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        key(**kw)


# --- API ---------------------------------------------------------------------------------


def test_peek_set_idle_update_and_getters() -> None:
    s = Scheduler()
    assert s.peek_best() is None and s.pop_best() is None and len(s) == 0
    s.set_ready(1, key(publisher_priority=5, flow="a"))
    s.set_ready(2, key(publisher_priority=6, flow="a"))
    s.set_ready(3, key(publisher_priority=7, flow="b"))
    assert s.peek_best() == 1 and s.peek_best() == 1 and len(s) == 3
    assert 1 in s and 4 not in s
    assert s.key_of(1) == key(publisher_priority=5, flow="a") and s.key_of(4) is None
    assert sorted(s.senders_of("a")) == [1, 2]
    assert list(s.senders_of("zzz")) == []
    assert s.update_key(2, key(publisher_priority=1, flow="a"))
    assert not s.update_key(4, key())
    assert 4 not in s
    assert s.peek_best() == 2
    s.set_idle(2)
    s.set_idle(2)  # idempotent
    s.set_idle(99)
    assert s.peek_best() == 1
    assert s.update_key(1, key(publisher_priority=9, flow="b"))  # moves to another flow
    assert sorted(s.senders_of("b")) == [1, 3]
    assert list(s.senders_of("a")) == []
    assert drain(s) == [3, 1]
    s.set_ready(5, key())
    s.clear()
    assert len(s) == 0 and s.pop_best() is None


def test_popped_sender_is_not_ready_until_set_again() -> None:
    s = Scheduler()
    s.set_ready(1, key())
    assert s.pop_best() == 1
    assert 1 not in s
    assert s.pop_best() is None
    s.set_ready(1, key())
    assert s.pop_best() == 1


# --- fairness -------------------------------------------------------------------------------


def test_round_robin_across_flows_with_equal_priorities() -> None:
    s = Scheduler()
    # flow "b" would win every comparison of rules 3-4 (earlier group, fill) but flows
    # are only compared by priority: all should progress
    owners = {1: "a", 2: "a", 3: "b", 4: "c"}
    keys = {
        1: key(group_id=50, flow="a"),
        2: key(group_id=51, flow="a"),
        3: key(group_id=0, fill=True, flow="b"),
        4: key(group_id=9, descending=True, flow="c"),
    }
    for sid, k in keys.items():
        s.set_ready(sid, k)
    served = []
    for _ in range(12):
        sid = s.pop_best()
        assert sid is not None
        served.append(owners[sid])
        s.set_ready(sid, keys[sid])  # always more to send
    assert served == ["a", "b", "c"] * 4


def test_rekeying_keeps_a_flows_turn() -> None:
    s = Scheduler()
    s.set_ready(1, key(flow="a"))
    s.set_ready(2, key(flow="b"))
    assert s.pop_best() == 1
    s.set_ready(1, key(flow="a"))
    s.set_ready(2, key(flow="b", seq=5))  # re-keyed while waiting: still b's turn
    assert s.pop_best() == 2


def test_newly_ready_flow_joins_at_the_back() -> None:
    s = Scheduler()
    for sid, f in ((1, "a"), (2, "b")):
        s.set_ready(sid, key(flow=f))
    assert s.pop_best() == 1
    s.set_ready(1, key(flow="a"))
    s.set_ready(3, key(flow="c"))
    assert [s.pop_best(), s.pop_best(), s.pop_best()] == [2, 1, 3]


def test_priority_beats_fairness() -> None:
    s = Scheduler()
    s.set_ready(1, key(flow="a", subscriber_priority=1))
    s.set_ready(2, key(flow="b", subscriber_priority=2))
    for _ in range(5):
        assert s.pop_best() == 1
        s.set_ready(1, key(flow="a", subscriber_priority=1))


def test_lazy_deletion_stays_bounded() -> None:
    s = Scheduler()
    for i in range(50):
        s.set_ready(i, key(flow=i % 3, seq=i))
    for round_ in range(200):
        for i in range(50):
            s.update_key(
                i, key(flow=i % 3, seq=round_ * 50 + i, publisher_priority=(i + round_) % 7)
            )
    assert len(s._global) <= 2 * len(s._flows) + 17
    for f in s._flows.values():
        assert len(f.heap) <= 2 * f.live + 17
    assert len(drain(s)) == 50


# --- brute-force references --------------------------------------------------------------

_KEYS = st.builds(
    lambda sp, pp, g, desc, kind, unit, seq, flow, differs: SendKey(
        subscriber_priority=sp,
        publisher_priority=pp,
        group_id=g,
        descending=desc,
        fill=kind == "fill",
        datagram=kind == "datagram",
        subgroup_or_object=unit,
        seq=seq,
        flow=flow,
        fill_order_differs=differs and kind == "fill",
    ),
    st.integers(0, 2),
    st.integers(0, 2),
    st.integers(0, 3),
    st.booleans(),
    st.sampled_from(["fill", "datagram", "subgroup"]),
    st.integers(0, 2),
    st.integers(0, 3),
    st.sampled_from([None, 0, 1, 2]),
    st.booleans(),
)


@settings(max_examples=300)
@given(st.lists(_KEYS, max_size=25))
def test_single_flow_order_is_a_sort_by_rank(keys: list[SendKey]) -> None:
    """Within one flow the pop order is exactly ``sorted`` by rank (ties: insertion order)."""
    one_flow = [SendKey.make(**{**_fields(k), "flow": "only"}) for k in keys]
    got = order_of(dict(enumerate(one_flow)))
    want = sorted(range(len(one_flow)), key=lambda i: (one_flow[i].rank, i))
    assert got == want


def _fields(k: SendKey) -> dict[str, Any]:
    return {
        "subscriber_priority": k.subscriber_priority,
        "publisher_priority": k.publisher_priority,
        "group_id": k.group_id,
        "descending": k.descending,
        "fill": k.fill,
        "datagram": k.datagram,
        "subgroup_or_object": k.subgroup_or_object,
        "seq": k.seq,
        "flow": k.flow,
        "fill_order_differs": k.fill_order_differs,
    }


class RefScheduler:
    """O(n) model of the documented policy: rules 1-2 across flows, round robin, rank within."""

    def __init__(self) -> None:
        self.ready: dict[int, tuple[SendKey, int]] = {}
        self.flows: dict[Hashable, tuple[int, int]] = {}  # flow -> (stamp, creation order)
        self.clock = 0
        self.orders = 0
        self.entries = 0

    def _gc(self, flow: Hashable) -> None:
        if not any(k.flow == flow for k, _ in self.ready.values()):
            del self.flows[flow]

    def set_ready(self, sid: int, k: SendKey) -> None:
        old = self.ready.pop(sid, None)
        if old is not None and old[0].flow != k.flow:
            self._gc(old[0].flow)
        if k.flow not in self.flows:
            self.flows[k.flow] = (self.clock, self.orders)
            self.orders += 1
        self.entries += 1
        self.ready[sid] = (k, self.entries)

    def set_idle(self, sid: int) -> None:
        old = self.ready.pop(sid, None)
        if old is not None:
            self._gc(old[0].flow)

    def peek(self) -> int | None:
        if not self.ready:
            return None
        best = min(k.priorities for k, _ in self.ready.values())
        heads = {
            k.flow for k, _ in self.ready.values() if k.priorities == best
        }  # flows whose best sender has the best priorities
        flow = min(heads, key=lambda f: self.flows[f])
        return min(
            (sid for sid, (k, _) in self.ready.items() if k.flow == flow),
            key=lambda sid: (self.ready[sid][0].rank, self.ready[sid][1]),
        )

    def pop(self) -> int | None:
        sid = self.peek()
        if sid is None:
            return None
        k, _ = self.ready.pop(sid)
        self.clock += 1
        self.flows[k.flow] = (self.clock, self.flows[k.flow][1])
        self._gc(k.flow)
        return sid


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("ready"), st.integers(0, 7), _KEYS),
        st.tuples(st.just("idle"), st.integers(0, 7)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("peek")),
    ),
    max_size=60,
)


@settings(max_examples=300)
@given(_OPS)
def test_scheduler_matches_reference_model(ops: list[tuple[Any, ...]]) -> None:
    s, ref = Scheduler(), RefScheduler()
    for op in ops:
        if op[0] == "ready":
            s.set_ready(op[1], op[2])
            ref.set_ready(op[1], op[2])
        elif op[0] == "idle":
            s.set_idle(op[1])
            ref.set_idle(op[1])
        elif op[0] == "pop":
            assert s.pop_best() == ref.pop()
        else:
            assert s.peek_best() == ref.peek()
        assert len(s) == len(ref.ready)
    assert drain(s) == [ref.pop() for _ in range(len(ref.ready))]


@settings(max_examples=200)
@given(st.lists(_KEYS, min_size=1, max_size=20))
def test_pops_respect_rules_1_and_2_globally(keys: list[SendKey]) -> None:
    """Whatever the flows, pops come out in non-decreasing (subscriber, publisher) order."""
    got = order_of(dict(enumerate(keys)))
    prios = [keys[i].priorities for i in got]
    assert prios == sorted(prios)
    assert sorted(got) == list(range(len(keys)))
