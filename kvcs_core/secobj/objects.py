"""Protect and unprotect one MOQT Object; the Key ID property; the keyring and its limits.

Theory of operation
-------------------
Implements draft-ietf-moq-secure-objects "Object Encryption" / "Object
Decryption" for one Object, given its track's Serialized Full Track Name,
Group ID, Object ID, Publisher Priority, Key ID and the other immutable
properties:

* plaintext = ``varint(len(payload)) || payload || [Encrypted Properties List]``
  where the list, when present, is ``u16be(0x000A) || varint(len) || pairs``;
* ciphertext = ``AEAD.Encrypt(moq_key, nonce, AAD, plaintext)`` (``derive.py``
  for the key, salt, nonce and AAD; ``aead.py`` for the AEAD);
* on receipt the plaintext is parsed back; a length that runs past the end, a
  trailing list whose type is not 0x000A, or one whose length is not exactly
  the rest, drops the Object (draft: "If parsing fails ... MUST drop").

*Key ID property on the wire.* The Key ID is a draft-22 Key-Value-Pair of
type 0x2 (even: a varint value) inside the IMMUTABLE_PROPERTIES (0x0B)
container, which relays must forward unchanged and cannot edit
(:func:`key_id_properties`, :func:`read_key_id`). The container's other
pairs, if any, are authenticated too (in the AAD after the Key ID).

*Keyring.* :class:`SecureObjectKeyring` maps Key IDs to ``track_base_key``\\ s
(a mapping, or a function such as KVSP binding 8's derivation from the scope
key) and keeps one derived ``(moq_key, moq_salt)`` and :class:`KeyUsage` per
(track, Key ID): the AEAD limits of the draft are counted per ``moq_key``.
:meth:`SecureObjectKeyring.protect` raises :class:`LimitReached` instead of
encrypting past the confidentiality limit; every failed decryption counts
against the integrity limit, and once it is reached the key opens nothing
more. A keyring holds at most ``max_keys`` derived keys: a new one past that
is refused (a relay cannot make a consumer derive keys without bound).

:meth:`SecureObjectKeyring.unprotect` never raises on bad input: it returns
:class:`Unprotected` or :class:`UnprotectFailed` with an
:class:`UnprotectReason`. Failures take the same path whichever check failed
(one AEAD open), so their timing says little about why.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs

from kvcs_core.secobj.aead import Aead, AuthenticationFailed, Chunk
from kvcs_core.secobj.derive import (
    KEY_ID_PROPERTY,
    aad_property,
    build_aad,
    derive_key_salt,
    make_nonce,
    track_base_key,
)
from kvcs_core.secobj.suites import AeadLimits, CipherSuite, SuiteParams, suite_params
from kvcs_core.wire.codes import PropertyType
from kvcs_core.wire.errors import CodecError, Incomplete
from kvcs_core.wire.kvp import KeyValuePair, KeyValuePairs, kvps_bytes, read_kvps
from kvcs_core.wire.varint import encode_vi64, read_vi64

__all__ = [
    "ENCRYPTED_PROPERTIES_TYPE",
    "KeyIdError",
    "KeyUsage",
    "LimitReached",
    "SecureObjectError",
    "SecureObjectKeyring",
    "UnprotectFailed",
    "UnprotectReason",
    "Unprotected",
    "key_id_properties",
    "read_key_id",
]

ENCRYPTED_PROPERTIES_TYPE: Final = 0x000A
"""Type of the Encrypted Properties List inside the plaintext (16 bits)."""
_IMMUTABLE: Final = int(PropertyType.IMMUTABLE_PROPERTIES)
_U16: Final = struct.Struct(">H")


class SecureObjectError(ValueError):
    """Misuse of the Secure Objects API by the caller (bad Key ID, Object ID, sizes)."""


class LimitReached(SecureObjectError):
    """A key reached an AEAD limit: rotate to a new Key ID (draft "AEAD Invocation Limits")."""


class KeyIdError(ValueError):
    """The IMMUTABLE_PROPERTIES of an Object do not hold one well-formed Key ID."""


class UnprotectReason(enum.IntEnum):
    """Why an Object could not be unprotected."""

    AUTHENTICATION = 1
    """The AEAD tag did not verify: tampered, moved to another Group/Object/track, another
    priority, or another key or suite."""
    UNKNOWN_KEY_ID = 2
    """No key for the Object's Key ID (or the keyring is full)."""
    MALFORMED = 3
    """The plaintext (length prefix, Encrypted Properties List) does not parse."""
    LIMIT = 4
    """The key reached its integrity limit: it opens nothing more."""
    UNPROTECTABLE = 5
    """The Object ID does not fit the 32-bit nonce counter."""


@attrs.frozen
class Unprotected:
    """A decrypted Object: its original payload (a view) and its Encrypted Properties."""

    payload: memoryview = attrs.field(eq=False, repr=lambda v: f"<{len(v)} octets>")
    encrypted_properties: bytes
    """The pairs of the Encrypted Properties List as carried (empty when absent)."""


