"""Per-peer, per-track and per-request state of the relay (no logic beyond small queries).

Theory of operation
-------------------
The relay splits its state by lifetime (STYLE.md R11):

* :class:`Peer`: one per session the relay owns, for the life of the session;
  it indexes that session's requests by Request ID, which is how every event
  (all events name a request, d21 section 6.4.2.1) finds its state in O(1).
* :class:`Track`: one per Full Track Name the relay has been asked about; it
  owns the cache entry (the TrackStore) and links the *feeds* that fill it
  with the downstream requests served from it.
* :class:`Feed`: one upstream request that delivers objects into a track:
  the relay's SUBSCRIBE (live objects plus a fill, wire reference 6), a
  PUBLISH a publisher sent us (d21 section 9.8), or the relay's FETCH (to serve
  a downstream FETCH, to make the cache whole after a failed fill, or to get
  evicted groups back).
* :class:`DownstreamSubscription` / :class:`DownstreamFetch`: a downstream
  request waiting for the track or served from it.

Life of an upstream subscription (wire reference 4.5, d21 section 9.9)::

    PENDING --SUBSCRIBE_OK--> LIVE --PUBLISH_DONE--> ENDING --streams seen--> DONE
    PENDING --REQUEST_ERROR--> DONE          LIVE/ENDING --session lost--> DONE

``ENDING`` waits until the data streams PUBLISH_DONE counts have ended (or
``publish_done_grace`` passed), so that objects still in flight reach the
cache before the downstream subscriptions are ended.
"""

from __future__ import annotations

import enum

import attrs

from kvcs_core.moqt.events import ObjectReceived
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.windows import RangeFilterSet
from kvcs_core.relay.cache import CacheEntry, GroupSet
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace
from kvcs_core.wire.params import FillParameters, LocationFilter, Parameters


class FeedKind(enum.IntEnum):
    SUBSCRIBE = 1
    """The relay's SUBSCRIBE upstream: NEXT_OBJECT + FILL{ABSOLUTE_START} (exactly once)."""
    PUBLISH = 2
    """A PUBLISH from a publisher, accepted by the relay."""
    FETCH = 3
    """The relay's FETCH upstream."""


class FeedState(enum.IntEnum):
    PENDING = 1
    LIVE = 2
    ENDING = 3
    DONE = 4


class FetchPurpose(enum.IntEnum):
    """Why the relay fetches upstream."""

    SERVE = 1
    """Downstream FETCHes wait for the range (it was not fully cached)."""
    REFILL = 2
    """Make the cache whole below a point (a fill failed, a PUBLISH started mid-track)."""
    REFETCH = 3
    """Get evicted groups back for a waiting downstream request."""


@attrs.define(eq=False)
class Peer:
    """One session the relay owns."""

    session: MoqtSession
    upstream: bool
    goaway: bool = False
    closed: bool = False
    feeds: dict[int, Feed] = attrs.field(factory=dict)
    """Our upstream requests on this session that deliver objects, by Request ID."""
    statuses: dict[int, StatusQuery] = attrs.field(factory=dict)
    """Our TRACK_STATUS requests on this session, by Request ID."""
    subscriptions: dict[int, DownstreamSubscription] = attrs.field(factory=dict)
    fetches: dict[int, DownstreamFetch] = attrs.field(factory=dict)
    published: dict[int, TrackNamespace] = attrs.field(factory=dict)
    """PUBLISH_NAMESPACE requests of the peer we accepted: Request ID -> namespace."""

    orphans: dict[int, list[ObjectReceived]] = attrs.field(factory=dict)
    """Objects of a peer's PUBLISH that arrived before its PublishRequested event."""
    tracks_subs: dict[int, TracksSubscription] = attrs.field(factory=dict)
    """The peer's SUBSCRIBE_TRACKS we accepted, by Request ID."""
    tracks_up: dict[int, UpstreamTracks] = attrs.field(factory=dict)
    """Our SUBSCRIBE_TRACKS on this session, by Request ID."""
    tokens: float = float("inf")
    """Request tokens left (``RelayConfig.request_rate``; capped at the burst on use)."""
    tokens_at: float = 0.0
    """When ``tokens`` was last brought up to date."""

    @property
    def usable(self) -> bool:
        """New requests may be sent on this session."""
        return not self.closed and not self.goaway and not self.session.is_closed


