"""Relay configuration and the accounting snapshots its getters return.

Theory of operation
-------------------
Everything a relay holds on behalf of its peers is bounded here (STYLE.md R8),
next to the outcome of passing the bound (wire reference section 10, d21
section 7):

* the **cache** is bounded in accounted bytes across every track
  (:attr:`RelayConfig.cache_budget_bytes`: payload buffers, properties and
  per-object, per-group and per-track overhead, evicted objects still being
  sent included), after every input; passing it evicts whole groups, in the
  order documented in :mod:`kvcs_core.relay.cache`;
* one **slow downstream subscriber** is bounded by its own session's
  ``SessionConfig.max_queued_bytes_per_subscription``: past it, that session
  ends the subscription with PUBLISH_DONE TOO_FAR_BEHIND (d21 section 5.2)
  and nobody else is affected; the relay never queues per subscriber itself;
* **requests** are bounded in rate per session (:attr:`RelayConfig.request_rate`,
  a token bucket; over it -> REQUEST_ERROR EXCESSIVE_LOAD with a Retry
  Interval) and in number by each session's ``max_concurrent_peer_requests``;
  SUBSCRIBEs held for a publisher (RENDEZVOUS_TIMEOUT) by
  :attr:`RelayConfig.max_rendezvous` and :attr:`RelayConfig.rendezvous_cap`;
* **objects in transit** (re-fetched for late joiners, forwarded without being
  kept, held only by downstream session queues) are bounded by
  :attr:`RelayConfig.max_transit_bytes` over the whole relay: the re-fetches
  are paced (:mod:`kvcs_core.relay.core`): about one group beyond it at most,
  unless a subscriber stops reading (:attr:`RelayConfig.transit_stall`);
* the **intake** from publishers is held when the cache is full of what
  downstream sessions still hold (:attr:`RelayConfig.intake_hold_bytes`,
  :mod:`kvcs_core.relay.intake`): backpressure reaches the publishers through
  their transport's flow control, and a hold with nothing draining is given
  up after :attr:`RelayConfig.intake_stall`;
* **tracks** are bounded by :attr:`RelayConfig.max_tracks`, and a track
  nobody needs (no publisher, nothing cached, no request) is forgotten at once;
* **waiting** is bounded in time: a downstream SUBSCRIBE waits for the
  upstream fill at most :attr:`RelayConfig.fill_timeout`, an upstream
  PUBLISH_DONE waits for its data streams at most
  :attr:`RelayConfig.publish_done_grace`.

The snapshots (:class:`TrackStats`, :class:`RelayStats`) are frozen values,
built complete when a getter is called.
"""

from __future__ import annotations

import attrs

from kvcs_core.auth.policy import Authorizer
from kvcs_core.wire.names import FullTrackName, Location


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, not {value!r}")


