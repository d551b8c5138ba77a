"""``serve_relay`` and ``connect`` written once for every event-loop binding.

A binding supplies two things: ``open_endpoint(endpoint, host, port)``, an async
context manager that binds a UDP socket and drives the endpoint on its loop
(yielding its :class:`~.api.Driver`), and ``resolve(host, port)``, its
asynchronous name lookup. Everything else (building the endpoint, the relay's
upstream connection, the client session, waiting for setup, closing) is here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from kvcs_core.relay.config import RelayConfig

from ._setup import client_endpoint, is_loopback, parse_url, relay_endpoint, token_bytes
from .api import MoqtClient, RelayServer, open_session
from .apps import ClientApp
from .config import DEFAULT_IDLE_TIMEOUT, parse_hostport
from .endpoint import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_ADDRESS, QuicEndpoint
from .reconnect import DEFAULT_BACKOFF, Backoff
from .stack import DEFAULT_STACK
from .tls import TlsConfig

OpenEndpoint = Callable[[QuicEndpoint, str, int], AbstractAsyncContextManager[Any]]
Resolve = Callable[[str, int], Awaitable[Any]]


@contextlib.asynccontextmanager
async def relay_server(
    open_endpoint: OpenEndpoint,
    resolve: Resolve,
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
) -> AsyncIterator[RelayServer]:
    """A caching relay on ``listen`` (``host:port``), as an async context manager.

    The body of every binding's ``serve_relay``; its parameters are documented there
    (:func:`.asyncio_binding.serve_relay`).
    """
    host, port = parse_hostport(listen)
    up_token = token_bytes(upstream_token)
    endpoint = relay_endpoint(
        tls=tls,
        stack=stack,
        relay_config=relay_config,
        max_datagram_size=max_datagram_size,
        max_connections=max_connections,
        max_connections_per_address=max_connections_per_address,
        webtransport=webtransport,
        idle_timeout=idle_timeout,
        qlog_dir=qlog_dir,
    )
    async with open_endpoint(endpoint, host, port) as driver:
        parent = None
        if upstream is not None:  # the parent relay: an upstream session of this relay
            url = parse_url(upstream)
            addr = await resolve(url.host, url.port)
            parent = open_session(
                driver,
                ClientApp(),
                url,
                upstream,
                addr,
                upstream_tls,
                max_datagram_size,
                idle_timeout=idle_timeout,
                reconnect=upstream_reconnect,
                connect_timeout=timeout,
                token=up_token,
            )
            await parent.wait_ready(timeout)
        yield RelayServer(driver, driver.udp.address, parent)


@contextlib.asynccontextmanager
async def client_session(
    open_endpoint: OpenEndpoint,
    resolve: Resolve,
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
) -> AsyncIterator[MoqtClient]:
    """A MOQT session with the server at ``url``, as an async context manager.

    The body of every binding's ``connect``; its parameters are documented there
    (:func:`.asyncio_binding.connect`). A connection that fails, or whose session the
    server closes during setup, raises :class:`~.api.ConnectError` with the reason.
    """
    target = parse_url(url)
    setup_token = token_bytes(token)
    addr = await resolve(target.host, target.port)
    async with contextlib.AsyncExitStack() as stack_:
        if via is not None:
            driver, app = via.driver, via.app
        else:
            app = ClientApp()
            endpoint = client_endpoint(
                stack=stack, app=app, idle_timeout=idle_timeout, qlog_dir=qlog_dir
            )
            if bind is None:
                loopback = is_loopback(addr[0])
                bind = "127.0.0.1" if loopback else ("::" if ":" in addr[0] else "0.0.0.0")
            driver = await stack_.enter_async_context(open_endpoint(endpoint, bind, 0))
        client = open_session(
            driver,
            app,
            target,
            url,
            addr,
            tls,
            max_datagram_size,
            idle_timeout=idle_timeout,
            reconnect=reconnect,
            connect_timeout=timeout,
            token=setup_token,
        )
        try:
            await client.wait_ready(timeout)
            yield client
        finally:
            await client.close()
