"""Authorization-token aliases through a session (d21 8.9, 9.1; Ambiguity A12)."""

from __future__ import annotations

from session_pair import Pair, track

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.auth import TokenCache
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.errors import PeerViolation
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import SessionErrorCode

T = p.AuthorizationToken


def _server(cache: int) -> Pair:
    return Pair(server_config=SessionConfig(role=Role.SERVER, max_auth_token_cache_size=cache))


def test_register_then_use_alias_presents_the_token() -> None:
    pair = _server(1024)
    store = pair.serve(TrackStore(track("k.raw.s0")))
    a = pair.cli.subscribe(store.name, now=pair.now, extra=[T.register(7, 0, b"secret")])
    pair.settle(0.1)
    assert pair.srv.requests[a].tokens == ((0, b"secret"),)
    c = pair.cli.subscribe(track("k.raw.s1"), now=pair.now, extra=[T.use_alias(7)])
    pair.settle(0.1)
    assert pair.srv.requests[c].tokens == ((0, b"secret"),)
    assert pair.srv.tokens.used == 16 + len(b"secret")
    assert not pair.srv.is_closed


def test_register_beyond_the_cache_closes_with_overflow() -> None:
    pair = _server(20)  # 16 + 6 bytes does not fit
    pair.cli.subscribe(track("x"), now=pair.now, extra=[T.register(1, 0, b"secret")])
    pair.settle(0.1)
    closed = pair.events(pair.srv, ev.SessionClosed)
    assert closed and closed[0].code == SessionErrorCode.AUTH_TOKEN_CACHE_OVERFLOW


def test_unknown_alias_closes_with_unknown_auth_token_alias() -> None:
    pair = _server(1024)
    pair.cli.subscribe(track("x"), now=pair.now, extra=[T.use_alias(3)])
    pair.settle(0.1)
    closed = pair.events(pair.srv, ev.SessionClosed)
    assert closed and closed[0].code == SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS


def test_cache_rules_directly() -> None:
    cache = TokenCache(100)
    assert cache.resolve([T.register(1, 5, b"abc")]) == ((5, b"abc"),)
    try:
        cache.resolve([T.register(1, 5, b"abc")])
    except PeerViolation as v:
        assert v.code == SessionErrorCode.DUPLICATE_AUTH_TOKEN_ALIAS
    else:
        raise AssertionError("duplicate alias accepted")
    assert cache.resolve([T.delete(1)]) == ()
    assert cache.used == 0 and len(cache) == 0
    # in SETUP an overflowing REGISTER is only used once, not cached (d21 9.1)
    small = TokenCache(0)
    assert small.resolve([T.register(2, 0, b"v")], in_setup=True) == ((0, b"v"),)
    assert len(small) == 0
