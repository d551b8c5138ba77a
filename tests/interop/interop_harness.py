"""What the interop tests share: peer processes, our relay, our plain MOQT client.

Everything here runs inside the loopback-only network namespace (conftest.py).

* :class:`Peers` (a :class:`peerlib.PeerSet`): the peer scripts of tests/peers
  (run by ``.peers/bin/python``) and our own ``python -m kvcs.transports.cli ...``
  processes, each a :class:`peerlib.Proc` whose JSON lines are parsed as they
  come; all stopped by PID when the test ends.
* :class:`InprocRelay`: our relay (``serve_relay``) on 127.0.0.1 in a thread of
  the test process, recording the ALPN and the peer's MOQT_IMPLEMENTATION of
  every session it sets up, and any exception its event loop saw.
* :class:`Plain`: our client session (``kvcs.transports.quic`` ``MoqtClient``) used
  as plain MOQT: it records every session event and object and answers the
  peer's requests: SUBSCRIBE / FETCH / TRACK_STATUS of the tracks it holds
  (:class:`~kvcs_core.moqt.track_store.TrackStore`), SUBSCRIBE_NAMESPACE
  (NAMESPACE for what it announced), and PUBLISH_NAMESPACE (a moq-rs server
  sends one per broadcast even to clients; REQUEST_OK, as aiomoqt answers).

Payloads are ``peer_common.payload(g, o, size, seed)``, as every peer script
sends and checks them, so both sides verify bytes without a side channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "peers"))

import peer_common  # noqa: E402
from peerlib import PeerSet, Proc, free_udp_port, loopback_only, peers_missing  # noqa: E402

from kvcs.transports.quic import asyncio_binding  # noqa: E402
from kvcs.transports.quic._setup import client_endpoint, parse_url  # noqa: E402
from kvcs.transports.quic.api import MoqtClient, open_session  # noqa: E402
from kvcs.transports.quic.apps import ClientApp  # noqa: E402
from kvcs.transports.quic.tls import TlsConfig, self_signed  # noqa: E402
from kvcs_core.moqt import events as ev  # noqa: E402
from kvcs_core.moqt.requests import RequestState  # noqa: E402
from kvcs_core.moqt.session import MoqtSession  # noqa: E402
from kvcs_core.moqt.track_store import TrackStore  # noqa: E402
from kvcs_core.wire.codes import ObjectStatus, PublishDoneCode, RequestErrorCode  # noqa: E402
from kvcs_core.wire.names import FullTrackName, TrackNamespace  # noqa: E402

__all__ = [
    "ALPN",
    "InprocRelay",
    "Peers",
    "Plain",
    "Proc",
    "free_udp_port",
    "payload",
    "peer_common",
    "proc_event",
    "proc_exit",
]

ALPN = "moqt-22"
SHAPE = (3, 4, 300)
"""groups, objects per group, payload size: the track every scenario sends."""


def payload(group: int, obj: int, size: int = SHAPE[2], seed: str = "") -> bytes:
    return peer_common.payload(group, obj, size, seed)


def shape_args(groups: int = SHAPE[0], objects: int = SHAPE[1], size: int = SHAPE[2]) -> list[str]:
    return ["--groups", str(groups), "--objects", str(objects), "--size", str(size)]


def ns_args(ns: Iterable[str], track: str | None = "t") -> list[str]:
    out: list[str] = []
    for field in ns:
        out += ["--ns", field]
    if track is not None:
        out += ["--track", track]
    return out


def require_namespace() -> None:
    """Every process an interop test starts runs in a loopback-only namespace."""
    if not loopback_only():
        pytest.fail("refusing to start peers outside a loopback-only network namespace")
    reason = peers_missing()
    if reason is not None:
        pytest.skip(reason)


# --- processes ----------------------------------------------------------------------------


class Peers(PeerSet):
    """The peer scripts plus our own CLI processes, all stopped by PID at the end."""

    def kvcs(self, name: str, *args: str) -> Proc:
        """``python3 -m kvcs ARGS`` (JSON lines parsed like a peer's)."""
        proc = Proc(name, [sys.executable, "-m", "kvcs", *args], self.tmp)
        self.procs.append(proc)
        return proc

    def our_relay_cli(self, *extra: str) -> tuple[Proc, str]:
        """``kvcs relay --listen 127.0.0.1:0 --self-signed --json``; (process, URL)."""
        relay = self.kvcs(
            "kvcs-relay",
            "relay",
            "--listen",
            "127.0.0.1:0",
            "--self-signed",
            "--cert-dir",
            str(self.tmp / "kvcs-cert"),
            "--json",
            *extra,
        )
        line = relay.wait_event("listening", 20)
        if line is None:
            raise RuntimeError(f"kvcs relay did not start: {relay.events} {relay.other}")
        return relay, str(line["url"])

    def aiomoqt_relay(self, *extra: str, big: bool = False) -> str:
        """aiomoqt's interop relay on a free port; ``big``: stream buffers for large
        objects (README: objects over ~1 MiB need --stream-ring-cap above their size)."""
        port = free_udp_port()
        tail = ["--", "--stream-ring-cap", "16777216", "--max-inflight-bytes", "8388608"]
        self.relay(port, *extra, *(tail if big else []))
        return self.url(port)

    def moqrs_server_at(self, *extra: str) -> str:
        port = free_udp_port()
        self.moqrs_server(port, *extra)
        return self.url(port)


async def proc_event(proc: Proc, name: str, timeout: float) -> dict[str, Any]:
    """Wait (without blocking the event loop) for a JSON line ``name`` of ``proc``."""
    deadline = time.monotonic() + timeout
    while True:
        with proc.cond:
            for e in proc.events:
                if e.get("event") == name:
                    return e
        if time.monotonic() >= deadline or proc.p.poll() is not None:
            with proc.cond:
                for e in proc.events:
                    if e.get("event") == name:
                        return e
            raise AssertionError(
                f"{proc.name}: no {name!r} within {timeout:g} s "
                f"(rc={proc.p.poll()}, last events {proc.events[-4:]})"
            )
        await asyncio.sleep(0.03)


async def proc_exit(proc: Proc, timeout: float) -> int:
    """Wait (without blocking the event loop) for ``proc`` to exit; its status."""
    deadline = time.monotonic() + timeout
    while proc.p.poll() is None:
        if time.monotonic() >= deadline:
            raise AssertionError(f"{proc.name}: still running after {timeout:g} s")
        await asyncio.sleep(0.03)
    proc.reader.join(2)
    return int(proc.p.returncode)


def summary(proc: Proc) -> str:
    return str(proc.last("summary") or proc.last("error") or proc.last("request_error"))


# --- our relay in a thread ---------------------------------------------------------------


class InprocRelay:
    """``serve_relay`` on 127.0.0.1:0 in a thread with its own asyncio loop."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.url = ""
        self.server: Any = None
        self.sessions: list[dict[str, Any]] = []
        """One entry per session set up: ALPN, the peer's MOQT_IMPLEMENTATION, our label."""
        self.closed: list[dict[str, Any]] = []
        """One entry per session that ended: code, reason, who ended it (LOCAL = us)."""
        self.errors: list[str] = []
        """Exceptions the relay's event loop caught (a bug of ours, whatever the peer did)."""
        self._ready = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="our-relay", daemon=True)

    def __enter__(self) -> InprocRelay:
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError(f"our relay did not start: {self.errors}")
        if not self.url:
            raise RuntimeError(f"our relay failed to start: {self.errors}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(10)

    def check(self) -> None:
        """No exception in the relay, and every session it set up spoke moqt-22."""
        assert not self.errors, f"our relay raised: {self.errors}"
        bad = [s for s in self.sessions if s["alpn"] != ALPN]
        assert not bad, f"sessions not on {ALPN}: {bad}"

    def implementations(self) -> list[str]:
        return [s["peer"] for s in self.sessions]

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by check()
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._ready.set()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        self.errors.append(f"{context.get('message')}: {exc!r}")

    async def _serve(self) -> None:
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        tls = self_signed(self.tmp / "our-relay-cert")
        # the default stack, qh3: aiomoqt's (picoquic) clients reach it after a Retry
        # (transports/quic/stack.py)
        async with asyncio_binding.serve_relay("127.0.0.1:0", tls=tls) as server:
            app = server.driver.endpoint.app
            handle = app.handle_session_event

            def spy(pump: Any, event: ev.SessionEvent, now: float) -> None:
                if isinstance(event, ev.SetupCompleted):
                    impl = event.peer_implementation
                    self.sessions.append(
                        {
                            "alpn": pump.alpn,
                            "peer": impl.decode(errors="replace") if impl else None,
                            "label": pump.label,
                        }
                    )
                elif isinstance(event, ev.SessionClosed):
                    self.closed.append(
                        {
                            "label": pump.label,
                            "code": int(event.code),
                            "reason": event.reason,
                            "by": event.initiator.name,
                        }
                    )
                handle(pump, event, now)

            app.handle_session_event = spy
            self.server = server
            self.url = server.url
            self._ready.set()
            while not self._stop:
                await asyncio.sleep(0.05)


# --- our client as plain MOQT ---------------------------------------------------------------


class Plain:
    """Our client session, driven request by request (see the module docstring)."""

    def __init__(self, app: ClientApp) -> None:
        self.client: MoqtClient = None  # type: ignore[assignment]  # set by plain()
        self.log: list[ev.SessionEvent] = []
        self.objects: dict[int, list[ev.ObjectReceived]] = {}
        self.payloads: dict[int, dict[tuple[int, int], bytes]] = {}
        self.stores: dict[FullTrackName, TrackStore] = {}
        self.announced: list[TrackNamespace] = []
        self.ended: set[FullTrackName] = set()
        self.served: dict[int, FullTrackName] = {}
        """Peer SUBSCRIBEs we accepted (Request ID -> track), still live."""
        self.peer_requests: list[ev.SessionEvent] = []
        app.watchers.append(self._on_event)

    @property
    def session(self) -> MoqtSession:
        return self.client.session

    # --- setup --------------------------------------------------------------------------

    @property
    def peer_implementation(self) -> str | None:
        setup = self.session.peer_setup
        impl = setup.moqt_implementation if setup is not None else None
        return impl.decode(errors="replace") if impl else None

    @property
    def alpn(self) -> str | None:
        return self.client.pump.alpn

    def now(self) -> float:
        return self.client.driver.now()

    def wake(self) -> None:
        self.client.driver.wake()

    # --- waiting --------------------------------------------------------------------------

    async def until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        try:
            await self.client.driver.wait_for(lambda: predicate() or self.client.closed, timeout)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None
        if not predicate():
            raise AssertionError(
                f"session closed ({self.client.pump.close_reason}) while waiting for {what}"
            )

    def first(self, kind: type[Any], **match: Any) -> Any:
        for e in self.log:
            if isinstance(e, kind) and all(getattr(e, k) == v for k, v in match.items()):
                return e
        return None

    def all(self, kind: type[Any], **match: Any) -> list[Any]:
        return [
            e
            for e in self.log
            if isinstance(e, kind) and all(getattr(e, k) == v for k, v in match.items())
        ]

    async def answer(self, rid: int, timeout: float = 10.0) -> Any:
        """The answer to our request ``rid``: *Accepted, or RequestFailed."""
        kinds = (ev.SubscribeAccepted, ev.FetchAccepted, ev.RequestAccepted, ev.RequestFailed)

        def got() -> Any:
            for e in self.log:
                if (
                    isinstance(e, kinds)
                    and e.request_id == rid
                    and getattr(e, "update_id", None) is None
                ):
                    return e
            return None

        await self.until(lambda: got() is not None, timeout, f"the answer to request {rid}")
        return got()

    async def accepted(self, rid: int, timeout: float = 10.0) -> Any:
        e = await self.answer(rid, timeout)
        assert not isinstance(e, ev.RequestFailed), (
            f"request {rid} refused: code {e.code:#x} {e.reason!r}"
        )
        return e

    async def publish_done(self, rid: int, timeout: float = 10.0) -> ev.PublishDoneReceived:
        await self.until(
            lambda: self.first(ev.PublishDoneReceived, request_id=rid) is not None,
            timeout,
            f"PUBLISH_DONE of request {rid}",
        )
        done: ev.PublishDoneReceived = self.first(ev.PublishDoneReceived, request_id=rid)
        return done

    async def all_objects(
        self, rid: int, wanted: Iterable[tuple[int, int]], timeout: float = 10.0
    ) -> dict[tuple[int, int], bytes]:
        want = set(wanted)
        await self.until(
            lambda: want <= set(self.payloads.get(rid, {})),
            timeout,
            f"objects {sorted(want - set(self.payloads.get(rid, {})))} of request {rid}",
        )
        return self.payloads[rid]

    # --- our requests ------------------------------------------------------------------

    def publish_namespace(self, ns: TrackNamespace) -> int:
        self.announced.append(ns)
        rid = self.session.publish_namespace(ns, now=self.now())
        self.wake()
        return rid

    def subscribe(self, track: FullTrackName, **kwargs: Any) -> int:
        rid = self.session.subscribe(track, now=self.now(), **kwargs)
        self.wake()
        return rid

    def fetch(self, track: FullTrackName, **kwargs: Any) -> int:
        rid = self.session.fetch(track, now=self.now(), **kwargs)
        self.wake()
        return rid

    def subscribe_namespace(self, prefix: TrackNamespace) -> int:
        rid = self.session.subscribe_namespace(prefix, now=self.now())
        self.wake()
        return rid

    def cancel(self, rid: int) -> None:
        self.session.cancel(rid, now=self.now())
        self.wake()

    # --- the tracks we publish ------------------------------------------------------------

    def add_track(self, track: FullTrackName) -> TrackStore:
        store = TrackStore(track)
        self.stores[track] = store
        return store

    def write_group(
        self, store: TrackStore, group: int, objects: int, size: int, seed: str = ""
    ) -> None:
        for o in range(objects):
            store.append(group, o, payload(group, o, size, seed))
        self.wake()

    def end_track(self, store: TrackStore) -> list[int]:
        """PUBLISH_DONE (TRACK_ENDED) on every live subscription to ``store``'s track, and
        on every later one right after its SUBSCRIBE_OK."""
        self.ended.add(store.name)
        ended = []
        for rid, track in list(self.served.items()):
            if track != store.name:
                continue
            del self.served[rid]
            rec = self.session.requests.get(rid)
            if rec is None or rec.state is not RequestState.ESTABLISHED:
                continue
            self.session.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=self.now())
            ended.append(rid)
        self.wake()
        return ended

    def subscribers(self, track: FullTrackName) -> list[int]:
        return [rid for rid, t in self.served.items() if t == track]

    # --- events -----------------------------------------------------------------------------

    def _on_event(self, pump: Any, e: ev.SessionEvent, now: float) -> None:
        if self.client is None or pump is not self.client.pump:
            return
        if isinstance(e, ev.ObjectReceived):
            self.objects.setdefault(e.request_id, []).append(e)
            if e.status is ObjectStatus.NORMAL:
                key = (e.location.group, e.location.object)
                self.payloads.setdefault(e.request_id, {})[key] = bytes(e.payload)
            self.log.append(e)
            return
        self.log.append(e)
        if self.session.is_closed:
            return
        s = self.session
        if isinstance(e, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
            self.peer_requests.append(e)
            store = self.stores.get(e.track)
            if store is None:
                code = RequestErrorCode.DOES_NOT_EXIST
                s.reject_request(e.request_id, code, "no such track", now=now)
            elif isinstance(e, ev.FetchRequested):
                s.accept_fetch(e.request_id, store, now=now)
            elif isinstance(e, ev.TrackStatusRequested):
                s.accept_track_status(e.request_id, store, now=now)
            else:
                s.accept_subscribe(e.request_id, store, now=now)
                if e.track in self.ended:  # late: the fill (if any), then PUBLISH_DONE
                    s.end_subscription(e.request_id, PublishDoneCode.TRACK_ENDED, now=now)
                else:
                    self.served[e.request_id] = e.track
        elif isinstance(e, ev.SubscribeNamespaceRequested):
            self.peer_requests.append(e)
            s.accept_request(e.request_id, now=now)
            for ns in self.announced:
                if e.prefix.is_prefix_of(ns):
                    s.send_namespace(e.request_id, ns.suffix_after(e.prefix), now=now)
        elif isinstance(e, ev.PublishNamespaceRequested):
            self.peer_requests.append(e)
            s.accept_request(e.request_id, now=now)
        elif isinstance(e, ev.PublishRequested | ev.SubscribeTracksRequested):
            self.peer_requests.append(e)
            s.reject_request(
                e.request_id, RequestErrorCode.NOT_SUPPORTED, "not in this test", now=now
            )
        elif isinstance(e, ev.RequestCancelled):
            self.served.pop(e.request_id, None)


@contextlib.asynccontextmanager
async def plain(url: str, timeout: float = 10.0) -> AsyncIterator[Plain]:
    """Our client session with the server at ``url`` (certificate not verified).

    ``asyncio_binding.connect`` spelled out, so that :class:`Plain` watches the session
    from its first event: a server may send requests right after SETUP (moq-rs does).
    """
    target = parse_url(url)
    app = ClientApp()
    me = Plain(app)
    endpoint = client_endpoint(stack="aioquic", app=app)
    async with asyncio_binding.open_endpoint(endpoint, "127.0.0.1", 0) as driver:
        addr = (target.host, target.port)
        me.client = open_session(driver, app, target, url, addr, TlsConfig(verify=False), None)
        try:
            await me.client.wait_ready(timeout)
            yield me
        finally:
            await me.client.close()


def namespace(*fields: str | bytes) -> TrackNamespace:
    return TrackNamespace.of(*fields)


def track(ns: TrackNamespace, name: str = "t") -> FullTrackName:
    return FullTrackName(ns, name.encode())


def run(coro: Any, timeout: float = 60.0) -> Any:
    """``asyncio.run`` with an overall bound."""

    async def bounded() -> Any:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())