@attrs.define(eq=False)
class Feed:
    """An upstream request delivering objects into a track (module docstring)."""

    peer: Peer
    request_id: int
    track: Track
    kind: FeedKind
    state: FeedState = FeedState.PENDING
    forward: bool = True
    """Our Forward State on this subscription (SUBSCRIBE or PUBLISH), as last requested."""
    fill_id: int | None = None
    """The Request ID naming the fill we wait for: the SUBSCRIBE's, or the REQUEST_UPDATE's
    that resumed forwarding (None: no fill requested)."""
    fill_answered: bool = False
    """The answer to ``fill_id`` arrived (SUBSCRIBE_OK or REQUEST_UPDATE_OK)."""
    fill_from: Location | None = None
    """Where the requested fill starts."""
    fill_open: bool = False
    """A fill stream is expected (SUBSCRIBE_OK's Largest Object was at/after fill_from)."""
    fill_ended: bool = False
    fill_reset: int | None = None
    fill_end: Location | None = None
    whole: bool = False
    """SUBSCRIBE/PUBLISH: everything before this feed's live part is cached (its fill
    completed, or there was nothing before it): while it delivers, the cache is whole
    up to Largest Object."""
    streams_ended: int = 0
    done_streams: int | None = None
    done_status: int = 0
    done_reason: str = ""
    deadline: float | None = None
    # FETCH feeds
    purpose: FetchPurpose | None = None
    accepted: bool = False
    stream_done: bool = False
    waiters: list[DownstreamFetch] = attrs.field(factory=list)
    following: list[DownstreamFetch] = attrs.field(factory=list)
    """SERVE fetch: downstream FETCHes answered at our FETCH_OK, fed as objects arrive."""
    streaming: bool = False
    range_empty: bool = False
    """SERVE fetch: the cache held nothing of the range when it was asked for."""
    delivered_to: Location | None = None
    """SERVE fetch: the Location of the last object it delivered (in its stream's order)."""
    """SERVE fetch answered downstream as it arrives (cut-through, relay module docstring)."""
    reset_code: int | None = None
    """FETCH: the response stream was reset with this code."""
    refill_of: Feed | None = None
    """REFILL: the subscription or PUBLISH this fetch completes."""
    groups: range | None = None
    """REFETCH: the groups asked for."""
    reserved: int = 0
    """REFETCH: estimated bytes asked for and not arrived yet (counted against
    ``RelayConfig.max_transit_bytes`` until they arrive or the fetch ends)."""
    filter_key: tuple[object, ...] | None = None
    """SERVE: what was asked, so that identical downstream FETCHes share one request."""
    span_from: Location | None = None
    """FETCH: where the asked range starts, when the filter says so without Largest Object
    (absolute filters, or none); ``None`` when it is relative."""
    end_of_track: bool = False
    """FETCH: FETCH_OK said End Of Track (its End Location is the track's last object)."""
    end_location: Location | None = None
    """FETCH: FETCH_OK's End Location."""
    gaps: bool = False
    """FETCH: an End of Unknown / Timed-Out Range marker came: objects of the range are
    missing from what it delivered."""
    updates: int = 0
    """Our REQUEST_UPDATEs on this subscription not answered yet."""

    @property
    def active(self) -> bool:
        """A subscription or PUBLISH that is pending or delivering."""
        return self.kind is not FeedKind.FETCH and self.state in (
            FeedState.PENDING,
            FeedState.LIVE,
            FeedState.ENDING,
        )

    @property
    def live(self) -> bool:
        return self.kind is not FeedKind.FETCH and self.state is FeedState.LIVE

    @property
    def delivering(self) -> bool:
        """Established and not finished (LIVE, or ENDING while streams drain)."""
        return self.kind is not FeedKind.FETCH and self.state in (
            FeedState.LIVE,
            FeedState.ENDING,
        )


@attrs.define(eq=False)
class DownstreamSubscription:
    """A downstream subscription: a peer's SUBSCRIBE, or a PUBLISH the relay sent it
    (SUBSCRIBE_TRACKS, ``published``)."""

    peer: Peer
    request_id: int
    params: Parameters
    track: Track
    forward: bool = True
    """Its Forward State (FORWARD in the request, then its REQUEST_UPDATEs)."""
    location_filter: LocationFilter | None = None
    """Its LOCATION_FILTER now (sticky across REQUEST_UPDATEs; None = unfiltered)."""
    published: bool = False
    """The relay PUBLISHed the track to the peer (the request is ours, not the peer's)."""
    fill: FillParameters | None = None
    """``published``: the SUBSCRIBE_TRACKS's FILL_PARAMETERS, served at PUBLISH_OK (A10)."""


