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
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from ._entry import client_session, relay_server
from .api import ConnectError, MoqtClient, RelayServer
from .endpoint import QuicEndpoint
from .groups import single_errors
from .pquic_binding import TRIO_REFUSED
from .stack import StackUnavailable
from .udp import UdpSocket

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
    udp = UdpSocket(host, port)
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
    listen: str = "127.0.0.1:4443", **options: Any
) -> AbstractAsyncContextManager[RelayServer]:
    """A caching relay on ``listen`` on trio; options: :func:`._entry.relay_server`."""
    return relay_server(open_endpoint, _resolve, listen, **options)


def connect(url: str, **options: Any) -> AbstractAsyncContextManager[MoqtClient]:
    """A MOQT session with ``url`` on trio; options: :func:`._entry.client_session`."""
    return client_session(open_endpoint, _resolve, url, **options)


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
