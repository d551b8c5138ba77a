"""The CAT-4-MOQT ``moqt`` claim: which actions a token allows on which names.

Theory of operation
-------------------
draft-ietf-moq-c4m-02 section 2.1 defines the claim as a list of *scopes*; each
scope is ``[actions, ? namespace-matches, ? track-match]``:

* ``actions``: MOQT action numbers (:class:`MoqtAction`); anything not listed is
  blocked.
* ``namespace-matches``: one match per Track Namespace field, applied in order;
  a match is a byte string (exact), or ``[1, bstr]`` (prefix of the field) or
  ``[2, bstr]`` (suffix of the field). A final ``nil`` pins the namespace
  length; without it, longer namespaces whose first fields match are included.
  ``nil`` anywhere but last is malformed. Absent: every namespace.
* ``track-match``: one match against the Track Name. Absent: every track.

Matching is bytewise, no normalisation. A scope list permits a request when any
one scope does (the order does not matter).

Where the draft is silent, kvcs decides (README "Authorization"):

* actions on a namespace alone (PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE) are
  permitted only by a scope without a track match: a grant limited to some
  tracks implies nothing about the whole namespace (wire reference 10,
  "a grant for one track implies nothing else");
* SUBSCRIBE_NAMESPACE (and SUBSCRIBE_TRACKS) ask about a *prefix*: they are
  permitted when some scope could match a namespace that starts with the prefix
  (:meth:`MoqtClaim.may_discover`); what is then announced on them is filtered
  namespace by namespace (:meth:`MoqtClaim.permits`).

Parsing (:func:`parse_moqt_claim`) raises :class:`ClaimError` on anything that
does not follow the CDDL; this module is pure (no I/O, no clock).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs

MAX_SCOPES: Final = 256
"""More scopes than this in one claim: malformed (bounds validation work)."""
MAX_MATCHES: Final = 32
"""More namespace matches than this in one scope: malformed (the wire allows 32 fields)."""


class ClaimError(ValueError):
    """A ``moqt`` claim that does not follow the draft's CDDL."""


class MoqtAction(enum.IntEnum):
    """Action numbers of the ``moqt`` claim (draft-ietf-moq-c4m-02 section 2.1)."""

    CLIENT_SETUP = 0
    SERVER_SETUP = 1
    PUBLISH_NAMESPACE = 2
    SUBSCRIBE_NAMESPACE = 3
    SUBSCRIBE = 4
    REQUEST_UPDATE = 5
    PUBLISH = 6
    FETCH = 7
    TRACK_STATUS = 8


NAMESPACE_ACTIONS: Final = frozenset({MoqtAction.PUBLISH_NAMESPACE, MoqtAction.SUBSCRIBE_NAMESPACE})
"""Actions on a namespace (no track name): only scopes without a track match permit them."""


class MatchType(enum.IntEnum):
    """How a match object compares (``bstr`` alone is EXACT)."""

    EXACT = 0
    PREFIX = 1
    SUFFIX = 2


@attrs.frozen
class Match:
    """One match object: compare a field (or the Track Name) with ``value``."""

    kind: MatchType
    value: bytes

    def matches(self, field: bytes) -> bool:
        if self.kind is MatchType.EXACT:
            return field == self.value
        if self.kind is MatchType.PREFIX:
            return field.startswith(self.value)
        return field.endswith(self.value)

    def to_cbor(self) -> bytes | list[Any]:
        return self.value if self.kind is MatchType.EXACT else [int(self.kind), self.value]


@attrs.frozen
class MoqtScope:
    """One scope of the claim: actions x namespace matches x track match."""

    actions: frozenset[MoqtAction]
    namespace: tuple[Match, ...] | None = None
    """Per-field matches; ``None``: any namespace."""
    exact_length: bool = False
    """The namespace match list ended with ``nil``: no longer namespaces."""
    track: Match | None = None
    """``None``: any Track Name."""
    unknown_actions: frozenset[int] = frozenset()
    """Action numbers this version does not know: they grant nothing, and are kept so
    that the claim re-encodes as received."""

    def _namespace_ok(self, fields: Sequence[bytes]) -> bool:
        ns = self.namespace
        if ns is None:
            return True
        if len(fields) < len(ns) or (self.exact_length and len(fields) != len(ns)):
            return False
        return all(m.matches(f) for m, f in zip(ns, fields, strict=False))

    def permits(self, action: MoqtAction, fields: Sequence[bytes], track: bytes | None) -> bool:
        """``action`` on namespace ``fields`` (and Track Name ``track``, ``None`` for an
        action on the namespace alone)."""
        if action not in self.actions:
            return False
        if track is None:
            if self.track is not None:
                return False
        elif self.track is not None and not self.track.matches(track):
            return False
        return self._namespace_ok(fields)

    def may_discover(self, action: MoqtAction, prefix: Sequence[bytes]) -> bool:
        """Some namespace starting with ``prefix`` could be permitted for ``action``."""
        if action not in self.actions:
            return False
        ns = self.namespace
        if ns is None:
            return True
        if self.exact_length and len(prefix) > len(ns):
            return False
        return all(m.matches(f) for m, f in zip(ns, prefix, strict=False))

    def to_cbor(self) -> list[Any]:
        out: list[Any] = [sorted({int(a) for a in self.actions} | self.unknown_actions)]
        if self.namespace is not None or self.track is not None:
            ns: list[Any] = [m.to_cbor() for m in self.namespace or ()]
            if self.exact_length:
                ns.append(None)
            out.append(ns)
        if self.track is not None:
            out.append(self.track.to_cbor())
        return out


