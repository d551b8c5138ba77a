"""State shared by the relay's halves, and the steps both of them take.

Theory of operation
-------------------
:class:`RelayCore` holds the relay's tables (peers, tracks, the cache, the
router, the timers) and the steps used on both sides of the relay:

* :meth:`RelayCore._serve_pending` answers the downstream SUBSCRIBEs waiting
  on a track. A SUBSCRIBE is accepted (``accept_subscribe`` from the track's
  store: the downstream session computes the window and the fill from the
  store's Largest Object in one step, A27) when the cache is *whole* (an
  upstream subscription is established and its own fill completed, so every
  object up to Largest Object is in the store) or, cut-through, as soon as the
  upstream fill's range is known (its SUBSCRIBE_OK: the store takes its
  LARGEST_OBJECT and is marked *filling*, :meth:`RelayCore._mark_filling`; the
  downstream fill then follows the upstream one, each object sent as it
  arrives, and finishes when the store settles after every upstream fill and
  serving FETCH is over, :meth:`RelayCore._settle_filling`). That is what makes the
  downstream exactly-once recipe (NEXT_OBJECT + FILL{ABSOLUTE_START 0,0}, wire
  reference 6) hold through the relay for subscribers joining at any time:
  their fill reads the store up to Largest Object, their live part starts
  right after it, and the store's listener hands them every later object once
  (d21 section 7.2: "deliver each object to every matching downstream
  subscription"). Objects that still reach the store later below its live
  start (out-of-order upstream streams, a fill timeout) follow on a late fill
  stream (A27, :mod:`kvcs_core.moqt.publishing`). A SUBSCRIBE with Forward 0
  needs no whole cache (no object, no fill: wire reference 6 item 4) and is
  accepted as soon as an upstream subscription is established. With no
  upstream left, a waiting SUBSCRIBE is served from the cache and ended at
  once with the track's terminal status (its fill still delivers the cached
  objects first); with no cache either it is refused (the upstream's error
  code, or DOES_NOT_EXIST).
* A downstream SUBSCRIBE whose fill crosses evicted groups is accepted like
  any other (its fill sends what is cached) and the evicted groups join the
  track's *wanted* groups, which are FETCHed upstream again, *paced*
  (:meth:`RelayCore._pace`): restored objects are forwarded without being kept,
  so until the downstream sessions have sent them they are held only by their
  queues (``Cache.transit_bytes``). A re-fetch is asked for only while what is
  in transit, plus the estimate of the re-fetches asked for and not arrived,
  fits ``RelayConfig.max_transit_bytes`` (each group estimated at the track's
  largest group so far; with nothing in transit one group goes whatever its
  size), one at a time per track, the next as the previous ends and the
  sessions drain (looked at after every input and every
  ``RelayConfig.transit_poll``: a session drains when its transport pulls,
  which is no input to the relay). When nothing drains for
  ``RelayConfig.transit_stall`` (a subscriber that stopped reading holds the
  restores), one more group is asked anyway, so a stalled subscriber holds
  back no other late joiner; its own queue is bounded by its session's
  ``max_queued_bytes_per_subscription`` (PUBLISH_DONE TOO_FAR_BEHIND). Each
  re-fetch takes the next run of wanted
  groups from a cursor that wraps around, and each restored object goes to
  *every* fill that lacks it on a late fill stream as it arrives (A27), so
  late joiners that lack the same groups share one re-fetch. Subscriptions of
  a track with no upstream left end once no re-fetch is wanted or in flight
  (:meth:`RelayCore._end_idle`).
* Tracks nobody needs (no feed, no request, nothing cached) are forgotten
  (:meth:`RelayCore._forget_idle`); every track record is charged to the cache
  budget, and at ``max_tracks`` an idle one is reclaimed with a bounded scan.
* Each new peer request takes a token of its session's bucket
  (``RelayConfig.request_rate``); without one it is refused EXCESSIVE_LOAD with
  a Retry Interval.
* :meth:`RelayCore._append` feeds one upstream object into the cache and
  keeps it within budget (:meth:`RelayCore._restore` for an evicted object
  fetched again, which the downstream sessions must not send twice); a
  malformed track (d21 section 12.1, wire reference 7.10) ends every
  downstream request of the track with MALFORMED_TRACK and drops its cache
  (:meth:`RelayCore._malformed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.events import ObjectReceived, RequestKind
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import MalformedTrack
from kvcs_core.moqt.windows import FetchRange, fetch_range
from kvcs_core.relay.authz import RelayAuth
from kvcs_core.relay.cache import Cache, CacheEntry, GroupSet, Spans, track_cost
from kvcs_core.relay.config import RelayConfig
from kvcs_core.relay.routing import Router
from kvcs_core.relay.tracks import (
    DownstreamSubscription,
    Feed,
    FeedKind,
    FeedState,
    FetchPurpose,
    Peer,
    Track,
)
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import MAX_VI64, PublishDoneCode, RequestErrorCode
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

_RECLAIM_SCAN = 64
"""Tracks :meth:`RelayCore._reclaim` looks at, at most, per new track at ``max_tracks``."""


def next_after(loc: Location) -> Location | None:
    """The Location right after ``loc`` in the same group (or the next group's first);
    ``None`` after the last one there can be, {2^64-1, 2^64-1}: a peer may publish there,
    and nothing can follow it (its Group ID + 1 is no vi64)."""
    if loc.object < MAX_VI64:
        return Location(loc.group, loc.object + 1)
    if loc.group < MAX_VI64:
        return Location(loc.group + 1, 0)
    return None


def as_request_error(code: int) -> RequestErrorCode:
    """An upstream REQUEST_ERROR code passed on unchanged, unknown ones as INTERNAL_ERROR."""
    try:
        return RequestErrorCode(code)
    except ValueError:
        return RequestErrorCode.INTERNAL_ERROR


class RelayCore:
    """The relay's state and shared steps (see the module docstring)."""

    def __init__(self, config: RelayConfig | None = None) -> None:
        self.config = config or RelayConfig()
        self._cache = Cache(self.config.cache_budget_bytes, self.config.evict_to)
        self._router = Router()
        auth = self.config.authorizer
        self._auth = RelayAuth(auth) if auth is not None else None
        """Authorization of downstream sessions (:mod:`kvcs_core.relay.authz`), if any."""
        if self._auth is not None:
            self._router.may_see = self._auth.may_see
        self._peers: dict[MoqtSession, Peer] = {}
        self._tracks: dict[FullTrackName, Track] = {}
        self.refused_for_rate = 0
        self.refused: dict[str, int] = {}
        """Requests refused so far (REQUEST_ERROR sent by the relay), by error code name."""
        self.sessions_added = 0
        """Sessions the relay was given so far (:meth:`Relay.add_session`)."""
        self._gone_objects_sent = 0
        self._gone_bytes_sent = 0
        """What sessions that are gone had sent (:meth:`Relay.stats` adds the live ones)."""
        self._rendezvous: dict[DownstreamSubscription, float] = {}
        """SUBSCRIBEs held for a publisher (RENDEZVOUS_TIMEOUT): their deadlines."""
        self._rendezvous_heap: list[tuple[float, int, DownstreamSubscription]] = []
        self._rendezvous_seq = 0
        self._pacing: dict[Track, None] = {}
        """Tracks with wanted groups (paced re-fetches, :meth:`_pace`)."""
        self._pace_at: float | None = None
        """When :meth:`_pace` looks again at re-fetches waiting for transit room."""
        self._refetches: dict[Feed, None] = {}
        """Paced re-fetches asked for (pruned once ended, :meth:`_reserved`)."""
        self._refetched_bytes = 0
        self._transit_seen = 0
        self._stalled_since: float | None = None
        """Since when re-fetches wait for transit room without anything draining."""
        self._timed: dict[Feed | Track, None] = {}
        """Feeds waiting after PUBLISH_DONE, tracks waiting for their fill: the timers."""
        self._filling: dict[Track, None] = {}
        """Tracks whose store is marked filling (:meth:`_mark_filling`)."""
        self._now = 0.0

    # --- small queries ------------------------------------------------------------------

    def _routes(self, namespace: TrackNamespace, exclude: Peer | None) -> list[Peer]:
        """Usable upstream peers for a track in ``namespace`` (routing module docstring)."""
        skip = exclude.session if exclude is not None else None
        out = [
            self._peers[s]
            for s in self._router.routes(namespace, skip)
            if s in self._peers and self._peers[s].usable
        ]
        if out:
            return out
        return [
            peer
            for peer in self._peers.values()
            if peer.upstream
            and peer.usable
            and peer is not exclude
            and not self._router.is_publisher(peer.session)
        ]

    @staticmethod
    def _pending(peer: Peer, request_id: int, kind: RequestKind | None = None) -> bool:
        """The peer's request still waits for our answer (not cancelled, session open)."""
        session = peer.session
        if session.is_closed:
            return False
        rec = session.requests.get(request_id)
        return (
            rec is not None
            and not rec.mine
            and rec.state is RequestState.PENDING
            and (kind is None or rec.kind is kind)
        )

    def _track_for(self, name: FullTrackName) -> Track | None:
        """The track's state, made if new (``None``: too many tracks). A malformed track
        starts over: its cache was dropped, and a new request subscribes afresh."""
        track = self._tracks.get(name)
        if track is not None and not track.malformed:
            return track
        if track is None:
            if len(self._tracks) >= self.config.max_tracks and not self._reclaim():
                return None
            if not self._cache.reserve(track_cost(name), self._tier):
                return None  # the cache budget cannot hold one more track record
        track = Track(name)
        self._tracks[name] = track
        return track

    def _reclaim(self) -> bool:
        """Forget an idle track (no request in flight, nothing served from it), its cache
        included, to make room for a new one. Looks at most ``_RECLAIM_SCAN`` tracks, the
        oldest first; busy ones move to the back, so the work per call is bounded whatever
        the number of tracks (approximately least recently added first)."""
        tracks = self._tracks
        for _ in range(min(_RECLAIM_SCAN, len(tracks))):
            name, t = next(iter(tracks.items()))
            if t.feeds or t.fetches or t.pending or t.served or t in self._timed:
                del tracks[name]
                tracks[name] = t  # busy: to the back
                continue
            self._cache.drop(name)
            self._cache.release(track_cost(name))
            del tracks[name]
            return True
        return False

    def _forget_idle(self, track: Track) -> None:
        """Forget a track nobody needs (finding 8: phantom tracks): no feed, no upstream
        FETCH, no downstream request, no timer, and nothing cached. A track that was only
        asked about (no publisher) thus leaves no record behind."""
        if (
            track.feeds
            or track.fetches
            or track.pending
            or track.served
            or track in self._timed
            or track.early
        ):
            return
        entry = track.entry
        if entry is not None and entry.groups:
            return  # cached data: kept until evicted (then forgotten here)
        if self._tracks.get(track.name) is track:
            del self._tracks[track.name]
            self._cache.release(track_cost(track.name))
            if entry is not None:
                self._cache.drop(track.name)
                track.entry = None

    def _want_forward(self, track: Track) -> bool:
        """The Forward State the track's upstream subscriptions should have: 1 when a
        downstream subscription forwards (wire reference 10), else 0, and with no
        downstream subscription at all ``RelayConfig.idle_forward``."""
        if not track.pending and not track.served:
            return self.config.idle_forward
        return any(s.forward for s in track.pending) or any(s.forward for s in track.served)

    def _terminal(self, track: Track) -> tuple[int, str]:
        """The status a downstream subscription served without upstream ends with."""
        if track.terminal is not None:
            return track.terminal
        entry = track.entry
        if entry is not None and (entry.store.end_of_track is not None or track.ended):
            return PublishDoneCode.TRACK_ENDED, "track ended"
        return PublishDoneCode.INTERNAL_ERROR, "no upstream for this track"

    def _sync_namespaces(self, namespaces: Iterable[TrackNamespace]) -> None:
        """NAMESPACE / NAMESPACE_DONE so that every downstream SUBSCRIBE_NAMESPACE sees the
        namespaces that have a source (routing module docstring; d21 9.16, 9.17)."""
        for sub, ns, announce in self._router.sync(namespaces):
            session = sub.session
            rec = session.requests.get(sub.request_id)
            if session.is_closed or rec is None or rec.state is not RequestState.ESTABLISHED:
                continue
            suffix = ns.suffix_after(sub.prefix)
            if announce:
                session.send_namespace(sub.request_id, suffix, now=self._now)
            else:
                session.send_namespace_done(sub.request_id, suffix, now=self._now)

    # --- answering downstream --------------------------------------------------------------

    def _reject(
        self, peer: Peer, request_id: int, code: int, reason: str, retry_ms: int | None = None
    ) -> None:
        if self._pending(peer, request_id):
            error = as_request_error(code)
            self.refused[error.name] = self.refused.get(error.name, 0) + 1
            peer.session.reject_request(
                request_id,
                error,
                reason[:1024],
                now=self._now,
                retry_interval_ms=retry_ms,
            )

    def _over_rate(self, peer: Peer, request_id: int) -> bool:
        """Take one token of the peer's request bucket (``RelayConfig.request_rate``);
        without one, refuse the request with EXCESSIVE_LOAD and a Retry Interval."""
        rate = self.config.request_rate
        if rate <= 0:
            return False
        burst = float(self.config.request_burst)
        tokens = min(burst, peer.tokens + (self._now - peer.tokens_at) * rate)
        peer.tokens_at = self._now
        if tokens >= 1.0:
            peer.tokens = tokens - 1.0
            return False
        peer.tokens = tokens
        self.refused_for_rate += 1
        retry = max(1, int((1.0 - tokens) / rate * 1000.0) + 1)
        self._reject(peer, request_id, RequestErrorCode.EXCESSIVE_LOAD, "request rate", retry)
        return True

    def _end(self, sub: DownstreamSubscription, status: int, reason: str) -> None:
        """PUBLISH_DONE for a downstream subscription once its queues drained (the session
        drains them, d21 9.9). Nothing if the session ended it already (TOO_FAR_BEHIND)."""
        sub.peer.subscriptions.pop(sub.request_id, None)
        session = sub.peer.session
        if session.is_closed:
            return
        rec = session.requests.get(sub.request_id)
        if rec is None or rec.local_fin:
            return
        # our PUBLISH may end before its PUBLISH_OK (d21 9.8)
        if rec.state is RequestState.ESTABLISHED or (
            sub.published and rec.state is RequestState.PENDING
        ):
            session.end_subscription(sub.request_id, status, reason, now=self._now)

    # --- cut-through (relay module docstring) -------------------------------------------

    @staticmethod
    def _still_filling(track: Track) -> bool:
        """Objects answered for downstream are still on their way from upstream: a fill
        whose range is known and not yet finished, or a FETCH serving downstream or
        refilling."""
        if track.entry is None or track.malformed:
            return False
        if any(f.fill_open and f.delivering for f in track.feeds):
            return True
        return any(
            f.purpose in (FetchPurpose.SERVE, FetchPurpose.REFILL) for f in track.fetches
        )

    def _mark_filling(self, track: Track) -> None:
        """Mark the track's store filling (the downstream sessions keep fill and FETCH
        streams open for what still arrives); cleared by :meth:`_settle_filling`."""
        entry = track.entry
        if entry is not None and not track.malformed:
            entry.store.set_filling(True)
            self._filling[track] = None

    def _settle_filling(self) -> None:
        """After every input: stores no longer filling are settled (their following
        streams finish once drained)."""
        for track in [t for t in self._filling if not self._still_filling(t)]:
            del self._filling[track]
            if track.entry is not None:
                track.entry.store.set_filling(False)

    @staticmethod
    def _streaming_fill(track: Track) -> bool:
        """An upstream subscription is established and its fill's range is known (its
        SUBSCRIBE_OK or REQUEST_UPDATE_OK arrived): a downstream SUBSCRIBE can be answered
        now, its fill following the upstream one object by object."""
        return any(f.delivering and f.fill_open for f in track.feeds)

    def _track_live(self, track: Track) -> None:
        """Hook: an upstream subscription or PUBLISH of ``track`` was established."""

    def _serve_pending(self, track: Track) -> None:
        """Answer the downstream SUBSCRIBEs waiting on ``track`` (module docstring); a
        track left with nothing to do is forgotten."""
        self._serve_pending_now(track)
        self._forget_idle(track)

    def _serve_pending_now(self, track: Track) -> None:
        self._end_idle(track)
        if not track.pending:
            return
        if track.malformed:
            for sub in track.pending:
                sub.peer.subscriptions.pop(sub.request_id, None)
                self._reject(
                    sub.peer, sub.request_id, RequestErrorCode.MALFORMED_TRACK, "malformed"
                )
            track.pending.clear()
            return
        active = track.active
        entry = track.entry
        ready = True
        if active:
            if not any(f.delivering for f in track.feeds):
                return  # wait for SUBSCRIBE_OK (or the PUBLISH)
            # a forwarding SUBSCRIBE waits for the upstream fill's range to be known (then
            # its own fill follows the upstream's as objects arrive: cut-through), the
            # cache to be whole, or the fill timeout; one with Forward 0 gets no object and
            # no fill (wire ref. 6 item 4): it is answered at once, with the Largest
            # Object known now
            ready = track.whole or track.forced or self._streaming_fill(track)
        if entry is None:
            code, reason = track.last_error or (
                RequestErrorCode.DOES_NOT_EXIST,
                "no publisher for this track",
            )
            held: list[DownstreamSubscription] = []
            for sub in track.pending:
                if code == RequestErrorCode.DOES_NOT_EXIST and sub in self._rendezvous:
                    held.append(sub)  # RENDEZVOUS_TIMEOUT: wait for a publisher (5.7)
                    continue
                sub.peer.subscriptions.pop(sub.request_id, None)
                self._reject(sub.peer, sub.request_id, code, reason)
            track.pending[:] = held
            return
        for sub in list(track.pending):
            if not self._pending(sub.peer, sub.request_id, RequestKind.SUBSCRIBE):
                track.pending.remove(sub)
                sub.peer.subscriptions.pop(sub.request_id, None)
                continue
            if not ready and sub.forward:
                continue
            track.pending.remove(sub)
            sub.peer.session.accept_subscribe(sub.request_id, entry.store, now=self._now)
            self._cache.touch(entry)
            # the fill crosses evicted groups: FETCH them again; each restored object goes
            # to the fill on a late fill stream as it arrives (A27, MoqtSession.restoring),
            # so the cache never has to hold the whole range at once (cache docstring)
            groups = self._evicted_needed(entry, sub.params) if sub.forward else None
            track.served[sub] = None  # without upstream: ended when the re-fetch is over
            refetching = groups is not None and self._refetch(track, groups)
            if not (active or refetching):
                track.served.pop(sub, None)
                status, reason = self._terminal(track)
                self._end(sub, status, reason)

    def _end_idle(self, track: Track) -> None:
        """With no upstream feed left, subscriptions kept only for a re-fetch of evicted
        groups end once no re-fetch is in flight (with the track's terminal status)."""
        if not track.served or track.malformed or track.active or self._refetching(track):
            return
        status, reason = self._terminal(track)
        for sub in list(track.served):
            self._end(sub, status, reason)
        track.served.clear()

    @staticmethod
    def _fill_range(
        entry: CacheEntry, params: p.Parameters, lf: p.LocationFilter | None = None
    ) -> FetchRange | None:
        """The fill range FILL_PARAMETERS in ``params`` asks for now (d21 3.4, wire ref. 6):
        the inner LOCATION_FILTER, else ``lf`` (the subscription's, after the update that
        carries the fill), else the one in ``params``."""
        fill = params.get(p.FillParameters)
        if fill is None:
            return None
        sub_lf = lf if lf is not None else params.get(p.LocationFilter)
        return fetch_range(fill.params.get(p.LocationFilter) or sub_lf, entry.store.largest)

    def _evicted_needed(
        self, entry: CacheEntry, params: p.Parameters, lf: p.LocationFilter | None = None
    ) -> range | None:
        """The evicted groups the fill requested in ``params`` would cross."""
        if not entry.evicted:
            return None
        rng = self._fill_range(entry, params, lf)
        if rng is None:
            return None
        span = entry.evicted.span_within(rng.start.group, rng.end.group)  # O(intervals)
        return range(span[0], span[1] + 1) if span is not None else None

    def _refetch(self, track: Track, groups: range) -> bool:
        """Ask for evicted ``groups`` again for a served fill: the evicted ones among them
        join the track's wanted groups, which paced re-fetches bring (:meth:`_pace`,
        shared by every fill that lacks them); False: no route upstream."""
        entry = track.entry
        if entry is None or not self._routes(track.name.namespace, None):
            return False
        lo, hi = groups.start, groups.stop - 1
        while lo <= hi:  # O(evicted intervals): only the evicted runs are wanted
            run = entry.evicted.first_run(lo, hi)
            if run is None:
                break
            track.wanted.add_range(run[0], run[1])
            if run[1] >= hi:
                break
            lo = run[1] + 1
        if track.wanted:
            self._pacing[track] = None
            self._pace()
        return True

    def _refetching(self, track: Track) -> bool:
        """A re-fetch of ``track`` is in flight or still to be asked (paced)."""
        return bool(track.wanted) or any(f.purpose is FetchPurpose.REFETCH for f in track.fetches)

    def _pace(self) -> None:
        """Ask upstream for the next re-fetches that fit ``RelayConfig.max_transit_bytes``.

        What is in transit is the cache's :attr:`~Cache.transit_bytes` (restored objects
        the downstream sessions still queue) plus the estimated bytes of the re-fetches
        asked for and not arrived (``Feed.reserved``). Each track has at most one re-fetch
        in flight; it asks for the next run of wanted groups from ``Track.refetch_at``
        (wrapping around, so a late joiner's groups come in turn), as many groups as fit
        (each estimated at the track's largest group so far), at least one. With something in
        transit a re-fetch waits until it fits; with nothing, one group goes whatever its
        size. A wait is looked at again after every input and every
        ``RelayConfig.transit_poll`` (the sessions drain when the transport pulls)."""
        self._pace_at = None
        limit = self.config.max_transit_bytes
        waiting = False
        transit = self._cache.transit_bytes
        if transit < self._transit_seen:
            self._stalled_since = None  # something drained
        self._transit_seen = transit
        stall = self.config.transit_stall
        for track in list(self._pacing):
            entry = track.entry
            if (
                entry is None
                or track.malformed
                or not track.served
                or self._tracks.get(track.name) is not track
            ):
                track.wanted = GroupSet()  # nobody left to restore to
            if not track.wanted:
                self._pacing.pop(track, None)
                self._end_idle(track)
                continue
            if any(f.purpose is FetchPurpose.REFETCH for f in track.fetches):
                continue  # one at a time per track: the next follows when it ends
            assert entry is not None
            held = self._cache.transit_bytes + self._reserved()
            avg = max(1, entry.largest_group)
            room = limit - held
            if held > 0 and room < avg:
                since = self._stalled_since
                if since is None or self._now < since + stall:
                    if since is None:
                        self._stalled_since = self._now
                    waiting = True
                    continue
                # nothing drained for transit_stall: a subscriber that stopped reading
                # holds the restores; one more group, so it holds back nobody else
                self._stalled_since = self._now
            else:
                self._stalled_since = None
            groups = self._next_wanted(track, entry, max(1, room // avg))
            if groups is None:
                track.wanted = GroupSet()
                self._pacing.pop(track, None)
                self._end_idle(track)
                continue
            if not self._fetch_groups(track, groups, avg * len(groups)):
                track.wanted = GroupSet()  # no route left: the served fills end
                self._pacing.pop(track, None)
                self._end_idle(track)
        if waiting:
            self._pace_at = self._now + self.config.transit_poll

    @staticmethod
    def _next_wanted(track: Track, entry: CacheEntry, most: int) -> range | None:
        """The next run of wanted groups still evicted (at most ``most`` of them), taken
        out of ``Track.wanted``; ``None`` when none is left. O(intervals log intervals)."""
        wanted = track.wanted
        for start in (track.refetch_at, 0):
            for a, b in wanted.intervals():
                if b < start:
                    continue
                a = max(a, start)
                run = entry.evicted.first_run(a, b)
                if run is None:
                    wanted.discard_range(a, b)  # cached again meanwhile
                    continue
                lo, hi = run[0], min(run[1], run[0] + most - 1)
                wanted.discard_range(a, hi)
                track.refetch_at = hi + 1 if hi < MAX_VI64 else 0
                return range(lo, hi + 1)
        return None

    def _fetch_groups(self, track: Track, groups: range, estimate: int) -> bool:
        """One upstream FETCH of evicted ``groups`` (a paced re-fetch); False: no route."""
        routes = self._routes(track.name.namespace, None)
        if not routes:
            return False
        peer = routes[0]
        try:
            rid = peer.session.fetch(
                track.name,
                now=self._now,
                location_filter=p.LocationFilter.absolute_group_end(
                    groups.start, 0, groups.stop - 1
                ),
                priority=self.config.upstream_priority,
            )
        except LocalProtocolError:
            return False
        feed = Feed(
            peer,
            rid,
            track,
            FeedKind.FETCH,
            purpose=FetchPurpose.REFETCH,
            groups=groups,
            span_from=Location(groups.start, 0),
            reserved=estimate,
        )
        self._refetches[feed] = None
        peer.feeds[rid] = feed
        track.fetches.append(feed)
        if track.entry is not None:
            self._cache.refetching(track.entry, groups)
        return True

    def _reserved(self) -> int:
        """Estimated bytes of the paced re-fetches in flight not arrived yet (ended ones,
        whatever ended them, are forgotten here)."""
        total = 0
        for feed in list(self._refetches):
            if feed.state is FeedState.DONE or feed not in feed.track.fetches:
                del self._refetches[feed]
            else:
                total += feed.reserved
        return total

    def _refetch_arrived(self, feed: Feed, nbytes: int) -> None:
        """Bytes of a paced re-fetch arrived (now counted in transit, or cached)."""
        self._refetched_bytes += nbytes
        feed.reserved = max(0, feed.reserved - nbytes)

    # --- the cache feed ------------------------------------------------------------------

    def _append(self, track: Track, entry: CacheEntry, e: ObjectReceived) -> None:
        """One upstream object into the cache (a duplicate is a no-op)."""
        try:
            obj = self._cache.append(entry, e)
        except (MalformedTrack, ValueError) as exc:
            self._malformed(track, str(exc))
            return
        if self._cache.total_bytes > self._cache.budget:
            self._cache.evict(self._tier, keep=obj)

    def _restore(self, track: Track, entry: CacheEntry, e: ObjectReceived) -> None:
        """An object of an evicted group fetched again (a fill or a FETCH): the downstream
        sessions treat it as a restore, not a new object (``MoqtSession.restoring``), so
        live subscribers that had it do not get it twice; fills that missed it do."""
        sessions = {id(sub.peer.session): sub.peer.session for sub in track.served}
        for session in sessions.values():
            session.restoring(entry.store)
        try:
            self._append(track, entry, e)
        finally:
            for session in sessions.values():
                session.restoring(None)

    def _tier(self, entry: CacheEntry) -> tuple[int | None, int | None, Spans]:
        """Eviction tier of a track, its protected group and the group spans its upstream
        FETCHes bring for waiting requests (cache module docstring)."""
        track = self._tracks.get(entry.store.name)
        if track is None:
            return 0, None, ()
        spans: list[tuple[int, int]] = []
        for f in track.fetches:
            if f.purpose is FetchPurpose.REFETCH:
                continue  # restores stream to the fills that wait (late fill): not kept for them
            if f.span_from is not None:
                end = f.end_location.group if f.end_location is not None else MAX_VI64
                spans.append((f.span_from.group, end))
            else:
                spans.append((0, MAX_VI64))
        if spans:
            # a FETCH answered from the store once complete, or a refill making the cache
            # whole, needs what arrives kept: evicted only as a last resort
            return None, None, tuple(spans)
        if track.live:
            largest = entry.store.largest
            return 2, largest.group if largest is not None else None, ()
        return (1 if track.served else 0), None, ()

    def _malformed(self, track: Track, reason: str) -> None:
        """d21 12.1 / wire reference 7.10: end everything downstream with MALFORMED_TRACK,
        cancel the upstream requests, cache nothing of the track."""
        track.malformed = True
        for sub in list(track.served):
            self._end(sub, PublishDoneCode.MALFORMED_TRACK, "malformed track")
        track.served.clear()
        self._serve_pending(track)  # refuses the waiting ones
        for feed in [*track.feeds, *track.fetches]:
            feed.state = FeedState.DONE
            feed.peer.feeds.pop(feed.request_id, None)
            self._timed.pop(feed, None)
            session = feed.peer.session
            if not session.is_closed:
                with contextlib.suppress(LocalProtocolError):  # finished and forgotten
                    session.cancel(feed.request_id, now=self._now)
            for w in feed.waiters:
                w.peer.fetches.pop(w.request_id, None)
                self._reject(w.peer, w.request_id, RequestErrorCode.MALFORMED_TRACK, reason)
        track.feeds.clear()
        track.fetches.clear()
        track.early.clear()
        self._timed.pop(track, None)
        if track.entry is not None:
            self._cache.drop(track.name)
            track.entry = None
