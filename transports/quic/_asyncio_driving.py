"""What both asyncio drivers (UDP socket and pquic) share: the loop's clock, a
coalesced wake-up, and waiting on a condition re-checked after each service.

A subclass sets ``_loop``, ``_scheduled``, ``_closed`` and ``_changed`` (an
``asyncio.Event`` set after every service) and defines ``_service``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from .api import ConnectError


class AsyncioDriving:
    """Mixin: ``now``, ``wake`` and ``wait_for`` of an asyncio driver (module docstring)."""

    _loop: asyncio.AbstractEventLoop
    _scheduled: bool
    _closed: bool
    _changed: asyncio.Event

    def _service(self) -> None:
        raise NotImplementedError

    def now(self) -> float:
        return self._loop.time()

    def wake(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._service)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> None:
        deadline = None if timeout is None else self.now() + timeout
        while not predicate():
            if self._closed:
                raise ConnectError("the endpoint is closed")
            remaining = None if deadline is None else deadline - self.now()
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
