"""A loopback network of publishers, relays and subscribers for the relay tests.

``RelayNet`` owns one :class:`~kvcs.transports.loopback.Network`. Every link joins two
sessions; a relay owns one session per link (``Relay.add_session``) and gets
every event of those sessions through the network's ``on_event`` callback, as
an embedding would do it. A :class:`Publisher` is a plain server session that
serves ``TrackStore``\\ s (SUBSCRIBE, FETCH, TRACK_STATUS, SUBSCRIBE_NAMESPACE)
and announces its namespaces with PUBLISH_NAMESPACE; a subscriber is a plain
client session driven by the test (:class:`Subscriber` adds the exactly-once
recipe and event filters). Relay timers are fired by :meth:`RelayNet.run_until`
and :meth:`RelayNet.settle`, which also stop at the relays' deadlines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcs.transports.loopback import Chunking, Link, Livelock, LoopbackTimeout, Network
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.moqt.transport_io import AbortKind, AbortStream, StreamRef
from kvcs_core.relay import Relay, RelayConfig
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, PublishDoneCode, RequestErrorCode
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace

NS = TrackNamespace.of("relay-test", "pub-a")


def track(name: str, ns: TrackNamespace = NS) -> FullTrackName:
    return FullTrackName(ns, name.encode())


def payload(g: int, o: int, size: int = 256) -> bytes:
    unit = f"[g{g}o{o}]".encode()
    return (unit * (size // len(unit) + 1))[:size]


def produce(store: TrackStore, g: int, objects: int, *, size: int = 256, eog: bool = True) -> None:
    """Group ``g``: ``objects`` objects, then End of Group."""
    for o in range(objects):
        store.append(g, o, payload(g, o, size))
    if eog:
        store.append(g, objects, status=ObjectStatus.END_OF_GROUP)


class Publisher:
    """A server session serving TrackStores (the origin of plain tracks)."""

    def __init__(self, session: MoqtSession) -> None:
        self.session = session
        self.stores: dict[FullTrackName, TrackStore] = {}
        self.namespaces: list[TrackNamespace] = []
        self.served: dict[int, FullTrackName] = {}
        self.requests: list[Any] = []
        self.tracks_subs: dict[int, TrackNamespace] = {}
        """SUBSCRIBE_TRACKS accepted: every matching store is PUBLISHed on it."""
        self.net: Network | None = None

    def serve(self, store: TrackStore) -> TrackStore:
        self.stores[store.name] = store
        for prefix in self.tracks_subs.values():
            if prefix.is_prefix_of(store.name.namespace):
                self._publish(store)
        return store

    def _publish(self, store: TrackStore) -> None:
        assert self.net is not None
        rid = self.session.publish(store, now=self.net.now)
        self.served[rid] = store.name
        self.net.poke(self.session)

    def end_track(self, store: TrackStore, now: float) -> None:
        """End of Track after the last group, then PUBLISH_DONE TRACK_ENDED everywhere."""
        largest = store.largest
        g = 0 if largest is None else largest.group + 1
        store.append(g, 0, status=ObjectStatus.END_OF_TRACK)
        for rid, name in list(self.served.items()):
            if name == store.name:
                del self.served[rid]
                rec = self.session.requests.get(rid)
                if rec is not None and not rec.finished and not rec.local_fin:
                    self.session.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=now)

    def on_event(self, e: Any, now: float) -> None:
        s = self.session
        if isinstance(e, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
            self.requests.append(e)
            store = self.stores.get(e.track)
            if store is None:
                s.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, "no", now=now)
            elif isinstance(e, ev.SubscribeRequested):
                s.accept_subscribe(e.request_id, store, now=now)
                if store.end_of_track is not None:
                    s.end_subscription(e.request_id, PublishDoneCode.TRACK_ENDED, now=now)
                else:
                    self.served[e.request_id] = store.name
            elif isinstance(e, ev.FetchRequested):
                s.accept_fetch(e.request_id, store, now=now)
            else:
                s.accept_track_status(e.request_id, store, now=now)
        elif isinstance(e, ev.SubscribeNamespaceRequested):
            s.accept_request(e.request_id, now=now)
            for ns in self.namespaces:
                if e.prefix.is_prefix_of(ns):
                    s.send_namespace(e.request_id, ns.suffix_after(e.prefix), now=now)
        elif isinstance(e, ev.SubscribeTracksRequested):
            self.requests.append(e)
            s.accept_request(e.request_id, now=now)
            self.tracks_subs[e.request_id] = e.prefix
            for store in self.stores.values():
                if e.prefix.is_prefix_of(store.name.namespace):
                    self._publish(store)


class Subscriber:
    """A client session plus helpers for the test's assertions."""

    def __init__(self, rn: RelayNet, session: MoqtSession) -> None:
        self.rn = rn
        self.session = session

    def subscribe_all(self, name: FullTrackName) -> int:
        """The exactly-once recipe: NEXT_OBJECT + FILL{ABSOLUTE_START 0,0} (wire ref. 6)."""
        rid = self.session.subscribe(
            name,
            now=self.rn.now,
            location_filter=p.LocationFilter.next_object(),
            fill=p.Parameters.of(p.LocationFilter.absolute_start(0, 0)),
        )
        self.rn.net.poke(self.session)
        return rid

    def subscribe_tracks(self, prefix: TrackNamespace, *, fill: bool = True) -> int:
        """SUBSCRIBE_TRACKS; with ``fill`` it asks each PUBLISH for the whole track up to
        the Largest Object it announces (A10), so every object arrives once."""
        extra = [p.FillParameters(p.Parameters.of(p.LocationFilter.absolute_start(0, 0)))]
        rid = self.session.subscribe_tracks(prefix, now=self.rn.now, extra=extra if fill else ())
        self.rn.net.poke(self.session)
        return rid

    def accept_publishes(self) -> None:
        """Answer every PUBLISH this subscriber gets with PUBLISH_OK (an on_event handler)."""

        def accept(e: Any, now: float) -> None:
            if isinstance(e, ev.PublishRequested):
                self.session.accept_publish(e.request_id, now=now)

        self.rn.handlers[self.session] = accept

    def fetch(self, name: FullTrackName, lf: p.LocationFilter | None = None) -> int:
        rid = self.session.fetch(name, now=self.rn.now, location_filter=lf)
        self.rn.net.poke(self.session)
        return rid

    def events(self, kind: Any = object) -> list[Any]:
        return [e for e in self.rn.net.events(self.session) if isinstance(e, kind)]

    def objects(self, rid: int) -> list[ev.ObjectReceived]:
        return [e for e in self.events(ev.ObjectReceived) if e.request_id == rid]

    def normal(self, rid: int) -> dict[Location, bytes]:
        """Normal objects of ``rid`` by Location; asserts none came twice."""
        out: dict[Location, bytes] = {}
        for e in self.objects(rid):
            if e.status is ObjectStatus.NORMAL:
                assert e.location not in out, f"{e.location} delivered twice"
                out[e.location] = bytes(e.payload)
        return out

    def done(self, rid: int) -> ev.PublishDoneReceived | None:
        got = [e for e in self.events(ev.PublishDoneReceived) if e.request_id == rid]
        return got[0] if got else None

    def failed(self, rid: int) -> ev.RequestFailed | None:
        got = [e for e in self.events(ev.RequestFailed) if e.request_id == rid]
        return got[0] if got else None

    def accepted(self, rid: int) -> bool:
        return any(
            getattr(e, "request_id", None) == rid
            for e in self.events((ev.SubscribeAccepted, ev.FetchAccepted))
        )


