"""A hypothesis state machine over loopback-linked MoqtSessions (STYLE.md: property tests).

The world is one :class:`Network` holding

* the *pair under test*: a client that subscribes, fetches, updates, cancels
  and sends GOAWAY, and a server whose application answers (or refuses) the
  client's requests and serves a :class:`TrackStore` it keeps appending to;
* a *bystander* pair that is never touched and must never close.

Rules also advance the virtual clock and inject garbage bytes (on a new uni or
bidi stream, on an existing stream, or as a datagram) into either session.
When the pair under test has closed, a new pair replaces it on the same
network.

Invariants:

1. nothing raises out of an input method or the network; local commands may
   raise ``LocalProtocolError`` only (caught where a rule makes an illegal call
   on purpose or by chance: after GOAWAY, after close);
2. a closed session emitted exactly one ``SessionClosed``, last, with a code
   from ``SessionErrorCode``; without garbage injected into the pair, a
   session closes only for a timeout (CONTROL_MESSAGE_TIMEOUT, GOAWAY_TIMEOUT)
   -- two kvcs sessions used legally never violate the protocol towards each
   other;
3. garbage on a stream or datagram the injector made up closes at most the
   session it was injected into (its peer sees ``CloseTransport`` with the same
   code); the bystander never notices;
4. after the application answered every request and the network went idle,
   no request of a session that is still open is PENDING;
5. right after ``handle_timer(now)``, ``get_timer()`` is never ``<= now``
   (checked by the harness's :class:`Tap` on every call).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from session_harness import SESSION_CODES, TRACK, Pair, World

from kvcs.transports.loopback import Chunking
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.transport_io import SendDatagram, StreamRef
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import (
    GroupOrder,
    ObjectStatus,
    PublishDoneCode,
    RequestErrorCode,
    SessionErrorCode,
)

TIMEOUT_CODES = frozenset(
    {
        SessionErrorCode.NO_ERROR,
        SessionErrorCode.CONTROL_MESSAGE_TIMEOUT,
        SessionErrorCode.GOAWAY_TIMEOUT,
    }
)
LIVE_STATES = (RequestState.ESTABLISHED, RequestState.DONE, RequestState.FAILED)


def location_filter_values() -> st.SearchStrategy[p.LocationFilter]:
    small = st.integers(0, 4)
    return st.one_of(
        st.just(p.LocationFilter.next_object()),
        st.just(p.LocationFilter.none()),
        small.map(p.LocationFilter.relative_start),
        st.builds(p.LocationFilter.absolute_start, small, small),
        st.builds(lambda g, o, d: p.LocationFilter.absolute_group_end(g, o, g + d), small, small,
                  small),
        st.builds(lambda g, o, d, e: p.LocationFilter.absolute_range(g, o, g + d, e), small, small,
                  small, small),
    )  # fmt: skip


def location_filters() -> st.SearchStrategy[p.LocationFilter | None]:
    return st.one_of(st.none(), location_filter_values())


def fill_values() -> st.SearchStrategy[p.Parameters]:
    return st.builds(
        lambda lf, order: p.Parameters([x for x in (lf, order) if x is not None]),
        location_filters(),
        st.one_of(st.none(), st.sampled_from(GroupOrder).map(p.GroupOrderParam)),
    )


def fills() -> st.SearchStrategy[p.Parameters | None]:
    return st.one_of(st.none(), fill_values())


def update_params() -> st.SearchStrategy[p.Parameters]:
    items = st.lists(
        st.one_of(
            st.integers(0, 255).map(p.SubscriberPriority),
            st.integers(0, 1).map(p.Forward),
            location_filter_values(),
            fill_values().map(p.FillParameters),
        ),
        max_size=3,
        unique_by=type,
    )
    return items.map(p.Parameters)


GARBAGE = st.one_of(
    st.binary(min_size=1, max_size=48),
    # plausible starts: a frame header of a real message type, a subgroup or fetch header
    st.tuples(st.sampled_from([b"\x03", b"\x02", b"\x07", b"\x10", b"\x05", b"\x14", b"\x2f\x00"]),
              st.binary(max_size=24)).map(b"".join),
)  # fmt: skip


class SessionPairMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World(seed=7)
        self.bystander = self.w.pair()
        self.pair: Pair | None = None
        self.garbage = False
        self.pairs_made = 0
        self.steps = 0

    # ----------------------------------------------------------------- set-up

    @initialize(
        chunking=st.sampled_from(["whole", "bytewise", "random"]),
        latency=st.sampled_from([0.0, 0.002, 0.02]),
        auto=st.booleans(),
        link=st.sampled_from(["plain", "zero-copy", "slow"]),
    )
    def start(self, chunking: str, latency: float, auto: bool, link: str) -> None:
        self.chunking = {
            "whole": Chunking.WHOLE,
            "bytewise": Chunking.BYTEWISE,
            "random": Chunking.random(3, max_size=7),
        }[chunking]
        self.latency = latency
        self.link_options: dict[str, Any] = {
            "plain": {},
            "zero-copy": {"zero_copy": True},
            # a slow link and a small queue: subscribers fall TOO_FAR_BEHIND
            "slow": {
                "bandwidth": 2_000.0,
                "server": SessionConfig(
                    role=Role.SERVER,
                    max_queued_bytes_per_subscription=300,
                ),
            },
        }[link]
        self.auto = auto
        """The server application answers every request at once (else the rules do)."""
        self._new_pair()

    def _new_pair(self) -> None:
        self.pairs_made += 1
        pr = self.w.pair(
            auto=self.auto,
            chunking=self.chunking,
            latency=self.latency,
            objects=2,
            **self.link_options,
        )
        self.w.setup(pr, self.bystander)
        self.pair = pr
        self.garbage = False
        self.garbled_stream = False
        """Garbage went into a real stream: its effects may surface later, on either side."""
        self.datagrams = False
        self.group, self.next_object = 0, 2

    @property
    def pr(self) -> Pair:
        assert self.pair is not None
        return self.pair

    @property
    def closed(self) -> bool:
        return self.pr.cli.is_closed or self.pr.srv.is_closed

    def _local(self, call: Any) -> Any:
        """Run a local command; LocalProtocolError is the only exception allowed."""
        try:
            result = call()
        except LocalProtocolError:
            return None
        self.w.net.poke(self.pr.cli)
        self.w.net.poke(self.pr.srv)
        return result

    def _own(self, *states: RequestState, kind: ev.RequestKind | None = None) -> list[int]:
        return sorted(
            rid
            for rid, r in self.pr.cli.requests.items()
            if r.mine and r.state in states and (kind is None or r.kind is kind)
        )

    def _peer_pending(self) -> list[int]:
        return sorted(
            rid
            for rid, r in self.pr.srv.requests.items()
            if not r.mine and r.state is RequestState.PENDING
        )

    # ----------------------------------------------------------------- client rules

    @precondition(lambda self: not self.closed)
    @rule(
        lf=location_filters(),
        fill=fills(),
        forward=st.sampled_from([True, True, True, False]),
        prio=st.integers(0, 255),
    )
    def subscribe(
        self, lf: p.LocationFilter | None, fill: p.Parameters | None, forward: bool, prio: int
    ) -> None:
        self._local(
            lambda: self.pr.cli.subscribe(
                TRACK, now=self.w.now, location_filter=lf, fill=fill, forward=forward, priority=prio
            )
        )

    @precondition(lambda self: not self.closed)
    @rule()
    def live_consumer(self) -> None:
        """The KVCS live-retrieval recipe: Next Object + a fill from {0, 0}."""
        self._local(
            lambda: self.pr.cli.subscribe(
                TRACK,
                now=self.w.now,
                location_filter=p.LocationFilter.next_object(),
                fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
            )
        )

    @precondition(lambda self: not self.closed)
    @rule(lf=location_filters(), order=st.sampled_from(GroupOrder))
    def fetch(self, lf: p.LocationFilter | None, order: GroupOrder) -> None:
        self._local(
            lambda: self.pr.cli.fetch(TRACK, now=self.w.now, location_filter=lf, group_order=order)
        )

    @precondition(lambda self: not self.closed)
    @rule()
    def track_status(self) -> None:
        self._local(lambda: self.pr.cli.track_status(TRACK, now=self.w.now))

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), params=update_params())
    def request_update(self, data: st.DataObject, params: p.Parameters) -> None:
        # only on answered subscriptions: an update that overtakes the answer is a known bug
        # (test_session_bad_input.py::test_update_before_subscribe_is_answered)
        rids = self._own(RequestState.ESTABLISHED, kind=ev.RequestKind.SUBSCRIBE)
        if rids:
            rid = data.draw(st.sampled_from(rids))
            self._local(lambda: self.pr.cli.request_update(rid, params, now=self.w.now))

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rids = self._own(RequestState.PENDING, RequestState.ESTABLISHED)
        if rids:
            rid = data.draw(st.sampled_from(rids))
            self._local(lambda: self.pr.cli.cancel(rid, now=self.w.now))

    @precondition(lambda self: not self.closed)
    @rule(server=st.booleans(), timeout_ms=st.sampled_from([0, 0, 500, 5000]))
    def goaway(self, server: bool, timeout_ms: int) -> None:
        if server:
            self._local(lambda: self.pr.srv.goaway(b"moqt://next", timeout_ms, now=self.w.now))
        else:
            self._local(lambda: self.pr.cli.goaway(b"", timeout_ms, now=self.w.now))

    # ----------------------------------------------------------------- server rules

    @rule(n=st.integers(1, 4), end_group=st.booleans(), datagram=st.booleans())
    def publish(self, n: int, end_group: bool, datagram: bool) -> None:
        store = self.pr.store
        self.datagrams = self.datagrams or datagram
        for _ in range(n):
            store.append(
                self.group,
                self.next_object,
                bytes([self.next_object % 256]) * (1 + 37 * self.next_object % 300),
                subgroup_id=None if datagram else 0,
                datagram=datagram,
            )
            self.next_object += 1
        if end_group and not datagram:
            store.append(self.group, self.next_object, status=ObjectStatus.END_OF_GROUP)
        if end_group:
            self.group, self.next_object = self.group + 1, 0
        self.w.net.poke(self.pr.srv)

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), accept=st.booleans())
    def answer(self, data: st.DataObject, accept: bool) -> None:
        rids = self._peer_pending()
        if rids:
            self._answer(data.draw(st.sampled_from(rids)), accept)

    def _answer(self, rid: int, accept: bool) -> None:
        srv, now, store = self.pr.srv, self.w.now, self.pr.store
        kind = srv.requests[rid].kind
        if not accept:
            self._local(lambda: srv.reject_request(rid, RequestErrorCode.DOES_NOT_EXIST, now=now))
        elif kind is ev.RequestKind.SUBSCRIBE:
            self._local(lambda: srv.accept_subscribe(rid, store, now=now))
        elif kind is ev.RequestKind.FETCH:
            self._local(lambda: srv.accept_fetch(rid, store, now=now))
        elif kind is ev.RequestKind.TRACK_STATUS:
            self._local(lambda: srv.accept_track_status(rid, store, now=now))
        else:
            self._local(lambda: srv.accept_request(rid, now=now))

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def end_subscription(self, data: st.DataObject) -> None:
        rids = sorted(
            rid
            for rid, r in self.pr.srv.requests.items()
            if not r.mine and r.kind is ev.RequestKind.SUBSCRIBE
            and r.state is RequestState.ESTABLISHED
        )  # fmt: skip
        if rids:
            rid = data.draw(st.sampled_from(rids))
            self._local(
                lambda: self.pr.srv.end_subscription(
                    rid, PublishDoneCode.TRACK_ENDED, "done", now=self.w.now
                )
            )

    # ----------------------------------------------------------------- network rules

    @rule(dt=st.sampled_from([0.0, 0.001, 0.01, 0.1, 1.0, 31.0]))
    def advance(self, dt: float) -> None:
        self.w.net.run_for(dt)

    @precondition(lambda self: not self.closed)
    @rule(
        target_server=st.booleans(),
        where=st.sampled_from(["uni", "bidi", "datagram", "existing"]),
        garbage=GARBAGE,
        fin=st.booleans(),
        data=st.data(),
    )
    def inject_garbage(
        self, target_server: bool, where: str, garbage: bytes, fin: bool, data: st.DataObject
    ) -> None:
        pr, link = self.pr, self.pr.link
        target = pr.srv if target_server else pr.cli
        self.garbage = True
        if where == "uni":
            link.inject_stream(target, uni=True, data=garbage, fin=fin)
        elif where == "bidi":
            link.inject_stream(target, uni=False, data=garbage, fin=fin)
        elif where == "datagram":
            link.inject_datagram(target, garbage)
        else:
            ref = data.draw(st.sampled_from(self._existing_streams(target_server)))
            link.inject_data(target, ref, garbage, fin=fin)
        if where == "existing":
            self.garbled_stream = True
        self.w.net.run_for(0.05)
        if not self.garbled_stream and self.closed:
            # made-up streams and datagrams: only the target may have closed on its own
            other = pr.cli if target_server else pr.srv
            closer = self.w.closed(other)
            assert closer is None or closer.initiator is not ev.Initiator.LOCAL, (
                f"garbage injected into {target!r} made {other!r} close: {closer}"
            )

    def _existing_streams(self, target_server: bool) -> list[StreamRef]:
        """Streams the target receives on from its real peer (its own names for them)."""
        pr = self.pr
        own = [r.stream for r in pr.cli.requests.values() if r.mine]
        if target_server:
            return [pr.server_control_in, *(pr.server_ref(s) for s in own)]
        return [pr.client_control_in, *own]

    @precondition(lambda self: self.closed)
    @rule()
    def reconnect(self) -> None:
        self.w.run(0.1)
        self._new_pair()

    @rule()
    def settle(self) -> None:
        """The application answers everything; once idle nothing may be left PENDING."""
        for _ in range(20):
            self.w.run(0.05)
            pending = [] if self.closed else self._peer_pending()
            if not pending:
                break
            for rid in pending:
                self._answer(rid, accept=rid % 4 == 0)
        self.w.net.run_until_idle(max_time=120.0)
        for sess in (self.pr.cli, self.pr.srv):
            if sess.is_closed:
                continue
            stuck = {rid: r for rid, r in sess.requests.items() if r.state not in LIVE_STATES}
            assert not stuck, f"{sess!r}: requests still pending once idle: {stuck}"
        if not self.garbage:
            self._objects_intact()
            if not self.closed:
                self._both_sides_agree()

    def _objects_intact(self) -> None:
        """Every object the client received is the one in the server's store, byte for byte."""
        store = self.pr.store
        for e in self.w.events(self.pr.cli, ev.ObjectReceived):
            stored = store.get(e.location)
            assert stored is not None, f"{e} was never published"
            assert e.status == stored.status, (e, stored)
            assert bytes(e.payload) == bytes(stored.payload), f"payload of {e.location} differs"

    def _too_far_behind(self) -> set[int]:
        return {
            e.request_id
            for e in self.w.events(self.pr.cli, ev.PublishDoneReceived)
            if e.status == PublishDoneCode.TOO_FAR_BEHIND
        }

    def _both_sides_agree(self) -> None:
        """Once idle, a subscription is established on both sides or on neither."""
        cli, srv = self.pr.cli.requests, self.pr.srv.requests
        for rid, mine in cli.items():
            if not mine.mine or mine.kind is not ev.RequestKind.SUBSCRIBE:
                continue
            theirs = srv.get(rid)
            if mine.state is RequestState.ESTABLISHED:
                assert theirs is not None and theirs.state is RequestState.ESTABLISHED, (
                    rid,
                    mine.state,
                    theirs and theirs.state,
                )
            if theirs is not None and theirs.state is RequestState.ESTABLISHED:
                assert mine.state is RequestState.ESTABLISHED, (rid, mine.state, theirs.state)

    # ----------------------------------------------------------------- invariants

    @invariant()
    def closes_are_well_formed(self) -> None:
        if self.pair is None:
            return
        pr = self.pr
        for sess in (pr.cli, pr.srv):
            events = self.w.net.events(sess)
            closes = [e for e in events if isinstance(e, ev.SessionClosed)]
            assert len(closes) <= 1, closes
            if not closes:
                assert not sess.is_closed
                continue
            (c,) = closes
            assert events[-1] is c, f"{sess!r} emitted events after SessionClosed"
            assert sess.get_timer() is None
            if c.initiator is not ev.Initiator.TRANSPORT:
                assert c.code in SESSION_CODES, c
            if not self.garbage:
                assert c.code in TIMEOUT_CODES, f"legal use closed {sess!r}: {c}"
        a, b = self.w.closed(pr.cli), self.w.closed(pr.srv)
        initiators = {a.initiator, b.initiator} if a is not None and b is not None else set()
        if initiators == {ev.Initiator.LOCAL, ev.Initiator.PEER}:
            # (both LOCAL: the two closed at once, e.g. two GOAWAY timeouts; codes may differ)
            assert a is not None and b is not None and a.code == b.code, (a, b)

    @invariant()
    def bystander_untouched(self) -> None:
        self.w.assert_open(self.bystander.cli, self.bystander.srv)
        self.steps += 1

    def teardown(self) -> None:
        if self.pair is not None:
            event(f"server answers at once: {self.auto}")
            event(f"subscriptions ended too far behind: {bool(self._too_far_behind())}")
            self.settle()
            self.closes_are_well_formed()
            # what the run covered (pytest --hypothesis-show-statistics)
            objects = len(self.w.events(self.pr.cli, ev.ObjectReceived))
            event(f"objects received by the last client: {'10+' if objects >= 10 else objects}")
            event(f"pairs made: {self.pairs_made}")
            event(f"steps: {self.steps // 5 * 5}+")
            for sess in (self.pr.cli, self.pr.srv):
                c = self.w.closed(sess)
                event(f"last pair closed: {c.code:#x}" if c else "last pair open")
        self.w.prove_alive(self.bystander)


