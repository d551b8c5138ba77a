"""A relay's counters for operators: one snapshot, as ``stats`` fields or Prometheus metrics.

Theory of operation
-------------------
Everything an operator watches on a relay already exists as plain getters: the
pure relay core (:meth:`~kvcs_core.relay.relay.Relay.stats`: sessions, tracks,
cache bytes and objects, objects and bytes in and out, evictions, refused
requests by error code), the endpoint (:class:`~.endpoint.QuicEndpoint`:
connections open, accepted, ended, handshakes refused over a limit) and the
upstream link (:class:`~.api.MoqtClient`: connected, reconnections).
:func:`relay_counters` reads them all at once into a frozen
:class:`RelayCounters` on the event loop's thread, the only thread that
touches the relay.

Two views of one snapshot:

* :func:`stats_fields`: the keys of ``kvcs relay --json``'s ``stats`` line;
* :class:`RelayMetrics`: a Prometheus collector (``prometheus_client``) that
  serves the latest snapshot it was given (:meth:`RelayMetrics.update`, called
  from the loop a few times a second) to ``/metrics`` from the HTTP server's
  own thread (:meth:`RelayMetrics.serve`). The HTTP thread reads one immutable
  object and never the relay itself, so no lock is needed and a scrape never
  disturbs the loop; what it sees is at most one update old.

Metric names (all prefixed ``kvcs_relay_``; ``_total`` ones are counters since
the relay started, the others gauges): see :data:`METRICS`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import attrs

from .config import UrlError, parse_hostport

PREFIX = "kvcs_relay_"


@attrs.frozen(kw_only=True)
class RelayCounters:
    """A relay's counters at one moment (module docstring)."""

    connections: int
    """QUIC connections open now (the upstream link included)."""
    connections_accepted: int
    """Connections accepted or opened since the start."""
    connections_ended: int
    """Connections that ended since the start."""
    handshakes_refused: int
    """Handshakes refused over a connection limit since the start."""
    sessions: int
    """MOQT sessions the relay owns now."""
    sessions_added: int
    """Sessions since the start."""
    upstream_sessions: int
    """Open sessions towards publishers' relays (the ``--upstream`` link)."""
    tracks: int
    subscriptions: int
    """Downstream subscriptions served now."""
    cache_bytes: int
    cache_peak_bytes: int
    cache_budget_bytes: int
    cache_objects: int
    transit_bytes: int
    objects_in: int
    """Objects received (from publishers and upstream), duplicates included."""
    bytes_in: int
    """Payload bytes of those objects."""
    objects_out: int
    """Objects sent to subscribers, fills and FETCHes."""
    bytes_out: int
    """Payload bytes of those objects."""
    evicted_groups: int
    evicted_bytes: int
    refused: tuple[tuple[str, int], ...]
    """Requests refused (REQUEST_ERROR) by error code name."""
    upstream: str | None
    """The ``--upstream`` URL, ``None`` without one."""
    upstream_connected: bool
    upstream_reconnects: int
    evicted_held_bytes: int = 0
    """Bytes of evicted objects that sessions still hold."""
    held_outside_bytes: int = 0
    """Bytes sessions hold of objects the cache no longer keeps (evicted, or forwarded and
    never kept): what the intake gate looks at."""
    intake_held: bool = False
    """The relay holds its intake from publishers now (its cache is full)."""
    intake_holds: int = 0
    """Holds of the intake since the start."""
    intake_given_up: int = 0
    """Holds given up since the start (nothing drained for ``intake_stall``)."""
    intake_held_seconds: float = 0.0
    """Time the intake was held since the start."""