def _positive_time(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, not {value!r}")


def _fraction(_inst: object, _attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"evict_to must be in (0, 1], not {value!r}")


def _non_negative(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, not {value!r}")


@attrs.frozen(kw_only=True)
class RelayConfig:
    """How a :class:`~kvcs_core.relay.relay.Relay` behaves. Durations are seconds."""

    cache_budget_bytes: int = attrs.field(default=1 << 30, validator=_positive)
    """Bytes the cache may hold over all tracks, as accounted by
    :mod:`kvcs_core.relay.cache` (payloads, properties, fixed overheads). It holds after
    every input: above it, whole groups are evicted
    (:mod:`kvcs_core.relay.cache`) down to ``evict_to`` of the budget; an evicted
    group is *unknown* again (d21 section 7.1) and re-fetched upstream on demand."""
    evict_to: float = attrs.field(default=0.9, validator=_fraction)
    """Fraction of the budget eviction brings the cache down to (a batch, so that a
    cache at its budget does not sort its tracks on every object)."""
    fill_timeout: float = attrs.field(default=10.0, validator=_non_negative)
    """How long downstream SUBSCRIBEs wait for the upstream fill (the part of the track
    before the relay subscribed) before they are accepted anyway. They then miss what
    the fill had not delivered yet (exactly-once needs the cache whole, wire ref. 6)."""
    publish_done_grace: float = attrs.field(default=2.0, validator=_non_negative)
    """After an upstream PUBLISH_DONE, how long to wait for the data streams it counts
    (d21 section 9.9, Stream Count) before ending the downstream subscriptions."""
    upstream_hold: float = attrs.field(default=10.0, validator=_non_negative)
    """After an upstream *link* (a session the embedding reopens when lost, see
    ``Relay.add_session(link=True)``) is lost, how long the downstream subscriptions
    and FETCHes it was serving wait for the next upstream session instead of ending."""
    idle_forward: bool = True
    """Forward State of an upstream subscription while the track has no downstream
    subscription at all. ``True`` keeps the cache warm for late joiners and FETCHes (the
    relay's choice, wire reference 10); with downstream subscriptions the upstream
    forwards exactly when one of them does (:mod:`kvcs_core.relay.upstream`)."""
    upstream_priority: int = attrs.field(default=128)
    """SUBSCRIBER_PRIORITY of the relay's own upstream SUBSCRIBEs and FETCHes."""
    max_tracks: int = attrs.field(default=100_000, validator=_positive)
    """Tracks the relay keeps state for. A request for a new track beyond it is
    refused with EXCESSIVE_LOAD (d21 section 7: protect the relay)."""

    request_rate: float = attrs.field(default=200.0, validator=_non_negative)
    """New requests per second one session may open, on average (a token bucket per
    session; 0 = no limit). Past it, the request is refused with REQUEST_ERROR
    EXCESSIVE_LOAD and a Retry Interval (wire reference 10: relays SHOULD protect
    themselves by rate-limiting requests; d21 9.4). The wire defines no session-level
    code for load (0x7, once TOO_MANY_REQUESTS, is unassigned: wire reference 8.1), so
    sustained abuse keeps being refused request by request; each refusal costs O(1)."""
    request_burst: int = attrs.field(default=400, validator=_positive)
    """Requests a session may open at once before ``request_rate`` applies."""
    rendezvous_cap: float = attrs.field(default=30.0, validator=_non_negative)
    """Longest a SUBSCRIBE's RENDEZVOUS_TIMEOUT is honoured, in seconds (relays MAY cap
    it, wire reference 5.7)."""
    max_rendezvous: int = attrs.field(default=1024, validator=_positive)
    """SUBSCRIBEs held for a publisher (RENDEZVOUS_TIMEOUT) over all sessions; a new one
    beyond it is answered at once (DOES_NOT_EXIST), as without the parameter."""

    max_transit_bytes: int = attrs.field(default=8 << 20, validator=_positive)
    """Bytes of re-fetched objects (evicted groups fetched again for late joiners' fills,
    A27) the relay lets be in transit at once: forwarded without being kept, held only by
    the downstream sessions' queues, plus the estimated size of the re-fetches asked for
    and not yet arrived. A re-fetch is asked upstream only while it fits (estimated from
    the average evicted group), one at a time per track, and the next follows as the
    downstream sessions drain (:mod:`kvcs_core.relay.core`); with nothing in transit one
    group is asked whatever its size, so an object larger than the allowance still goes
    through, one at a time. Default 8 MiB: a few large KV objects."""
    transit_poll: float = attrs.field(default=0.005, validator=_positive_time)
    """While re-fetches wait for room in ``max_transit_bytes``, how often (seconds) the
    relay looks again if no input comes (the sessions drain their queues when the
    transport pulls, which is no input to the relay)."""

    transit_stall: float = attrs.field(default=1.0, validator=_positive_time)
    """When re-fetches have waited this long (seconds) for transit room with nothing
    draining (a downstream subscriber that stopped reading holds the restores), one more
    group is asked anyway, one per ``transit_stall``: a stalled subscriber holds back no
    other late joiner, and what it holds is bounded by its session's
    ``max_queued_bytes_per_subscription`` (past it: PUBLISH_DONE TOO_FAR_BEHIND)."""

    intake_hold_bytes: int = attrs.field(default=8 << 20, validator=_positive)
    """Bytes that downstream sessions hold of objects the cache no longer keeps (evicted, or
    forwarded and never kept: ``Cache.held_outside_bytes``, :mod:`.cache`) at which
    the relay holds its intake from the sessions that feed it, so that flow control
    reaches the publishers (:mod:`kvcs_core.relay.intake`); at most half the cache
    budget is used. Intake opens again when they fall to half of it. Default 8 MiB: with a
    receive window of 16 MiB per connection, what arrives after a hold starts leaves a
    subscriber well within the default 64 MiB ``max_queued_bytes_per_subscription``."""
    intake_stall: float = attrs.field(default=2.0, validator=_positive_time)
    """A hold during which nothing drains for this long (seconds) is given up: intake
    opens, and a subscriber that stopped reading alone ends TOO_FAR_BEHIND at its queue
    limit, instead of freezing the publishers and every other subscriber."""

    authorizer: Authorizer | None = attrs.field(default=None, eq=False)
    """CAT-token authorization of downstream sessions and their requests
    (:mod:`kvcs_core.relay.authz`); ``None`` (the default): anonymous access, every
    request served as far as the other limits allow."""

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.upstream_priority <= 255:
            raise ValueError(f"upstream_priority must be 0..255, not {self.upstream_priority}")


@attrs.frozen(kw_only=True)
class TrackStats:
    """What the relay knows about one track, at the time of the call."""

    name: FullTrackName
    cached_bytes: int
    """Payload bytes of this track held in the cache now."""
    cached_objects: int
    """Objects held now (status objects included)."""
    objects_received: int
    """Objects received from upstream, duplicates included."""
    bytes_received: int
    """Payload bytes received from upstream, duplicates included."""
    duplicates: int
    """Objects received again (an aggregation overlap, a refetch): no-ops in the cache."""
    evicted_groups: int
    """Groups evicted so far (some may have been fetched again since)."""
    evicted_bytes: int
    """Payload bytes evicted so far."""
    largest: Location | None
    """Largest Object known (d21 section 3.1.3)."""
    complete: bool
    """End of Track is known and every object before it was received (none evicted)."""
    upstream_live: bool
    """An upstream subscription (or PUBLISH) feeds the track now."""
    downstream_subscriptions: int
    """Downstream subscriptions served from this track now (accepted, not ended)."""
    pending_subscriptions: int
    """Downstream SUBSCRIBEs waiting for the upstream (SUBSCRIBE_OK, fill, refetch)."""


@attrs.frozen(kw_only=True)
class RelayStats:
    """Relay-wide accounting, at the time of the call."""

    cache_bytes: int
    """Accounted bytes the cache holds now, over every track (never above the budget)."""
    peak_cache_bytes: int
    """The most ``cache_bytes`` ever was after an input."""
    upstream_bytes_received: int
    """Payload bytes received from upstream sessions (subscriptions, fills, fetches)."""
    upstream_objects_received: int
    """Objects received from upstream sessions, duplicates included."""
    evicted_bytes: int
    """Accounted bytes evicted so far."""
    tracks: int
    """Tracks the relay keeps state for."""
    sessions: int
    """Sessions the relay owns (open ones)."""
    downstream_subscriptions: int
    """Downstream subscriptions served now."""
    transit_bytes: int = 0
    """Bytes of objects forwarded but never kept (larger than what the cache could hold)
    that the sessions still hold; with ``cache_bytes`` this is every object byte the
    relay holds."""
    refetch_bytes_received: int = 0
    """Payload bytes of evicted groups fetched again upstream for late joiners so far."""
    refused_for_rate: int = 0
    """Requests refused so far because their session passed ``request_rate``."""
    cached_objects: int = 0
    """Objects the cache holds now, over every track (status objects included)."""
    evicted_groups: int = 0
    """Groups evicted so far, over every track."""
    objects_sent: int = 0
    """Objects the relay's sessions handed to their transports so far (to subscribers,
    fills and FETCHes downstream), sessions that are gone included."""
    bytes_sent: int = 0
    """Payload bytes of those objects."""
    sessions_added: int = 0
    """Sessions the relay was given so far (open or gone)."""
    upstream_sessions: int = 0
    """Open sessions towards publishers or parent relays (``add_session(upstream=True)``)."""
    refused: tuple[tuple[str, int], ...] = ()
    """Requests the relay refused so far (REQUEST_ERROR), as ``(error code name, count)``
    pairs sorted by name."""
    evicted_held_bytes: int = 0
    """Bytes of evicted objects (payloads included) that downstream sessions still hold,
    part of ``cache_bytes``."""
    held_outside_bytes: int = 0
    """``evicted_held_bytes`` plus ``transit_bytes``: everything downstream sessions hold
    that the cache no longer keeps, what the intake gate looks at
    (:mod:`kvcs_core.relay.intake`)."""
    intake_held: bool = False
    """The relay holds its intake from publishers now (the cache is full)."""
    intake_holds: int = 0
    """Holds of the intake started so far."""
    intake_given_up: int = 0
    """Holds given up so far because nothing drained for ``intake_stall``."""
    intake_held_seconds: float = 0.0
    """Time the intake was held so far."""
