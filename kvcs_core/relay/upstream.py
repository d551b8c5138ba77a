"""The relay's upstream half: subscribing once per track, feeding the cache, endings.

Theory of operation
-------------------
**Aggregation** (d21 section 7.2, wire reference 10): however many downstream
subscribers a track has, the relay sends one SUBSCRIBE per upstream route
(every publisher whose namespace matches, else the default upstream), with
``LOCATION_FILTER NEXT_OBJECT`` + ``FILL_PARAMETERS{LOCATION_FILTER
ABSOLUTE_START {0,0}}``: the exactly-once recipe of wire reference 6, so the
cache receives the whole track, the part before the subscription on the fill
stream and the rest live, each object once. When the relay subscribes again to
a track it already holds whole (after the upstream left), the fill starts right
after the cached Largest Object instead of {0,0}. Forward is always 1 upstream
(wire reference 10: "any downstream Forward 1 => upstream Forward 1"); the
downstream's delivery timeouts and filters are never forwarded, the
downstream sessions apply them to the cache.

**Feeding the cache**: every upstream ``ObjectReceived`` (subscription,
fill or fetch delivered; status objects too) is appended to the track's store
as received, payload view and all (:mod:`kvcs_core.relay.cache`). Objects that
arrive before the store exists (a fill stream may overtake SUBSCRIBE_OK, wire
reference 6 item 8; a relay's FETCH objects may precede FETCH_OK) wait in the
track and are appended when it is made from the Track Properties of the
answer. If the upstream fill is reset instead of finished (d21 3.4: the
publisher could not serve it), the same range is FETCHed.

**Endings** (d21 section 9.9, wire reference 4.5): an upstream PUBLISH_DONE
moves the subscription to ENDING until the data streams it counts have ended
(or ``publish_done_grace`` passed); then, if no other upstream feeds the
track, every downstream subscription ends with the *same* status once its
queue drained. When an upstream session is lost the relay first tries another
route (failover, downstream subscriptions stay up); without one, the
downstream subscriptions end with TRACK_ENDED if End of Track had arrived, else
INTERNAL_ERROR (0x0): the track did not end, the relay lost its source. The
cache is kept: later subscribers and FETCHes are served from it.

**FETCH**: a downstream FETCH whose range is fully cached (the cache is whole
up to Largest Object, no evicted group in the range, and Largest Object is
current: a live upstream subscription or an ended track) is served from the
store at once. Otherwise the relay FETCHes the same range upstream once (equal
downstream FETCHes share it), caches what arrives, and answers with
``accept_fetch`` from the store when the upstream FETCH completed (FETCH_OK and
the stream's FIN) - the simple correct form of d21 section 7.4: FETCH_OK only
once End Location is known. An upstream failure is passed on as the same
REQUEST_ERROR, unless the cache holds objects of the range (then they are
served).
"""

from __future__ import annotations

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.track_store import BeyondEnd, MalformedTrack
from kvcs_core.moqt.windows import fetch_range
from kvcs_core.relay.cache import store_for
from kvcs_core.relay.core import RelayCore, next_after
from kvcs_core.relay.routing import Source, SourceKind, UpstreamNamespaceSubscription
from kvcs_core.relay.tracks import (
    DownstreamFetch,
    Feed,
    FeedKind,
    FeedState,
    FetchPurpose,
    Peer,
    Track,
)
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import PublishDoneCode, RequestErrorCode
from kvcs_core.wire.kvp import KeyValuePairs
from kvcs_core.wire.names import Location