def relay_counters(server: Any) -> RelayCounters:
    """Read every counter of ``server`` (a :class:`~.api.RelayServer`) now; call it on the
    relay's event loop."""
    relay = server.relay
    st = relay.stats()
    endpoint = server.driver.endpoint
    up = server.upstream
    link = getattr(up, "link", None)
    return RelayCounters(
        connections=len(endpoint.pumps),
        connections_accepted=endpoint.accepted,
        connections_ended=endpoint.ended_total,
        handshakes_refused=endpoint.refused,
        sessions=st.sessions,
        sessions_added=st.sessions_added,
        upstream_sessions=st.upstream_sessions,
        tracks=st.tracks,
        subscriptions=st.downstream_subscriptions,
        cache_bytes=st.cache_bytes,
        cache_peak_bytes=st.peak_cache_bytes,
        cache_budget_bytes=relay.config.cache_budget_bytes,
        cache_objects=st.cached_objects,
        transit_bytes=st.transit_bytes,
        objects_in=st.upstream_objects_received,
        bytes_in=st.upstream_bytes_received,
        objects_out=st.objects_sent,
        bytes_out=st.bytes_sent,
        evicted_groups=st.evicted_groups,
        evicted_bytes=st.evicted_bytes,
        refused=st.refused,
        upstream=None if up is None else str(up.target),
        upstream_connected=bool(up is not None and up.connected),
        upstream_reconnects=0 if link is None else int(link.reconnects),
        evicted_held_bytes=st.evicted_held_bytes,
        held_outside_bytes=st.held_outside_bytes,
        intake_held=st.intake_held,
        intake_holds=st.intake_holds,
        intake_given_up=st.intake_given_up,
        intake_held_seconds=st.intake_held_seconds,
    )


def stats_fields(c: RelayCounters) -> dict[str, Any]:
    """The keys of a ``stats`` JSON line (``event`` excluded)."""
    fields = attrs.asdict(c)
    fields["refused"] = dict(c.refused)
    return fields


METRICS: tuple[tuple[str, str, str, str], ...] = (
    # (name without the prefix, kind, RelayCounters field, help)
    ("connections", "gauge", "connections", "QUIC connections open now"),
    ("connections_accepted_total", "counter", "connections_accepted",
     "QUIC connections accepted (and upstream links opened)"),
    ("connections_ended_total", "counter", "connections_ended", "QUIC connections that ended"),
    ("handshakes_refused_total", "counter", "handshakes_refused",
     "QUIC handshakes refused over a connection limit (CONNECTION_REFUSED)"),
    ("sessions", "gauge", "sessions", "MOQT sessions open now"),
    ("sessions_total", "counter", "sessions_added", "MOQT sessions set up"),
    ("upstream_sessions", "gauge", "upstream_sessions",
     "MOQT sessions towards a parent relay open now"),
    ("tracks", "gauge", "tracks", "tracks the relay keeps state for"),
    ("subscriptions", "gauge", "subscriptions", "downstream subscriptions served now"),
    ("cache_bytes", "gauge", "cache_bytes", "accounted bytes the cache holds"),
    ("cache_peak_bytes", "gauge", "cache_peak_bytes", "the most cache_bytes ever was"),
    ("cache_budget_bytes", "gauge", "cache_budget_bytes", "the cache budget (--cache-budget)"),
    ("cache_objects", "gauge", "cache_objects", "objects the cache holds"),
    ("transit_bytes", "gauge", "transit_bytes",
     "bytes of objects forwarded without being kept, still held by sessions"),
    ("objects_received_total", "counter", "objects_in",
     "objects received from publishers and upstream relays (duplicates included)"),
    ("bytes_received_total", "counter", "bytes_in", "payload bytes of the objects received"),
    ("objects_sent_total", "counter", "objects_out",
     "objects handed to QUIC for subscribers, fills and FETCHes"),
    ("bytes_sent_total", "counter", "bytes_out", "payload bytes of the objects sent"),
    ("evicted_groups_total", "counter", "evicted_groups", "groups evicted from the cache"),
    ("evicted_bytes_total", "counter", "evicted_bytes", "accounted bytes evicted from the cache"),
    ("evicted_held_bytes", "gauge", "evicted_held_bytes",
     "bytes of evicted objects that sessions still hold"),
    ("held_outside_bytes", "gauge", "held_outside_bytes",
     "bytes sessions hold of objects the cache no longer keeps (evicted or never kept)"),
    ("intake_held", "gauge", "intake_held",
     "1 while the relay holds its intake from publishers (the cache is full), else 0"),
    ("intake_holds_total", "counter", "intake_holds", "holds of the intake from publishers"),
    ("intake_given_up_total", "counter", "intake_given_up",
     "holds given up because nothing drained for intake_stall"),
    ("intake_held_seconds_total", "counter", "intake_held_seconds",
     "seconds the intake from publishers was held"),
)  # fmt: skip
"""Every metric of :class:`RelayMetrics` but the labelled and upstream ones:
``kvcs_relay_requests_refused_total{reason="<REQUEST_ERROR code name>"}`` (counter),
``kvcs_relay_upstream_connected`` (gauge, 1 or 0) and
``kvcs_relay_upstream_reconnects_total`` (counter), the last two only with an
upstream."""


