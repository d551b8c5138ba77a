"""KVCS Track Namespaces and Track Names (profile sections 3.1 and 3.2).

Theory of operation
-------------------
*Namespace* (profile 3.1, KVSP-BINDING section 4). A KVCS Track Namespace has
exactly five fields, all raw octets::

    0  "kvcs-1"           6 octets (ASCII)
    1  Scope ID          16 octets
    2  Compatibility ID  16 octets
    3  Anchor Key        32 octets
    4  Publication ID    16 octets, random per production (entropy is passed in)

Fields 0 to 3 identify content; field 4 one production of it.
:class:`KvcsNamespace` holds fields 1 to 4 and converts to and from the wire
:class:`~kvcs_core.wire.names.TrackNamespace`. Two prefixes matter for
discovery and authorization: the *scope prefix* ``("kvcs-1", Scope ID)`` and
the *content prefix* ``("kvcs-1", Scope ID, Compatibility ID, Anchor Key)``
that a consumer sends in SUBSCRIBE_NAMESPACE (profile 5.1). A namespace of any
other shape "is not a KVCS namespace and is ignored by KVCS consumers"
(binding 4): :meth:`KvcsNamespace.try_parse` returns ``None`` for it and never
raises; :meth:`KvcsNamespace.from_track_namespace` raises
:class:`KvcsNameError` saying what is wrong.

*Track Names* (profile 3.2), ASCII, ABNF::

    track-name = "manifest" / "manifest.cose" / data-track
    data-track = component "." codec-name "." "s" segment
    component  = "k" / "v" / "kv"
    codec-name = 1*32( %x61-7A / DIGIT / "-" )
    segment    = "0" / ( %x31-39 *DIGIT )        ; no leading zeros

:class:`TrackNameSpec` is the parsed form: :meth:`TrackNameSpec.parse` returns
a :class:`ManifestTrackName` or a :class:`DataTrackName` and
:meth:`TrackNameSpec.build` gives the wire bytes back. Parsing is exact (the
mapping is a bijection): no case folding, no leading zeros, no non-ASCII digits.
Whether a codec name is *registered* is the KVSP registry's question, not the
grammar's. Every failure is a :class:`KvcsNameError` (a ``ValueError``) whose
``reason`` says what was wrong.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import attrs

from kvcs_core.wire.names import MAX_FULL_NAME_BYTES, FullTrackName, TrackNamespace

KVCS_NAMESPACE_TAG: Final = b"kvcs-1"
"""Namespace field 0 (binding 4): the ASCII octets ``kvcs-1``."""
SCOPE_ID_LEN: Final = 16
COMPAT_ID_LEN: Final = 16
ANCHOR_KEY_LEN: Final = 32
PUBLICATION_ID_LEN: Final = 16
KVCS_NAMESPACE_FIELDS: Final = 5

MANIFEST_TRACK: Final = "manifest"
"""The unsigned manifest track (profile 3.6): a JSON payload."""
MANIFEST_COSE_TRACK: Final = "manifest.cose"
"""The signed manifest track (profile 3.6): a COSE_Sign1 payload."""
MAX_CODEC_NAME_LEN: Final = 32
"""``codec-name = 1*32( %x61-7A / DIGIT / "-" )`` (profile 3.2)."""

_CODEC_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
_DIGITS: Final = frozenset("0123456789")


class KvcsNameError(ValueError):
    """A KVCS namespace or track name that does not follow profile 3.1/3.2.

    Attributes:
        reason: what was wrong, in words.
        value: the offending input (as given), for diagnostics.
    """

    def __init__(self, reason: str, value: object = None) -> None:
        super().__init__(reason if value is None else f"{reason}: {value!r}")
        self.reason: Final = reason
        self.value: Final = value


# --- namespace (profile 3.1, binding 4) -------------------------------------


def _fixed(length: int, what: str) -> Any:
    def check(_inst: Any, _attr: Any, value: bytes) -> None:
        if not isinstance(value, bytes):
            raise KvcsNameError(f"{what} must be bytes, not {type(value).__name__}")
        if len(value) != length:
            raise KvcsNameError(f"{what} must be {length} octets, not {len(value)}", value)

    return check


@attrs.frozen
class KvcsNamespace:
    """Fields 1 to 4 of a KVCS Track Namespace (field 0 is always ``kvcs-1``)."""

    scope_id: bytes = attrs.field(validator=_fixed(SCOPE_ID_LEN, "Scope ID"))
    compat_id: bytes = attrs.field(validator=_fixed(COMPAT_ID_LEN, "Compatibility ID"))
    anchor_key: bytes = attrs.field(validator=_fixed(ANCHOR_KEY_LEN, "Anchor Key"))
    publication_id: bytes = attrs.field(validator=_fixed(PUBLICATION_ID_LEN, "Publication ID"))

    @classmethod
    def from_track_namespace(cls, ns: TrackNamespace) -> KvcsNamespace:
        """Parse a wire namespace; raise :class:`KvcsNameError` if it is not KVCS."""
        f = ns.fields
        if len(f) != KVCS_NAMESPACE_FIELDS:
            raise KvcsNameError(
                f"a KVCS namespace has {KVCS_NAMESPACE_FIELDS} fields, not {len(f)}"
            )
        if f[0] != KVCS_NAMESPACE_TAG:
            raise KvcsNameError("namespace field 0 is not 'kvcs-1'", f[0])
        return cls(f[1], f[2], f[3], f[4])

    @classmethod
    def try_parse(cls, ns: TrackNamespace) -> KvcsNamespace | None:
        """Like :meth:`from_track_namespace` but ``None`` for a non-KVCS namespace.

        For peer input: binding section 4 says such a namespace is ignored.
        """
        try:
            return cls.from_track_namespace(ns)
        except KvcsNameError:
            return None

    def to_track_namespace(self) -> TrackNamespace:
        """The five-field wire namespace."""
        return TrackNamespace(
            (
                KVCS_NAMESPACE_TAG,
                self.scope_id,
                self.compat_id,
                self.anchor_key,
                self.publication_id,
            )
        )

    def scope_prefix(self) -> TrackNamespace:
        """``("kvcs-1", Scope ID)``: all publications of the scope (profile 3.1)."""
        return scope_prefix(self.scope_id)

    def content_prefix(self) -> TrackNamespace:
        """``("kvcs-1", Scope ID, Compatibility ID, Anchor Key)`` (profile 3.1, 5.1)."""
        return content_prefix(self.scope_id, self.compat_id, self.anchor_key)

    def full_track_name(self, track: TrackNameSpec | str | bytes) -> FullTrackName:
        """This namespace plus a track name (a spec, or text/bytes that must parse)."""
        spec = track if isinstance(track, TrackNameSpec) else TrackNameSpec.parse(track)
        return FullTrackName(self.to_track_namespace(), spec.build())


def scope_prefix(scope_id: bytes) -> TrackNamespace:
    """The namespace prefix ``("kvcs-1", Scope ID)``: the unit of authorization."""
    _fixed(SCOPE_ID_LEN, "Scope ID")(None, None, scope_id)
    return TrackNamespace((KVCS_NAMESPACE_TAG, scope_id))


def content_prefix(scope_id: bytes, compat_id: bytes, anchor_key: bytes) -> TrackNamespace:
    """The namespace prefix of one token prefix: fields 0 to 3 (profile 5.1).

    A consumer subscribes to it (SUBSCRIBE_NAMESPACE) to discover the
    publications of that prefix; for a shorter prefix it passes an earlier Block
    Key as ``anchor_key``.
    """
    _fixed(SCOPE_ID_LEN, "Scope ID")(None, None, scope_id)
    _fixed(COMPAT_ID_LEN, "Compatibility ID")(None, None, compat_id)
    _fixed(ANCHOR_KEY_LEN, "Anchor Key")(None, None, anchor_key)
    return TrackNamespace((KVCS_NAMESPACE_TAG, scope_id, compat_id, anchor_key))


def is_kvcs_namespace(ns: TrackNamespace) -> bool:
    """True when ``ns`` has the shape of binding section 4 (five fields, right sizes)."""
    return KvcsNamespace.try_parse(ns) is not None


# --- track names (profile 3.2) ------------------------------------------------


class Component(enum.IntEnum):
    """The tensor component of a data track; also the payload's Component field."""

    K = 1
    V = 2
    KV = 3

    @property
    def token(self) -> str:
        """The track-name spelling: ``k``, ``v`` or ``kv``."""
        return _COMPONENT_TOKEN[self]

    @classmethod
    def from_token(cls, token: str) -> Component:
        """``"k"`` -> K, ...; raise :class:`KvcsNameError` for anything else."""
        try:
            return _TOKEN_COMPONENT[token]
        except KeyError:
            raise KvcsNameError("component must be 'k', 'v' or 'kv'", token) from None


