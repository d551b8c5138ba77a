"""``MoqtSession``: the sans-I/O state machine of one MOQT draft-22 session.

Theory of operation
-------------------
One session = one QUIC (or WebTransport) connection, either role, publisher and
subscriber at once (d21 sections 3 and 6). The session consumes
:mod:`.transport_io` events and emits transport commands and session events,
following the call protocol of :mod:`.protocol`; it never performs I/O, reads a
clock or draws randomness.

Streams (d21 section 6.3, wire reference 3.3):

* each endpoint opens one unidirectional *control stream* whose first bytes are
  SETUP (type 0x2F00 doubles as the stream type); it later carries only GOAWAY.
  A second control stream, FIN or reset of it, or anything else on it is a
  PROTOCOL_VIOLATION (Ambiguity A19);
* every request travels on its own bidirectional *request stream*
  (:mod:`.requests`); the first message must be a request type, else PV;
* object data travels on unidirectional *data streams* and datagrams
  (:mod:`.receiving` decodes what we receive, :mod:`.publishing` produces what
  we send).

Stream credit: a request of ours needs a bidirectional stream, and the peer
limits how many we may open (QUIC MAX_STREAMS). When the transport reports
that limit (:class:`~kvcs_core.moqt.transport_io.StreamCredit`), a request
made while it is used up is held unsent (:mod:`.output`, at most
``SessionConfig.max_held_requests``); held requests go out in the order they
were made as the credit grows, and only then does their CONTROL_MESSAGE_TIMEOUT
timer start (the peer cannot answer what it has not seen). Updates and cancels
of a held request wait with it; a held request that is cancelled is dropped
without ever being sent. (A held PUBLISH's objects are not held: as when a QUIC
stack queued the stream itself, they may reach the peer before the PUBLISH, which
buffers them under an unknown Track Alias, bounded there.)

Request and data streams may arrive before the peer's SETUP; they are buffered
(bounded by ``SessionConfig.max_pre_setup_bytes``) and replayed once it arrives
(d21 section 6.3: SHOULD buffer).

Errors follow the three tiers of :mod:`.errors`: every input passes one choke
point, :meth:`MoqtSession._guard`, that turns a :class:`PeerViolation` (or a
:class:`CodecError` from the wire codec, which carries its session code) into
``CloseTransport`` + :class:`~.events.SessionClosed`. Anything else propagates: it is a
bug.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.auth import TokenCache
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.errors import LocalProtocolError, PeerViolation
from kvcs_core.moqt.output import Output
from kvcs_core.moqt.own_requests import OwnRequests
from kvcs_core.moqt.peer_requests import PeerRequests
from kvcs_core.moqt.publishing import Publisher
from kvcs_core.moqt.receiving import DataReceiver
from kvcs_core.moqt.requests import (
    MESSAGE_OF_KIND,
    RequestIdTracker,
    RequestRecord,
    RequestState,
)
from kvcs_core.moqt.timers import Deadlines, TimerKind
from kvcs_core.moqt.transport_io import (
    AbortKind,
    DatagramReceived,
    SendDatagram,
    StreamAborted,
    StreamCredit,
    StreamData,
    StreamOpened,
    StreamRef,
    TransportClosed,
    TransportCommand,
    TransportEvent,
    WriteStream,
)
from kvcs_core.moqt.windows import RangeFilterSet, request_ranges
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import (
    GroupOrder,
    RequestErrorCode,
    SessionErrorCode,
    StreamResetCode,
)
from kvcs_core.wire.errors import NEED_MORE, CodecError
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace
from kvcs_core.wire.objects import UniStreamKind, peek_uni_stream_type
from kvcs_core.wire.scopes import PUBLISH_PARAMS

if TYPE_CHECKING:
    from kvcs_core.moqt.track_store import TrackStore

_NAMESPACE_KINDS = (
    ev.RequestKind.PUBLISH_NAMESPACE,
    ev.RequestKind.SUBSCRIBE_NAMESPACE,
    ev.RequestKind.SUBSCRIBE_TRACKS,
)


class MoqtSession(PeerRequests, OwnRequests):
    """One MOQT draft-22 session (see the module docstring for the model)."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self._out = Output()
        self._timers = Deadlines()
        self._last_now = 0.0
        self._started = False
        self._closed = False
        self._peer_setup: m.Setup | None = None
        self._control_out: StreamRef | None = None
        self._control_in: StreamRef | None = None
        self._control_decoder = m.ControlStreamDecoder(config.max_control_message_size)
        self._uni_pending: dict[StreamRef, bytearray] = {}
        """Peer uni streams whose type is not known yet (first vi64 incomplete)."""
        self._pre_setup: list[TransportEvent] = []
        self._pre_setup_bytes = 0
        self._next_request_id = 0 if config.role is Role.CLIENT else 1
        self._peer_ids = RequestIdTracker(
            parity=1 if config.role is Role.CLIENT else 0, limit=config.max_request_id_window
        )
        self.requests: dict[int, RequestRecord] = {}
        """Every request of this session, ours and the peer's, by Request ID."""
        self._by_stream: dict[StreamRef, RequestRecord] = {}
        self._update_owner: dict[int, int] = {}
        """REQUEST_UPDATE Request ID -> the request it updates (both directions)."""
        self._goaway_sent = False
        self._goaway_received = False
        self._dead_streams: set[StreamRef] = set()
        """Request streams of forgotten requests whose peer half is still open: their
        late bytes are ignored (QUIC's stream limit bounds how many there can be)."""
        self._sweep_at = 16
        self._peer_uni: set[StreamRef] = set()
        """Every unidirectional stream the peer opened (control and data)."""
        self._partial_requests: dict[StreamRef, m.ControlStreamDecoder] = {}
        """Peer bidi streams whose first message is still incomplete."""
        self.tokens = TokenCache(config.max_auth_token_cache_size)
        """Aliases of authorization tokens the peer registered (d21 section 8.9)."""
        self.setup_tokens: tuple[tuple[int, bytes], ...] = ()
        """Tokens the peer presented in its SETUP (type, value)."""
        self.publisher = Publisher(self._out, config)
        self.receiver = DataReceiver(self._out, config, self.requests, self._update_owner)

    # ------------------------------------------------------------------ getters

    @property
    def role(self) -> Role:
        return self.config.role

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def queued_bytes(self) -> int:
        """Object bytes queued for our live subscriptions, not yet pulled by the transport.

        A producer that outruns its link watches this to pace itself before the
        queue limit (``max_queued_bytes_per_subscription``) ends a subscriber.
        """
        return self.publisher.queued_bytes

    @property
    def held_requests(self) -> int:
        """Requests of ours held unsent until the peer's stream credit allows them."""
        return self._out.held

    @property
    def setup_complete(self) -> bool:
        return self._ready

    @property
    def _ready(self) -> bool:
        return self._peer_setup is not None and self._started

    @property
    def peer_setup(self) -> m.Setup | None:
        return self._peer_setup

    @property
    def peer_max_filter_ranges(self) -> int:
        return (self._peer_setup.max_filter_ranges or 0) if self._peer_setup else 0

    @property
    def peer_max_request_updates(self) -> int:
        return (self._peer_setup.max_request_updates or 0) if self._peer_setup else 0

    # ------------------------------------------------------------------ outputs

    def next_command(self) -> TransportCommand | None:
        return self._out.commands.popleft() if self._out.commands else None

    def next_event(self) -> ev.SessionEvent | None:
        return self._out.events.popleft() if self._out.events else None

    def get_timer(self) -> float | None:
        if self._closed:
            return None
        deadlines = [
            t
            for t in (
                self._timers.earliest(),
                self.publisher.next_deadline(),
                self.receiver.next_deadline(),
            )
            if t is not None
        ]
        return min(deadlines, default=None)

    def advance(self, now: float) -> None:
        """Move the session's clock forward to ``now`` without firing anything (an earlier
        ``now`` does nothing). Call it before appending to a store the session serves
        after a quiet spell: an object's OBJECT_DELIVERY_TIMEOUT runs from when it was
        handed over (d21 5.2), which the session knows only from the latest ``now`` it
        saw. Timers still fire only in :meth:`handle_timer`."""
        self._last_now = max(self._last_now, now)
        publisher = self.publisher
        publisher.now = max(publisher.now, now)

    def restoring(self, store: TrackStore | None) -> None:
        """Declare that objects appended to ``store`` from now until ``restoring(None)`` are
        *restores*: objects a cache evicted and fetched again, which every subscription
        served from ``store`` either already received or must get on a late fill stream
        (:mod:`.publishing` module docstring). Pure; for caches such as a relay."""
        self.publisher.restoring = store

    def poll_data(self, max_bytes: int) -> WriteStream | SendDatagram | None:
        """The next object data to send, at most ``max_bytes`` of it (pull-based, R9)."""
        if self._closed or self._peer_setup is None or not self._started:
            return None
        return self.publisher.poll_data(max_bytes, self._last_now)

    # ------------------------------------------------------------------ inputs

    def handle_transport_event(self, event: TransportEvent, now: float) -> None:
        """Feed one transport event. Never raises because of peer input."""
        if now != self._last_now:
            self._advance(now)
        if self._closed:
            return
        if (
            type(event) is StreamData
            and self._peer_setup is not None
            and self._started
            and event.stream in self.receiver.streams
        ):
            # the per-Object path: bytes of a data stream already classified (one choke
            # point all the same: a violation closes the session, nothing escapes)
            try:
                self.receiver.on_stream_data(event.stream, event.data, event.fin)
            except PeerViolation as v:
                self._close(v.code, v.reason, ev.Initiator.LOCAL)
            except CodecError as e:
                self._close(e.code, str(e), ev.Initiator.LOCAL)
            return
        self._guard(lambda: self._dispatch(event, now), now)
        if len(self.requests) >= self._sweep_at:
            self._sweep()

    def handle_timer(self, now: float) -> None:
        """Fire every deadline due at ``now``; early or repeated calls do nothing."""
        self._advance(now)
        if self._closed:
            return
        self._guard(lambda: self._fire_timers(now), now)

    def _advance(self, now: float) -> None:
        if now < self._last_now:
            raise LocalProtocolError(f"time went backwards: {now} < {self._last_now}")
        self._last_now = now

    def _guard(self, action: Callable[[], None], now: float) -> None:
        try:
            action()
        except PeerViolation as v:
            self._close(v.code, v.reason, ev.Initiator.LOCAL)
        except CodecError as e:
            self._close(e.code, str(e), ev.Initiator.LOCAL)

    # ------------------------------------------------------------------ commands

    def start(self, *, now: float) -> None:
        """Open our control stream and send SETUP (d21 section 9.1)."""
        self._advance(now)
        self._check_open()
        if self._started:
            raise LocalProtocolError("session already started")
        self._started = True
        cfg = self.config
        client = cfg.role is Role.CLIENT
        setup = m.Setup(
            path=cfg.path if client and not cfg.webtransport else None,
            authority=cfg.authority if client and not cfg.webtransport else None,
            max_filter_ranges=cfg.max_filter_ranges,
            max_request_updates=cfg.max_request_updates,
            max_auth_token_cache_size=cfg.max_auth_token_cache_size or None,
            moqt_implementation=cfg.implementation,
            authorization_tokens=tuple(
                p.AuthorizationToken.use_value(ttype, value) for ttype, value in cfg.setup_tokens
            ),
        )
        self._control_out = self._out.open_stream(uni=True, priority=0)
        self._out.send(self._control_out, setup)
        if self._peer_setup is None:
            self._timers.set(TimerKind.SETUP, now + cfg.setup_timeout)
        else:
            # replaying buffered peer input may find a violation: same choke point
            self._guard(self._setup_done, now)

    def subscribe(
        self,
        track: FullTrackName,
        *,
        now: float,
        location_filter: p.LocationFilter | None = None,
        fill: p.Parameters | None = None,
        forward: bool = True,
        priority: int = 128,
        group_order: GroupOrder = GroupOrder.ASCENDING,
        range_filters: Iterable[p.Parameter] = (),
        extra: Iterable[p.Parameter] = (),
    ) -> int:
        """SUBSCRIBE (d21 section 9.6). ``fill``: inner FILL_PARAMETERS (requests a fill).

        GROUP_ORDER is always sent explicitly (Ambiguity A6).
        """
        items: list[p.Parameter] = [
            p.SubscriberPriority(priority),
            p.GroupOrderParam(group_order),
            *range_filters,
            *extra,
        ]
        if location_filter is not None:
            items.append(location_filter)
        if fill is not None:
            items.append(p.FillParameters(fill))
        if not forward:
            items.append(p.Forward(0))
        params = p.Parameters(items)
        self._check_range_filter_budget(params)
        return self._send_request(
            ev.RequestKind.SUBSCRIBE,
            lambda rid: m.Subscribe(rid, track.namespace, track.name, params),
            now,
            track=track,
            params=params,
            group_order=group_order,
        )

    def fetch(
        self,
        track: FullTrackName,
        *,
        now: float,
        location_filter: p.LocationFilter | None = None,
        group_order: GroupOrder = GroupOrder.ASCENDING,
        priority: int = 128,
        range_filters: Iterable[p.Parameter] = (),
    ) -> int:
        """FETCH (d21 section 9.11) of ``location_filter``'s range (absent: the whole track)."""
        items: list[p.Parameter] = [
            p.SubscriberPriority(priority),
            p.GroupOrderParam(group_order),
            *range_filters,
        ]
        if location_filter is not None:
            items.append(location_filter)
        params = p.Parameters(items)
        self._check_range_filter_budget(params)
        return self._send_request(
            ev.RequestKind.FETCH,
            lambda rid: m.Fetch(rid, track.namespace, track.name, params),
            now,
            track=track,
            params=params,
            group_order=group_order,
        )

    def track_status(self, track: FullTrackName, *, now: float) -> int:
        """TRACK_STATUS (d21 section 9.13): LARGEST_OBJECT and Track Properties, no objects."""
        return self._send_request(
            ev.RequestKind.TRACK_STATUS,
            lambda rid: m.TrackStatus(rid, track.namespace, track.name, p.Parameters()),
            now,
            track=track,
        )

    def publish_namespace(self, namespace: TrackNamespace, *, now: float) -> int:
        """PUBLISH_NAMESPACE (d21 section 9.14): we can serve tracks under ``namespace``."""
        return self._send_request(
            ev.RequestKind.PUBLISH_NAMESPACE,
            lambda rid: m.PublishNamespace(rid, namespace, p.Parameters()),
            now,
            namespace=namespace,
        )

    def subscribe_namespace(self, prefix: TrackNamespace, *, now: float) -> int:
        """SUBSCRIBE_NAMESPACE (d21 section 9.15): learn namespaces under ``prefix``."""
        return self._send_request(
            ev.RequestKind.SUBSCRIBE_NAMESPACE,
            lambda rid: m.SubscribeNamespace(rid, prefix, p.Parameters()),
            now,
            namespace=prefix,
        )

    def request_update(self, request_id: int, params: p.Parameters, *, now: float) -> int:
        """REQUEST_UPDATE (d21 section 9.5) on one of our requests, or on a subscription the
        peer created with PUBLISH; returns the update's own Request ID."""
        self._advance(now)
        self._check_ready()
        rec = self._updatable(request_id)
        if rec.finished:
            raise LocalProtocolError(f"request {request_id} is finished")
        msg = m.RequestUpdate(self._next_request_id, params)
        try:
            m.check_request_update(msg, MESSAGE_OF_KIND[rec.kind])
        except CodecError as e:
            raise LocalProtocolError(f"REQUEST_UPDATE not allowed here: {e.reason}") from None
        limit = self.peer_max_request_updates
        if limit and len(rec.pending_updates) >= limit:
            raise LocalProtocolError(f"peer accepts at most {limit} unanswered updates")
        update_id = self._take_request_id()
        rec.pending_updates.append(update_id)
        self._update_owner[update_id] = request_id
        prefix = params.get(p.TrackNamespacePrefix)
        if prefix is not None:
            rec.pending_prefixes[update_id] = prefix.namespace
        self._out.send(rec.stream, msg)
        if rec.kind in (ev.RequestKind.SUBSCRIBE, ev.RequestKind.PUBLISH):
            self.receiver.note_update(rec, update_id, params)
        return update_id

    def _updatable(self, request_id: int) -> RequestRecord:
        rec = self.requests.get(request_id)
        if rec is not None and not rec.mine and rec.kind is ev.RequestKind.PUBLISH:
            return rec  # we are the subscriber of the peer's PUBLISH
        if rec is not None and rec.mine and rec.kind is ev.RequestKind.PUBLISH:
            raise LocalProtocolError("only the subscriber updates a PUBLISH subscription")
        return self._mine(request_id)

    def cancel(self, request_id: int, *, now: float) -> None:
        """Cancel one of our requests: reset our half, STOP_SENDING theirs (d21 6.4.2.3)."""
        self._advance(now)
        self._check_open()
        if request_id not in self.requests and 0 <= request_id < self._next_request_id:
            return  # finished and already forgotten
        rec = self._updatable(request_id)
        if rec.finished:
            return
        if self._out.drop_held(rec.stream):
            # never sent: nothing to reset, and no stream credit spent on it
            rec.local_fin = rec.peer_fin = True
        else:
            self._abort_request_stream(rec, StreamResetCode.CANCELLED)
        rec.state = RequestState.FAILED
        rec.cancelled = True
        self._timers.cancel_request(request_id)
        self.receiver.request_finished(rec)

    def goaway(self, new_session_uri: bytes = b"", timeout_ms: int = 0, *, now: float) -> None:
        """GOAWAY on the control stream (d21 section 9.2); clients must send an empty URI."""
        self._advance(now)
        self._check_ready()
        if self._goaway_sent:
            raise LocalProtocolError("GOAWAY already sent")
        if new_session_uri and self.config.role is Role.CLIENT:
            raise LocalProtocolError("a client's GOAWAY carries no URI")
        assert self._control_out is not None
        self._goaway_sent = True
        self._out.send(self._control_out, m.Goaway(new_session_uri, timeout_ms))
        if timeout_ms:
            self._timers.set(TimerKind.GOAWAY, now + timeout_ms / 1000)

    def close(self, code: int = SessionErrorCode.NO_ERROR, reason: str = "", *, now: float) -> None:
        """Close the session with a session error code (d21 section 12.2)."""
        self._advance(now)
        if self._closed:
            return
        self._close(code, reason, ev.Initiator.LOCAL)

    # -- answering the peer's requests

    def accept_subscribe(
        self,
        request_id: int,
        store: TrackStore,
        *,
        now: float,
        track_alias: int | None = None,
        expires_ms: int | None = None,
    ) -> None:
        """SUBSCRIBE_OK from ``store``; live objects and any fill follow (d21 3.1, 3.4)."""
        self._advance(now)
        rec = self._peer_pending(request_id, ev.RequestKind.SUBSCRIBE)
        self.publisher.accept_subscribe(rec, store, now, track_alias, expires_ms)
        rec.state = RequestState.ESTABLISHED
        self._answered(rec, now)

    def accept_fetch(
        self,
        request_id: int,
        store: TrackStore,
        *,
        now: float,
        end_location: Location | None = None,
        end_of_track: bool = False,
    ) -> None:
        """Serve a FETCH from ``store``: FETCH_OK, then the objects on a fetch stream.

        A cache that answers before the objects have arrived (its upstream's FETCH_OK
        in hand, the store :attr:`~.track_store.TrackStore.filling`) passes that answer's
        ``end_location`` and ``end_of_track``: the stream then sends each object of the
        range as it reaches the store, until :meth:`end_fetch` or End Location
        (:mod:`kvcs_core.moqt.publishing`, cut-through)."""
        self._advance(now)
        rec = self._peer_pending(request_id, ev.RequestKind.FETCH)
        if self.publisher.accept_fetch(rec, store, now, end_location, end_of_track):
            rec.state = RequestState.ESTABLISHED
        else:
            rec.state = RequestState.FAILED
        self._answered(rec, now)

    def end_fetch(self, request_id: int, *, ok: bool, now: float) -> None:
        """The source of a FETCH accepted with ``end_location`` is done: ``ok`` lets its
        stream FIN once drained; otherwise the stream is reset (INTERNAL_ERROR). Nothing
        for a FETCH that is already over."""
        self._advance(now)
        rec = self.requests.get(request_id)
        if rec is None or rec.mine or rec.kind is not ev.RequestKind.FETCH:
            return
        self.publisher.end_fetch(rec, ok=ok)

    def accept_track_status(self, request_id: int, store: TrackStore, *, now: float) -> None:
        """TRACK_STATUS_OK with LARGEST_OBJECT and Track Properties, then FIN (d21 9.13)."""
        self._advance(now)
        rec = self._peer_pending(request_id, ev.RequestKind.TRACK_STATUS)
        items: list[p.Parameter] = []
        if store.largest is not None:
            items.append(p.LargestObject(store.largest))
        # Ambiguity A8: never send EXPIRES in TRACK_STATUS_OK.
        self._out.send(
            rec.stream, m.RequestOk(p.Parameters(items), store.track_properties), fin=True
        )
        rec.local_fin = True
        rec.state = RequestState.DONE
        self._answered(rec, now)

    def accept_request(
        self, request_id: int, *, now: float, params: Iterable[p.Parameter] = ()
    ) -> None:
        """REQUEST_OK for a namespace request (PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, ...)."""
        self._advance(now)
        rec = self._peer_pending(request_id)
        if rec.kind not in _NAMESPACE_KINDS:
            raise LocalProtocolError(f"use the dedicated accept_* for {rec.kind.name}")
        msg = m.RequestOk(p.Parameters(params))
        try:
            m.check_request_ok(msg, MESSAGE_OF_KIND[rec.kind])
        except CodecError as e:
            raise LocalProtocolError(f"parameter not allowed here: {e.reason}") from None
        self._out.send(rec.stream, msg)
        rec.state = RequestState.ESTABLISHED
        self._answered(rec, now)

    def reject_request(
        self,
        request_id: int,
        code: RequestErrorCode,
        reason: str = "",
        *,
        now: float,
        retry_interval_ms: int | None = None,
    ) -> None:
        """REQUEST_ERROR, then FIN (d21 sections 9.4 and 6.4.2.2)."""
        self._advance(now)
        rec = self._peer_pending(request_id)
        self._refuse(rec, code, reason, retry_interval_ms)
        self._answered(rec, now)

    def send_namespace(self, request_id: int, suffix: TrackNamespace, *, now: float) -> None:
        """NAMESPACE on an accepted SUBSCRIBE_NAMESPACE (d21 section 9.16)."""
        self._advance(now)
        rec = self._peer_established(request_id, ev.RequestKind.SUBSCRIBE_NAMESPACE)
        rec.announced.add(suffix.fields)
        self._out.send(rec.stream, m.Namespace(suffix))

    def send_namespace_done(self, request_id: int, suffix: TrackNamespace, *, now: float) -> None:
        """NAMESPACE_DONE for a suffix announced earlier (d21 section 9.17)."""
        self._advance(now)
        rec = self._peer_established(request_id, ev.RequestKind.SUBSCRIBE_NAMESPACE)
        if suffix.fields not in rec.announced:
            raise LocalProtocolError("NAMESPACE_DONE for a namespace never announced")
        rec.announced.discard(suffix.fields)
        self._out.send(rec.stream, m.NamespaceDone(suffix))

    def end_subscription(
        self, request_id: int, status: int, reason: str = "", *, now: float
    ) -> None:
        """End a subscription we serve (a peer's SUBSCRIBE or our PUBLISH): let queued
        objects drain, FIN every stream, then PUBLISH_DONE and FIN (d21 9.9)."""
        self._advance(now)
        self._check_ready()
        rec = self.requests.get(request_id)
        served = rec is not None and (
            (rec.kind is ev.RequestKind.SUBSCRIBE and not rec.mine)
            or (rec.kind is ev.RequestKind.PUBLISH and rec.mine)
        )
        if (
            rec is None
            or not served
            or (
                rec.state is not RequestState.ESTABLISHED
                and not (rec.mine and rec.state is RequestState.PENDING)
            )
        ):
            raise LocalProtocolError(f"no subscription {request_id} served by us")
        self.publisher.end_subscription(rec, status, reason)
        rec.state = RequestState.DONE

    def publish(
        self,
        store: TrackStore,
        *,
        now: float,
        forward: bool = True,
        track_alias: int | None = None,
        extra: Iterable[p.Parameter] = (),
        group_order: GroupOrder | None = None,
        range_filters: Iterable[p.Parameter] = (),
        include_properties: bool = True,
    ) -> int:
        """PUBLISH (d21 9.8): offer ``store``'s track to the peer. Objects from the Next
        Object on flow at once when ``forward`` (even before PUBLISH_OK); with
        ``forward=False`` the subscriber starts them with a REQUEST_UPDATE (Ambiguity A15).
        GROUP_ORDER and FORWARD are written explicitly (d21 9.18.1).

        Args:
            extra: more initial settings the PUBLISH carries (SUBSCRIBER_PRIORITY, delivery
                timeouts, LOCATION_FILTER: wire reference 4.3), e.g. a SUBSCRIBE_TRACKS's.
            group_order: the subscription's group order (default: the track's).
            range_filters: range filters applied to the objects sent, not sent (a PUBLISH
                cannot carry them; those of a SUBSCRIBE_TRACKS, wire reference 5.1).
            include_properties: ``False`` sends empty Track Properties (INCLUDE_PROPERTIES
                0 in a SUBSCRIBE_TRACKS, wire reference 5.7).

        Raises:
            LocalProtocolError: a parameter a PUBLISH cannot carry, or invalid filters.
        """
        order = group_order if group_order is not None else store.group_order
        items: list[p.Parameter] = [
            p.Forward(1 if forward else 0),
            p.GroupOrderParam(order),
            *extra,
        ]
        if store.largest is not None:
            items.append(p.LargestObject(store.largest))
        try:
            params = p.Parameters(items)
            p.check_scope(params, PUBLISH_PARAMS, "PUBLISH")
            filters = RangeFilterSet.from_params(range_filters)
        except (CodecError, ValueError) as e:
            raise LocalProtocolError(f"bad PUBLISH parameters: {e}") from None
        props = store.track_properties if include_properties else ()
        alias = track_alias if track_alias is not None else self.publisher.take_alias()
        rid = self._send_request(
            ev.RequestKind.PUBLISH,
            lambda rid: m.Publish(rid, store.name.namespace, store.name.name, alias, params, props),
            now,
            track=store.name,
            params=params,
            group_order=order,
        )
        rec = self.requests[rid]
        rec.track_alias = alias
        self.publisher.start_publish(rec, store, now, alias, filters)
        return rid

    def open_publish_fill(self, request_id: int, fill: p.Parameters, *, now: float) -> bool:
        """Serve FILL_PARAMETERS on the subscription our PUBLISH created (Ambiguity A10:
        a SUBSCRIBE_TRACKS asked for them), once it is established with Forward 1: one
        fill named by the PUBLISH's Request ID, ending at the Largest Object the PUBLISH
        announced. Returns False when there is nothing to fill.

        Raises:
            LocalProtocolError: ``request_id`` is not an established PUBLISH of ours.
        """
        self._advance(now)
        self._check_ready()
        rec = self.requests.get(request_id)
        if (
            rec is None
            or not rec.mine
            or rec.kind is not ev.RequestKind.PUBLISH
            or rec.state is not RequestState.ESTABLISHED
        ):
            raise LocalProtocolError(f"no established PUBLISH {request_id} of ours")
        return self.publisher.open_publish_fill(rec, fill)

    def accept_publish(self, request_id: int, *, now: float, expires_ms: int | None = None) -> None:
        """PUBLISH_OK (REQUEST_OK answering PUBLISH, only EXPIRES allowed; d21 9.3)."""
        self._advance(now)
        rec = self._peer_pending(request_id, ev.RequestKind.PUBLISH)
        items = [p.Expires(expires_ms)] if expires_ms else []
        self._out.send(rec.stream, m.RequestOk(p.Parameters(items)))
        rec.state = RequestState.ESTABLISHED
        self._answered(rec, now)

    def subscribe_tracks(
        self,
        prefix: TrackNamespace,
        *,
        now: float,
        forward: bool = True,
        extra: Iterable[p.Parameter] = (),
    ) -> int:
        """SUBSCRIBE_TRACKS (d21 9.18): the peer PUBLISHes every matching track to us.
        ``extra``: more SUBSCRIBE parameters (the initial settings of each PUBLISH, B3;
        Ambiguity A10: send what the peer is known to accept)."""
        items: list[p.Parameter] = [*extra]
        if not forward:
            items.append(p.Forward(0))
        return self._send_request(
            ev.RequestKind.SUBSCRIBE_TRACKS,
            lambda rid: m.SubscribeTracks(rid, prefix, p.Parameters(items)),
            now,
            namespace=prefix,
        )

    def send_publish_skipped(self, request_id: int, track: FullTrackName, *, now: float) -> None:
        """PUBLISH_SKIPPED (d21 9.19) on an accepted SUBSCRIBE_TRACKS."""
        self._advance(now)
        rec = self._peer_established(request_id, ev.RequestKind.SUBSCRIBE_TRACKS)
        assert rec.namespace is not None
        suffix = track.namespace.suffix_after(rec.namespace)
        self._out.send(rec.stream, m.PublishSkipped(suffix, track.name))

    # ------------------------------------------------------------------ internals: requests

    def _answered(self, rec: RequestRecord, now: float) -> None:
        """The request got its answer: now the updates that overtook it (wire ref. 4.4)."""
        if rec.deferred_updates:
            self._guard(lambda: self._run_deferred_updates(rec, now), now)

    def _sweep(self) -> None:
        """Forget finished requests (amortised: runs when the table doubles), so that a
        long session does not keep every request it ever saw. A request is forgotten once
        it is finished, our half of its stream is closed, no data stream is bound to it
        and it is not draining (PUBLISH_DONE received, streams still due: forgetting it
        then dropped a fill whose stream arrived after the sweep); a still-open peer
        half is remembered only as a dead stream."""
        busy = {id(st.request) for st in self.receiver.streams.values() if st.request}
        gone: set[int] = set()
        for rid, rec in list(self.requests.items()):
            if not (rec.finished and rec.local_fin) or id(rec) in busy or rec.deferred_updates:
                continue
            if self.receiver.draining(rid):
                continue  # PUBLISH_DONE overtook its data streams: they may still come
            del self.requests[rid]
            gone.add(rid)
            if self._by_stream.get(rec.stream) is rec:
                del self._by_stream[rec.stream]
                if not rec.peer_fin:
                    self._dead_streams.add(rec.stream)
        if gone:
            for uid in [u for u, owner in self._update_owner.items() if owner in gone]:
                del self._update_owner[uid]
        self._sweep_at = max(16, 2 * len(self.requests))

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError("session is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if not self._started:
            raise LocalProtocolError("call start() first")

    def _check_range_filter_budget(self, params: p.Parameters) -> None:
        ranges = request_ranges(params)
        if ranges and self.setup_complete and ranges > self.peer_max_filter_ranges:
            raise LocalProtocolError(
                f"{ranges} filter ranges exceed the peer's MAX_FILTER_RANGES "
                f"({self.peer_max_filter_ranges})"
            )

    def _take_request_id(self) -> int:
        rid = self._next_request_id
        self._next_request_id += 2
        return rid

    def _send_request(
        self,
        kind: ev.RequestKind,
        build: Callable[[int], m.ControlMessageBase],
        now: float,
        *,
        track: FullTrackName | None = None,
        namespace: TrackNamespace | None = None,
        params: p.Parameters | None = None,
        group_order: GroupOrder = GroupOrder.ASCENDING,
    ) -> int:
        self._advance(now)
        self._check_ready()
        if self._goaway_received:
            raise LocalProtocolError("the peer sent GOAWAY: start no new requests")
        out = self._out
        if out.credit_exhausted and out.held >= self.config.max_held_requests:
            raise LocalProtocolError(
                f"too many requests waiting for stream credit ({out.held} held; "
                "the peer allows no more request streams now)"
            )
        rid = self._take_request_id()
        msg = build(rid)
        stream = self._out.open_stream(uni=False, priority=0)
        rec = RequestRecord(
            request_id=rid,
            kind=kind,
            stream=stream,
            mine=True,
            opened_at=now,
            decoder=m.ControlStreamDecoder(self.config.max_control_message_size),
            track=track,
            namespace=namespace,
            params=params or p.Parameters(),
            group_order=group_order,
        )
        self.requests[rid] = rec
        self._by_stream[stream] = rec
        self._out.send(stream, msg)
        if not self._out.is_held(stream):  # a held request's timer starts when it is sent
            self._timers.set_request(rid, now + self.config.request_timeout)
        return rid

    def _on_stream_credit(self, event: StreamCredit, now: float) -> None:
        """The peer's bidi stream credit grew: send held requests, start their timers."""
        for stream in self._out.grant_bidi(event.bidi):
            rec = self._by_stream.get(stream)
            if rec is not None and rec.mine and rec.state is RequestState.PENDING:
                rec.opened_at = now
                self._timers.set_request(rec.request_id, now + self.config.request_timeout)

    def _mine(self, request_id: int) -> RequestRecord:
        rec = self.requests.get(request_id)
        if rec is None or not rec.mine:
            raise LocalProtocolError(f"no request {request_id} of ours")
        return rec

    def _peer_pending(self, request_id: int, kind: ev.RequestKind | None = None) -> RequestRecord:
        self._check_ready()
        rec = self.requests.get(request_id)
        if rec is None or rec.mine:
            raise LocalProtocolError(f"no request {request_id} from the peer")
        if kind is not None and rec.kind is not kind:
            raise LocalProtocolError(f"request {request_id} is a {rec.kind.name}")
        if rec.state is not RequestState.PENDING:
            raise LocalProtocolError(f"request {request_id} was already answered")
        return rec

    def _peer_established(self, request_id: int, kind: ev.RequestKind) -> RequestRecord:
        self._check_ready()
        rec = self.requests.get(request_id)
        if rec is None or rec.mine or rec.kind is not kind:
            raise LocalProtocolError(f"no {kind.name} {request_id} from the peer")
        if rec.state is not RequestState.ESTABLISHED:
            raise LocalProtocolError(f"request {request_id} is not established")
        return rec

    # ------------------------------------------------------------------ internals: dispatch

    def _dispatch(self, event: TransportEvent, now: float) -> None:
        if type(event) is StreamData and self._ready and event.stream in self.receiver.streams:
            # the hot path: bytes of a data stream already classified
            self.receiver.on_stream_data(event.stream, event.data, event.fin)
            return
        if isinstance(event, TransportClosed):
            self._closed = True
            self._timers.clear()
            self.publisher.release()
            initiator = ev.Initiator.PEER if event.by_peer else ev.Initiator.TRANSPORT
            self._out.emit(
                ev.SessionClosed(code=event.code, reason=event.reason, initiator=initiator)
            )
            return
        if isinstance(event, StreamCredit):
            self._on_stream_credit(event, now)  # a transport fact: never waits for SETUP
            return
        if not self.setup_complete and not self._is_control_event(event):
            self._buffer_pre_setup(event)
            return
        if isinstance(event, StreamOpened):
            self._on_stream_opened(event)
        elif isinstance(event, StreamData):
            self._on_stream_data(event, now)
        elif isinstance(event, StreamAborted):
            self._on_stream_aborted(event, now)
        elif isinstance(event, DatagramReceived):
            self.receiver.on_datagram(event.data)

    def _is_control_event(self, event: TransportEvent) -> bool:
        """Before SETUP only the peer's control stream is processed; the rest waits."""
        if isinstance(event, StreamOpened):
            return event.uni  # classify uni streams by their first bytes
        if isinstance(event, StreamData | StreamAborted):
            s = event.stream
            if s == self._control_in or s in self._uni_pending:
                return True
            return s.local and s == self._control_out
        return False

    def _buffer_pre_setup(self, event: TransportEvent) -> None:
        if isinstance(event, DatagramReceived):
            return  # unreliable anyway: a datagram before SETUP is dropped, not buffered
        if isinstance(event, StreamData):
            self._pre_setup_bytes += len(event.data)
            if self._pre_setup_bytes > self.config.max_pre_setup_bytes:
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION,
                    "too much data before SETUP",
                )
            event = StreamData(stream=event.stream, data=bytes(event.data), fin=event.fin)
        self._pre_setup.append(event)

    def _on_stream_opened(self, event: StreamOpened) -> None:
        if event.uni:
            self._peer_uni.add(event.stream)
            self._uni_pending[event.stream] = bytearray()
        # a peer bidi stream becomes a request when its first message arrives

    def _on_stream_data(self, event: StreamData, now: float) -> None:
        s = event.stream
        if s in self._uni_pending:
            self._classify_uni(s, event, now)
        elif s == self._control_in:
            self._on_control_bytes(event.data, event.fin, now)
        elif s in self._by_stream:
            self._on_request_bytes(self._by_stream[s], event.data, event.fin, now)
        elif s in self._partial_requests:
            decoder = self._partial_requests[s]
            msgs = decoder.feed(event.data)
            if msgs:
                del self._partial_requests[s]
                self._open_peer_request(s, decoder, msgs, event.fin, now)
            elif event.fin:
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION, "request stream ended early"
                )
        elif s in self._peer_uni:
            self.receiver.on_stream_data(s, event.data, event.fin)
        elif s in self._dead_streams:
            if event.fin:
                self._dead_streams.discard(s)
        elif not s.local:
            self._new_peer_request_stream(s, event, now)

    def _classify_uni(self, s: StreamRef, event: StreamData, now: float) -> None:
        buf = self._uni_pending[s]
        if buf:
            buf += event.data
            pending: bytes | bytearray | memoryview = buf
        else:  # usual: the first piece holds the stream type; look at it without a copy
            pending = event.data
        kind = peek_uni_stream_type(pending)
        if kind is NEED_MORE:
            if not buf:
                buf += event.data
            if event.fin:
                del self._uni_pending[s]  # an empty or truncated stream: nothing to do
                if buf:
                    raise PeerViolation(
                        SessionErrorCode.PROTOCOL_VIOLATION, "truncated stream type"
                    )
            return
        del self._uni_pending[s]
        # the first piece often carries objects too (a subgroup stream opened by the
        # pull that writes its first objects): hand it on uncopied when it came whole
        data = bytes(buf) if buf else event.data
        if kind is UniStreamKind.CONTROL:
            if self._control_in is not None:
                raise PeerViolation(SessionErrorCode.PROTOCOL_VIOLATION, "second control stream")
            self._control_in = s
            self._on_control_bytes(data, event.fin, now)
            return
        if not self.setup_complete:
            # data stream before SETUP: keep it for replay (d21 section 6.3)
            self._buffer_pre_setup(StreamOpened(stream=s, uni=True))
            self._buffer_pre_setup(StreamData(stream=s, data=data, fin=event.fin))
            return
        self.receiver.on_new_stream(s, data, event.fin)

    # -- control stream

    def _on_control_bytes(self, data: bytes | memoryview, fin: bool, now: float) -> None:
        for msg in self._control_decoder.feed(data):
            self._on_control_message(msg, now)
        if fin:
            raise PeerViolation(SessionErrorCode.PROTOCOL_VIOLATION, "control stream closed")

    def _on_control_message(self, msg: m.ControlMessage, now: float) -> None:
        if self._peer_setup is None:
            if not isinstance(msg, m.Setup):
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION, "first control message is not SETUP"
                )
            self._on_setup(msg)
            return
        if isinstance(msg, m.Goaway):
            if self._goaway_received:
                raise PeerViolation(SessionErrorCode.PROTOCOL_VIOLATION, "second GOAWAY")
            if msg.new_session_uri and self.config.role is Role.SERVER:
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION, "a client's GOAWAY carried a URI"
                )
            self._goaway_received = True
            self._out.emit(
                ev.GoawayReceived(new_session_uri=msg.new_session_uri, timeout_ms=msg.timeout_ms)
            )
            return
        raise PeerViolation(
            SessionErrorCode.PROTOCOL_VIOLATION,
            f"{msg.TYPE.name} is not allowed on the control stream",
        )

    def _on_setup(self, setup: m.Setup) -> None:
        if self.config.role is Role.CLIENT and setup.path is not None:
            raise PeerViolation(SessionErrorCode.INVALID_PATH, "PATH from a server")
        if self.config.role is Role.CLIENT and setup.authority is not None:
            raise PeerViolation(SessionErrorCode.INVALID_AUTHORITY, "AUTHORITY from a server")
        if self.config.webtransport and setup.path is not None:
            raise PeerViolation(SessionErrorCode.INVALID_PATH, "PATH over WebTransport")
        if self.config.webtransport and setup.authority is not None:
            raise PeerViolation(SessionErrorCode.INVALID_AUTHORITY, "AUTHORITY over WebTransport")
        self.setup_tokens = self.tokens.resolve(setup.authorization_tokens, in_setup=True)
        self._peer_setup = setup
        if self._started:
            self._setup_done()

    def _setup_done(self) -> None:
        assert self._peer_setup is not None
        self._timers.cancel(TimerKind.SETUP)
        setup = self._peer_setup
        self._out.emit(
            ev.SetupCompleted(
                peer_implementation=setup.moqt_implementation,
                peer_max_filter_ranges=setup.max_filter_ranges or 0,
                peer_max_request_updates=setup.max_request_updates or 0,
            )
        )
        pending, self._pre_setup = self._pre_setup, []
        self._pre_setup_bytes = 0
        for event in pending:
            self._dispatch(event, self._last_now)

    # -- request streams

    def _on_request_bytes(
        self, rec: RequestRecord, data: bytes | memoryview, fin: bool, now: float
    ) -> None:
        for msg in rec.decoder.feed(data):
            if rec.mine:
                self._on_responder_message(rec, msg, now)
            else:
                self._on_requester_message(rec, msg, now)
        if fin:
            rec.decoder.close()  # FIN mid-message: PV (Ambiguity A19)
            rec.peer_fin = True
            if rec.mine:
                self._on_response_fin(rec)

    def _on_stream_aborted(self, event: StreamAborted, now: float) -> None:
        s = event.stream
        if s == self._control_in or (s.local and s == self._control_out):
            raise PeerViolation(SessionErrorCode.PROTOCOL_VIOLATION, "control stream reset")
        rec = self._by_stream.get(s)
        if rec is None:
            self._dead_streams.discard(s)
            self._uni_pending.pop(s, None)
            self.receiver.on_stream_aborted(event)
            self.publisher.on_stream_aborted(event)
            return
        if event.kind is AbortKind.RESET:
            rec.peer_fin = True
        if rec.finished:
            return
        if rec.mine:
            rec.state = RequestState.FAILED
            self._timers.cancel_request(rec.request_id)
            if rec.kind is ev.RequestKind.PUBLISH:
                self.publisher.cancel(rec)  # the subscriber of our PUBLISH cancelled
            self._out.emit(
                ev.RequestFailed(
                    request_id=rec.request_id,
                    code=event.code,
                    reason="request stream reset by the peer",
                )
            )
            self.receiver.request_finished(rec)
        else:
            # the peer cancelled its request (d21 6.4.2.3): stop serving it
            rec.state = RequestState.FAILED
            self.publisher.cancel(rec)
            self._abort_request_stream(rec, StreamResetCode.CANCELLED)
            self._out.emit(ev.RequestCancelled(request_id=rec.request_id, code=event.code))

    # ------------------------------------------------------------------ timers and closing

    def _fire_timers(self, now: float) -> None:
        for kind, key in self._timers.pop_expired(now):
            if kind is TimerKind.SETUP:
                raise PeerViolation(SessionErrorCode.CONTROL_MESSAGE_TIMEOUT, "no SETUP from peer")
            if kind is TimerKind.GOAWAY:
                # a request of ours still held for credit is not the peer staying
                if any(
                    not r.finished and not self._out.is_held(r.stream)
                    for r in self.requests.values()
                ):
                    raise PeerViolation(SessionErrorCode.GOAWAY_TIMEOUT, "peer did not leave")
            elif kind is TimerKind.REQUEST:
                rec = self.requests.get(key)
                if rec is not None and rec.state is RequestState.PENDING:
                    raise PeerViolation(
                        SessionErrorCode.CONTROL_MESSAGE_TIMEOUT, f"no answer to request {key}"
                    )
        self.publisher.on_timer(now)
        self.receiver.on_timer(now)

    def _close(self, code: int, reason: str, initiator: ev.Initiator) -> None:
        if self._closed:
            return
        self._closed = True
        self._timers.clear()
        self.publisher.release()
        self._out.close(code, reason)
        self._out.emit(ev.SessionClosed(code=code, reason=reason, initiator=initiator))
