"""Key, salt, nonce and AAD of MOQT Secure Objects, and KVSP's ``track_base_key``.

Theory of operation
-------------------
Implements the derivations of draft-ietf-moq-secure-objects ("Serialized Full
Track Name", "Key and Salt Derivation", "Nonce Formation", "Metadata
Authentication") and KVSP binding section 8:

* ``track_base_key(scope_key, kid, suite)`` =
  ``HMAC-SHA256(scope_key, "KVSP-objkey-v0" || u64be(kid))``, its first 16
  octets for the SHA-256 suites, all 32 for 0x0005;
* ``serialized_full_track_name`` = the namespace tuple count and each field
  with its length, then the Track Name with its length (MOQT varints: the
  draft-22 ``vi64``, as everywhere on kvcs's wire);
* ``moq_secret = HKDF-Extract("", track_base_key)``, then ``moq_key`` (``Nk``
  octets) and ``moq_salt`` (``Nn`` octets) by HKDF-Expand with the labels
  ``"MOQ 1.0 Secure Objects Secret key "`` and ``"MOQ 1.0 Secret salt "``, each
  followed by the serialized full track name, ``u16be(suite)`` and
  ``u64be(kid)``; the hash is the suite's;
* ``CTR = u64be(Group ID) || u32be(Object ID)``, ``nonce = moq_salt XOR CTR``;
* ``AAD = u64be(Group ID) || u32be(Object ID) || u8(Publisher Priority) ||
  serialized immutable properties``, where the immutable properties start
  with the Secure Object Key ID property.

*Serialized immutable properties in the AAD.* The draft's test vectors encode
each property there as a 2-octet big-endian type, a varint length and the
value (the Key ID property of kid 7 is ``00 02 01 07``: type 2, length 1, the
varint 7). kvcs builds the AAD that way (:func:`aad_property`), so its AAD is
the one the draft's vectors give for the same fields, whatever encoding the
properties have on the wire (there: draft-22 Key-Value-Pairs inside
IMMUTABLE_PROPERTIES, see ``objects.py``).

All functions are pure; keys are passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable
from typing import Final

from kvcs_core.secobj.suites import CipherSuite, suite_params
from kvcs_core.wire.names import FullTrackName, encode_namespace, encode_track_name
from kvcs_core.wire.varint import encode_vi64

__all__ = [
    "KEY_ID_PROPERTY",
    "KVSP_OBJKEY_LABEL",
    "MAX_OBJECT_ID",
    "aad_property",
    "build_aad",
    "derive_key_salt",
    "hkdf_expand",
    "hkdf_extract",
    "make_ctr",
    "make_nonce",
    "serialize_full_track_name",
    "serialize_names",
    "track_base_key",
]

KEY_ID_PROPERTY: Final = 0x2
"""The Secure Object Key ID property type (draft section "Key ID Property")."""
KVSP_OBJKEY_LABEL: Final = b"KVSP-objkey-v0"
KEY_LABEL: Final = b"MOQ 1.0 Secure Objects Secret key "
SALT_LABEL: Final = b"MOQ 1.0 Secret salt "
MAX_OBJECT_ID: Final = 2**32 - 1
"""The largest Object ID the nonce can hold (draft "Nonce Formation")."""
MAX_KEY_ID: Final = 2**64 - 1
_U64: Final = struct.Struct(">Q")
_CTR: Final = struct.Struct(">QI")
_AAD_HEAD: Final = struct.Struct(">QIB")


def _check_key_id(key_id: int) -> int:
    if not isinstance(key_id, int) or isinstance(key_id, bool) or not 0 <= key_id <= MAX_KEY_ID:
        raise ValueError(f"a Key ID is an integer 0..2**64-1, not {key_id!r}")
    return key_id


def track_base_key(scope_key: bytes, key_id: int, suite: CipherSuite | int) -> bytes:
    """KVSP binding 8: the ``track_base_key`` of Key ID ``key_id`` for ``suite``.

    Raises:
        ValueError: a scope key that is not 32 octets, a bad Key ID or suite.
    """
    if not isinstance(scope_key, bytes | bytearray) or len(scope_key) != 32:
        raise ValueError("the scope key must be 32 octets")
    params = suite_params(suite)
    mac = hmac.new(
        bytes(scope_key), KVSP_OBJKEY_LABEL + _U64.pack(_check_key_id(key_id)), hashlib.sha256
    )
    return mac.digest()[: params.base_key_len]


def serialize_names(namespace: Iterable[bytes], track_name: bytes) -> bytes:
    """Serialized Full Track Name from raw namespace fields and a Track Name (no checks)."""
    fields = list(namespace)
    out = bytearray(encode_vi64(len(fields)))
    for f in fields:
        out += encode_vi64(len(f))
        out += f
    out += encode_vi64(len(track_name))
    out += track_name
    return bytes(out)


def serialize_full_track_name(name: FullTrackName) -> bytes:
    """The draft's Serialized Full Track Name of a validated :class:`FullTrackName`."""
    out = bytearray()
    encode_namespace(name.namespace, out)
    encode_track_name(name.name, out)
    return bytes(out)


