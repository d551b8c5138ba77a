"""Backpressure from a full cache to the publishers: when the relay holds its intake.

Theory of operation
-------------------
Upstream intake and downstream delivery are decoupled through the cache
(:mod:`kvcs_core.relay.cache`): a subscriber that is behind is served at its
own pace from references into the cache, and costs nothing beyond it. The
cache is *full* when that stops being true: it had to evict groups that
downstream sessions still hold (queued live objects, fill and FETCH
snapshots). Those objects stay in memory until sent, and so do the objects
that arrive once pinned objects fill the budget: each is evicted in the step
it arrives and forwarded without being kept. Both together are
:attr:`~kvcs_core.relay.cache.Cache.held_outside_bytes` (payloads included),
and each such byte a subscriber still queues counts against its session's
``max_queued_bytes_per_subscription`` (d21 section 5.2: past it, PUBLISH_DONE
TOO_FAR_BEHIND). So those *held* bytes are the measure: while they stay low, the
relay takes everything upstream sends; once they reach the *hold mark*, taking
more would only evict more of what a subscriber is about to read. (The evicted
part alone stops growing at about the budget, which the pinned objects fill,
while a stalled subscriber's queue goes on growing in the never-kept part.)

:class:`IntakeGate` is the decision, free of I/O. It is fed, after every
input and every poll, the held bytes and the total bytes ever released
(:attr:`~kvcs_core.relay.cache.Cache.released_outside_bytes`, a monotonic
count, so that progress is seen even while new objects are evicted):

* **open** -> **held** when the held bytes reach the hold mark
  (``RelayConfig.intake_hold_bytes``, at most half the cache budget). The
  relay then names the sessions it receives objects from
  (:attr:`kvcs_core.relay.relay.Relay.intake_held`), and the embedding stops
  taking their data from its transport, so that QUIC flow control (RFC 9000
  section 4: credit follows what the receiving application consumes) reaches
  the publishers. MOQT itself has no message for this; the transport's flow
  control is the whole mechanism, and the relay sends nothing new on the wire.
* **held** -> **open** when the held bytes fall to half the hold mark
  (hysteresis: one release lets a batch through, not one object at a time).
* **held** -> **given up** when nothing is released for
  ``RelayConfig.intake_stall`` seconds: a subscriber that stopped reading must
  not freeze the publishers and every other subscriber with it. Intake opens,
  and the relay behaves as without backpressure: what no longer fits is
  forwarded, not kept, and the stalled subscriber alone ends TOO_FAR_BEHIND at
  its queue limit, which frees what it held.
* **given up** -> **open** once the held bytes fall to half the hold mark.

While held, the relay asks to be called again every
``RelayConfig.transit_poll`` (sessions release objects as their transport
pulls, which is no input to the relay).

What arrives after a hold starts (credit the transport had granted before) is
taken as usual: the headroom between the hold mark and a subscriber's queue
limit must cover one connection's receive window (the QUIC transports size
their relay connections for that, :mod:`kvcs.transports.quic.config`).
"""

from __future__ import annotations

import enum


class IntakeState(enum.IntEnum):
    """Where :class:`IntakeGate` stands."""

    OPEN = 0
    """Everything upstream sends is taken."""
    HELD = 1
    """The cache is full: the sessions feeding it are held."""
    GIVEN_UP = 2
    """A hold stalled (nothing drained): open until the held bytes fall again."""


class IntakeGate:
    """Decides when the relay holds its upstream intake (module docstring).

    Args:
        hold_bytes: held bytes of objects the cache no longer keeps at which intake is held
            (> 0).
        stall: seconds without anything released after which a hold is given up (> 0).
        poll: seconds between looks while held (> 0).
    """

    def __init__(self, hold_bytes: int, stall: float, poll: float) -> None:
        if hold_bytes <= 0 or stall <= 0 or poll <= 0:
            raise ValueError("hold_bytes, stall and poll must be > 0")
        self.hold_bytes = hold_bytes
        self.resume_bytes = hold_bytes // 2
        self._stall = stall
        self._poll = poll
        self.state = IntakeState.OPEN
        self.holds = 0
        """Holds started so far."""
        self.given_up = 0
        """Holds given up so far (stalled for ``stall`` seconds)."""
        self.held_seconds = 0.0
        """Time spent held so far (ended holds, and the current one up to the last update)."""
        self._since: float | None = None
        """When the current hold started, or last saw progress (bytes released)."""
        self._last: float | None = None
        """When the current hold was last updated."""
        self._released_seen = 0

    @property
    def held(self) -> bool:
        return self.state is IntakeState.HELD

    def update(self, held: int, released_total: int, now: float) -> bool:
        """Look at the cache after an input or a poll (``held``: bytes sessions hold of
        objects the cache no longer keeps; ``released_total``: such bytes released so
        far); ``True`` when the state changed."""
        state = self.state
        progressed = released_total > self._released_seen
        self._released_seen = released_total
        if state is IntakeState.OPEN:
            if held < self.hold_bytes:
                return False
            self.state = IntakeState.HELD
            self.holds += 1
            self._since = self._last = now
            return True
        if state is IntakeState.GIVEN_UP:
            if held > self.resume_bytes:
                return False
            self.state = IntakeState.OPEN
            return True
        # held
        assert self._since is not None and self._last is not None
        self.held_seconds += max(0.0, now - self._last)
        self._last = now
        if held <= self.resume_bytes:
            self.state = IntakeState.OPEN
            self._since = self._last = None
            return True
        if progressed:
            self._since = now
            return False
        if now >= self._since + self._stall:
            self.state = IntakeState.GIVEN_UP
            self.given_up += 1
            self._since = self._last = None
            return True
        return False

    def deadline(self, now: float) -> float | None:
        """When to look again without an input (``None``: not held)."""
        if self.state is not IntakeState.HELD:
            return None
        return now + self._poll
