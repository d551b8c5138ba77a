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
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from . import pquic_binding
from ._asyncio_driving import AsyncioDriving
from ._entry import client_session, relay_server
from .api import ConnectError, MoqtClient, RelayServer
from .endpoint import QuicEndpoint
from .udp import UdpSocket

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
    udp = UdpSocket(host, port)
    driver = AsyncioDriver(endpoint, udp)
    try:
        yield driver
    finally:
        await driver.aclose()


def serve_relay(
    listen: str = "127.0.0.1:4443", **options: Any
) -> AbstractAsyncContextManager[RelayServer]:
    """A caching relay on ``listen`` on asyncio; options: :func:`._entry.relay_server`."""
    return relay_server(open_endpoint, _resolve, listen, **options)


def connect(url: str, **options: Any) -> AbstractAsyncContextManager[MoqtClient]:
    """A MOQT session with ``url`` on asyncio; options: :func:`._entry.client_session`."""
    return client_session(open_endpoint, _resolve, url, **options)


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
