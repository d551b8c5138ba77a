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
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from kvcs_core.kvcs.consumer import (
    ConsumerConfig,
    ConsumerEvent,
    Destinations,
    IndexOptions,
    KvcsConsumer,
    LayerReady,
    RecomputeNeeded,
    RetrievalComplete,
    TrackSelection,
)
from kvcs_core.kvcs.cose import VerificationKey
from kvcs_core.kvcs.index import DEFAULT_MAX_INDEX_RECORDS
from kvcs_core.kvcs.protection import ObjectProtection
from kvcs_core.kvcs.publisher import RAW_KV, KvcsPublisher, ManifestSigner, TrackOffer
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.secobj import DEFAULT_SUITE, CipherSuite
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
        """The MOQT session (the current one, with a link), for plain MOQT use."""
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
        encrypt: bool = False,
        cipher_suite: CipherSuite | int = DEFAULT_SUITE,
        key_id: int = 0,
        index_stride: int = 1,
        max_index_records: int | None = DEFAULT_MAX_INDEX_RECORDS,
    ) -> CachePublication:
        """Create a publication and announce it on this session (PUBLISH_NAMESPACE); with
        a link (``connect(..., reconnect=...)``), again on every new session.

        Args:
            descriptor: the KVSP Compatibility Descriptor of the cache (a decoded JSON
                object, e.g. ``CacheFile.descriptor``).
            scope_key: the 32-octet scope key (your tenant's secret).
            tokens: the prompt's token IDs; the full blocks are published.
            publication_id: 16 octets naming this publication (default: random).
            signer: a :class:`~kvcs_core.kvcs.publisher.ManifestSigner` to publish a
                signed ``manifest.cose`` (default ``None``: an unsigned ``manifest``).
            offer: the data tracks to publish (default: ``k`` and ``v`` of codec
                ``raw``).
            deterministic: the cache is bit-identical whoever computes it, so
                consumers may mix it with other publications (default false).
            max_queued: object bytes the session may hold queued for subscribers
                before :meth:`CachePublication.put_layer` waits (default 32 MiB).
            encrypt: protect every Object, the manifest included, with MOQT Secure
                Objects keyed from ``scope_key`` (KVSP binding 8), so that relays
                can neither read nor alter them (default false).
            cipher_suite: the Secure Objects cipher suite when ``encrypt``
                (default ``CipherSuite.AES_128_GCM_SHA256_128``).
            key_id: the Key ID when ``encrypt`` (default 0; a new one rotates keys).
            index_stride: announce KVSP index records (binding 9) for every
                ``index_stride``-th prefix length and the last block (default 1:
                every block; 0: no index), signed like the manifest; doubled until
                at most ``max_index_records`` records remain.
            max_index_records: the most index records to announce (default 512:
                each is a request a relay counts against its 1024 per session;
                None: no bound).

        Returns:
            The :class:`CachePublication`; publish each layer with ``put_layer``.

        Raises:
            ConnectError: the session is closed (and no reconnection is under way).
            ValueError: an invalid descriptor, scope key, token, publication ID,
                offer, cipher suite or Key ID.
        """
        self._require_open()
        protection = ObjectProtection(cipher_suite, key_id) if encrypt else None
        pub = KvcsPublisher(
            descriptor,
            scope_key,
            tokens,
            publication_id or os.urandom(16),
            offer=offer,
            signer=signer,
            deterministic=deterministic,
            protection=protection,
            index_stride=index_stride,
            max_index_records=max_index_records,
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
        destinations: Destinations | None = None,
        producer_keys: Mapping[bytes, VerificationKey] | None = None,
        require_authenticity: bool = True,
        tracks: TrackSelection | None = None,
        recovery_time_bound: float = 2.0,
        layers: range | None = None,
        prefix_lengths: Sequence[int] | None = None,
        config: ConsumerConfig | None = None,
        require_encryption: bool = False,
        cipher_suite: CipherSuite | int = DEFAULT_SUITE,
        key_ids: Collection[int] | None = None,
        index: IndexOptions | None = IndexOptions(),  # noqa: B008 - frozen
    ) -> CacheRetrieval:
        """Start retrieving the KV cache of ``tokens`` on this session (and the ``also``
        sessions): discovery, live or completed retrieval, verification, recovery.

        The retrieval runs in the background of the event loop; iterate over the
        returned :class:`CacheRetrieval` for each layer as it becomes usable, or await
        :meth:`CacheRetrieval.result`.

        Args:
            descriptor: the KVSP Compatibility Descriptor (a decoded JSON object,
                e.g. ``CacheFile.descriptor``).
            scope_key: the 32-octet scope key the cache was published under.
            tokens: the prompt's token IDs; its full blocks are what can be reused.
            also: more connected clients (e.g. other relays) to retrieve from at the
                same time; missing Objects are recovered from them (default: none).
            destinations: where verified Data goes: a callable ``(layer, component) ->
                buffer`` or a mapping ``{(layer, component): buffer}`` (e.g.
                ``KvDestination.buffer``); default ``None``: verified views of the
                payloads are kept (``retrieval.consumer.data``).
            producer_keys: trusted producer verification keys by key ID (``kid``);
                default ``None``.
            require_authenticity: count an Object only once a manifest signed with
                one of ``producer_keys`` lists its digest (default true, which needs
                ``producer_keys``; pass ``False`` for unsigned publications).
            tracks: the data tracks to retrieve (a
                :class:`~kvcs_core.kvcs.consumer.TrackSelection`; default: ``k`` and
                ``v`` of codec ``raw``).
            recovery_time_bound: seconds to try to recover missing Objects before
                reporting them as needing recomputation (default 2).
            layers: the layers needed (default: every layer of the descriptor).
            prefix_lengths: prefix lengths in blocks to discover, longest first
                (default: the consumer's choice, longest first).
            config: the consumer's bounds and policies
                (:class:`~kvcs_core.kvcs.consumer.ConsumerConfig`; default: its
                defaults).
            require_encryption: refuse Objects and manifests that are not protected
                with Secure Objects (default false: protected ones are decrypted,
                unprotected ones used as they are).
            cipher_suite: the Secure Objects cipher suite of protected publications
                (default ``CipherSuite.AES_128_GCM_SHA256_128``; not carried on the
                wire).
            key_ids: accept only these Key IDs (default ``None``: any, each key
                derived from ``scope_key``).
            index: the KVSP index search (binding 9) used when the whole prompt is
                not published: :class:`~kvcs_core.kvcs.consumer.IndexOptions`
                (default: stride 1, 0.3 s per lookup); ``None``: direct discovery
                only. ``retrieval.consumer.index_lookups`` and
                ``index_shared_blocks`` report what it did.

        Returns:
            The running :class:`CacheRetrieval`.

        Raises:
            ConnectError: this session or one of ``also`` is closed.
            ValueError: an invalid descriptor, scope key, token, layer range, prefix
                length or destination; a prompt without a full block;
                ``require_authenticity`` without ``producer_keys``.
        """
        for c in (self, *also):
            if not c.connected:
                raise ConnectError(f"connection to {c.target} closed: {_closed_reason(c.pump)}")
        consumer = KvcsConsumer(
            descriptor,
            scope_key,
            tokens,
            producer_keys=producer_keys,
            require_authenticity=require_authenticity,
            tracks=tracks,
            recovery_time_bound=recovery_time_bound,
            destinations=destinations,
            layers=layers,
            prefix_lengths=prefix_lengths,
            config=config or ConsumerConfig(),
            require_encryption=require_encryption,
            cipher_suite=cipher_suite,
            key_ids=key_ids,
            index=index,
        )
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
        return CacheRetrieval(self.driver, handle, tuple(c.app for c in clients))

    async def discover(
        self,
        prefix: TrackNamespace,
        *,
        quiet: float = 0.3,
        timeout: float = 5.0,
        first: bool = False,
    ) -> list[TrackNamespace]:
        """SUBSCRIBE_NAMESPACE ``prefix``; the namespaces announced until ``quiet`` s pass
        (with ``first``: as soon as one is announced, for "is there any?" questions).

        Raises:
            ConnectError: the request was refused, not answered within ``timeout`` s, or
                the connection closed before the listing was over (an answered request
                whose session then closes is not a complete listing).
        """
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
                    or (first and bool(found))
                )

            while not settled():
                wait = min(quiet, max(0.0, deadline - self.driver.now()))
                with contextlib.suppress(TimeoutError):
                    await self.driver.wait_for(settled, wait)
            if first and found:
                return found
            if state["failed"] is not None:
                e = state["failed"]
                raise ConnectError(f"SUBSCRIBE_NAMESPACE refused: {e.reason} (code {e.code})")
            if self.closed:  # answered or not, the listing was cut short: never a success
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
        """Publish one layer, first waiting while too much is queued for subscribers.

        Args:
            layer: the layer number; layers go in order 0, 1, ... per segment.
            k_blocks: the K section of each full block of the segment (buffers, e.g.
                ``layer_sections(...).k``), held by reference until sent.
            v_blocks: the V sections, likewise.
            segment: the segment the blocks belong to (default 0).
            timeout: seconds to wait for the queue to drain (default ``None``: no
                bound; ``TimeoutError`` when it passes).

        Raises:
            ConnectError: the session is gone.
            PublisherError: the layer is out of order, the sections do not match the
                descriptor, or the publication is finished
                (:class:`~kvcs_core.kvcs.publisher.PublisherError` and subclasses).
            TimeoutError: ``timeout`` passed.
        """
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

    async def withdraw(self) -> None:
        """Stop offering the publication: withdraw its namespace and index namespaces
        (PUBLISH_NAMESPACE cancelled), serve no further requests for it, and drop the
        client's references to it (it is not announced again on a new session), so
        that its sections can be freed. Relays may still answer from their caches."""
        client = self.client
        pub = self.publisher
        if client.connected:
            pub.withdraw(now=client.driver.now())
        else:  # nothing to cancel on a closed session; forget the attachments
            with contextlib.suppress(Exception):
                pub.withdraw(now=client.driver.now())
        if pub in client.publications:
            client.publications.remove(pub)
        client.app.publishers[:] = [(p, s) for p, s in client.app.publishers if p is not pub]
        client.driver.wake()

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

    def __init__(
        self, driver: Driver, handle: ConsumerHandle, apps: Sequence[ClientApp] = ()
    ) -> None:
        self.driver = driver
        self.handle = handle
        self._apps = tuple(apps)
        self.ready: list[int] = []
        self.recompute: list[RecomputeNeeded] = []
        self.complete: RetrievalComplete | None = None

    @property
    def consumer(self) -> KvcsConsumer:
        """The pure consumer machine (its events, state and kept data)."""
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

    def forget(self) -> None:
        """Drop the clients' references to this retrieval (its consumer machine and the
        destinations it writes into), so that a long-lived client that retrieves many
        caches does not keep every one. Call it once the retrieval is over (``result()``
        returned); a retrieval still running gets no further events after it."""
        for app in self._apps:
            if self.handle in app.consumers:
                app.consumers.remove(self.handle)

    async def result(
        self, timeout: float | None = None, *, strict: bool = True
    ) -> RetrievalComplete:
        """Wait for the end of the retrieval and return its outcome.

        Args:
            timeout: seconds to wait (default ``None``: no bound).
            strict: raise unless every needed Object arrived (default true).

        Raises:
            RetrievalFailed: with ``strict``, the retrieval ended incomplete (no
                publication found, or objects missing: ``recompute`` says which).
            TimeoutError: ``timeout`` passed.
        """

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
        """The relay's ``moqt://host:port`` URL."""
        host, port = self.address
        return f"moqt://{host}:{port}"

    @property
    def connections(self) -> int:
        """The number of QUIC connections it holds now."""
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
    token: bytes | None = None,
) -> MoqtClient:
    """Start a client connection on ``driver``'s endpoint; the session follows the handshake.

    ``reconnect``: open the connection again with this backoff whenever it is lost once
    its session was set up (:mod:`.reconnect`; each attempt has ``connect_timeout`` s).
    ``token``: a CAT sent in every CLIENT_SETUP of the connection (README "Authorization").
    """
    endpoint = driver.endpoint

    def open_one(now: float) -> SessionPump:
        return endpoint.connect(
            addr,
            now,
            configuration=client_configuration(
                endpoint, target, tls, max_datagram_size, idle_timeout=idle_timeout
            ),
            session_config=client_session_config(target, token),
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