def test_end_subscription_after_a_datagram_sends_publish_done() -> None:
    w = World()
    v = w.pair()
    w.setup(v)
    rid = v.cli.subscribe(TRACK, now=w.now)
    w.net.poke(v.cli)
    w.run(0.1)
    v.store.append(0, 0, b"dgram", subgroup_id=None, datagram=True)
    w.run(0.1)
    assert len(w.events(v.cli, ev.ObjectReceived)) == 1
    v.srv.end_subscription(rid, PublishDoneCode.TRACK_ENDED, "done", now=w.now)
    w.net.poke(v.srv)
    w.net.run_until_idle(max_time=60.0)
    assert [e.request_id for e in w.events(v.cli, ev.PublishDoneReceived)] == [rid]
    assert v.cli.requests[rid].state is RequestState.DONE


def test_poll_data_keeps_datagrams_within_the_budget() -> None:
    w = World()
    v = w.pair()
    w.setup(v)
    v.cli.subscribe(TRACK, now=w.now)
    w.net.poke(v.cli)
    w.run(0.1)
    v.store.append(0, 0, bytes(300), subgroup_id=None, datagram=True)
    item = v.srv.session.poll_data(100)
    size = None if item is None else sum(len(c) for c in item.chunks)
    assert size is None or size <= 100, f"poll_data(100) returned {size} bytes"
    later = v.srv.session.poll_data(2000)  # the datagram still goes once the budget allows
    assert isinstance(later, SendDatagram)


def test_end_subscription_after_subgroup_objects_sends_publish_done() -> None:
    w = World()
    v = w.pair()
    w.setup(v)
    rid = v.cli.subscribe(TRACK, now=w.now)
    w.net.poke(v.cli)
    w.run(0.1)
    v.store.append(0, 0, b"stream")
    w.run(0.1)
    v.srv.end_subscription(rid, PublishDoneCode.TRACK_ENDED, "done", now=w.now)
    w.net.poke(v.srv)
    w.net.run_until_idle(max_time=60.0)
    (done,) = w.events(v.cli, ev.PublishDoneReceived)
    assert (done.request_id, done.stream_count) == (rid, 1)
    assert v.cli.requests[rid].state is RequestState.DONE


SessionPairMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSessionPair = SessionPairMachine.TestCase
