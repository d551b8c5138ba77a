"""State and helpers shared by ``MoqtSession`` and the two halves of its request handling.

Theory of operation
-------------------
A session's request handling splits by who opened the request stream
(d21 section 6.4.2): :mod:`.peer_requests` handles streams the peer opened (we
are the responder), :mod:`.own_requests` handles answers on streams we opened.
Both are mixins of :class:`~kvcs_core.moqt.session.MoqtSession`; this base
declares the state they share and the three helpers both use (refusing a
request, cancelling a request stream, turning REQUEST_ERROR into an event).
"""

from __future__ import annotations

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.auth import TokenCache
from kvcs_core.moqt.config import SessionConfig
from kvcs_core.moqt.errors import PeerViolation
from kvcs_core.moqt.output import Output
from kvcs_core.moqt.publishing import Publisher
from kvcs_core.moqt.receiving import DataReceiver
from kvcs_core.moqt.requests import RequestIdTracker, RequestRecord, RequestState
from kvcs_core.moqt.timers import Deadlines
from kvcs_core.moqt.transport_io import AbortKind, StreamRef
from kvcs_core.wire import messages as m
from kvcs_core.wire.codes import SessionErrorCode


class SessionCore:
    """Declarations of the session state the request-handling mixins use."""

    config: SessionConfig
    requests: dict[int, RequestRecord]
    publisher: Publisher
    receiver: DataReceiver
    _out: Output
    _timers: Deadlines
    _peer_ids: RequestIdTracker
    _by_stream: dict[StreamRef, RequestRecord]
    _update_owner: dict[int, int]
    _partial_requests: dict[StreamRef, m.ControlStreamDecoder]
    _goaway_sent: bool
    _last_now: float
    tokens: TokenCache

    def _check_alias(self, alias: int, rec: RequestRecord) -> None:
        """d21 3.1.2: an alias that names another track of a live subscription we receive
        (our SUBSCRIBE or the peer's PUBLISH) is DUPLICATE_TRACK_ALIAS."""
        for other in self.requests.values():
            if other is rec or other.finished or other.track_alias != alias:
                continue
            ours = (other.kind is ev.RequestKind.SUBSCRIBE and other.mine) or (
                other.kind is ev.RequestKind.PUBLISH and not other.mine
            )
            if ours and other.track != rec.track:
                raise PeerViolation(
                    SessionErrorCode.DUPLICATE_TRACK_ALIAS, f"Track Alias {alias} in use"
                )

    def _run_deferred_updates(self, rec: RequestRecord, now: float) -> None:
        """Answer REQUEST_UPDATEs that arrived before the request's own answer."""
        deferred, rec.deferred_updates = rec.deferred_updates, []
        for msg in deferred:
            assert isinstance(msg, m.RequestUpdate)
            if rec.finished:
                rec.pending_updates.clear()
                return
            self._on_peer_update(rec, msg, now)

    # implemented by the mixins, used across them
    def _take_peer_update(self, rec: RequestRecord, msg: m.RequestUpdate) -> None:
        raise NotImplementedError

    def _on_peer_update(self, rec: RequestRecord, msg: m.RequestUpdate, now: float) -> None:
        raise NotImplementedError

    def _on_publisher_message(self, rec: RequestRecord, msg: m.ControlMessage) -> bool:
        raise NotImplementedError

    def _refuse(
        self, rec: RequestRecord, code: int, reason: str, retry_after_ms: int | None = None
    ) -> None:
        self._out.send(
            rec.stream,
            # d21 9.4.2: Retry Interval is the minimum delay in ms plus one; 0 = do not retry
            m.RequestError(
                code, 0 if retry_after_ms is None else retry_after_ms + 1, reason.encode()[:1024]
            ),
            fin=True,
        )
        rec.local_fin = True
        rec.state = RequestState.FAILED

    def _abort_request_stream(self, rec: RequestRecord, code: int) -> None:
        if not rec.local_fin:
            self._out.abort(rec.stream, AbortKind.RESET, code)
            rec.local_fin = True
        if not rec.peer_fin:
            self._out.abort(rec.stream, AbortKind.STOP_SENDING, code)

    def _failed(
        self, request_id: int, msg: m.RequestError, update_id: int | None
    ) -> ev.RequestFailed:
        return ev.RequestFailed(
            request_id=request_id,
            code=int(msg.error_code),
            reason=msg.reason.decode("utf-8", "replace"),
            retry_interval_ms=msg.retry_interval - 1 if msg.retry_interval else None,
            redirect=msg.redirect,
            update_id=update_id,
        )
