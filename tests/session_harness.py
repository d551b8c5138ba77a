"""Shared helpers for the session robustness tests (not a test module).

* :class:`Tap` wraps a :class:`MoqtSession` as a loopback machine and records
  every transport command it emits (control commands and pulled data), so a
  test can read what a session wrote on a stream nobody listens to (an
  injected one) or which ``CloseTransport`` code it used. It also checks, after
  every ``handle_timer(now)``, that ``get_timer()`` is not ``<= now``.
* :class:`World` is one :class:`Network` with any number of client/server
  :class:`Pair`\\ s; servers answer requests automatically from their own
  :class:`TrackStore` (auto-serve), so a pair can be proven alive after a
  neighbour was broken (:meth:`World.prove_alive`).
* Raw-byte builders (:func:`frame`, :func:`param_block`,
  :func:`raw_track_request`, ...) make messages the codec refuses to encode
  (disallowed or repeated parameters) from the codec's own primitives.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvcs.transports.loopback import Chunking, Link, Network
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.moqt.transport_io import (
    CloseTransport,
    SendDatagram,
    StreamRef,
    TransportCommand,
    TransportEvent,
    WriteStream,
)
from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import MessageType, ObjectStatus, ParameterType, SessionErrorCode
from kvcs_core.wire.names import (
    FullTrackName,
    TrackNamespace,
    encode_namespace,
    encode_track_name,
)
from kvcs_core.wire.varint import encode_vi64

NS = TrackNamespace.of("kvcs-1", b"x" * 16)
TRACK = FullTrackName(NS, b"k.raw.s0")
SESSION_CODES = frozenset(int(c) for c in SessionErrorCode)


# --------------------------------------------------------------------------- machines


class Tap:
    """A loopback machine that forwards to a session and records its commands.

    Any attribute not defined here (``subscribe``, ``requests``, ...) is the
    session's, so a test calls local commands on the tap directly.
    """

    def __init__(self, session: MoqtSession) -> None:
        self.session = session
        self.commands: list[TransportCommand] = []
        self.pulled: list[WriteStream | SendDatagram] = []
        self.timer_calls = 0

    def __repr__(self) -> str:
        return f"<Tap {self.session.config.role.name}>"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def handle_transport_event(self, event: TransportEvent, now: float) -> None:
        self.session.handle_transport_event(event, now)

    def handle_timer(self, now: float) -> None:
        self.session.handle_timer(now)
        # the call protocol: handle_timer fires everything due, so what remains is later
        t = self.session.get_timer()
        assert t is None or t > now, f"{self!r}: get_timer() = {t} <= now {now} after handle_timer"
        self.timer_calls += 1

    def next_command(self) -> TransportCommand | None:
        cmd = self.session.next_command()
        if cmd is not None:
            self.commands.append(cmd)
        return cmd

    def get_timer(self) -> float | None:
        return self.session.get_timer()

    def next_event(self) -> ev.SessionEvent | None:
        return self.session.next_event()

    def poll_data(self, max_bytes: int) -> WriteStream | SendDatagram | None:
        item = self.session.poll_data(max_bytes)
        if item is not None:
            self.pulled.append(item)
        return item

    def written(self, stream: StreamRef) -> bytes:
        """Every byte this session wrote on ``stream`` (its own name for it)."""
        return b"".join(
            bytes(c)
            for cmd in [*self.commands, *self.pulled]
            if isinstance(cmd, WriteStream) and cmd.stream == stream
            for c in cmd.chunks
        )

    def messages_on(self, stream: StreamRef) -> list[m.ControlMessage]:
        """The control messages this session wrote on request stream ``stream``."""
        return m.ControlStreamDecoder().feed(self.written(stream))

    def close_codes(self) -> list[int]:
        return [c.code for c in self.commands if isinstance(c, CloseTransport)]


@attrs.define(eq=False)
class Pair:
    """A client and a server session linked over one loopback link."""

    cli: Tap
    srv: Tap
    link: Link
    store: TrackStore
    auto: bool = True
    """The server answers every peer request from ``store`` (see :class:`World`)."""

    def server_ref(self, client_stream: StreamRef) -> StreamRef:
        """The server's name for a stream the client opened."""
        return self.link.endpoint(self.cli).peer_ref(client_stream)

    def client_ref(self, server_stream: StreamRef) -> StreamRef:
        """The client's name for a stream the server opened."""
        return self.link.endpoint(self.srv).peer_ref(server_stream)

    @property
    def server_control_in(self) -> StreamRef:
        """The server's name for the client's control stream (the client's first stream)."""
        return self.server_ref(StreamRef(True, 0))

    @property
    def client_control_in(self) -> StreamRef:
        return self.client_ref(StreamRef(True, 0))