@attrs.frozen
class UnprotectFailed:
    """Why :meth:`SecureObjectKeyring.unprotect` refused an Object."""

    reason: UnprotectReason
    detail: str


@attrs.define
class KeyUsage:
    """What one derived key has done, against its limits."""

    encryptions: int = 0
    decryptions: int = 0
    failures: int = 0
    blocks: int = 0
    """AES blocks counted against the confidentiality limit (``suites.py``)."""


def key_id_properties(key_id: int) -> KeyValuePairs:
    """The Object Properties that carry ``key_id``: IMMUTABLE_PROPERTIES { Key ID }."""
    inner = kvps_bytes((KeyValuePair(KEY_ID_PROPERTY, key_id),))
    return (KeyValuePair(_IMMUTABLE, inner),)


def read_key_id(properties: KeyValuePairs) -> tuple[int, bytes] | None:
    """The Key ID and the AAD serialization of the other immutable properties.

    Returns ``None`` when the Object carries no Key ID (an unprotected Object).

    Raises:
        KeyIdError: more than one IMMUTABLE_PROPERTIES or Key ID, a container that
            does not parse, or an immutable type that does not fit the AAD.
    """
    containers = [p.value for p in properties if p.type == _IMMUTABLE]
    if not containers:
        return None
    if len(containers) > 1:
        raise KeyIdError("more than one IMMUTABLE_PROPERTIES")
    raw = containers[0]
    assert isinstance(raw, bytes)  # odd type
    try:
        inner = read_kvps(raw, 0, len(raw), what="IMMUTABLE_PROPERTIES")
    except CodecError as exc:
        raise KeyIdError(str(exc)) from None
    key_ids = [p.value for p in inner if p.type == KEY_ID_PROPERTY]
    if not key_ids:
        return None
    if len(key_ids) > 1:
        raise KeyIdError("more than one Secure Object Key ID")
    others = bytearray()
    for p in inner:
        if p.type == KEY_ID_PROPERTY:
            continue
        value = p.value if isinstance(p.value, bytes) else encode_vi64(p.value)
        try:
            others += aad_property(p.type, value)
        except ValueError as exc:
            raise KeyIdError(str(exc)) from None
    kid = key_ids[0]
    assert isinstance(kid, int)  # even type
    return kid, bytes(others)


class _Key:
    __slots__ = ("aead", "salt", "usage")

    def __init__(self, aead: Aead, salt: bytes) -> None:
        self.aead = aead
        self.salt = salt
        self.usage = KeyUsage()


BaseKeys = Mapping[int, bytes] | Callable[[int], bytes | None]


