"""The one error type every decoder raises, and the "need more bytes" signal.

Theory of operation
-------------------
A decoder given malformed bytes raises :class:`CodecError`, which carries the
MOQT session error code the malformation maps to (usually PROTOCOL_VIOLATION,
d21 section 12.2; KEY_VALUE_FORMATTING_ERROR for a known key-value pair or token
whose value does not fit its definition, d21 section 8.3), a message saying what
was wrong and the byte offset where it was found. No other exception type may
leave a decoder on any input: the fuzz harnesses in ``fuzz/`` check exactly that.

A strict prefix of valid input is never an error. One-shot decoders return the
:data:`NEED_MORE` sentinel for it; incremental stream decoders keep the bytes and
return the items completed so far. Internally the primitive readers signal a
short buffer by raising :class:`Incomplete`, which the public entry points turn
into :data:`NEED_MORE`; it never escapes the package.

Encoders given values that cannot be encoded (a negative integer, a namespace
with 33 fields, ...) raise :class:`EncodeError`, a ``ValueError``: that is local
misuse, not peer input.
"""

from __future__ import annotations

import enum
from typing import Final

from kvcs_core.wire.codes import SessionErrorCode


class CodecError(Exception):
    """Malformed MOQT bytes.

    Attributes:
        code: the session error code to close the session with.
        reason: what was wrong, in words.
        offset: byte offset (within the item being decoded) where it was found,
            or -1 when unknown.
    """

    def __init__(
        self,
        reason: str,
        *,
        code: SessionErrorCode = SessionErrorCode.PROTOCOL_VIOLATION,
        offset: int = -1,
    ) -> None:
        where = f" at offset {offset}" if offset >= 0 else ""
        super().__init__(f"{code.name}: {reason}{where}")
        self.code: Final = code
        self.reason: Final = reason
        self.offset: Final = offset


class EncodeError(ValueError):
    """A value handed to an encoder cannot be represented on the wire."""


class Incomplete(Exception):
    """Internal: the buffer ends before the item does. Never escapes ``wire``."""


class NeedMore(enum.Enum):
    """Type of the :data:`NEED_MORE` sentinel."""

    NEED_MORE = enum.auto()

    def __repr__(self) -> str:
        return "NEED_MORE"


NEED_MORE: Final = NeedMore.NEED_MORE
"""Returned by one-shot decoders for a strict prefix of a valid item."""
