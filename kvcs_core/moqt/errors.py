"""The three error tiers of a session (ARCHITECTURE.md "Errors, three tiers").

Theory of operation
-------------------
* Our own misuse (calling ``subscribe`` before ``start``, answering a request
  twice, time going backwards) raises :class:`LocalProtocolError` at once and
  leaves the session as it was.
* A peer's protocol violation never raises out of an input method: internally
  it is a :class:`PeerViolation` carrying the MOQT session error code (d21
  section 12.2); the session's single choke point turns it into
  ``CloseTransport(code)`` plus a ``SessionClosed`` event.
* A request-scoped refusal is a REQUEST_ERROR on that request only (d21 section
  12.3) and a ``RequestFailed`` event; the session stays up.
"""

from __future__ import annotations

from kvcs_core.wire.codes import SessionErrorCode


class LocalProtocolError(Exception):
    """The local application used the session in a way the protocol or API forbids."""


class PeerViolation(Exception):
    """Internal: the peer broke the protocol; the session must close with ``code``."""

    def __init__(self, code: SessionErrorCode, reason: str) -> None:
        super().__init__(f"{code.name}: {reason}")
        self.code = code
        self.reason = reason