@attrs.frozen
class MoqtClaim:
    """The whole ``moqt`` claim: a list of scopes; one permitting is enough."""

    scopes: tuple[MoqtScope, ...]

    def permits(
        self, action: MoqtAction, fields: Sequence[bytes], track: bytes | None = None
    ) -> bool:
        return any(s.permits(action, fields, track) for s in self.scopes)

    def may_discover(self, action: MoqtAction, prefix: Sequence[bytes]) -> bool:
        return any(s.may_discover(action, prefix) for s in self.scopes)

    def allows_action(self, action: MoqtAction) -> bool:
        """``action`` appears in some scope (CLIENT_SETUP has no name to match)."""
        return any(action in s.actions for s in self.scopes)

    def to_cbor(self) -> list[Any]:
        return [s.to_cbor() for s in self.scopes]


def _match(raw: Any, what: str) -> Match:
    if isinstance(raw, bytes):
        return Match(MatchType.EXACT, raw)
    if isinstance(raw, list | tuple) and len(raw) == 2:
        kind, value = raw
        if type(kind) is int and kind in (1, 2) and isinstance(value, bytes):
            return Match(MatchType(kind), value)
    raise ClaimError(f"{what}: not a bstr or [1|2, bstr] match")


def _actions(raw: Any) -> tuple[frozenset[MoqtAction], frozenset[int]]:
    if not isinstance(raw, list | tuple) or not raw:
        raise ClaimError("scope actions: a non-empty array of integers")
    known: set[MoqtAction] = set()
    unknown: set[int] = set()
    for a in raw:
        if type(a) is not int:
            raise ClaimError(f"scope action {a!r} is not an integer")
        if a in MoqtAction._value2member_map_:
            known.add(MoqtAction(a))
        else:
            unknown.add(a)  # an action number we do not know grants nothing we enforce
    return frozenset(known), frozenset(unknown)


def parse_scope(raw: Any) -> MoqtScope:
    """One ``moqt-scope`` array; :class:`ClaimError` if malformed."""
    if not isinstance(raw, list | tuple) or not 1 <= len(raw) <= 3:
        raise ClaimError("a moqt scope is an array of 1 to 3 elements")
    actions, unknown = _actions(raw[0])
    namespace: tuple[Match, ...] | None = None
    exact = False
    if len(raw) >= 2:
        ns_raw = raw[1]
        if not isinstance(ns_raw, list | tuple):
            raise ClaimError("namespace matches: an array")
        if len(ns_raw) > MAX_MATCHES + 1:
            raise ClaimError(f"more than {MAX_MATCHES} namespace matches")
        items = list(ns_raw)
        if items and items[-1] is None:
            exact = True
            items.pop()
        namespace = tuple(_match(m, "namespace match") for m in items)  # nil inside: error
    track = _match(raw[2], "track match") if len(raw) == 3 else None
    return MoqtScope(actions, namespace, exact, track, unknown)


def parse_moqt_claim(raw: Any) -> MoqtClaim:
    """The ``moqt`` claim value (``[+ moqt-scope]``); :class:`ClaimError` if malformed."""
    if not isinstance(raw, list | tuple) or not raw:
        raise ClaimError("the moqt claim is a non-empty array of scopes")
    if len(raw) > MAX_SCOPES:
        raise ClaimError(f"more than {MAX_SCOPES} scopes")
    return MoqtClaim(tuple(parse_scope(s) for s in raw))


def prefix_scope(
    actions: Iterable[MoqtAction], namespace: Sequence[bytes] | None, track: Match | None = None
) -> MoqtScope:
    """A scope granting ``actions`` on every namespace starting with ``namespace``
    (each field matched exactly; ``None``: every namespace)."""
    ns = None if namespace is None else tuple(Match(MatchType.EXACT, f) for f in namespace)
    return MoqtScope(frozenset(actions), ns, False, track)


__all__ = [
    "NAMESPACE_ACTIONS",
    "ClaimError",
    "Match",
    "MatchType",
    "MoqtAction",
    "MoqtClaim",
    "MoqtScope",
    "parse_moqt_claim",
    "parse_scope",
    "prefix_scope",
]