class World:
    """One network and its pairs; servers auto-answer requests from their stores."""

    def __init__(self, seed: int = 1) -> None:
        self.net = Network(seed=seed)
        self.pairs: list[Pair] = []
        self.local_errors: list[LocalProtocolError] = []
        self.net.on_event(self._serve)

    @property
    def now(self) -> float:
        return self.net.now

    def pair(
        self,
        *,
        client: SessionConfig | None = None,
        server: SessionConfig | None = None,
        start_client: bool = True,
        start_server: bool = True,
        latency: float = 0.005,
        chunking: Chunking = Chunking.WHOLE,
        store: TrackStore | None = None,
        auto: bool = True,
        objects: int = 0,
        **link_options: Any,
    ) -> Pair:
        """A new pair on this network; both sessions started unless told otherwise.

        ``link_options`` go to ``Network.connect`` (``zero_copy``, ``bandwidth``, ...).
        """
        cli = Tap(MoqtSession(client or SessionConfig(role=Role.CLIENT)))
        srv = Tap(MoqtSession(server or SessionConfig(role=Role.SERVER)))
        link = self.net.connect(cli, srv, latency=latency, chunking=chunking, **link_options)
        pair = Pair(cli, srv, link, store or TrackStore(TRACK), auto)
        for i in range(objects):
            pair.store.append(0, i, bytes([i]) * 10)
        now = self.net.now
        if start_client:
            cli.start(now=now)
            self.net.poke(cli)
        if start_server:
            srv.start(now=now)
            self.net.poke(srv)
        self.pairs.append(pair)
        return pair

    def _pair_of_server(self, machine: object) -> Pair | None:
        for pr in self.pairs:
            if pr.srv is machine:
                return pr
        return None

    def _serve(self, machine: Any, e: Any) -> None:
        pr = self._pair_of_server(machine)
        if pr is None or not pr.auto or pr.srv.is_closed:
            return
        now = self.net.now
        srv = pr.srv
        try:
            if isinstance(e, ev.SubscribeRequested):
                srv.accept_subscribe(e.request_id, pr.store, now=now)
            elif isinstance(e, ev.FetchRequested):
                srv.accept_fetch(e.request_id, pr.store, now=now)
            elif isinstance(e, ev.TrackStatusRequested):
                srv.accept_track_status(e.request_id, pr.store, now=now)
            elif isinstance(
                e,
                ev.PublishNamespaceRequested
                | ev.SubscribeNamespaceRequested
                | ev.SubscribeTracksRequested,
            ):
                srv.accept_request(e.request_id, now=now)
        except LocalProtocolError as err:  # e.g. the request was already refused
            self.local_errors.append(err)

    # --- driving ---------------------------------------------------------------------

    def events(self, machine: Any, kind: type | tuple[type, ...] = object) -> list[Any]:
        return [e for e in self.net.events(machine) if isinstance(e, kind)]

    def setup(self, *pairs: Pair, max_time: float = 5.0) -> None:
        """Run until every pair has exchanged SETUP."""

        def done() -> bool:
            return all(
                self.events(pr.cli, ev.SetupCompleted) and self.events(pr.srv, ev.SetupCompleted)
                for pr in pairs
            )

        self.net.run_until(done, max_time=max_time)

    def run(self, seconds: float = 0.2) -> None:
        self.net.run_for(seconds)

    def closed(self, machine: Any) -> ev.SessionClosed | None:
        got = self.events(machine, ev.SessionClosed)
        assert len(got) <= 1, f"{machine!r} emitted {len(got)} SessionClosed events"
        return got[0] if got else None

    def assert_open(self, *machines: Any) -> None:
        for mach in machines:
            assert not mach.is_closed, f"{mach!r} closed: {self.closed(mach)}"
            assert self.closed(mach) is None

    def assert_closed(self, pair: Pair, code: int, *, by: str = "srv") -> None:
        """``by`` closed with ``code`` (LOCAL) and its peer saw CloseTransport(code)."""
        culprit, peer = (pair.srv, pair.cli) if by == "srv" else (pair.cli, pair.srv)
        mine = self.closed(culprit)
        assert mine is not None, f"{culprit!r} did not close; events: {self.net.events(culprit)}"
        assert (mine.code, mine.initiator) == (code, ev.Initiator.LOCAL), mine
        assert culprit.close_codes() == [code]
        assert culprit.is_closed and culprit.get_timer() is None
        theirs = self.closed(peer)
        assert theirs is not None, f"{peer!r} never saw the close"
        assert (theirs.code, theirs.initiator) == (code, ev.Initiator.PEER), theirs
        assert pair.link.closed and pair.link.close_info is not None
        assert pair.link.close_info.code == code
        # nothing after SessionClosed
        assert self.net.events(culprit)[-1] is mine

    def prove_alive(self, pair: Pair, *, objects: int = 3) -> None:
        """A fresh subscription with a fill on ``pair`` completes and delivers live objects."""
        self.assert_open(pair.cli, pair.srv)
        before = len(self.events(pair.cli, ev.ObjectReceived))
        largest = pair.store.largest
        g = 0 if largest is None else largest.group + 1
        pair.store.append(g, 0, b"filled")
        rid = pair.cli.subscribe(
            pair.store.name,
            now=self.now,
            location_filter=p.LocationFilter.next_object(),
            fill=p.Parameters.of(p.LocationFilter.absolute_start(g, 0)),
        )
        self.net.poke(pair.cli)

        def accepted() -> bool:
            return any(e.request_id == rid for e in self.events(pair.cli, ev.SubscribeAccepted))

        self.net.run_until(accepted, max_time=5.0)
        for i in range(1, objects + 1):
            pair.store.append(g, i, bytes([i]) * 100)
        pair.store.append(g, objects + 1, status=ObjectStatus.END_OF_GROUP)

        def got_all() -> bool:
            locs = {
                (e.location.group, e.location.object)
                for e in self.events(pair.cli, ev.ObjectReceived)[before:]
                if e.request_id == rid
            }
            return all((g, i) in locs for i in range(objects + 2))

        self.net.run_until(got_all, max_time=5.0)
        self.assert_open(pair.cli, pair.srv)


