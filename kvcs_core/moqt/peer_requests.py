"""Requests the peer opens: we are the responder (d21 sections 6.4.2, 9.5-9.18).

Theory of operation
-------------------
The first message on a peer's bidirectional stream must be a request (SUBSCRIBE,
FETCH, TRACK_STATUS, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS,
PUBLISH), else PROTOCOL_VIOLATION; its Request ID must have the peer's parity
and be new, else INVALID_REQUEST_ID. Requests the application must decide on
become ``*Requested`` events; refusals the session can decide alone (load,
GOAWAY, bad range filters, PREFIX_OVERLAP, unsupported request types) are
answered here with REQUEST_ERROR, leaving the session up. Later messages from
the requester are REQUEST_UPDATE (counted against MAX_REQUEST_UPDATES, d21
9.5) and GOAWAY (Ambiguity A22: accepted from either side); anything else is
PROTOCOL_VIOLATION.
"""

from __future__ import annotations

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.core import SessionCore
from kvcs_core.moqt.errors import PeerViolation
from kvcs_core.moqt.requests import MESSAGE_OF_KIND, REQUEST_KIND_OF, RequestRecord, RequestState
from kvcs_core.moqt.transport_io import StreamData, StreamRef
from kvcs_core.moqt.windows import request_ranges
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import GroupOrder, MessageType, RequestErrorCode, SessionErrorCode
from kvcs_core.wire.filters import invalid_filter_reason