class SecureObjectKeyring:
    """Key ID -> ``track_base_key`` for one cipher suite, with per-key limits.

    Args:
        suite: the cipher suite of every key in the ring.
        base_keys: ``{Key ID: track_base_key}``, or a function returning the
            base key of a Key ID (``None``: unknown).
        limits: the AEAD limits (default: the suite's, ``suites.py``).
        max_keys: at most this many derived (track, Key ID) keys are held.
    """

    def __init__(
        self,
        suite: CipherSuite | int,
        base_keys: BaseKeys,
        *,
        limits: AeadLimits | None = None,
        max_keys: int = 4096,
    ) -> None:
        self.params: Final[SuiteParams] = suite_params(suite)
        self.limits: Final = limits or self.params.limits
        self._base_keys = base_keys
        self._max_keys = max_keys
        self._keys: dict[tuple[bytes, int], _Key] = {}

    @classmethod
    def from_scope_key(
        cls,
        scope_key: bytes,
        suite: CipherSuite | int,
        *,
        key_ids: Sequence[int] | None = None,
        limits: AeadLimits | None = None,
        max_keys: int = 4096,
    ) -> SecureObjectKeyring:
        """KVSP binding 8: every Key ID (or only ``key_ids``) derived from the scope key."""
        params = suite_params(suite)
        track_base_key(scope_key, 0, params.suite)  # checks the scope key now
        allowed = None if key_ids is None else frozenset(key_ids)
        key = bytes(scope_key)

        def derive(kid: int) -> bytes | None:
            if allowed is not None and kid not in allowed:
                return None
            return track_base_key(key, kid, params.suite)

        return cls(params.suite, derive, limits=limits, max_keys=max_keys)

    @property
    def suite(self) -> CipherSuite:
        return self.params.suite

    def usage(self, track: bytes, key_id: int) -> KeyUsage | None:
        """The usage of the key of (serialized full track name, Key ID), if derived."""
        k = self._keys.get((track, key_id))
        return None if k is None else k.usage

    def _key(self, track: bytes, key_id: int) -> _Key | None:
        k = self._keys.get((track, key_id))
        if k is not None:
            return k
        if len(self._keys) >= self._max_keys:
            return None
        src = self._base_keys
        base = src(key_id) if callable(src) else src.get(key_id)
        if base is None:
            return None
        moq_key, salt = derive_key_salt(self.params.suite, key_id, base, track)
        k = self._keys[(track, key_id)] = _Key(Aead(self.params, moq_key), salt)
        return k

    def _blocks(self, octets: int) -> int:
        return (octets + 15) // 16 + 1

    def protect(
        self,
        track: bytes,
        group_id: int,
        object_id: int,
        publisher_priority: int,
        key_id: int,
        payload: Sequence[Chunk],
        *,
        encrypted_properties: bytes = b"",
        other_immutable: bytes = b"",
    ) -> bytes:
        """The protected payload of one Object.

        Args:
            track: the Serialized Full Track Name (``derive.serialize_full_track_name``).
            payload: the original payload as one or more chunks (scatter input:
                e.g. the KVCS header and the Data, never joined by the caller).
            encrypted_properties: pairs for the Encrypted Properties List (empty:
                no list).
            other_immutable: the other immutable properties, serialized for the
                AAD (``derive.aad_property``), empty for kvcs.

        Raises:
            SecureObjectError: an unknown Key ID, an Object ID past 2**32-1, a bad
                priority.
            LimitReached: this key's confidentiality limit would be passed.
        """
        try:
            aad = build_aad(group_id, object_id, publisher_priority, key_id, other_immutable)
        except ValueError as exc:
            raise SecureObjectError(str(exc)) from None
        k = self._key(track, key_id)
        if k is None:
            raise SecureObjectError(f"no key for Key ID {key_id}")
        size = sum(memoryview(p).nbytes for p in payload)
        parts: list[Chunk] = [encode_vi64(size), *payload]
        if encrypted_properties:
            parts.append(
                _U16.pack(ENCRYPTED_PROPERTIES_TYPE)
                + encode_vi64(len(encrypted_properties))
                + encrypted_properties
            )
        total = sum(memoryview(p).nbytes for p in parts)
        blocks = self._blocks(total)
        if k.usage.blocks + blocks > self.limits.confidentiality_blocks:
            raise LimitReached(
                f"Key ID {key_id} reached its confidentiality limit "
                f"({self.limits.confidentiality_blocks} AES blocks): rotate to a new Key ID"
            )
        sealed = k.aead.seal(make_nonce(k.salt, group_id, object_id), aad, parts)
        k.usage.blocks += blocks
        k.usage.encryptions += 1
        return sealed

    def unprotect(
        self,
        track: bytes,
        group_id: int,
        object_id: int,
        publisher_priority: int,
        key_id: int,
        sealed: Chunk,
        *,
        other_immutable: bytes = b"",
    ) -> Unprotected | UnprotectFailed:
        """Decrypt and parse one Object payload; never raises on bad input."""
        try:
            aad = build_aad(group_id, object_id, publisher_priority, key_id, other_immutable)
        except ValueError as exc:
            return UnprotectFailed(UnprotectReason.UNPROTECTABLE, str(exc))
        k = self._key(track, key_id)
        if k is None:
            return UnprotectFailed(UnprotectReason.UNKNOWN_KEY_ID, f"no key for Key ID {key_id}")
        usage = self.limits
        if k.usage.failures >= usage.integrity_failures:
            return UnprotectFailed(
                UnprotectReason.LIMIT,
                f"Key ID {key_id} reached its integrity limit ({usage.integrity_failures} "
                "failed decryptions)",
            )
        if self.params.decryptions_count:
            blocks = self._blocks(len(sealed))
            if k.usage.blocks + blocks > usage.confidentiality_blocks:
                return UnprotectFailed(
                    UnprotectReason.LIMIT, f"Key ID {key_id} reached its confidentiality limit"
                )
            k.usage.blocks += blocks
        try:
            pt = k.aead.open(make_nonce(k.salt, group_id, object_id), aad, sealed)
        except AuthenticationFailed as exc:
            k.usage.failures += 1
            return UnprotectFailed(UnprotectReason.AUTHENTICATION, f"Key ID {key_id}: {exc}")
        k.usage.decryptions += 1
        return _parse_plaintext(pt)


def _parse_plaintext(pt: bytes) -> Unprotected | UnprotectFailed:
    view = memoryview(pt)
    try:
        length, pos = read_vi64(view, 0)
    except Incomplete:
        return UnprotectFailed(UnprotectReason.MALFORMED, "no payload length")
    end = pos + length
    if end > len(view):
        return UnprotectFailed(UnprotectReason.MALFORMED, "the payload length runs past the end")
    if end == len(view):
        return Unprotected(view[pos:end], b"")
    rest = view[end:]
    if len(rest) < 2 or _U16.unpack_from(rest)[0] != ENCRYPTED_PROPERTIES_TYPE:
        return UnprotectFailed(
            UnprotectReason.MALFORMED, "trailing octets are not an Encrypted Properties List"
        )
    try:
        plen, ppos = read_vi64(rest, 2)
    except Incomplete:
        return UnprotectFailed(UnprotectReason.MALFORMED, "truncated Encrypted Properties List")
    if ppos + plen != len(rest):
        return UnprotectFailed(
            UnprotectReason.MALFORMED, "the Encrypted Properties List length is not the rest"
        )
    return Unprotected(view[pos:end], bytes(rest[ppos:]))
