"""aiomoqt publisher peer: PUBLISH_NAMESPACE + serve one track, then PUBLISH_DONE.

    .peers/bin/python tests/peers/aiomoqt_pub.py --url moqt://127.0.0.1:4443 \\
        --ns kvcs --ns demo --track t --groups 3 --objects 5 --size 100 --timeout 20

Runs inside ``unshare -n`` like every aiomoqt process (see README.md). Draft 22
over raw QUIC (ALPN ``moqt-22``), certificate verification off.

Modes (``--mode``):

* ``announce`` (default): PUBLISH_NAMESPACE the namespace, then answer every
  SUBSCRIBE for ``ns/track``: SUBSCRIBE_OK, the objects its filter admits (one
  subgroup stream per group, subgroup 0, objects 0..M-1), then PUBLISH_DONE
  (status TRACK_ENDED, Stream Count = streams opened). FETCH is answered
  from the same deterministic content (FETCH_OK + one FETCH stream) once the
  objects exist (``--history``: from the start). SUBSCRIBE for another track
  gets REQUEST_ERROR DOES_NOT_EXIST.
* ``publish``: PUBLISH the track (Forward 1) with no PUBLISH_NAMESPACE (or
  after it with ``--announce``), wait for REQUEST_OK, send every object on
  the PUBLISH's alias, then PUBLISH_DONE on the PUBLISH request stream.
  A relay that parks the PUBLISH (REQUEST_UPDATE FORWARD=0, as aiomoqt's
  does until someone subscribes) is answered REQUEST_OK and waited for.

Payload of object (g, o) is ``peer_common.payload(g, o, size, seed)``.
Exits after the first subscription (or PUBLISH) completes and ``--linger``
seconds pass (``--serve K``: after K subscriptions), 0 on success; 3 on
timeout (no subscriber came), 1 on a refused request or an error.

JSON lines: setup, publish_namespace_ok, subscribe, subscribe_ok, group_sent,
publish_done_sent, fetch, fetch_served, publish_ok, error, exit.
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
from aiomoqt.context import profile_for
from aiomoqt.messages import SubgroupHeader
from aiomoqt.messages.data import FetchObject
from aiomoqt.messages.params import LocationFilterType
from aiomoqt.messages.request import RequestOk
from aiomoqt.messages.subscribe import Subscribe
from aiomoqt.types import (
    MOQTMessageType,
    MOQTRequestError,
    ParamType,
    RequestErrorCode,
    SubscribeDoneCode,
)
from aiomoqt.utils.logger import set_log_level
from aiomoqt.utils.url import parse_relay_url

PRIORITY = 128
REQUEST_UPDATE = 0x02  # d16+ REQUEST_UPDATE (SUBSCRIBE_UPDATE's code point)


class Publisher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ns = tuple(pc.parse_field(f) for f in args.ns)
        self.track = pc.parse_field(args.track)
        self.size = args.size
        # Largest Location published so far; --history: all of it already.
        self.largest: tuple[int, int] | None = (
            (args.groups - 1, args.objects - 1) if args.history else None)
        self.served = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.finished = asyncio.Event()
        self.failed: str | None = None
        # Forward State per request id (PUBLISH or SUBSCRIBE), from REQUEST_UPDATE.
        self.forward: dict[int, int] = {}
        self.forward_changed = asyncio.Event()

    def all_locations(self) -> list[tuple[int, int]]:
        return [(g, o) for g in range(self.args.groups) for o in range(self.args.objects)]

    def data(self, g: int, o: int) -> bytes:
        return pc.payload(g, o, self.size, self.args.seed)

    def note_largest(self, loc: tuple[int, int]) -> None:
        if self.largest is None or loc > self.largest:
            self.largest = loc

    # -- SUBSCRIBE ---------------------------------------------------------

    def window(self, msg: Any) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """(first Location, last Location inclusive or None) of a SUBSCRIBE's
        d22 LOCATION_FILTER, against the Largest Location now."""
        lf = getattr(msg, "location_filter", None)
        largest = self.largest
        if lf is None or lf.type == LocationFilterType.NONE:
            return (0, 0), None
        t = lf.type
        if t == LocationFilterType.NEXT_OBJECT:
            start = (0, 0) if largest is None else (largest[0], largest[1] + 1)
        elif t == LocationFilterType.RELATIVE_START:
            nxt = 0 if largest is None else largest[0] + 1
            start = (max(0, nxt - lf.start_group), 0)
        else:
            start = (lf.start_group, lf.start_object)
        if t == LocationFilterType.ABSOLUTE_GROUP_END:
            return start, (lf.end_group, 1 << 62)
        if t == LocationFilterType.ABSOLUTE_RANGE:
            return start, (lf.end_group, lf.end_object)
        return start, None

    async def on_subscribe(self, session: Any, msg: Any) -> None:
        ns = tuple(bytes(f) for f in msg.track_namespace)
        name = bytes(msg.track_name)
        lf = getattr(msg, "location_filter", None)
        pc.emit("subscribe", request_id=msg.request_id, ns=pc.ns_json(ns),
                track=pc.field_json(name), filter=str(lf) if lf is not None else None,
                forward=getattr(msg, "forward", None))
        if ns != self.ns or name != self.track:
            session.subscribe_error(request_id=msg.request_id,
                                    error_code=RequestErrorCode.DOES_NOT_EXIST,
                                    reason="track does not exist")
            pc.emit("subscribe_error_sent", request_id=msg.request_id)
            return
        start, last = self.window(msg)
        kw: dict[str, Any] = {}
        if self.largest is not None:
            kw = dict(content_exists=1, largest_group_id=self.largest[0],
                      largest_object_id=self.largest[1])
        ok = session.subscribe_ok(request_msg=msg, **kw)
        pc.emit("subscribe_ok", request_id=msg.request_id, track_alias=ok.track_alias,
                start=list(start), last=list(last) if last else None)
        cancelled = asyncio.Event()
        session.register_request_cancel_handler(msg.request_id, lambda _rid: cancelled.set())
        if getattr(msg, "forward", None) == 0:
            pc.emit("note", detail="SUBSCRIBE with Forward 0: sending anyway is wrong; waiting")
        task = asyncio.ensure_future(
            self.send_track(session, ok.track_alias, msg.request_id, start, last, cancelled))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def send_track(self, session: Any, alias: int, request_id: int,
                         start: tuple[int, int], last: tuple[int, int] | None,
                         cancelled: asyncio.Event) -> None:
        try:
            await asyncio.sleep(self.args.start_delay)
            streams = await self.send_objects(session, alias, start, last, cancelled)
            if cancelled.is_set():
                pc.emit("subscription_cancelled", request_id=request_id)
            else:
                session.subscribe_done(request_id=request_id,
                                       status_code=SubscribeDoneCode.TRACK_ENDED,
                                       stream_count=streams, reason="track ended")
                pc.emit("publish_done_sent", request_id=request_id, stream_count=streams,
                        status=int(SubscribeDoneCode.TRACK_ENDED))
        except Exception as e:
            self.failed = f"sending failed: {type(e).__name__}: {e}"
            pc.emit("error", error=self.failed)
        self.served += 1
        if self.served >= self.args.serve:
            self.finished.set()

    async def send_objects(self, session: Any, alias: int, start: tuple[int, int],
                           last: tuple[int, int] | None, cancelled: asyncio.Event) -> int:
        prof = profile_for(session.negotiated_draft)
        streams = 0
        for g in range(self.args.groups):
            objs = [o for o in range(self.args.objects)
                    if (g, o) >= start and (last is None or (g, o) <= last)]
            if not objs or cancelled.is_set():
                continue
            sid = await session.open_uni_stream()
            streams += 1
            header = SubgroupHeader(track_alias=alias, group_id=g, subgroup_id=0,
                                    publisher_priority=PRIORITY, prof=prof)
            session.stream_write(sid, header.serialize().data)
            for o in objs:
                buf = header.next_object(payload=self.data(g, o), object_id=o)
                await session.stream_write_drain(sid, buf.data)
                self.note_largest((g, o))
                if self.args.interval:
                    await asyncio.sleep(self.args.interval / 1000)
            session.stream_write(sid, b"", end_stream=True)
            pc.emit("group_sent", group=g, objects=len(objs), stream_id=sid)
        return streams

    # -- FETCH -------------------------------------------------------------

    async def on_fetch(self, session: Any, msg: Any) -> None:
        ns = tuple(bytes(f) for f in (msg.namespace or ()))
        name = bytes(msg.track_name or b"")
        lf = getattr(msg, "location_filter", None)
        pc.emit("fetch", request_id=msg.request_id, ns=pc.ns_json(ns),
                track=pc.field_json(name), filter=str(lf) if lf is not None else None,
                fetch_type=getattr(msg, "fetch_type", None))
        if ns != self.ns or name != self.track:
            session.fetch_error(request_id=msg.request_id,
                                error_code=RequestErrorCode.DOES_NOT_EXIST,
                                reason="track does not exist")
            pc.emit("fetch_error_sent", request_id=msg.request_id, code="DOES_NOT_EXIST")
            return
        if self.largest is None:
            session.fetch_error(request_id=msg.request_id,
                                error_code=RequestErrorCode.INVALID_RANGE,
                                reason="no object published yet")
            pc.emit("fetch_error_sent", request_id=msg.request_id, code="INVALID_RANGE")
            return
        if lf is None:
            start, last = (0, 0), self.largest
        else:
            start, last = lf.resolve(self.largest, fetch=True)
            last = min(last, self.largest)
        locs = [loc for loc in self.all_locations() if start <= loc <= last]
        if not locs:
            session.fetch_error(request_id=msg.request_id,
                                error_code=RequestErrorCode.INVALID_RANGE,
                                reason="empty range")
            pc.emit("fetch_error_sent", request_id=msg.request_id, code="INVALID_RANGE")
            return
        end = locs[-1]
        done = self.largest == (self.args.groups - 1, self.args.objects - 1)
        # aiomoqt's FetchOk takes End Location in the d14-d18 form (last Object
        # + 1) and writes it inclusive on the d20+ wire: pass end + 1.
        session.fetch_ok(request_id=msg.request_id, end_of_track=int(done and end == self.largest),
                         largest_group_id=end[0], largest_object_id=end[1] + 1)
        objects = [FetchObject(group_id=g, subgroup_id=0, object_id=o,
                               publisher_priority=PRIORITY, payload=self.data(g, o))
                   for g, o in locs]
        await session.serve_fetch(msg.request_id, objects)
        pc.emit("fetch_served", request_id=msg.request_id, objects=len(objects),
                first=list(locs[0]), last=list(end))

    # -- REQUEST_UPDATE ------------------------------------------------------

    async def on_request_update(self, session: Any, msg: Any) -> None:
        """d20+: a relay parks a PUBLISH with REQUEST_UPDATE(FORWARD=0) and
        resumes it with FORWARD=1 when a subscriber arrives. Accept every
        update (REQUEST_OK) and remember FORWARD."""
        params = dict(msg.parameters or {})
        fwd = params.get(int(ParamType.FORWARD))
        pc.emit("request_update", request_id=msg.request_id,
                existing_request_id=msg.existing_request_id,
                params={f"0x{int(k):x}": repr(v) for k, v in params.items()})
        if fwd is not None:
            self.forward[msg.existing_request_id] = int(fwd)
            self.forward_changed.set()
        session._send_reply(msg.request_id, RequestOk(request_id=msg.request_id))

    async def wait_forward(self, request_id: int) -> None:
        while self.forward.get(request_id, 1) != 1:
            self.forward_changed.clear()
            await self.forward_changed.wait()

    # -- PUBLISH (publisher-initiated) ---------------------------------------

    async def publish_track(self, session: Any) -> None:
        pub = session.publish(namespace=self.ns, track_name=self.track, forward=1)
        reply = session._await_response(pub.request_id)  # future registered before any await
        pc.emit("publish_sent", request_id=pub.request_id, track_alias=pub.track_alias)
        cancelled = asyncio.Event()
        session.register_request_cancel_handler(pub.request_id, lambda _rid: cancelled.set())
        ok = await reply
        pc.emit("publish_ok", request_id=pub.request_id, reply=type(ok).__name__,
                forward=getattr(ok, "forward", None))
        await asyncio.sleep(self.args.start_delay)
        if self.forward.get(pub.request_id, 1) != 1:
            pc.emit("parked", request_id=pub.request_id, detail="FORWARD=0; waiting for 1")
        await self.wait_forward(pub.request_id)
        streams = await self.send_objects(session, pub.track_alias, (0, 0), None, cancelled)
        session.subscribe_done(request_id=pub.request_id,
                               status_code=SubscribeDoneCode.TRACK_ENDED,
                               stream_count=streams, reason="track ended")
        pc.emit("publish_done_sent", request_id=pub.request_id, stream_count=streams,
                status=int(SubscribeDoneCode.TRACK_ENDED))
        self.served += 1
        if self.served >= self.args.serve:
            self.finished.set()


def allow_duplicate_subscribe(session: Any) -> None:
    """aiomoqt refuses a second SUBSCRIBE for a track while it still holds one
    on the session (REQUEST_ERROR NOT_SUPPORTED "track already subscribed in
    this session"). moq-rs's server, bridging a moq-lite subscriber, sends
    SUBSCRIBE, cancels it (request stream reset) and at once SUBSCRIBEs again:
    when the new request stream is read before the reset, aiomoqt refuses it
    and the moq-rs subscriber fails (~5% of runs). d20+ has no
    DUPLICATE_SUBSCRIPTION; this publisher serves each subscription on its
    own, so forget the older one before aiomoqt's check (private API)."""
    refuse = session._refuse_request

    def patched(msg: Any) -> Any:
        if isinstance(msg, Subscribe):
            key = (tuple(msg.track_namespace or ()), bytes(msg.track_name or b""))
            for rid, held in list(session._peer_requests.items()):
                if held == (Subscribe, key):
                    del session._peer_requests[rid]
        return refuse(msg)

    session._refuse_request = patched


async def run(args: argparse.Namespace) -> int:
    relay = parse_relay_url(args.url)
    if not relay.use_quic:
        pc.emit("error", error="only moqt:// (raw QUIC) URLs are supported here")
        return pc.EXIT_USAGE
    pub = Publisher(args)
    client = MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=True,
                        verify_tls=False, supported_drafts=args.draft)
    client.register_handler(MOQTMessageType.SUBSCRIBE, pub.on_subscribe)
    client.register_handler(MOQTMessageType.FETCH, pub.on_fetch)
    client.register_handler(REQUEST_UPDATE, pub.on_request_update)
    async with client.connect() as session:
        if not args.strict_duplicate:
            allow_duplicate_subscribe(session)
        await session.client_session_init()
        hi = session.handshake_info
        pc.emit("setup", draft=hi.get("draft"), alpn=hi.get("alpn"),
                peer_transport_parameters=pc.jsonable(hi.get("peer_transport_parameters")))
        try:
            if args.mode == "announce" or args.announce:
                await session.publish_namespace(namespace=pub.ns, wait_response=True)
                pc.emit("publish_namespace_ok", ns=pc.ns_json(pub.ns))
            if args.mode == "publish":
                await pub.publish_track(session)
            if args.expect_error:
                pc.emit("error", error="expected REQUEST_ERROR, the request was accepted")
                return pc.EXIT_FAIL
            if args.serve > 0:
                await pub.finished.wait()
            await asyncio.sleep(args.linger)
        except MOQTRequestError as e:
            pc.emit("request_error", code=e.error_code, reason=str(e.reason or ""))
            return pc.EXIT_OK if args.expect_error else pc.EXIT_FAIL
        finally:
            for t in list(pub.tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                session.close()
    return pc.EXIT_FAIL if pub.failed else pc.EXIT_OK


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    pc.add_common_args(p)
    pc.add_track_shape_args(p)
    p.add_argument("--mode", choices=("announce", "publish"), default="announce")
    p.add_argument("--announce", action="store_true",
                   help="with --mode publish: PUBLISH_NAMESPACE first")
    p.add_argument("--history", action="store_true",
                   help="the whole track exists from the start (FETCH works at once; "
                        "SUBSCRIBE filters are applied against Largest = last object)")
    p.add_argument("--serve", type=int, default=1,
                   help="exit after this many subscriptions were served (default 1; "
                        "0: just stay --linger seconds, answering what comes)")
    p.add_argument("--linger", type=float, default=1.0,
                   help="seconds to stay connected after the last one (default 1)")
    p.add_argument("--interval", type=float, default=0.0, help="ms between objects")
    p.add_argument("--start-delay", type=float, default=0.05,
                   help="seconds between SUBSCRIBE_OK and the first object (default 0.05)")
    p.add_argument("--expect-error", action="store_true",
                   help="success = PUBLISH_NAMESPACE / PUBLISH is refused (REQUEST_ERROR)")
    p.add_argument("--strict-duplicate", action="store_true",
                   help="keep aiomoqt's refusal of a second SUBSCRIBE to a track on one "
                        "session (see allow_duplicate_subscribe)")
    p.add_argument("--draft", type=int, default=22)
    p.add_argument("--debug", action="store_true", help="aiomoqt INFO/DEBUG logs on stderr")
    args = p.parse_args()
    set_log_level(logging.DEBUG if args.debug else logging.WARNING)
    if not args.ns:
        p.error("--ns is required (repeat it for each namespace field)")
    pc.require_loopback_netns()
    pc.install_watchdog(args.timeout + 5)
    code = pc.EXIT_TIMEOUT

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
