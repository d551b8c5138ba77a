"""kvcs over QUIC on trio: relay servers and clients (aioquic or qh3).

Theory of operation
-------------------
The same sans-I/O endpoint as the asyncio binding (:mod:`.endpoint`), driven by
two trio tasks in a nursery: a *reader* that waits until the UDP socket is
readable (``trio.lowlevel.wait_readable``), drains it into the endpoint and
services it; and a *ticker* that sleeps until :meth:`~.endpoint.QuicEndpoint.get_timer`
or until :meth:`TrioDriver.wake` is called (after the application commanded
something), then fires timers and services. Each service's datagrams go to
the socket in one ``send_batch`` (GSO runs, :mod:`.udp`). A send that would block waits
for writability in the reader loop's stead (``wait_writable``). After each
service every ``wait_for`` re-checks its predicate. The clock is
``trio.current_time()``.

Entry points mirror :mod:`.asyncio_binding`: ``serve_relay(...)`` and
``connect(url, ...)``, async context managers returning the objects of
:mod:`.api`. Every nursery here is wrapped in :func:`.groups.single_errors`,
so callers get one typed error (``ConnectError``, ``KeyboardInterrupt``, ...)
with strict exception groups (trio 0.25 and later) and without.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from kvcs_core.relay.config import RelayConfig

from ._entry import client_session, relay_server
from .api import ConnectError, MoqtClient, RelayServer
from .config import DEFAULT_IDLE_TIMEOUT
from .endpoint import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_ADDRESS, QuicEndpoint
from .groups import single_errors
from .pquic_binding import TRIO_REFUSED
from .reconnect import DEFAULT_BACKOFF, Backoff
from .stack import DEFAULT_STACK, StackUnavailable
from .tls import TlsConfig
from .udp import UdpSocket, open_udp

log = logging.getLogger("kvcs.quic")

__all__ = [
    "ConnectError",
    "MoqtClient",
    "RelayServer",
    "TrioDriver",
    "connect",
    "gather",
    "open_endpoint",
    "serve_relay",
    "sleep",
]


class TrioDriver:
    """Drives one endpoint on one UDP socket inside a trio nursery."""

    def __init__(self, endpoint: QuicEndpoint, udp: UdpSocket) -> None:
        self.endpoint = endpoint
        self.udp = udp
        endpoint.clock = self.now  # read during service (endpoint docstring)
        self._wakeup = trio.Event()
        self._changed = trio.Event()
        self._closed = False

    def now(self) -> float:
        now: float = trio.current_time()
        return now

    def wake(self) -> None:
        self._wakeup.set()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> None:
        deadline = math.inf if timeout is None else self.now() + timeout
        while not predicate():
            if self._closed:
                raise ConnectError("the endpoint is closed")
            if self.now() >= deadline:
                raise TimeoutError
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with single_errors():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader)
                nursery.start_soon(self._ticker)
                task_status.started()

    async def aclose(self, timeout: float = 1.0) -> None:
        if self._closed:
            return
        self.endpoint.close(self.now())
        self.wake()
        with contextlib.suppress(TimeoutError, ConnectError):
            await self.wait_for(lambda: self.endpoint.idle, timeout)
        self.endpoint.flush_qlog()  # connections still closing leave their qlog too
        self._closed = True
        self._changed.set()

    # --- tasks ---------------------------------------------------------------------------

    async def _reader(self) -> None:
        while not self._closed:
            await trio.lowlevel.wait_readable(self.udp.sock)
            try:
                self.endpoint.receive_datagrams(self.udp.recv_batch(), self.now())
            except Exception as exc:  # isolated per connection by the endpoint; never here
                log.warning("endpoint input failed: %r", exc)
            await self._service(poke_ticker=True)

    async def _ticker(self) -> None:
        while not self._closed:
            deadline = self.endpoint.get_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            now = self.now()
            if deadline is not None and deadline <= now:
                try:
                    self.endpoint.handle_timer(now)
                except Exception as exc:
                    log.warning("endpoint timer failed: %r", exc)
            await self._service(poke_ticker=False)

    async def _service(self, *, poke_ticker: bool) -> None:
        if self._closed:
            return
        try:
            out = self.endpoint.service(self.now())
        except Exception as exc:
            log.warning("endpoint service failed: %r", exc)
            out = []
        while self.udp.send_batch(out):
            out = []
            await trio.lowlevel.wait_writable(self.udp.sock)
        changed, self._changed = self._changed, trio.Event()
        changed.set()
        if poke_ticker:
            self._wakeup.set()  # the timer may have moved: let the ticker look again


@contextlib.asynccontextmanager
async def open_endpoint(endpoint: QuicEndpoint, host: str, port: int) -> AsyncIterator[TrioDriver]:
    """Bind ``host:port`` and drive ``endpoint`` there until the block ends."""
    if endpoint.stack.name == "pquic":
        raise StackUnavailable(TRIO_REFUSED)
    udp = open_udp(host, port)
    driver = TrioDriver(endpoint, udp)
    try:
        with single_errors():  # one typed error whatever the trio version (.groups)
            async with trio.open_nursery() as nursery:
                await nursery.start(driver.run)
                try:
                    yield driver
                finally:
                    await driver.aclose()
                    nursery.cancel_scope.cancel()
    finally:
        udp.close()


def serve_relay(
    listen: str = "127.0.0.1:4443",
    *,
    tls: TlsConfig,
    stack: str = DEFAULT_STACK,
    relay_config: RelayConfig | None = None,
    upstream: str | None = None,
    upstream_tls: TlsConfig | None = None,
    max_datagram_size: int | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_address: int = DEFAULT_MAX_PER_ADDRESS,
    timeout: float = 10.0,
    webtransport: bool = True,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    upstream_reconnect: Backoff | None = DEFAULT_BACKOFF,
    qlog_dir: str | os.PathLike[str] | None = None,
    upstream_token: bytes | str | None = None,
) -> AbstractAsyncContextManager[RelayServer]:
    """A caching MOQT relay on trio, as an async context manager.

    ``async with serve_relay("127.0.0.1:0", tls=self_signed(d)) as relay:`` serves
    until the block ends; ``relay.url`` is its ``moqt://`` URL (port 0: the OS chose).

    Args:
        listen: ``host:port`` to bind (default ``127.0.0.1:4443``; port 0 lets the
            OS choose, see :attr:`~.api.RelayServer.address`).
        tls: the server's certificate and key (required; :func:`~.tls.self_signed`
            makes a local pair).
        stack: the QUIC implementation: ``"qh3"`` (the default) or ``"aioquic"``
            (``"pquic"`` runs on asyncio only: refused with :class:`~.stack.StackUnavailable`).
        relay_config: the relay core's bounds and policies
            (:class:`~kvcs_core.relay.config.RelayConfig`; default: its defaults).
        upstream: a parent relay's URL (``moqt://`` or ``https://``), for trees;
            default ``None``: no parent.
        upstream_tls: trust for the upstream connection (default: the system's).
        max_datagram_size: the largest UDP payload QUIC sends, in octets
            (default: the stack's).
        max_connections: connections held at once (default 256); a handshake
            over it is refused at once with CONNECTION_REFUSED.
        max_connections_per_address: connections one IP address may hold
            (default 32), refused the same way.
        timeout: seconds for the upstream session's setup, and for each attempt
            to reopen it (default 10).
        webtransport: also accept WebTransport (``https://host:port/...``) on the
            same UDP port (default true).
        idle_timeout: QUIC's idle timeout of every connection, in seconds
            (default 30; quiet peers are PINGed, so only dead ones reach it).
        upstream_reconnect: the :class:`~.reconnect.Backoff` with which a lost
            upstream session is reopened (default: 0.5 s doubling to 30 s,
            forever); ``None``: never.
        qlog_dir: a directory where each QUIC connection, the upstream link's
            included, writes a qlog file (JSON) through the stack's own logger when
            it ends (:mod:`.qlog`; aioquic and qh3); default ``None``: no qlog.
        upstream_token: a CAT (octets, or its base64url text) this relay presents in
            its CLIENT_SETUP to ``upstream`` (README "Authorization"); default
            ``None``: none. To *enforce* tokens, give ``relay_config`` an
            :class:`~kvcs_core.auth.policy.Authorizer`.

    Returns:
        An async context manager yielding the :class:`~.api.RelayServer`.

    Raises:
        TlsError: ``tls`` names a missing or unusable certificate or key.
        StackUnavailable: ``stack`` is unknown, not installed, or ``pquic``.
        UrlError: ``upstream`` is not a ``moqt://`` or ``https://`` URL.
        ConnectError: the upstream session could not be set up.
        OSError: ``listen`` cannot be bound (address in use, ...).
        ValueError: an invalid ``listen`` or ``idle_timeout``.
    """
    return relay_server(
        open_endpoint,
        _resolve,
        listen,
        tls=tls,
        stack=stack,
        relay_config=relay_config,
        upstream=upstream,
        upstream_tls=upstream_tls,
        max_datagram_size=max_datagram_size,
        max_connections=max_connections,
        max_connections_per_address=max_connections_per_address,
        timeout=timeout,
        webtransport=webtransport,
        idle_timeout=idle_timeout,
        upstream_reconnect=upstream_reconnect,
        qlog_dir=qlog_dir,
        upstream_token=upstream_token,
    )


def connect(
    url: str,
    *,
    tls: TlsConfig | None = None,
    stack: str = DEFAULT_STACK,
    timeout: float = 10.0,
    max_datagram_size: int | None = None,
    via: MoqtClient | None = None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    reconnect: Backoff | None = None,
    bind: str | None = None,
    qlog_dir: str | os.PathLike[str] | None = None,
    token: bytes | str | None = None,
) -> AbstractAsyncContextManager[MoqtClient]:
    """A MOQT session with a server on trio, as an async context manager.

    ``async with connect("moqt://127.0.0.1:4443", tls=trust) as client:`` gives a
    set-up session (handshake and both SETUPs done); the block's end closes it.

    Args:
        url: ``moqt://host[:port][/path]`` (native QUIC, port 443 by default) or
            ``https://host[:port]/path`` (WebTransport).
        tls: trust for the server's certificate (a :class:`~.tls.TlsConfig` with
            ``cafile``, or ``verify=False`` for local tests); default ``None``: the
            system's roots.
        stack: the QUIC implementation: ``"qh3"`` (the default) or ``"aioquic"``
            (``"pquic"`` runs on asyncio only: refused with :class:`~.stack.StackUnavailable`).
        timeout: seconds for the handshake and SETUP, and for each reconnection
            attempt (default 10).
        max_datagram_size: the largest UDP payload QUIC sends, in octets
            (default: the stack's).
        via: open the session on the UDP socket and driver of this other client
            (e.g. a second relay for one retrieval, ``retrieve_cache(..., also=...)``;
            both must reach their servers from the same local address); default
            ``None``: a socket of its own.
        idle_timeout: QUIC's idle timeout in seconds (default 30; a quiet server is
            PINGed, so only a dead one reaches it).
        reconnect: a :class:`~.reconnect.Backoff`: once set up, a lost session is
            opened again with it and the publications made on the client are
            announced again; default ``None``: no reconnection.
        bind: the local IP address to send from (default: 127.0.0.1 for a loopback
            server, else any).
        qlog_dir: a directory where the QUIC connection writes a qlog file (JSON)
            through the stack's own logger when it ends (:mod:`.qlog`; aioquic and
            qh3; with ``via``, the other client's endpoint decides); default
            ``None``: no qlog.
        token: a CAT authorization token (octets, or its base64url text as ``kvcs
            token issue`` prints it) sent in CLIENT_SETUP, and again on each
            reconnection (README "Authorization"); default ``None``: none.

    Returns:
        An async context manager yielding the :class:`~.api.MoqtClient`.

    Raises:
        UrlError: ``url`` is not a ``moqt://`` or ``https://`` URL.
        ConnectError: the name does not resolve, the connection fails, or the
            server closes the session during setup (the message says why).
        TlsError: ``tls`` names a missing or unusable file.
        StackUnavailable: ``stack`` is unknown, not installed, or ``pquic``.
        ValueError: an invalid ``idle_timeout``, or a ``token`` that is not base64url.
    """
    return client_session(
        open_endpoint,
        _resolve,
        url,
        tls=tls,
        stack=stack,
        timeout=timeout,
        max_datagram_size=max_datagram_size,
        via=via,
        idle_timeout=idle_timeout,
        reconnect=reconnect,
        bind=bind,
        qlog_dir=qlog_dir,
        token=token,
    )


async def _resolve(host: str, port: int) -> Any:
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConnectError(f"cannot resolve {host}: {exc}") from None
    addr = infos[0][4]
    return (addr[0], addr[1])


async def sleep(seconds: float) -> None:
    """``trio.sleep``, so that loop-agnostic code can pause through the binding."""
    await trio.sleep(seconds)


async def gather(*jobs: Callable[[], Any]) -> list[Any]:
    """Run the coroutine functions concurrently in a nursery; their results in order."""
    results: list[Any] = [None] * len(jobs)

    async def one(i: int) -> None:
        results[i] = await jobs[i]()

    with single_errors():  # the first error, as asyncio's gather
        async with trio.open_nursery() as nursery:
            for i in range(len(jobs)):
                nursery.start_soon(one, i)
    return results
