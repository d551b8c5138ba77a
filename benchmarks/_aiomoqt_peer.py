"""aiomoqt's publisher and subscriber for ``bench_relay_pipeline.py`` (the reference column).

Run by the peers' interpreter (``.peers/bin/python``, Python >= 3.12, aiomoqt
0.13.3), inside a loopback-only network namespace (aiopquic binds every
interface), by ``bench_relay_pipeline.py --worker aiomoqt``; never by hand
outside ``unshare -n``.

* ``pub``: PUBLISH_NAMESPACE ``kvcs-bench``; on the SUBSCRIBE for track ``t``
  (SUBSCRIBE_OK) it sends G groups of M objects of S bytes, one subgroup stream
  per group, objects cut from one seeded random buffer made beforehand (no
  per-object work beyond aiomoqt's own), then PUBLISH_DONE (TRACK_ENDED); it
  keeps its session until the parent writes "stop" on its stdin.
* ``sub``: SUBSCRIBE ``kvcs-bench``/``t`` (no filter: the whole track); each
  object's payload is copied to its place in a buffer touched beforehand; its
  clock runs from the SUBSCRIBE to the last object.

Both print JSON lines (``peer_common.emit``) and the SHA-256 of the bytes they
sent / received, so the parent checks bit identity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "peers"))

import peer_common as pc  # stdlib only: emit, namespace guard, watchdog
from aiomoqt.client import MOQTClient
from aiomoqt.context import profile_for
from aiomoqt.messages import SubgroupHeader
from aiomoqt.types import MOQTMessageType, SubscribeDoneCode
from aiomoqt.utils.logger import set_log_level

NS = (b"kvcs-bench",)
TRACK = b"t"
PRIORITY = 128


def content(args: argparse.Namespace) -> bytes:
    """The seeded bytes to send, made in 1 MiB pieces (``randbytes`` of 256 MiB at once
    overflows: it draws all the bits as one C int)."""
    rng, total, piece = random.Random(args.seed), args.groups * args.objects * args.size, 1 << 20
    out = bytearray()
    while len(out) < total:
        out += rng.randbytes(min(piece, total - len(out)))
    return bytes(out)


async def publisher(args: argparse.Namespace) -> int:
    data = memoryview(content(args))
    digest = hashlib.sha256(data).hexdigest()
    done = asyncio.Event()
    tasks: set[asyncio.Task[Any]] = set()

    async def send(session: Any, msg: Any) -> None:
        ok = session.subscribe_ok(request_msg=msg)
        prof = profile_for(session.negotiated_draft)
        t0 = time.monotonic()
        size, objects = args.size, args.objects
        for g in range(args.groups):
            sid = await session.open_uni_stream()
            header = SubgroupHeader(
                track_alias=ok.track_alias,
                group_id=g,
                subgroup_id=0,
                publisher_priority=PRIORITY,
                prof=prof,
            )
            session.stream_write(sid, header.serialize().data)
            for o in range(objects):
                start = (g * objects + o) * size
                obj = header.next_object(payload=bytes(data[start : start + size]), object_id=o)
                await session.stream_write_drain(sid, obj.data)
            session.stream_write(sid, b"", end_stream=True)
        session.subscribe_done(
            request_id=msg.request_id,
            status_code=SubscribeDoneCode.TRACK_ENDED,
            stream_count=args.groups,
            reason="track ended",
        )
        pc.emit("sent", seconds=time.monotonic() - t0, digest=digest)
        done.set()

    async def on_subscribe(session: Any, msg: Any) -> None:
        if tuple(bytes(f) for f in msg.track_namespace) != NS or bytes(msg.track_name) != TRACK:
            session.subscribe_error(request_id=msg.request_id, error_code=0x10, reason="no")
            return
        task = asyncio.ensure_future(send(session, msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    client = MOQTClient(
        "127.0.0.1", args.port, use_quic=True, verify_tls=False, supported_drafts=22
    )
    client.register_handler(MOQTMessageType.SUBSCRIBE, on_subscribe)
    async with client.connect() as session:
        await session.client_session_init()
        await session.publish_namespace(namespace=NS, wait_response=True)
        pc.emit("announced", digest=digest)
        await done.wait()
        await stopped()  # the relay may still be forwarding: keep the session until told
        with contextlib.suppress(Exception):
            session.close()
    return pc.EXIT_OK


async def stopped() -> None:
    """Until the parent writes "stop" on stdin (or closes it)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)
    seen = bytearray()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        seen.extend(chunk)
        if (not chunk or b"stop" in seen) and not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def subscriber(args: argparse.Namespace) -> int:
    total = args.groups * args.objects * args.size
    buf = bytearray(total)  # zero-filled: the pages are touched now
    view = memoryview(buf)
    want = args.groups * args.objects
    seen: set[tuple[int, int]] = set()
    finished = asyncio.Event()
    t1 = [0.0]
    size, objects = args.size, args.objects

    def on_object(msg: Any, _size: int, _recv_us: int, group_id: Any = None, *_: Any) -> None:
        gid = getattr(msg, "group_id", None)
        g = group_id if gid is None else gid
        o = msg.object_id
        payload = msg.payload or b""
        if g is None or not (0 <= g < args.groups and 0 <= o < objects) or len(payload) != size:
            return
        start = (g * objects + o) * size
        view[start : start + size] = payload
        seen.add((g, o))
        if len(seen) == want and not finished.is_set():
            t1[0] = time.monotonic()
            finished.set()

    client = MOQTClient(
        "127.0.0.1", args.port, use_quic=True, verify_tls=False, supported_drafts=22
    )
    async with client.connect() as session:
        await session.client_session_init()
        t0 = time.monotonic()
        await session.subscribe(
            namespace=NS, track_name=TRACK, on_object=on_object, wait_response=True
        )
        await finished.wait()
        digest = hashlib.sha256(view).hexdigest()
        pc.emit("done", t0=t0, t1=t1[0], objects=len(seen), bytes=total, digest=digest)
        with contextlib.suppress(Exception):
            session.close()
    return pc.EXIT_OK


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", choices=("pub", "sub"))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--objects", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    set_log_level(logging.WARNING)
    pc.require_loopback_netns()
    pc.install_watchdog(args.timeout + 5)
    job = publisher if args.role == "pub" else subscriber

    async def bounded() -> int:
        async with asyncio.timeout(args.timeout):
            return await job(args)

    try:
        code = asyncio.run(bounded())
    except TimeoutError:
        pc.emit("error", error="timeout", seconds=args.timeout)
        code = pc.EXIT_TIMEOUT
    except Exception as e:  # a one-line report for the parent, never a traceback
        pc.emit("error", error=f"{type(e).__name__}: {e}")
        code = pc.EXIT_FAIL
    pc.hard_exit(code)


if __name__ == "__main__":
    main()
