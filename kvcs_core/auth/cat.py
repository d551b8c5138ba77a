"""CAT tokens for MOQT (draft-ietf-moq-c4m-02): issue and validate a CWT.

Theory of operation
-------------------
A token is a CBOR Web Token (RFC 8392) protected by COSE (RFC 9052): a
COSE_Sign1 (tag 18; ES256 or EdDSA) or a COSE_Mac0 (tag 17; HMAC 256/256), with
the algorithm in the protected header and the issuer key's ``kid`` in either
header bucket; the CWT tag 61 and the COSE tag are optional on input. It
travels in MOQT's AUTHORIZATION_TOKEN with Token Type :data:`CAT_TOKEN_TYPE`
(0x01, the draft's registration) and, as text, as base64url without padding
(:func:`token_from_text`).

Claims used (RFC 8392 labels): ``iss`` (1), ``aud`` (3, not checked), ``exp``
(4), ``nbf`` (5), ``iat`` (6), ``cti`` (7), and the draft's ``moqt`` and
``moqt-reval`` claims, whose labels the draft leaves "TBD": kvcs uses
:data:`CLAIM_MOQT` = 327 and :data:`CLAIM_MOQT_REVAL` = 328 (the values one
public CAT implementation chose; a relay and its issuer must agree). Other
claims are ignored.

:func:`validate_token` checks, in order, and returns the first failure as a
:class:`TokenStatus` (never raising on bad input):

1. size (:data:`MAX_TOKEN_BYTES`), exactly one CBOR item, COSE structure,
   claims a CBOR map with the types above, a ``moqt`` claim that follows the
   CDDL (:mod:`.scope`) -> ``MALFORMED``;
2. ``alg`` protected and one of :class:`~.keys.TokenAlg`, ``kid`` known, the
   key's algorithm equal to ``alg``, the signature or MAC valid, and the key's
   ``iss`` (if it has one) equal to the token's -> ``UNTRUSTED``;
3. ``exp`` <= now -> ``EXPIRED``; now < ``nbf`` -> ``NOT_YET_VALID`` (``leeway``
   seconds of tolerance on both); the clock is passed in (seconds since the Unix
   epoch);
4. a non-zero ``moqt-reval``: the draft requires a recipient that does not
   revalidate to reject it -> ``UNSUPPORTED``.

Whether the valid token permits an action is :mod:`.scope`'s question; a token
without a ``moqt`` claim permits nothing (the draft: all actions blocked unless
enabled).
"""

from __future__ import annotations

import base64
import binascii
import enum
import io
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs
import cbor2
from pycose.algorithms import HMAC256, EdDSA, Es256
from pycose.headers import KID, Algorithm
from pycose.keys.symmetric import SymmetricKey
from pycose.messages.mac0message import Mac0Message
from pycose.messages.sign1message import Sign1Message

from kvcs_core.auth.keys import IssuerKey, TokenAlg
from kvcs_core.auth.scope import ClaimError, MoqtClaim, parse_moqt_claim

CAT_TOKEN_TYPE: Final = 0x01
"""MOQT Auth Token Type of a CAT (draft-ietf-moq-c4m-02, IANA section)."""
CLAIM_ISS: Final = 1
CLAIM_AUD: Final = 3
CLAIM_EXP: Final = 4
CLAIM_NBF: Final = 5
CLAIM_IAT: Final = 6
CLAIM_CTI: Final = 7
CLAIM_MOQT: Final = 327
"""The ``moqt`` claim label (TBD_MOQT in the draft; module docstring)."""
CLAIM_MOQT_REVAL: Final = 328
"""The ``moqt-reval`` claim label (TBD_MOQT_REVAL in the draft)."""
CWT_TAG: Final = 61
COSE_MAC0_TAG: Final = 17
COSE_SIGN1_TAG: Final = 18
MAX_TOKEN_BYTES: Final = 8192
"""Larger tokens are refused unread (``MALFORMED``)."""
_MAX_DEPTH: Final = 16
_HEADER_ALG: Final = 1
_HEADER_CRIT: Final = 2
_HEADER_KID: Final = 4
_PYCOSE_ALG: Final = {TokenAlg.ES256: Es256, TokenAlg.EDDSA: EdDSA, TokenAlg.HMAC256: HMAC256}


