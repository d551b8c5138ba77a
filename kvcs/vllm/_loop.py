"""The connector's network side: one asyncio event loop in a daemon thread, one relay session.

Theory of operation
-------------------
vLLM calls the connector from its own threads (the scheduler loop, the model
runner's forward pass) and never awaits anything. Every MOQT session, publication
and retrieval of the connector therefore lives on one asyncio event loop that runs
in a daemon thread (:class:`LoopThread`), and vLLM's threads talk to it through two
doors only:

* :meth:`LoopThread.call`: run a coroutine on the loop and block the calling thread
  for its result, with a timeout (the scheduler's lookup);
* :meth:`LoopThread.submit`: start a coroutine on the loop and return a
  ``concurrent.futures.Future`` at once (a retrieval, a publication).

The relay session (:meth:`LoopThread.client`) is opened lazily on first use, with a
reconnecting link (``connect(..., reconnect=Backoff())``) so that publications are
announced again after a lost connection; a failed first connection is retried at the
next use. :meth:`LoopThread.close` closes the session and stops the loop (bounded).

:class:`EventLog` appends one JSON object per line (``{"t": unix time, "pid": ...,
"event": ..., ...}``) to ``event_log`` when configured: what the connector decided
(lookups, loads, load errors, publications), for operators and tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from kvcs.transports.quic import asyncio_binding
from kvcs.transports.quic.api import MoqtClient
from kvcs.transports.quic.reconnect import Backoff

from .config import ConnectorSettings

__all__ = ["EventLog", "LoopThread"]

log = logging.getLogger("kvcs.vllm")

T = TypeVar("T")


class EventLog:
    """JSON lines appended to a file (nothing when ``path`` is ``None``); thread-safe."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        stamp = {"t": round(time.time(), 6), "pid": os.getpid(), "event": event}
        line = json.dumps({**stamp, **fields})
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


class LoopThread:
    """An asyncio loop in a daemon thread holding the connector's relay session."""

    def __init__(self, settings: ConnectorSettings, name: str) -> None:
        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: MoqtClient | None = None
        self._lock: asyncio.Lock | None = None
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its future (thread-safe)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float) -> T:
        """Run ``fn()`` on the loop and wait for its result at most ``timeout`` s.

        Raises:
            TimeoutError: ``timeout`` passed (the coroutine is cancelled).
            Exception: whatever the coroutine raised.
        """
        fut = self.submit(asyncio.wait_for(fn(), timeout))
        try:
            return fut.result(timeout + 1.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout:g} s") from None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop (thread-safe, returns at once)."""
        self._loop.call_soon_threadsafe(fn, *args)

    async def client(self) -> MoqtClient:
        """The relay session, connected on first use (on the loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None and not self._client.closed:
                return self._client
            if self._stack is not None:
                with contextlib.suppress(Exception):
                    await self._stack.aclose()
            s = self.settings
            stack = contextlib.AsyncExitStack()
            try:
                client = await stack.enter_async_context(
                    asyncio_binding.connect(
                        s.relay,
                        tls=s.tls,
                        stack=s.stack,
                        timeout=s.connect_timeout,
                        reconnect=Backoff(initial=0.2, maximum=5.0),
                        token=s.token,
                    )
                )
            except BaseException:
                await stack.aclose()
                raise
            self._stack, self._client = stack, client
            return client

    def close(self, timeout: float = 5.0) -> None:
        """Close the relay session and stop the loop (at most about ``timeout`` s)."""
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            if self._stack is not None:
                await self._stack.aclose()
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()

        with contextlib.suppress(Exception):
            self.submit(shut()).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
