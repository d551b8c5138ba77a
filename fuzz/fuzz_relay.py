"""Fuzz the relay core (``kvcs_core.relay``) with operation lists from several sessions.

Invariant: whatever its peers do, the relay raises nothing, its cache never holds more
than its budget after any input, no single call does unbounded work, its timer is never
in the past after it fired, and every session it owns keeps to the transport rules.

A ``Relay`` owns one upstream session towards a publisher (a plain server session that
serves two ``TrackStore``\\ s and announces their namespace) and up to three downstream
client sessions, all on one deterministic loopback network (``kvcs.transports.loopback``)
with zero latency. The first input byte chooses the cache budget (1 KiB to 8 MiB) and a
request-rate limit; the rest is a sequence of operations, each one opcode byte
``kind | arg << 4`` plus the bytes it reads (a missing byte reads as 0):

======  ====================================================================
kind    operation (``s`` = subscriber ``arg % 3``, ``t`` = track ``arg >> 2 & 1``)
======  ====================================================================
0       the publisher appends an object: Group, Object (``pick`` bytes), size
        (next byte x 256 B); ``arg & 8``: with a 2 kB Object Property
1       the publisher ends a group (End of Group at Group ``pick``, Object ``pick``)
2       ``s`` SUBSCRIBEs to ``t``: filter kind (next byte) with start / end from
        ``pick``, a fill from ``pick`` (or none), FORWARD, RENDEZVOUS_TIMEOUT
3       ``s`` FETCHes ``t``: Absolute Range between two ``pick`` Locations
4       ``s`` sends REQUEST_UPDATE on one of its requests: FORWARD, a fill from ``pick``
5       ``s`` cancels one of its requests (unsubscribe / fetch cancel)
6       ``s``'s connection is cut; a new subscriber takes its place
7       time passes (``arg**2 / 100`` s) and timers fire
8       ``s`` sends TRACK_STATUS for ``t``
9       the publisher ends ``t`` (End of Track, PUBLISH_DONE TRACK_ENDED)
10      ``s`` SUBSCRIBEs to a track nobody publishes (a long name)
11      ``s`` sends SUBSCRIBE_NAMESPACE or SUBSCRIBE_TRACKS (``arg & 8``)
12      the publisher's connection is cut, a new publisher connects
13-15   as 0-2 (no opcode is wasted)
======  ====================================================================

At most ``MAX_OPS`` operations are read from one input, so that every input is a
few milliseconds of work (the campaign runs a million of them).

``pick(b)`` maps a byte to a Group or Object ID: small values as they are, and the
values that once hurt (2^62, 2^62 + k, 2^64 - 2, ...) for the high ones.

Checks after every operation: ``relay.cache_bytes <= budget``; ``relay.get_timer()``
is ``None`` or in the future once due timers fired; no relay call took more than
``CALL_LIMIT`` seconds (a hang guard: finding 3's ``range(0, 2**62)`` loop would trip
it at once); the network settles within ``MAX_STEPS`` steps per operation; the loopback
raises ``LoopbackError`` (an AssertionError) for any session that breaks a transport
rule.

Coverage guidance comes from ``kvcs_core.relay`` only (``fuzz_main(instrument=...)``):
the sessions around the relay are fuzzed by ``fuzz_session.py`` and run here
uninstrumented, which doubles the executions per second.

Seed corpus: ``python3 fuzz/fuzz_relay.py --make-corpus`` writes deterministic
scenarios (live subscription with fill, late joiner after eviction, far Group IDs,
FETCHes, updates, cancels, cut links, rendezvous, rate limit, phantom tracks) to
``fuzz/corpus/relay/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from fuzzlib import fuzz_main

from kvcs.transports.loopback import Livelock, Network
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import MalformedTrack, TrackStore
from kvcs_core.relay import Relay, RelayConfig
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import MAX_VI64, ObjectStatus, PublishDoneCode, RequestErrorCode
from kvcs_core.wire.errors import EncodeError
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import FullTrackName, TrackNamespace

NS = TrackNamespace.of("kvcs-1", b"fuzz-relay")
TRACKS = (FullTrackName(NS, b"t0"), FullTrackName(NS, b"t1"))
G62 = 1 << 62
FAR = (G62, G62 + 1, G62 + 2, G62 + 3, MAX_VI64 - 1, MAX_VI64, 1 << 32, (1 << 32) + 1)
CALL_LIMIT = 5.0
"""Seconds one relay call may take before it counts as unbounded work (a hang guard)."""
MAX_STEPS = 4000
"""Network steps one operation may take to settle."""
MAX_OPS = 32
SUBSCRIBERS = 3

(PUB_OBJECT, PUB_EOG, SUBSCRIBE, FETCH, UPDATE, CANCEL, CUT, TIME, STATUS, END_TRACK,
 PHANTOM, NAMESPACES, CUT_PUB) = range(13)  # fmt: skip


def pick(b: int) -> int:
    """A Group / Object ID from one byte (module docstring)."""
    return b if b < 248 else FAR[b - 248]


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    @property
    def more(self) -> bool:
        return self.at < len(self.data)


class RelayUnderTest:
    """A relay, its publisher and subscribers on one loopback network."""

    def __init__(self, budget: int, rate: float) -> None:
        self.budget = budget
        self.net = Network(seed=1, keep_events=False)
        self.relay = Relay(
            RelayConfig(
                cache_budget_bytes=budget,
                request_rate=rate,
                request_burst=8,
                fill_timeout=1.0,
                rendezvous_cap=2.0,
                max_rendezvous=4,
                max_tracks=16,
            )
        )
        self.owned: set[int] = set()
        self.stores: dict[FullTrackName, TrackStore] = {}
        self.pub: MoqtSession | None = None
        self.served: dict[int, FullTrackName] = {}
        self.subs: list[MoqtSession | None] = [None] * SUBSCRIBERS
        self.requests: list[list[int]] = [[] for _ in range(SUBSCRIBERS)]
        self.relay_sessions: list[MoqtSession] = []
        self.net.on_event(self._on_event, scoped=True)
        self._new_publisher()

    # --- building -----------------------------------------------------------------------

    def _config(self, role: Role) -> SessionConfig:
        return SessionConfig(role=role, setup_timeout=5.0, request_timeout=8.0)

    def _link(self, client: MoqtSession, server: MoqtSession) -> None:
        self.net.connect(client, server)
        for s in (client, server):
            s.start(now=self.net.now)
            self.net.poke(s)
        self.settle()

    def _new_publisher(self) -> None:
        up = MoqtSession(self._config(Role.CLIENT))
        pub = MoqtSession(self._config(Role.SERVER))
        self.owned.add(id(up))
        self.relay_sessions.append(up)
        self.relay.add_session(up, upstream=True)
        self.stores = {name: TrackStore(name) for name in TRACKS}
        self.served = {}
        self.pub = pub
        self._link(up, pub)
        if pub.setup_complete and not pub.is_closed:
            pub.publish_namespace(NS, now=self.net.now)
            self.net.poke(pub)

    def subscriber(self, k: int) -> MoqtSession | None:
        s = self.subs[k]
        if s is None or s.is_closed:
            down = MoqtSession(self._config(Role.SERVER))
            s = MoqtSession(self._config(Role.CLIENT))
            self.owned.add(id(down))
            self.relay_sessions.append(down)
            self.relay.add_session(down, upstream=False)
            self.subs[k] = s
            self.requests[k] = []
            self._link(s, down)
        return s if s.setup_complete and not s.is_closed else None

    # --- the applications ---------------------------------------------------------------

    def _on_event(self, machine: Any, e: Any) -> list[MoqtSession]:
        """Hand ``e`` to its application; returns the sessions that may have changed
        (the loopback drains only those again: ``Network.on_event(scoped=True)``)."""
        now = self.net.now
        if id(machine) in self.owned:  # the relay acts on any of its own sessions only
            self._timed(self.relay.handle_session_event, machine, e, now)
            self._fire()
            # only open sessions can have new output (a closed one sends nothing more);
            # naming every session ever made would drain them all on every event
            self.relay_sessions = [s for s in self.relay_sessions if not s.is_closed]
            return self.relay_sessions
        if machine is self.pub:
            self._publisher(machine, e, now)
            return [machine]
        if isinstance(e, ev.PublishRequested):  # a subscriber: accept PUBLISHes
            machine.accept_publish(e.request_id, now=now)
            return [machine]
        return []

    def _publisher(self, s: MoqtSession, e: Any, now: float) -> None:
        if isinstance(e, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
            store = self.stores.get(e.track)
            if store is None:
                s.reject_request(e.request_id, RequestErrorCode.DOES_NOT_EXIST, "no", now=now)
            elif isinstance(e, ev.SubscribeRequested):
                s.accept_subscribe(e.request_id, store, now=now)
                if store.end_of_track is not None:
                    s.end_subscription(e.request_id, PublishDoneCode.TRACK_ENDED, now=now)
                else:
                    self.served[e.request_id] = e.track
            elif isinstance(e, ev.FetchRequested):
                s.accept_fetch(e.request_id, store, now=now)
            else:
                s.accept_track_status(e.request_id, store, now=now)
        elif isinstance(e, ev.SubscribeNamespaceRequested | ev.SubscribeTracksRequested):
            s.accept_request(e.request_id, now=now)

    # --- driving and checks -------------------------------------------------------------

    def _timed(self, fn: Any, *args: Any) -> None:
        start = time.perf_counter()
        fn(*args)
        took = time.perf_counter() - start
        assert took < CALL_LIMIT, f"one relay call took {took:.1f} s: unbounded work"

    def _fire(self) -> None:
        now = self.net.now
        t = self.relay.get_timer()
        if t is not None and t <= now:
            self._timed(self.relay.handle_timer, now)
            after = self.relay.get_timer()
            assert after is None or after > now, f"relay timer {after} not after {now}"

    def settle(self, duration: float = 0.0) -> None:
        """Run the network for ``duration`` (and until quiet), firing relay timers."""
        end = self.net.now + duration
        for _ in range(64):
            self._fire()
            t = self.relay.get_timer()
            horizon = end if t is None or t > end else max(t, self.net.now)
            try:
                self.net.run_for(max(0.0, horizon - self.net.now), max_steps=MAX_STEPS)
            except Livelock as exc:
                raise AssertionError(f"the network did not settle: {exc}") from exc
            if horizon >= end:
                break
        self._fire()
        self.check()

    def check(self) -> None:
        total = self.relay.cache_bytes
        assert total <= self.budget, f"cache holds {total} > budget {self.budget}"

    # --- operations ---------------------------------------------------------------------

    def run(self, r: _Reader) -> None:
        for _ in range(MAX_OPS):
            if not r.more:
                return
            op = r.byte()
            kind, arg = op & 15, op >> 4
            if kind > CUT_PUB:
                kind -= CUT_PUB + 1
            # a local command the session refuses (closed, GOAWAY, bad values) is no bug
            with contextlib.suppress(LocalProtocolError, EncodeError):
                self.apply(kind, arg, r)
            self.settle()

    def apply(self, kind: int, arg: int, r: _Reader) -> None:
        now = self.net.now
        k = arg % SUBSCRIBERS
        name = TRACKS[arg >> 2 & 1]
        if kind == PUB_OBJECT:
            g, o, size = pick(r.byte()), pick(r.byte()), r.byte() * 256
            props = (KeyValuePair(0x41, b"p" * 2000),) if arg & 8 else ()
            # beyond an end, a conflicting duplicate: the store refuses
            with contextlib.suppress(MalformedTrack, ValueError):
                self.stores[name].append(g, o, bytes([g & 255]) * size, properties=props)
        elif kind == PUB_EOG:
            with contextlib.suppress(MalformedTrack, ValueError):
                self.stores[name].append(
                    pick(r.byte()), pick(r.byte()), status=ObjectStatus.END_OF_GROUP
                )
        elif kind in (SUBSCRIBE, PHANTOM):
            s = self.subscriber(k)
            if s is None:
                return
            mode, fill_at, flags = r.byte(), r.byte(), r.byte()
            lf = _filter(mode, r)
            fill = (
                p.Parameters.of(p.LocationFilter.absolute_start(pick(fill_at), 0))
                if flags & 1
                else None
            )
            extra: list[p.Parameter] = []
            if flags & 2:
                extra.append(p.RendezvousTimeout((flags >> 2) * 40))
            target = (
                FullTrackName(NS, b"missing-" + bytes([fill_at]) * 2000)
                if kind == PHANTOM
                else name
            )
            rid = s.subscribe(
                target,
                now=now,
                location_filter=lf,
                fill=fill,
                forward=not flags & 0x80,
                extra=extra,
            )
            self.requests[k].append(rid)
            self.net.poke(s)
        elif kind == FETCH:
            s = self.subscriber(k)
            if s is None:
                return
            a, b, c, d = (pick(r.byte()) for _ in range(4))
            lo, hi = min(a, c), max(a, c)
            rid = s.fetch(
                name, now=now, location_filter=p.LocationFilter.absolute_range(lo, b, hi, d)
            )
            self.requests[k].append(rid)
            self.net.poke(s)
        elif kind == UPDATE:
            s = self.subscriber(k)
            rids = self.requests[k]
            if s is None or not rids:
                return
            rid, flags, at = rids[r.byte() % len(rids)], r.byte(), r.byte()
            items: list[p.Parameter] = [p.Forward(flags & 1)]
            if flags & 2:
                items.append(
                    p.FillParameters(p.Parameters.of(p.LocationFilter.absolute_start(pick(at), 0)))
                )
            s.request_update(rid, p.Parameters(items), now=now)
            self.net.poke(s)
        elif kind == CANCEL:
            s = self.subscriber(k)
            rids = self.requests[k]
            if s is None or not rids:
                return
            rid = rids.pop(r.byte() % len(rids))
            s.cancel(rid, now=now)
            self.net.poke(s)
        elif kind == CUT:
            s = self.subs[k]
            if s is not None and not s.is_closed:
                self.net.link_of(s).cut()
        elif kind == TIME:
            self.settle(arg * arg / 100)
        elif kind == STATUS:
            s = self.subscriber(k)
            if s is not None:
                s.track_status(name, now=now)
                self.net.poke(s)
        elif kind == END_TRACK:
            self._end_track(name)
        elif kind == NAMESPACES:
            s = self.subscriber(k)
            if s is not None:
                if arg & 8:
                    s.subscribe_tracks(NS, now=now)
                else:
                    s.subscribe_namespace(TrackNamespace.of("kvcs-1"), now=now)
                self.net.poke(s)
        elif kind == CUT_PUB:
            if self.pub is not None and not self.pub.is_closed:
                self.net.link_of(self.pub).cut()
                self.settle()
            self._new_publisher()

    def _end_track(self, name: FullTrackName) -> None:
        store = self.stores[name]
        if store.end_of_track is not None or self.pub is None:
            return
        largest = store.largest
        g = 0 if largest is None else min(largest.group + 1, MAX_VI64)
        try:
            store.append(g, 0, status=ObjectStatus.END_OF_TRACK)
        except (MalformedTrack, ValueError):
            return
        for rid, n in list(self.served.items()):
            if n == name:
                del self.served[rid]
                rec = self.pub.requests.get(rid)
                if rec is not None and not rec.finished and not rec.local_fin:
                    self.pub.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=self.net.now)
        self.net.poke(self.pub)


def _filter(mode: int, r: _Reader) -> p.LocationFilter:
    kind = mode % 6
    if kind == 0:
        return p.LocationFilter.next_object()
    if kind == 1:
        return p.LocationFilter.relative_start(r.byte())
    if kind == 2:
        return p.LocationFilter.absolute_start(pick(r.byte()), pick(r.byte()))
    if kind == 3:
        g = pick(r.byte())
        return p.LocationFilter.absolute_group_end(g, pick(r.byte()), min(MAX_VI64, g + r.byte()))
    if kind == 4:
        return p.LocationFilter.none()
    a, b = pick(r.byte()), pick(r.byte())
    return p.LocationFilter.absolute_range(min(a, b), 0, max(a, b), pick(r.byte()))


def check(data: bytes) -> None:
    r = _Reader(data)
    head = r.byte()
    budget = 1 << (10 + head % 14)
    rate = 0.0 if head & 0x80 else 40.0
    RelayUnderTest(budget, rate).run(r)


# --- seed corpus ----------------------------------------------------------------------------


def _op(kind: int, arg: int = 0, *more: int) -> bytes:
    return bytes([kind | arg << 4, *more])


def _seeds() -> dict[str, bytes]:
    small, mid = 0x80 | 0, 0x80 | 6  # 1 KiB / 64 KiB budgets, no rate limit
    objs_t0 = b"".join(_op(PUB_OBJECT, 0, g, o, 16) for g in range(4) for o in range(3))
    sub_fill = _op(SUBSCRIBE, 0, 0, 0, 1)  # NEXT_OBJECT + fill from {0,0}
    far = b"".join(_op(PUB_OBJECT, 0, g, 0, 255) for g in (0, 248, 249, 250))
    return {
        "live-fill": bytes([mid]) + sub_fill + objs_t0 + _op(TIME, 5),
        "late-joiner-evicted": bytes([small])
        + sub_fill
        + objs_t0
        + _op(SUBSCRIBE, 1, 0, 0, 1)
        + _op(TIME, 8),
        "far-groups": bytes([0x80 | 10])
        + sub_fill
        + far
        + _op(TIME, 3)
        + _op(SUBSCRIBE, 1, 0, 0, 1)
        + _op(TIME, 9),
        "fetch-range": bytes([mid])
        + objs_t0
        + _op(FETCH, 0, 0, 0, 3, 2)
        + _op(FETCH, 1, 248, 0, 250, 0)
        + _op(TIME, 4),
        "updates": bytes([mid])
        + sub_fill
        + objs_t0
        + _op(UPDATE, 0, 0, 0, 0)
        + _op(UPDATE, 0, 0, 3, 1)
        + _op(TIME, 4),
        "cancel-and-cut": bytes([mid])
        + sub_fill
        + objs_t0
        + _op(CANCEL, 0, 0)
        + _op(SUBSCRIBE, 2, 0, 0, 1)
        + _op(CUT, 2)
        + _op(TIME, 6),
        "rendezvous": bytes([mid])
        + _op(CUT_PUB)
        + _op(SUBSCRIBE, 1, 0, 0, 0x0B)
        + _op(TIME, 2)
        + _op(TIME, 9),
        "phantoms": bytes([mid]) + b"".join(_op(PHANTOM, 0, i, i, 0) for i in range(10)),
        "rate-limited": bytes([6])
        + b"".join(_op(STATUS, 0) for _ in range(12))
        + _op(TIME, 10)
        + _op(STATUS, 0),
        "properties": bytes([0x80 | 4])
        + sub_fill
        + b"".join(_op(PUB_OBJECT, 8, g, 0, 0) for g in range(8)),
        "end-track": bytes([mid])
        + sub_fill
        + objs_t0
        + _op(END_TRACK)
        + _op(TIME, 4)
        + _op(SUBSCRIBE, 1, 0, 0, 1)
        + _op(TIME, 6),
        "namespaces-tracks": bytes([mid])
        + _op(NAMESPACES, 0)
        + _op(NAMESPACES, 9)
        + objs_t0
        + _op(TIME, 3),
        "publisher-lost": bytes([mid])
        + sub_fill
        + objs_t0
        + _op(CUT_PUB)
        + _op(TIME, 5)
        + _op(FETCH, 1, 0, 0, 3, 0),
        "filters": bytes([mid])
        + objs_t0
        + b"".join(_op(SUBSCRIBE, 0, m, 0, 1, 1, 2, 3) for m in range(6))
        + _op(TIME, 4),
        "big-object": bytes([0x80 | 0])
        + sub_fill
        + _op(PUB_OBJECT, 0, 0, 0, 255)
        + _op(PUB_OBJECT, 0, 0, 1, 255)
        + _op(TIME, 3),
    }


def make_corpus(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.bin"):
        old.unlink()
    written = []
    for name, data in sorted(_seeds().items()):
        check(data)  # every seed is a valid input
        digest = hashlib.sha256(data).hexdigest()[:8]
        path = out / f"seed-{name}-{digest}.bin"
        path.write_bytes(data)
        written.append(path)
    return written


def main() -> None:
    if "--make-corpus" in sys.argv:
        files = make_corpus(Path(__file__).resolve().parent / "corpus" / "relay")
        total = sum(f.stat().st_size for f in files)
        print(f"wrote {len(files)} seeds, {total} bytes")
        return
    fuzz_main(check, instrument=("kvcs_core.relay",))


if __name__ == "__main__":
    main()
