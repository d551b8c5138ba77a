"""The relay's authorization gate: CAT tokens on sessions and requests (issue #14).

Theory of operation
-------------------
With ``RelayConfig.authorizer`` set, every session the relay owns as a
*downstream* session (``add_session(upstream=False)``: subscribers, and
publishers that connect to the relay) is held to its tokens
(:mod:`kvcs_core.auth.policy`); upstream sessions (those the relay opened
itself, to an origin or a parent relay) are trusted. Without an authorizer
nothing here runs: the relay is anonymous, exactly as before.

* **SETUP**: when the session's setup completes, its SETUP tokens are checked;
  refused -> the session is closed with UNAUTHORIZED (0x2),
  MALFORMED_AUTH_TOKEN (0x16) or EXPIRED_AUTH_TOKEN (0x18) before any request
  is served. What they grant is kept for the session's requests.
* **Requests** (:data:`ACTIONS`): PUBLISH_NAMESPACE, PUBLISH, SUBSCRIBE, FETCH,
  TRACK_STATUS, SUBSCRIBE_NAMESPACE and SUBSCRIBE_TRACKS are checked before the
  relay acts on them, with the request's own tokens (aliases resolved) and the
  session's; refused -> REQUEST_ERROR UNAUTHORIZED (0x1), MALFORMED_AUTH_TOKEN
  (0x4) or EXPIRED_AUTH_TOKEN (0x5), and the relay forgets the request (objects
  of a refused PUBLISH are dropped).
* **Discovery**: SUBSCRIBE_NAMESPACE and SUBSCRIBE_TRACKS on a prefix are
  allowed when a grant could cover something under it; each namespace is then
  announced (NAMESPACE) only if SUBSCRIBE_NAMESPACE is permitted on it, and each
  track PUBLISHed to a SUBSCRIBE_TRACKS subscriber only if SUBSCRIBE is
  permitted on it. Another scope's namespaces are never revealed.

* **Expiry**: a session lasts as long as the SETUP tokens that admitted it: when
  the last of them reaches its ``exp``, the relay closes the session with
  EXPIRED_AUTH_TOKEN (0x18), ending everything it subscribed to or published
  (:meth:`RelayAuth.deadline` joins the relay's timer).

REQUEST_UPDATEs are not re-authorized (the request was), and no grant is
revalidated otherwise (tokens with ``moqt-reval`` are refused,
:mod:`kvcs_core.auth.cat`).
"""

from __future__ import annotations

from typing import Any, Final

from kvcs_core.auth.cat import TokenStatus
from kvcs_core.auth.policy import Authorizer, Decision, SessionGrant
from kvcs_core.auth.scope import MoqtAction
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.wire.codes import SessionErrorCode
from kvcs_core.wire.names import FullTrackName, TrackNamespace

ACTIONS: Final[dict[type, MoqtAction]] = {
    ev.SubscribeRequested: MoqtAction.SUBSCRIBE,
    ev.FetchRequested: MoqtAction.FETCH,
    ev.TrackStatusRequested: MoqtAction.TRACK_STATUS,
    ev.PublishNamespaceRequested: MoqtAction.PUBLISH_NAMESPACE,
    ev.SubscribeNamespaceRequested: MoqtAction.SUBSCRIBE_NAMESPACE,
    ev.SubscribeTracksRequested: MoqtAction.SUBSCRIBE,
    ev.PublishRequested: MoqtAction.PUBLISH,
}
"""Request event -> the ``moqt`` claim action it needs (SUBSCRIBE_TRACKS, newer than
the draft's table, needs SUBSCRIBE: it delivers tracks)."""
_DISCOVERY: Final = frozenset({ev.SubscribeNamespaceRequested, ev.SubscribeTracksRequested})