class Upstream(RelayCore):
    """Mixin: requests the relay makes upstream and what comes back."""

    # --- subscribing -------------------------------------------------------------------

    def _subscribe_upstream(self, track: Track, exclude: Peer | None) -> int:
        """SUBSCRIBE on every route not already feeding ``track``; how many were sent."""
        have = {id(f.peer) for f in track.feeds if f.active}
        fill_from = Location(0, 0)
        entry = track.entry
        if entry is not None and track.whole and entry.store.largest is not None:
            fill_from = next_after(entry.store.largest)
        sent = 0
        for peer in self._routes(track.name.namespace, exclude):
            if id(peer) in have:
                continue
            rid = peer.session.subscribe(
                track.name,
                now=self._now,
                location_filter=p.LocationFilter.next_object(),
                fill=p.Parameters.of(
                    p.LocationFilter.absolute_start(fill_from.group, fill_from.object)
                ),
                priority=self.config.upstream_priority,
            )
            feed = Feed(peer, rid, track, FeedKind.SUBSCRIBE, fill_from=fill_from)
            track.forced = False
            peer.feeds[rid] = feed
            track.feeds.append(feed)
            sent += 1
        return sent

    def _make_store(self, track: Track, properties: KeyValuePairs) -> bool:
        """The track's cache entry from upstream Track Properties; early objects go in."""
        if track.entry is not None:
            return True
        try:
            store = store_for(track.name, properties)
        except ValueError as exc:
            self._malformed(track, f"bad track properties: {exc}")
            return False
        entry = track.entry = self._cache.add(store)
        early, track.early = track.early, []
        for e in early:
            self._append(track, entry, e)
            if track.malformed:
                return False
        return True

    def _on_subscribe_accepted(self, peer: Peer, e: ev.SubscribeAccepted) -> None:
        feed = peer.feeds.get(e.request_id)
        if feed is None or feed.kind is not FeedKind.SUBSCRIBE:
            return
        feed.state = FeedState.LIVE
        track = feed.track
        if not self._make_store(track, e.track_properties):
            return
        start = feed.fill_from
        if start is not None and e.largest is not None and e.largest >= start:
            feed.fill_open = True
            feed.fill_end = e.largest
            if feed.fill_ended:
                self._fill_finished(feed)
            else:
                track.fill_deadline = self._now + self.config.fill_timeout
                self._timed[track] = None
        else:
            feed.whole = True  # wire reference 6 item 2: nothing before us, no fill stream
        self._serve_pending(track)

    def _fill_finished(self, feed: Feed) -> None:
        feed.fill_open = False
        if feed.fill_reset is None:
            self._feed_whole(feed)
            return
        # d21 3.4: a reset fill means the publisher could not serve it: FETCH the range
        start, end = feed.fill_from, feed.fill_end
        assert start is not None and end is not None
        self._refill(feed, start, end)

    def _refill(self, feed: Feed, start: Location, end: Location) -> None:
        peer, track = feed.peer, feed.track
        if not peer.usable:
            self._feed_whole(feed)
            return
        rid = peer.session.fetch(
            track.name,
            now=self._now,
            location_filter=p.LocationFilter.absolute_range(
                start.group, start.object, end.group, end.object
            ),
            priority=self.config.upstream_priority,
        )
        fetch = Feed(peer, rid, track, FeedKind.FETCH, purpose=FetchPurpose.REFILL, refill_of=feed)
        peer.feeds[rid] = fetch
        track.fetches.append(fetch)

    def _feed_whole(self, feed: Feed) -> None:
        feed.whole = True
        track = feed.track
        track.forced = False
        if track.fill_deadline is not None and not any(f.fill_open for f in track.feeds):
            track.fill_deadline = None
            self._timed.pop(track, None)
        self._serve_pending(track)

    def _on_publish_requested(self, peer: Peer, e: ev.PublishRequested) -> None:
        """A publisher PUBLISHes a track to us (d21 9.8): accept it as a feed."""
        orphans = peer.orphans.pop(e.request_id, [])
        if not self._pending(peer, e.request_id, ev.RequestKind.PUBLISH):
            return
        track = self._track_for(e.track)
        if track is None:
            self._reject(peer, e.request_id, RequestErrorCode.EXCESSIVE_LOAD, "too many tracks")
            return
        peer.session.accept_publish(e.request_id, now=self._now)
        was_whole = track.whole
        feed = Feed(peer, e.request_id, track, FeedKind.PUBLISH, state=FeedState.LIVE)
        peer.feeds[e.request_id] = feed
        track.feeds.append(feed)
        if not self._make_store(track, e.track_properties):
            return
        entry = track.entry
        assert entry is not None
        for obj in orphans:
            self._append(track, entry, obj)
        largest = e.params.get(p.LargestObject)
        cached = entry.store.largest
        if largest is None or (was_whole and cached is not None and cached >= largest.location):
            self._feed_whole(feed)
        else:
            start = next_after(cached) if was_whole and cached is not None else Location(0, 0)
            if start <= largest.location:
                self._refill(feed, start, largest.location)
            else:
                self._feed_whole(feed)

    # --- objects and streams -------------------------------------------------------------

    def _on_object(self, peer: Peer, e: ev.ObjectReceived) -> None:
        feed = peer.feeds.get(e.request_id)
        if feed is None:
            rec = peer.session.requests.get(e.request_id)
            if rec is not None and not rec.mine and rec.kind is ev.RequestKind.PUBLISH:
                peer.orphans.setdefault(e.request_id, []).append(e)  # before PublishRequested
            return
        track = feed.track
        entry = track.entry
        if entry is None:
            track.early.append(e)
            return
        cache = self._cache
        try:
            cache.append(entry, e)
        except (MalformedTrack, ValueError) as exc:
            self._malformed(track, str(exc))
            return
        if cache.total_bytes > cache.budget:
            cache.evict(self._tier)

    def _on_stream_ended(self, peer: Peer, e: ev.DataStreamEnded) -> None:
        feed = peer.feeds.get(e.request_id)
        if feed is None:
            return
        if feed.kind is FeedKind.FETCH:
            if e.delivery is ev.Delivery.FETCH:
                feed.stream_done = True
                feed.reset_code = e.reset_code
                self._check_fetch(feed)
            return
        feed.streams_ended += 1
        if (
            e.delivery is ev.Delivery.FILL
            and feed.kind is FeedKind.SUBSCRIBE
            and e.via_request_id == feed.request_id
        ):
            feed.fill_ended = True
            feed.fill_reset = e.reset_code
            if feed.fill_open:
                self._fill_finished(feed)
        self._maybe_finalize(feed)

    # --- endings ---------------------------------------------------------------------------

    def _on_publish_done(self, peer: Peer, e: ev.PublishDoneReceived) -> None:
        feed = peer.feeds.get(e.request_id)
        if feed is None or feed.kind is FeedKind.FETCH:
            return
        feed.state = FeedState.ENDING
        feed.done_streams = e.stream_count
        feed.done_status = e.status
        feed.done_reason = e.reason
        feed.deadline = self._now + self.config.publish_done_grace
        self._timed[feed] = None
        self._maybe_finalize(feed)

    def _maybe_finalize(self, feed: Feed) -> None:
        if (
            feed.state is FeedState.ENDING
            and feed.done_streams is not None
            and feed.streams_ended >= feed.done_streams
        ):
            self._finalize(feed, lost=False)

    def _finalize(self, feed: Feed, *, lost: bool) -> None:
        """An upstream subscription or PUBLISH is over (PUBLISH_DONE, loss, cancel)."""
        was_delivering = feed.delivering
        feed.state = FeedState.DONE
        self._timed.pop(feed, None)
        feed.peer.feeds.pop(feed.request_id, None)
        track = feed.track
        if feed in track.feeds:
            track.feeds.remove(feed)
        if was_delivering and feed.whole:
            track.contiguous = True  # objects lost in flight lie beyond Largest Object
        if track.active or track.malformed:
            return
        if track.fill_deadline is not None:
            track.fill_deadline = None
            self._timed.pop(track, None)
        if lost:
            entry = track.entry
            if entry is not None and entry.store.end_of_track is not None:
                status, reason = int(PublishDoneCode.TRACK_ENDED), "track ended"
            else:
                status, reason = int(PublishDoneCode.INTERNAL_ERROR), "upstream lost"
        else:
            status, reason = feed.done_status, feed.done_reason
        failover = lost or status == PublishDoneCode.GOING_AWAY
        self._upstream_gone(track, status, reason, failover=failover)

    def _upstream_gone(self, track: Track, status: int, reason: str, *, failover: bool) -> None:
        if (
            failover
            and (track.served or track.pending)
            and not track.complete
            and self._subscribe_upstream(track, None)
        ):
            return  # another route: the downstream subscriptions stay up
        track.terminal = (status, reason)
        for sub in list(track.served):
            self._end(sub, status, reason)
        track.served.clear()
        self._serve_pending(track)

    def _on_request_failed(self, peer: Peer, e: ev.RequestFailed) -> None:
        if e.update_id is not None:
            return
        feed = peer.feeds.get(e.request_id)
        if feed is not None:
            if feed.kind is FeedKind.FETCH:
                self._fetch_done(feed, ok=False, code=e.code, reason=e.reason)
                return
            track = feed.track
            if feed.state is not FeedState.PENDING:
                self._finalize(feed, lost=True)  # our request stream was reset
                return
            track.last_error = (e.code, e.reason)
            feed.state = FeedState.DONE
            peer.feeds.pop(e.request_id, None)
            track.feeds.remove(feed)
            if not track.active:
                if track.served:  # a failover SUBSCRIBE was refused
                    self._upstream_gone(
                        track, PublishDoneCode.INTERNAL_ERROR, e.reason, failover=False
                    )
                else:
                    self._serve_pending(track)
            return
        query = peer.statuses.pop(e.request_id, None)
        if query is not None:
            entry = query.track.entry
            for down, rid in query.waiters:
                if entry is not None and self._pending(down, rid):
                    down.session.accept_track_status(rid, entry.store, now=self._now)
                else:
                    self._reject(down, rid, e.code, e.reason)
            return
        up = self._router.remove_upstream(peer.session, e.request_id)
        if up is not None and e.code == RequestErrorCode.PREFIX_OVERLAP and not up.retried:
            # the cancel of a narrower prefix had not arrived yet (routing docstring)
            rid = peer.session.subscribe_namespace(up.prefix, now=self._now)
            self._router.add_upstream(
                UpstreamNamespaceSubscription(peer.session, rid, up.prefix, retried=True)
            )
            self._router.reattribute(peer.session, e.request_id, rid)

    # --- fetches ---------------------------------------------------------------------------

    def _on_fetch_accepted(self, peer: Peer, e: ev.FetchAccepted) -> None:
        feed = peer.feeds.get(e.request_id)
        if feed is None or feed.kind is not FeedKind.FETCH:
            return
        feed.accepted = True
        if not self._make_store(feed.track, e.track_properties):
            return
        self._check_fetch(feed)

    def _check_fetch(self, feed: Feed) -> None:
        if feed.accepted and feed.stream_done:
            ok = feed.reset_code is None
            self._fetch_done(
                feed, ok=ok, code=RequestErrorCode.INTERNAL_ERROR, reason="upstream fetch reset"
            )

    def _fetch_done(self, feed: Feed, *, ok: bool, code: int, reason: str) -> None:
        feed.state = FeedState.DONE
        feed.peer.feeds.pop(feed.request_id, None)
        track = feed.track
        if feed in track.fetches:
            track.fetches.remove(feed)
        if feed.purpose is FetchPurpose.SERVE:
            for w in feed.waiters:
                w.peer.fetches.pop(w.request_id, None)
                if track.entry is not None and (ok or self._has_objects(w)):
                    self._accept_fetch(w)
                else:
                    self._reject(w.peer, w.request_id, code, reason)
        elif feed.purpose is FetchPurpose.REFILL:
            sub = feed.refill_of
            if sub is not None and sub.delivering:
                self._feed_whole(sub)  # on failure too: what could be had is cached
        elif feed.purpose is FetchPurpose.REFETCH:
            entry = track.entry
            if entry is not None and feed.groups is not None:
                self._cache.unevict(entry, feed.groups)
            self._serve_pending(track)

    def _has_objects(self, fetch: DownstreamFetch) -> bool:
        entry = fetch.track.entry
        if entry is None:
            return False
        rng = fetch_range(fetch.params.get(p.LocationFilter), entry.store.largest)
        if rng is None:
            return False
        return next(iter(entry.store.objects_in(rng.start, rng.end)), None) is not None

    def _accept_fetch(self, fetch: DownstreamFetch) -> None:
        entry = fetch.track.entry
        if entry is None or not self._pending(fetch.peer, fetch.request_id, ev.RequestKind.FETCH):
            return
        fetch.peer.session.accept_fetch(fetch.request_id, entry.store, now=self._now)
        self._served_from(fetch.track, reads=True)

    # --- namespaces and status ------------------------------------------------------------

    def _on_namespace(self, peer: Peer, e: ev.NamespaceAnnounced | ev.NamespaceWithdrawn) -> None:
        if self._router.upstream(peer.session, e.request_id) is None:
            return
        source = Source(peer.session, SourceKind.NAMESPACE, e.request_id)
        if isinstance(e, ev.NamespaceAnnounced):
            self._router.add_source(e.namespace, source)
        else:
            self._router.remove_source(e.namespace, source)
        self._sync_namespaces([e.namespace])

    def _on_request_accepted(self, peer: Peer, e: ev.RequestAccepted) -> None:
        if e.update_id is not None or e.kind is not ev.RequestKind.TRACK_STATUS:
            return
        query = peer.statuses.pop(e.request_id, None)
        if query is None:
            return
        track = query.track
        largest_param = e.params.get(p.LargestObject)
        largest = largest_param.location if largest_param is not None else None
        entry = track.entry
        cached = entry.store.largest if entry is not None else None
        if cached is not None and (largest is None or cached > largest):
            largest = cached  # d21 7.2: max(upstream-reported, largest received)
        try:
            answer = store_for(track.name, e.track_properties)
            if largest is not None:
                answer.observe_largest(largest)
        except (ValueError, BeyondEnd) as exc:
            for down, rid in query.waiters:
                self._reject(down, rid, RequestErrorCode.INTERNAL_ERROR, str(exc))
            return
        for down, rid in query.waiters:
            if self._pending(down, rid, ev.RequestKind.TRACK_STATUS):
                down.session.accept_track_status(rid, answer, now=self._now)

    # --- timers ---------------------------------------------------------------------------

    def _fire(self, now: float) -> None:
        for item in list(self._timed):
            if isinstance(item, Feed):
                if item.deadline is not None and item.deadline <= now:
                    self._finalize(item, lost=False)
            elif item.fill_deadline is not None and item.fill_deadline <= now:
                item.fill_deadline = None
                self._timed.pop(item, None)
                item.forced = True  # accept the waiting SUBSCRIBEs without the fill
                self._serve_pending(item)

    def _deadline(self) -> float | None:
        best: float | None = None
        for item in self._timed:
            at = item.deadline if isinstance(item, Feed) else item.fill_deadline
            if at is not None and (best is None or at < best):
                best = at
        return best
