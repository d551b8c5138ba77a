"""``kvcs.transports.quic.apps.ClientApp``: requests of the peer that nothing on the client answers.

Regression (interop with the moq-rs server, tests/interop/): a server may send a
client requests right after SETUP (moq-rs sends SUBSCRIBE_NAMESPACE and
PUBLISH_NAMESPACE to every client), before any publication is attached. They
used to stay unanswered forever; wire reference 8.2 says a limited endpoint
SHOULD answer (NOT_SUPPORTED), not ignore. And a SUBSCRIBE_NAMESPACE covering
several publications of one session reached only the first of them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from session_pair import Pair, track

from kvcs.transports.quic.apps import ClientApp
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire.codes import RequestErrorCode
from kvcs_core.wire.names import TrackNamespace


def wire(pair: Pair, app: ClientApp) -> None:
    pump = SimpleNamespace(session=pair.cli)

    def on_event(machine: Any, event: Any) -> None:
        if machine is pair.cli:
            app.handle_session_event(pump, event, pair.now)  # type: ignore[arg-type]

    pair.net.on_event(on_event)


def answers(pair: Pair) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for e in pair.events(pair.srv, (ev.RequestAccepted, ev.RequestFailed)):
        out[e.request_id] = e
    return out


def test_unclaimed_requests_get_an_answer() -> None:
    pair = Pair()
    pair.auto_accept = False
    wire(pair, ClientApp())
    srv, now = pair.srv, pair.now
    ns = TrackNamespace.of("kvcs", "elsewhere")
    t = track("t", ns)
    rids = {
        "subscribe_namespace": srv.subscribe_namespace(TrackNamespace.of(), now=now),
        "publish_namespace": srv.publish_namespace(ns, now=now),
        "subscribe": srv.subscribe(t, now=now),
        "fetch": srv.fetch(t, now=now),
        "track_status": srv.track_status(t, now=now),
        "publish": srv.publish(TrackStore(t), now=now, forward=False),
        "subscribe_tracks": srv.subscribe_tracks(ns, now=now),
    }
    pair.net.poke(srv)
    pair.wait(lambda: len(answers(pair)) == len(rids), max_time=5)
    got = answers(pair)
    assert isinstance(got[rids["subscribe_namespace"]], ev.RequestAccepted)
    assert isinstance(got[rids["publish_namespace"]], ev.RequestAccepted)
    for name, code in [
        ("subscribe", RequestErrorCode.DOES_NOT_EXIST),
        ("fetch", RequestErrorCode.DOES_NOT_EXIST),
        ("track_status", RequestErrorCode.DOES_NOT_EXIST),
        ("publish", RequestErrorCode.UNINTERESTED),
        ("subscribe_tracks", RequestErrorCode.NOT_SUPPORTED),
    ]:
        e = got[rids[name]]
        assert isinstance(e, ev.RequestFailed) and e.code == code, (name, e)
    assert not pair.cli.is_closed and not srv.is_closed


def test_a_request_answered_by_a_watcher_is_left_alone() -> None:
    pair = Pair()
    pair.auto_accept = False
    app = ClientApp()
    store = TrackStore(track("t"))
    store.append(0, 0, b"x")

    def watch(pump: Any, e: Any, now: float) -> None:
        if isinstance(e, ev.SubscribeRequested):
            pump.session.accept_subscribe(e.request_id, store, now=now)

    app.watchers.append(watch)
    wire(pair, app)
    rid = pair.srv.subscribe(store.name, now=pair.now)
    pair.net.poke(pair.srv)
    pair.wait(lambda: bool(pair.events(pair.srv, ev.SubscribeAccepted)), max_time=5)
    pair.settle(0.2)
    assert not pair.events(pair.srv, ev.RequestFailed)
    assert pair.events(pair.srv, ev.SubscribeAccepted)[0].request_id == rid


class FakePublisher:
    def __init__(self, claims: tuple[type, ...]) -> None:
        self.claims = claims
        self.seen: list[Any] = []

    def handle_session_event(self, session: Any, event: Any, now: float) -> bool:
        if isinstance(event, self.claims):
            self.seen.append(event)
            return True
        return False


def test_subscribe_namespace_reaches_every_publication_other_requests_the_first() -> None:
    pair = Pair()
    pair.auto_accept = False
    app = ClientApp()
    kinds = (ev.SubscribeNamespaceRequested, ev.SubscribeRequested)
    first, second = FakePublisher(kinds), FakePublisher(kinds)
    app.publishers += [(first, pair.cli), (second, pair.cli)]  # type: ignore[list-item]
    wire(pair, app)
    pair.srv.subscribe_namespace(TrackNamespace.of("kvcs"), now=pair.now)
    pair.srv.subscribe(track("t"), now=pair.now)
    pair.net.poke(pair.srv)
    pair.settle(0.5)
    assert [type(e) for e in first.seen] == [ev.SubscribeNamespaceRequested, ev.SubscribeRequested]
    assert [type(e) for e in second.seen] == [ev.SubscribeNamespaceRequested]