_COMPONENT_TOKEN: Final = {Component.K: "k", Component.V: "v", Component.KV: "kv"}
_TOKEN_COMPONENT: Final = {v: k for k, v in _COMPONENT_TOKEN.items()}


def check_codec_name(codec: str) -> str:
    """Return ``codec`` if it matches ``1*32( %x61-7A / DIGIT / "-" )``, else raise."""
    if not isinstance(codec, str):
        raise KvcsNameError(f"codec name must be str, not {type(codec).__name__}")
    if not codec:
        raise KvcsNameError("codec name is empty")
    if len(codec) > MAX_CODEC_NAME_LEN:
        raise KvcsNameError(
            f"codec name is {len(codec)} characters (max {MAX_CODEC_NAME_LEN})", codec
        )
    bad = next((c for c in codec if c not in _CODEC_CHARS), None)
    if bad is not None:
        raise KvcsNameError(f"codec name has {bad!r}; only a-z, 0-9 and '-' are allowed", codec)
    return codec


def _parse_segment(text: str) -> int:
    if not text:
        raise KvcsNameError("segment number is missing after 's'")
    if not set(text) <= _DIGITS:
        raise KvcsNameError("segment must be ASCII decimal digits", text)
    if len(text) > 1 and text[0] == "0":
        raise KvcsNameError("segment has a leading zero", text)
    return int(text)