class PeerRequests(SessionCore):
    """Mixin: the responder side of request streams."""

    def _new_peer_request_stream(self, s: StreamRef, event: StreamData, now: float) -> None:
        decoder = m.ControlStreamDecoder(self.config.max_control_message_size)
        msgs = decoder.feed(event.data)
        if not msgs:
            if event.fin:
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION, "request stream ended early"
                )
            # keep the partial first message under a placeholder record-less decoder
            self._partial_requests[s] = decoder
            return
        self._open_peer_request(s, decoder, msgs, event.fin, now)

    def _open_peer_request(
        self,
        s: StreamRef,
        decoder: m.ControlStreamDecoder,
        msgs: list[m.ControlMessage],
        fin: bool,
        now: float,
    ) -> None:
        first = msgs[0]
        kind = REQUEST_KIND_OF.get(first.TYPE)
        if kind is None:
            raise PeerViolation(
                SessionErrorCode.PROTOCOL_VIOLATION,
                f"{first.TYPE.name} cannot open a request stream",
            )
        rid: int = getattr(first, "request_id")  # noqa: B009 - every request type has one
        if not self._peer_ids.accept(rid):
            raise PeerViolation(SessionErrorCode.INVALID_REQUEST_ID, f"bad Request ID {rid}")
        rec = RequestRecord(
            request_id=rid, kind=kind, stream=s, mine=False, opened_at=now, decoder=decoder
        )
        self.requests[rid] = rec
        self._by_stream[s] = rec
        first_params: p.Parameters | None = getattr(first, "params", None)
        if first_params is not None:
            rec.tokens = self.tokens.resolve(first_params.all(p.AuthorizationToken))
        self._on_peer_request(rec, first, now)
        for msg in msgs[1:]:
            self._on_requester_message(rec, msg, now)
        if fin:
            rec.peer_fin = True

    def _on_peer_request(self, rec: RequestRecord, msg: m.ControlMessage, now: float) -> None:
        """The first message of a peer's request stream."""
        live = sum(1 for r in self.requests.values() if not r.mine and not r.finished)
        if live > self.config.max_concurrent_peer_requests:
            self._refuse(
                rec,
                RequestErrorCode.EXCESSIVE_LOAD,
                "too many requests",
                self.config.retry_interval_ms,
            )
            return
        if self._goaway_sent:
            self._refuse(rec, RequestErrorCode.GOING_AWAY, "going away")
            return
        if isinstance(msg, m.Subscribe | m.Fetch | m.TrackStatus):
            rec.track = msg.track
            rec.params = msg.params
            order = msg.params.get(p.GroupOrderParam)
            rec.group_order = order.order if order else GroupOrder.ASCENDING
            bad = self._bad_filters(msg.params)
            if bad is not None:
                self._refuse(rec, RequestErrorCode.INVALID_FILTER, bad)
                return
            if isinstance(msg, m.Subscribe):
                self._out.emit(
                    ev.SubscribeRequested(
                        request_id=rec.request_id, track=msg.track, params=msg.params
                    )
                )
            elif isinstance(msg, m.Fetch):
                self._out.emit(
                    ev.FetchRequested(request_id=rec.request_id, track=msg.track, params=msg.params)
                )
            else:
                self._out.emit(
                    ev.TrackStatusRequested(
                        request_id=rec.request_id, track=msg.track, params=msg.params
                    )
                )
        elif isinstance(msg, m.PublishNamespace):
            rec.namespace = msg.namespace
            rec.params = msg.params
            self._out.emit(
                ev.PublishNamespaceRequested(
                    request_id=rec.request_id, namespace=msg.namespace, params=msg.params
                )
            )
        elif isinstance(msg, m.SubscribeNamespace):
            rec.namespace = msg.prefix
            rec.params = msg.params
            overlap = self._prefix_overlap(rec)
            if overlap:
                self._refuse(rec, RequestErrorCode.PREFIX_OVERLAP, "prefix overlaps another")
                return
            self._out.emit(
                ev.SubscribeNamespaceRequested(
                    request_id=rec.request_id, prefix=msg.prefix, params=msg.params
                )
            )
        elif isinstance(msg, m.SubscribeTracks):
            rec.namespace = msg.prefix
            rec.params = msg.params
            if self._prefix_overlap(rec):
                self._refuse(rec, RequestErrorCode.PREFIX_OVERLAP, "prefix overlaps another")
                return
            bad = self._bad_filters(msg.params)
            if bad is not None:  # wire reference 5.5, as for SUBSCRIBE
                self._refuse(rec, RequestErrorCode.INVALID_FILTER, bad)
                return
            self._out.emit(
                ev.SubscribeTracksRequested(
                    request_id=rec.request_id, prefix=msg.prefix, params=msg.params
                )
            )
        elif isinstance(msg, m.Publish):
            self._on_peer_publish(rec, msg)

    def _on_peer_publish(self, rec: RequestRecord, msg: m.Publish) -> None:
        """PUBLISH (d21 9.8): objects may flow before our PUBLISH_OK unless FORWARD is 0."""
        rec.track = msg.track
        self._check_alias(msg.track_alias, rec)
        rec.params = msg.params
        rec.track_alias = msg.track_alias
        order = msg.params.get(p.GroupOrderParam)
        rec.group_order = order.order if order else GroupOrder.ASCENDING
        largest = msg.params.get(p.LargestObject)
        rec.largest = largest.location if largest else None
        self.receiver.subscription_established(rec, msg.track_alias, msg.track_properties)
        self._out.emit(
            ev.PublishRequested(
                request_id=rec.request_id,
                track=msg.track,
                track_alias=msg.track_alias,
                params=msg.params,
                track_properties=msg.track_properties,
            )
        )

    def _bad_filters(self, params: p.Parameters) -> str | None:
        """REQUEST_ERROR INVALID_FILTER reasons (d21 3.3.2; wire reference 5.5)."""
        reason = invalid_filter_reason(list(params))
        if reason is not None:
            return reason
        for fp in params.all(p.FillParameters):
            inner = invalid_filter_reason(list(fp.params))
            if inner is not None:
                return inner
        ranges = request_ranges(params)
        if ranges > self.config.max_filter_ranges:
            return f"{ranges} ranges exceed MAX_FILTER_RANGES {self.config.max_filter_ranges}"
        has_filter = any(isinstance(f, p.RangeFilter) for f in params)
        if has_filter and self.config.max_filter_ranges == 0:
            return "range filters were not allowed (MAX_FILTER_RANGES 0)"
        return None

    def _prefix_overlap(self, rec: RequestRecord) -> bool:
        """Ambiguity A21: overlap iff one prefix is a field-wise prefix of the other."""
        assert rec.namespace is not None
        for other in self.requests.values():
            if (
                other is rec
                or other.mine
                or other.kind is not rec.kind
                or other.finished  # pending ones count too: both could be accepted otherwise
                or other.namespace is None
            ):
                continue
            if other.namespace.is_prefix_of(rec.namespace) or rec.namespace.is_prefix_of(
                other.namespace
            ):
                return True
        return False

    def _on_requester_message(self, rec: RequestRecord, msg: m.ControlMessage, now: float) -> None:
        """A later message from the peer on a request stream it opened."""
        if isinstance(msg, m.RequestUpdate):
            if rec.kind is ev.RequestKind.PUBLISH:
                # Ambiguity A23: the PUBLISH sender may update (token only); accept it
                m.check_request_update(msg, MessageType.PUBLISH, from_publisher=True)
                self._take_peer_update(rec, msg)
                rec.pending_updates.pop()
                self._out.send(rec.stream, m.RequestOk(p.Parameters()))
                return
            m.check_request_update(msg, MESSAGE_OF_KIND[rec.kind])
            self._take_peer_update(rec, msg)
            self._on_peer_update(rec, msg, now)
        elif isinstance(msg, m.Goaway):
            if rec.goaway_seen:
                raise PeerViolation(SessionErrorCode.PROTOCOL_VIOLATION, "second GOAWAY on stream")
            rec.goaway_seen = True  # Ambiguity A22: accepted from either side
            self._out.emit(
                ev.GoawayReceived(
                    new_session_uri=msg.new_session_uri,
                    timeout_ms=msg.timeout_ms,
                    request_id=rec.request_id,
                )
            )
        elif rec.kind is ev.RequestKind.PUBLISH and self._on_publisher_message(rec, msg):
            return  # we subscribe to the peer's PUBLISH: its answers, notifications, done
        else:
            raise PeerViolation(
                SessionErrorCode.PROTOCOL_VIOLATION,
                f"{msg.TYPE.name} from the requester of a {rec.kind.name}",
            )

    def _take_peer_update(self, rec: RequestRecord, msg: m.RequestUpdate) -> None:
        """Count a peer REQUEST_UPDATE: its ID (d21 6.4.2.1) and MAX_REQUEST_UPDATES (9.5)."""
        if not self._peer_ids.accept(msg.request_id):
            raise PeerViolation(
                SessionErrorCode.INVALID_REQUEST_ID, f"bad Request ID {msg.request_id}"
            )
        rec.pending_updates.append(msg.request_id)
        limit = self.config.max_request_updates
        if limit and len(rec.pending_updates) > limit:
            raise PeerViolation(
                SessionErrorCode.TOO_MANY_REQUEST_UPDATES, "too many REQUEST_UPDATEs"
            )
        self._update_owner[msg.request_id] = rec.request_id
        presented = self.tokens.resolve(msg.params.all(p.AuthorizationToken))
        if presented:
            rec.tokens = presented

    def _on_peer_update(self, rec: RequestRecord, msg: m.RequestUpdate, now: float) -> None:
        if rec.state is RequestState.PENDING:
            # answers match by order: this one must follow the request's own answer
            rec.deferred_updates.append(msg)
            return
        update_id = rec.pending_updates.popleft()
        if rec.finished:
            return  # the request ended (refused, cancelled): nothing to answer on
        if rec.state is not RequestState.ESTABLISHED:
            self._out.send(
                rec.stream,
                m.RequestError(RequestErrorCode.NOT_SUPPORTED, 0, b"request not established"),
            )
            return
        if rec.kind in (ev.RequestKind.SUBSCRIBE, ev.RequestKind.PUBLISH):
            bad = self._bad_filters(msg.params)
            if bad is not None:
                self._out.send(
                    rec.stream,
                    m.RequestError(RequestErrorCode.INVALID_FILTER, 0, bad.encode()[:1024]),
                )
                # d21 9.5.1: a failed update ends the subscription (PUBLISH_DONE UPDATE_FAILED)
                self.publisher.end_subscription(rec, 0x8, "update failed")
                rec.state = RequestState.DONE
                return
            self.publisher.update_subscription(rec, update_id, msg.params, now)
        elif (prefix := msg.params.get(p.TrackNamespacePrefix)) is not None:
            old = rec.namespace
            rec.namespace = prefix.namespace
            if self._prefix_overlap(rec):
                rec.namespace = old
                self._out.send(
                    rec.stream,
                    m.RequestError(RequestErrorCode.PREFIX_OVERLAP, 0, b"prefix overlaps another"),
                )
                return
            rec.namespace = old
            rec.change_prefix(prefix.namespace)
            self._out.send(rec.stream, m.RequestOk(p.Parameters()))
        else:
            self._out.send(rec.stream, m.RequestOk(p.Parameters()))
        self._out.emit(
            ev.RequestUpdated(request_id=rec.request_id, update_id=update_id, params=msg.params)
        )