class RelayNet:
    """Publishers, relays and subscribers on one loopback network (module docstring)."""

    def __init__(
        self,
        *,
        seed: int = 5,
        latency: float = 0.002,
        bandwidth: float | None = None,
        chunking: Any = Chunking.WHOLE,
        zero_copy: bool = False,
        keep_events: bool = True,
        session_config: Callable[[Role], SessionConfig] | None = None,
    ) -> None:
        self.net = Network(seed=seed, keep_events=keep_events)
        self.latency = latency
        self.bandwidth = bandwidth
        self.chunking = chunking
        self.zero_copy = zero_copy
        self.relays: list[Relay] = []
        self.publishers: dict[MoqtSession, Publisher] = {}
        self.handlers: dict[MoqtSession, Callable[[Any, float], None]] = {}
        """Event handlers of other origin sessions (a KvcsPublisher's)."""
        self.subscribers: list[Subscriber] = []
        self.owner: dict[MoqtSession, Relay] = {}
        self._config = session_config or (lambda role: SessionConfig(role=role))
        self.wrap: Callable[[MoqtSession], Any] = lambda s: s
        """Turns a relay session into the machine put on the network (benchmarks time it)."""
        self.unwrap: dict[int, MoqtSession] = {}
        self.relay_time = 0.0
        self.net.on_event(self._on_event)

    @property
    def now(self) -> float:
        return self.net.now

    # --- building ---------------------------------------------------------------------

    def _connect(
        self,
        client: MoqtSession,
        server: MoqtSession,
        name: str,
        bandwidth: float | None = None,
    ) -> Link:
        mc = self.wrap(client) if client in self.owner else client
        ms = self.wrap(server) if server in self.owner else server
        self.unwrap[id(mc)] = client
        self.unwrap[id(ms)] = server
        link = self.net.connect(
            mc,
            ms,
            latency=self.latency,
            bandwidth=bandwidth if bandwidth is not None else self.bandwidth,
            chunking=self.chunking,
            zero_copy=self.zero_copy,
            name=name,
        )
        for s, m in ((client, mc), (server, ms)):
            s.start(now=self.now)
            self.net.poke(m)
        return link

    def add_relay(self, config: RelayConfig | None = None) -> Relay:
        relay = Relay(config)
        self.relays.append(relay)
        return relay

    def add_publisher(
        self,
        relay: Relay,
        namespaces: tuple[TrackNamespace, ...] = (NS,),
        *,
        bandwidth: float | None = None,
    ) -> Publisher:
        """A publisher (server) linked to ``relay`` (its session there is upstream), over a
        link of ``bandwidth`` bytes/s (default: the loopback's)."""
        up = MoqtSession(self._config(Role.CLIENT))
        pub = MoqtSession(self._config(Role.SERVER))
        self.owner[up] = relay
        relay.add_session(up, upstream=True)
        publisher = Publisher(pub)
        publisher.net = self.net
        publisher.namespaces = list(namespaces)
        self.publishers[pub] = publisher
        self._connect(up, pub, f"pub{len(self.publishers)}", bandwidth)
        self.run_until(lambda: pub.setup_complete and up.setup_complete)
        for ns in namespaces:
            pub.publish_namespace(ns, now=self.now)
        self.net.poke(pub)
        self.settle(0.05)
        return publisher

    def add_origin(
        self, relay: Relay, handler: Callable[[MoqtSession, Any, float], None]
    ) -> MoqtSession:
        """A bare origin session (server) linked to ``relay``; ``handler(session, event,
        now)`` gets its events (e.g. a KvcsPublisher's ``handle_session_event``)."""
        up = MoqtSession(self._config(Role.CLIENT))
        origin = MoqtSession(self._config(Role.SERVER))
        self.owner[up] = relay
        relay.add_session(up, upstream=True)
        self.handlers[origin] = lambda e, now: handler(origin, e, now)
        self._connect(up, origin, f"origin{len(self.handlers)}")
        self.run_until(lambda: origin.setup_complete and up.setup_complete)
        return origin

    def add_subscriber(
        self,
        relay: Relay,
        config: SessionConfig | None = None,
        *,
        relay_side: SessionConfig | None = None,
        bandwidth: float | None = None,
    ) -> Subscriber:
        """A subscriber (client) linked to ``relay``; ``relay_side`` configures the relay's
        session on that link (e.g. its ``max_queued_bytes_per_subscription``)."""
        down = MoqtSession(relay_side or self._config(Role.SERVER))
        sub = MoqtSession(config or self._config(Role.CLIENT))
        self.owner[down] = relay
        relay.add_session(down, upstream=False)
        self._connect(sub, down, f"sub{len(self.subscribers)}", bandwidth)
        self.run_until(lambda: sub.setup_complete and down.setup_complete)
        s = Subscriber(self, sub)
        self.subscribers.append(s)
        return s

    def stop_sending(self, session: MoqtSession, stream: StreamRef, code: int) -> None:
        """``session``'s transport sends STOP_SENDING on ``stream`` (a data stream it
        receives), as an application abandoning that stream would have it do."""
        ep = self.endpoint(session)
        ep.link._apply(ep, AbortStream(stream=stream, kind=AbortKind.STOP_SENDING, code=code))

    def cut(self, session: MoqtSession) -> None:
        """Sever the link ``session`` sits on (both ends get TransportClosed)."""
        self.net.link_of(self.machine(session)).cut()

    def link_relays(self, parent: Relay, child: Relay) -> tuple[MoqtSession, MoqtSession]:
        """``child``'s upstream is ``parent`` (a relay tree). Returns (parent's, child's)."""
        down = MoqtSession(self._config(Role.SERVER))
        up = MoqtSession(self._config(Role.CLIENT))
        self.owner[down] = parent
        self.owner[up] = child
        parent.add_session(down, upstream=False)
        child.add_session(up, upstream=True)
        self._connect(up, down, f"relay{len(self.net.links)}")
        self.run_until(lambda: up.setup_complete and down.setup_complete)
        return down, up

    def machine(self, session: MoqtSession) -> Any:
        """What sits on the network for ``session`` (the session, or its wrapper)."""
        for m_id, s in self.unwrap.items():
            if s is session:
                for link in self.net.links:
                    for ep in link.endpoints:
                        if id(ep.machine) == m_id:
                            return ep.machine
        return session

    def endpoint(self, session: MoqtSession) -> Any:
        return self.net.endpoint(self.machine(session))

    # --- driving --------------------------------------------------------------------

    def _on_event(self, machine: Any, e: Any) -> None:
        session = self.unwrap.get(id(machine), machine)
        now = self.net.now
        relay = self.owner.get(session)
        if relay is not None:
            relay.handle_session_event(session, e, now)
        elif session in self.publishers:
            self.publishers[session].on_event(e, now)
        elif session in self.handlers:
            self.handlers[session](e, now)
        self._fire_due()

    def _deadline(self) -> float | None:
        ts = [t for r in self.relays if (t := r.get_timer()) is not None]
        return min(ts) if ts else None

    def _due(self) -> bool:
        t = self._deadline()
        return t is not None and t <= self.net.now

    def _fire_due(self) -> bool:
        fired = False
        for r in self.relays:
            t = r.get_timer()
            if t is not None and t <= self.net.now:
                r.handle_timer(self.net.now)
                fired = True
        return fired

    def run_until(self, pred: Callable[[], bool], max_time: float = 30.0) -> None:
        limit = self.net.now + max_time
        while not pred():
            if self._fire_due():
                continue
            t = self._deadline()
            horizon = t if t is not None and t < limit else limit
            try:
                self.net.run_until(
                    lambda: pred() or self._due(), max_time=max(0.0, horizon - self.net.now)
                )
            except (LoopbackTimeout, Livelock) as exc:
                t = self._deadline()
                if t is None or t > limit:
                    if isinstance(exc, LoopbackTimeout) and horizon < limit:
                        continue  # stopped at a relay deadline that went away meanwhile
                    raise
                self.net.run_for(max(0.0, t - self.net.now))

    def settle(self, duration: float = 0.5) -> None:
        end = self.net.now + duration
        while True:
            self._fire_due()
            t = self._deadline()
            step_to = end if t is None or t > end else max(t, self.net.now)
            self.net.run_for(max(0.0, step_to - self.net.now))
            if step_to >= end:
                self._fire_due()
                return
