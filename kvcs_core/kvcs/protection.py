"""Protected publications: how KVCS uses MOQT Secure Objects (KVSP binding 8).

Theory of operation
-------------------
*Publisher* (:class:`ObjectProtection`, :class:`PublicationSealer`). A
protected publication encrypts every Normal Object of every track (data
tracks and the manifest track, JSON or COSE) with one cipher suite and one
Key ID. The keys come from the scope key (``track_base_key`` of binding 8),
so a relay, which knows only the Scope ID, can neither read nor forge them.
The plaintext is the whole Object payload (the 68-octet KVCS header and the
Data, or the manifest payload), taken as separate chunks, never joined by the
caller. Each protected Object carries the Key ID in its IMMUTABLE_PROPERTIES
(``kvcs_core.secobj.objects``). End of Group and End of Track are status
Objects without payload and are left as they are. The nonce is the Object's
(Group ID, Object ID) XOR a salt derived per track and Key ID, and every
production has its own Publication ID (namespace field 4), so no nonce
repeats under one key.

*Consumer* (:func:`open_payload`). For each received Normal Object: an Object
with a Key ID is decrypted with the key derived from the scope key and that
Key ID (:class:`~kvcs_core.secobj.SecureObjectKeyring`); an Object without
one is used as it is, unless encryption is required. The result is either
the plaintext payload (a view), verified afterwards exactly as before, or a
:class:`Unopened` with a :class:`ProtectionFailure` that the consumer turns
into an ``ObjectDiscarded`` (data) or a refused manifest version: recovery
then proceeds as for a corrupted Object (profile 5.4).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from kvcs_core.secobj import (
    DEFAULT_SUITE,
    AeadLimits,
    CipherSuite,
    KeyIdError,
    SecureObjectKeyring,
    UnprotectFailed,
    UnprotectReason,
    key_id_properties,
    read_key_id,
    serialize_full_track_name,
)
from kvcs_core.secobj.aead import Chunk
from kvcs_core.wire.kvp import KeyValuePairs
from kvcs_core.wire.names import FullTrackName

__all__ = [
    "ObjectProtection",
    "ProtectionFailure",
    "PublicationSealer",
    "Unopened",
    "open_payload",
]


def _key_id(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        raise ValueError(f"key_id must be an integer 0..2**64-1, not {value!r}")
    return value


@attrs.frozen
class ObjectProtection:
    """How a publication is protected: the cipher suite and the Key ID (binding 8)."""

    suite: CipherSuite = attrs.field(default=DEFAULT_SUITE, converter=CipherSuite)
    key_id: int = attrs.field(default=0, converter=_key_id)
    limits: AeadLimits | None = None
    """AEAD limits per key (default: the suite's)."""


class PublicationSealer:
    """Encrypts the Objects of one publication (the publisher's half)."""

    def __init__(self, scope_key: bytes, protection: ObjectProtection) -> None:
        self.protection = protection
        self.keyring = SecureObjectKeyring.from_scope_key(
            scope_key, protection.suite, key_ids=[protection.key_id], limits=protection.limits
        )
        self.properties: KeyValuePairs = key_id_properties(protection.key_id)
        self._names: dict[FullTrackName, bytes] = {}

    def _ftn(self, name: FullTrackName) -> bytes:
        ftn = self._names.get(name)
        if ftn is None:
            ftn = self._names[name] = serialize_full_track_name(name)
        return ftn

    def seal(
        self,
        name: FullTrackName,
        group_id: int,
        object_id: int,
        priority: int,
        parts: Sequence[Chunk],
    ) -> bytes:
        """The protected payload of one Object (raises ``LimitReached`` past the limit)."""
        return self.keyring.protect(
            self._ftn(name), group_id, object_id, priority, self.protection.key_id, parts
        )

    def seal_group(
        self,
        name: FullTrackName,
        group_id: int,
        priority: int,
        heads: Sequence[bytes],
        datas: Sequence[Chunk],
    ) -> list[bytes]:
        """Objects ``0..n-1`` of one Group, each ``head || data`` encrypted."""
        ftn = self._ftn(name)
        protect, kid = self.keyring.protect, self.protection.key_id
        return [
            protect(ftn, group_id, oid, priority, kid, (head, data))
            for oid, (head, data) in enumerate(zip(heads, datas, strict=True))
        ]


class ProtectionFailure(enum.IntEnum):
    """Why a received Object could not be opened."""

    DECRYPTION_FAILED = 1
    """Authentication failed, the plaintext did not parse, or the key reached a limit."""
    UNKNOWN_KEY_ID = 2
    """No key for its Key ID, or a malformed IMMUTABLE_PROPERTIES / Key ID."""
    NOT_PROTECTED = 3
    """No Key ID while encryption is required."""


@attrs.frozen
class Unopened:
    """A received Object that must be discarded, and why."""

    failure: ProtectionFailure
    detail: str


_FAILURES = {
    UnprotectReason.AUTHENTICATION: ProtectionFailure.DECRYPTION_FAILED,
    UnprotectReason.MALFORMED: ProtectionFailure.DECRYPTION_FAILED,
    UnprotectReason.LIMIT: ProtectionFailure.DECRYPTION_FAILED,
    UnprotectReason.UNPROTECTABLE: ProtectionFailure.DECRYPTION_FAILED,
    UnprotectReason.UNKNOWN_KEY_ID: ProtectionFailure.UNKNOWN_KEY_ID,
}


def open_payload(
    keyring: SecureObjectKeyring,
    ftn: bytes,
    *,
    group_id: int,
    object_id: int,
    priority: int,
    properties: KeyValuePairs,
    payload: memoryview,
    require: bool,
) -> memoryview | Unopened:
    """The plaintext payload of a received Normal Object, or why it must be discarded.

    ``ftn`` is the track's Serialized Full Track Name. Never raises on bad input.
    """
    try:
        found = read_key_id(properties) if properties else None
    except KeyIdError as exc:
        return Unopened(ProtectionFailure.UNKNOWN_KEY_ID, f"bad Secure Object Key ID: {exc}")
    if found is None:
        if require:
            return Unopened(
                ProtectionFailure.NOT_PROTECTED,
                "no Secure Object Key ID: the Object is not protected",
            )
        return payload
    kid, others = found
    result = keyring.unprotect(
        ftn, group_id, object_id, priority, kid, payload, other_immutable=others
    )
    if isinstance(result, UnprotectFailed):
        return Unopened(_FAILURES[result.reason], result.detail)
    # kvcs defines no encrypted property: any present are the publisher's (authenticated)
    # and ignored like an unknown property
    return result.payload
