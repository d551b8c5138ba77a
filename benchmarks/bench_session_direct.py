"""MOQT session cost alone: publisher session -> subscriber session, no network simulator.

Run from the repository root::

    python3 benchmarks/bench_session_direct.py [--groups G] [--objects N] [--size BYTES]

``bench_session_loopback.py`` measures the whole data path through the
loopback simulator (virtual clock, pacing, per-link bookkeeping), whose own
cost is a large share of what it reports. This benchmark asks the narrower
question of the session issue: what does *MOQT itself* cost per byte? Two
``MoqtSession`` machines are joined by the smallest possible pump: every
transport command of one is handed to the other at once (stream refs mapped,
write chunks passed through as they are, header and payload as separate
``StreamData`` events, no copy), and object data is pulled with
``poll_data(1 MiB)``. Timed: FETCH of G groups x N objects of BYTES, from the
FETCH call to the last ``ObjectReceived``, best of 3, beside ``hashlib.sha256``
over the same payload bytes measured in the same run. Target: >= 2x SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.moqt.transport_io import (
    OpenStream,
    StreamData,
    StreamOpened,
    StreamRef,
    WriteStream,
)
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.names import FullTrackName, TrackNamespace


class DirectPump:
    """Hands each session's commands to the other immediately (no clock, no copies)."""

    def __init__(self, a: MoqtSession, b: MoqtSession, *, join: bool) -> None:
        self.join = join
        self.peer = {id(a): b, id(b): a}
        self.maps: dict[int, dict[StreamRef, StreamRef]] = {id(a): {}, id(b): {}}
        self.counters = {id(a): 0, id(b): 0}
        self.on_event: Any = None

    def _remote(self, src: MoqtSession, ref: StreamRef) -> StreamRef:
        return self.maps[id(src)][ref]

    def apply(self, src: MoqtSession, cmd: Any) -> None:
        dst = self.peer[id(src)]
        if isinstance(cmd, OpenStream) or (isinstance(cmd, WriteStream) and cmd.opens):
            n = self.counters[id(dst)]
            self.counters[id(dst)] = n + 1
            theirs = StreamRef(False, n)
            self.maps[id(src)][cmd.stream] = theirs
            self.maps[id(dst)][theirs] = cmd.stream
            uni = cmd.uni if isinstance(cmd, OpenStream) else True
            dst.handle_transport_event(StreamOpened(stream=theirs, uni=uni), 0.0)
        if isinstance(cmd, WriteStream):
            ref = self.maps[id(src)][cmd.stream]
            if self.join:
                # like a QUIC stack: the write is copied into one send buffer
                data = b"".join(cmd.chunks)
                dst.handle_transport_event(StreamData(stream=ref, data=data, fin=cmd.fin), 0.0)
            else:
                last = len(cmd.chunks) - 1
                if last < 0:
                    dst.handle_transport_event(StreamData(stream=ref, data=b"", fin=cmd.fin), 0.0)
                for i, chunk in enumerate(cmd.chunks):
                    dst.handle_transport_event(
                        StreamData(stream=ref, data=chunk, fin=cmd.fin and i == last), 0.0
                    )
        self.drain(dst)

    def drain(self, s: MoqtSession) -> None:
        while (cmd := s.next_command()) is not None:
            self.apply(s, cmd)
        while (e := s.next_event()) is not None:
            self.on_event(s, e)

    def pump_data(self, s: MoqtSession) -> bool:
        moved = False
        while (item := s.poll_data(1 << 20)) is not None:
            moved = True
            self.apply(s, item)
            self.drain(s)
        return moved


def run(groups: int, objects: int, size: int, join: bool = False) -> tuple[float, int]:
    seed = os.urandom(size)
    ns = TrackNamespace.of("kvcs-1", b"b" * 16)
    store = TrackStore(FullTrackName(ns, b"k.raw.s0"))
    payloads = [bytes([g % 256, o % 256]) + seed[2:] for g in range(groups) for o in range(1)]
    for g in range(groups):
        for o in range(objects):
            store.append(g, o, payloads[g])
        store.append(g, objects, status=ObjectStatus.END_OF_GROUP)
    cli = MoqtSession(SessionConfig(role=Role.CLIENT))
    srv = MoqtSession(SessionConfig(role=Role.SERVER))
    pump = DirectPump(cli, srv, join=join)
    got = [0, 0]

    def on_event(s: MoqtSession, e: Any) -> None:
        if isinstance(e, ev.FetchRequested):
            srv.accept_fetch(e.request_id, store, now=0.0)
        elif type(e) is ev.ObjectReceived:
            got[0] += 1
            got[1] += e.payload.nbytes

    pump.on_event = on_event
    cli.start(now=0.0)
    srv.start(now=0.0)
    pump.drain(cli)
    pump.drain(srv)
    assert cli.setup_complete and srv.setup_complete
    t0 = time.perf_counter()
    cli.fetch(
        store.name, now=0.0, location_filter=p.LocationFilter.absolute_group_end(0, 0, groups - 1)
    )
    pump.drain(cli)
    pump.drain(srv)
    while pump.pump_data(srv):
        pass
    elapsed = time.perf_counter() - t0
    if got[0] != groups * objects or got[1] != groups * objects * size:
        raise SystemExit(f"delivered {got} of {groups * objects} objects")
    return elapsed, got[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--size", type=int, default=32 * 1024)
    args = ap.parse_args()
    total = args.groups * args.objects * args.size
    data = os.urandom(total)
    print(
        f"{args.groups} groups x {args.objects} objects x {args.size} B = {total / 1e6:.2f} MB,"
        " FETCH through two sessions, direct pump (no simulator); best of 3"
    )
    print(f"{'figure':34}{'value':>14}{'reference':>22}{'ratio':>8}  target")
    for join, label in ((False, "chunks passed through"), (True, "each write joined (1 copy)")):
        best = min(run(args.groups, args.objects, args.size, join)[0] for _ in range(3))
        sha = min(_time_sha(data) for _ in range(5))
        mbps, sha_mbps = total / best / 1e6, total / sha / 1e6
        ratio = mbps / sha_mbps
        verdict = "met" if ratio >= 2 else "MISSED"
        print(
            f"{label:34}{mbps:>9.0f} MB/s{'sha256 ':>13}{sha_mbps:.0f} MB/s"
            f"{ratio:>7.2f}x  {verdict} (>= 2x)"
        )
        print(f"{'  per object':34}{best / (args.groups * args.objects) * 1e6:>10.2f} us")


def _time_sha(data: bytes) -> float:
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
