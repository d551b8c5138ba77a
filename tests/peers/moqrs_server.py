"""moq-rs (``import moq``) server peer: a small relay that also publishes one track.

    .peers/bin/python tests/peers/moqrs_server.py --port 4450 \\
        --ns kvcs --ns demo --track t --groups 3 --objects 5 --size 100 --timeout 60

moq-rs binds exactly the address it is given: always 127.0.0.1 here (it does
not need ``unshare -n``, but running it inside the test's namespace is fine).
TLS: ``--cert/--key`` PEM files, else a self-signed certificate moq-rs
generates for localhost (``tls_generate``); clients must not verify.

The server routes between its clients (what one client announces, another
can subscribe to: a small relay). With --ns it also creates and announces the
broadcast ``--ns`` joined with "/" with track --track, and on its first
subscriber writes N groups x M frames (payload ``peer_common.payload``) and
finishes the track (END_OF_TRACK object in group N, PUBLISH_DONE).
``--no-track``: routing only. ``--wait-subscriber 0``: write at once, before
anyone subscribes (moq-rs then serves late subscribers from its cache: a
moq-rs subscriber sees only the latest group; see README.md).

The server speaks whatever the client's ALPN picks: an aiomoqt or kvcs client
offering only moqt-22 gets draft-22 (after SETUP the server sends that client
SUBSCRIBE_NAMESPACE with an empty prefix and PUBLISH_NAMESPACE for each
announced broadcast); a moq-rs client gets moq-lite.

Prints {"event": "ready", "port": P, "addr": ..., "fingerprints": [...]} once
listening; "session" for each accepted client; "used", "group_sent",
"track_finished"; exits 0 after --timeout seconds or on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

import moq
import peer_common as pc


async def serve(server: Any) -> None:
    tasks: set[asyncio.Task[Any]] = set()

    async def one(request: Any) -> None:
        try:
            session = await request.accept()
        except Exception as e:
            pc.emit("session_error", error=f"{type(e).__name__}: {e}")
            return
        pc.emit("session", path=request.path, transport=str(request.transport))
        try:
            await session.closed()
            pc.emit("session_closed")
        except Exception as e:
            pc.emit("session_closed", error=f"{type(e).__name__}: {e}")

    async for request in server:
        t = asyncio.create_task(one(request))
        tasks.add(t)
        t.add_done_callback(tasks.discard)


async def produce(track: Any, args: argparse.Namespace) -> None:
    if args.wait_subscriber:
        await track.used()
        pc.emit("used")
        await asyncio.sleep(args.start_delay)
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
    tls: dict[str, Any] = {}
    if args.cert and args.key:
        tls = {"tls_cert": [args.cert], "tls_key": [args.key]}
    else:
        tls = {"tls_generate": ["localhost"]}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with moq.Server(f"127.0.0.1:{args.port}", **tls) as server:
        tasks = [asyncio.create_task(serve(server))]
        producer = None
        if args.ns and not args.no_track:
            path = "/".join(args.ns)
            bc = server.create_broadcast(path)
            track = bc.publish_track(args.track)
            bc.announce()
            producer = asyncio.create_task(produce(track, args))
            tasks.append(producer)
        pc.emit("ready", port=args.port, addr=server.local_addr,
                url=f"moqt://127.0.0.1:{args.port}", fingerprints=server.cert_fingerprints())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.timeout):
                await stop.wait()
        failed = producer is not None and producer.done() and producer.exception() is not None
        for t in tasks:
            t.cancel()
        if failed:
            pc.emit("error", error=f"producer failed: {producer.exception()!r}")  # type: ignore[union-attr]
            return pc.EXIT_FAIL
    return pc.EXIT_OK


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=4450)
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--ns", action="append", default=[], metavar="FIELD",
                   help="namespace field of the served broadcast (repeat); none = routing only")
    p.add_argument("--track", default="track")
    pc.add_track_shape_args(p)
    p.add_argument("--no-track", action="store_true")
    p.add_argument("--no-finish", action="store_true")
    p.add_argument("--wait-subscriber", type=int, default=1,
                   help="1 (default): write when the first subscriber arrives; 0: at once")
    p.add_argument("--start-delay", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="serve this many seconds, then exit 0 (default 60)")
    p.add_argument("--log", default=os.environ.get("MOQ_LOG"),
                   help="moq Rust log level on stderr (error|warn|info|debug|trace)")
    args = p.parse_args()
    if any(f.startswith("hex:") or "/" in f for f in args.ns):
        p.error("moq-rs paths are strings: no hex: or '/' in --ns fields")
    if args.log:
        moq.log_level(args.log)
    pc.install_watchdog(args.timeout + 10)
    try:
        code = asyncio.run(run(args))
    except Exception as e:
        pc.emit("error", error=f"{type(e).__name__}: {e}")
        code = pc.EXIT_FAIL
    pc.emit("exit", code=code)
    pc.hard_exit(code)


if __name__ == "__main__":
    sys.exit(main())
