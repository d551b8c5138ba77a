"""The relay's authorization gate on a loopback network (kvcs_core.relay.authz).

Two upstream publishers serve scope A and scope B; clients connect downstream with
CAT tokens in their SETUP (or none). Everything runs in virtual time.
"""

from __future__ import annotations

from auth_keys import SCOPE_A, SCOPE_B, ed25519_key, scope_token
from relay_net import RelayNet, Subscriber, produce

from kvcs_core.auth import Authorizer, IssuerKey
from kvcs_core.auth.cat import CAT_TOKEN_TYPE
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.relay import Relay, RelayConfig
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import RequestErrorCode, SessionErrorCode
from kvcs_core.wire.names import FullTrackName, TrackNamespace

WALL = 1_800_000_000.0
NS_A = TrackNamespace((b"kvcs-1", SCOPE_A, b"content"))
NS_B = TrackNamespace((b"kvcs-1", SCOPE_B, b"content"))
TRACK_A = FullTrackName(NS_A, b"layer-0")
TRACK_B = FullTrackName(NS_B, b"layer-0")


def _net(key: IssuerKey | None) -> tuple[RelayNet, Relay]:
    rn = RelayNet()
    authorizer = None if key is None else Authorizer([key.public()], lambda: WALL + rn.now)
    relay = rn.add_relay(RelayConfig(authorizer=authorizer))
    for ns, name in ((NS_A, TRACK_A), (NS_B, TRACK_B)):
        pub = rn.add_publisher(relay, (ns,))
        store = pub.serve(TrackStore(name))
        produce(store, 0, 3)
    rn.settle(0.05)
    return rn, relay


def _client(rn: RelayNet, relay: Relay, token: bytes | None) -> Subscriber:
    tokens = () if token is None else ((CAT_TOKEN_TYPE, token),)
    return rn.add_subscriber(relay, SessionConfig(role=Role.CLIENT, setup_tokens=tokens))


def _closed(s: Subscriber) -> ev.SessionClosed | None:
    got = s.events(ev.SessionClosed)
    return got[0] if got else None


def _refused(rn: RelayNet, s: Subscriber, rid: int) -> int:
    rn.run_until(lambda: s.failed(rid) is not None or s.accepted(rid), 5.0)
    failed = s.failed(rid)
    assert failed is not None, "the request was not refused"
    return failed.code


def test_scope_a_token_is_confined_to_scope_a() -> None:
    key = ed25519_key()
    rn, relay = _net(key)
    c = _client(rn, relay, scope_token(key, SCOPE_A, now=WALL))
    assert _closed(c) is None and c.session.setup_complete
    # read: A yes, B no (subscribe and fetch)
    ok = c.subscribe_all(TRACK_A)
    rn.run_until(lambda: c.accepted(ok), 5.0)
    assert _refused(rn, c, c.subscribe_all(TRACK_B)) == RequestErrorCode.UNAUTHORIZED
    assert _refused(rn, c, c.fetch(TRACK_B)) == RequestErrorCode.UNAUTHORIZED
    status_b = c.session.track_status(TRACK_B, now=rn.now)
    rn.net.poke(c.session)
    assert _refused(rn, c, status_b) == RequestErrorCode.UNAUTHORIZED
    # discover: only A's namespace is announced under the common prefix
    rid = c.session.subscribe_namespace(TrackNamespace((b"kvcs-1",)), now=rn.now)
    rn.net.poke(c.session)
    rn.settle(0.2)
    seen = {e.namespace for e in c.events(ev.NamespaceAnnounced) if e.request_id == rid}
    assert seen == {NS_A}
    c2 = _client(rn, relay, scope_token(key, SCOPE_A, now=WALL))
    only_b = c2.session.subscribe_namespace(TrackNamespace((b"kvcs-1", SCOPE_B)), now=rn.now)
    rn.net.poke(c2.session)
    assert _refused(rn, c2, only_b) == RequestErrorCode.UNAUTHORIZED
    # announce: in A yes, in B (or the whole kvcs-1 tree) no
    mine = c.session.publish_namespace(TrackNamespace((b"kvcs-1", SCOPE_A, b"new")), now=rn.now)
    theirs = c.session.publish_namespace(NS_B, now=rn.now)
    wide = c.session.publish_namespace(TrackNamespace((b"kvcs-1",)), now=rn.now)
    rn.net.poke(c.session)
    rn.settle(0.2)
    assert any(e.request_id == mine for e in c.events(ev.RequestAccepted))
    assert c.failed(theirs) is not None and c.failed(theirs).code == RequestErrorCode.UNAUTHORIZED
    assert c.failed(wide) is not None and c.failed(wide).code == RequestErrorCode.UNAUTHORIZED
    # inject: a PUBLISH of a track in B is refused and none of its objects is kept
    evil = TrackStore(FullTrackName(NS_B, b"evil"))
    produce(evil, 0, 2)
    good = TrackStore(FullTrackName(TrackNamespace((b"kvcs-1", SCOPE_A, b"new")), b"ok"))
    produce(good, 0, 2)
    bad_rid = c.session.publish(evil, now=rn.now)
    good_rid = c.session.publish(good, now=rn.now)
    rn.net.poke(c.session)
    rn.settle(0.3)
    assert c.failed(bad_rid) is not None
    assert c.failed(bad_rid).code == RequestErrorCode.UNAUTHORIZED
    assert c.failed(good_rid) is None
    stats = relay.track_stats(evil.name)
    assert stats is None or stats.objects_received == 0
    assert relay.stats().refused


