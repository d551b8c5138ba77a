"""Fuzz CAT-4-MOQT token parsing and validation (kvcs_core.auth).

Invariant: any input yields a typed outcome; any other exception is a bug.
``validate_token`` and ``inspect_token`` return a ``TokenVerdict`` with a
``TokenStatus`` and never raise; ``parse_moqt_claim`` returns a ``MoqtClaim`` or
raises ``ClaimError``; ``token_from_text`` returns octets or raises
``ValueError``; the policy (``Authorizer``) returns a ``Decision``.

Input format (plain slicing, the same with and without atheris)::

    byte 0   mode: bit 0 reads the body as a ``moqt`` claim (CBOR) instead of a
             token; bit 1 also runs the token through the policy (SETUP and one
             SUBSCRIBE) and through its text form; bit 2 validates at a time
             after every ``exp`` the fixed keys' seeds use
    rest     the body

Checked beyond "no other exception":

* a token that validates names one of the fixed keys, and its ``moqt`` claim (if
  any) round-trips through CBOR (``parse(claim.to_cbor()) == claim``);
* a claim that parses round-trips likewise, and a token issued with it by the
  fixed HMAC key validates to the same claim (and is refused by a stranger key);
* the policy's decision maps to a REQUEST_ERROR and a session code.
"""

from __future__ import annotations

import contextlib

import cbor2
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from fuzzlib import fuzz_main

from kvcs_core.auth import (
    Authorizer,
    IssuerKey,
    MoqtAction,
    MoqtClaim,
    TokenAlg,
    TokenStatus,
    TokenVerdict,
    inspect_token,
    issue_token,
    token_from_text,
    token_to_text,
    validate_token,
)
from kvcs_core.auth.cat import CAT_TOKEN_TYPE
from kvcs_core.auth.policy import SessionGrant
from kvcs_core.auth.scope import ClaimError, parse_moqt_claim

NOW = 1_800_000_000.0
"""The fixed clock (seeds are issued at NOW - 60 for an hour)."""
LATER = NOW + 86_400 * 365
_ED = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
ED_KEY = IssuerKey(
    kid=b"fuzz-ed25519",
    alg=TokenAlg.EDDSA,
    x=_ED.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
    d=_ED.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
)
MAC_KEY = IssuerKey(kid=b"fuzz-hmac", alg=TokenAlg.HMAC256, k=bytes(range(32, 64)))
STRANGER = IssuerKey(kid=b"fuzz-hmac", alg=TokenAlg.HMAC256, k=bytes(32))
KEYS = {k.kid: k for k in (ED_KEY.public(), MAC_KEY)}
NAMESPACE = (b"kvcs-1", bytes(range(16)), b"c")


def check_verdict(v: TokenVerdict) -> None:
    assert isinstance(v.status, TokenStatus), v
    if v.status is TokenStatus.OK:
        assert v.claims is not None
        moqt = v.claims.moqt
        if moqt is not None:
            assert parse_moqt_claim(cbor2.loads(cbor2.dumps(moqt.to_cbor()))) == moqt


def check_claim(body: bytes) -> None:
    try:
        raw = cbor2.loads(body)
    except Exception:  # not CBOR: nothing of ours to test
        return
    try:
        claim = parse_moqt_claim(raw)
    except ClaimError:
        return
    assert isinstance(claim, MoqtClaim)
    assert parse_moqt_claim(cbor2.loads(cbor2.dumps(claim.to_cbor()))) == claim
    for action in (MoqtAction.SUBSCRIBE, MoqtAction.PUBLISH_NAMESPACE):
        claim.permits(action, NAMESPACE, b"t")
        claim.permits(action, NAMESPACE[:1])
        claim.may_discover(action, NAMESPACE[:1])
    token = issue_token(MAC_KEY, claim, now=NOW, expires_in=60)
    v = validate_token(token, KEYS, now=NOW)
    assert v.ok and v.claims is not None and v.claims.moqt == claim, v
    assert validate_token(token, {STRANGER.kid: STRANGER}, now=NOW).status is TokenStatus.UNTRUSTED


def check_policy(body: bytes) -> None:
    auth = Authorizer(KEYS.values(), lambda: NOW)
    d, grant = auth.check_session([(CAT_TOKEN_TYPE, body)])
    d.session_error()
    assert isinstance(grant, SessionGrant)
    r = auth.check_request(
        MoqtAction.SUBSCRIBE, NAMESPACE, b"t", [(CAT_TOKEN_TYPE, body)], SessionGrant(())
    )
    r.request_error()
    try:
        again = token_from_text(token_to_text(body)) if body else b""
    except ValueError:
        raise AssertionError("the text form of octets did not decode") from None
    assert again == body
    with contextlib.suppress(ValueError):  # not base64url text: a typed refusal
        token_from_text(body.decode("latin-1"))


def check(data: bytes) -> None:
    mode = data[0] if data else 0
    body = data[1:]
    if mode & 1:
        check_claim(body)
        return
    v = validate_token(body, KEYS, now=LATER if mode & 4 else NOW)
    check_verdict(v)
    if v.ok:
        assert v.claims is not None and v.claims.kid in KEYS
    check_verdict(inspect_token(body))
    if mode & 2:
        check_policy(body)


def seeds() -> list[bytes]:
    """Deterministic seeds (``make_corpus.py`` writes them to ``fuzz/corpus/cat_token``)."""
    from kvcs_core.auth.scope import prefix_scope  # noqa: PLC0415 - seeds only

    claims = [
        MoqtClaim((prefix_scope(tuple(MoqtAction), NAMESPACE[:2]),)),
        MoqtClaim((prefix_scope([MoqtAction.SUBSCRIBE_NAMESPACE], NAMESPACE[:1]),)),
        parse_moqt_claim([[[2, 3, 6, 7], [b"example", b"com", None], b"/bob"]]),
        parse_moqt_claim([[[6], [b"example", [1, b"user-"], None], [2, b".json"]], [[4]]]),
    ]
    out: list[bytes] = []
    for i, claim in enumerate(claims):
        for key in (ED_KEY, MAC_KEY):
            token = issue_token(key, claim, now=NOW - 60, expires_in=3600, issuer=f"iss-{i}")
            out += [bytes([0]) + token, bytes([2]) + token, bytes([4]) + token]
        out.append(bytes([1]) + cbor2.dumps(claim.to_cbor()))
    out.append(bytes([2]) + b"\xd2\x84\x40\xa0\x40\x40")  # an empty COSE_Sign1
    out.append(bytes([1]) + cbor2.dumps([[[2], [None, b"a"]]]))  # nil not last
    return out


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
