"""Authorization decisions for a relay: tokens presented -> allowed, or which error.

Theory of operation
-------------------
An :class:`Authorizer` holds the trusted issuer keys and a wall clock *passed
in* (seconds since the Unix epoch; the core reads no clock). It answers two
questions, with MOQT's error codes (wire reference 8):

* **session** (:meth:`Authorizer.check_session`): the CAT tokens of the
  peer's SETUP. A malformed one -> close MALFORMED_AUTH_TOKEN (0x16); a valid
  one whose ``moqt`` claim lists CLIENT_SETUP admits the session (its claims
  then apply to every request of the session); otherwise an expired one ->
  EXPIRED_AUTH_TOKEN (0x18), anything else (no token, unknown issuer, bad
  signature, no CLIENT_SETUP) -> UNAUTHORIZED (0x2).
* **request** (:meth:`Authorizer.check_request`): an action on a namespace
  (and track). It is allowed when a valid token permits it: one on the request
  itself, or one of the session's (re-checked for expiry now). Otherwise a
  malformed token on the request -> REQUEST_ERROR MALFORMED_AUTH_TOKEN (0x4);
  an expired one (on the request, or a session token that would have permitted
  it) -> EXPIRED_AUTH_TOKEN (0x5); else UNAUTHORIZED (0x1).

Tokens whose Token Type is not CAT (0x01) are ignored: they grant nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs

from kvcs_core.auth.cat import CAT_TOKEN_TYPE, TokenClaims, TokenStatus, validate_token
from kvcs_core.auth.keys import IssuerKey
from kvcs_core.auth.scope import MoqtAction
from kvcs_core.wire.codes import RequestErrorCode, SessionErrorCode

Presented = Sequence[tuple[int, bytes]]
"""(Token Type, Token Value) pairs, aliases resolved (``RequestRecord.tokens``)."""


@attrs.frozen
class Decision:
    """Allowed, or why not (``status``) with the code to send."""

    status: TokenStatus
    detail: str = ""

    @property
    def allowed(self) -> bool:
        return self.status is TokenStatus.OK

    def request_error(self) -> RequestErrorCode:
        if self.status is TokenStatus.MALFORMED:
            return RequestErrorCode.MALFORMED_AUTH_TOKEN
        if self.status is TokenStatus.EXPIRED:
            return RequestErrorCode.EXPIRED_AUTH_TOKEN
        return RequestErrorCode.UNAUTHORIZED

    def session_error(self) -> SessionErrorCode:
        if self.status is TokenStatus.MALFORMED:
            return SessionErrorCode.MALFORMED_AUTH_TOKEN
        if self.status is TokenStatus.EXPIRED:
            return SessionErrorCode.EXPIRED_AUTH_TOKEN
        return SessionErrorCode.UNAUTHORIZED


@attrs.frozen
class SessionGrant:
    """What a session's SETUP tokens grant (their claims)."""

    claims: tuple[TokenClaims, ...]


class Authorizer:
    """Trusted issuer keys plus a wall clock (see the module docstring).

    Args:
        keys: the issuer keys (by kid).
        clock: the current time in seconds since the Unix epoch.
        leeway: seconds of tolerance on ``exp`` and ``nbf``.
    """

    def __init__(
        self, keys: Iterable[IssuerKey], clock: Callable[[], float], *, leeway: float = 0.0
    ) -> None:
        self.keys = {k.kid: k.public() for k in keys}
        if not self.keys:
            raise ValueError("an Authorizer needs at least one issuer key")
        self.clock = clock
        self.leeway = leeway

    def _validate(self, tokens: Presented) -> tuple[list[TokenClaims], list[TokenStatus], str]:
        now = self.clock()
        good: list[TokenClaims] = []
        bad: list[TokenStatus] = []
        detail = ""
        for token_type, value in tokens:
            if token_type != CAT_TOKEN_TYPE:
                continue
            verdict = validate_token(value, self.keys, now=now, leeway=self.leeway)
            if verdict.ok and verdict.claims is not None:
                good.append(verdict.claims)
            else:
                bad.append(verdict.status)
                detail = detail or verdict.detail
        return good, bad, detail

    def _live(self, claims: TokenClaims) -> bool:
        exp = claims.expires
        return exp is None or self.clock() < exp + self.leeway

    def check_session(self, tokens: Presented) -> tuple[Decision, SessionGrant]:
        """The SETUP tokens (module docstring)."""
        good, bad, detail = self._validate(tokens)
        if TokenStatus.MALFORMED in bad:
            return Decision(TokenStatus.MALFORMED, detail), SessionGrant(())
        admitted = [
            c for c in good if c.moqt is not None and c.moqt.allows_action(MoqtAction.CLIENT_SETUP)
        ]
        if admitted:
            return Decision(TokenStatus.OK), SessionGrant(tuple(good))
        if TokenStatus.EXPIRED in bad:
            return Decision(TokenStatus.EXPIRED, detail), SessionGrant(())
        if good:
            return Decision(
                TokenStatus.NOT_PERMITTED, "no token grants CLIENT_SETUP"
            ), SessionGrant(())
        if bad:
            return Decision(bad[0], detail), SessionGrant(())
        return Decision(TokenStatus.NOT_PERMITTED, "no authorization token"), SessionGrant(())

    def check_request(
        self,
        action: MoqtAction,
        namespace: Sequence[bytes],
        track: bytes | None,
        tokens: Presented,
        session: SessionGrant,
        *,
        discover: bool = False,
    ) -> Decision:
        """``action`` on ``namespace`` (and ``track``; ``None``: the namespace alone).
        ``discover``: ``namespace`` is a prefix to look under (SUBSCRIBE_NAMESPACE,
        SUBSCRIBE_TRACKS; :meth:`~.scope.MoqtClaim.may_discover`)."""
        good, bad, detail = self._validate(tokens)
        expired_session = False
        for claims in (*good, *session.claims):
            moqt = claims.moqt
            if moqt is None:
                continue
            ok = (
                moqt.may_discover(action, namespace)
                if discover
                else moqt.permits(action, namespace, track)
            )
            if not ok:
                continue
            if self._live(claims):
                return Decision(TokenStatus.OK)
            expired_session = True
        if TokenStatus.MALFORMED in bad:
            return Decision(TokenStatus.MALFORMED, detail)
        if TokenStatus.EXPIRED in bad or expired_session:
            return Decision(TokenStatus.EXPIRED, detail or "the session's token expired")
        return Decision(TokenStatus.NOT_PERMITTED, f"not authorized for {action.name}")

    def visible(
        self,
        action: MoqtAction,
        namespace: Sequence[bytes],
        track: bytes | None,
        tokens: Presented,
        session: SessionGrant,
    ) -> bool:
        """What a discovery request may be told about: ``action`` permitted on the name."""
        return self.check_request(action, namespace, track, tokens, session).allowed


__all__ = ["Authorizer", "Decision", "Presented", "SessionGrant"]