class RelayAuth:
    """Per-session grants and the checks of the module docstring."""

    def __init__(self, authorizer: Authorizer) -> None:
        self.authorizer = authorizer
        self._grants: dict[int, SessionGrant] = {}
        """id(session) -> what its SETUP tokens grant (admitted sessions only)."""
        self._expiry: dict[int, tuple[float, MoqtSession]] = {}
        """id(session) -> (when its SETUP grant expires, in the relay's time; the session)."""
        self.refused_sessions = 0
        self.expired_sessions = 0

    def admit(self, session: MoqtSession, now: float) -> bool:
        """Check the SETUP tokens; close the session if they do not admit it."""
        decision, grant = self.authorizer.check_session(session.setup_tokens)
        if not decision.allowed:
            self.refused_sessions += 1
            if not session.is_closed:
                session.close(
                    decision.session_error(),
                    f"authorization: {decision.detail or decision.status.name}"[:1024],
                    now=now,
                )
            return False
        self._grants[id(session)] = grant
        self._schedule(session, grant, now)
        return True

    def _schedule(self, session: MoqtSession, grant: SessionGrant, now: float) -> None:
        """The session lasts as long as the last of its SETUP tokens that admit it."""
        ends: list[float] = []
        for c in grant.claims:
            if c.moqt is None or not c.moqt.allows_action(MoqtAction.CLIENT_SETUP):
                continue
            if c.expires is None:
                self._expiry.pop(id(session), None)
                return  # no exp: admitted for as long as it lasts
            ends.append(c.expires)
        if ends:
            left = max(ends) + self.authorizer.leeway - self.authorizer.clock()
            self._expiry[id(session)] = (now + max(left, 0.0), session)

    def deadline(self) -> float | None:
        """When the next admitted session's SETUP grant expires (relay time), if any."""
        return min((at for at, _s in self._expiry.values()), default=None)

    def expire(self, now: float) -> None:
        """Close the sessions whose SETUP grant has expired with EXPIRED_AUTH_TOKEN (0x18):
        what they subscribed, published or announced ends with them."""
        for key, (at, session) in list(self._expiry.items()):
            if at > now:
                continue
            grant = self._grants.get(key)
            if grant is not None and any(
                self.authorizer.clock() < (c.expires or 0.0) + self.authorizer.leeway
                for c in grant.claims
                if c.moqt is not None and c.moqt.allows_action(MoqtAction.CLIENT_SETUP)
            ):
                self._schedule(session, grant, now)  # the wall clock says not yet
                continue
            del self._expiry[key]
            self.expired_sessions += 1
            if not session.is_closed:
                session.close(
                    SessionErrorCode.EXPIRED_AUTH_TOKEN,
                    "authorization: the session's token expired",
                    now=now,
                )

    def grant(self, session: MoqtSession) -> SessionGrant | None:
        return self._grants.get(id(session))

    def check(self, session: MoqtSession, event: Any, now: float) -> Decision:
        """May ``event`` (a new request of ``session``) go ahead?"""
        grant = self._grants.get(id(session))
        if grant is None:  # not admitted (yet): its SETUP decides first
            if not session.setup_complete or not self.admit(session, now):
                return Decision(TokenStatus.NOT_PERMITTED, "session not authorized")
            grant = self._grants[id(session)]
        action = ACTIONS[type(event)]
        rec = session.requests.get(event.request_id)
        tokens = rec.tokens if rec is not None else ()
        if type(event) in _DISCOVERY:
            return self.authorizer.check_request(
                action, event.prefix.fields, None, tokens, grant, discover=True
            )
        if isinstance(event, ev.PublishNamespaceRequested):
            return self.authorizer.check_request(
                action, event.namespace.fields, None, tokens, grant
            )
        track: FullTrackName = event.track
        return self.authorizer.check_request(
            action, track.namespace.fields, track.name, tokens, grant
        )

    def may_see(self, session: MoqtSession, request_id: int, namespace: TrackNamespace) -> bool:
        """NAMESPACE for ``namespace`` may go to this SUBSCRIBE_NAMESPACE."""
        return self._visible(session, request_id, MoqtAction.SUBSCRIBE_NAMESPACE, namespace, None)

    def may_offer(self, session: MoqtSession, request_id: int, name: FullTrackName) -> bool:
        """PUBLISH of ``name`` may go to this SUBSCRIBE_TRACKS."""
        return self._visible(session, request_id, MoqtAction.SUBSCRIBE, name.namespace, name.name)

    def _visible(
        self,
        session: MoqtSession,
        request_id: int,
        action: MoqtAction,
        namespace: TrackNamespace,
        track: bytes | None,
    ) -> bool:
        grant = self._grants.get(id(session))
        if grant is None:
            return False
        rec = session.requests.get(request_id)
        tokens = rec.tokens if rec is not None else ()
        return self.authorizer.check_request(action, namespace.fields, track, tokens, grant).allowed

    def forget(self, session: MoqtSession) -> None:
        self._grants.pop(id(session), None)
        self._expiry.pop(id(session), None)


__all__ = ["ACTIONS", "RelayAuth"]
