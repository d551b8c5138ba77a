"""The five Track Namespace Fields of a KVCS publication.

Theory of operation
-------------------
Implements ``KVSP-BINDING.md`` section 4 (v0) and profile section 3.1. A KVCS
namespace has exactly five fields, all raw octets (never hex):

====  ============================  ======
0     ASCII ``kvcs-1``              6
1     Scope ID                      16
2     Compatibility ID              16
3     Anchor Key                    32
4     Publication ID                16
====  ============================  ======

The Publication ID is 16 random octets chosen by the Original Publisher for
each production; the caller passes it in (the core makes no entropy).

Fields are returned as a ``tuple`` of ``bytes``, ready for the MOQT codec; this
package does not import ``kvcs_core.wire`` (``kvsp`` is a leaf).
:func:`parse_namespace` is the consumer side: a namespace of any other shape
is not a KVCS namespace and gives ``None`` (it stays routable by relays, which
never call this). :func:`namespace_prefix` builds the prefixes that profile
sections 3.1 and 5.1 subscribe to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

from kvcs_core.kvsp.descriptor import COMPAT_ID_LEN
from kvcs_core.kvsp.dtypes import Buffer
from kvcs_core.kvsp.errors import KvspError
from kvcs_core.kvsp.keys import BLOCK_KEY_LEN, SCOPE_ID_LEN

NAMESPACE_TAG: Final = b"kvcs-1"
"""Field 0 of every KVCS namespace."""
PUBLICATION_ID_LEN: Final = 16
"""Octets in a Publication ID (field 4)."""
FIELD_LENGTHS: Final = (
    len(NAMESPACE_TAG),
    SCOPE_ID_LEN,
    COMPAT_ID_LEN,
    BLOCK_KEY_LEN,
    PUBLICATION_ID_LEN,
)
"""Octets in each of the five fields."""
_FIELD_NAMES: Final = ("field 0", "Scope ID", "Compatibility ID", "Anchor Key", "Publication ID")


def _field(value: Buffer, index: int) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise KvspError(f"{_FIELD_NAMES[index]} must be bytes, not {type(value).__name__}")
    if len(value) != FIELD_LENGTHS[index]:
        raise KvspError(
            f"{_FIELD_NAMES[index]} must be {FIELD_LENGTHS[index]} octets, not {len(value)}"
        )
    return bytes(value)


def _scope_id(value: Buffer) -> bytes:
    return _field(value, 1)


def _compat_id(value: Buffer) -> bytes:
    return _field(value, 2)


def _anchor_key(value: Buffer) -> bytes:
    return _field(value, 3)


def _publication_id(value: Buffer) -> bytes:
    return _field(value, 4)


@attrs.frozen
class KvcsNamespace:
    """The content of a KVCS namespace (fields 1 to 4, raw octets, lengths checked).

    Raises:
        KvspError: on construction, a field that is not bytes-like or has the
            wrong length.
    """

    scope_id: bytes = attrs.field(converter=_scope_id)
    compat_id: bytes = attrs.field(converter=_compat_id)
    anchor_key: bytes = attrs.field(converter=_anchor_key)
    publication_id: bytes = attrs.field(converter=_publication_id)

    @property
    def fields(self) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        """The five namespace fields."""
        return (
            NAMESPACE_TAG,
            self.scope_id,
            self.compat_id,
            self.anchor_key,
            self.publication_id,
        )

    @property
    def content_prefix(self) -> tuple[bytes, bytes, bytes, bytes]:
        """Fields 0 to 3: the prefix shared by every publication of this token prefix."""
        return (NAMESPACE_TAG, self.scope_id, self.compat_id, self.anchor_key)


def namespace_fields(
    scope_id: Buffer, compat_id: Buffer, anchor_key: Buffer, publication_id: Buffer
) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """The five fields ``("kvcs-1", Scope ID, Compatibility ID, Anchor Key, Publication ID)``.

    Raises:
        KvspError: a field is not bytes-like or has the wrong length.
    """
    return KvcsNamespace(scope_id, compat_id, anchor_key, publication_id).fields


def namespace_prefix(
    scope_id: Buffer, compat_id: Buffer | None = None, anchor_key: Buffer | None = None
) -> tuple[bytes, ...]:
    """A namespace prefix to subscribe to (profile sections 3.1 and 5.1).

    ``("kvcs-1", scope)`` covers a scope; adding the Compatibility ID covers one
    model configuration; adding the Anchor Key covers every publication of one
    token prefix. An Anchor Key needs a Compatibility ID.
    """
    fields = [NAMESPACE_TAG, _field(scope_id, 1)]
    if compat_id is not None:
        fields.append(_field(compat_id, 2))
        if anchor_key is not None:
            fields.append(_field(anchor_key, 3))
    elif anchor_key is not None:
        raise KvspError("an Anchor Key prefix needs the Compatibility ID")
    return tuple(fields)


def parse_namespace(fields: Sequence[Buffer]) -> KvcsNamespace | None:
    """The KVCS content of a namespace, or ``None`` when it is not a KVCS namespace.

    A KVCS namespace has exactly five fields, field 0 is ``kvcs-1`` and fields
    1 to 4 have the lengths of section 4; anything else is ignored by KVCS
    consumers (``None``), never an error.
    """
    if len(fields) != len(FIELD_LENGTHS):
        return None
    raw = [bytes(field) for field in fields]
    if raw[0] != NAMESPACE_TAG:
        return None
    if any(len(f) != n for f, n in zip(raw, FIELD_LENGTHS, strict=True)):
        return None
    return KvcsNamespace(raw[1], raw[2], raw[3], raw[4])