class RelayMetrics:
    """A Prometheus collector over the latest :class:`RelayCounters` (module docstring)."""

    def __init__(self, counters: RelayCounters | None = None) -> None:
        # prometheus_client is imported here, by a relay given --metrics: the others never
        # load it (about 10 MiB of an idle process)
        from prometheus_client.registry import CollectorRegistry  # noqa: PLC0415

        self._counters = counters
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def update(self, counters: RelayCounters) -> None:
        """The snapshot that scrapes see from now on (one reference, set atomically)."""
        self._counters = counters

    def collect(self) -> Iterator[Any]:
        """``prometheus_client``'s collector protocol (called on the HTTP thread)."""
        from prometheus_client.core import (  # noqa: PLC0415  (loaded by __init__)
            CounterMetricFamily,
            GaugeMetricFamily,
        )

        c = self._counters
        if c is None:
            return
        for name, kind, field, text in METRICS:
            value = float(getattr(c, field))
            if kind == "counter":
                yield CounterMetricFamily(PREFIX + name.removesuffix("_total"), text, value=value)
            else:
                yield GaugeMetricFamily(PREFIX + name, text, value=value)
        refused = CounterMetricFamily(
            PREFIX + "requests_refused",
            "requests the relay refused with REQUEST_ERROR, by error code name",
            labels=["reason"],
        )
        for reason, count in c.refused:
            refused.add_metric([reason], float(count))
        yield refused
        if c.upstream is not None:
            yield GaugeMetricFamily(
                PREFIX + "upstream_connected",
                "1 while the session with the --upstream relay is set up, else 0",
                value=1.0 if c.upstream_connected else 0.0,
            )
            yield CounterMetricFamily(
                PREFIX + "upstream_reconnects",
                "times the upstream link was opened again after a loss",
                value=float(c.upstream_reconnects),
            )

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Serve ``/metrics`` over HTTP on ``host:port`` (port 0: any) from a daemon thread;
        the address bound. ``OSError`` when it cannot listen."""
        from prometheus_client import start_http_server  # noqa: PLC0415  (as in __init__)

        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        """Stop the HTTP server (if serving) and wait for its thread."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def parse_metrics_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) for ``--metrics``; ``ValueError`` (one line)
    when malformed: the port is required."""
    if ":" not in text:
        raise ValueError(f"--metrics: not host:port: {text!r} (e.g. 127.0.0.1:9464)")
    try:
        host, port = parse_hostport(text)
    except UrlError:
        raise ValueError(f"--metrics: not host:port: {text!r} (e.g. 127.0.0.1:9464)") from None
    return host, port


__all__ = [
    "METRICS",
    "RelayCounters",
    "RelayMetrics",
    "parse_metrics_address",
    "relay_counters",
    "stats_fields",
]
