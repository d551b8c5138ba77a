"""Namespace routing: who publishes what, and who wants to hear about it.

Theory of operation
-------------------
A relay learns where tracks come from in two ways (d21 section 7, wire
reference 10 "Forwarding and subscriptions" and "Publishing side"):

* a peer sends **PUBLISH_NAMESPACE** for a namespace (a publisher, or a relay
  below us that is also a publisher): the relay answers REQUEST_OK and records
  the peer as a *source* of that namespace until the peer withdraws it (resets
  the request stream) or its session ends;
* the relay itself sends **SUBSCRIBE_NAMESPACE** to its upstream sessions (a
  parent relay) for the prefixes its downstream peers asked about; every
  NAMESPACE the upstream answers makes that upstream a source of that
  namespace until NAMESPACE_DONE (or the end of the stream or session).

**Routes for a track** (wire reference 10: "publishers are found by prefix
matching against accepted PUBLISH_NAMESPACEs"): every source session whose
namespace is a field-wise prefix of the track's namespace, in the order they
were learned. When there is none, the *default routes* are used: the upstream
sessions (``add_session(..., upstream=True)``) that never sent
PUBLISH_NAMESPACE, that is parent relays, which are asked for any track (this
is what makes relay trees work without namespace announcements). The session
that asked is never a route for its own request.

**Namespace subscriptions downstream** (d21 sections 9.15-9.17): a
SUBSCRIBE_NAMESPACE from a peer is answered with REQUEST_OK, then one NAMESPACE
(the suffix after its prefix) for every namespace that has a source other than
that peer, now and whenever one appears, and NAMESPACE_DONE when the last such
source goes away. :meth:`Router.sync` is the single place that computes those
differences. **d22 (B6, Ambiguity A13): the PUBLISH_NAMESPACE itself is never
forwarded downstream**; namespaces reach subscribers only as NAMESPACE.

**Aggregation upstream**: one upstream SUBSCRIBE_NAMESPACE per (upstream
session, prefix) is enough for every downstream prefix it covers. Two prefixes
of one session must not overlap (PREFIX_OVERLAP, d21 4.3.1), so a broader new
prefix replaces the narrower ones: those are cancelled first and the
namespaces they taught are kept, attributed to the broader request, which the
upstream announces again (no NAMESPACE_DONE flaps downstream).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator

import attrs

from kvcs_core.moqt.session import MoqtSession
from kvcs_core.wire.names import TrackNamespace


class SourceKind(enum.IntEnum):
    """How the relay learned that a session can serve a namespace."""

    PUBLISH_NAMESPACE = 1
    """The peer sent PUBLISH_NAMESPACE (we answered REQUEST_OK)."""
    NAMESPACE = 2
    """The peer announced it with NAMESPACE on our SUBSCRIBE_NAMESPACE."""


@attrs.frozen
class Source:
    """One session that can serve a namespace, and the request that says so."""

    session: MoqtSession = attrs.field(eq=False)
    kind: SourceKind
    request_id: int
    key: int = attrs.field(init=False)

    @key.default
    def _key(self) -> int:
        return id(self.session)


@attrs.define(eq=False)
class NamespaceSubscription:
    """A downstream SUBSCRIBE_NAMESPACE the relay accepted."""

    session: MoqtSession
    request_id: int
    prefix: TrackNamespace
    announced: set[TrackNamespace] = attrs.field(factory=set)
    """Full namespaces announced (NAMESPACE sent, no NAMESPACE_DONE since)."""


@attrs.define(eq=False)
class UpstreamNamespaceSubscription:
    """A SUBSCRIBE_NAMESPACE the relay sent to an upstream session."""

    session: MoqtSession
    request_id: int
    prefix: TrackNamespace
    retried: bool = False


class Router:
    """Namespace sources and namespace subscriptions (see the module docstring)."""

    def __init__(self) -> None:
        self._sources: dict[TrackNamespace, dict[Source, None]] = {}
        self._published: dict[int, int] = {}
        """id(session) -> PUBLISH_NAMESPACE sources it holds (publishers are not default routes)."""
        self._subs: dict[tuple[int, int], NamespaceSubscription] = {}
        self._upstream: dict[tuple[int, int], UpstreamNamespaceSubscription] = {}
        self.may_see: Callable[[MoqtSession, int, TrackNamespace], bool] | None = None
        """Authorization filter on what a downstream subscription is told
        (:mod:`kvcs_core.relay.authz`); ``None``: everything."""

    # --- sources ---------------------------------------------------------------------

    def add_source(self, namespace: TrackNamespace, source: Source) -> None:
        self._sources.setdefault(namespace, {})[source] = None
        if source.kind is SourceKind.PUBLISH_NAMESPACE:
            self._published[source.key] = self._published.get(source.key, 0) + 1

    def remove_source(self, namespace: TrackNamespace, source: Source) -> None:
        sources = self._sources.get(namespace)
        if sources is None or source not in sources:
            return
        del sources[source]
        if not sources:
            del self._sources[namespace]
        if source.kind is SourceKind.PUBLISH_NAMESPACE:
            left = self._published.get(source.key, 0) - 1
            if left > 0:
                self._published[source.key] = left
            else:
                self._published.pop(source.key, None)

    def sources_of(self, session: MoqtSession) -> list[tuple[TrackNamespace, Source]]:
        """Every (namespace, source) held by ``session``."""
        key = id(session)
        return [(ns, s) for ns, srcs in self._sources.items() for s in srcs if s.key == key]

    def sources_via(self, session: MoqtSession, request_id: int) -> list[TrackNamespace]:
        """Namespaces learned through one request of ``session``."""
        key = id(session)
        return [
            ns
            for ns, srcs in self._sources.items()
            for s in srcs
            if s.key == key and s.request_id == request_id
        ]

    def namespaces(self) -> tuple[TrackNamespace, ...]:
        """Every namespace with at least one source."""
        return tuple(self._sources)

    def is_publisher(self, session: MoqtSession) -> bool:
        """``session`` sent at least one PUBLISH_NAMESPACE still in force."""
        return id(session) in self._published

    def routes(self, namespace: TrackNamespace, exclude: MoqtSession | None) -> list[MoqtSession]:
        """Source sessions for a track in ``namespace`` (prefix match), deduplicated."""
        out: dict[int, MoqtSession] = {}
        skip = id(exclude) if exclude is not None else None
        for ns, sources in self._sources.items():
            if not ns.is_prefix_of(namespace):
                continue
            for s in sources:
                if s.key != skip and s.key not in out:
                    out[s.key] = s.session
        return list(out.values())

    def _visible(self, namespace: TrackNamespace, to: MoqtSession) -> bool:
        sources = self._sources.get(namespace)
        return bool(sources) and any(s.key != id(to) for s in sources or ())

    # --- downstream namespace subscriptions ---------------------------------------------

    def add_subscription(self, sub: NamespaceSubscription) -> None:
        self._subs[(id(sub.session), sub.request_id)] = sub

    def remove_subscription(self, session: MoqtSession, request_id: int) -> bool:
        return self._subs.pop((id(session), request_id), None) is not None

    def subscriptions_of(self, session: MoqtSession) -> list[NamespaceSubscription]:
        key = id(session)
        return [s for (k, _), s in self._subs.items() if k == key]

    def change_prefix(self, session: MoqtSession, request_id: int, prefix: TrackNamespace) -> bool:
        """A downstream subscription's prefix changed (TRACK_NAMESPACE_PREFIX, wire reference
        5.8): namespaces outside it are no longer announced on it."""
        sub = self._subs.get((id(session), request_id))
        if sub is None:
            return False
        sub.prefix = prefix
        sub.announced = {ns for ns in sub.announced if prefix.is_prefix_of(ns)}
        return True

    def subscriptions(self) -> Iterator[NamespaceSubscription]:
        return iter(tuple(self._subs.values()))

    def sync(
        self, namespaces: Iterable[TrackNamespace]
    ) -> list[tuple[NamespaceSubscription, TrackNamespace, bool]]:
        """What to send so that every downstream subscription sees exactly the visible
        namespaces under its prefix: ``(subscription, namespace, True=NAMESPACE /
        False=NAMESPACE_DONE)``. The caller sends them; state is updated here."""
        out: list[tuple[NamespaceSubscription, TrackNamespace, bool]] = []
        for ns in namespaces:
            for sub in self._subs.values():
                if not sub.prefix.is_prefix_of(ns):
                    continue
                want = self._visible(ns, sub.session) and (
                    self.may_see is None or self.may_see(sub.session, sub.request_id, ns)
                )
                if want and ns not in sub.announced:
                    sub.announced.add(ns)
                    out.append((sub, ns, True))
                elif not want and ns in sub.announced:
                    sub.announced.discard(ns)
                    out.append((sub, ns, False))
        return out

    # --- upstream namespace subscriptions ---------------------------------------------

    def upstream_plan(
        self, session: MoqtSession, prefix: TrackNamespace
    ) -> tuple[bool, list[UpstreamNamespaceSubscription]]:
        """``(covered, narrower)``: whether a SUBSCRIBE_NAMESPACE already sent on
        ``session`` covers ``prefix``, else the narrower ones the new one replaces."""
        key = id(session)
        narrower: list[UpstreamNamespaceSubscription] = []
        for (k, _), up in self._upstream.items():
            if k != key:
                continue
            if up.prefix.is_prefix_of(prefix):
                return True, []
            if prefix.is_prefix_of(up.prefix):
                narrower.append(up)
        return False, narrower

    def add_upstream(self, up: UpstreamNamespaceSubscription) -> None:
        self._upstream[(id(up.session), up.request_id)] = up

    def upstream(
        self, session: MoqtSession, request_id: int
    ) -> UpstreamNamespaceSubscription | None:
        return self._upstream.get((id(session), request_id))

    def remove_upstream(
        self, session: MoqtSession, request_id: int
    ) -> UpstreamNamespaceSubscription | None:
        return self._upstream.pop((id(session), request_id), None)

    def upstream_of(self, session: MoqtSession) -> list[UpstreamNamespaceSubscription]:
        key = id(session)
        return [u for (k, _), u in self._upstream.items() if k == key]

    def reattribute(self, session: MoqtSession, old_request_id: int, new_request_id: int) -> None:
        """Namespaces learned through ``old`` are now held by ``new`` (a broader prefix)."""
        for ns in self.sources_via(session, old_request_id):
            sources = self._sources[ns]
            for s in list(sources):
                if s.key == id(session) and s.request_id == old_request_id:
                    del sources[s]
                    sources[Source(session, s.kind, new_request_id)] = None
