"""The ``manifest.cose`` envelope: COSE_Sign1 over the manifest JSON (profile 3.6).

Theory of operation
-------------------
Profile 3.6: with ``manifest.cose`` "the publisher signs each version with its
producer key, using the COSE algorithm ES256 or EdDSA [RFC9053], and places the
key identifier in the "kid" header parameter". Producer keys reach the scope's
members out of band; here they are *passed in* (the core reads no files).

Signing (:func:`sign_manifest`) emits a tagged COSE_Sign1 (CBOR tag 18,
RFC 9052 section 4.2)::

    18([ protected = bstr .cbor {1: alg, 4: kid},   ; alg -7 (ES256) or -8 (EdDSA)
         unprotected = {},
         payload = bstr (the manifest JSON octets),
         signature = bstr ])

The algorithm follows from the key (P-256 -> ES256, Ed25519/Ed448 -> EdDSA).
``kid`` is placed in the *protected* bucket so that it is covered by the
signature. EdDSA signatures are deterministic, so an Ed25519 envelope is byte
stable for a given key, kid and payload; pycose 1.1 also signs ES256 with RFC
6979 deterministic nonces, but that is an implementation detail nobody should
rely on.

Verifying (:func:`verify_manifest`) returns the payload octets, or a
:class:`ManifestRejected` with a :class:`CoseRejectReason`; it never raises on
bad input. Checks, in order:

1. size limit; a single well-formed CBOR item with nothing after it (duplicate
   map keys refused); tag 18 or no tag (RFC 9052 allows the untagged form where
   the context says what it is, and a ``manifest.cose`` Object does);
2. an array of four: protected ``bstr`` (empty, or a CBOR map), unprotected map,
   payload ``bstr`` (a detached ``nil`` payload is refused), signature ``bstr``;
   no label in both buckets (RFC 9052 section 3);
3. ``alg`` present, in the protected bucket (RFC 9052 section 3.1 says it should
   be protected and we require it), and ES256 or EdDSA;
4. no ``crit`` parameter (we understand none beyond alg and kid);
5. ``kid`` present (either bucket) and known in ``keys_by_kid``;
6. the key fits the algorithm (P-256 for ES256, Ed25519/Ed448 for EdDSA, and a
   pycose key's own ``alg``, if set, agrees);
7. the signature verifies (pycose, over Sig_structure "Signature1" with the
   protected header octets *as received* and empty external AAD).

Keys may be given as pycose ``EC2Key``/``OKPKey`` objects or as ``cryptography``
keys (``EllipticCurvePrivateKey``/``PublicKey`` on SECP256R1,
``Ed25519PrivateKey``/``PublicKey``, ``Ed448PrivateKey``/``PublicKey``); a
private key also works for verification. A key of any other kind is local
misuse: :class:`CoseKeyError` (a ``ValueError``).
"""

from __future__ import annotations

import enum
import io
from collections.abc import Mapping
from typing import Any, Final

import attrs
import cbor2
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pycose.algorithms import CoseAlgorithm, EdDSA, Es256
from pycose.headers import KID, Algorithm
from pycose.keys.curves import P256, Ed448, Ed25519
from pycose.keys.ec2 import EC2Key
from pycose.keys.okp import OKPKey
from pycose.messages.sign1message import Sign1Message

from kvcs_core.kvcs.manifest import DEFAULT_MAX_MANIFEST_BYTES

COSE_SIGN1_TAG: Final = 18
"""RFC 9052 section 2: COSE_Sign1_Tagged."""
HEADER_ALG: Final = 1
HEADER_CRIT: Final = 2
HEADER_KID: Final = 4
DEFAULT_MAX_COSE_BYTES: Final = DEFAULT_MAX_MANIFEST_BYTES + 4096
"""Manifest limit plus room for headers and a signature."""
_MAX_CBOR_DEPTH: Final = 16


class CoseAlg(enum.IntEnum):
    """The COSE algorithms profile 3.6 allows (RFC 9053 identifiers)."""

    ES256 = -7
    EDDSA = -8


_PYCOSE_ALG: Final[dict[CoseAlg, type[CoseAlgorithm]]] = {
    CoseAlg.ES256: Es256,
    CoseAlg.EDDSA: EdDSA,
}

SigningKey = (
    EC2Key | OKPKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey
)
"""A producer's private key: a pycose key or a ``cryptography`` key (P-256,
Ed25519 or Ed448)."""
VerificationKey = (
    EC2Key
    | OKPKey
    | ec.EllipticCurvePublicKey
    | ec.EllipticCurvePrivateKey
    | ed25519.Ed25519PublicKey
    | ed25519.Ed25519PrivateKey
    | ed448.Ed448PublicKey
    | ed448.Ed448PrivateKey
)
"""A producer's public key (a private key works too)."""


class CoseKeyError(ValueError):
    """A key that cannot be used for ES256 or EdDSA, or a bad ``kid`` (local misuse)."""


