"""Unit tests of the Secure Objects core: every failure path of protect/unprotect."""

from __future__ import annotations

import pytest

from kvcs_core.secobj import (
    AeadLimits,
    CipherSuite,
    KeyIdError,
    LimitReached,
    SecureObjectError,
    SecureObjectKeyring,
    Unprotected,
    UnprotectFailed,
    UnprotectReason,
    key_id_properties,
    read_key_id,
    suite_from_name,
)
from kvcs_core.secobj.derive import build_aad, make_nonce, serialize_names
from kvcs_core.wire.codes import PropertyType
from kvcs_core.wire.kvp import KeyValuePair, kvps_bytes

SCOPE = bytes(range(32))
TRACK = serialize_names([b"kvcs-1", b"scope"], b"k.raw.s0")
OTHER_TRACK = serialize_names([b"kvcs-1", b"scope"], b"v.raw.s0")
SUITES = list(CipherSuite)
PAYLOAD = [b"H" * 68, bytes(range(256)) * 40]


def _ring(suite: CipherSuite, **kw: object) -> SecureObjectKeyring:
    return SecureObjectKeyring.from_scope_key(SCOPE, suite, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("suite", SUITES)
def test_roundtrip_and_no_plaintext(suite: CipherSuite) -> None:
    ring = _ring(suite)
    sealed = ring.protect(TRACK, 3, 5, 96, 0, PAYLOAD)
    assert PAYLOAD[1][:64] not in sealed
    opened = _ring(suite).unprotect(TRACK, 3, 5, 96, 0, sealed)
    assert isinstance(opened, Unprotected)
    assert bytes(opened.payload) == b"".join(PAYLOAD)
    assert opened.encrypted_properties == b""


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize(
    "change",
    [
        "flip",
        "truncate",
        "group",
        "object",
        "priority",
        "track",
        "key_id",
        "suite",
    ],
)
def test_every_change_is_detected(suite: CipherSuite, change: str) -> None:
    sealed = _ring(suite).protect(TRACK, 3, 5, 96, 0, PAYLOAD)
    ring = _ring(suite)
    where = [TRACK, 3, 5, 96, 0]
    data = bytearray(sealed)
    if change == "flip":
        data[100] ^= 1
    elif change == "truncate":
        del data[-1]
    elif change == "group":
        where[1] = 4
    elif change == "object":
        where[2] = 6
    elif change == "priority":
        where[3] = 0
    elif change == "track":
        where[0] = OTHER_TRACK
    elif change == "key_id":
        where[4] = 1
    elif change == "suite":
        other = next(s for s in SUITES if s is not suite)
        ring = _ring(other)
    result = ring.unprotect(*where, bytes(data))  # type: ignore[arg-type]
    assert isinstance(result, UnprotectFailed)
    assert result.reason is UnprotectReason.AUTHENTICATION
    assert ring.usage(where[0], where[4]).failures == 1  # type: ignore[arg-type, union-attr]


def test_unknown_key_id() -> None:
    sealed = _ring(CipherSuite.AES_128_GCM_SHA256_128).protect(TRACK, 0, 0, 0, 9, PAYLOAD)
    only0 = _ring(CipherSuite.AES_128_GCM_SHA256_128, key_ids=[0])
    result = only0.unprotect(TRACK, 0, 0, 0, 9, sealed)
    assert isinstance(result, UnprotectFailed)
    assert result.reason is UnprotectReason.UNKNOWN_KEY_ID
    with pytest.raises(SecureObjectError, match="no key"):
        only0.protect(TRACK, 0, 0, 0, 9, PAYLOAD)


def test_keyring_bound_refuses_new_keys() -> None:
    ring = _ring(CipherSuite.AES_128_GCM_SHA256_128, max_keys=1)
    ring.protect(TRACK, 0, 0, 0, 0, PAYLOAD)
    result = ring.unprotect(TRACK, 0, 0, 0, 1, b"x" * 40)
    assert isinstance(result, UnprotectFailed)
    assert result.reason is UnprotectReason.UNKNOWN_KEY_ID


@pytest.mark.parametrize("suite", SUITES)
def test_confidentiality_limit_refuses_to_encrypt(suite: CipherSuite) -> None:
    # each protect of 1 octet costs 2 blocks (data + tag/counter block)
    ring = _ring(suite, limits=AeadLimits(confidentiality_blocks=5, integrity_failures=10))
    ring.protect(TRACK, 0, 0, 0, 0, [b"a"])
    ring.protect(TRACK, 0, 1, 0, 0, [b"a"])
    with pytest.raises(LimitReached, match="rotate"):
        ring.protect(TRACK, 0, 2, 0, 0, [b"a"])
    usage = ring.usage(TRACK, 0)
    assert usage is not None and usage.encryptions == 2
    # another Key ID (rotation) is a fresh key with its own count
    ring.protect(TRACK, 0, 2, 0, 1, [b"a"])


@pytest.mark.parametrize("suite", SUITES)
def test_integrity_limit_counts_failures(suite: CipherSuite) -> None:
    good = _ring(suite).protect(TRACK, 0, 0, 0, 0, PAYLOAD)
    ring = _ring(suite, limits=AeadLimits(confidentiality_blocks=2**36, integrity_failures=2))
    for _ in range(2):
        bad = ring.unprotect(TRACK, 0, 0, 0, 0, good[:-1] + bytes([good[-1] ^ 1]))
        assert isinstance(bad, UnprotectFailed)
        assert bad.reason is UnprotectReason.AUTHENTICATION
    # the key is spent: even the genuine Object is refused now
    spent = ring.unprotect(TRACK, 0, 0, 0, 0, good)
    assert isinstance(spent, UnprotectFailed) and spent.reason is UnprotectReason.LIMIT


def test_ctr_suite_counts_decryptions() -> None:
    suite = CipherSuite.AES_128_CTR_HMAC_SHA256_80
    good = _ring(suite).protect(TRACK, 0, 0, 0, 0, [b"a"])
    ring = _ring(suite, limits=AeadLimits(confidentiality_blocks=5, integrity_failures=9))
    assert isinstance(ring.unprotect(TRACK, 0, 0, 0, 0, good), Unprotected)
    assert isinstance(ring.unprotect(TRACK, 0, 0, 0, 0, good), Unprotected)
    third = ring.unprotect(TRACK, 0, 0, 0, 0, good)
    assert isinstance(third, UnprotectFailed) and third.reason is UnprotectReason.LIMIT
    # AES-GCM: decryptions do not count against confidentiality
    gcm = _ring(CipherSuite.AES_128_GCM_SHA256_128, limits=AeadLimits(5, 9))
    sealed = _ring(CipherSuite.AES_128_GCM_SHA256_128).protect(TRACK, 0, 0, 0, 0, [b"a"])
    for _ in range(5):
        assert isinstance(gcm.unprotect(TRACK, 0, 0, 0, 0, sealed), Unprotected)


def test_object_id_past_32_bits() -> None:
    ring = _ring(CipherSuite.AES_128_GCM_SHA256_128)
    with pytest.raises(SecureObjectError, match="32-bit"):
        ring.protect(TRACK, 0, 2**32, 0, 0, PAYLOAD)
    result = ring.unprotect(TRACK, 0, 2**32, 0, 0, b"x" * 40)
    assert isinstance(result, UnprotectFailed)
    assert result.reason is UnprotectReason.UNPROTECTABLE


def test_malformed_plaintext_is_dropped() -> None:
    # a publisher (holding the key) that sealed a bad plaintext: the parse must refuse it
    ring = _ring(CipherSuite.AES_128_GCM_SHA256_128)
    key = ring._key(TRACK, 0)  # seal a raw plaintext with the real key
    assert key is not None
    aad = build_aad(0, 0, 0, 0, b"")
    for pt, what in (
        (b"\x05abc", "runs past"),
        (b"\x01a\x00\x0b\x00", "not an Encrypted"),
        (b"\x01a\x00\x0a\x05xy", "not the rest"),
        (b"", "no payload length"),
    ):
        sealed = key.aead.seal(make_nonce(key.salt, 0, 0), aad, [pt])
        result = ring.unprotect(TRACK, 0, 0, 0, 0, sealed)
        assert isinstance(result, UnprotectFailed), what
        assert result.reason is UnprotectReason.MALFORMED and what in result.detail


def test_key_id_property_roundtrip_and_errors() -> None:
    props = key_id_properties(7)
    assert props[0].type == PropertyType.IMMUTABLE_PROPERTIES
    assert read_key_id(props) == (7, b"")
    assert read_key_id(()) is None
    assert read_key_id((KeyValuePair(PropertyType.IMMUTABLE_PROPERTIES, b""),)) is None
    with pytest.raises(KeyIdError, match="more than one IMMUTABLE"):
        read_key_id(props + props)
    two = kvps_bytes((KeyValuePair(2, 1), KeyValuePair(2, 2)))
    with pytest.raises(KeyIdError, match="more than one Secure"):
        read_key_id((KeyValuePair(PropertyType.IMMUTABLE_PROPERTIES, two),))
    with pytest.raises(KeyIdError):
        read_key_id((KeyValuePair(PropertyType.IMMUTABLE_PROPERTIES, b"\x03\x09"),))
    # other immutable pairs are authenticated after the Key ID
    extra = kvps_bytes((KeyValuePair(2, 7), KeyValuePair(5, b"relay-ok")))
    kid, others = read_key_id((KeyValuePair(PropertyType.IMMUTABLE_PROPERTIES, extra),))  # type: ignore[misc]
    assert kid == 7 and others == b"\x00\x05\x08relay-ok"


def test_suite_names() -> None:
    assert suite_from_name("aes128gcm") is CipherSuite.AES_128_GCM_SHA256_128
    assert suite_from_name("aes256gcm") is CipherSuite.AES_256_GCM_SHA512_128
    assert suite_from_name("aes128ctr-hmac") is CipherSuite.AES_128_CTR_HMAC_SHA256_80
    with pytest.raises(ValueError, match="unknown cipher suite"):
        suite_from_name("rot13")
