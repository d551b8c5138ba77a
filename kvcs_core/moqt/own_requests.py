"""Answers on the request streams we open: we are the requester (d21 sections 6.4.2, 9).

Theory of operation
-------------------
The first answer must match the request (SUBSCRIBE_OK to SUBSCRIBE, FETCH_OK to
FETCH, REQUEST_OK to the others) or be REQUEST_ERROR; anything else is
PROTOCOL_VIOLATION. Answers to our REQUEST_UPDATEs carry no ID and are matched
by order (wire reference 4.4). A subscription's stream may then carry
PUBLISH_STATE_NOTIFY and finally PUBLISH_DONE; a SUBSCRIBE_NAMESPACE stream
carries NAMESPACE / NAMESPACE_DONE (NAMESPACE_DONE before NAMESPACE is PV). The
responder's FIN before its answer fails the request; after it, on
SUBSCRIBE_NAMESPACE, it withdraws every announced namespace (d21 4.4).
"""

from __future__ import annotations

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role
from kvcs_core.moqt.core import SessionCore
from kvcs_core.moqt.errors import PeerViolation
from kvcs_core.moqt.requests import MESSAGE_OF_KIND, RequestRecord, RequestState
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import MessageType, RequestErrorCode, SessionErrorCode
from kvcs_core.wire.names import FullTrackName, TrackNamespace

_NAMESPACE_SCOPED = (
    ev.RequestKind.SUBSCRIBE_NAMESPACE,
    ev.RequestKind.PUBLISH_NAMESPACE,
    ev.RequestKind.SUBSCRIBE_TRACKS,
)