# --------------------------------------------------------------------------- raw bytes


def frame(mtype: int, body: bytes) -> bytes:
    """``Type | Length(16) | Body`` for any type, known or not."""
    return encode_vi64(mtype) + len(body).to_bytes(2, "big") + body


def param_block(*params: tuple[int, bytes]) -> bytes:
    """A parameter block from ``(type, encoded value)`` pairs, in the order given."""
    out = bytearray(encode_vi64(len(params)))
    prev = 0
    for t, value in params:
        out += encode_vi64(t - prev)
        prev = t
        out += value
    return bytes(out)


def raw_track_request(
    mtype: MessageType, request_id: int, track: FullTrackName = TRACK, params: bytes = b"\x00"
) -> bytes:
    """SUBSCRIBE / FETCH / TRACK_STATUS framed around a raw parameter block."""
    body = bytearray(encode_vi64(request_id))
    encode_namespace(track.namespace, body)
    encode_track_name(track.name, body)
    body += params
    return frame(mtype, bytes(body))


def raw_request_update(request_id: int, params: bytes = b"\x00") -> bytes:
    return frame(MessageType.REQUEST_UPDATE, encode_vi64(request_id) + params)


def subscribe_bytes(request_id: int, *items: p.Parameter, track: FullTrackName = TRACK) -> bytes:
    """A valid SUBSCRIBE from the codec."""
    return m.encode_message(
        m.Subscribe(request_id, track.namespace, track.name, p.Parameters(items))
    )


def client_setup_bytes(**options: Any) -> bytes:
    return m.encode_message(
        m.Setup(max_filter_ranges=16, moqt_implementation=b"raw-peer", **options)
    )


def range_filter(n_ranges: int, *, set_id: int = 0) -> p.RangeFilter:
    """OBJECTID_FILTER with ``n_ranges`` disjoint ranges."""
    return p.RangeFilter(
        ParameterType.OBJECTID_FILTER,
        set_id,
        None,
        [(10 * i, 10 * i + 1) for i in range(n_ranges)],
    )


def drive(session: MoqtSession, events: Iterable[TransportEvent], now: float = 0.0) -> None:
    """Feed events to a bare session (no network)."""
    for e in events:
        session.handle_transport_event(e, now)