class TokenStatus(enum.IntEnum):
    """The outcome of validating (and, for ``NOT_PERMITTED``, evaluating) a token."""

    OK = 0
    MALFORMED = 1
    EXPIRED = 2
    NOT_YET_VALID = 3
    UNTRUSTED = 4
    """Unknown kid, wrong algorithm for the key, bad signature/MAC, or wrong issuer."""
    UNSUPPORTED = 5
    """A non-zero ``moqt-reval`` (we do not revalidate)."""
    NOT_PERMITTED = 6
    """Valid, but it does not grant the action asked for."""


@attrs.frozen
class TokenClaims:
    """The claims of a token that validated."""

    moqt: MoqtClaim | None
    issuer: str | None = None
    expires: float | None = None
    not_before: float | None = None
    issued_at: float | None = None
    cti: bytes | None = None
    kid: bytes = b""


@attrs.frozen
class TokenVerdict:
    """:func:`validate_token`'s answer: ``claims`` is set only when ``status`` is OK
    (or, for :func:`inspect_token`, whenever the claims could be decoded)."""

    status: TokenStatus
    detail: str = ""
    claims: TokenClaims | None = None

    @property
    def ok(self) -> bool:
        return self.status is TokenStatus.OK


class _Bad(Exception):
    def __init__(self, status: TokenStatus, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _decode_one(data: bytes) -> Any:
    fp = io.BytesIO(data)
    try:
        value = cbor2.CBORDecoder(fp, allow_duplicate_keys=False, max_depth=_MAX_DEPTH).decode()
    except Exception as e:  # third-party decoder: any failure on peer bytes is malformed
        raise _Bad(TokenStatus.MALFORMED, f"not CBOR: {e}") from None
    if fp.tell() != len(data):
        raise _Bad(TokenStatus.MALFORMED, "octets after the CBOR item")
    return value


def _map(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict | cbor2.frozendict):
        raise _Bad(TokenStatus.MALFORMED, f"{what} is not a map")
    out = dict(value)
    for label in out:
        if type(label) not in (int, str):
            raise _Bad(TokenStatus.MALFORMED, f"{what} label {label!r} is neither int nor text")
    return out


def _number(claims: dict[Any, Any], label: int, what: str) -> float | None:
    v = claims.get(label)
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v):
        raise _Bad(TokenStatus.MALFORMED, f"{what} is not a finite number")
    return float(v)


def _claims(payload: bytes, kid: bytes) -> TokenClaims:
    raw = _map(_decode_one(payload), "claims set")
    iss = raw.get(CLAIM_ISS)
    if iss is not None and not isinstance(iss, str):
        raise _Bad(TokenStatus.MALFORMED, "iss is not text")
    cti = raw.get(CLAIM_CTI)
    if cti is not None and not isinstance(cti, bytes | str):
        raise _Bad(TokenStatus.MALFORMED, "cti is not a byte string")
    moqt: MoqtClaim | None = None
    if CLAIM_MOQT in raw:
        try:
            moqt = parse_moqt_claim(raw[CLAIM_MOQT])
        except ClaimError as e:
            raise _Bad(TokenStatus.MALFORMED, f"moqt claim: {e}") from None
    reval = _number(raw, CLAIM_MOQT_REVAL, "moqt-reval")
    if reval is not None and reval < 0:
        raise _Bad(TokenStatus.MALFORMED, "moqt-reval is negative")
    out = TokenClaims(
        moqt=moqt,
        issuer=iss,
        expires=_number(raw, CLAIM_EXP, "exp"),
        not_before=_number(raw, CLAIM_NBF, "nbf"),
        issued_at=_number(raw, CLAIM_IAT, "iat"),
        cti=cti.encode() if isinstance(cti, str) else cti,
        kid=kid,
    )
    if reval:
        raise _Bad(
            TokenStatus.UNSUPPORTED, f"moqt-reval {reval:g} s: this relay does not revalidate"
        )
    return out


