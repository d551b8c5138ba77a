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
after the cached Largest Object instead of {0,0}. The downstream's priorities,
delivery timeouts and filters are never forwarded (wire reference 9.1, 5.7, 10):
the downstream sessions apply them to the cache.

**Forward State and REQUEST_UPDATE propagation** (wire reference 10, 4.5,
5.9): the upstream subscription (SUBSCRIBE or accepted PUBLISH) forwards
exactly when at least one downstream subscription of the track forwards ("any
downstream Forward 1 => upstream Forward 1"; otherwise the relay chooses, and
this one saves the upstream bytes). With no downstream subscription at all it
follows ``RelayConfig.idle_forward`` (default: keep the cache warm). Changes
go upstream as REQUEST_UPDATE: ``{FORWARD=0}`` pauses (the cache is no longer
*whole*: objects produced meanwhile are missing); ``{FORWARD=1,
FILL_PARAMETERS{ABSOLUTE_START}}`` resumes, with a fill from the first object
of the group that held the cache's Largest Object when it was last whole
(objects of that group may still have been in flight: duplicates are no-ops in
the cache), and no LOCATION_FILTER, so the live window stays where it was and
no object produced later can fall between the fill and the live part (A16:
FORWARD is applied before FILL_PARAMETERS). The fill is named by the update's
Request ID; the REQUEST_UPDATE_OK's LARGEST_OBJECT fixes its end, exactly as
SUBSCRIBE_OK's does for the first fill. A downstream SUBSCRIBE with Forward 1
waits until the cache is whole again; one with Forward 0 is answered at once
(it gets no object and no fill, wire reference 6 item 4) with LARGEST_OBJECT =
max(upstream-reported, received) (wire reference 5.8; the store observes the
upstream's value). A downstream REQUEST_UPDATE is answered by its own session
from the cache (FORWARD first, then FILL_PARAMETERS, A16); the relay then
propagates what it needs: the Forward State above; a fill crossing evicted
groups FETCHes them upstream, paced (:meth:`RelayCore._pace`; the session
delivers them on a late fill stream as they arrive, A27); NEW_GROUP_REQUEST
goes upstream in an RU when it is 0 or above Largest Group, the track has
DYNAMIC_GROUPS, and no request >= it is outstanding (until Largest Group grows;
wire reference 5.8); copied into the upstream SUBSCRIBE when there is none yet.

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

**Complete tracks**: a track whose cache is whole, with nothing evicted, and
whose end is known is *complete*: late SUBSCRIBEs (fill from the store, then
PUBLISH_DONE TRACK_ENDED) and FETCHes are answered from the cache alone. The
end is known from the cached End of Track object, or from the upstream's word
(``Track.ended``): a PUBLISH_DONE TRACK_ENDED whose counted streams all
arrived, or a FETCH from {0,0} answered with End Of Track whose range arrived
whole (no End of Unknown / Timed-Out Range marker; it also makes the cache
whole). The word is needed because status objects travel only on subgroup
streams (wire reference 7.5, 7.8): a track the relay subscribed after it
ended (everything came on the fill) or only FETCHed never caches its End of
Track object. An upstream whose feed stops without TRACK_ENDED (lost, another
status, the grace timer) leaves the track incomplete; a new SUBSCRIBE or
PUBLISH feeding the track forgets the word. A whole feed of a track whose End
of Track is cached is not paused (FORWARD=0) when its downstream leaves:
nothing is left to save, and the pause would leave the cache not whole.

**FETCH**: a downstream FETCH whose range is fully cached (the cache is whole
up to Largest Object, no evicted group in the range, and Largest Object is
current: a live upstream subscription or an ended track) is served from the
store at once. Otherwise the relay FETCHes the same range upstream once (equal
downstream FETCHes share it) and caches what arrives. **Cut-through**: when the
upstream FETCH_OK arrives (End Location known, d21 section 7.4) and the cache
holds nothing of the range yet, every waiting downstream FETCH is answered with
that End Location and End Of Track, and its stream follows the store, sending
each object as it arrives (the store is marked *filling*; objects of the upstream
FETCH that overtook its FETCH_OK on their own stream count as already delivered
by it, so they do not turn cut-through off); a FETCH of the same
range arriving later joins where the upstream one has got to (its snapshot is
what arrived so far, in order). When the upstream FETCH ends, their streams FIN
once drained, or are reset if it failed (INTERNAL_ERROR: never ended short as
if complete). Otherwise (part of the range cached, descending order) the relay
answers with ``accept_fetch`` from the store when the upstream FETCH completed
(FETCH_OK and the stream's FIN). An upstream failure before any answer is
passed on as the same REQUEST_ERROR, unless the cache holds objects of the
range (then they are served).
"""

from __future__ import annotations

import contextlib

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.requests import RequestState
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
from kvcs_core.wire.codes import (
    EndOfRange,
    GroupOrder,
    ObjectStatus,
    PropertyType,
    PublishDoneCode,
    RequestErrorCode,
)
from kvcs_core.wire.kvp import KeyValuePairs, find_kvp
from kvcs_core.wire.names import Location


class Upstream(RelayCore):
    """Mixin: requests the relay makes upstream and what comes back."""

    # --- subscribing -------------------------------------------------------------------

    def _subscribe_upstream(self, track: Track, exclude: Peer | None) -> int:
        """SUBSCRIBE on every route not already feeding ``track``; how many were sent."""
        have = {id(f.peer) for f in track.feeds if f.active}
        fill_from: Location | None = Location(0, 0)
        entry = track.entry
        if entry is not None and track.whole and entry.store.largest is not None:
            fill_from = next_after(entry.store.largest)  # None: nothing can follow it
        forward = self._want_forward(track)
        extra: list[p.Parameter] = []
        ngr = [v.value for s in track.pending if (v := s.params.get(p.NewGroupRequest)) is not None]
        if ngr:  # wire reference 5.8: copied into the upstream SUBSCRIBE
            extra.append(p.NewGroupRequest(0 if 0 in ngr else max(ngr)))
        fill = (
            None
            if fill_from is None
            else p.Parameters.of(p.LocationFilter.absolute_start(fill_from.group, fill_from.object))
        )
        sent = 0
        for peer in self._routes(track.name.namespace, exclude):
            if id(peer) in have:
                continue
            rid = peer.session.subscribe(
                track.name,
                now=self._now,
                location_filter=p.LocationFilter.next_object(),
                fill=fill if forward and fill is not None else None,
                forward=forward,
                priority=self.config.upstream_priority,
                extra=extra,
            )
            feed = Feed(
                peer,
                rid,
                track,
                FeedKind.SUBSCRIBE,
                forward=forward,
                fill_id=rid if forward and fill is not None else None,
                fill_from=fill_from if forward and fill is not None else None,
            )
            track.forced = False
            track.ended = False  # the new feed says how the track ends now
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
        if feed.forward:
            self._fill_answered(feed, e.largest)
        elif e.largest is not None and not self._observe(track, e.largest):
            return
        self._serve_pending(track)
        self._sync_forward(track)
        if not track.malformed:
            self._track_live(track)

    def _fill_answered(self, feed: Feed, largest: Location | None) -> None:
        """SUBSCRIBE_OK or REQUEST_UPDATE_OK for the request that asked for ``feed``'s fill:
        its LARGEST_OBJECT fixes the fill's end (wire reference 6 items 2 and 8)."""
        feed.fill_answered = True
        track = feed.track
        start = feed.fill_from
        if start is not None and largest is not None and largest >= start:
            feed.fill_open = True
            feed.fill_end = largest
            if feed.fill_ended:
                self._fill_finished(feed)
            else:
                track.fill_deadline = self._now + self.config.fill_timeout
                self._timed[track] = None
                # cut-through: the store's Largest Object is the upstream's now, so a
                # downstream SUBSCRIBE answered before the fill arrives gets its live part
                # after it and the rest on its fill as it arrives (wire reference 6, A27)
                if self._observe(track, largest):
                    self._mark_filling(track)
        else:
            self._feed_whole(feed)  # wire reference 6 item 2: nothing before, no fill stream

    def _observe(self, track: Track, largest: Location) -> bool:
        """The upstream reports ``largest`` while we do not forward: the store's Largest
        Object becomes max(upstream-reported, received) (wire reference 5.8)."""
        entry = track.entry
        if entry is None:
            return True
        try:
            entry.store.observe_largest(largest)
        except BeyondEnd as exc:
            self._malformed(track, str(exc))
            return False
        return True

    # --- Forward State and updates (module docstring) ---------------------------------

    def _sync_forward(self, track: Track) -> None:
        """Pause or resume the track's upstream subscriptions to match the downstream."""
        if track.malformed:
            return
        want = self._want_forward(track)
        entry = track.entry
        over = entry is not None and entry.store.end_of_track is not None
        for feed in list(track.feeds):
            if feed.state is FeedState.LIVE and feed.forward != want and feed.peer.usable:
                if not want and over and feed.whole:
                    continue  # whole through End of Track: a pause saves nothing, and would
                    # leave the cache looking not whole when the feed ends (not complete)
                self._set_forward(feed, want)

    def _resume_from(self, track: Track) -> Location:
        """Where a resumed upstream fill starts (module docstring)."""
        entry = track.entry
        largest = entry.store.largest if entry is not None else None
        if largest is not None and any(f.delivering and f.whole for f in track.feeds):
            return Location(largest.group, 0)
        if track.whole_to is not None:
            return Location(track.whole_to.group, 0)
        return Location(0, 0)

    def _set_forward(self, feed: Feed, on: bool) -> None:
        track = feed.track
        entry = track.entry
        if on:
            start = self._resume_from(track)
            params = p.Parameters.of(
                p.Forward(1),
                p.FillParameters(
                    p.Parameters.of(p.LocationFilter.absolute_start(start.group, start.object))
                ),
            )
        else:
            params = p.Parameters.of(p.Forward(0))
        try:
            uid = feed.peer.session.request_update(feed.request_id, params, now=self._now)
        except LocalProtocolError:
            return  # too many updates outstanding: retried when one is answered
        feed.updates += 1
        if feed.whole and entry is not None and entry.store.largest is not None:
            track.whole_to = entry.store.largest  # what the cache holds whole now
        feed.whole = False
        feed.forward = on
        feed.fill_open = feed.fill_ended = feed.fill_answered = False
        feed.fill_reset = None
        feed.fill_end = None
        if on:
            feed.fill_id, feed.fill_from = uid, start
            # the downstream SUBSCRIBEs this resume makes wait are answered by then at the
            # latest, whatever the upstream does (RelayConfig.fill_timeout)
            track.fill_deadline = self._now + self.config.fill_timeout
            self._timed[track] = None
        else:
            feed.fill_id = feed.fill_from = None
            if not any(f.fill_open for f in track.feeds) and track.fill_deadline is not None:
                track.fill_deadline = None
                self._timed.pop(track, None)

    def _on_update_answered(self, peer: Peer, e: ev.RequestAccepted | ev.RequestFailed) -> None:
        """The answer to one of our REQUEST_UPDATEs on an upstream subscription. A refused
        one ends the subscription upstream (PUBLISH_DONE UPDATE_FAILED, d21 9.5.1)."""
        feed = peer.feeds.get(e.request_id)
        if feed is None or feed.kind is FeedKind.FETCH:
            return
        feed.updates = max(0, feed.updates - 1)
        if isinstance(e, ev.RequestAccepted):
            lp = e.params.get(p.LargestObject)
            largest = lp.location if lp is not None else None
            if e.update_id == feed.fill_id and not feed.fill_answered:
                self._fill_answered(feed, largest)
            elif (
                not feed.forward and largest is not None and not self._observe(feed.track, largest)
            ):
                return
        self._sync_forward(feed.track)

    def _new_group_request(self, track: Track, value: int) -> None:
        """NEW_GROUP_REQUEST from downstream, to the live upstream (wire reference 5.8)."""
        entry = track.entry
        if entry is None:
            return
        dynamic = find_kvp(entry.store.track_properties, PropertyType.DYNAMIC_GROUPS)
        if dynamic != 1:
            return  # the track lacks dynamic groups
        largest = entry.store.largest
        group = largest.group if largest is not None else None
        if value != 0 and group is not None and value <= group:
            return  # a non-zero value <= Largest Group is not forwarded
        sent = track.new_group
        if sent is not None and sent[1] == group and sent[0] >= value:
            return  # an outstanding request >= value (until Largest Group grows)
        params = p.Parameters.of(p.NewGroupRequest(value))
        for feed in track.feeds:
            if feed.state is FeedState.LIVE and feed.peer.usable:
                with contextlib.suppress(LocalProtocolError):
                    feed.peer.session.request_update(feed.request_id, params, now=self._now)
                    feed.updates += 1
                    track.new_group = (value, group)

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
        fetch = Feed(
            peer,
            rid,
            track,
            FeedKind.FETCH,
            purpose=FetchPurpose.REFILL,
            refill_of=feed,
            span_from=start,
        )
        peer.feeds[rid] = fetch
        track.fetches.append(fetch)

    def _feed_whole(self, feed: Feed) -> None:
        if not feed.forward or feed.state is not FeedState.LIVE:
            return  # paused (or over) meanwhile: the cache is not whole
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
        if any(f.peer is peer and f.active for f in track.feeds):
            # already fed by this peer (e.g. a broader SUBSCRIBE_TRACKS of ours replaced a
            # narrower one): the same objects twice would only cost (d21 7.5: may refuse)
            self._reject(peer, e.request_id, RequestErrorCode.UNINTERESTED, "already subscribed")
            return
        peer.session.accept_publish(e.request_id, now=self._now)
        was_whole = track.whole
        fwd = e.params.get(p.Forward)
        forward = fwd is None or fwd.value == 1
        feed = Feed(
            peer, e.request_id, track, FeedKind.PUBLISH, state=FeedState.LIVE, forward=forward
        )
        peer.feeds[e.request_id] = feed
        track.feeds.append(feed)
        track.ended = False  # the new feed says how the track ends now
        if not self._make_store(track, e.track_properties):
            return
        entry = track.entry
        assert entry is not None
        if was_whole and entry.store.largest is not None:
            track.whole_to = entry.store.largest
        for obj in orphans:
            self._append(track, entry, obj)
            if track.malformed:
                return
        largest = e.params.get(p.LargestObject)
        if not forward:  # A15: resumed (RU FORWARD=1 + fill) when a subscriber wants it
            if largest is not None and not self._observe(track, largest.location):
                return
            self._sync_forward(track)
            self._serve_pending(track)
            self._track_live(track)
            return
        cached = entry.store.largest
        if largest is None or (was_whole and cached is not None and cached >= largest.location):
            self._feed_whole(feed)
        else:
            start = next_after(cached) if was_whole and cached is not None else Location(0, 0)
            if start is not None and start <= largest.location:
                self._refill(feed, start, largest.location)
            else:
                self._feed_whole(feed)
        self._sync_forward(track)
        if not track.malformed:
            self._track_live(track)

    # --- objects and streams -------------------------------------------------------------

    def _on_object(self, peer: Peer, e: ev.ObjectReceived) -> None:
        feed = peer.feeds.get(e.request_id)
        if feed is None:
            rec = peer.session.requests.get(e.request_id)
            if (
                rec is not None
                and not rec.mine
                and rec.kind is ev.RequestKind.PUBLISH
                and rec.state is RequestState.PENDING  # not a PUBLISH we refused
            ):
                peer.orphans.setdefault(e.request_id, []).append(e)  # before PublishRequested
            return
        track = feed.track
        if feed.purpose is FetchPurpose.SERVE:
            # before the store check: objects that overtook FETCH_OK (another stream) go
            # to ``early`` but were delivered by this FETCH all the same, and
            # _start_streaming must know it, or it finds them cached and gives up
            # cut-through until the whole upstream FETCH is in (module docstring, FETCH)
            feed.delivered_to = e.location
        entry = track.entry
        if entry is None:
            track.early.append(e)
            return
        if track.clock != self._now:
            # the downstream sessions stamp the object with their clock as it is handed
            # over (d21 5.2 delivery timeouts): bring the idle ones to now first
            track.clock = self._now
            for sub in track.served:
                sub.peer.session.advance(self._now)
        if feed.purpose is FetchPurpose.REFETCH:
            self._refetch_arrived(feed, e.payload.nbytes)
        if (
            entry.evicted
            and e.location.group in entry.evicted
            and e.delivery is not ev.Delivery.SUBSCRIPTION
        ):
            self._restore(track, entry, e)
            return
        cache = self._cache
        try:
            obj = cache.append(entry, e)
        except (MalformedTrack, ValueError) as exc:
            self._malformed(track, str(exc))
            return
        if cache.total_bytes > cache.budget:
            cache.evict(self._tier, keep=obj)

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
            and feed.fill_id is not None
            and e.via_request_id == feed.fill_id
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
            entry = track.entry
            if entry is not None and entry.store.largest is not None:
                track.whole_to = entry.store.largest
        if (
            not lost
            and feed.done_status == PublishDoneCode.TRACK_ENDED
            and feed.done_streams is not None
            and feed.streams_ended >= feed.done_streams
        ):
            # every stream it counted arrived: nothing follows what is cached (the End of
            # Track object never reaches the cache when the track ended before our fill)
            track.ended = True
        if track.active or track.malformed:
            return
        if track.fill_deadline is not None:
            track.fill_deadline = None
            self._timed.pop(track, None)
        if lost:
            entry = track.entry
            if entry is not None and (entry.store.end_of_track is not None or track.ended):
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
        self._serve_pending(track)  # ends track.served, once no re-fetch is in flight

    def _on_request_failed(self, peer: Peer, e: ev.RequestFailed) -> None:
        if e.update_id is not None:
            self._on_update_answered(peer, e)
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
        feed.end_of_track = e.end_of_track
        feed.end_location = e.end_location
        if not self._make_store(feed.track, e.track_properties):
            return
        if feed.purpose is FetchPurpose.SERVE and not feed.stream_done:
            self._start_streaming(feed)
        self._check_fetch(feed)

    def _start_streaming(self, feed: Feed) -> None:
        """Cut-through FETCH: with our FETCH_OK in hand, answer the downstream FETCHes now
        and feed them as objects arrive, if none of the range is cached yet (so every
        object reaches the store in the fetch stream's order; module docstring, FETCH)."""
        track, entry, end = feed.track, feed.track.entry, feed.end_location
        if entry is None or end is None:
            return
        lf = feed.filter_key[0] if feed.filter_key else None
        rng = fetch_range(lf if isinstance(lf, p.LocationFilter) else None, end)
        if rng is None or not feed.range_empty:
            return  # part of it was cached already: answered when the upstream FETCH ends
        # objects of the FETCH may have overtaken its FETCH_OK (they travel on another
        # stream): those cached must be exactly what it delivered so far, in order
        after = feed.delivered_to
        start = rng.start if after is None else next_after(after)
        rest = () if start is None else entry.store.objects_in(start, rng.end)
        if next(iter(rest), None) is not None:
            return
        feed.streaming = True
        self._mark_filling(track)
        for w in list(feed.waiters):
            self._stream_fetch(feed, w)

    def _stream_fetch(self, feed: Feed, fetch: DownstreamFetch) -> bool:
        """Answer ``fetch`` from the store with the upstream's End Location, following the
        store; False (it waits for the upstream FETCH to end) for descending order."""
        order = fetch.params.get(p.GroupOrderParam)
        entry = feed.track.entry
        if entry is None or (order is not None and order.order is GroupOrder.DESCENDING):
            return False
        if fetch in feed.waiters:
            feed.waiters.remove(fetch)
        if not self._pending(fetch.peer, fetch.request_id, ev.RequestKind.FETCH):
            fetch.peer.fetches.pop(fetch.request_id, None)
            return True
        fetch.peer.session.accept_fetch(
            fetch.request_id,
            entry.store,
            now=self._now,
            end_location=feed.end_location,
            end_of_track=feed.end_of_track,
        )
        self._cache.touch(entry)
        feed.following.append(fetch)
        return True

    def _on_range_marker(self, peer: Peer, e: ev.RangeMarkerReceived) -> None:
        """End of Unknown / Timed-Out Range on one of our FETCHes: its range is not whole."""
        feed = peer.feeds.get(e.request_id)
        if (
            feed is not None
            and feed.kind is FeedKind.FETCH
            and e.kind is not EndOfRange.NON_EXISTENT
        ):
            feed.gaps = True

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
        if ok and feed.end_of_track:
            self._fetched_to_end(feed)
        if feed.purpose is FetchPurpose.SERVE:
            for w in feed.following:
                w.peer.fetches.pop(w.request_id, None)
                if not w.peer.session.is_closed:
                    w.peer.session.end_fetch(w.request_id, ok=ok, now=self._now)
            feed.following = []
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
            self._pace()  # the next paced re-fetch (core module docstring)
            self._serve_pending(track)
        self._forget_idle(track)

    def _fetched_to_end(self, feed: Feed) -> None:
        """A FETCH answered with End Of Track delivered its range: from {0,0} and with no
        unknown part, the cache now holds the whole track and the track is over (module
        docstring, FETCH)."""
        track, end, entry = feed.track, feed.end_location, feed.track.entry
        if entry is None or end is None or feed.gaps or feed.span_from != Location(0, 0):
            return
        store = entry.store
        largest = store.largest
        if largest is None or largest < end:
            return  # its last object is not in the cache
        beyond = next_after(end)
        if beyond is not None and any(
            o.status is ObjectStatus.NORMAL for o in store.objects_in(beyond)
        ):
            return  # objects beyond its End of Track came from elsewhere: not whole either way
        track.contiguous = True
        track.ended = True

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
        self._cache.touch(entry)

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
        if e.update_id is not None:
            self._on_update_answered(peer, e)
            return
        if e.kind is not ev.RequestKind.TRACK_STATUS:
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
        if self._pace_at is not None and self._pace_at <= now:
            self._pace()  # re-fetches waiting for transit room (RelayCore._pace)
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
        best: float | None = self._pace_at
        for item in self._timed:
            at = item.deadline if isinstance(item, Feed) else item.fill_deadline
            if at is not None and (best is None or at < best):
                best = at
        return best
