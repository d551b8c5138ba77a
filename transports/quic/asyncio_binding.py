"""kvcs over QUIC on asyncio: relay servers and clients (aioquic, qh3 or pquic).

Theory of operation
-------------------
:class:`AsyncioDriver` runs one :class:`~.endpoint.QuicEndpoint` on one
non-blocking UDP socket inside the running asyncio loop: a reader callback
(``loop.add_reader``) drains the socket into the endpoint, one ``call_at``
handle tracks :meth:`~.endpoint.QuicEndpoint.get_timer`, and
:meth:`AsyncioDriver.wake` schedules one :meth:`~.endpoint.QuicEndpoint.service`
per loop iteration however many inputs arrived, whose datagrams go to the
socket in one ``send_batch`` (GSO runs, :mod:`.udp`). After each service every
``wait_for`` re-checks its predicate. That is the whole binding: the protocol
lives in the core, the wiring in :mod:`.endpoint` and :mod:`.apps`, the
user-facing API in :mod:`.api`.

Entry points: ``serve_relay(...)`` and ``connect(url, ...)``, both async
context managers (see the README for examples). The clock is ``loop.time()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from kvcs_core.relay.config import RelayConfig

from . import pquic_binding
from ._asyncio_driving import AsyncioDriving
from ._entry import client_session, relay_server
from .api import ConnectError, MoqtClient, RelayServer
from .config import DEFAULT_IDLE_TIMEOUT
from .endpoint import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_ADDRESS, QuicEndpoint
from .reconnect import DEFAULT_BACKOFF, Backoff
from .stack import DEFAULT_STACK
from .tls import TlsConfig
from .udp import UdpSocket, open_udp

log = logging.getLogger("kvcs.quic")

__all__ = [
    "AsyncioDriver",
    "ConnectError",
    "MoqtClient",
    "RelayServer",
    "connect",
    "gather",
    "open_endpoint",
    "serve_relay",
    "sleep",
]


class AsyncioDriver(AsyncioDriving):
    """Drives one endpoint on one UDP socket in the running asyncio loop."""

    def __init__(self, endpoint: QuicEndpoint, udp: UdpSocket) -> None:
        self.endpoint = endpoint
        self.udp = udp
        self._loop = asyncio.get_running_loop()
        endpoint.clock = self.now  # read during service (endpoint docstring)
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._changed = asyncio.Event()
        self._writing = False
        self._closed = False
        self._loop.add_reader(udp.fileno(), self._on_readable)

    async def aclose(self, timeout: float = 1.0) -> None:
        """Close every connection, wait briefly for them to end, release the socket."""
        if self._closed:
            return
        self.endpoint.close(self.now())
        self.wake()
        with contextlib.suppress(TimeoutError, ConnectError):
            await self.wait_for(lambda: self.endpoint.idle, timeout)
        self.endpoint.flush_qlog()  # connections still closing leave their qlog too
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._loop.remove_reader(self.udp.fileno())
        if self._writing:
            self._loop.remove_writer(self.udp.fileno())
        self.udp.close()
        self._changed.set()

    # --- callbacks -------------------------------------------------------------------------

    # The endpoint isolates failures per connection; should anything escape it anyway,
    # it is logged here and the driver goes on (an exception must never leave a callback).

    def _on_readable(self) -> None:
        try:
            self.endpoint.receive_datagrams(self.udp.recv_batch(), self.now())
        except Exception as exc:
            log.warning("endpoint input failed: %r", exc)
        self.wake()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        try:
            self.endpoint.handle_timer(self.now())
        except Exception as exc:
            log.warning("endpoint timer failed: %r", exc)
        self._service()

    def _on_writable(self) -> None:
        if not self.udp.send_batch([]):
            self._loop.remove_writer(self.udp.fileno())
            self._writing = False

    def _service(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        try:
            out = self.endpoint.service(self.now())
        except Exception as exc:
            log.warning("endpoint service failed: %r", exc)
            out = []
        if self.udp.send_batch(out) and not self._writing:
            self._writing = True
            self._loop.add_writer(self.udp.fileno(), self._on_writable)
        deadline = self.endpoint.get_timer()
        if deadline != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = (
                None
                if deadline is None
                else self._loop.call_at(max(deadline, self.now()), self._on_timer)
            )
            self._timer_at = deadline
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


@contextlib.asynccontextmanager
async def open_endpoint(
    endpoint: QuicEndpoint, host: str, port: int
) -> AsyncIterator[AsyncioDriver]:
    """Bind ``host:port`` and drive ``endpoint`` there until the block ends (a pquic
    endpoint owns its sockets: :mod:`.pquic_binding` drives it)."""
    if endpoint.stack.name == "pquic":
        async with pquic_binding.open_endpoint(endpoint, host, port) as pdriver:  # type: ignore[arg-type]
            yield pdriver  # type: ignore[misc]
        return
    udp = open_udp(host, port)
    driver = AsyncioDriver(endpoint, udp)
    try:
        yield driver
    finally:
        await driver.aclose()


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
    """A caching MOQT relay on asyncio, as an async context manager.

    ``async with serve_relay("127.0.0.1:0", tls=self_signed(d)) as relay:`` serves
    until the block ends; ``relay.url`` is its ``moqt://`` URL (port 0: the OS chose).

    Args:
        listen: ``host:port`` to bind (default ``127.0.0.1:4443``; port 0 lets the
            OS choose, see :attr:`~.api.RelayServer.address`).
        tls: the server's certificate and key (required; :func:`~.tls.self_signed`
            makes a local pair).
        stack: the QUIC implementation: ``"qh3"`` (the default), ``"aioquic"`` or
            ``"pquic"``.
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
        StackUnavailable: ``stack`` is unknown or not installed.
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
    """A MOQT session with a server on asyncio, as an async context manager.

    ``async with connect("moqt://127.0.0.1:4443", tls=trust) as client:`` gives a
    set-up session (handshake and both SETUPs done); the block's end closes it.

    Args:
        url: ``moqt://host[:port][/path]`` (native QUIC, port 443 by default) or
            ``https://host[:port]/path`` (WebTransport).
        tls: trust for the server's certificate (a :class:`~.tls.TlsConfig` with
            ``cafile``, or ``verify=False`` for local tests); default ``None``: the
            system's roots.
        stack: the QUIC implementation: ``"qh3"`` (the default), ``"aioquic"`` or
            ``"pquic"``.
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
        StackUnavailable: ``stack`` is unknown or not installed.
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
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=2)  # SOCK_DGRAM
    except OSError as exc:
        raise ConnectError(f"cannot resolve {host}: {exc}") from None
    addr = infos[0][4]
    return (addr[0], addr[1])


async def sleep(seconds: float) -> None:
    """``asyncio.sleep``, so that loop-agnostic code can pause through the binding."""
    await asyncio.sleep(seconds)


async def gather(*jobs: Callable[[], Any]) -> list[Any]:
    """Run the coroutine functions concurrently; their results in order (first error wins)."""
    return list(await asyncio.gather(*(job() for job in jobs)))
