"""A client and a server MoqtSession on the loopback, with an auto-answering server.

Used by the scenario tests. The server serves every TrackStore registered with
:meth:`Pair.serve`: SUBSCRIBE, FETCH and TRACK_STATUS for a registered track are
accepted, others refused with DOES_NOT_EXIST; SUBSCRIBE_NAMESPACE is answered
with NAMESPACE for every registered namespace under the prefix.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kvcs.transports.loopback import Chunking, Network
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire.codes import ObjectStatus, RequestErrorCode
from kvcs_core.wire.names import FullTrackName, TrackNamespace

NS = TrackNamespace.of("kvcs-1", b"\x01" * 16, b"\x02" * 16)
CHUNKINGS = {
    "whole": Chunking.WHOLE,
    "bytewise": Chunking.BYTEWISE,
    "random": Chunking.random(seed=11, max_size=37),
}


def track(name: str, ns: TrackNamespace = NS) -> FullTrackName:
    return FullTrackName(ns, name.encode())


def payload(g: int, o: int, size: int = 64) -> bytes:
    unit = f"g{g}o{o};".encode()
    return (unit * (size // len(unit) + 1))[:size]


def fill_store(store: TrackStore, groups: range, objects: int, *, size: int = 64,
               end_of_group: bool = True) -> None:
    for g in groups:
        for o in range(objects):
            store.append(g, o, payload(g, o, size))
        if end_of_group:
            store.append(g, objects, status=ObjectStatus.END_OF_GROUP)


class Pair:
    def __init__(
        self,
        chunking: Any = Chunking.WHOLE,
        *,
        latency: float = 0.005,
        bandwidth: float | None = None,
        client_config: SessionConfig | None = None,
        server_config: SessionConfig | None = None,
        seed: int = 3,
    ) -> None:
        self.net = Network(seed=seed)
        self.cli = MoqtSession(client_config or SessionConfig(role=Role.CLIENT))
        self.srv = MoqtSession(server_config or SessionConfig(role=Role.SERVER))
        self.link = self.net.connect(
            self.cli, self.srv, latency=latency, bandwidth=bandwidth, chunking=chunking
        )
        self.stores: dict[FullTrackName, TrackStore] = {}
        self.namespaces: list[TrackNamespace] = []
        self.auto_accept = True
        self.net.on_event(self._on_event)
        self.cli.start(now=0.0)
        self.srv.start(now=0.0)
        self.net.poke(self.cli)
        self.net.poke(self.srv)
        self.net.run_until(lambda: self.cli.setup_complete and self.srv.setup_complete,
                           max_time=5)

    @property
    def now(self) -> float:
        return self.net.now

    def serve(self, store: TrackStore) -> TrackStore:
        self.stores[store.name] = store
        if store.name.namespace not in self.namespaces:
            self.namespaces.append(store.name.namespace)
        return store

    def _on_event(self, machine: Any, e: Any) -> None:
        if machine is not self.srv or not self.auto_accept:
            return
        srv, now = self.srv, self.net.now
        if isinstance(e, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
            store = self.stores.get(e.track)
            if store is None:
                srv.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, "no such track",
                                   now=now)
            elif isinstance(e, ev.SubscribeRequested):
                srv.accept_subscribe(e.request_id, store, now=now)
            elif isinstance(e, ev.FetchRequested):
                srv.accept_fetch(e.request_id, store, now=now)
            else:
                srv.accept_track_status(e.request_id, store, now=now)
        elif isinstance(e, ev.SubscribeNamespaceRequested):
            srv.accept_request(e.request_id, now=now)
            for ns in self.namespaces:
                if e.prefix.is_prefix_of(ns):
                    srv.send_namespace(e.request_id, ns.suffix_after(e.prefix), now=now)
        elif isinstance(e, ev.PublishNamespaceRequested):
            srv.accept_request(e.request_id, now=now)

    def events(self, machine: Any, kind: type | tuple[type, ...] = object) -> list[Any]:
        return [e for e in self.net.events(machine) if isinstance(e, kind)]

    def objects(self, request_id: int | None = None) -> list[ev.ObjectReceived]:
        return [
            e for e in self.events(self.cli, ev.ObjectReceived)
            if request_id is None or e.request_id == request_id
        ]

    def wait(self, predicate: Any, max_time: float = 30.0) -> None:
        self.net.run_until(predicate, max_time=self.net.now + max_time)

    def settle(self, duration: float = 1.0) -> None:
        self.net.run_for(duration)


def normalized(events: list[Any]) -> dict[Any, list[Any]]:
    """Event log with the interleaving between independent streams removed.

    Objects are grouped per (request, delivery, via request) in arrival order
    (the order within one stream is fixed); other events per request, in order.
    This is what must not depend on how bytes were chunked.
    """
    out: dict[Any, list[Any]] = defaultdict(list)
    for e in events:
        if isinstance(e, ev.ObjectReceived):
            out[("obj", e.request_id, e.delivery, e.via_request_id)].append(
                (e.location.group, e.location.object, e.status, e.subgroup_id,
                 e.publisher_priority, bytes(e.payload))
            )
        elif isinstance(e, ev.DataStreamEnded):
            out[("end", e.request_id, e.delivery)].append((e.group_id, e.reset_code))
        else:
            rid = getattr(e, "request_id", None)
            out[("ev", rid)].append(e)
    for key, value in out.items():
        if key[0] == "end":
            value.sort(key=repr)
    return dict(out)
