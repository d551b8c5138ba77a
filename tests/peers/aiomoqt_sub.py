"""aiomoqt subscriber peer: SUBSCRIBE / FETCH / SUBSCRIBE_NAMESPACE, JSON lines out.

    .peers/bin/python tests/peers/aiomoqt_sub.py --url moqt://127.0.0.1:4443 \\
        --ns kvcs --ns demo --track t --groups 3 --objects 5 --size 100 --timeout 20

Runs inside ``unshare -n`` (README.md). Draft 22 over raw QUIC (ALPN
``moqt-22``), certificate verification off. Namespace fields are repeated
``--ns`` args; ``hex:0a0b`` is a binary field (same for ``--track``).

Modes:

* default, SUBSCRIBE: ``--filter none|next|largest|abs:G:O|range:G:O:EG[:EO]|rel:N``
  (d22 LOCATION_FILTER; ``none`` omits it = every object; ``largest`` is the
  library default LATEST_OBJECT, sent as NEXT_OBJECT). Prints each object and
  PUBLISH_DONE; ends when PUBLISH_DONE came and the expected objects arrived
  (or ``--drain`` seconds after PUBLISH_DONE).
* ``--fetch SG:SO:EG[:EO]``: standalone FETCH, End inclusive (d22), EO omitted
  = the whole end group. Prints FETCH_OK, each object, fetch_done.
* ``--subscribe-namespace``: SUBSCRIBE_NAMESPACE with the --ns fields as the
  prefix; prints REQUEST_OK, each NAMESPACE / NAMESPACE_DONE (suffixes); ends
  after ``--count`` messages (default 1) or ``--duration`` seconds.

With ``--groups N`` (default 3) ``--objects M --size S --seed X`` the
objects are checked against peer_common.payload; ``--no-verify`` skips it.
``--expect-error`` turns a REQUEST_ERROR into the success outcome.
Exit: 0 ok, 1 failed check / refused / protocol error, 3 timeout.

JSON lines: setup, subscribe_ok, object, publish_done, fetch_ok, fetch_object,
fetch_done, subscribe_namespace_ok, namespace, namespace_done, request_error,
summary, error, exit. ``object``: group, subgroup, object, len, sha256, status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from typing import Any

import peer_common as pc
from aiomoqt.client import MOQTClient
from aiomoqt.messages.params import LocationFilter
from aiomoqt.types import D16MessageType, FilterType, MOQTRequestError
from aiomoqt.utils.logger import set_log_level
from aiomoqt.utils.url import parse_relay_url

# d22 SUBSCRIBE parameter: how long a relay may hold a SUBSCRIBE for a
# publisher that has not appeared yet (ms).
RENDEZVOUS_TIMEOUT = 0x04


def parse_filter(text: str) -> tuple[Any, LocationFilter | None]:
    """(filter_type for subscribe(), location_filter) of --filter."""
    parts = text.split(":")
    kind, nums = parts[0], [int(x) for x in parts[1:]]
    if kind == "none":
        return None, None
    if kind == "largest":
        return FilterType.LATEST_OBJECT, None
    if kind == "next":
        return None, LocationFilter.next_object()
    if kind == "rel":
        return None, LocationFilter.relative(nums[0])
    if kind == "abs":
        return None, LocationFilter.absolute(nums[0], nums[1])
    if kind == "range":
        return None, LocationFilter.absolute(*nums)
    raise ValueError(f"unknown --filter {text!r}")


def parse_fetch(text: str) -> tuple[LocationFilter, tuple[int, int], tuple[int, int] | None]:
    nums = [int(x) for x in text.split(":")]
    if len(nums) == 3:
        return LocationFilter.absolute(nums[0], nums[1], nums[2]), (nums[0], nums[1]), (
            nums[2], 1 << 62)
    if len(nums) == 4:
        return LocationFilter.absolute(*nums), (nums[0], nums[1]), (nums[2], nums[3])
    raise ValueError("--fetch wants SG:SO:EG or SG:SO:EG:EO")


def ext_json(ext: Any) -> dict[str, Any]:
    """Object Properties (extension headers) as {"0x06": int or "hex:.."}."""
    out: dict[str, Any] = {}
    for k, v in dict(ext).items():
        if isinstance(v, (bytes, bytearray, memoryview)):
            out[f"0x{int(k):x}"] = "hex:" + bytes(v).hex()
        else:
            out[f"0x{int(k):x}"] = v if isinstance(v, int) else repr(v)
    return out


# The running Subscriber, for a summary when --timeout cuts the run short.
CURRENT: list[Subscriber] = []


class Subscriber:
    def __init__(self, args: argparse.Namespace, start: tuple[int, int] = (0, 0),
                 end: tuple[int, int] | None = None):
        CURRENT.append(self)
        self.args = args
        self.expect = pc.Expect(None if args.no_verify else args.groups, args.objects,
                                args.size, args.seed, start=start, end=end)
        self.done: Any = None
        self.changed = asyncio.Event()
        self.count = 0

    def record(self, event: str, group: int, subgroup: Any, obj: int, data: bytes,
               status: Any, ext: Any = None) -> None:
        self.count += 1
        if status in (None, 0):
            self.expect.add(group, obj, data)
        extra = {"ext": ext_json(ext)} if ext else {}
        pc.emit(event, group=group, subgroup=subgroup, object=obj, len=len(data),
                sha256=pc.sha256_hex(data), status=None if status is None else int(status),
                **extra)
        self.changed.set()

    def on_object(self, msg: Any, _size: int, _recv_us: int, group_id: Any = None,
                  subgroup_id: Any = None, *_: Any) -> None:
        gid = getattr(msg, "group_id", None)
        self.record("object", group_id if gid is None else gid, subgroup_id, msg.object_id,
                    bytes(msg.payload or b""), getattr(msg, "status", None),
                    getattr(msg, "extensions", None))

    def on_fetch_object(self, msg: Any, _size: int, _recv_us: int, _rid: Any = None) -> None:
        self.record("fetch_object", msg.group_id, msg.subgroup_id, msg.object_id,
                    bytes(msg.payload or b""), getattr(msg, "status", None),
                    getattr(msg, "extensions", None))

    def on_done(self, msg: Any) -> None:
        self.done = msg
        pc.emit("publish_done", status=msg.status_code, stream_count=msg.stream_count,
                reason=str(msg.reason or ""))
        self.changed.set()

    async def wait_until(self, pred: Any) -> None:
        while not pred():
            self.changed.clear()
            await self.changed.wait()

    def summary(self, **extra: Any) -> int:
        problems = self.expect.problems()
        pc.emit("summary", objects=self.count, unique=len(self.expect.got),
                publish_done=self.done is not None, ok=not problems,
                problems=problems[:20], **extra)
        return pc.EXIT_FAIL if problems else pc.EXIT_OK


async def do_subscribe(args: argparse.Namespace, session: Any, ns: tuple[bytes, ...],
                       track: bytes) -> int:
    filter_type, lf = parse_filter(args.filter)
    sub = Subscriber(args)
    params = {}
    if args.rendezvous is not None:
        params[RENDEZVOUS_TIMEOUT] = args.rendezvous
    ok = await session.subscribe(namespace=ns, track_name=track, filter_type=filter_type,
                                 location_filter=lf, forward=args.forward, parameters=params,
                                 on_object=sub.on_object, on_done=sub.on_done,
                                 wait_response=True)
    largest = None
    if getattr(ok, "largest_group_id", None) is not None:
        largest = [ok.largest_group_id, ok.largest_object_id]
    pc.emit("subscribe_ok", track_alias=ok.track_alias, largest=largest,
            expires=getattr(ok, "expires", None))
    if args.expect_error:
        pc.emit("error", error="expected REQUEST_ERROR, got SUBSCRIBE_OK")
        return pc.EXIT_FAIL
    if sub.expect.groups is not None and lf is None and filter_type is None:
        pass  # every object is expected
    elif sub.expect.groups is not None and filter_type == FilterType.LATEST_OBJECT:
        # Only objects after Largest at SUBSCRIBE time are expected.
        sub.expect.start = (0, 0) if largest is None else (largest[0], largest[1] + 1)
    elif sub.expect.groups is not None and lf is not None:
        start, end = lf.resolve(None if largest is None else tuple(largest))
        sub.expect.start, sub.expect.end = start, end
    await sub.wait_until(lambda: sub.done is not None or (
        args.no_wait_done and sub.expect.complete()))
    if not sub.expect.complete() and sub.expect.groups is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.drain):
                await sub.wait_until(sub.expect.complete)
    if args.linger:
        await asyncio.sleep(args.linger)
    return sub.summary()


async def do_fetch(args: argparse.Namespace, session: Any, ns: tuple[bytes, ...],
                   track: bytes) -> int:
    lf, start, end = parse_fetch(args.fetch)
    sub = Subscriber(args, start=start, end=end)
    ok = await session.fetch(namespace=ns, track_name=track, location_filter=lf,
                             on_object=sub.on_fetch_object, wait_response=True)
    # aiomoqt reports End Location as last Object + 1 (d14-d18 form); the
    # d22 wire value, printed here, is inclusive: largest_object_id - 1.
    wire_end = (ok.largest_group_id, ok.largest_object_id - 1)
    pc.emit("fetch_ok", end_of_track=ok.end_of_track, end=list(wire_end))
    if args.expect_error:
        pc.emit("error", error="expected REQUEST_ERROR, got FETCH_OK")
        return pc.EXIT_FAIL
    # FETCH_OK's End Location caps what can come.
    sub.expect.end = min(end, wire_end)
    clean = await session.await_fetch_done(ok.request_id, timeout=args.timeout)
    pc.emit("fetch_done", clean=bool(clean))
    code = sub.summary()
    return code if clean else pc.EXIT_FAIL


async def do_subscribe_namespace(args: argparse.Namespace, session: Any,
                                 prefix: tuple[bytes, ...]) -> int:
    seen: list[tuple[str, list[str]]] = []
    changed = asyncio.Event()

    def record(kind: str) -> Any:
        async def handler(_session: Any, msg: Any) -> None:
            suffix = pc.ns_json(bytes(f) for f in msg.namespace_suffix)
            seen.append((kind, suffix))
            pc.emit(kind, suffix=suffix, ns=pc.ns_json(prefix) + suffix)
            changed.set()
        return handler

    session.register_handler(D16MessageType.NAMESPACE, record("namespace"))
    session.register_handler(D16MessageType.NAMESPACE_DONE, record("namespace_done"))
    await session.subscribe_namespace(prefix, wait_response=True)
    pc.emit("subscribe_namespace_ok", prefix=pc.ns_json(prefix))
    if args.expect_error:
        pc.emit("error", error="expected REQUEST_ERROR, got REQUEST_OK")
        return pc.EXIT_FAIL
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(args.duration):
            while len(seen) < args.count:
                changed.clear()
                await changed.wait()
    pc.emit("summary", messages=len(seen), ok=len(seen) >= args.count,
            seen=[{"kind": k, "suffix": s} for k, s in seen])
    return pc.EXIT_OK if len(seen) >= args.count else pc.EXIT_FAIL


async def run(args: argparse.Namespace) -> int:
    relay = parse_relay_url(args.url)
    if not relay.use_quic:
        pc.emit("error", error="only moqt:// (raw QUIC) URLs are supported here")
        return pc.EXIT_USAGE
    ns = tuple(pc.parse_field(f) for f in args.ns)
    track = pc.parse_field(args.track)
    client = MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=True,
                        verify_tls=False, supported_drafts=args.draft)
    async with client.connect() as session:
        await session.client_session_init()
        hi = session.handshake_info
        pc.emit("setup", draft=hi.get("draft"), alpn=hi.get("alpn"),
                peer_transport_parameters=pc.jsonable(hi.get("peer_transport_parameters")))
        try:
            if args.subscribe_namespace:
                return await do_subscribe_namespace(args, session, ns)
            if args.fetch:
                return await do_fetch(args, session, ns, track)
            return await do_subscribe(args, session, ns, track)
        except MOQTRequestError as e:
            pc.emit("request_error", code=e.error_code, reason=str(e.reason or ""))
            return pc.EXIT_OK if args.expect_error else pc.EXIT_FAIL
        finally:
            with contextlib.suppress(Exception):
                session.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    pc.add_common_args(p)
    pc.add_track_shape_args(p)
    p.add_argument("--no-verify", action="store_true", help="print objects, check nothing")
    p.add_argument("--filter", default="none", help="SUBSCRIBE filter (see above)")
    p.add_argument("--forward", type=int, default=None, help="FORWARD param (omitted by default)")
    p.add_argument("--rendezvous", type=int, default=None, metavar="MS",
                   help="RENDEZVOUS_TIMEOUT (0x04) parameter on SUBSCRIBE: a relay holds the "
                        "SUBSCRIBE up to MS ms for a publisher to appear")
    p.add_argument("--fetch", metavar="SG:SO:EG[:EO]", help="standalone FETCH instead")
    p.add_argument("--subscribe-namespace", action="store_true",
                   help="SUBSCRIBE_NAMESPACE with --ns as the prefix instead")
    p.add_argument("--count", type=int, default=1,
                   help="--subscribe-namespace: NAMESPACE(_DONE) messages to wait for")
    p.add_argument("--duration", type=float, default=5.0,
                   help="--subscribe-namespace: longest wait for them, seconds")
    p.add_argument("--drain", type=float, default=2.0,
                   help="seconds to wait for missing objects after PUBLISH_DONE")
    p.add_argument("--no-wait-done", action="store_true",
                   help="finish once every expected object came, PUBLISH_DONE or not")
    p.add_argument("--linger", type=float, default=0.0, help="stay connected this long at the end")
    p.add_argument("--expect-error", action="store_true",
                   help="success = the request is refused (REQUEST_ERROR)")
    p.add_argument("--draft", type=int, default=22)
    p.add_argument("--debug", action="store_true", help="aiomoqt INFO/DEBUG logs on stderr")
    args = p.parse_args()
    set_log_level(logging.DEBUG if args.debug else logging.WARNING)
    pc.require_loopback_netns()
    pc.install_watchdog(args.timeout + 5)

    async def bounded() -> int:
        async with asyncio.timeout(args.timeout):
            return await run(args)

    try:
        code = asyncio.run(bounded())
    except TimeoutError:
        if CURRENT:
            CURRENT[-1].summary(timed_out=True)
        pc.emit("error", error="timeout", seconds=args.timeout)
        code = pc.EXIT_TIMEOUT
    except Exception as e:
        pc.emit("error", error=f"{type(e).__name__}: {e}")
        code = pc.EXIT_FAIL
    pc.emit("exit", code=code)
    pc.hard_exit(code)


if __name__ == "__main__":
    sys.exit(main())
