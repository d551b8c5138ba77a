"""Client connections that come back: bounded, jittered exponential backoff (sans-I/O).

Theory of operation
-------------------
A :class:`Link` shadows one client connection of a :class:`~.endpoint.QuicEndpoint`
(a publisher's session with its relay, a relay's session with its parent). Once
that connection has carried a MOQT session (both SETUPs), and whenever it then
ends, for any reason but our own :meth:`Link.stop`, the link opens a new one to
the same address after a delay from :class:`Backoff`, gives every attempt
``connect_timeout`` seconds to complete QUIC and SETUP, and tells its owner
(``on_session``) when a new session is set up, so the owner can restore what it
had on the old one (a publisher: PUBLISH_NAMESPACE and its tracks; a relay:
the new upstream session joins the relay core, which asks it again for what
its downstream peers wait for). A connection that never got as far as SETUP
is not retried: the first failure is the caller's error to see.

Everything is driven by the endpoint: :meth:`Link.service` after each service
(to notice the end of its connection), :meth:`Link.handle_timer` and
:meth:`Link.get_timer` for the attempts, :meth:`Link.handle_session_event`
before the application sees an event. The clock is the ``now`` passed in and
the jitter comes from ``rand`` (a ``() -> float`` in ``[0, 1)``), both from the
event-loop binding, so the policy is deterministic under test.

Each attempt and each restored session is logged (WARNING when a connection is
lost and retried, INFO when it is back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.events import SessionEvent

from .endpoint import QuicEndpoint
from .pump import SessionPump

log = logging.getLogger("kvcs.quic")


def _positive(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, not {value!r}")


@attrs.frozen(kw_only=True)
class Backoff:
    """Delays between reconnection attempts.

    Attempt ``n`` (0 for the first after a loss) waits
    ``min(maximum, initial * factor**n) * (1 - jitter * u)`` seconds, ``u`` uniform in
    ``[0, 1)`` ("equal jitter" for the default 0.5: spread over the upper half). After
    ``attempts`` failed attempts in a row the link gives up (``None``: never).
    """

    initial: float = attrs.field(default=0.5, validator=_positive)
    maximum: float = attrs.field(default=30.0, validator=_positive)
    factor: float = attrs.field(default=2.0, validator=_positive)
    jitter: float = 0.5
    attempts: int | None = None

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be within [0, 1], not {self.jitter!r}")
        if self.maximum < self.initial:
            raise ValueError("maximum must be >= initial")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError("attempts must be >= 1 (or None)")

    def delay(self, attempt: int, u: float) -> float:
        """Seconds to wait before attempt number ``attempt`` (0-based), ``u`` in ``[0, 1)``."""
        base = min(self.maximum, self.initial * self.factor ** min(max(attempt, 0), 64))
        u = min(max(u, 0.0), 1.0)
        return base * (1.0 - self.jitter * u)


DEFAULT_BACKOFF = Backoff()
"""0.5 s doubling to at most 30 s, jittered over the upper half, retried forever."""


class Link:
    """One client connection that is opened again when it ends (module docstring).

    Args:
        endpoint: where the connections live (the link registers itself there).
        first: the first connection (already opened).
        reopen: ``(now) -> SessionPump``, opening one more connection to the same peer.
        backoff: the delay policy.
        rand: uniform ``[0, 1)`` source for the jitter.
        connect_timeout: seconds an attempt may take to reach SETUP.
        target: the peer's name, for the log.
        on_session: ``(pump, now)`` when a new connection's session is set up
            (not called for the first one).
    """

    def __init__(
        self,
        endpoint: QuicEndpoint,
        first: SessionPump,
        reopen: Callable[[float], SessionPump],
        *,
        backoff: Backoff,
        rand: Callable[[], float],
        connect_timeout: float,
        target: str,
        on_session: Callable[[SessionPump, float], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.pump = first
        self.reopen = reopen
        self.backoff = backoff
        self.rand = rand
        self.connect_timeout = connect_timeout
        self.target = target
        self.on_session = on_session
        self.was_up = first.session.setup_complete
        """A session was set up on one of this link's connections (only then does it retry)."""
        self.stopped = False
        self.gave_up = False
        self.failures = 0
        """Attempts in a row that did not reach SETUP."""
        self.reconnects = 0
        """Sessions restored so far."""
        self.retry_at: float | None = None
        self.attempt_deadline: float | None = None
        first.reconnects = True
        endpoint.links.append(self)

    @property
    def active(self) -> bool:
        """Still following its peer (neither stopped nor given up)."""
        return not self.stopped and not self.gave_up

    def stop(self) -> None:
        """No more attempts (the owner closes the connection itself)."""
        self.stopped = True
        self.retry_at = self.attempt_deadline = None
        if self in self.endpoint.links:
            self.endpoint.links.remove(self)

    # --- driven by the endpoint ----------------------------------------------------------

    def handle_session_event(self, pump: SessionPump, event: SessionEvent, now: float) -> None:
        if pump is not self.pump or not isinstance(event, ev.SetupCompleted):
            return
        self.attempt_deadline = None
        self.failures = 0
        if not self.was_up:
            self.was_up = True
            return
        self.reconnects += 1
        log.info(
            "%s: session with %s restored (reconnection %d)",
            pump.label,
            self.target,
            self.reconnects,
        )
        if self.on_session is not None:
            self.on_session(pump, now)

    def service(self, now: float) -> None:
        if not self.active or self.retry_at is not None or not self.pump.terminated:
            return
        self.attempt_deadline = None
        if not self.was_up:  # the first connection failed: the caller sees that error
            self._give_up("never connected")
            return
        reason = self.pump.close_reason or "connection closed"
        if self.pump.session.setup_complete:
            lost = f"lost ({reason})"
        else:
            self.failures += 1
            lost = f"attempt {self.failures} failed ({reason})"
        if self.backoff.attempts is not None and self.failures >= self.backoff.attempts:
            self._give_up(f"{self.failures} attempts failed")
            return
        delay = self.backoff.delay(self.failures, self.rand())
        self.retry_at = now + delay
        log.warning("connection with %s %s; reconnecting in %.2f s", self.target, lost, delay)

    def handle_timer(self, now: float) -> None:
        if not self.active:
            return
        if self.retry_at is not None and self.retry_at <= now:
            self.retry_at = None
            try:
                self.pump = self.reopen(now)
            except Exception as exc:  # e.g. the endpoint is full: try again later
                self.failures += 1
                delay = self.backoff.delay(self.failures, self.rand())
                log.warning(
                    "reconnecting to %s failed at once: %s; next try in %.2f s",
                    self.target,
                    exc,
                    delay,
                )
                self.retry_at = now + delay
                return
            self.pump.reconnects = True
            self.attempt_deadline = now + self.connect_timeout
            log.info("%s: reconnecting to %s", self.pump.label, self.target)
        elif (
            self.attempt_deadline is not None
            and self.attempt_deadline <= now
            and not self.pump.terminated
            and not self.pump.session.setup_complete
        ):
            # the attempt took too long: drop it (the endpoint reaps it), service() retries
            self.attempt_deadline = None
            self.pump.abandon(f"no session within {self.connect_timeout:g} s", now)

    def get_timer(self) -> float | None:
        if not self.active:
            return None
        times = [t for t in (self.retry_at, self.attempt_deadline) if t is not None]
        return min(times) if times else None

    def _give_up(self, why: str) -> None:
        self.gave_up = True
        if self in self.endpoint.links:
            self.endpoint.links.remove(self)
        if self.was_up:
            log.warning("giving up the connection with %s: %s", self.target, why)
