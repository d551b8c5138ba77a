"""Our client against their relay and server, over QUIC on loopback, draft 22.

Our side: ``kvcs.transports.quic`` ``connect()`` in this process, its session used as
plain MOQT (:class:`~interop_harness.Plain`): PUBLISH_NAMESPACE and answering
SUBSCRIBE / FETCH from a :class:`~kvcs_core.moqt.track_store.TrackStore`,
PUBLISH_DONE (TRACK_ENDED), SUBSCRIBE, FETCH, SUBSCRIBE_NAMESPACE. Their side:
the aiomoqt 0.13.3 relay (``moq_interop_relay``) and the moq-rs 0.5.1 server
(``moq.Server``, which also routes between its clients), plus their publisher
and subscriber scripts at the far end. Payloads are ``peer_common.payload``
on both sides and checked byte for byte.

Known gaps of the peers, said by the tests that meet them: moq-rs has no FETCH
spanning several groups (REQUEST_ERROR NOT_SUPPORTED); the aiomoqt relay sends
NAMESPACE_DONE twice for one withdrawal.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from interop_harness import (
    ALPN,
    SHAPE,
    namespace,
    ns_args,
    payload,
    plain,
    proc_event,
    proc_exit,
    run,
    shape_args,
    summary,
    track,
)

from kvcs_core.moqt import events as ev
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, PublishDoneCode, RequestErrorCode

GROUPS, OBJECTS, SIZE = SHAPE
ALL = [(g, o) for g in range(GROUPS) for o in range(OBJECTS)]
BINARY_NS = ("kvcs", b"\x00\xff\x10")
NS_ARGS = ns_args(["kvcs", "hex:00ff10"])
TEXT_NS = ("kvcs", "demo")
TEXT_ARGS = ns_args(["kvcs", "demo"])


def check_payloads(got: dict[tuple[int, int], bytes], wanted: list[tuple[int, int]]) -> None:
    assert sorted(got) == sorted(wanted), sorted(got)
    bad = [k for k in wanted if got[k] != payload(*k, SIZE)]
    assert not bad, f"payloads differ at {bad}"


# --- against the aiomoqt relay ------------------------------------------------------------


def test_publish_to_aiomoqt_relay(peers: Any) -> None:
    """Our PUBLISH_NAMESPACE at the aiomoqt relay; an aiomoqt subscriber there makes the
    relay SUBSCRIBE to us; our objects reach it byte-exact; our PUBLISH_DONE
    (TRACK_ENDED, Stream Count 3) is forwarded to it."""
    url = peers.aiomoqt_relay()

    async def scenario() -> None:
        async with plain(url) as me:
            assert me.alpn == ALPN
            assert (me.peer_implementation or "").startswith("aiomoqt/")
            ns = namespace(*BINARY_NS)
            t = track(ns)
            store = me.add_track(t)
            await me.accepted(me.publish_namespace(ns))
            sub = peers.run(
                "sub", "aiomoqt_sub.py", "--url", url, *NS_ARGS, *shape_args(), "--timeout", "10"
            )
            await me.until(lambda: bool(me.subscribers(t)), 10, "the relay's SUBSCRIBE")
            # content comes a little after SUBSCRIBE_OK, as from a live source (and as
            # aiomoqt_pub.py's --start-delay): the relay loses a PUBLISH_DONE that comes
            # right behind the SUBSCRIBE_OK (test_publish_done_right_after_subscribe_ok)
            await asyncio.sleep(0.3)
            for g in range(GROUPS):
                me.write_group(store, g, OBJECTS, SIZE)
            assert len(me.end_track(store)) == 1
            assert await proc_exit(sub, 15) == 0, summary(sub)
            done = sub.last("publish_done")
            assert done is not None and done["status"] == PublishDoneCode.TRACK_ENDED, done
            assert done["stream_count"] == GROUPS, done
            assert sub.last("summary")["unique"] == GROUPS * OBJECTS

    run(scenario())


def test_publish_done_right_after_subscribe_ok(peers: Any) -> None:
    """A track that has already ended when the relay SUBSCRIBEs: we answer SUBSCRIBE_OK
    (LARGEST_OBJECT {2,3}) and, right behind it on the request stream, PUBLISH_DONE
    TRACK_ENDED (Stream Count 0), which is legal (wire reference 4.4). The aiomoqt
    subscriber behind the relay must get that PUBLISH_DONE."""
    url = peers.aiomoqt_relay("--debug")  # its log shows what it received

    async def scenario() -> None:
        async with plain(url) as me:
            ns = namespace("kvcs", "ended")
            t = track(ns)
            store = me.add_track(t)
            for g in range(GROUPS):
                me.write_group(store, g, OBJECTS, SIZE)
            me.end_track(store)  # every SUBSCRIBE from now on: SUBSCRIBE_OK + PUBLISH_DONE
            await me.accepted(me.publish_namespace(ns))
            sub = peers.run(
                "sub", "aiomoqt_sub.py", "--url", url, "--ns", "kvcs", "--ns", "ended",
                "--track", "t", "--no-verify", "--timeout", "4",
            )  # fmt: skip
            rc = await proc_exit(sub, 10)
            assert any(isinstance(e, ev.SubscribeRequested) for e in me.peer_requests)
            if rc != 0 and not sub.last("summary")["publish_done"]:
                log = next(peers.tmp.glob("relay*.log")).read_text()
                assert "SubscribeDone(request_id=1, status_code=2, stream_count=0" in log
                pytest.xfail(
                    "aiomoqt relay deviation: it received our PUBLISH_DONE (TRACK_ENDED) "
                    "right after the SUBSCRIBE_OK, handled it before it had finished "
                    "setting up the subscription, and never forwarded it: its subscriber "
                    "waits for the end forever"
                )
            assert rc == 0, summary(sub)

    run(scenario())


def test_subscribe_at_aiomoqt_relay(peers: Any) -> None:
    """An aiomoqt publisher behind the aiomoqt relay; our SUBSCRIBE there gets SUBSCRIBE_OK,
    12 objects byte-exact and PUBLISH_DONE TRACK_ENDED with Stream Count 3."""
    url = peers.aiomoqt_relay()

    async def scenario() -> None:
        pub = peers.run(
            "pub", "aiomoqt_pub.py", "--url", url, *NS_ARGS, *shape_args(), "--timeout", "15"
        )
        await proc_event(pub, "publish_namespace_ok", 10)
        async with plain(url) as me:
            rid = me.subscribe(track(namespace(*BINARY_NS)))
            ok = await me.accepted(rid)
            assert isinstance(ok, ev.SubscribeAccepted)
            check_payloads(await me.all_objects(rid, ALL), ALL)
            done = await me.publish_done(rid)
            assert done.status == PublishDoneCode.TRACK_ENDED and done.stream_count == GROUPS
        assert await proc_exit(pub, 10) == 0, summary(pub)

    run(scenario())


def test_publish_and_subscribe_both_ours_via_aiomoqt_relay(peers: Any) -> None:
    """Our publisher and our subscriber on either side of the aiomoqt relay."""
    url = peers.aiomoqt_relay()

    async def scenario() -> None:
        async with plain(url) as pub, plain(url) as sub:
            ns = namespace("kvcs", "ours")
            t = track(ns, "layer-0")
            store = pub.add_track(t)
            await pub.accepted(pub.publish_namespace(ns))
            rid = sub.subscribe(t)
            await pub.until(lambda: bool(pub.subscribers(t)), 10, "the relay's SUBSCRIBE")
            await sub.accepted(rid)
            await asyncio.sleep(0.3)  # see test_publish_to_aiomoqt_relay
            for g in range(GROUPS):
                pub.write_group(store, g, OBJECTS, SIZE)
            pub.end_track(store)
            check_payloads(await sub.all_objects(rid, ALL), ALL)
            done = await sub.publish_done(rid)
            assert done.status == PublishDoneCode.TRACK_ENDED

    run(scenario())


def test_fetch_at_aiomoqt_relay(peers: Any) -> None:
    """Our FETCH at the aiomoqt relay, which has nothing cached: it FETCHes upstream from
    our publisher (FETCH answered from our TrackStore), FETCH_OK's End Location is
    inclusive {2,1}; then a whole-track FETCH."""
    url = peers.aiomoqt_relay()

    async def scenario() -> None:
        async with plain(url) as pub, plain(url) as me:
            ns = namespace("kvcs", "history")
            t = track(ns)
            store = pub.add_track(t)
            for g in range(GROUPS):
                pub.write_group(store, g, OBJECTS, SIZE)
            await pub.accepted(pub.publish_namespace(ns))
            rid = me.fetch(t, location_filter=p.LocationFilter.absolute_range(1, 0, 2, 1))
            ok = await me.accepted(rid)
            assert isinstance(ok, ev.FetchAccepted)
            assert (ok.end_location.group, ok.end_location.object) == (2, 1), ok
            part = [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
            check_payloads(await me.all_objects(rid, part), part)
            assert any(isinstance(e, ev.FetchRequested) for e in pub.peer_requests)
            rid2 = me.fetch(t, location_filter=p.LocationFilter.absolute_group_end(0, 0, 2))
            await me.accepted(rid2)
            check_payloads(await me.all_objects(rid2, ALL), ALL)

    run(scenario())


def test_subscribe_namespace_at_aiomoqt_relay(peers: Any) -> None:
    """Our SUBSCRIBE_NAMESPACE kvcs at the aiomoqt relay: NAMESPACE kvcs/ns2 when an
    aiomoqt publisher announces it, NAMESPACE_DONE when it leaves."""
    url = peers.aiomoqt_relay()

    async def scenario() -> None:
        async with plain(url) as me:
            rid = me.subscribe_namespace(namespace("kvcs"))
            await me.accepted(rid)
            pub = peers.run(
                "pub", "aiomoqt_pub.py", "--url", url, "--ns", "kvcs", "--ns", "ns2",
                "--serve", "0", "--linger", "0.5", "--timeout", "5",
            )  # fmt: skip
            await me.until(
                lambda: me.first(ev.NamespaceAnnounced, request_id=rid) is not None, 10, "NAMESPACE"
            )
            assert me.first(ev.NamespaceAnnounced).namespace == namespace("kvcs", "ns2")
            assert await proc_exit(pub, 10) == 0, summary(pub)
            await me.until(
                lambda: me.first(ev.NamespaceWithdrawn, request_id=rid) is not None,
                10,
                "NAMESPACE_DONE",
            )
            await asyncio.sleep(1.0)  # a repeated NAMESPACE_DONE would come now
            closed = me.first(ev.SessionClosed)
            if closed is not None:
                assert closed.reason == "NAMESPACE_DONE before NAMESPACE", closed
                assert len(me.all(ev.NamespaceWithdrawn)) == 1
                pytest.xfail(
                    "aiomoqt relay deviation: it sent NAMESPACE_DONE kvcs/ns2 twice for one "
                    "withdrawal (tests/peers/README.md); a NAMESPACE_DONE with no matching "
                    "NAMESPACE is a PROTOCOL_VIOLATION (wire reference 4.3), so our session "
                    f"closed: {closed}"
                )

    run(scenario())


# --- against the moq-rs server ------------------------------------------------------------


def test_subscribe_at_moqrs_server(peers: Any) -> None:
    """The moq-rs server's own track (written once we subscribe): our SUBSCRIBE gets
    SUBSCRIBE_OK, 12 frames as objects byte-exact (each with Object Property 0x10
    TIMESTAMP), the END_OF_TRACK object moq-rs adds in group 3, PUBLISH_DONE TRACK_ENDED."""
    url = peers.moqrs_server_at(*TEXT_ARGS, *shape_args())

    async def scenario() -> None:
        async with plain(url) as me:
            assert me.alpn == ALPN
            assert me.peer_implementation == "moq-lite-rs", me.peer_implementation
            rid = me.subscribe(track(namespace(*TEXT_NS)))
            await me.accepted(rid)
            check_payloads(await me.all_objects(rid, ALL), ALL)
            done = await me.publish_done(rid)
            assert done.status == PublishDoneCode.TRACK_ENDED
            normal = [o for o in me.objects[rid] if o.status is ObjectStatus.NORMAL]
            assert all(any(kv.type == 0x10 for kv in o.properties) for o in normal)
            eot = [o for o in me.objects[rid] if o.status is ObjectStatus.END_OF_TRACK]
            assert [(o.location.group, o.location.object) for o in eot] == [(GROUPS, 0)], eot
            # SUBSCRIBE_NAMESPACE and PUBLISH_NAMESPACE came from the server: answered
            kinds = {type(e).__name__ for e in me.peer_requests}
            assert "SubscribeNamespaceRequested" in kinds, kinds

    run(scenario())


def test_fetch_at_moqrs_server(peers: Any) -> None:
    """After the track was written, FETCH of the whole group 1 from the moq-rs server:
    objects 1.0..1.3 byte-exact. Then a FETCH spanning groups 0..2, which moq-rs 0.5.1
    does not support: it must be refused (REQUEST_ERROR), not answered wrongly."""
    url = peers.moqrs_server_at(*TEXT_ARGS, *shape_args())

    async def scenario() -> None:
        async with plain(url) as me:
            t = track(namespace(*TEXT_NS))
            rid = me.subscribe(t)
            await me.accepted(rid)
            await me.publish_done(rid)
            one = [(1, o) for o in range(OBJECTS)]
            frid = me.fetch(t, location_filter=p.LocationFilter.absolute_group_end(1, 0, 1))
            ok = await me.accepted(frid)
            assert (ok.end_location.group, ok.end_location.object) == (1, OBJECTS - 1), ok
            check_payloads(await me.all_objects(frid, one), one)
            many = me.fetch(t, location_filter=p.LocationFilter.absolute_group_end(0, 0, 2))
            answer = await me.answer(many)
            if isinstance(answer, ev.RequestFailed):
                assert answer.code == RequestErrorCode.NOT_SUPPORTED, answer
                pytest.xfail(
                    "moq-rs 0.5.1 lacks FETCH spanning several groups: REQUEST_ERROR "
                    f"{answer.code:#x} {answer.reason!r} (single-group FETCH passed above)"
                )
            check_payloads(await me.all_objects(many, ALL), ALL)

    run(scenario())


def test_subscribe_namespace_at_moqrs_server(peers: Any) -> None:
    """Our SUBSCRIBE_NAMESPACE kvcs at the moq-rs server: NAMESPACE kvcs/demo."""
    url = peers.moqrs_server_at(*TEXT_ARGS, *shape_args(), "--wait-subscriber", "1")

    async def scenario() -> None:
        async with plain(url) as me:
            rid = me.subscribe_namespace(namespace("kvcs"))
            await me.accepted(rid)
            await me.until(
                lambda: me.first(ev.NamespaceAnnounced, request_id=rid) is not None, 10, "NAMESPACE"
            )
            assert me.first(ev.NamespaceAnnounced).namespace == namespace(*TEXT_NS)

    run(scenario())


@pytest.mark.parametrize("sub_script", ["aiomoqt_sub.py", "moqrs_sub.py"])
def test_publish_to_moqrs_server(peers: Any, sub_script: str) -> None:
    """Our PUBLISH_NAMESPACE kvcs/demo at the moq-rs server (we also answer its
    SUBSCRIBE_NAMESPACE and PUBLISH_NAMESPACE); a subscriber there (aiomoqt over d22;
    moq-rs over moq-lite on its own leg) makes the server SUBSCRIBE to us (NEXT_OBJECT
    + a fill of the current group, descending groups), then our objects reach it
    byte-exact, and our PUBLISH_DONE ends its track."""
    url = peers.moqrs_server_at("--no-track")

    async def scenario() -> None:
        async with plain(url) as me:
            ns = namespace(*TEXT_NS)
            t = track(ns)
            store = me.add_track(t)
            await me.accepted(me.publish_namespace(ns))
            sub = peers.run(
                "sub", sub_script, "--url", url, *TEXT_ARGS, *shape_args(), "--timeout", "10"
            )
            await me.until(lambda: bool(me.subscribers(t)), 10, "the server's SUBSCRIBE")
            # As the peer publishers do (moqrs_pub.py writes after used(), aiomoqt_pub.py
            # after --start-delay): the moq-rs server forwards to a downstream only the
            # groups that come after it attached it (no history), and for a moq-lite
            # subscriber it cancels its first SUBSCRIBE and sends another at once.
            await asyncio.sleep(0.5)
            for g in range(GROUPS):
                me.write_group(store, g, OBJECTS, SIZE)
                await asyncio.sleep(0.05)
            me.end_track(store)
            assert await proc_exit(sub, 15) == 0, summary(sub)
            assert sub.last("summary")["unique"] == GROUPS * OBJECTS
            subs = [e for e in me.peer_requests if isinstance(e, ev.SubscribeRequested)]
            fill = subs[-1].params.get(p.FillParameters)
            assert fill is not None, subs[-1]  # moq-rs asks for a fill of the current group

    run(scenario())


def test_binary_namespace_at_moqrs_server(peers: Any) -> None:
    """PUBLISH_NAMESPACE with a binary field (every KVCS namespace has four: its IDs) at
    the moq-rs server. Namespace fields are byte strings (wire reference 2.6); moq-rs
    names broadcasts by UTF-8 paths and ends the session instead, which is also why a
    KVCS publication cannot go through a moq-rs server."""
    url = peers.moqrs_server_at("--no-track")

    async def scenario() -> None:
        async with plain(url) as me:
            rid = me.publish_namespace(namespace("kvcs", b"\x00\xff\x10"))
            answer_or_close = None
            with contextlib.suppress(AssertionError):
                answer_or_close = await me.answer(rid, timeout=5)
            if me.client.closed:
                reason = me.client.pump.close_reason or ""
                assert "invalid string" in reason, reason
                pytest.xfail(
                    "moq-rs 0.5.1 deviation: a Track Namespace field that is not UTF-8 ends "
                    f"the session ({reason}); fields are byte strings (wire reference 2.6)"
                )
            assert isinstance(answer_or_close, ev.RequestAccepted), answer_or_close

    run(scenario())