def test_subscribe_tracks_offers_only_permitted_tracks() -> None:
    key = ed25519_key()
    rn, relay = _net(key)
    c = _client(rn, relay, scope_token(key, SCOPE_A, now=WALL))
    c.accept_publishes()
    rid = c.subscribe_tracks(TrackNamespace((b"kvcs-1",)))
    rn.settle(0.5)
    assert any(e.request_id == rid for e in c.events(ev.RequestAccepted))
    offered = {e.track for e in c.events(ev.PublishRequested)}
    assert offered == {TRACK_A}
    # a prefix wholly outside the grant is refused outright
    c2 = _client(rn, relay, scope_token(key, SCOPE_A, now=WALL))
    other = c2.subscribe_tracks(TrackNamespace((b"kvcs-1", SCOPE_B)))
    assert _refused(rn, c2, other) == RequestErrorCode.UNAUTHORIZED
    assert not c2.events(ev.PublishRequested)


def test_token_on_a_request_adds_to_the_session_grant() -> None:
    key = ed25519_key()
    rn, relay = _net(key)
    c = _client(rn, relay, scope_token(key, SCOPE_A, now=WALL))
    for_b = scope_token(key, SCOPE_B, now=WALL)
    rid = c.session.subscribe(
        TRACK_B,
        now=rn.now,
        extra=[p.AuthorizationToken.use_value(CAT_TOKEN_TYPE, for_b)],
    )
    rn.net.poke(c.session)
    rn.run_until(lambda: c.accepted(rid) or c.failed(rid) is not None, 5.0)
    assert c.accepted(rid)
    bad = c.session.subscribe(
        TRACK_B, now=rn.now, extra=[p.AuthorizationToken.use_value(CAT_TOKEN_TYPE, b"\xa1")]
    )
    rn.net.poke(c.session)
    assert _refused(rn, c, bad) == RequestErrorCode.MALFORMED_AUTH_TOKEN
    old = scope_token(key, SCOPE_B, now=WALL - 7200, expires_in=60)
    late = c.session.subscribe(
        TRACK_B, now=rn.now, extra=[p.AuthorizationToken.use_value(CAT_TOKEN_TYPE, old)]
    )
    rn.net.poke(c.session)
    assert _refused(rn, c, late) == RequestErrorCode.EXPIRED_AUTH_TOKEN


def test_sessions_without_a_valid_setup_token_are_closed() -> None:
    key = ed25519_key()
    rn, relay = _net(key)
    good = scope_token(key, SCOPE_A, now=WALL)
    tampered = bytearray(good)
    tampered[-2] ^= 0x40
    cases = {
        None: SessionErrorCode.UNAUTHORIZED,
        bytes(tampered): SessionErrorCode.UNAUTHORIZED,
        scope_token(ed25519_key(), SCOPE_A, now=WALL): SessionErrorCode.UNAUTHORIZED,
        scope_token(key, SCOPE_A, now=WALL - 7200, expires_in=60): (
            SessionErrorCode.EXPIRED_AUTH_TOKEN
        ),
        b"\x18": SessionErrorCode.MALFORMED_AUTH_TOKEN,
    }
    for token, code in cases.items():
        c = _client(rn, relay, token)
        rn.run_until(lambda c=c: _closed(c) is not None, 5.0)  # type: ignore[misc]
        closed = _closed(c)
        assert closed is not None and closed.code == code, (token, closed)


def test_a_session_ends_when_its_setup_token_expires() -> None:
    key = ed25519_key()
    rn, relay = _net(key)
    c = _client(rn, relay, scope_token(key, SCOPE_A, now=WALL, expires_in=3))
    lasting = _client(rn, relay, scope_token(key, SCOPE_A, now=WALL, expires_in=3600))
    rid = c.subscribe_all(TRACK_A)
    rn.run_until(lambda: c.accepted(rid), 2.0)
    assert relay.get_timer() is not None
    rn.run_until(lambda: _closed(c) is not None, 10.0)
    closed = _closed(c)
    assert closed is not None and closed.code == SessionErrorCode.EXPIRED_AUTH_TOKEN
    assert rn.now >= 2.9  # not before its exp
    assert _closed(lasting) is None


def test_without_an_authorizer_the_relay_stays_anonymous() -> None:
    rn, relay = _net(None)
    c = _client(rn, relay, None)
    rid = c.subscribe_all(TRACK_B)
    rn.run_until(lambda: c.accepted(rid), 5.0)
    assert _closed(c) is None
