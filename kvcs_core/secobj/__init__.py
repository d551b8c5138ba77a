"""MOQT Secure Objects (draft-ietf-moq-secure-objects) for kvcs, pure.

Theory of operation
-------------------
End-to-end protection of Object payloads against relays (profile 1.3, KVSP
binding 8): ``suites`` (the cipher suites and AEAD limits), ``derive`` (Full
Track Name serialization, HKDF key and salt, nonce, AAD, KVSP's
``track_base_key``), ``aead`` (AES-GCM and AES-CTR-HMAC), ``objects`` (protect
and unprotect one Object, the Key ID property, the keyring). Keys come from
the caller (the scope key, for kvcs); nothing here draws entropy or reads a
clock: the nonce is the Object's location XOR a derived salt.
"""

from __future__ import annotations

from kvcs_core.secobj.derive import (
    KEY_ID_PROPERTY,
    build_aad,
    derive_key_salt,
    make_nonce,
    serialize_full_track_name,
    track_base_key,
)
from kvcs_core.secobj.objects import (
    KeyIdError,
    KeyUsage,
    LimitReached,
    SecureObjectError,
    SecureObjectKeyring,
    Unprotected,
    UnprotectFailed,
    UnprotectReason,
    key_id_properties,
    read_key_id,
)
from kvcs_core.secobj.suites import (
    DEFAULT_SUITE,
    SUITE_NAMES,
    AeadLimits,
    CipherSuite,
    suite_from_name,
    suite_params,
)

__all__ = [
    "DEFAULT_SUITE",
    "KEY_ID_PROPERTY",
    "SUITE_NAMES",
    "AeadLimits",
    "CipherSuite",
    "KeyIdError",
    "KeyUsage",
    "LimitReached",
    "SecureObjectError",
    "SecureObjectKeyring",
    "UnprotectFailed",
    "UnprotectReason",
    "Unprotected",
    "build_aad",
    "derive_key_salt",
    "key_id_properties",
    "make_nonce",
    "read_key_id",
    "serialize_full_track_name",
    "suite_from_name",
    "suite_params",
    "track_base_key",
]