class TrackNameSpec:
    """A parsed KVCS Track Name: :class:`ManifestTrackName` or :class:`DataTrackName`."""

    __slots__ = ()

    @staticmethod
    def parse(name: bytes | str) -> ManifestTrackName | DataTrackName:
        """Parse wire bytes or text against the profile 3.2 grammar (exactly).

        Raises :class:`KvcsNameError` with the reason for anything else.
        """
        if isinstance(name, bytes | bytearray | memoryview):
            raw = bytes(name)
            if len(raw) > MAX_FULL_NAME_BYTES:
                raise KvcsNameError(f"track name is longer than {MAX_FULL_NAME_BYTES} octets")
            if not raw.isascii():
                raise KvcsNameError("track name is not ASCII", raw)
            text = raw.decode("ascii")
        elif isinstance(name, str):
            if len(name) > MAX_FULL_NAME_BYTES:
                raise KvcsNameError(f"track name is longer than {MAX_FULL_NAME_BYTES} octets")
            if not name.isascii():
                raise KvcsNameError("track name is not ASCII", name)
            text = name
        else:
            raise KvcsNameError(f"track name must be bytes or str, not {type(name).__name__}")
        if text == MANIFEST_TRACK:
            return ManifestTrackName(signed=False)
        if text == MANIFEST_COSE_TRACK:
            return ManifestTrackName(signed=True)
        if not text:
            raise KvcsNameError("track name is empty")
        parts = text.split(".")
        if len(parts) != 3:
            raise KvcsNameError(
                "a data track name is component '.' codec '.' 's' segment "
                f"(3 dot-separated parts, found {len(parts)})",
                text,
            )
        comp, codec, seg = parts
        component = Component.from_token(comp)
        check_codec_name(codec)
        if not seg.startswith("s"):
            raise KvcsNameError("segment part must start with 's'", seg)
        return DataTrackName(component, codec, _parse_segment(seg[1:]))

    def build(self) -> bytes:
        """The Track Name octets (ASCII)."""
        return str(self).encode("ascii")

    @property
    def is_manifest(self) -> bool:
        """True for ``manifest`` and ``manifest.cose``."""
        return isinstance(self, ManifestTrackName)


@attrs.frozen
class ManifestTrackName(TrackNameSpec):
    """``manifest`` (JSON) or, with ``signed``, ``manifest.cose`` (profile 3.6)."""

    signed: bool = False

    def __str__(self) -> str:
        return MANIFEST_COSE_TRACK if self.signed else MANIFEST_TRACK


def _to_component(value: Component | int) -> Component:
    try:
        return Component(value)
    except ValueError:
        raise KvcsNameError("component must be 1 (k), 2 (v) or 3 (kv)", value) from None


def _check_segment(_inst: Any, _attr: Any, value: int) -> None:
    if type(value) is not int or value < 0:
        raise KvcsNameError("segment must be a non-negative int", value)


def _check_codec(_inst: Any, _attr: Any, value: str) -> None:
    check_codec_name(value)


@attrs.frozen
class DataTrackName(TrackNameSpec):
    """``<component>.<codec>.s<segment>``, e.g. ``k.raw.s0`` (profile 3.2)."""

    component: Component = attrs.field(converter=_to_component)
    codec: str = attrs.field(validator=_check_codec)
    segment: int = attrs.field(validator=_check_segment)

    def __str__(self) -> str:
        return f"{self.component.token}.{self.codec}.s{self.segment}"


def parse_track_name(name: bytes | str) -> ManifestTrackName | DataTrackName:
    """Alias of :meth:`TrackNameSpec.parse`."""
    return TrackNameSpec.parse(name)


def data_track_name(component: Component, codec: str, segment: int) -> str:
    """Build the text of a data track name, validating every part."""
    return str(DataTrackName(component, codec, segment))
