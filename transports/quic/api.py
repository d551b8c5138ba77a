"""The async API shared by the asyncio and trio bindings.

Theory of operation
-------------------
Everything here is written against :class:`Driver`: a clock, a way to ask for
a :meth:`~.endpoint.QuicEndpoint.service` soon (``wake``), and an awaitable
``wait_for(predicate, timeout)`` that re-checks ``predicate`` after every
service of the endpoint. :mod:`.asyncio_binding` and :mod:`.trio_binding`
each provide one; the classes below are therefore the same API on both loops.

* :class:`MoqtClient`: one client connection and its session; the raw session
  stays reachable (``client.session``) for plain MOQT use.
* :class:`CachePublication`: a :class:`~kvcs_core.kvcs.publisher.KvcsPublisher`
  attached to the session. :meth:`CachePublication.put_layer` waits while the
  session has more than ``max_queued`` object bytes queued for its
  subscribers, so a producer that outruns QUIC is paced by it instead of the
  queue limit ending a subscriber.
* :class:`CacheRetrieval`: a :class:`~kvcs_core.kvcs.consumer.KvcsConsumer`
  on one or more sessions; ``async for layer in retrieval`` yields each layer
  as it becomes usable, :meth:`CacheRetrieval.result` the final outcome.

Nothing is buffered here: publishers hold the caller's section buffers by
reference, consumers write into the caller's destinations.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from kvcs_core.kvcs.consumer import (
    ConsumerConfig,
    ConsumerEvent,
    KvcsConsumer,
    LayerReady,
    RecomputeNeeded,
    RetrievalComplete,
)
from kvcs_core.kvcs.publisher import RAW_KV, KvcsPublisher, ManifestSigner, TrackOffer
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.wire.codes import SessionErrorCode
from kvcs_core.wire.names import TrackNamespace

from ._setup import client_configuration, client_session_config
from .apps import ClientApp, ConsumerHandle
from .config import DEFAULT_IDLE_TIMEOUT, MoqtUrl
from .endpoint import QuicEndpoint
from .pump import SessionPump
from .reconnect import Backoff, Link
from .tls import TlsConfig

log = logging.getLogger("kvcs.quic")

DEFAULT_MAX_QUEUED = 32 * 1024 * 1024
"""Object bytes a publication lets its sessions queue before ``put_layer`` waits."""


class ConnectError(ConnectionError):
    """The connection or the MOQT setup failed; the message says why in one line."""


class RetrievalFailed(RuntimeError):
    """A retrieval ended without every needed Object (see ``events`` for the detail)."""

    def __init__(
        self, message: str, result: RetrievalComplete | None, recompute: tuple[RecomputeNeeded, ...]
    ) -> None:
        super().__init__(message)
        self.result = result
        self.recompute = recompute


class Driver(Protocol):
    """What an event-loop binding offers the API (see :mod:`.asyncio_binding`)."""

    endpoint: QuicEndpoint

    def now(self) -> float: ...

    def wake(self) -> None: ...

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> None: ...


def _closed_reason(pump: SessionPump) -> str:
    return pump.close_reason or "connection closed"


class MoqtClient:
    """One client connection carrying one MOQT session.

    With a :class:`~.reconnect.Link` (``connect(..., reconnect=Backoff())``) the
    connection is opened again when it is lost: :attr:`pump` and :attr:`session`
    are then always the current ones, the publications made here are announced
    and served again on each new session, and :attr:`closed` is true only once
    the link gave up (or :meth:`close` was called).
    """

    def __init__(
        self,
        driver: Driver,
        pump: SessionPump,
        app: ClientApp,
        target: str,
        link: Link | None = None,
    ) -> None:
        self.driver = driver
        self._pump = pump
        self.app = app
        self.target = target
        self.link = link
        self.publications: list[KvcsPublisher] = []
        self._closing = False

    @property
    def pump(self) -> SessionPump:
        """The connection (the current one, with a link)."""
        return self.link.pump if self.link is not None else self._pump

    @property
    def session(self) -> MoqtSession:
        return self.pump.session

    @property
    def connected(self) -> bool:
        """The current session is set up and open."""
        pump = self.pump
        return pump.session.setup_complete and not pump.terminated and not pump.session.is_closed

    @property
    def closed(self) -> bool:
        """Over for good: the session ended (with a link: the link gave up or was stopped)."""
        if self.link is not None and self.link.active and not self._closing:
            return False
        return self.pump.terminated or self.session.is_closed

    async def wait_ready(self, timeout: float) -> None:
        """Wait for the QUIC handshake and both SETUPs; :class:`ConnectError` otherwise
        (also when the session was closed right after SETUP, with the peer's reason)."""
        pump = self.pump

        def settled() -> bool:
            return pump.session.setup_complete or pump.terminated or pump.session.is_closed

        try:
            await self.driver.wait_for(settled, timeout)
        except TimeoutError:
            raise ConnectError(
                f"no MOQT session with {self.target} within {timeout:g} s "
                "(unreachable, or not a moqt-22 server)"
            ) from None
        if not pump.session.setup_complete or pump.terminated or pump.session.is_closed:
            raise ConnectError(f"connection to {self.target} failed: {_closed_reason(pump)}")

    def _require_open(self) -> None:
        if not self.connected and (self.link is None or not self.link.active):
            raise ConnectError(f"connection to {self.target} closed: {_closed_reason(self.pump)}")

    def _restore(self, pump: SessionPump, now: float) -> None:
        """A new session of the link is set up: announce every publication on it again
        (each re-serves its tracks from its stores)."""
        self.app.publishers[:] = [(p, s) for p, s in self.app.publishers if not s.is_closed]
        for pub in self.publications:
            try:
                pub.attach(pump.session, now=now)
            except Exception as exc:  # the new session is unusable: the link tries again
                log.warning("%s: publication not restored: %s", pump.label, exc)
                continue
            self.app.publishers.append((pub, pump.session))

    async def publish_cache(
        self,
        descriptor: Mapping[str, Any],
        scope_key: bytes,
        tokens: Sequence[int],
        *,
        publication_id: bytes | None = None,
        signer: ManifestSigner | None = None,
        offer: Sequence[TrackOffer] = RAW_KV,
        deterministic: bool = False,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> CachePublication:
        """Create a publication and announce it on this session (PUBLISH_NAMESPACE); with
        a link, again on every new session."""
        self._require_open()
        pub = KvcsPublisher(
            descriptor,
            scope_key,
            tokens,
            publication_id or os.urandom(16),
            offer=offer,
            signer=signer,
            deterministic=deterministic,
        )
        self.publications.append(pub)
        if self.connected:
            self.app.publishers.append((pub, self.session))
            pub.attach(self.session, now=self.driver.now())
        self.driver.wake()
        return CachePublication(self, pub, max_queued)

    def retrieve_cache(
        self,
        descriptor: Mapping[str, Any],
        scope_key: bytes,
        tokens: Sequence[int],
        *,
        also: Sequence[MoqtClient] = (),
        **kwargs: Any,
    ) -> CacheRetrieval:
        """Start a consumer for ``tokens`` on this session (and the ``also`` sessions).

        ``kwargs`` go to :class:`~kvcs_core.kvcs.consumer.KvcsConsumer` (destinations,
        producer_keys, require_authenticity, layers, config, ...).
        """
        for c in (self, *also):
            if not c.connected:
                raise ConnectError(f"connection to {c.target} closed: {_closed_reason(c.pump)}")
        kwargs.setdefault("config", ConsumerConfig())
        consumer = KvcsConsumer(descriptor, scope_key, tokens, **kwargs)
        clients = (self, *also)
        handle = ConsumerHandle(consumer, tuple(c.session for c in clients))
        self.app.consumers.append(handle)
        now = self.driver.now()
        for c in clients:
            if c.app is not self.app:
                c.app.consumers.append(handle)
            consumer.attach(c.session, now=now)
        handle.drain()
        self.driver.wake()
        return CacheRetrieval(self.driver, handle)

    async def discover(
        self, prefix: TrackNamespace, *, quiet: float = 0.3, timeout: float = 5.0
    ) -> list[TrackNamespace]:
        """SUBSCRIBE_NAMESPACE ``prefix``; the namespaces announced until ``quiet`` s pass."""
        found: list[TrackNamespace] = []
        state: dict[str, Any] = {"rid": None, "answered": False, "failed": None}
        last = [self.driver.now()]

        def watch(pump: SessionPump, e: ev.SessionEvent, now: float) -> None:
            if pump is not self.pump:
                return
            rid = state["rid"]
            if isinstance(e, ev.NamespaceAnnounced) and e.request_id == rid:
                found.append(e.namespace)
                last[0] = now
            elif isinstance(e, ev.RequestAccepted) and e.request_id == rid:
                state["answered"] = True
                last[0] = now
            elif isinstance(e, ev.RequestFailed) and e.request_id == rid:
                state["failed"] = e

        if not self.connected:
            raise ConnectError(f"connection to {self.target} closed: {_closed_reason(self.pump)}")
        self.app.watchers.append(watch)
        try:
            try:
                state["rid"] = self.session.subscribe_namespace(prefix, now=self.driver.now())
            except LocalProtocolError as exc:  # closed in the meantime
                raise ConnectError(f"connection to {self.target} closed: {exc}") from None
            self.driver.wake()
            deadline = self.driver.now() + timeout

            def settled() -> bool:
                now = self.driver.now()
                return (
                    state["failed"] is not None
                    or self.closed
                    or now >= deadline
                    or (state["answered"] and now - last[0] >= quiet)
                )

            while not settled():
                wait = min(quiet, max(0.0, deadline - self.driver.now()))
                with contextlib.suppress(TimeoutError):
                    await self.driver.wait_for(settled, wait)
            if state["failed"] is not None:
                e = state["failed"]
                raise ConnectError(f"SUBSCRIBE_NAMESPACE refused: {e.reason} (code {e.code})")
            if not state["answered"] and self.closed:
                raise ConnectError(f"connection closed: {_closed_reason(self.pump)}")
            if not state["answered"]:
                raise ConnectError(f"no answer to SUBSCRIBE_NAMESPACE within {timeout:g} s")
        finally:
            self.app.watchers.remove(watch)
            if state["rid"] is not None and not self.closed:
                with contextlib.suppress(LocalProtocolError):  # already finished
                    self.session.cancel(state["rid"], now=self.driver.now())
                self.driver.wake()
        return found

    async def close(self, timeout: float = 2.0) -> None:
        """Close the session (NO_ERROR) and wait briefly for the connection to end."""
        self._closing = True
        if self.link is not None:
            self.link.stop()
        if not self.closed:
            self.pump.close(SessionErrorCode.NO_ERROR, "bye", self.driver.now())
            self.driver.wake()
        with contextlib.suppress(TimeoutError):
            await self.driver.wait_for(lambda: self.pump.terminated, timeout)


class CachePublication:
    """A KV cache published layer by layer on one session."""

    def __init__(self, client: MoqtClient, publisher: KvcsPublisher, max_queued: int) -> None:
        self.client = client
        self.publisher = publisher
        self.max_queued = max_queued

    async def put_layer(
        self,
        layer: int,
        k_blocks: Sequence[Any],
        v_blocks: Sequence[Any],
        *,
        segment: int = 0,
        timeout: float | None = None,
    ) -> None:
        """Publish one layer, first waiting while too much is queued for subscribers."""
        client = self.client
        await client.driver.wait_for(
            lambda: client.session.queued_bytes <= self.max_queued or not client.connected,
            timeout,
        )
        if self.client.closed:
            raise ConnectError(f"publication lost its session: {_closed_reason(self.client.pump)}")
        self.publisher.put_layer(
            layer, k_blocks, v_blocks, segment=segment, now=self.client.driver.now()
        )
        self.client.driver.wake()

    async def finish(self) -> None:
        """End the manifest track once every segment is complete."""
        self.publisher.finish(now=self.client.driver.now())
        self.client.driver.wake()

    async def drained(self, timeout: float | None = None) -> None:
        """Wait until nothing is queued for subscribers and QUIC has sent what it was given
        (or the session is gone: nothing can be sent then)."""
        client = self.client
        await client.driver.wait_for(
            lambda: (
                not client.connected
                or (client.session.queued_bytes == 0 and client.pump.unsent_bytes() == 0)
            ),
            timeout,
        )


class CacheRetrieval:
    """A running consumer: iterate over usable layers, then take the result."""

    def __init__(self, driver: Driver, handle: ConsumerHandle) -> None:
        self.driver = driver
        self.handle = handle
        self.ready: list[int] = []
        self.recompute: list[RecomputeNeeded] = []
        self.complete: RetrievalComplete | None = None

    @property
    def consumer(self) -> KvcsConsumer:
        return self.handle.consumer

    @property
    def events(self) -> list[ConsumerEvent]:
        """Every event the consumer emitted so far, in order."""
        return self.handle.history

    def _take(self) -> list[ConsumerEvent]:
        taken = list(self.handle.events)
        self.handle.events.clear()
        for e in taken:
            if isinstance(e, LayerReady):
                self.ready.append(e.layer)
            elif isinstance(e, RecomputeNeeded):
                self.recompute.append(e)
            elif isinstance(e, RetrievalComplete):
                self.complete = e
        return taken

    async def __aiter__(self) -> AsyncIterator[int]:
        """Each layer number as soon as it is usable, until the retrieval ends."""
        seen = 0
        while True:
            self._take()
            while seen < len(self.ready):
                seen += 1
                yield self.ready[seen - 1]
            if self.complete is not None:
                return
            await self.driver.wait_for(lambda: bool(self.handle.events), None)

    async def layers(self, timeout: float | None = None) -> AsyncIterator[int]:
        """As ``async for``, but the whole iteration ends by ``timeout`` seconds from now
        (``TimeoutError``)."""
        deadline = None if timeout is None else self.driver.now() + timeout
        seen = 0
        while True:
            self._take()
            while seen < len(self.ready):
                seen += 1
                yield self.ready[seen - 1]
            if self.complete is not None:
                return
            left = None if deadline is None else deadline - self.driver.now()
            if left is not None and left <= 0:
                raise TimeoutError
            await self.driver.wait_for(lambda: bool(self.handle.events), left)

    async def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Wait until ``layer`` is usable; :class:`RetrievalFailed` if it never will be."""

        def settled() -> bool:
            self._take()
            return layer in self.ready or self.complete is not None

        await self.driver.wait_for(settled, timeout)
        if layer not in self.ready:
            raise RetrievalFailed(
                f"layer {layer} will not arrive", self.complete, tuple(self.recompute)
            )

    async def result(
        self, timeout: float | None = None, *, strict: bool = True
    ) -> RetrievalComplete:
        """Wait for the end; with ``strict``, :class:`RetrievalFailed` unless complete."""

        def settled() -> bool:
            self._take()
            return self.complete is not None

        await self.driver.wait_for(settled, timeout)
        assert self.complete is not None
        if strict and not self.complete.complete:
            what = (
                "no publication found"
                if self.complete.publication_id is None
                else "objects missing; recomputation needed"
            )
            raise RetrievalFailed(what, self.complete, tuple(self.recompute))
        return self.complete


class RelayServer:
    """A relay listening on a UDP address (and, in a tree, connected to a parent)."""

    def __init__(
        self, driver: Driver, address: tuple[str, int], upstream: MoqtClient | None
    ) -> None:
        self.driver = driver
        self.address = address
        self.upstream = upstream

    @property
    def relay(self) -> Any:
        """The :class:`~kvcs_core.relay.relay.Relay` serving every connection."""
        return self.driver.endpoint.app.relay  # type: ignore[attr-defined]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"moqt://{host}:{port}"

    @property
    def connections(self) -> int:
        return len(self.driver.endpoint.pumps)


def open_session(
    driver: Driver,
    app: ClientApp,
    target: MoqtUrl,
    url: str,
    addr: Any,
    tls: TlsConfig | None,
    max_datagram_size: int | None,
    *,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    reconnect: Backoff | None = None,
    connect_timeout: float = 10.0,
    rand: Callable[[], float] = random.random,
) -> MoqtClient:
    """Start a client connection on ``driver``'s endpoint; the session follows the handshake.

    ``reconnect``: open the connection again with this backoff whenever it is lost once
    its session was set up (:mod:`.reconnect`; each attempt has ``connect_timeout`` s).
    """
    endpoint = driver.endpoint

    def open_one(now: float) -> SessionPump:
        return endpoint.connect(
            addr,
            now,
            configuration=client_configuration(
                endpoint, target, tls, max_datagram_size, idle_timeout=idle_timeout
            ),
            session_config=client_session_config(target),
            webtransport=(target.authority, target.path or "/") if target.webtransport else None,
        )

    pump = open_one(driver.now())
    driver.wake()
    if reconnect is None:
        return MoqtClient(driver, pump, app, url)
    client = MoqtClient(driver, pump, app, url)
    client.link = Link(
        endpoint,
        pump,
        open_one,
        backoff=reconnect,
        rand=rand,
        connect_timeout=connect_timeout,
        target=url,
        on_session=client._restore,
    )
    return client