class OwnRequests(SessionCore):
    """Mixin: the requester side of request streams."""

    def _on_responder_message(self, rec: RequestRecord, msg: m.ControlMessage, now: float) -> None:
        """A message from the peer on a request stream we opened."""
        if rec.cancelled:
            # we reset the stream and sent STOP_SENDING (d21 6.4.2.3); bytes the peer sent
            # before seeing that may still be delivered: they answer nothing any more
            return
        if isinstance(msg, m.Goaway):
            if rec.goaway_seen:
                raise PeerViolation(SessionErrorCode.PROTOCOL_VIOLATION, "second GOAWAY on stream")
            rec.goaway_seen = True
            self._out.emit(
                ev.GoawayReceived(
                    new_session_uri=msg.new_session_uri,
                    timeout_ms=msg.timeout_ms,
                    request_id=rec.request_id,
                )
            )
            return
        if rec.state is RequestState.PENDING:
            self._on_first_answer(rec, msg)
            return
        if rec.kind is ev.RequestKind.PUBLISH and isinstance(msg, m.RequestUpdate):
            # the subscriber of our PUBLISH updates it (d21 9.5): same as a SUBSCRIBE's
            m.check_request_update(msg, MessageType.PUBLISH)
            self._take_peer_update(rec, msg)
            self._on_peer_update(rec, msg, now)
            return
        if rec.kind is not ev.RequestKind.PUBLISH and self._on_publisher_message(rec, msg):
            return
        if rec.kind is ev.RequestKind.SUBSCRIBE_NAMESPACE and isinstance(
            msg, m.Namespace | m.NamespaceDone
        ):
            self._on_namespace_message(rec, msg)
            return
        raise PeerViolation(
            SessionErrorCode.PROTOCOL_VIOLATION,
            f"{msg.TYPE.name} not expected on a {rec.kind.name} stream",
        )

    def _on_publisher_message(self, rec: RequestRecord, msg: m.ControlMessage) -> bool:
        """What a publisher sends to the subscriber of a subscription (or any requester):
        answers to our REQUEST_UPDATEs, PUBLISH_STATE_NOTIFY, PUBLISH_DONE. False if not one."""
        if isinstance(msg, m.RequestOk | m.RequestError):
            if not rec.pending_updates:
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION, f"unsolicited {msg.TYPE.name}"
                )
            update_id = rec.pending_updates.popleft()
            prefix = rec.pending_prefixes.pop(update_id, None)
            # keep update_id -> request: a fill stream naming it may still arrive (d21 3.4)
            if isinstance(msg, m.RequestOk):
                m.check_request_ok(msg, MessageType.REQUEST_UPDATE)
                if prefix is not None:
                    rec.change_prefix(prefix)
                largest = msg.params.get(p.LargestObject)
                if largest is not None:
                    rec.largest = largest.location
                self._out.emit(
                    ev.RequestAccepted(
                        request_id=rec.request_id,
                        kind=rec.kind,
                        params=msg.params,
                        update_id=update_id,
                    )
                )
            else:
                self._check_redirect(rec, msg)
                self._out.emit(self._failed(rec.request_id, msg, update_id))
            return True
        subscription = rec.kind in (ev.RequestKind.SUBSCRIBE, ev.RequestKind.PUBLISH)
        if subscription and isinstance(msg, m.PublishDone):
            rec.state = RequestState.DONE
            done = ev.PublishDoneReceived(
                request_id=rec.request_id,
                status=int(msg.status_code),
                stream_count=msg.stream_count,
                reason=msg.reason.decode("utf-8", "replace"),
            )
            # emitted by the receiver once the counted streams have ended (or the grace
            # passed), so that nothing of the subscription arrives after the event
            self.receiver.publish_done(rec, done, self._last_now)
            return True
        if subscription and isinstance(msg, m.PublishStateNotify):
            largest = msg.params.get(p.LargestObject)
            if largest is not None:
                rec.largest = largest.location
            return True
        if rec.kind is ev.RequestKind.SUBSCRIBE_TRACKS and isinstance(msg, m.PublishSkipped):
            assert rec.namespace is not None
            self._out.emit(
                ev.PublishSkippedReceived(
                    request_id=rec.request_id,
                    track=FullTrackName(rec.namespace + msg.suffix, msg.name),
                )
            )
            return True
        return False

    def _check_redirect(self, rec: RequestRecord, msg: m.RequestError) -> None:
        """Appendix A: a Redirect Connect URI received by a server, or a Track Name in a
        namespace-scoped Redirect (wire reference 4.3), is PROTOCOL_VIOLATION."""
        redirect = msg.redirect
        if redirect is None:
            return
        if redirect.connect_uri and self.config.role is Role.SERVER:
            raise PeerViolation(
                SessionErrorCode.PROTOCOL_VIOLATION, "a server got a Redirect Connect URI"
            )
        if redirect.track_name and rec.kind in _NAMESPACE_SCOPED:
            raise PeerViolation(
                SessionErrorCode.PROTOCOL_VIOLATION,
                f"a Redirect answering {rec.kind.name} names a track",
            )

    def _on_first_answer(self, rec: RequestRecord, msg: m.ControlMessage) -> None:
        self._timers.cancel_request(rec.request_id)
        if isinstance(msg, m.RequestError):
            self._check_redirect(rec, msg)
            rec.state = RequestState.FAILED
            self._out.emit(self._failed(rec.request_id, msg, None))
            self.receiver.request_finished(rec)
            if rec.kind is ev.RequestKind.PUBLISH:
                self.publisher.cancel(rec)  # refused: stop the objects already flowing
            return
        kind = rec.kind
        if kind is ev.RequestKind.SUBSCRIBE and isinstance(msg, m.SubscribeOk):
            self._check_alias(msg.track_alias, rec)
            largest = msg.params.get(p.LargestObject)
            expires = msg.params.get(p.Expires)
            rec.state = RequestState.ESTABLISHED
            rec.track_alias = msg.track_alias
            rec.largest = largest.location if largest else None
            self.receiver.subscription_established(rec, msg.track_alias, msg.track_properties)
            self._out.emit(
                ev.SubscribeAccepted(
                    request_id=rec.request_id,
                    track_alias=msg.track_alias,
                    largest=rec.largest,
                    expires_ms=expires.ms if expires else None,
                    track_properties=msg.track_properties,
                )
            )
        elif kind is ev.RequestKind.FETCH and isinstance(msg, m.FetchOk):
            lf = rec.params.get(p.LocationFilter)
            start = lf.start if lf is not None else None
            if start is not None and msg.end_location < start:
                # wire reference 4.3: End Location before the request's start is PV
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION, "FETCH_OK ends before the FETCH's start"
                )
            rec.state = RequestState.ESTABLISHED
            rec.largest = msg.end_location
            self._out.emit(
                ev.FetchAccepted(
                    request_id=rec.request_id,
                    end_of_track=msg.end_of_track,
                    end_location=msg.end_location,
                    track_properties=msg.track_properties,
                )
            )
            self.receiver.fetch_accepted(rec)
        elif kind not in (ev.RequestKind.SUBSCRIBE, ev.RequestKind.FETCH) and isinstance(
            msg, m.RequestOk
        ):
            m.check_request_ok(msg, MESSAGE_OF_KIND[kind])
            rec.state = (
                RequestState.DONE
                if kind is ev.RequestKind.TRACK_STATUS
                else RequestState.ESTABLISHED
            )
            largest = msg.params.get(p.LargestObject)
            rec.largest = largest.location if largest else None
            self._out.emit(
                ev.RequestAccepted(
                    request_id=rec.request_id,
                    kind=kind,
                    params=msg.params,
                    track_properties=msg.track_properties,
                )
            )
        else:
            raise PeerViolation(
                SessionErrorCode.PROTOCOL_VIOLATION, f"{msg.TYPE.name} cannot answer {kind.name}"
            )

    def _on_namespace_message(self, rec: RequestRecord, msg: m.Namespace | m.NamespaceDone) -> None:
        assert rec.namespace is not None
        full = rec.namespace + msg.suffix
        if isinstance(msg, m.Namespace):
            rec.announced.add(msg.suffix.fields)
            self._out.emit(ev.NamespaceAnnounced(request_id=rec.request_id, namespace=full))
        else:
            if msg.suffix.fields not in rec.announced:
                raise PeerViolation(
                    SessionErrorCode.PROTOCOL_VIOLATION, "NAMESPACE_DONE before NAMESPACE"
                )
            rec.announced.discard(msg.suffix.fields)
            self._out.emit(ev.NamespaceWithdrawn(request_id=rec.request_id, namespace=full))

    def _on_response_fin(self, rec: RequestRecord) -> None:
        """The responder finished its half: final for TRACK_STATUS / errors, else an end."""
        if rec.state is RequestState.PENDING:
            rec.state = RequestState.FAILED
            self._timers.cancel_request(rec.request_id)
            self._out.emit(
                ev.RequestFailed(
                    request_id=rec.request_id,
                    code=RequestErrorCode.INTERNAL_ERROR,
                    reason="request stream ended before an answer",
                )
            )
        elif (
            rec.state is RequestState.ESTABLISHED and rec.kind is ev.RequestKind.SUBSCRIBE_NAMESPACE
        ):
            # d21 4.4: FIN of the response direction = every announced namespace ended
            assert rec.namespace is not None
            for suffix in sorted(rec.announced):
                self._out.emit(
                    ev.NamespaceWithdrawn(
                        request_id=rec.request_id, namespace=rec.namespace + TrackNamespace(suffix)
                    )
                )
            rec.announced.clear()
            rec.state = RequestState.DONE
        if not rec.local_fin:
            self._out.write(rec.stream, fin=True)
            rec.local_fin = True