def _structure(token: bytes) -> tuple[int | None, list[Any], dict[Any, Any], dict[Any, Any]]:
    """(COSE tag or None, [phdr bytes, uhdr, payload, tag/signature], phdr, uhdr)."""
    if len(token) > MAX_TOKEN_BYTES:
        raise _Bad(TokenStatus.MALFORMED, f"{len(token)} octets exceed {MAX_TOKEN_BYTES}")
    item = _decode_one(token)
    if isinstance(item, cbor2.CBORTag) and item.tag == CWT_TAG:
        item = item.value
    tag: int | None = None
    if isinstance(item, cbor2.CBORTag):
        if item.tag not in (COSE_MAC0_TAG, COSE_SIGN1_TAG):
            raise _Bad(TokenStatus.MALFORMED, f"CBOR tag {item.tag} is not COSE_Sign1 or COSE_Mac0")
        tag, item = item.tag, item.value
    if not isinstance(item, list | tuple) or len(item) != 4:
        raise _Bad(TokenStatus.MALFORMED, "a COSE_Sign1/COSE_Mac0 is an array of 4")
    phdr_bytes, uhdr_raw, payload, sig = item
    if not all(isinstance(v, bytes) for v in (phdr_bytes, payload, sig)):
        raise _Bad(TokenStatus.MALFORMED, "protected header, payload and tag must be byte strings")
    phdr = _map(_decode_one(phdr_bytes), "protected header") if phdr_bytes else {}
    uhdr = _map(uhdr_raw, "unprotected header")
    if set(phdr) & set(uhdr):
        raise _Bad(TokenStatus.MALFORMED, "a header label in both buckets")
    return tag, [phdr_bytes, uhdr, payload, sig], phdr, uhdr


def _authenticate(
    tag: int | None,
    parts: list[Any],
    phdr: dict[Any, Any],
    uhdr: dict[Any, Any],
    keys: Mapping[bytes, IssuerKey],
) -> IssuerKey:
    alg_value = phdr.get(_HEADER_ALG)
    if type(alg_value) is not int or alg_value not in TokenAlg._value2member_map_:
        raise _Bad(
            TokenStatus.UNTRUSTED, f"alg {alg_value!r}: not a protected ES256, EdDSA or HMAC256"
        )
    alg = TokenAlg(alg_value)
    if _HEADER_CRIT in phdr:
        raise _Bad(TokenStatus.UNTRUSTED, "crit lists header parameters we do not process")
    mac = alg is TokenAlg.HMAC256
    if tag is not None and (tag == COSE_MAC0_TAG) != mac:
        raise _Bad(TokenStatus.MALFORMED, "the COSE tag does not fit the algorithm")
    kid = phdr.get(_HEADER_KID, uhdr.get(_HEADER_KID))
    if not isinstance(kid, bytes):
        raise _Bad(TokenStatus.UNTRUSTED, "no kid (byte string) header")
    key = keys.get(kid)
    if key is None:
        raise _Bad(TokenStatus.UNTRUSTED, f"unknown issuer key {kid!r}")
    if key.alg is not alg:
        raise _Bad(TokenStatus.UNTRUSTED, f"key {kid!r} is not an {alg.name} key")
    try:
        if mac:
            mmsg = Mac0Message.from_cose_obj(list(parts), True)
            mmsg.key = key.cose_key()
            ok = bool(mmsg.verify_tag())
        else:
            smsg = Sign1Message.from_cose_obj(list(parts), True)
            smsg.key = key.cose_key()
            ok = bool(smsg.verify_signature())
    except Exception as e:  # pycose raises several types on odd headers or lengths
        raise _Bad(TokenStatus.UNTRUSTED, f"cannot verify: {e}") from None
    if not ok:
        raise _Bad(TokenStatus.UNTRUSTED, "signature or MAC does not verify")
    return key


def validate_token(
    token: bytes | bytearray | memoryview,
    keys: Mapping[bytes, IssuerKey],
    *,
    now: float,
    leeway: float = 0.0,
) -> TokenVerdict:
    """Validate ``token`` against the issuer keys (by kid) at ``now`` (Unix seconds).

    Never raises on bad input (module docstring for the checks and their order).
    """
    data = bytes(token)
    try:
        tag, parts, phdr, uhdr = _structure(data)
        key = _authenticate(tag, parts, phdr, uhdr, keys)
        claims = _claims(parts[2], key.kid)
        if key.issuer is not None and claims.issuer != key.issuer:
            raise _Bad(TokenStatus.UNTRUSTED, f"issuer {claims.issuer!r} is not {key.issuer!r}")
        if claims.expires is not None and now >= claims.expires + leeway:
            return TokenVerdict(TokenStatus.EXPIRED, f"expired at {claims.expires:.0f}", claims)
        if claims.not_before is not None and now + leeway < claims.not_before:
            return TokenVerdict(
                TokenStatus.NOT_YET_VALID, f"not valid before {claims.not_before:.0f}", claims
            )
    except _Bad as b:
        return TokenVerdict(b.status, b.detail)
    return TokenVerdict(TokenStatus.OK, "", claims)


