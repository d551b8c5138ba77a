"""A caching MOQT draft-22 relay: a pure component over many sessions (d21 section 7).

See :mod:`kvcs_core.relay.relay` for the model. Public API::

    relay = Relay(RelayConfig(cache_budget_bytes=...))
    relay.add_session(session, upstream=False)      # one MoqtSession per connection
    relay.handle_session_event(session, event, now) # every event of every such session
    relay.handle_timer(now); relay.get_timer()
    relay.intake_held                               # sessions to hold (a full cache)
    relay.stats(); relay.track_stats(name); relay.cache_bytes; relay.upstream_bytes_received
"""

from kvcs_core.relay.config import RelayConfig, RelayStats, TrackStats
from kvcs_core.relay.relay import Relay

__all__ = ["Relay", "RelayConfig", "RelayStats", "TrackStats"]
