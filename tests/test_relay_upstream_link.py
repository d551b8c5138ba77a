"""A relay's upstream *link* (``Relay.add_session(..., link=True)``) lost and reopened.

Loopback network, simulated time. A leaf relay's parent link is cut while a
downstream subscriber receives a track from the parent: with ``link=True`` the
subscription waits (``RelayConfig.upstream_hold``) instead of ending, and when a new
upstream session is set up it is subscribed upstream again and gets what the
publisher produced meanwhile and later, each object once. Without a new session in
time, it ends as it would have at the loss. Without ``link`` nothing changes.
"""

from __future__ import annotations

from relay_net import RelayNet, Subscriber, payload, produce, track

from kvcs_core.moqt.config import Role
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import Relay, RelayConfig
from kvcs_core.wire.names import Location, TrackNamespace

SIZE = 200


def _link(rn: RelayNet, parent: Relay, child: Relay, *, link: bool) -> MoqtSession:
    """As ``RelayNet.link_relays``, the child's session a reopened-on-loss link."""
    down = MoqtSession(rn._config(Role.SERVER))
    up = MoqtSession(rn._config(Role.CLIENT))
    rn.owner[down] = parent
    rn.owner[up] = child
    parent.add_session(down, upstream=False)
    child.add_session(up, upstream=True, link=link)
    rn._connect(up, down, f"relay{len(rn.net.links)}")
    rn.run_until(lambda: up.setup_complete and down.setup_complete)
    return up


def _tree(link: bool) -> tuple[RelayNet, Relay, Relay, TrackStore, Subscriber, int, MoqtSession]:
    rn = RelayNet()
    root = rn.add_relay()
    leaf = rn.add_relay(RelayConfig(upstream_hold=5.0))
    pub = rn.add_publisher(root)
    store = pub.serve(TrackStore(track("t")))
    produce(store, 0, 3, size=SIZE)
    up = _link(rn, root, leaf, link=link)
    s = rn.add_subscriber(leaf)
    rid = s.subscribe_all(store.name)
    rn.run_until(lambda: len(s.normal(rid)) == 3)
    return rn, root, leaf, store, s, rid, up


def _want(groups: range) -> dict[Location, bytes]:
    return {Location(g, o): payload(g, o, SIZE) for g in groups for o in range(3)}


def test_a_lost_link_keeps_the_subscription_and_the_next_session_resumes_it() -> None:
    rn, root, leaf, store, s, rid, up = _tree(link=True)
    rn.cut(up)
    rn.settle(0.5)
    assert s.done(rid) is None, "the subscription ended although the link comes back"
    produce(store, 1, 3, size=SIZE)  # produced while the leaf had no upstream
    rn.settle(0.2)
    _link(rn, root, leaf, link=True)  # the embedding reopened the link
    produce(store, 2, 3, size=SIZE)
    rn.run_until(lambda: len(s.normal(rid)) == 9)
    assert s.normal(rid) == _want(range(3))  # each object exactly once
    assert s.done(rid) is None


def test_a_lost_link_that_does_not_come_back_in_time_ends_the_subscription() -> None:
    rn, _root, _leaf, _store, s, rid, up = _tree(link=True)
    rn.cut(up)
    rn.settle(1.0)
    assert s.done(rid) is None
    rn.run_until(lambda: s.done(rid) is not None, max_time=10.0)
    done = s.done(rid)
    assert done is not None and done.status == 0x0  # INTERNAL_ERROR: upstream lost
    assert rn.now >= 5.0  # not before the hold ended


def test_without_link_a_loss_ends_the_subscription_at_once() -> None:
    rn, _root, _leaf, _store, s, rid, up = _tree(link=False)
    t0 = rn.now
    rn.cut(up)
    rn.run_until(lambda: s.done(rid) is not None, max_time=2.0)
    assert rn.now - t0 < 1.0


def test_a_fetch_waiting_on_a_lost_link_is_asked_again_on_the_next_session() -> None:
    rn, root, leaf, _store, s, _rid, up = _tree(link=True)
    other = rn.add_publisher(root, namespaces=(track("u", ns=_ns("other")).namespace,))
    fetched = other.serve(TrackStore(track("u", ns=_ns("other"))))
    produce(fetched, 0, 3, size=SIZE)
    frid = s.fetch(fetched.name)
    rn.net.run_for(0.003)  # the leaf has asked upstream; the answer is on its way
    assert not s.accepted(frid)
    rn.cut(up)
    rn.settle(0.2)
    assert s.failed(frid) is None, "the FETCH was refused although the link comes back"
    _link(rn, root, leaf, link=True)
    rn.run_until(lambda: s.accepted(frid) or s.failed(frid) is not None)
    assert s.accepted(frid), s.failed(frid)
    rn.run_until(lambda: len(s.normal(frid)) == 3)
    assert s.normal(frid) == {Location(0, o): payload(0, o, SIZE) for o in range(3)}


def _ns(name: str) -> TrackNamespace:
    return TrackNamespace.of("relay-test", name)