def inspect_token(token: bytes) -> TokenVerdict:
    """Decode ``token``'s claims without checking its signature or its times: ``OK`` with
    the claims, or ``MALFORMED`` (what ``kvcs token inspect`` shows without a key)."""
    try:
        _tag, parts, phdr, uhdr = _structure(bytes(token))
        kid = phdr.get(_HEADER_KID, uhdr.get(_HEADER_KID))
        claims = _claims(parts[2], kid if isinstance(kid, bytes) else b"")
    except _Bad as b:
        return TokenVerdict(b.status, b.detail)
    return TokenVerdict(TokenStatus.OK, "not verified", claims)


def issue_token(
    key: IssuerKey,
    moqt: MoqtClaim,
    *,
    now: float,
    expires_in: float,
    issuer: str | None = None,
    not_before: float | None = None,
    cti: bytes | None = None,
    extra: Mapping[int, Any] | None = None,
) -> bytes:
    """A signed (or MACed) CAT: tagged COSE_Sign1/COSE_Mac0 over the claims.

    ``iat`` = ``now``, ``exp`` = ``now + expires_in`` (integers, rounded down); ``iss``
    = ``issuer``, else the key's issuer if it has one. ``extra``: more claims by label.

    Raises:
        ValueError: the key cannot issue (a public key), or a bad ``expires_in``.
    """
    if not key.can_issue:
        raise ValueError("issuing needs a private key (this key file has no 'd')")
    if not math.isfinite(expires_in) or expires_in <= 0:
        raise ValueError("expires_in must be a positive number of seconds")
    claims: dict[int, Any] = dict(extra or {})
    iss = issuer if issuer is not None else key.issuer
    if iss is not None:
        claims[CLAIM_ISS] = iss
    claims[CLAIM_IAT] = int(now)
    claims[CLAIM_EXP] = int(now + expires_in)
    if not_before is not None:
        claims[CLAIM_NBF] = int(not_before)
    if cti is not None:
        claims[CLAIM_CTI] = cti
    claims[CLAIM_MOQT] = moqt.to_cbor()
    payload = cbor2.dumps(claims)
    phdr = {Algorithm: _PYCOSE_ALG[key.alg], KID: key.kid}
    ckey = key.cose_key()
    if isinstance(ckey, SymmetricKey):
        return bytes(Mac0Message(phdr=phdr, uhdr={}, payload=payload, key=ckey).encode(tag=True))
    return bytes(Sign1Message(phdr=phdr, uhdr={}, payload=payload, key=ckey).encode(tag=True))


def token_to_text(token: bytes) -> str:
    """base64url without padding (the draft's text form)."""
    return base64.urlsafe_b64encode(token).rstrip(b"=").decode("ascii")


def token_from_text(text: str) -> bytes:
    """The token octets of its text form (base64url, padding optional; standard base64
    is accepted too). ``ValueError`` if it is not base64."""
    s = "".join(text.split())
    if not s:
        raise ValueError("empty token")
    s = s.replace("+", "-").replace("/", "_").rstrip("=")
    try:
        out = base64.b64decode(s + "=" * (-len(s) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the token is not base64url text") from None
    if not out:
        raise ValueError("empty token")
    return out


def keys_by_kid(keys: Iterable[IssuerKey]) -> dict[bytes, IssuerKey]:
    return {k.kid: k for k in keys}


__all__ = [
    "CAT_TOKEN_TYPE",
    "CLAIM_MOQT",
    "CLAIM_MOQT_REVAL",
    "TokenClaims",
    "TokenStatus",
    "TokenVerdict",
    "inspect_token",
    "issue_token",
    "keys_by_kid",
    "token_from_text",
    "token_to_text",
    "validate_token",
]
