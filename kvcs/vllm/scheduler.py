"""The scheduler side's question to the relay tree: how many blocks of this prefix are published?

Theory of operation
-------------------
``get_num_new_matched_tokens`` must answer at once and never over-promise. The
answer comes from namespace discovery alone (no data moves): for the prompt's
candidate blocks ``K_0 .. K_(m-1)`` (KVSP Block Keys from the scope key, the
descriptor and the token IDs), "some publication shares at least ``j`` blocks"
holds when the relay announces either

* a publication namespace under ``("kvcs-1", Scope ID, Compatibility ID,
  K_(j-1))`` (a publication of exactly those ``j`` blocks, profile 5.1), or
* a KVSP index namespace ``("kvcs-idx-1", Scope ID, Compatibility ID, K_(j-1))``
  (a publication with at least ``j`` blocks, binding 9; publishers announce one
  per block by default).

Shared prefixes are nested, so :func:`published_blocks` asks ``j = m`` first (the
usual hit: the same prompt was prefilled elsewhere) and otherwise binary-searches
``1 .. m-1``: at most ``1 + ceil(log2 m)`` rounds of two SUBSCRIBE_NAMESPACE
requests each. A round ends at the first announcement (a hit: one round trip)
or ``lookup_quiet`` seconds after the relay answered without one (a miss). The
whole lookup is bounded by ``lookup_timeout`` (:class:`Lookup`); a timeout, a lost
relay or any error answers 0 blocks (a miss: vLLM computes the prompt). The
lookup runs on the loop thread; the scheduler is told "ask again later" until it
is answered (:mod:`.plan`). The
answer is a promise the worker side checks: what is loaded is verified object
by object, and whatever fails to arrive or verify is reported to vLLM for
recomputation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence

from kvcs.transports.quic.api import MoqtClient
from kvcs_core.kvcs.index import index_prefix
from kvcs_core.kvcs.names import content_prefix
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.kvsp.keys import block_keys, scope_id

from ._loop import EventLog, LoopThread
from .plan import Found

__all__ = ["Lookup", "published_blocks"]

log = logging.getLogger("kvcs.vllm")

QUIET = 0.25
"""Seconds without an announcement after the relay answered a SUBSCRIBE_NAMESPACE before
the answer is taken as "none" (a relay in a tree may answer before its upstream has
announced); a hit returns at its first announcement."""


async def published_blocks(
    client: MoqtClient,
    scope_key: bytes,
    descriptor: CompatibilityDescriptor,
    tokens: Sequence[int],
    *,
    quiet: float = QUIET,
    timeout: float = 2.0,
) -> Found:
    """How many leading full blocks of ``tokens`` some publication holds (0: none), and
    whether a publication of exactly that many was announced.

    Raises:
        ConnectError: the relay refused a request or the session closed.
    """
    keys = block_keys(scope_key, descriptor, tokens)
    if not keys:
        return Found(0)
    sid, cid = scope_id(scope_key), descriptor.compat_id

    async def holds(j: int) -> Found | None:
        exact = asyncio.ensure_future(
            client.discover(content_prefix(sid, cid, keys[j - 1]), quiet=quiet,
                            timeout=timeout, first=True)
        )  # fmt: skip
        index = asyncio.ensure_future(
            client.discover(index_prefix(sid, cid, keys[j - 1]), quiet=quiet,
                            timeout=timeout, first=True)
        )  # fmt: skip
        tasks = [exact, index]
        try:
            for next_done in asyncio.as_completed(tasks):
                if await next_done:
                    # the exact publication wins when both answered
                    seen = exact.done() and not exact.cancelled() and not exact.exception()
                    return Found(j, seen and bool(exact.result()))
            return None
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    m = len(keys)
    if (hit := await holds(m)) is not None:
        return hit
    best = Found(0)
    lo, hi = 0, m - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (hit := await holds(mid)) is not None:
            lo, best = mid, hit
        else:
            hi = mid - 1
    return best


class Lookup:
    """``lookup(tokens) -> Future[blocks]`` for :class:`~.plan.StepPlanner`: the question
    runs on the loop thread, bounded by ``lookup_timeout``; the future always completes
    with a number of blocks, 0 for every failure (a miss)."""

    def __init__(
        self,
        loop: LoopThread,
        descriptor: CompatibilityDescriptor,
        events: EventLog,
    ) -> None:
        self.loop = loop
        self.descriptor = descriptor
        self.events = events

    def __call__(self, tokens: Sequence[int]) -> concurrent.futures.Future[Found]:
        return self.loop.submit(self._ask(tuple(tokens)))

    async def _ask(self, tokens: tuple[int, ...]) -> Found:
        s = self.loop.settings
        t0 = time.monotonic()
        error = None
        found = Found(0)

        async def ask() -> Found:
            client = await self.loop.client()
            return await published_blocks(
                client, s.scope_key, self.descriptor, tokens, quiet=s.lookup_quiet,
                timeout=s.lookup_timeout,
            )  # fmt: skip

        try:
            found = await asyncio.wait_for(ask(), s.lookup_timeout)
        except Exception as exc:  # a miss, never an error for vLLM
            error = f"{type(exc).__name__}: {exc}"
            log.warning("kvcs lookup failed (the prompt is computed): %s", error)
        self.events(
            "lookup",
            tokens=len(tokens),
            blocks=found.blocks,
            exact=found.exact,
            ms=round((time.monotonic() - t0) * 1e3, 1),
            error=error,
        )
        return found