def hkdf_extract(hash_name: str, salt: bytes, ikm: bytes) -> bytes:
    """RFC 5869 HKDF-Extract (an empty salt is the hash length of zeros, as HMAC pads it)."""
    return hmac.new(salt, ikm, hash_name).digest()


def hkdf_expand(hash_name: str, prk: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 HKDF-Expand."""
    out = b""
    block = b""
    counter = 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hash_name).digest()
        out += block
        counter += 1
    return out[:length]


def derive_key_salt(
    suite: CipherSuite | int, key_id: int, base_key: bytes, serialized_ftn: bytes
) -> tuple[bytes, bytes]:
    """``(moq_key, moq_salt)`` of the draft's "Key and Salt Derivation"."""
    params = suite_params(suite)
    tail = struct.pack(">H", params.suite) + _U64.pack(_check_key_id(key_id))
    secret = hkdf_extract(params.hash_name, b"", bytes(base_key))
    key = hkdf_expand(params.hash_name, secret, KEY_LABEL + serialized_ftn + tail, params.nk)
    salt = hkdf_expand(params.hash_name, secret, SALT_LABEL + serialized_ftn + tail, params.nn)
    return key, salt


def make_ctr(group_id: int, object_id: int) -> bytes:
    """``u64be(Group ID) || u32be(Object ID)``.

    Raises:
        ValueError: an Object ID over 2**32-1 (or a Group ID over 2**64-1): such an
            Object cannot be protected and must not be processed (draft "Nonce Formation").
    """
    if not 0 <= object_id <= MAX_OBJECT_ID:
        raise ValueError(f"Object ID {object_id} does not fit the 32-bit CTR")
    if not 0 <= group_id <= MAX_KEY_ID:
        raise ValueError(f"Group ID {group_id} does not fit the 64-bit CTR")
    return _CTR.pack(group_id, object_id)


def make_nonce(salt: bytes, group_id: int, object_id: int) -> bytes:
    """``moq_salt XOR CTR`` (both 12 octets)."""
    ctr = make_ctr(group_id, object_id)
    return (int.from_bytes(salt, "big") ^ int.from_bytes(ctr, "big")).to_bytes(len(salt), "big")


def aad_property(type_: int, value: bytes) -> bytes:
    """One property as the AAD serializes it: ``u16be(type) || varint(len) || value``."""
    if not 0 <= type_ <= 0xFFFF:
        raise ValueError(f"property type {type_:#x} does not fit the AAD's 16 bits")
    return struct.pack(">H", type_) + encode_vi64(len(value)) + value


def build_aad(
    group_id: int, object_id: int, publisher_priority: int, key_id: int, other_immutable: bytes
) -> bytes:
    """SECURE_OBJECT_AAD: the Key ID property first, then the other immutable properties.

    ``other_immutable`` is already serialized (:func:`aad_property` per property).
    """
    if not 0 <= publisher_priority <= 255:
        raise ValueError(f"publisher priority {publisher_priority} is not 0..255")
    make_ctr(group_id, object_id)  # the same range checks as the nonce
    return (
        _AAD_HEAD.pack(group_id, object_id, publisher_priority)
        + aad_property(KEY_ID_PROPERTY, encode_vi64(_check_key_id(key_id)))
        + other_immutable
    )
