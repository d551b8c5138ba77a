"""CAT tokens for MOQT in the pure core: the moqt claim, validation, the policy."""

from __future__ import annotations

import cbor2
import pytest
from auth_keys import SCOPE_A, SCOPE_B, claim, ed25519_key, es256_key, hmac_key, scope_token
from pycose.algorithms import HMAC256
from pycose.headers import KID, Algorithm
from pycose.messages.mac0message import Mac0Message

from kvcs_core.auth import (
    Authorizer,
    IssuerKey,
    KeyFileError,
    MoqtAction,
    TokenStatus,
    inspect_token,
    issue_token,
    key_file_text,
    parse_key_file,
    token_from_text,
    token_to_text,
    validate_token,
)
from kvcs_core.auth.cat import CAT_TOKEN_TYPE, CLAIM_EXP, CLAIM_MOQT, CLAIM_MOQT_REVAL
from kvcs_core.auth.scope import ClaimError, MatchType, parse_moqt_claim
from kvcs_core.wire.codes import RequestErrorCode, SessionErrorCode

NOW = 1_800_000_000.0
A = (b"kvcs-1", SCOPE_A)
B = (b"kvcs-1", SCOPE_B)


# --- the moqt claim (draft-ietf-moq-c4m-02 section 2.1 examples) ---------------------------


def test_exact_namespace_with_nil_and_exact_track() -> None:
    c = parse_moqt_claim([[[2, 3, 6, 7], [b"example", b"com", None], b"/bob"]])
    ok = c.permits
    assert ok(MoqtAction.PUBLISH, [b"example", b"com"], b"/bob")
    assert not ok(MoqtAction.PUBLISH, [b"example", b"com"], b"")
    assert not ok(MoqtAction.PUBLISH, [b"example", b"com"], b"/bob/123")
    assert not ok(MoqtAction.PUBLISH, [b"alternate", b"example", b"com"], b"/bob")
    assert not ok(MoqtAction.PUBLISH, [b"example"], b"com/bob")
    assert not ok(MoqtAction.PUBLISH, [b"example", b"com", b""], b"/bob")
    assert not ok(MoqtAction.SUBSCRIBE, [b"example", b"com"], b"/bob")  # action not listed


def test_prefix_and_suffix_matches() -> None:
    c = parse_moqt_claim([[[6], [b"example", [1, b"user-"], None], [2, b".json"]]])
    assert c.permits(MoqtAction.PUBLISH, [b"example", b"user-alice"], b"a.json")
    assert not c.permits(MoqtAction.PUBLISH, [b"example", b"USER-alice"], b"a.json")
    assert not c.permits(MoqtAction.PUBLISH, [b"example", b"user-a", b"x"], b"a.json")
    assert not c.permits(MoqtAction.PUBLISH, [b"example", b"user-a"], b"a.json.bak")
    assert c.scopes[0].track is not None and c.scopes[0].track.kind is MatchType.SUFFIX


def test_open_namespace_includes_longer_ones_and_any_track() -> None:
    c = parse_moqt_claim([[[2, 3, 6, 7], [b"example", b"com"]]])
    assert c.permits(MoqtAction.FETCH, [b"example", b"com", b"bob"], b"")
    assert c.permits(MoqtAction.PUBLISH_NAMESPACE, [b"example", b"com"])
    assert not c.permits(MoqtAction.FETCH, [b"12345"], b"")


def test_namespace_actions_need_a_scope_without_track_match() -> None:
    c = parse_moqt_claim([[[2, 4], [b"ns"], b"one-track"]])
    assert c.permits(MoqtAction.SUBSCRIBE, [b"ns"], b"one-track")
    assert not c.permits(MoqtAction.PUBLISH_NAMESPACE, [b"ns"])


def test_discovery_of_a_shorter_prefix() -> None:
    c = claim(A, [MoqtAction.SUBSCRIBE_NAMESPACE])
    assert c.may_discover(MoqtAction.SUBSCRIBE_NAMESPACE, [b"kvcs-1"])
    assert c.may_discover(MoqtAction.SUBSCRIBE_NAMESPACE, [b"kvcs-1", SCOPE_A, b"x"])
    assert not c.may_discover(MoqtAction.SUBSCRIBE_NAMESPACE, [b"kvcs-1", SCOPE_B])
    assert not c.permits(MoqtAction.SUBSCRIBE_NAMESPACE, [b"kvcs-1"])


@pytest.mark.parametrize(
    "raw",
    [
        [],
        "x",
        [[]],
        [[[]]],
        [[["x"]]],
        [[[2], [None, b"a"]]],  # nil only last
        [[[2], [b"a"], [3, b"x"]]],  # unknown match type
        [[[2], b"not-a-list"]],
        [[[2], [b"a"], b"t", b"extra"]],
    ],
)
def test_malformed_claims_are_refused(raw: object) -> None:
    with pytest.raises(ClaimError):
        parse_moqt_claim(raw)


