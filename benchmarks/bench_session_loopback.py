"""End-to-end data path: a publisher session to a subscriber session over the loopback.

Run from the repository root::

    python3 benchmarks/bench_session_loopback.py [--groups G] [--objects N] [--size BYTES]
        [--repeat R] [--latency S] [--bandwidth B] [--link copy|zero-copy|both]
        [--profile live|fetch] [--top K]

Two :class:`~kvcs_core.moqt.session.MoqtSession` machines (server = publisher,
client = subscriber) are joined by one :class:`kvcs.transports.loopback.Network`
link (default 1 ms one-way latency, 1 GB/s of virtual bandwidth, whole-write
chunking). The track holds G groups (one per "layer") of N objects of BYTES
each, an End of Group marker closing every group: by default 32 x 64 x 32 KiB
= 64 MiB of payload, every object different (seeded random bytes). Two cases:

* **live**: the client SUBSCRIBEs (NEXT_OBJECT) to the empty track; then the
  server's application appends one group at a time to the ``TrackStore`` and
  lets the network run for the virtual time the link needs to carry a group,
  and finally runs it until every object has arrived;
* **fetch**: everything is in the ``TrackStore`` already; the client FETCHes
  groups 0..G-1 (ascending) and the network runs until every object arrived.

Each case runs over a link that copies every write (the loopback's default,
as a kernel socket would) and over one with ``zero_copy=True``, which carries
the store's payload buffers themselves, so that only the sessions' own copies
remain (``--link`` picks one). On the copying link the subscriber's payloads
are views into the link's copy; over the zero-copy link header and payload
arrive as separate events, and the subscriber's decoder copies each payload
once as it completes.

Reported per case and link, with its reference, the ratio and the target:

* **throughput**: payload bytes of the ``ObjectReceived`` events handed to the
  subscriber's application per second of wall time (``time.perf_counter``,
  best of R), from the first append (live) / the FETCH call (fetch) to the last
  object. Reference: ``hashlib.sha256`` over the same payload bytes, best of
  2R, timed right before and right after each transfer so that machine load
  hits both sides.
  Target: at least 2x SHA-256.
* **payload memory held**: the peak, over the transfer, of the bytes of every
  buffer the link and the receiver hold that is not the publisher's own payload
  buffer (each buffer counted once): the link's in-flight copies, object
  headers, and the payload just handed to the application if the receiver
  copied it. Sampled after every network step and at every ``ObjectReceived``.
  It does not see inside the receiver's decoder, which keeps nothing between
  two events as long as every object fits in one pull (the link's budget per
  pacing slot, 1 MB here); larger objects span writes, the decoder keeps the
  delivered pieces until it joins them, and only tracemalloc counts those.
  Reference: the peak *bytes in flight*, stream and
  datagram bytes sent and not yet delivered (``Link.in_flight_chunks``).
  Target: at most 1.25x, i.e. at most one copy of each payload in flight.
* **tracemalloc peak**: every allocation during the transfer above what was
  in use when it started (a separate run: tracing slows Python down). It also
  counts what the transfer keeps for good, which grows with the track and not
  with what is in flight (the store's index of live objects, the loopback's
  ``sent_log``, stream bookkeeping): the ratio is over the peak less what is
  still allocated at the end, so it is informative only.

Payload checks: the timed runs check every object's length and its first and
last 16 bytes against what was appended, plus the object count and the total;
one untimed run per case and link first compares every payload byte for byte
and checks that each Location arrived exactly once. The application drops each
payload as soon as it has checked it (``keep_events`` is off), as a consumer
that copies it onward (to a GPU) would.

MB = 10**6 bytes. ``--profile live|fetch`` runs that case once under cProfile
instead (the copying link unless ``--link zero-copy``) and prints the top K
functions by cumulative time (all, then ``kvcs_core`` only) and by own time,
and own time summed per component.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import pstats
import random
import sys
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcs.transports.loopback import Network
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.names import FullTrackName, TrackNamespace

THROUGHPUT_TARGET = 2.0
"""Session payload throughput / SHA-256 throughput: at least this."""
MEMORY_TARGET = 1.25
"""Peak payload memory held / peak bytes in flight: at most this (one copy)."""
TRACK = FullTrackName(TrackNamespace.of("kvcs-1", b"b" * 16), b"k.raw.s0")


class Payloads:
    """G x N payloads of ``size`` seeded random bytes: views into one buffer."""

    def __init__(self, groups: int, objects: int, size: int) -> None:
        self.groups, self.objects, self.size = groups, objects, size
        self.count = groups * objects
        self.total = self.count * size
        self.buf = random.Random(20240601).randbytes(self.total)
        view = memoryview(self.buf)
        self.views = [view[i * size : (i + 1) * size] for i in range(self.count)]

    def offset(self, group: int, obj: int) -> int:
        return (group * self.objects + obj) * self.size

    def append_group(self, store: TrackStore, group: int) -> None:
        base = group * self.objects
        for o in range(self.objects):
            store.append(group, o, self.views[base + o])
        store.append(group, self.objects, status=ObjectStatus.END_OF_GROUP)

    def sha256_seconds(self) -> float:
        """Wall time of one ``hashlib.sha256`` over every payload, in order."""
        t0 = time.perf_counter()
        h = hashlib.sha256()
        for v in self.views:
            h.update(v)
        h.digest()
        return time.perf_counter() - t0


class Consumer:
    """The subscriber's application: checks every object it is handed, then drops it."""

    def __init__(self, payloads: Payloads, *, full: bool) -> None:
        self.p = payloads
        self.full = full
        self.count = 0
        self.nbytes = 0
        self.seen: set[tuple[int, int]] = set()

    def on_object(self, e: ev.ObjectReceived) -> None:
        pl = e.payload
        n = pl.nbytes
        if n == 0 and e.status is not ObjectStatus.NORMAL:
            return  # End of Group
        P = self.p
        loc = e.location
        if loc.object >= P.objects or loc.group >= P.groups or n != P.size:
            raise SystemExit(f"unexpected object {loc} of {n} bytes")
        off = P.offset(loc.group, loc.object)
        if self.full:
            if pl != P.views[off // P.size]:
                raise SystemExit(f"payload of {loc} differs from what was appended")
            key = (loc.group, loc.object)
            if key in self.seen:
                raise SystemExit(f"{loc} arrived twice")
            self.seen.add(key)
        elif pl[:16] != P.buf[off : off + 16] or pl[-16:] != P.buf[off + n - 16 : off + n]:
            raise SystemExit(f"payload of {loc} differs from what was appended")
        self.count += 1
        self.nbytes += n

    @property
    def done(self) -> bool:
        return self.count == self.p.count

    def verify(self) -> None:
        P = self.p
        if self.count != P.count or self.nbytes != P.total:
            raise SystemExit(
                f"got {self.count} objects / {self.nbytes} bytes, want {P.count} / {P.total}"
            )
        if self.full and len(self.seen) != P.count:
            raise SystemExit("some Location arrived twice or never")


class Rig:
    """A publisher and a subscriber session on one loopback link, past SETUP."""

    def __init__(
        self, args: argparse.Namespace, zero_copy: bool, store: TrackStore, consumer: Consumer
    ) -> None:
        self.store = store
        self.consumer = consumer
        self.cli = MoqtSession(SessionConfig(role=Role.CLIENT))
        self.srv = MoqtSession(SessionConfig(role=Role.SERVER))
        self.net = Network(seed=1, keep_events=False)
        self.link = self.net.connect(
            self.cli, self.srv, latency=args.latency, bandwidth=args.bandwidth, zero_copy=zero_copy
        )
        self.accepted = False
        self.sampling = False
        self.peak_in_flight = 0
        self.peak_held = 0
        self.net.on_event(self._on_event)
        self.cli.start(now=0.0)
        self.srv.start(now=0.0)
        self.net.run_until(lambda: self.cli.setup_complete and self.srv.setup_complete)

    def _on_event(self, machine: Any, e: Any) -> None:
        if machine is self.cli:
            if type(e) is ev.ObjectReceived:
                if self.sampling:  # the receiver holds this payload now, besides the link
                    self.sample(extra=e.payload)
                self.consumer.on_object(e)
            elif isinstance(e, ev.SubscribeAccepted | ev.FetchAccepted):
                self.accepted = True
            elif isinstance(e, ev.RequestFailed | ev.SessionClosed | ev.PublishDoneReceived):
                raise SystemExit(f"subscriber: unexpected {e!r}")
        elif isinstance(e, ev.SubscribeRequested):
            self.srv.accept_subscribe(e.request_id, self.store, now=self.net.now)
        elif isinstance(e, ev.FetchRequested):
            self.srv.accept_fetch(e.request_id, self.store, now=self.net.now)
        elif isinstance(e, ev.RequestFailed | ev.SessionClosed):
            raise SystemExit(f"publisher: unexpected {e!r}")

    def sample(self, extra: memoryview | None = None) -> None:
        """Update the peaks of bytes in flight and of memory held (see the module docstring)."""
        chunks = self.link.in_flight_chunks()
        self.peak_in_flight = max(self.peak_in_flight, sum(len(c) for c in chunks))
        if extra is not None:
            chunks.append(extra)
        store_buf = self.consumer.p.buf
        owners: dict[int, int] = {}
        for c in chunks:
            obj = c.obj if isinstance(c, memoryview) else c
            if obj is not store_buf:
                owners[id(obj)] = memoryview(obj).nbytes
        self.peak_held = max(self.peak_held, sum(owners.values()))

    def run_for(self, seconds: float) -> None:
        net = self.net
        if not self.sampling:
            net.run_for(seconds, max_steps=10_000_000)
            return
        end = net.now + seconds
        while (t := net.next_time()) is not None and t <= end:
            net.step()
            self.sample()
        net.run_for(max(0.0, end - net.now))

    def run_until_done(self) -> None:
        net, consumer = self.net, self.consumer
        if not self.sampling:
            net.run_until(lambda: consumer.done, max_steps=10_000_000)
            return
        while not consumer.done:
            if not net.step():
                raise SystemExit("the network went idle before every object arrived")
            self.sample()


class Transfer:
    """One case, set up to the point where the timed transfer starts."""

    def __init__(
        self, args: argparse.Namespace, zero_copy: bool, payloads: Payloads, consumer: Consumer
    ) -> None:
        self.payloads = payloads
        self.store = TrackStore(TRACK)
        self.rig = Rig(args, zero_copy, self.store, consumer)

    def run(self) -> None:
        raise NotImplementedError


class Live(Transfer):
    """Subscribed to the empty track; ``run`` appends the groups while the network runs."""

    def __init__(
        self, args: argparse.Namespace, zero_copy: bool, payloads: Payloads, consumer: Consumer
    ) -> None:
        super().__init__(args, zero_copy, payloads, consumer)
        rig = self.rig
        rig.cli.subscribe(TRACK, now=rig.net.now, location_filter=p.LocationFilter.next_object())
        rig.net.run_until(lambda: rig.accepted)
        bw = args.bandwidth
        self.layer_time = payloads.objects * payloads.size / bw if bw else 0.0

    def run(self) -> None:
        rig = self.rig
        for g in range(self.payloads.groups):
            self.payloads.append_group(self.store, g)
            rig.net.poke(rig.srv)  # the store fed the session: it has data to pull now
            rig.run_for(self.layer_time)
        rig.run_until_done()


class Fetch(Transfer):
    """Every group in the store; ``run`` FETCHes them all."""

    def __init__(
        self, args: argparse.Namespace, zero_copy: bool, payloads: Payloads, consumer: Consumer
    ) -> None:
        super().__init__(args, zero_copy, payloads, consumer)
        for g in range(payloads.groups):
            payloads.append_group(self.store, g)

    def run(self) -> None:
        rig = self.rig
        last = self.payloads.groups - 1
        rig.cli.fetch(
            TRACK, now=rig.net.now, location_filter=p.LocationFilter.absolute_group_end(0, 0, last)
        )
        rig.run_until_done()


CASES: dict[str, type[Transfer]] = {"live": Live, "fetch": Fetch}


def timed_run(
    args: argparse.Namespace, case: str, zero_copy: bool, payloads: Payloads, *, full: bool
) -> float:
    consumer = Consumer(payloads, full=full)
    transfer = CASES[case](args, zero_copy, payloads, consumer)
    gc.collect()
    t0 = time.perf_counter()
    transfer.run()
    dt = time.perf_counter() - t0
    consumer.verify()
    return dt


def held_run(
    args: argparse.Namespace, case: str, zero_copy: bool, payloads: Payloads
) -> tuple[int, int]:
    """(peak payload memory held, peak bytes in flight)."""
    consumer = Consumer(payloads, full=False)
    transfer = CASES[case](args, zero_copy, payloads, consumer)
    transfer.rig.sampling = True
    transfer.run()
    consumer.verify()
    return transfer.rig.peak_held, transfer.rig.peak_in_flight


def tracemalloc_run(
    args: argparse.Namespace, case: str, zero_copy: bool, payloads: Payloads
) -> tuple[int, int]:
    """(tracemalloc peak above the start, still allocated at the end above the start)."""
    consumer = Consumer(payloads, full=False)
    transfer = CASES[case](args, zero_copy, payloads, consumer)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    transfer.run()
    gc.collect()
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    consumer.verify()
    return peak - base, cur - base


COMPONENTS = (
    ("transports/loopback", "loopback network"),
    ("kvcs_core/wire", "kvcs_core.wire (codec)"),
    ("kvcs_core/moqt/publishing", "moqt publisher"),
    ("kvcs_core/moqt/scheduler", "moqt publisher"),
    ("kvcs_core/moqt/track_store", "moqt track store"),
    ("kvcs_core/moqt/receiving", "moqt receiver"),
    ("kvcs_core/moqt", "moqt session, other"),
    ("benchmarks/", "this benchmark"),
    ("attrs generated", "attrs __init__ (kvcs_core types)"),
)


def profile(args: argparse.Namespace, payloads: Payloads) -> None:
    zero_copy = args.link == "zero-copy"
    consumer = Consumer(payloads, full=False)
    transfer = CASES[args.profile](args, zero_copy, payloads, consumer)
    prof = cProfile.Profile()
    prof.enable()
    transfer.run()
    prof.disable()
    consumer.verify()
    print(f"case {args.profile}, zero_copy={zero_copy}, {payloads.count} objects")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("kvcs_core", args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    own: dict[str, float] = defaultdict(float)
    for (path, _, _), (_, _, tt, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        name = next((n for key, n in COMPONENTS if key in path), "builtins / C")
        own[name] += tt
    total = sum(own.values())
    print("own time by component:")
    for name, tt in sorted(own.items(), key=lambda kv: -kv[1]):
        print(f"  {name:34} {tt:7.3f} s  {100 * tt / total:5.1f} %")


def mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def verdict(ok: bool, target: str) -> str:
    return f"{'met' if ok else 'MISSED'} ({target})"


def measure(
    args: argparse.Namespace, case: str, zero_copy: bool, payloads: Payloads
) -> list[tuple[str, ...]]:
    name = f"{case}, {'zero-copy' if zero_copy else 'copying'} link"
    timed_run(args, case, zero_copy, payloads, full=True)  # untimed: every byte, once each
    sha = dt = float("inf")
    for _ in range(args.repeat):  # interleaved, so that machine load hits both sides
        sha = min(sha, payloads.sha256_seconds())
        dt = min(dt, timed_run(args, case, zero_copy, payloads, full=False))
        sha = min(sha, payloads.sha256_seconds())
    rate, sha_rate = payloads.total / dt, payloads.total / sha
    held, flight = held_run(args, case, zero_copy, payloads)
    peak, kept = tracemalloc_run(args, case, zero_copy, payloads)
    return [
        (
            name,
            "throughput",
            f"{rate / 1e6:.0f} MB/s",
            f"sha256 {sha_rate / 1e6:.0f} MB/s",
            f"{rate / sha_rate:.2f}x",
            verdict(rate / sha_rate >= THROUGHPUT_TARGET, f">= {THROUGHPUT_TARGET:g}x"),
        ),
        (
            "",
            "payload memory held",
            mb(held),
            f"in flight {mb(flight)}",
            f"{held / flight:.2f}x",
            verdict(held / flight <= MEMORY_TARGET, f"<= {MEMORY_TARGET:g}x"),
        ),
        (
            "",
            "tracemalloc peak",
            mb(peak),
            f"in flight {mb(flight)}",
            f"{(peak - kept) / flight:.2f}x",
            f"info: {mb(kept)} kept at end, not in ratio",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--size", type=int, default=32 * 1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.001, help="one-way, virtual seconds")
    ap.add_argument("--bandwidth", type=float, default=1e9, help="virtual bytes/s; 0: unlimited")
    ap.add_argument("--link", choices=("copy", "zero-copy", "both"), default="both")
    ap.add_argument("--profile", choices=sorted(CASES), help="cProfile one run of a case")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    if not args.bandwidth:
        args.bandwidth = None
    payloads = Payloads(args.groups, args.objects, args.size)
    if args.profile:
        profile(args, payloads)
        return
    links = {"copy": [False], "zero-copy": [True], "both": [False, True]}[args.link]
    bw = "unlimited" if args.bandwidth is None else f"{args.bandwidth / 1e9:g} GB/s"
    print(
        f"{args.groups} groups x {args.objects} objects x {args.size} B = {mb(payloads.total)}"
        f" of payload; link latency {args.latency * 1e3:g} ms, bandwidth {bw}"
        f" (virtual), whole writes; best of {args.repeat}"
    )
    head = ("case", "figure", "value", "reference", "ratio", "target")
    rows: list[tuple[str, ...]] = [head]
    for case in CASES:
        for zero_copy in links:
            rows += measure(args, case, zero_copy, payloads)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
