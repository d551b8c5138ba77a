"""SUBSCRIBE_TRACKS at the relay: matching tracks are PUBLISHed downstream.

Theory of operation
-------------------
A peer that sends SUBSCRIBE_TRACKS for a prefix (d21 section 9.18, wire
reference 4.4 and 10) asks the relay to PUBLISH to it every track under the
prefix, those the relay knows now and those it learns later. The relay answers
REQUEST_OK (empty Track Properties, A26), then, for each matching track, once:

* **PUBLISH** on a new request stream (``MoqtSession.publish``) when the track
  is live at the relay (an upstream subscription or PUBLISH is established, so
  LARGEST_OBJECT is known and objects flow). The SUBSCRIBE_TRACKS parameters
  are its initial settings and are written explicitly (B3, wire reference 4.3):
  FORWARD (as of now: a REQUEST_UPDATE on the SUBSCRIBE_TRACKS changes only
  later PUBLISHes, wire reference 5.7), GROUP_ORDER, SUBSCRIBER_PRIORITY, the
  delivery timeouts and LOCATION_FILTER; AUTHORIZATION_TOKEN never (5.3). Its
  range filters cannot travel in a PUBLISH (wire reference 5.1) and are applied
  by the session to what it sends; INCLUDE_PROPERTIES 0 empties the Track
  Properties (5.7). The PUBLISH-created subscription is then served from the
  cache like a downstream SUBSCRIBE (it counts for the upstream Forward State,
  its REQUEST_UPDATEs are propagated, PUBLISH_DONE passes the upstream's end
  on). FILL_PARAMETERS in the SUBSCRIBE_TRACKS (Ambiguity A10): once the
  subscription is established with Forward 1, one fill named by the PUBLISH's
  Request ID, up to the Largest Object the PUBLISH announced (its live part
  starts right after it, so each object arrives once); a subscriber should not
  rely on it and may ask with REQUEST_UPDATE{FORWARD=1, FILL_PARAMETERS}.
* **PUBLISH_SKIPPED** instead when the relay will not PUBLISH it to that peer:
  the peer is itself a source of the track (it PUBLISHed it, or announced a
  namespace covering it: "every matching track except those the subscriber
  itself publishes", wire reference 4.4), or the peer already holds a SUBSCRIBE
  for it ("that one gets the SUBSCRIBE path", wire reference 10). No later
  PUBLISH follows for that track on that SUBSCRIBE_TRACKS.
* nothing for a track its TRACK_PROPERTY_FILTER rejects (the peer did not ask
  for it; reconsidered if a REQUEST_UPDATE changes the filter).

A TRACK_NAMESPACE_PREFIX update (the session checked PREFIX_OVERLAP) makes the
tracks under the new prefix eligible; tracks already offered are not offered
again, and existing PUBLISH-created subscriptions are unaffected (5.8).
Cancelling the SUBSCRIBE_TRACKS stops further offers; the PUBLISHes already
made live on (they are requests of their own).

**Upstream**: the relay learns of tracks through its upstream sessions: for
every downstream prefix it sends one SUBSCRIBE_TRACKS (Forward 1: the cache is
warmed; each resulting PUBLISH follows the upstream Forward rules of
:mod:`kvcs_core.relay.upstream`) to each upstream session and each source of a
namespace overlapping the prefix, except the asking peer, aggregated per
session like namespace subscriptions (:mod:`kvcs_core.relay.routing`): a
prefix already covered is not sent again; a broader one replaces narrower ones
(cancelled first; their PUBLISHes live on, and a duplicate PUBLISH of a track
already fed by that session is refused with UNINTERESTED). Every PUBLISH that
arrives is accepted as a feed of the track (d21 9.8); once established the
track is offered to the matching downstream SUBSCRIBE_TRACKS.
"""

from __future__ import annotations

import contextlib

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.windows import RangeFilterSet
from kvcs_core.relay.tracks import (
    DownstreamSubscription,
    Peer,
    Track,
    TracksSubscription,
    UpstreamTracks,
)
from kvcs_core.relay.upstream import Upstream
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ParameterType, RequestErrorCode
from kvcs_core.wire.names import TrackNamespace

_SETTINGS = (
    p.SubscriberPriority,
    p.ObjectDeliveryTimeout,
    p.SubgroupDeliveryTimeout,
    p.LocationFilter,
)
"""SUBSCRIBE_TRACKS parameters written into each resulting PUBLISH (besides FORWARD and
GROUP_ORDER, which ``MoqtSession.publish`` always writes)."""