def test_claim_round_trips_through_cbor() -> None:
    c = parse_moqt_claim([[[2, 6], [b"a", [1, b"p"], None], [2, b"s"]], [[4]]])
    assert parse_moqt_claim(cbor2.loads(cbor2.dumps(c.to_cbor()))) == c


def test_unknown_actions_grant_nothing_and_are_kept() -> None:
    """Found by fuzz_cat_token: a scope of unknown actions only must re-encode."""
    c = parse_moqt_claim([[[99, 4], [b"a"]], [[1000]]])
    assert c.permits(MoqtAction.SUBSCRIBE, [b"a"], b"t")
    assert not c.scopes[1].actions and c.scopes[1].unknown_actions == {1000}
    assert parse_moqt_claim(cbor2.loads(cbor2.dumps(c.to_cbor()))) == c


# --- tokens -------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [ed25519_key, es256_key, hmac_key])
def test_token_validates_for_each_algorithm(make: object) -> None:
    key: IssuerKey = make()  # type: ignore[operator]
    tok = scope_token(key, SCOPE_A, now=NOW)
    v = validate_token(tok, {key.kid: key.public()}, now=NOW + 10)
    assert v.status is TokenStatus.OK and v.claims is not None and v.claims.moqt is not None
    assert v.claims.moqt.permits(MoqtAction.FETCH, [*A, b"c"], b"t")
    assert not v.claims.moqt.permits(MoqtAction.FETCH, [*B, b"c"], b"t")
    assert v.claims.expires == int(NOW + 3600)


def test_expired_and_not_yet_valid() -> None:
    key = ed25519_key()
    keys = {key.kid: key}
    tok = scope_token(key, SCOPE_A, now=NOW, expires_in=60)
    assert validate_token(tok, keys, now=NOW + 60).status is TokenStatus.EXPIRED
    assert validate_token(tok, keys, now=NOW + 61, leeway=5).status is TokenStatus.OK
    early = issue_token(key, claim(A), now=NOW, expires_in=60, not_before=NOW + 30)
    assert validate_token(early, keys, now=NOW).status is TokenStatus.NOT_YET_VALID
    assert validate_token(early, keys, now=NOW + 30).status is TokenStatus.OK


def test_tampered_wrong_key_and_wrong_issuer_are_untrusted() -> None:
    key = ed25519_key(issuer="https://issuer.example")
    tok = scope_token(key, SCOPE_A, now=NOW)
    keys = {key.kid: key.public()}
    assert validate_token(tok, keys, now=NOW).ok
    flipped = bytearray(tok)
    flipped[-1] ^= 1
    assert validate_token(bytes(flipped), keys, now=NOW).status is TokenStatus.UNTRUSTED
    other = ed25519_key()  # same kid, another key pair
    assert validate_token(tok, {other.kid: other}, now=NOW).status is TokenStatus.UNTRUSTED
    assert validate_token(tok, {b"someone-else": other}, now=NOW).status is TokenStatus.UNTRUSTED
    wrong_iss = issue_token(key, claim(A), now=NOW, expires_in=60, issuer="https://evil")
    v = validate_token(wrong_iss, keys, now=NOW)
    assert v.status is TokenStatus.UNTRUSTED and "issuer" in v.detail
    # an HMAC key under the Ed25519 kid: the algorithm does not fit the key
    mac = hmac_key(kid=key.kid)
    assert validate_token(tok, {key.kid: mac}, now=NOW).status is TokenStatus.UNTRUSTED


@pytest.mark.parametrize(
    "data", [b"", b"\xff", b"\x80", cbor2.dumps([1, 2, 3]), cbor2.dumps({1: 2}), b"\x84" * 40]
)
def test_garbage_is_malformed(data: bytes) -> None:
    key = hmac_key()
    assert validate_token(data, {key.kid: key}, now=NOW).status is TokenStatus.MALFORMED


def test_bad_claims_are_malformed_after_a_valid_mac() -> None:
    key = hmac_key()
    keys = {key.kid: key}

    def mac(claims: dict[int, object]) -> bytes:
        msg = Mac0Message(
            phdr={Algorithm: HMAC256, KID: key.kid},
            uhdr={},
            payload=cbor2.dumps(claims),
            key=key.cose_key(),  # type: ignore[arg-type]
        )
        return bytes(msg.encode(tag=True))

    assert validate_token(mac({CLAIM_MOQT: [[[2], [None, b"a"]]]}), keys, now=NOW).status is (
        TokenStatus.MALFORMED
    )
    assert validate_token(mac({CLAIM_EXP: "soon"}), keys, now=NOW).status is TokenStatus.MALFORMED
    reval = mac({CLAIM_MOQT: claim(A).to_cbor(), CLAIM_MOQT_REVAL: 300})
    assert validate_token(reval, keys, now=NOW).status is TokenStatus.UNSUPPORTED
    zero = mac({CLAIM_MOQT: claim(A).to_cbor(), CLAIM_MOQT_REVAL: 0})
    assert validate_token(zero, keys, now=NOW).ok


