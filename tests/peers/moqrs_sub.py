"""moq-rs (``import moq``) subscriber peer: subscribe to a track, JSON lines out.

    .peers/bin/python tests/peers/moqrs_sub.py --url moqt://127.0.0.1:4443 \\
        --ns kvcs --ns demo --track t --groups 3 --objects 5 --size 100 --timeout 20

moq-rs names a broadcast by a path string: the --ns fields are joined with
"/" (``kvcs/demo`` is the namespace tuple (kvcs, demo) on the IETF wire), so
fields must be UTF-8 without "/" (no ``hex:`` binary fields here). The moq-rs
client offers every ALPN (moq-lite-0x, moqt-15..22, moq-00): against an
aiomoqt relay or our server it gets moqt-22; against a moq-rs server it gets
moq-lite (not IETF!). Certificate verification is off; it binds 127.0.0.1:0.

Modes:

* default: wait until the broadcast is announced (moq-rs sends
  SUBSCRIBE_NAMESPACE with an empty prefix right after SETUP and learns it
  from NAMESPACE / PUBLISH_NAMESPACE), SUBSCRIBE the track (moq-rs sends
  LOCATION_FILTER NEXT_OBJECT + FILL_PARAMETERS{LOCATION_FILTER RELATIVE_START 1},
  GROUP_ORDER descending, SUBSCRIBER_PRIORITY 255, FORWARD 1 at d22) and print
  every frame (= object) until the track ends (PUBLISH_DONE); moq-rs does not
  expose PUBLISH_DONE's status or Stream Count, only the end (``track_ended``).
  ``--start G`` asks moq-rs for groups from G (moq.Subscription(group_start=G)).
* ``--fetch-group G``: BroadcastConsumer.fetch_group(track, G), one group.
* ``--announced``: iterate ``announced(prefix)`` (prefix = the --ns path) and
  print each announce / unannounce; ends after --count updates.

Object numbering: moq-rs has no object ids; a frame's index in its group is
reported as ``object``. Checked against peer_common.payload with --groups N
(default 3) unless --no-verify. Exit 0 ok, 1 failed / error, 3 timeout.
JSON lines: connected, announced, subscribed, object, track_ended, group_done,
summary, error, exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import moq
import peer_common as pc


def path_of(args: argparse.Namespace) -> str:
    for f in args.ns:
        if f.startswith("hex:") or "/" in f:
            raise SystemExit("moq-rs paths are strings: no hex: or '/' in --ns fields")
    return "/".join(args.ns)


def make_client(args: argparse.Namespace) -> moq.Client:
    return moq.Client(args.url, tls_verify=False, bind="127.0.0.1:0", reconnect=False)


async def read_group(grp: Any, expect: pc.Expect, group: int | None = None) -> int:
    seq = grp.sequence if group is None else group
    n = 0
    while True:
        fr = await grp.read_frame()
        if fr is None:
            return n
        data = bytes(fr.payload)
        expect.add(seq, n, data)
        pc.emit("object", group=seq, object=n, len=len(data), sha256=pc.sha256_hex(data),
                timestamp_us=fr.timestamp_us)
        n += 1


async def do_subscribe(args: argparse.Namespace, expect: pc.Expect) -> int:
    async with make_client(args) as client:
        pc.emit("connected", url=args.url)
        path = path_of(args)
        bc = await client.announced_broadcast(path)
        pc.emit("announced", path=path)
        # max_age_us: how stale a group may be before moq-rs skips it; its
        # default 0 drops every group but the newest when they come in a burst.
        sub = moq.Subscription(max_age_us=int(args.max_age * 1e6), group_start=args.start)
        track = await bc.subscribe_track(args.track, sub)
        pc.emit("subscribed", path=path, track=args.track)
        groups = 0
        while True:
            grp = await track.recv_group()
            if grp is None:
                break
            n = await read_group(grp, expect)
            groups += 1
            pc.emit("group_done", group=grp.sequence, objects=n)
        pc.emit("track_ended", groups=groups)
        return summary(expect, track_ended=True)


async def do_fetch_group(args: argparse.Namespace, expect: pc.Expect) -> int:
    async with make_client(args) as client:
        pc.emit("connected", url=args.url)
        path = path_of(args)
        bc = await client.announced_broadcast(path)
        pc.emit("announced", path=path)
        grp = await bc.fetch_group(args.track, args.fetch_group)
        n = await read_group(grp, expect, args.fetch_group)
        pc.emit("group_done", group=args.fetch_group, objects=n)
        expect.start = (args.fetch_group, 0)
        expect.end = (args.fetch_group, args.objects - 1)
        return summary(expect)


async def do_announced(args: argparse.Namespace) -> int:
    async with make_client(args) as client:
        pc.emit("connected", url=args.url)
        seen = 0
        async for upd in client.announced("/".join(args.ns)):
            pc.emit("announce" if upd.active else "unannounce", prefix=upd.prefix)
            seen += 1
            if seen >= args.count:
                break
        pc.emit("summary", updates=seen, ok=seen >= args.count)
        return pc.EXIT_OK if seen >= args.count else pc.EXIT_FAIL


def summary(expect: pc.Expect, **extra: Any) -> int:
    problems = expect.problems()
    pc.emit("summary", unique=len(expect.got), ok=not problems, problems=problems[:20], **extra)
    return pc.EXIT_FAIL if problems else pc.EXIT_OK


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    pc.add_common_args(p)
    pc.add_track_shape_args(p)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--start", type=int, default=None,
                   help="moq.Subscription(group_start=START) (default: moq-rs default)")
    p.add_argument("--max-age", type=float, default=60.0,
                   help="Subscription.max_age_us in seconds (default 60; 0 = moq-rs default, "
                        "which skips to the newest group)")
    p.add_argument("--fetch-group", type=int, default=None, help="fetch_group(track, G) instead")
    p.add_argument("--announced", action="store_true", help="print announcements instead")
    p.add_argument("--count", type=int, default=1, help="--announced: updates to wait for")
    p.add_argument("--log", default=os.environ.get("MOQ_LOG"),
                   help="moq Rust log level on stderr (error|warn|info|debug|trace)")
    args = p.parse_args()
    if not args.ns:
        p.error("--ns is required")
    if args.log:
        moq.log_level(args.log)
    pc.install_watchdog(args.timeout + 5)
    expect = pc.Expect(None if args.no_verify else args.groups, args.objects, args.size,
                       args.seed)

    async def bounded() -> int:
        async with asyncio.timeout(args.timeout):
            if args.announced:
                return await do_announced(args)
            if args.fetch_group is not None:
                return await do_fetch_group(args, expect)
            return await do_subscribe(args, expect)

    try:
        code = asyncio.run(bounded())
    except TimeoutError:
        pc.emit("error", error="timeout", seconds=args.timeout, objects=len(expect.got))
        code = pc.EXIT_TIMEOUT
    except Exception as e:
        pc.emit("error", error=f"{type(e).__name__}: {e}")
        code = pc.EXIT_FAIL
    pc.emit("exit", code=code)
    pc.hard_exit(code)


if __name__ == "__main__":
    sys.exit(main())
