"""The errors of the KVSP binding.

Theory of operation
-------------------
Every error raised by ``kvcs_core.kvsp`` is a :class:`KvspError`, which is a
``ValueError``: each one means that a value handed in (a Compatibility
Descriptor, a scope key, a token, a codec value, a section) breaks a rule of
``KVSP-BINDING.md`` (v0). The subclasses say which part of the binding:

* :class:`DescriptorError`: the Compatibility Descriptor (binding section 1);
  it names the offending member.
* :class:`UnknownCodecError`: a codec value or name that is not in the registry
  (binding section 6). The profile discards that Object or track and keeps the
  session.
* :class:`SectionError`: a K/V section or codec Data of the wrong size, or a
  section that a codec cannot encode (binding sections 5 and 6).

Other bad arguments (a scope key that is not 32 octets, a token outside u32,
an identifier of the wrong length) raise :class:`KvspError` itself.
"""

from __future__ import annotations

from typing import Final


class KvspError(ValueError):
    """A value breaks a rule of the KVSP binding (``KVSP-BINDING.md`` v0)."""


class DescriptorError(KvspError):
    """A Compatibility Descriptor breaks a rule of binding section 1.

    Attributes:
        member: the top-level member at fault (``"layers"``, ``"extra"``, ...);
            ``""`` when the descriptor as a whole is at fault (not an object,
            too deeply nested, not canonical CBOR).
        pointer: the exact place, as an RFC 6901 JSON Pointer (``"/extra/rope/0"``;
            ``""`` for the whole descriptor).
        reason: what is wrong, in words.
    """

    def __init__(self, pointer: str, reason: str) -> None:
        member = _unescape(pointer[1:].split("/", 1)[0]) if pointer else ""
        where = (
            f"member {member!r}"
            if pointer == f"/{_escape(member)}"
            else (f"member {member!r} at {pointer!r}" if pointer else "descriptor")
        )
        super().__init__(f"Compatibility Descriptor {where}: {reason}")
        self.member: Final = member
        self.pointer: Final = pointer
        self.reason: Final = reason


class UnknownCodecError(KvspError):
    """A codec value or name that the KVSP codec registry does not define."""


class SectionError(KvspError):
    """A K/V section or codec Data of the wrong size, or one a codec cannot encode."""


def _escape(token: str) -> str:
    """RFC 6901 section 3: ``~`` becomes ``~0`` and ``/`` becomes ``~1``."""
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def json_pointer(path: tuple[str | int, ...]) -> str:
    """The RFC 6901 JSON Pointer of ``path`` (member names and array indices)."""
    return "".join("/" + _escape(str(part)) for part in path)