@attrs.define(eq=False)
class TracksSubscription:
    """A downstream SUBSCRIBE_TRACKS (d21 9.18): every matching track is offered once,
    as a PUBLISH or a PUBLISH_SKIPPED (:mod:`kvcs_core.relay.offers`)."""

    peer: Peer
    request_id: int
    prefix: TrackNamespace
    """The prefix now (TRACK_NAMESPACE_PREFIX in a REQUEST_UPDATE replaces it)."""
    params: Parameters
    """The SUBSCRIBE_TRACKS parameters: the initial settings of every PUBLISH (B3)."""
    forward: bool
    """FORWARD for the PUBLISHes from now on (a REQUEST_UPDATE changes future ones only)."""
    filters: RangeFilterSet
    """Its range filters (TRACK_PROPERTY_FILTER selects tracks; the others apply to objects)."""
    offered: dict[FullTrackName, None] = attrs.field(factory=dict)
    """Tracks PUBLISHed or PUBLISH_SKIPPED on it: never offered again (d21 9.19)."""
    excluded: dict[FullTrackName, None] = attrs.field(factory=dict)
    """Tracks its TRACK_PROPERTY_FILTER rejected (reconsidered when the filter changes)."""


@attrs.define(eq=False)
class UpstreamTracks:
    """A SUBSCRIBE_TRACKS the relay sent upstream for a downstream prefix."""

    prefix: TrackNamespace
    retried: bool = False


@attrs.define(eq=False)
class DownstreamFetch:
    peer: Peer
    request_id: int
    params: Parameters
    track: Track


@attrs.define(eq=False)
class StatusQuery:
    """Our TRACK_STATUS upstream, answering downstream TRACK_STATUS requests."""

    track: Track
    waiters: list[tuple[Peer, int]] = attrs.field(factory=list)


@attrs.define(eq=False)
class Track:
    """Everything the relay knows about one Full Track Name."""

    name: FullTrackName
    entry: CacheEntry | None = None
    early: list[ObjectReceived] = attrs.field(factory=list)
    """Objects that arrived before the store could be made (a fill before SUBSCRIBE_OK)."""
    feeds: list[Feed] = attrs.field(factory=list)
    """Upstream SUBSCRIBEs and PUBLISHes (any state but DONE)."""
    fetches: list[Feed] = attrs.field(factory=list)
    """Upstream FETCHes in flight."""
    contiguous: bool = False
    """Every object from {0,0} to Largest Object was received (some may be evicted since:
    ``entry.evicted``): a whole feed ended, or a FETCH from {0,0} was answered with End Of
    Track and delivered its range whole. Required before a downstream SUBSCRIBE is
    accepted, so that the session's fill from the cache misses nothing (exactly once,
    wire reference 6)."""
    forced: bool = False
    """The fill wait timed out: accept downstream SUBSCRIBEs without ``contiguous``."""
    fill_deadline: float | None = None
    pending: list[DownstreamSubscription] = attrs.field(factory=list)
    """Downstream SUBSCRIBEs not answered yet."""
    served: dict[DownstreamSubscription, None] = attrs.field(factory=dict)
    """Downstream subscriptions accepted and not ended by the relay."""
    terminal: tuple[int, str] | None = None
    """How the upstream ended the track last (PUBLISH_DONE status, reason)."""
    last_error: tuple[int, str] | None = None
    """The last upstream REQUEST_ERROR for a SUBSCRIBE of this track."""
    malformed: bool = False
    clock: float = -1.0
    """When the downstream sessions serving the track last had their clocks moved."""
    whole_to: Location | None = None
    """The cache held every object up to here when the last whole feed paused or ended:
    where a resumed upstream fill starts (from this group's first object)."""
    new_group: tuple[int, int | None] | None = None
    """The NEW_GROUP_REQUEST value sent upstream and the Largest Group then: outstanding
    until Largest Group grows (wire reference 5.8)."""
    ended: bool = False
    """The upstream said the track is over without an End of Track object reaching the
    cache: PUBLISH_DONE TRACK_ENDED, or FETCH_OK End Of Track. Status objects travel only on
    subgroup streams (wire reference 7.5, 7.8): a track the relay got by a fill or a FETCH
    never caches its End of Track object. Cleared when a new SUBSCRIBE or PUBLISH feeds
    the track."""
    wanted: GroupSet = attrs.field(factory=GroupSet)
    """Evicted groups some served fill still needs restored and no re-fetch has asked for
    yet (paced re-fetches, :meth:`RelayCore._pace`)."""
    refetch_at: int = 0
    """Where the next paced re-fetch of ``wanted`` starts looking (it wraps around)."""

    @property
    def live(self) -> bool:
        return any(f.live for f in self.feeds)

    @property
    def whole(self) -> bool:
        """The cache holds (or held, before evictions) every object up to Largest Object."""
        if any(f.delivering and f.whole for f in self.feeds):
            return True
        return self.contiguous and not any(f.delivering for f in self.feeds)

    @property
    def active(self) -> bool:
        return any(f.active for f in self.feeds)

    @property
    def complete(self) -> bool:
        """End of Track known (its object cached, or ``ended`` and no upstream feed left)
        and nothing before it missing or evicted: served without asking upstream."""
        entry = self.entry
        return (
            entry is not None
            and self.whole
            and (entry.store.end_of_track is not None or (self.ended and not self.active))
            and not entry.evicted
        )