class CoseRejectReason(enum.IntEnum):
    """Why a ``manifest.cose`` payload was refused (discard the version)."""

    TOO_LARGE = 1
    MALFORMED = 2
    """Not a single COSE_Sign1 CBOR item of the RFC 9052 shape."""
    UNSUPPORTED_ALG = 3
    """``alg`` missing, unprotected, or neither ES256 nor EdDSA."""
    CRITICAL_HEADER = 4
    """A ``crit`` header parameter (nothing beyond alg and kid is understood)."""
    MISSING_KID = 5
    UNKNOWN_KID = 6
    KEY_MISMATCH = 7
    """The key for ``kid`` does not fit ``alg`` (wrong key type, curve or key alg)."""
    BAD_SIGNATURE = 8


@attrs.frozen
class ManifestRejected:
    """A ``manifest.cose`` Object that did not verify; never use its payload."""

    reason: CoseRejectReason
    detail: str
    kid: bytes | None = None


# --- keys -----------------------------------------------------------------------


def _be(n: int, size: int) -> bytes:
    return n.to_bytes(size, "big")


def _raw_public(key: ed25519.Ed25519PublicKey | ed448.Ed448PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def to_cose_key(key: SigningKey | VerificationKey) -> EC2Key | OKPKey:
    """The pycose form of ``key`` (pycose keys are returned as they are).

    Raises :class:`CoseKeyError` for anything but P-256 EC keys and Ed25519 /
    Ed448 keys.
    """
    if isinstance(key, EC2Key | OKPKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, ec.SECP256R1):
            raise CoseKeyError(f"EC key on {key.curve.name}: ES256 needs P-256 (secp256r1)")
        if isinstance(key, ec.EllipticCurvePrivateKey):
            priv = key.private_numbers()
            pub = priv.public_numbers
            return EC2Key(
                crv=P256, x=_be(pub.x, 32), y=_be(pub.y, 32), d=_be(priv.private_value, 32)
            )
        pub = key.public_numbers()
        return EC2Key(crv=P256, x=_be(pub.x, 32), y=_be(pub.y, 32))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return OKPKey(crv=Ed25519, x=_raw_public(key.public_key()), d=key.private_bytes_raw())
    if isinstance(key, ed25519.Ed25519PublicKey):
        return OKPKey(crv=Ed25519, x=_raw_public(key))
    if isinstance(key, ed448.Ed448PrivateKey):
        return OKPKey(crv=Ed448, x=_raw_public(key.public_key()), d=key.private_bytes_raw())
    if isinstance(key, ed448.Ed448PublicKey):
        return OKPKey(crv=Ed448, x=_raw_public(key))
    raise CoseKeyError(f"unsupported key type {type(key).__name__}")


def alg_for_key(key: EC2Key | OKPKey) -> CoseAlg | None:
    """ES256 for a P-256 EC2 key, EdDSA for an Ed25519/Ed448 OKP key, else None."""
    crv = key.crv
    if isinstance(key, EC2Key) and crv is P256:
        return CoseAlg.ES256
    if isinstance(key, OKPKey) and crv in (Ed25519, Ed448):
        return CoseAlg.EDDSA
    return None


# --- signing ------------------------------------------------------------------------


def sign_manifest(manifest_json: bytes, key: SigningKey, kid: bytes) -> bytes:
    """A tagged COSE_Sign1 around ``manifest_json``, signed with ``key``.

    The algorithm follows from the key: ES256 for P-256, EdDSA for Ed25519 or
    Ed448. ``kid`` (non-empty bytes) goes in the protected header. Raises
    :class:`CoseKeyError` for a key that cannot sign.
    """
    if not isinstance(kid, bytes) or not kid:
        raise CoseKeyError("kid must be non-empty bytes")
    cose_key = to_cose_key(key)
    alg = alg_for_key(cose_key)
    if alg is None:
        raise CoseKeyError("the key is neither P-256 (ES256) nor Ed25519/Ed448 (EdDSA)")
    if not cose_key.d:
        raise CoseKeyError("signing needs a private key")
    msg = Sign1Message(
        phdr={Algorithm: _PYCOSE_ALG[alg], KID: kid},
        uhdr={},
        payload=bytes(manifest_json),
        key=cose_key,
    )
    try:
        return msg.encode(tag=True)
    except Exception as e:  # pycose reports key/alg conflicts with several types
        raise CoseKeyError(f"pycose could not sign: {e}") from e


# --- verifying --------------------------------------------------------------------------


class _Malformed(Exception):
    pass


def _decode_one(data: bytes) -> Any:
    """Exactly one CBOR item, nothing after it, no duplicate map keys."""
    fp = io.BytesIO(data)
    try:
        value = cbor2.CBORDecoder(
            fp, allow_duplicate_keys=False, max_depth=_MAX_CBOR_DEPTH
        ).decode()
    except Exception as e:  # cbor2 is third-party: any failure on peer bytes is malformed
        raise _Malformed(f"not CBOR: {e}") from None
    if fp.tell() != len(data):
        raise _Malformed(f"{len(data) - fp.tell()} octets after the CBOR item")
    return value


def _header_map(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict | cbor2.frozendict):
        raise _Malformed(f"{what} header is not a map")
    out = dict(value)
    for label in out:
        if type(label) not in (int, str):
            raise _Malformed(f"{what} header label {label!r} is neither int nor text")
    return out


def verify_manifest(
    cose_bytes: bytes | bytearray | memoryview,
    keys_by_kid: Mapping[bytes, VerificationKey],
    *,
    max_size: int = DEFAULT_MAX_COSE_BYTES,
) -> bytes | ManifestRejected:
    """Verify a ``manifest.cose`` payload; return the manifest JSON octets.

    Returns :class:`ManifestRejected` for anything that is not a COSE_Sign1 with
    ES256/EdDSA signed by the key ``keys_by_kid`` maps its ``kid`` to. Never
    raises on bad input; raises :class:`CoseKeyError` only when the key found
    for the ``kid`` is of an unsupported kind (local misuse).
    """
    if len(cose_bytes) > max_size:
        return ManifestRejected(
            CoseRejectReason.TOO_LARGE, f"{len(cose_bytes)} octets exceed the limit {max_size}"
        )
    data = bytes(cose_bytes)
    try:
        item = _decode_one(data)
        if isinstance(item, cbor2.CBORTag):
            if item.tag != COSE_SIGN1_TAG:
                raise _Malformed(f"CBOR tag {item.tag}, not COSE_Sign1 ({COSE_SIGN1_TAG})")
            item = item.value
        if not isinstance(item, list | tuple) or len(item) != 4:
            raise _Malformed("COSE_Sign1 is an array of 4 elements")
        phdr_bytes, uhdr_raw, payload, signature = item
        if not isinstance(phdr_bytes, bytes):
            raise _Malformed("protected header is not a byte string")
        if payload is None:
            raise _Malformed("detached payloads are not used for manifests")
        if not isinstance(payload, bytes) or not isinstance(signature, bytes):
            raise _Malformed("payload and signature must be byte strings")
        phdr = _header_map(_decode_one(phdr_bytes), "protected") if phdr_bytes else {}
        uhdr = _header_map(uhdr_raw, "unprotected")
        both = set(phdr) & set(uhdr)
        if both:
            raise _Malformed(f"labels {sorted(map(str, both))} in both header buckets")
    except _Malformed as e:
        return ManifestRejected(CoseRejectReason.MALFORMED, str(e))

    kid_value = phdr.get(HEADER_KID, uhdr.get(HEADER_KID))
    kid = kid_value if isinstance(kid_value, bytes) else None
    if HEADER_ALG not in phdr:
        where = "unprotected" if HEADER_ALG in uhdr else "absent"
        return ManifestRejected(
            CoseRejectReason.UNSUPPORTED_ALG, f"alg must be protected (it is {where})", kid
        )
    alg_value = phdr[HEADER_ALG]
    if type(alg_value) is not int or alg_value not in (CoseAlg.ES256, CoseAlg.EDDSA):
        return ManifestRejected(
            CoseRejectReason.UNSUPPORTED_ALG, f"alg {alg_value!r} is neither ES256 nor EdDSA", kid
        )
    alg = CoseAlg(alg_value)
    if HEADER_CRIT in phdr or HEADER_CRIT in uhdr:
        return ManifestRejected(
            CoseRejectReason.CRITICAL_HEADER, "crit lists parameters we do not process", kid
        )
    if kid_value is None:
        return ManifestRejected(CoseRejectReason.MISSING_KID, "no kid header parameter")
    if kid is None:
        return ManifestRejected(CoseRejectReason.MALFORMED, "kid is not a byte string")
    key = keys_by_kid.get(kid)
    if key is None:
        return ManifestRejected(CoseRejectReason.UNKNOWN_KID, f"no producer key {kid.hex()}", kid)
    cose_key = to_cose_key(key)
    key_alg = alg_for_key(cose_key)
    if key_alg is not alg:
        return ManifestRejected(
            CoseRejectReason.KEY_MISMATCH,
            f"alg {alg.name} but the key for this kid is for "
            f"{key_alg.name if key_alg else 'neither ES256 nor EdDSA'}",
            kid,
        )
    own_alg = cose_key.alg
    if own_alg is not None and getattr(own_alg, "identifier", None) != int(alg):
        return ManifestRejected(
            CoseRejectReason.KEY_MISMATCH,
            f"the key is restricted to {getattr(own_alg, 'fullname', own_alg)}",
            kid,
        )
    try:
        msg = Sign1Message.from_cose_obj([phdr_bytes, uhdr, payload, signature], True)
    except Exception as e:  # pycose's header parsing raises several types
        return ManifestRejected(CoseRejectReason.MALFORMED, f"headers: {e}", kid)
    msg.key = cose_key
    try:
        ok = bool(msg.verify_signature())
    except Exception as e:  # e.g. a signature of the wrong length, a key without x
        return ManifestRejected(CoseRejectReason.BAD_SIGNATURE, f"cannot verify: {e}", kid)
    if not ok:
        return ManifestRejected(CoseRejectReason.BAD_SIGNATURE, "signature does not verify", kid)
    return payload
