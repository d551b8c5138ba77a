"""``Relay``: a pure caching MOQT draft-22 relay that fans out without reading payloads.

Theory of operation
-------------------
A relay (d21 section 7, wire reference section 10) owns many
:class:`~kvcs_core.moqt.session.MoqtSession`\\ s, one per connection: downstream
subscribers, upstream publishers and parent relays. It performs no I/O and
reads no clock: the embedding drives every session as usual (transport events
in, commands and data out) and hands every session event to
:meth:`Relay.handle_session_event` with the current time; the relay answers by
calling the sessions' local commands (``accept_subscribe``, ``subscribe``,
``end_subscription``, ...). After a call, drain every session the relay owns
(the loopback's ``on_event`` callback does exactly that).

The relay is split by concern:

* :mod:`~kvcs_core.relay.routing`: namespaces. PUBLISH_NAMESPACE from a peer
  is accepted (REQUEST_OK) and makes it a source; SUBSCRIBE_NAMESPACE is
  answered with NAMESPACE for every matching namespace, now and later, and
  NAMESPACE_DONE when a source goes away. d22 (B6, A13): PUBLISH_NAMESPACE is
  never forwarded downstream. Downstream prefixes are also subscribed upstream
  (parent relays), aggregated per prefix.
* :mod:`~kvcs_core.relay.cache`: one TrackStore per track, shared by every
  downstream session, holding the upstream payload views (zero copy); a byte
  budget with whole-group eviction.
* :mod:`~kvcs_core.relay.upstream`: one upstream SUBSCRIBE per track and route
  (aggregation), fill included, feeding the cache; its Forward State and the
  REQUEST_UPDATEs propagated from downstream; FETCHes upstream; PUBLISH_DONE
  and session loss.
* :mod:`~kvcs_core.relay.offers`: SUBSCRIBE_TRACKS (PUBLISH downstream,
  SUBSCRIBE_TRACKS upstream).
* this module: the API, the dispatch, and the downstream requests.

**Downstream SUBSCRIBE** (d21 section 7.2): the Full Track Name is matched
exactly against the tracks the relay knows. If an upstream subscription is
established and the cache is whole, the SUBSCRIBE is accepted at once from the
store; otherwise the relay subscribes upstream (once, for every subscriber) and
accepts as soon as the upstream SUBSCRIBE_OK has arrived (**cut-through**: its
LARGEST_OBJECT becomes the store's, the store is marked *filling*, and the
downstream fill follows the upstream fill object by object as it arrives,
while live objects flow meanwhile), or refuses with the upstream's
REQUEST_ERROR code, or DOES_NOT_EXIST when no route exists
(:mod:`~kvcs_core.relay.core`). Objects then reach each
subscriber exactly once, whenever it joined, through the store and the
session's fill (wire reference 6). Each downstream session enforces its own
filters, priorities, delivery timeouts and queue limit. A subscriber that is
behind is served at its own pace: its queues hold references into the cache,
which costs nothing beyond it; only what they hold of groups the cache has
evicted counts against its session's ``max_queued_bytes_per_subscription``,
past which it alone ends with PUBLISH_DONE TOO_FAR_BEHIND (d21 section 5.2,
:mod:`kvcs_core.moqt.publishing`). When the cache is full of what downstream
sessions still hold, the relay asks the embedding to hold the sessions that feed
it (:attr:`Relay.intake_held`, :mod:`~kvcs_core.relay.intake`): flow control
then reaches the publishers, and a hold with nothing draining is given up.

Objects reaching the cache out of order (upstream subgroups, fills and
fetches travel on separate streams) below a subscriber's live start are sent
to it fill-delivered on a late fill stream (Ambiguity A27); objects of an
evicted group fetched again (paced by ``RelayConfig.max_transit_bytes`` and
shared by every fill that lacks them, :mod:`~kvcs_core.relay.core`) are
*restores*, sent only to fills that missed them (``MoqtSession.restoring``),
so nobody gets an object twice
(:mod:`kvcs_core.moqt.publishing`). A SUBSCRIBE with Forward 0 is answered at
once (it gets no object and no fill).

**Downstream REQUEST_UPDATE**: answered by the subscriber's own session from
the cache; the relay then propagates what needs it upstream: the aggregated
Forward State (pause / resume with a fill), FETCHes of evicted groups a new
fill needs, NEW_GROUP_REQUEST (:mod:`~kvcs_core.relay.upstream`). A
TRACK_NAMESPACE_PREFIX update of a SUBSCRIBE_NAMESPACE moves its announcements
to the new prefix (wire reference 5.8).

**Downstream FETCH and TRACK_STATUS**: served from the cache when it holds the
answer, else asked upstream first (:mod:`~kvcs_core.relay.upstream`).

**Downstream SUBSCRIBE_TRACKS**: every matching live track is PUBLISHed to
the peer, now and later, or named in PUBLISH_SKIPPED
(:mod:`~kvcs_core.relay.offers`).

**RENDEZVOUS_TIMEOUT** (wire reference 5.7): a SUBSCRIBE for a track with no
publisher (no route, or every route answered DOES_NOT_EXIST) and nothing
cached, carrying a non-zero RENDEZVOUS_TIMEOUT, is held unanswered until a
publisher appears (a PUBLISH_NAMESPACE covering it, a PUBLISH of the track, a
new upstream session: it is then served as any SUBSCRIBE) or the timeout
(capped at ``RelayConfig.rendezvous_cap``) passes: REQUEST_ERROR TIMEOUT.
Without it, DOES_NOT_EXIST at once. At most ``RelayConfig.max_rendezvous``
are held. A held SUBSCRIBE wins over PUBLISHing the track to the same peer
(it gets PUBLISH_SKIPPED on its SUBSCRIBE_TRACKS).

**Limits** (:mod:`~kvcs_core.relay.config`): per-session request rate
(EXCESSIVE_LOAD with a Retry Interval), tracks, the cache budget (which
holds after every input, :mod:`~kvcs_core.relay.cache`). A track nobody needs
any more (no publisher, nothing cached, no request) is forgotten.

**Not supported**: authorization (every request is allowed; filter events
before handing them to the relay); MAX_CACHE_DURATION (objects are kept until
evicted).

Chaining: a relay's upstream session can be a downstream session of another
relay (trees); a parent relay is a default route for tracks no PUBLISH_NAMESPACE
covers.

**Upstream links** (``add_session(..., link=True)``): an upstream session the
embedding reopens when it is lost (a parent relay). When one is lost, a track it
fed that has no other route keeps its downstream subscriptions (served and
waiting), and downstream FETCHes waiting on it are kept too, for up to
``RelayConfig.upstream_hold`` seconds; when the next upstream session completes
SETUP each such track is subscribed upstream again (the fill starting after the
cached Largest Object when the cache is whole, as for any re-subscription) and
each kept FETCH is asked again. Namespace subscriptions of downstream peers are
re-subscribed on it as on any new upstream session. When the hold expires first,
they end as they would have at the loss (PUBLISH_DONE, REQUEST_ERROR).
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from typing import Any

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.windows import fetch_range
from kvcs_core.relay.config import RelayConfig, RelayStats, TrackStats
from kvcs_core.relay.intake import IntakeGate
from kvcs_core.relay.offers import Offers
from kvcs_core.relay.routing import (
    NamespaceSubscription,
    Source,
    SourceKind,
    UpstreamNamespaceSubscription,
)
from kvcs_core.relay.tracks import (
    DownstreamFetch,
    DownstreamSubscription,
    Feed,
    FeedKind,
    FetchPurpose,
    Peer,
    StatusQuery,
    Track,
)
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import LocationFilterType, PublishDoneCode, RequestErrorCode
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

__all__ = ["Relay"]


_NEW_REQUESTS: frozenset[type] = frozenset(
    {
        ev.SubscribeRequested,
        ev.FetchRequested,
        ev.TrackStatusRequested,
        ev.PublishNamespaceRequested,
        ev.SubscribeNamespaceRequested,
        ev.SubscribeTracksRequested,
        ev.PublishRequested,
    }
)
"""Events that open a new peer request: each takes a token (``RelayConfig.request_rate``)."""


def _fixed_start(lf: p.LocationFilter | None) -> Location | None:
    """Where a FETCH of ``lf`` starts, when that does not depend on Largest Object."""
    if lf is None or lf.filter_type == LocationFilterType.NONE:
        return Location(0, 0)
    if lf.filter_type in (
        LocationFilterType.ABSOLUTE_START,
        LocationFilterType.ABSOLUTE_GROUP_END,
        LocationFilterType.ABSOLUTE_RANGE,
    ):
        return lf.start
    return None


class Relay(Offers):
    """A caching MOQT relay over many sessions (see the module docstring).

    Args:
        config: limits and timeouts; :class:`RelayConfig` defaults if omitted.
    """

    def __init__(self, config: RelayConfig | None = None) -> None:
        super().__init__(config)
        handlers: dict[type, Callable[[Peer, Any], None]] = {
            ev.ObjectReceived: self._on_object,
            ev.DataStreamEnded: self._on_stream_ended,
            ev.SubscribeRequested: self._on_subscribe,
            ev.FetchRequested: self._on_fetch,
            ev.TrackStatusRequested: self._on_track_status,
            ev.PublishNamespaceRequested: self._on_publish_namespace,
            ev.SubscribeNamespaceRequested: self._on_subscribe_namespace,
            ev.SubscribeTracksRequested: self._on_subscribe_tracks,
            ev.PublishRequested: self._on_publish_requested,
            ev.RequestCancelled: self._on_request_cancelled,
            ev.RequestUpdated: self._on_request_updated,
            ev.SubscribeAccepted: self._on_subscribe_accepted,
            ev.FetchAccepted: self._on_fetch_accepted,
            ev.RangeMarkerReceived: self._on_range_marker,
            ev.RequestAccepted: self._on_request_accepted,
            ev.RequestFailed: self._on_request_failed,
            ev.PublishDoneReceived: self._on_publish_done,
            ev.NamespaceAnnounced: self._on_namespace,
            ev.NamespaceWithdrawn: self._on_namespace,
            ev.SetupCompleted: self._on_setup,
            ev.GoawayReceived: self._on_goaway,
            ev.SessionClosed: self._on_closed,
        }
        self._handlers = handlers
        self._links: set[MoqtSession] = set()
        """Upstream sessions that the embedding reopens when lost (module docstring)."""
        self._hold_until: float | None = None
        self._held: dict[Track, None] = {}
        self._parked: list[DownstreamFetch] = []
        cfg = self.config
        self._intake = IntakeGate(
            max(1, min(cfg.intake_hold_bytes, cfg.cache_budget_bytes // 2)),
            cfg.intake_stall,
            cfg.transit_poll,
        )
        """Backpressure from a full cache to the publishers (:mod:`.intake`)."""
        self._intake_held: frozenset[MoqtSession] = frozenset()

    # ------------------------------------------------------------------ API

    def add_session(self, session: MoqtSession, *, upstream: bool, link: bool = False) -> None:
        """Own ``session`` (started by the embedding, before or after this call).

        Args:
            session: one connection's session; every event it emits must go to
                :meth:`handle_session_event` from now on.
            upstream: ``True`` for a session towards publishers: an origin
                publisher or a parent relay (a default route for tracks no
                PUBLISH_NAMESPACE covers, and asked about downstream
                SUBSCRIBE_NAMESPACE prefixes). ``False`` for subscribers
                (downstream). Any session may send PUBLISH_NAMESPACE or PUBLISH.
            link: with ``upstream``: the embedding opens a new upstream session when
                this one is lost; until then (at most ``RelayConfig.upstream_hold``
                seconds) what it served waits instead of ending (module docstring).

        Raises:
            LocalProtocolError: the session is already owned or is closed.
        """
        if session in self._peers:
            raise LocalProtocolError("this session is already owned by the relay")
        if session.is_closed:
            raise LocalProtocolError("the session is closed")
        peer = Peer(session, upstream)
        self._peers[session] = peer
        self.sessions_added += 1
        if upstream and link:
            self._links.add(session)
        if upstream and session.setup_complete:
            self._on_setup(peer, None)

    def handle_session_event(
        self, session: MoqtSession, event: ev.SessionEvent, now: float
    ) -> bool:
        """React to one event of a session the relay owns; drain the sessions afterwards.

        Never raises because of what a peer sent.

        Returns:
            ``False`` when ``session`` is not owned by this relay (nothing done).

        Raises:
            LocalProtocolError: ``now`` went backwards.
        """
        peer = self._peers.get(session)
        if peer is None:
            return False
        if now != self._now:
            self._advance(now)
        if type(event) is ev.ObjectReceived:  # the hot path: straight into the cache
            self._on_object(peer, event)
        elif type(event) in _NEW_REQUESTS and (
            self._over_rate(
                peer,
                getattr(event, "request_id"),  # noqa: B009 - every request event has one
            )
            or not self._authorized(peer, event)
        ):
            pass  # refused: EXCESSIVE_LOAD (RelayConfig.request_rate) or unauthorized
        else:
            handler = self._handlers.get(type(event))
            if handler is not None:
                handler(peer, event)
        self._settle()
        return True

    def handle_timer(self, now: float) -> None:
        """Fire due deadlines (PUBLISH_DONE grace, fill timeout, upstream hold); early calls
        do nothing."""
        self._advance(now)
        self._fire(now)
        if self._hold_until is not None and self._hold_until <= now:
            self._end_hold()
        if self._auth is not None:
            self._auth.expire(now)  # sessions whose SETUP token expired (authz docstring)
        self._settle(timer=True)

    def _settle(self, *, timer: bool = False) -> None:
        """After every input: the cache within its budget (cache docstring), and tracks
        whose cache emptied forgotten if nothing else needs them; re-fetches waiting for
        transit room looked at again (:meth:`~.core.RelayCore._pace`)."""
        if self._pace_at is not None:
            self._pace()
        if self._filling:
            self._settle_filling()
        cache = self._cache
        cache.settle(self._tier)
        if cache.emptied:
            names, cache.emptied = cache.emptied, []
            for name in names:
                track = self._tracks.get(name)
                if track is not None:
                    self._forget_idle(track)
        intake = self._intake
        changed = intake.update(
            cache.held_outside_bytes, cache.released_outside_bytes, self._now
        )
        if intake.held:
            if changed or timer:
                # the sessions the relay receives objects from (any upstream request
                # delivering objects): named when a hold starts, and looked at again at
                # each of its polls (RelayConfig.transit_poll), so that a new feed is held
                # too, not on every object that arrives meanwhile (a transport that holds
                # by credit still delivers what it had granted: those inputs leave the
                # hold as it is)
                feeding = frozenset(
                    peer.session
                    for peer in self._peers.values()
                    if peer.feeds and not peer.session.is_closed
                )
                if feeding != self._intake_held:
                    self._intake_held = feeding  # a new object only when it changed
        elif self._intake_held:
            self._intake_held = frozenset()  # the gate opened (or gave up)

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` should next be called, or ``None``."""
        deadline = self._deadline()
        if self._hold_until is not None and (deadline is None or self._hold_until < deadline):
            deadline = self._hold_until
        if self._auth is not None:
            expiry = self._auth.deadline()
            if expiry is not None and (deadline is None or expiry < deadline):
                deadline = expiry
        look = self._intake.deadline(self._now)
        if look is not None and (deadline is None or look < deadline):
            deadline = look
        return deadline

    def _advance(self, now: float) -> None:
        if now < self._now:
            raise LocalProtocolError(f"time went backwards: {now} < {self._now}")
        self._now = now

    # ------------------------------------------------------------------ getters

    @property
    def cache_bytes(self) -> int:
        """Payload bytes cached now, over every track."""
        return self._cache.total_bytes

    @property
    def peak_cache_bytes(self) -> int:
        return self._cache.peak_bytes

    @property
    def upstream_bytes_received(self) -> int:
        """Payload bytes received from upstream (duplicates included)."""
        return self._cache.received_bytes

    @property
    def sessions(self) -> tuple[MoqtSession, ...]:
        return tuple(self._peers)

    @property
    def intake_held(self) -> frozenset[MoqtSession]:
        """The sessions whose input the embedding should stop taking from its transport
        now, so that flow control reaches the publishers (the cache is full of what
        downstream sessions still hold: :mod:`kvcs_core.relay.intake`); empty while
        intake is open. Look after every call into the relay (an input or a timer); hold
        a session by leaving what its transport received unread (its flow-control credit
        unextended), and on release hand the session everything that was held. A
        transport that cannot hold may ignore it: the relay then forwards what does not
        fit without keeping it (cache module docstring)."""
        return self._intake_held

    def tracks(self) -> tuple[FullTrackName, ...]:
        """Every track the relay keeps state for."""
        return tuple(self._tracks)

    def namespaces(self) -> tuple[TrackNamespace, ...]:
        """Every namespace a source is known for."""
        return self._router.namespaces()

    def track_stats(self, name: FullTrackName) -> TrackStats | None:
        """Accounting for one track, or ``None`` if the relay does not know it."""
        track = self._tracks.get(name)
        if track is None:
            return None
        entry = track.entry
        store = entry.store if entry is not None else None
        return TrackStats(
            name=name,
            cached_bytes=store.total_bytes if store is not None else 0,
            cached_objects=len(store) if store is not None else 0,
            objects_received=entry.objects_received if entry is not None else 0,
            bytes_received=entry.bytes_received if entry is not None else 0,
            duplicates=entry.duplicates if entry is not None else 0,
            evicted_groups=entry.evicted_groups if entry is not None else 0,
            evicted_bytes=entry.evicted_bytes if entry is not None else 0,
            largest=store.largest if store is not None else None,
            complete=track.complete,
            upstream_live=track.live,
            downstream_subscriptions=len(track.served),
            pending_subscriptions=len(track.pending),
        )

    def stats(self) -> RelayStats:
        """Relay-wide accounting."""
        cache = self._cache
        live = [peer.session.publisher for peer in self._peers.values()]
        return RelayStats(
            cache_bytes=cache.total_bytes,
            peak_cache_bytes=cache.peak_bytes,
            upstream_bytes_received=cache.received_bytes,
            upstream_objects_received=cache.received_objects,
            evicted_bytes=cache.evicted_bytes,
            tracks=len(self._tracks),
            sessions=len(self._peers),
            downstream_subscriptions=sum(len(t.served) for t in self._tracks.values()),
            transit_bytes=cache.transit_bytes,
            refetch_bytes_received=self._refetched_bytes,
            refused_for_rate=self.refused_for_rate,
            cached_objects=sum(
                len(t.entry.store) for t in self._tracks.values() if t.entry is not None
            ),
            evicted_groups=cache.evicted_groups,
            objects_sent=self._gone_objects_sent + sum(p.objects_sent for p in live),
            bytes_sent=self._gone_bytes_sent + sum(p.payload_bytes_sent for p in live),
            sessions_added=self.sessions_added,
            upstream_sessions=sum(1 for peer in self._peers.values() if peer.upstream),
            refused=tuple(sorted(self.refused.items())),
            evicted_held_bytes=cache.evicted_held_bytes,
            held_outside_bytes=cache.held_outside_bytes,
            intake_held=self._intake.held,
            intake_holds=self._intake.holds,
            intake_given_up=self._intake.given_up,
            intake_held_seconds=self._intake.held_seconds,
        )

    # ------------------------------------------------------------------ downstream requests

    def _on_subscribe(self, peer: Peer, e: ev.SubscribeRequested) -> None:
        if not self._pending(peer, e.request_id, ev.RequestKind.SUBSCRIBE):
            return
        track = self._track_for(e.track)
        if track is None:
            self._reject(peer, e.request_id, RequestErrorCode.EXCESSIVE_LOAD, "too many tracks")
            return
        fwd = e.params.get(p.Forward)
        lf = e.params.get(p.LocationFilter)
        sub = DownstreamSubscription(
            peer,
            e.request_id,
            e.params,
            track,
            forward=fwd is None or fwd.value == 1,
            location_filter=lf,
        )
        peer.subscriptions[e.request_id] = sub
        track.pending.append(sub)
        if not track.active and not track.complete:
            self._subscribe_upstream(track, exclude=peer)
            if track.entry is None:  # nothing known of it: may be held for a publisher
                self._hold(sub, e.params.get(p.RendezvousTimeout))
        else:
            self._sync_forward(track)
            ngr = e.params.get(p.NewGroupRequest)
            if ngr is not None:
                self._new_group_request(track, ngr.value)
        self._serve_pending(track)

    # ------------------------------------------------------------------ rendezvous

    def _hold(self, sub: DownstreamSubscription, timeout: p.RendezvousTimeout | None) -> None:
        """RENDEZVOUS_TIMEOUT (wire reference 5.7, d21 9.20.7): a SUBSCRIBE for a track with
        no publisher is held, unanswered, until one appears (it is then served as usual:
        a PUBLISH_NAMESPACE covering it, a PUBLISH of it, or a new upstream session) or
        the timeout passes (REQUEST_ERROR TIMEOUT). 0 or absent: answered at once. The
        timeout is capped at ``RelayConfig.rendezvous_cap`` and at most
        ``RelayConfig.max_rendezvous`` SUBSCRIBEs are held (beyond: answered at once)."""
        if timeout is None or timeout.ms <= 0:
            return
        held = self._rendezvous
        if len(held) >= self.config.max_rendezvous:
            for old in [s for s in held if s not in s.track.pending]:
                del held[old]  # answered meanwhile
            if len(held) >= self.config.max_rendezvous:
                return
        at = self._now + min(timeout.ms / 1000.0, self.config.rendezvous_cap)
        held[sub] = at
        self._rendezvous_seq += 1
        heapq.heappush(self._rendezvous_heap, (at, self._rendezvous_seq, sub))

    def _fire(self, now: float) -> None:
        super()._fire(now)
        heap, held = self._rendezvous_heap, self._rendezvous
        while heap and heap[0][0] <= now:
            at, _seq, sub = heapq.heappop(heap)
            if held.get(sub) != at:
                continue  # answered (or re-held) meanwhile
            del held[sub]
            track = sub.track
            if sub in track.pending:
                track.pending.remove(sub)
                sub.peer.subscriptions.pop(sub.request_id, None)
                self._reject(
                    sub.peer, sub.request_id, RequestErrorCode.TIMEOUT, "no publisher appeared"
                )
                self._forget_idle(track)

    def _deadline(self) -> float | None:
        best = super()._deadline()
        heap, held = self._rendezvous_heap, self._rendezvous
        while heap and held.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)  # stale entries (amortised O(log n) each)
        if heap and (best is None or heap[0][0] < best):
            best = heap[0][0]
        return best

    def _on_request_updated(self, peer: Peer, e: ev.RequestUpdated) -> None:
        """A downstream REQUEST_UPDATE its session already answered from the cache (FORWARD,
        then FILL_PARAMETERS, A16): propagate upstream what needs it (upstream module
        docstring)."""
        sub = peer.subscriptions.get(e.request_id)
        if sub is None:
            prefix = e.params.get(p.TrackNamespacePrefix)
            rec = peer.session.requests.get(e.request_id)
            if (
                prefix is not None
                and rec is not None
                and rec.namespace == prefix.namespace  # accepted (no PREFIX_OVERLAP)
                and self._router.change_prefix(peer.session, e.request_id, prefix.namespace)
            ):
                self._sync_namespaces(
                    [ns for ns in self._router.namespaces() if prefix.namespace.is_prefix_of(ns)]
                )
                for up in list(self._peers.values()):
                    if up.upstream and up is not peer and up.usable:
                        self._ensure_upstream_namespace(up, prefix.namespace)
                return
            self._tracks_updated(peer, e)
            return
        params = e.params
        fwd = params.get(p.Forward)
        if fwd is not None:
            sub.forward = fwd.value == 1
        lf = params.get(p.LocationFilter)
        if lf is not None:  # NONE removes the filter (wire reference 5.4)
            sub.location_filter = None if lf.filter_type == LocationFilterType.NONE else lf
        track = sub.track
        entry = track.entry
        if sub in track.served and entry is not None:
            if sub.forward and params.get(p.FillParameters) is not None:
                # the fill needs objects the cache evicted: FETCH them; the session sends
                # each one fill-delivered as it arrives (A27)
                groups = self._evicted_needed(entry, params, sub.location_filter)
                if groups is not None:
                    self._refetch(track, groups)
            ngr = params.get(p.NewGroupRequest)
            if ngr is not None:
                self._new_group_request(track, ngr.value)
        self._sync_forward(track)

    def _on_fetch(self, peer: Peer, e: ev.FetchRequested) -> None:
        if not self._pending(peer, e.request_id, ev.RequestKind.FETCH):
            return
        track = self._track_for(e.track)
        if track is None:
            self._reject(peer, e.request_id, RequestErrorCode.EXCESSIVE_LOAD, "too many tracks")
            return
        self._route_fetch(DownstreamFetch(peer, e.request_id, e.params, track))

    def _route_fetch(self, fetch: DownstreamFetch) -> None:
        """Serve a downstream FETCH from the cache, or ask upstream (module docstring)."""
        peer, track = fetch.peer, fetch.track
        lf = fetch.params.get(p.LocationFilter)
        if self._fetch_cached(track, lf):
            self._accept_fetch(fetch)
            return
        routes = self._routes(track.name.namespace, peer)
        if not routes:
            if track.entry is not None:
                self._accept_fetch(fetch)  # what the cache has (INVALID_RANGE if nothing)
            else:
                self._reject(
                    peer,
                    fetch.request_id,
                    RequestErrorCode.DOES_NOT_EXIST,
                    "no publisher for track",
                )
            self._forget_idle(track)
            return
        peer.fetches[fetch.request_id] = fetch
        key = (lf,)
        for f in track.fetches:
            if f.purpose is FetchPurpose.SERVE and f.filter_key == key:
                f.waiters.append(fetch)  # the same range is being fetched: share it
                if f.streaming:
                    self._stream_fetch(f, fetch)  # joins it where it has got to
                return
        up = routes[0]
        rid = up.session.fetch(
            track.name,
            now=self._now,
            location_filter=lf,
            priority=self.config.upstream_priority,
        )
        feed = Feed(
            up,
            rid,
            track,
            FeedKind.FETCH,
            purpose=FetchPurpose.SERVE,
            filter_key=key,
            waiters=[fetch],
            span_from=_fixed_start(lf),
            range_empty=not (track.entry is not None and self._has_objects(fetch)),
        )
        up.feeds[rid] = feed
        track.fetches.append(feed)

    def _fetch_cached(self, track: Track, lf: p.LocationFilter | None) -> bool:
        """The cache alone answers a FETCH of ``lf`` (upstream module docstring)."""
        entry = track.entry
        if entry is None or not track.whole:
            return False
        store = entry.store
        if track.active and not track.live:
            return False  # (re)subscribing: the cached Largest Object may be stale
        rng = fetch_range(lf, store.largest)
        return rng is None or entry.evicted.span_within(rng.start.group, rng.end.group) is None

    def _on_track_status(self, peer: Peer, e: ev.TrackStatusRequested) -> None:
        """TRACK_STATUS (d21 9.13, wire ref. 10): from a live cache, else asked upstream."""
        if not self._pending(peer, e.request_id, ev.RequestKind.TRACK_STATUS):
            return
        track = self._tracks.get(e.track)
        entry = track.entry if track is not None else None
        if entry is not None and track is not None and (track.live or track.complete):
            peer.session.accept_track_status(e.request_id, entry.store, now=self._now)
            return
        routes = self._routes(e.track.namespace, peer)
        if routes:
            track = track if track is not None else self._track_for(e.track)
            if track is not None:
                up = routes[0]
                rid = up.session.track_status(e.track, now=self._now)
                up.statuses[rid] = StatusQuery(track, [(peer, e.request_id)])
                return
        if entry is not None:
            peer.session.accept_track_status(e.request_id, entry.store, now=self._now)
        else:
            self._reject(peer, e.request_id, RequestErrorCode.DOES_NOT_EXIST, "no such track")
        if track is not None:
            self._forget_idle(track)

    def _on_publish_namespace(self, peer: Peer, e: ev.PublishNamespaceRequested) -> None:
        """d21 7.5 / wire ref. 10: accept, record the source, tell the namespace
        subscribers with NAMESPACE (never forward the PUBLISH_NAMESPACE itself, A13)."""
        if not self._pending(peer, e.request_id, ev.RequestKind.PUBLISH_NAMESPACE):
            return
        peer.session.accept_request(e.request_id, now=self._now)
        peer.published[e.request_id] = e.namespace
        self._router.add_source(
            e.namespace, Source(peer.session, SourceKind.PUBLISH_NAMESPACE, e.request_id)
        )
        self._sync_namespaces([e.namespace])
        for track in list(self._tracks.values()):
            if (
                (track.pending or track.served)
                and not track.active
                and e.namespace.is_prefix_of(track.name.namespace)
            ):
                self._subscribe_upstream(track, None)
        self._tracks_on_setup(peer)  # a new source: ask it for the downstream prefixes

    def _on_subscribe_namespace(self, peer: Peer, e: ev.SubscribeNamespaceRequested) -> None:
        if not self._pending(peer, e.request_id, ev.RequestKind.SUBSCRIBE_NAMESPACE):
            return
        peer.session.accept_request(e.request_id, now=self._now)
        self._router.add_subscription(NamespaceSubscription(peer.session, e.request_id, e.prefix))
        self._sync_namespaces([ns for ns in self._router.namespaces() if e.prefix.is_prefix_of(ns)])
        for up in list(self._peers.values()):
            if up.upstream and up is not peer and up.usable:
                self._ensure_upstream_namespace(up, e.prefix)

    def _ensure_upstream_namespace(self, peer: Peer, prefix: TrackNamespace) -> None:
        """SUBSCRIBE_NAMESPACE upstream for ``prefix`` unless one covers it (routing)."""
        session = peer.session
        covered, narrower = self._router.upstream_plan(session, prefix)
        if covered:
            return
        for up in narrower:
            self._router.remove_upstream(session, up.request_id)
            with contextlib.suppress(LocalProtocolError):  # finished and forgotten already
                session.cancel(up.request_id, now=self._now)
        rid = session.subscribe_namespace(prefix, now=self._now)
        self._router.add_upstream(UpstreamNamespaceSubscription(session, rid, prefix))
        for up in narrower:
            self._router.reattribute(session, up.request_id, rid)

    def _on_request_cancelled(self, peer: Peer, e: ev.RequestCancelled) -> None:
        rid = e.request_id
        sub = peer.subscriptions.pop(rid, None)
        if sub is not None:
            self._rendezvous.pop(sub, None)
            track = sub.track
            if sub in track.pending:
                track.pending.remove(sub)
            track.served.pop(sub, None)
            self._sync_forward(track)
            self._forget_idle(track)
            return
        fetch = peer.fetches.pop(rid, None)
        if fetch is not None:
            for f in fetch.track.fetches:
                if fetch in f.waiters:
                    f.waiters.remove(fetch)
                if fetch in f.following:
                    f.following.remove(fetch)  # its session reset the stream (d21 4.5)
            return
        if self._router.remove_subscription(peer.session, rid):
            return
        if peer.tracks_subs.pop(rid, None) is not None:
            return  # no more offers; the PUBLISHes made live on (offers module docstring)
        ns = peer.published.pop(rid, None)
        if ns is not None:  # the publisher withdrew its PUBLISH_NAMESPACE
            self._router.remove_source(ns, Source(peer.session, SourceKind.PUBLISH_NAMESPACE, rid))
            self._sync_namespaces([ns])
            return
        feed = peer.feeds.get(rid)
        if feed is not None and feed.kind is FeedKind.PUBLISH:
            self._finalize(feed, lost=True)  # the publisher reset its PUBLISH

    # ------------------------------------------------------------------ session life

    def _authorized(self, peer: Peer, event: Any) -> bool:
        """The authorization gate for a new request (:mod:`kvcs_core.relay.authz`);
        refused: REQUEST_ERROR with the token's code, and the request is forgotten."""
        auth = self._auth
        if auth is None or peer.upstream:
            return True
        decision = auth.check(peer.session, event, self._now)
        if decision.allowed:
            return True
        rid: int = event.request_id
        peer.orphans.pop(rid, None)  # objects of a refused PUBLISH go nowhere
        self._reject(peer, rid, decision.request_error(), decision.detail or "unauthorized")
        return False

    def _on_setup(self, peer: Peer, _e: object) -> None:
        auth = self._auth
        if auth is not None and not peer.upstream and not auth.admit(peer.session, self._now):
            return  # closed: UNAUTHORIZED / MALFORMED_AUTH_TOKEN / EXPIRED_AUTH_TOKEN
        if peer.upstream and peer.usable:
            for sub in self._router.subscriptions():
                if sub.session is not peer.session:
                    self._ensure_upstream_namespace(peer, sub.prefix)
            self._tracks_on_setup(peer)
            self._resume_held()
            for track in {s.track: None for s in self._rendezvous}:
                if track.pending and not track.active:  # a new route for a held SUBSCRIBE
                    self._subscribe_upstream(track, None)

    # ------------------------------------------------------------------ upstream links

    def _holding(self) -> bool:
        return self._hold_until is not None and self._now < self._hold_until

    def _upstream_gone(self, track: Track, status: int, reason: str, *, failover: bool) -> None:
        """As :class:`~kvcs_core.relay.upstream.Upstream`'s, but while a lost upstream link
        is expected back, a track left without any route keeps its downstream
        subscriptions (module docstring, upstream links)."""
        if (
            failover
            and self._holding()
            and (track.served or track.pending)
            and not track.complete
            and not self._routes(track.name.namespace, None)
        ):
            self._held[track] = None
            return
        super()._upstream_gone(track, status, reason, failover=failover)

    def _resume_held(self) -> None:
        """A new upstream session is set up: ask it for what waited (module docstring)."""
        held, self._held = list(self._held), {}
        parked, self._parked = self._parked, []
        self._hold_until = None
        for track in held:
            if (
                (track.served or track.pending)
                and not track.active
                and not track.complete
                and not self._subscribe_upstream(track, None)
            ):
                self._release(track)
        for fetch in parked:
            if self._pending(fetch.peer, fetch.request_id, ev.RequestKind.FETCH):
                self._route_fetch(fetch)

    def _end_hold(self) -> None:
        """No upstream session came back in time: end what waited for one."""
        held, self._held = list(self._held), {}
        parked, self._parked = self._parked, []
        self._hold_until = None
        for track in held:
            if not track.active:
                self._release(track)
        for fetch in parked:
            fetch.peer.fetches.pop(fetch.request_id, None)
            if fetch.track.entry is not None and self._has_objects(fetch):
                self._accept_fetch(fetch)
            else:
                self._reject(
                    fetch.peer, fetch.request_id, RequestErrorCode.INTERNAL_ERROR, "upstream lost"
                )

    def _release(self, track: Track) -> None:
        entry = track.entry
        if entry is not None and (entry.store.end_of_track is not None or track.ended):
            status, reason = int(PublishDoneCode.TRACK_ENDED), "track ended"
        else:
            status, reason = int(PublishDoneCode.INTERNAL_ERROR), "upstream lost"
        super()._upstream_gone(track, status, reason, failover=False)

    def _on_goaway(self, peer: Peer, e: ev.GoawayReceived) -> None:
        if e.request_id is None:
            peer.goaway = True  # d21 9.2: no new requests on this session

    def _on_closed(self, peer: Peer, _e: ev.SessionClosed) -> None:
        """Forget the session: its downstream requests, the namespaces it served
        (NAMESPACE_DONE), and its upstream feeds (failover or PUBLISH_DONE downstream)."""
        peer.closed = True
        session = peer.session
        del self._peers[session]
        if self._auth is not None:
            self._auth.forget(session)
        self._gone_objects_sent += session.publisher.objects_sent
        self._gone_bytes_sent += session.publisher.payload_bytes_sent
        if session in self._links:
            self._links.discard(session)
            if self.config.upstream_hold > 0:
                self._hold_until = self._now + self.config.upstream_hold
        affected: dict[Track, None] = {}
        for sub in peer.subscriptions.values():
            self._rendezvous.pop(sub, None)
            track = sub.track
            if sub in track.pending:
                track.pending.remove(sub)
            track.served.pop(sub, None)
            affected[track] = None
        peer.subscriptions.clear()
        for fetch in peer.fetches.values():
            for f in fetch.track.fetches:
                if fetch in f.waiters:
                    f.waiters.remove(fetch)
                if fetch in f.following:
                    f.following.remove(fetch)
        peer.fetches.clear()
        peer.tracks_subs.clear()
        peer.tracks_up.clear()
        for ns_sub in self._router.subscriptions_of(session):
            self._router.remove_subscription(session, ns_sub.request_id)
        changed: list[TrackNamespace] = []
        for ns, source in self._router.sources_of(session):
            self._router.remove_source(ns, source)
            changed.append(ns)
        for up in self._router.upstream_of(session):
            self._router.remove_upstream(session, up.request_id)
        self._sync_namespaces(changed)
        for feed in list(peer.feeds.values()):
            if feed.kind is FeedKind.FETCH:
                if (
                    self._holding()
                    and feed.purpose is FetchPurpose.SERVE
                    and not self._routes(feed.track.name.namespace, None)
                ):
                    # asked again on the next upstream session (module docstring)
                    self._parked.extend(feed.waiters)
                    feed.waiters = []
                self._fetch_done(
                    feed, ok=False, code=RequestErrorCode.INTERNAL_ERROR, reason="upstream lost"
                )
            else:
                self._finalize(feed, lost=True)
        for track in affected:
            self._sync_forward(track)
            self._forget_idle(track)
        for query in peer.statuses.values():
            entry = query.track.entry
            for down, rid in query.waiters:
                if entry is not None and self._pending(down, rid):
                    down.session.accept_track_status(rid, entry.store, now=self._now)
                else:
                    self._reject(down, rid, RequestErrorCode.INTERNAL_ERROR, "upstream lost")
        peer.statuses.clear()
