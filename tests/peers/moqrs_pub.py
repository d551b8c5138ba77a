"""moq-rs (``import moq``) publisher peer: announce a broadcast, serve one track.

    .peers/bin/python tests/peers/moqrs_pub.py --url moqt://127.0.0.1:4443 \\
        --ns kvcs --ns demo --track t --groups 3 --objects 5 --size 100 --timeout 20

The broadcast path is the --ns fields joined with "/" (namespace tuple on the
IETF wire; UTF-8 fields without "/" only). moq-rs, as an IETF client, sends
PUBLISH_NAMESPACE for the path once ``announce()`` runs and answers the
relay's SUBSCRIBE itself; it never sends PUBLISH (and refuses one).

Waits (``TrackProducer.used()``) for a subscriber, then writes N groups of M
frames (group sequence 0..N-1 via ``append_group``; each frame is one object,
payload ``peer_common.payload(g, o, size, seed)``, timestamp_us = o), finishes
each group, then the track (``finish()``: moq-rs then sends an END_OF_TRACK
status object in group N and PUBLISH_DONE). ``--no-wait`` writes at once.
Stays connected ``--linger`` seconds (default 1) so late readers can drain.
Exit 0 ok, 1 error, 3 timeout (no subscriber). JSON lines: connected,
announced, used, group_sent, track_finished, error, exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import moq
import peer_common as pc


def write_track(track: moq.TrackProducer, args: argparse.Namespace) -> None:
    for g in range(args.groups):
        grp = track.append_group()
        for o in range(args.objects):
            grp.write_frame(pc.payload(g, o, args.size, args.seed), o)
        grp.finish()
        pc.emit("group_sent", group=g, sequence=grp.sequence, objects=args.objects)
    if not args.no_finish:
        track.finish()
        pc.emit("track_finished")


async def run(args: argparse.Namespace) -> int:
    path = "/".join(args.ns)
    async with moq.Client(args.url, tls_verify=False, bind="127.0.0.1:0",
                          reconnect=False) as client:
        pc.emit("connected", url=args.url)
        bc = client.create_broadcast(path)
        track = bc.publish_track(args.track)
        bc.announce()
        pc.emit("announced", path=path, track=args.track)
        if not args.no_wait:
            await track.used()
            pc.emit("used")
            await asyncio.sleep(args.start_delay)
        write_track(track, args)
        await asyncio.sleep(args.linger)
        bc.close()
    return pc.EXIT_OK


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    pc.add_common_args(p)
    pc.add_track_shape_args(p)
    p.add_argument("--no-wait", action="store_true", help="write without waiting for a subscriber")
    p.add_argument("--no-finish", action="store_true",
                   help="leave the track open (no PUBLISH_DONE)")
    p.add_argument("--linger", type=float, default=1.0)
    p.add_argument("--start-delay", type=float, default=0.05,
                   help="seconds between the first subscriber and the first object")
    p.add_argument("--log", default=os.environ.get("MOQ_LOG"),
                   help="moq Rust log level on stderr (error|warn|info|debug|trace)")
    args = p.parse_args()
    if not args.ns:
        p.error("--ns is required")
    if any(f.startswith("hex:") or "/" in f for f in args.ns):
        p.error("moq-rs paths are strings: no hex: or '/' in --ns fields")
    if args.log:
        moq.log_level(args.log)
    pc.install_watchdog(args.timeout + 5)

    async def bounded() -> int:
        async with asyncio.timeout(args.timeout):
            return await run(args)

    try:
        code = asyncio.run(bounded())
    except TimeoutError:
        pc.emit("error", error="timeout", seconds=args.timeout)
        code = pc.EXIT_TIMEOUT
    except Exception as e:
        pc.emit("error", error=f"{type(e).__name__}: {e}")
        code = pc.EXIT_FAIL
    pc.emit("exit", code=code)
    pc.hard_exit(code)


if __name__ == "__main__":
    sys.exit(main())
