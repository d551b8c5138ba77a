"""Answering a peer's request for a track from the TrackStore that holds it.

Theory of operation
-------------------
A KVCS publisher serves two kinds of tracks from its own
:class:`~kvcs_core.moqt.track_store.TrackStore` objects: a publication's
tracks (:mod:`.publisher`) and its KVSP index records (:mod:`._index_serving`,
KVSP binding 9). Both answer SUBSCRIBE, FETCH and TRACK_STATUS the same way
(d21 sections 9.7, 9.16, 9.18): nothing if the request is no longer pending
(the peer cancelled it first), REQUEST_ERROR DOES_NOT_EXIST for a track they do
not hold, else the session serves the request from the store. What follows an
accepted SUBSCRIBE differs between them, so :func:`answer_from_store` says
whether it accepted one.
"""

from __future__ import annotations

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire.codes import RequestErrorCode

TrackRequest = ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested


def answer_from_store(
    session: MoqtSession,
    event: TrackRequest,
    store: TrackStore | None,
    missing: str,
    now: float,
) -> bool:
    """Answer ``event`` from ``store`` (``None``: the track is not held, refused with
    DOES_NOT_EXIST and the reason ``missing``); ``True`` when a SUBSCRIBE was accepted."""
    rec = session.requests.get(event.request_id)
    if rec is None or rec.state is not RequestState.PENDING:
        return False  # cancelled by the peer before we could answer: nothing to do
    rid = event.request_id
    if store is None:
        session.reject_request(rid, RequestErrorCode.DOES_NOT_EXIST, missing, now=now)
    elif isinstance(event, ev.FetchRequested):
        session.accept_fetch(rid, store, now=now)
    elif isinstance(event, ev.TrackStatusRequested):
        session.accept_track_status(rid, store, now=now)
    else:
        session.accept_subscribe(rid, store, now=now)
        return True
    return False