class Offers(Upstream):
    """Mixin: SUBSCRIBE_TRACKS, downstream and upstream (see the module docstring)."""

    # --- downstream ------------------------------------------------------------------

    def _on_subscribe_tracks(self, peer: Peer, e: ev.SubscribeTracksRequested) -> None:
        if not self._pending(peer, e.request_id, ev.RequestKind.SUBSCRIBE_TRACKS):
            return
        try:
            filters = RangeFilterSet.from_params(e.params)
        except ValueError as exc:
            self._reject(peer, e.request_id, RequestErrorCode.INVALID_FILTER, str(exc))
            return
        fwd = e.params.get(p.Forward)
        tsub = TracksSubscription(
            peer,
            e.request_id,
            e.prefix,
            e.params,
            forward=fwd is None or fwd.value == 1,
            filters=filters,
        )
        peer.session.accept_request(e.request_id, now=self._now)  # A26: no Track Properties
        peer.tracks_subs[e.request_id] = tsub
        self._offer_all(tsub)
        self._ensure_upstream_tracks(e.prefix, peer)

    def _tracks_updated(self, peer: Peer, e: ev.RequestUpdated) -> None:
        """REQUEST_UPDATE on a downstream SUBSCRIBE_TRACKS (its session answered it):
        FORWARD for later PUBLISHes, TRACK_PROPERTY_FILTER, TRACK_NAMESPACE_PREFIX."""
        tsub = peer.tracks_subs.get(e.request_id)
        if tsub is None:
            return
        fwd = e.params.get(p.Forward)
        if fwd is not None:
            tsub.forward = fwd.value == 1
        with contextlib.suppress(ValueError):  # the session refused bad filters already
            updated = tsub.filters.apply_update(e.params)
            if updated is not tsub.filters:
                tsub.filters = updated
                tsub.excluded.clear()
        prefix = e.params.get(p.TrackNamespacePrefix)
        rec = peer.session.requests.get(e.request_id)
        if prefix is not None and rec is not None and rec.namespace == prefix.namespace:
            tsub.prefix = prefix.namespace  # accepted (no PREFIX_OVERLAP)
            self._ensure_upstream_tracks(tsub.prefix, peer)
        self._offer_all(tsub)

    def _track_live(self, track: Track) -> None:
        for peer in list(self._peers.values()):
            for tsub in list(peer.tracks_subs.values()):
                self._offer(tsub, track)

    def _offer_all(self, tsub: TracksSubscription) -> None:
        for track in list(self._tracks.values()):
            if tsub.prefix.is_prefix_of(track.name.namespace):
                self._offer(tsub, track)

    def _offer(self, tsub: TracksSubscription, track: Track) -> None:
        """PUBLISH ``track`` on ``tsub``'s session, or PUBLISH_SKIPPED (module docstring)."""
        name = track.name
        if name in tsub.offered or name in tsub.excluded:
            return
        if not tsub.prefix.is_prefix_of(name.namespace):
            return
        entry = track.entry
        if entry is None or track.malformed or not track.live:
            return  # offered when it is live
        peer = tsub.peer
        session = peer.session
        rec = session.requests.get(tsub.request_id)
        if session.is_closed or rec is None or rec.state is not RequestState.ESTABLISHED:
            return
        auth = self._auth
        if auth is not None and not tsub.peer.upstream and not auth.may_offer(
            session, tsub.request_id, name
        ):
            tsub.excluded[name] = None  # not authorized for it (authz module docstring)
            return
        if not tsub.filters.matches_track(entry.store.track_properties):
            tsub.excluded[name] = None  # TRACK_PROPERTY_FILTER (wire reference 5.5)
            return
        tsub.offered[name] = None
        if self._sourced_by(peer, track) or any(
            s.track is track and not s.published for s in peer.subscriptions.values()
        ):
            session.send_publish_skipped(tsub.request_id, name, now=self._now)
            return
        params = tsub.params
        extra: list[p.Parameter] = []
        for item in params:
            if isinstance(item, _SETTINGS):
                extra.append(item)
        order = params.get(p.GroupOrderParam)
        include = params.get(p.IncludeProperties)
        ranges = [
            f
            for f in params
            if isinstance(f, p.RangeFilter) and f.kind != ParameterType.TRACK_PROPERTY_FILTER
        ]
        try:
            rid = session.publish(
                entry.store,
                now=self._now,
                forward=tsub.forward,
                extra=extra,
                group_order=order.order if order is not None else None,
                range_filters=ranges,
                include_properties=include is None or include.value == 1,
            )
        except LocalProtocolError:
            return  # GOAWAY received on that session: no new requests
        lf = params.get(p.LocationFilter)
        sub = DownstreamSubscription(
            peer,
            rid,
            session.requests[rid].params,
            track,
            forward=tsub.forward,
            location_filter=lf,
            published=True,
            fill=params.get(p.FillParameters),
        )
        peer.subscriptions[rid] = sub
        track.served[sub] = None
        self._cache.touch(entry)
        self._sync_forward(track)

    def _sourced_by(self, peer: Peer, track: Track) -> bool:
        """``peer`` publishes ``track`` itself: it feeds it, or announced its namespace."""
        if any(f.peer is peer for f in track.feeds):
            return True
        return any(s is peer.session for s in self._router.routes(track.name.namespace, None))

    def _published_accepted(self, peer: Peer, e: ev.RequestAccepted) -> bool:
        """PUBLISH_OK for a PUBLISH of ours: serve the SUBSCRIBE_TRACKS fill (A10)."""
        sub = peer.subscriptions.get(e.request_id)
        if sub is None or not sub.published:
            return False
        fill = sub.fill
        entry = sub.track.entry
        if fill is not None and sub.forward and entry is not None:
            with contextlib.suppress(LocalProtocolError):
                if peer.session.open_publish_fill(e.request_id, fill.params, now=self._now):
                    groups = self._evicted_needed(entry, p.Parameters.of(fill), sub.location_filter)
                    if groups is not None:
                        self._refetch(sub.track, groups)
        return True

    def _published_failed(self, peer: Peer, request_id: int) -> bool:
        """The peer refused (REQUEST_ERROR) or cancelled a PUBLISH of ours."""
        sub = peer.subscriptions.get(request_id)
        if sub is None or not sub.published:
            return False
        del peer.subscriptions[request_id]
        sub.track.served.pop(sub, None)
        self._sync_forward(sub.track)
        return True

    # --- upstream --------------------------------------------------------------------

    def _tracks_targets(self, prefix: TrackNamespace, exclude: Peer | None) -> list[Peer]:
        """Upstream sessions, and sources of a namespace overlapping ``prefix``."""
        out: dict[int, Peer] = {}
        for peer in self._peers.values():
            if peer is exclude or not peer.usable:
                continue
            if peer.upstream or any(
                ns.is_prefix_of(prefix) or prefix.is_prefix_of(ns)
                for ns, _src in self._router.sources_of(peer.session)
            ):
                out[id(peer)] = peer
        return list(out.values())

    def _ensure_upstream_tracks(self, prefix: TrackNamespace, exclude: Peer | None) -> None:
        for peer in self._tracks_targets(prefix, exclude):
            self._upstream_tracks(peer, prefix)

    def _upstream_tracks(
        self, peer: Peer, prefix: TrackNamespace, *, retried: bool = False
    ) -> None:
        """One SUBSCRIBE_TRACKS per session covers a prefix (module docstring)."""
        if not peer.session.setup_complete:
            return  # sent when the session's setup completes
        ups = peer.tracks_up
        if any(up.prefix.is_prefix_of(prefix) for up in ups.values()):
            return
        session = peer.session
        for rid in [r for r, up in ups.items() if prefix.is_prefix_of(up.prefix)]:
            del ups[rid]
            with contextlib.suppress(LocalProtocolError):  # finished and forgotten already
                session.cancel(rid, now=self._now)
        try:
            rid = session.subscribe_tracks(prefix, now=self._now)
        except LocalProtocolError:
            return  # GOAWAY received
        ups[rid] = UpstreamTracks(prefix, retried=retried)

    def _upstream_tracks_failed(self, peer: Peer, e: ev.RequestFailed) -> bool:
        up = peer.tracks_up.pop(e.request_id, None)
        if up is None:
            return False
        if e.code == RequestErrorCode.PREFIX_OVERLAP and not up.retried and peer.usable:
            # the cancel of a narrower prefix had not arrived yet (as for namespaces)
            self._upstream_tracks(peer, up.prefix, retried=True)
        return True

    def _tracks_on_setup(self, peer: Peer) -> None:
        """An upstream session became usable: subscribe the downstream prefixes on it."""
        for other in list(self._peers.values()):
            if other is peer:
                continue
            for tsub in other.tracks_subs.values():
                if peer in self._tracks_targets(tsub.prefix, other):
                    self._upstream_tracks(peer, tsub.prefix)

    # --- outcomes of our requests (extends the upstream half) -------------------------

    def _on_request_accepted(self, peer: Peer, e: ev.RequestAccepted) -> None:
        if e.update_id is None and e.kind is ev.RequestKind.PUBLISH:
            self._published_accepted(peer, e)
            return
        super()._on_request_accepted(peer, e)

    def _on_request_failed(self, peer: Peer, e: ev.RequestFailed) -> None:
        if e.update_id is None and (
            self._published_failed(peer, e.request_id) or self._upstream_tracks_failed(peer, e)
        ):
            return
        super()._on_request_failed(peer, e)