def test_text_form_and_inspect() -> None:
    key = es256_key()
    tok = scope_token(key, SCOPE_A, now=NOW)
    text = token_to_text(tok)
    assert "=" not in text and token_from_text(text) == tok
    assert token_from_text(" " + text[:10] + "\n" + text[10:]) == tok
    with pytest.raises(ValueError, match="base64"):
        token_from_text("not base64 !!")
    v = inspect_token(tok)
    assert v.ok and v.claims is not None and v.claims.kid == key.kid
    assert inspect_token(b"junk").status is TokenStatus.MALFORMED


def test_key_file_round_trip_and_errors() -> None:
    keys = (ed25519_key(issuer="me"), es256_key(), hmac_key())
    parsed = parse_key_file(key_file_text(keys))
    assert parsed == keys
    public = parse_key_file(key_file_text(tuple(k.public() for k in keys)))
    assert all(not k.d for k in public) and public[2].k == keys[2].k
    for bad in (
        "nope",
        "{}",
        '{"keys": []}',
        '{"kid": "a", "alg": "RS256"}',
        '{"kid": "a", "alg": "EdDSA", "x": "00"}',
        '{"kid": "", "alg": "HMAC256", "k": "' + "00" * 32 + '"}',
        '{"keys": [{"kid": "a", "alg": "HMAC256", "k": "'
        + "00" * 32
        + '"}, {"kid": "a", "alg": "HMAC256", "k": "'
        + "11" * 32
        + '"}]}',
    ):
        with pytest.raises(KeyFileError):
            parse_key_file(bad)
    with pytest.raises(ValueError, match="private"):
        issue_token(keys[0].public(), claim(A), now=NOW, expires_in=60)


# --- the policy ---------------------------------------------------------------------------


def _authorizer(*keys: IssuerKey, at: list[float]) -> Authorizer:
    return Authorizer(keys, lambda: at[0])


def test_session_admission_codes() -> None:
    key = ed25519_key()
    clock = [NOW]
    auth = _authorizer(key, at=clock)
    good = scope_token(key, SCOPE_A, now=NOW)
    d, grant = auth.check_session([(CAT_TOKEN_TYPE, good)])
    assert d.allowed and len(grant.claims) == 1
    d, _ = auth.check_session([])
    assert d.session_error() is SessionErrorCode.UNAUTHORIZED
    d, _ = auth.check_session([(CAT_TOKEN_TYPE, b"\x00garbage")])
    assert d.session_error() is SessionErrorCode.MALFORMED_AUTH_TOKEN
    old = scope_token(key, SCOPE_A, now=NOW - 7200, expires_in=60)
    d, _ = auth.check_session([(CAT_TOKEN_TYPE, old)])
    assert d.session_error() is SessionErrorCode.EXPIRED_AUTH_TOKEN
    stranger = scope_token(ed25519_key(), SCOPE_A, now=NOW)
    d, _ = auth.check_session([(CAT_TOKEN_TYPE, stranger)])
    assert d.session_error() is SessionErrorCode.UNAUTHORIZED
    no_setup = scope_token(key, SCOPE_A, now=NOW, actions=[MoqtAction.SUBSCRIBE])
    d, _ = auth.check_session([(CAT_TOKEN_TYPE, no_setup)])
    assert d.session_error() is SessionErrorCode.UNAUTHORIZED
    d, _ = auth.check_session([(0, good)])  # not a CAT: ignored
    assert d.session_error() is SessionErrorCode.UNAUTHORIZED


def test_request_decisions_and_codes() -> None:
    key = hmac_key()
    clock = [NOW]
    auth = _authorizer(key, at=clock)
    d, grant = auth.check_session([(CAT_TOKEN_TYPE, scope_token(key, SCOPE_A, now=NOW))])
    assert d.allowed
    sub = MoqtAction.SUBSCRIBE
    assert auth.check_request(sub, [*A, b"c"], b"t", (), grant).allowed
    refused = auth.check_request(sub, [*B, b"c"], b"t", (), grant)
    assert refused.request_error() is RequestErrorCode.UNAUTHORIZED
    # a token on the request adds to the session's grant
    for_b = scope_token(key, SCOPE_B, now=NOW)
    assert auth.check_request(sub, [*B, b"c"], b"t", [(CAT_TOKEN_TYPE, for_b)], grant).allowed
    bad = auth.check_request(sub, [*B, b"c"], b"t", [(CAT_TOKEN_TYPE, b"\xa0")], grant)
    assert bad.request_error() is RequestErrorCode.MALFORMED_AUTH_TOKEN
    old_b = scope_token(key, SCOPE_B, now=NOW - 7200, expires_in=60)
    exp = auth.check_request(sub, [*B, b"c"], b"t", [(CAT_TOKEN_TYPE, old_b)], grant)
    assert exp.request_error() is RequestErrorCode.EXPIRED_AUTH_TOKEN
    # the session's own token expires later: its requests are then refused EXPIRED
    clock[0] = NOW + 4000
    late = auth.check_request(sub, [*A, b"c"], b"t", (), grant)
    assert late.request_error() is RequestErrorCode.EXPIRED_AUTH_TOKEN
