"""The worker side: verified layers into vLLM's pages during the forward pass, computed layers out.

Theory of operation
-------------------
**Loading** (consumer). ``start_load_kv`` starts, for every :class:`~.plan.LoadSpec`
of the step, a retrieval on the loop thread (``retrieve_cache`` of the prefix's
tokens, direct discovery of exactly that prefix length, the KVSP index as the
fallback) into a :class:`~kvcs.adapters.torch_kv.TorchKvDestination`; each
``LayerReady`` (every Object of the layer verified: payload checks, manifest
digests, signatures and decryption when configured) sets that layer's
``threading.Event``. vLLM's attention layer ``l`` calls ``wait_for_layer_load``
before it reads the cache: the forward thread waits for layer ``l``'s event (the
whole load is bounded by ``load_timeout``), then copies the verified blocks into
the request's pages (:func:`~.layout.write_blocks`, blocks ``first_block ..``), so
layer ``l`` computes while layers ``l+1 ..`` are still on the wire.

A layer that does not become ready (an Object that failed verification and was
not recovered within ``recovery_time``, a lost relay, a publication shorter than
promised, the timeout) is never written; its request's block IDs from the first
affected block on are returned by :meth:`Worker.load_errors` (vLLM's
``get_block_ids_with_load_errors``), and vLLM, with ``kv_load_failure_policy:
"recompute"``, discards the step's output for that request and recomputes those
blocks. Wrong KV never reaches attention as if it were right.

**Publishing** (producer). ``save_kv_layer`` is called after attention layer ``l``
has written its K/V into the pages; for every :class:`~.plan.SaveSpec` of the
step the forward thread gathers the request's full blocks of layer ``l`` out of
the pages into new memory (:func:`~.layout.gather_sections`) and hands them to
the loop thread, where a coroutine per publication (``publish_cache`` then
``put_layer`` in layer order, then ``finish``) sends them while the model
computes layer ``l + 1``. Because the copy is taken before ``save_kv_layer``
returns, the pages may be reused as soon as the step ends; ``wait_for_save``
checks that every layer of every save of the step was taken (and takes any that
was not) before vLLM frees or reuses a block. At most ``max_publications``
publications are kept; older ones are withdrawn (relays may still serve them
from their caches).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcs.adapters.torch_kv import TorchKvDestination
from kvcs.transports.quic.api import CachePublication, CacheRetrieval
from kvcs_core.kvcs.consumer import ConsumerConfig, IndexOptions, PublicationSelected
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

from ._loop import EventLog, LoopThread
from .layout import PagedLayer, gather_sections, layer_order, paged_views, write_blocks
from .plan import LoadSpec, SaveSpec

__all__ = ["Worker"]

log = logging.getLogger("kvcs.vllm")

SHORT_DISCOVERY = 0.05
"""Seconds of direct discovery when the lookup found the prefix only in the KVSP index."""

FORGET_AFTER = 60.0
"""Seconds a retrieval that is still running after its load may go on (recovering,
closing its requests) before the client drops it anyway."""

MAX_PUBLICATIONS = 64
"""Publications a producer keeps offering; the oldest is withdrawn beyond this."""


class _Load:
    """One request's retrieval (loop thread) and its per-layer handoff (forward thread)."""

    def __init__(self, spec: LoadSpec, descriptor: CompatibilityDescriptor, timeout: float) -> None:
        self.spec = spec
        layers = descriptor.layers
        self.dest = TorchKvDestination(descriptor, len(spec.tokens))
        self.ready = [threading.Event() for _ in range(layers)]
        self.ok = [False] * layers
        self.available = spec.blocks
        """Blocks the selected publication covers (set before any layer is ready)."""
        self.failed_blocks: set[int] = set()
        self.concluded = False
        self.deadline = time.monotonic() + timeout
        self.written: set[int] = set()
        self.timed_out = False
        self.error: str | None = None
        self.started = time.monotonic()

    def bad_from(self) -> int:
        """The first block that cannot be taken as loaded (``blocks``: none)."""
        first = self.spec.first_block
        if self.timed_out or (self.error is not None and not self.failed_blocks):
            return first
        return max(min([self.available, self.spec.blocks, *self.failed_blocks]), first)


class Worker:
    """The connector's worker-side state (see the module docstring)."""

    def __init__(
        self,
        loop: LoopThread,
        descriptor: CompatibilityDescriptor,
        descriptor_json: Mapping[str, Any],
        events: EventLog,
    ) -> None:
        self.loop = loop
        self.descriptor = descriptor
        self.descriptor_json = dict(descriptor_json)
        self.events = events
        self.pages: dict[str, PagedLayer] = {}
        self.order: dict[str, int] = {}
        self._by_layer: dict[int, PagedLayer] = {}
        self._loads: dict[str, _Load] = {}
        self._saves: list[tuple[SaveSpec, asyncio.Queue[Any], set[int]]] = []
        self._errors: set[int] = set()
        self._published: collections.deque[CachePublication] = collections.deque()

    # -- register_kv_caches

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Learn the paged layout: one page view per attention layer.

        Raises:
            ValueError: layer names or tensor shapes that do not fit the descriptor.
        """
        self.order = layer_order(list(kv_caches), self.descriptor.layers)
        self.pages = {name: paged_views(t, self.descriptor) for name, t in kv_caches.items()}
        self._by_layer = {self.order[n]: p for n, p in self.pages.items()}
        shapes = sorted({tuple(t.shape) for t in kv_caches.values()})
        self.events("registered", layers=len(kv_caches), shapes=[list(s) for s in shapes])

    # -- start_load_kv / wait_for_layer_load

    def start_loads(self, loads: Sequence[LoadSpec]) -> None:
        """Start the retrieval of every load of the step (returns at once)."""
        s = self.loop.settings
        for spec in loads:
            if spec.req_id in self._loads:
                continue
            ld = _Load(spec, self.descriptor, s.load_timeout)
            self._loads[spec.req_id] = ld
            self.events(
                "load_started",
                req_id=spec.req_id,
                tokens=len(spec.tokens),
                blocks=spec.blocks,
                first_block=spec.first_block,
            )
            self.loop.submit(self._retrieve(ld))

    async def _retrieve(self, ld: _Load) -> None:
        s = self.loop.settings
        retrieval: CacheRetrieval | None = None
        try:
            client = await self.loop.client()
            retrieval = client.retrieve_cache(
                self.descriptor_json,
                s.scope_key,
                ld.spec.tokens,
                destinations=ld.dest.buffer,
                producer_keys=s.producer_keys,
                require_authenticity=s.producer_keys is not None,
                recovery_time_bound=s.recovery_time,
                prefix_lengths=[len(ld.spec.tokens) // self.descriptor.block_tokens],
                require_encryption=s.encrypt,
                # a longer publication has another Anchor Key: straight to the index
                config=ConsumerConfig(
                    discovery_timeout=s.lookup_timeout if ld.spec.exact else SHORT_DISCOVERY
                ),
                index=IndexOptions(timeout=s.lookup_timeout),
            )
            left = max(ld.deadline - time.monotonic(), 0.001)
            async for layer in retrieval.layers(timeout=left):
                primary = [
                    e for e in retrieval.events if isinstance(e, PublicationSelected) and e.primary
                ]
                if primary:
                    ld.available = min(primary[0].blocks, ld.spec.blocks)
                ld.dest.layer_ready(layer)
                ld.ok[layer] = True
                ld.ready[layer].set()
        except Exception as exc:  # a failed load is recomputed, never an engine error
            ld.error = f"{type(exc).__name__}: {exc}"
        finally:
            if retrieval is not None:
                for e in retrieval.recompute:
                    ld.failed_blocks.update(e.blocks)
                done = retrieval.complete
                if done is not None and done.publication_id is None:
                    ld.available = 0
            else:
                ld.available = 0
            if retrieval is not None:
                self.loop.loop.create_task(self._forget(retrieval))
            for layer, ok in enumerate(ld.ok):
                if not ok:  # the verified blocks before the first bad one may still be written
                    with contextlib.suppress(Exception):
                        ld.dest.layer_ready(layer)
            ld.concluded = True
            for ev in ld.ready:
                ev.set()
            self.events(
                "retrieval_done",
                req_id=ld.spec.req_id,
                layers_ok=sum(ld.ok),
                available=ld.available,
                failed_blocks=sorted(ld.failed_blocks),
                error=ld.error,
                ms=round((time.monotonic() - ld.started) * 1e3, 1),
            )

    async def _forget(self, retrieval: CacheRetrieval) -> None:
        """Let the client drop the retrieval (and its destination) once it is over, so a
        serving engine does not keep every retrieval it ever made (bounded wait)."""
        with contextlib.suppress(Exception):
            await retrieval.result(timeout=FORGET_AFTER, strict=False)
        retrieval.forget()

    def wait_layer(self, layer_name: str) -> None:
        """Block until ``layer_name``'s verified blocks of every load are in the pages (or
        are known not to come: their block IDs become load errors)."""
        li = self.order.get(layer_name)
        if li is None:
            return
        pages = self._by_layer[li]
        for ld in self._loads.values():
            if li in ld.written or ld.timed_out:
                continue
            ld.written.add(li)
            left = ld.deadline - time.monotonic()
            if not ld.ready[li].wait(max(left, 0.0)):
                ld.timed_out = True
                ld.error = ld.error or f"layer {li} not loaded within load_timeout"
                self._fail(ld)
                continue
            spec, first = ld.spec, ld.spec.first_block
            # a ready layer: every Object of blocks 0..available-1 verified; a layer that
            # is not: those before the first block with a missing Object did
            end = min(ld.available, spec.blocks) if ld.ok[li] else ld.bad_from()
            if end > first:
                k, v = ld.dest.paged(li)
                write_blocks(pages, spec.block_ids[first:end], k[first:end], v[first:end])
            if not ld.ok[li] or (ld.concluded and ld.bad_from() < spec.blocks):
                self._fail(ld)

    def _fail(self, ld: _Load) -> None:
        spec = ld.spec
        start = ld.bad_from()
        bad = set(spec.block_ids[start:])
        if bad - self._errors:
            self.events(
                "load_errors",
                req_id=spec.req_id,
                first_block=start,
                block_ids=sorted(bad),
                error=ld.error,
            )
        self._errors |= bad

    def load_errors(self) -> set[int]:
        """Settle the step's loads; the block IDs that failed to load (vLLM recomputes
        them). Called once per step, after the forward pass."""
        for ld in self._loads.values():
            missed = set(range(self.descriptor.layers)) - ld.written
            if missed:  # vLLM never asked for these layers: they were never written
                ld.error = ld.error or f"layers {sorted(missed)} were not waited for"
                ld.timed_out = True
            if ld.timed_out or (ld.concluded and ld.bad_from() < ld.spec.blocks):
                self._fail(ld)
            self.events(
                "load_done",
                req_id=ld.spec.req_id,
                blocks=ld.spec.blocks,
                first_block=ld.spec.first_block,
                loaded_blocks=ld.bad_from() - ld.spec.first_block,
                ms=round((time.monotonic() - ld.started) * 1e3, 1),
            )
        self._loads.clear()
        out, self._errors = self._errors, set()
        return out

    # -- save_kv_layer / wait_for_save

    def start_saves(self, saves: Sequence[SaveSpec]) -> None:
        """Open a publication for every save of the step (on the loop thread)."""
        for spec in saves:
            q: asyncio.Queue[Any] = asyncio.Queue()
            self._saves.append((spec, q, set()))
            self.loop.submit(self._publish(spec, q))

    def save_layer(self, layer_name: str) -> None:
        """Take layer ``layer_name`` of every save of the step out of the pages."""
        li = self.order.get(layer_name)
        if li is None:
            return
        for spec, q, taken in self._saves:
            self._take(spec, q, taken, li)

    def _take(self, spec: SaveSpec, q: asyncio.Queue[Any], taken: set[int], li: int) -> None:
        if li in taken:
            return
        ks, vs = gather_sections(self._by_layer[li], spec.block_ids, self.descriptor)
        taken.add(li)
        self.loop.call_soon(q.put_nowait, (li, ks, vs))

    def wait_saves(self) -> None:
        """Every layer of every save of this step is copied out of the pages; then forget
        the step's saves (their publications go on on the loop thread)."""
        for spec, q, taken in self._saves:
            for li in range(self.descriptor.layers):
                self._take(spec, q, taken, li)
        self._saves.clear()

    async def _publish(self, spec: SaveSpec, q: asyncio.Queue[Any]) -> None:
        s = self.loop.settings
        t0 = time.monotonic()
        try:
            client = await self.loop.client()
            pub = await client.publish_cache(
                self.descriptor_json, s.scope_key, spec.tokens, signer=s.signer, encrypt=s.encrypt
            )
            for _ in range(self.descriptor.layers):
                layer, ks, vs = await asyncio.wait_for(q.get(), s.load_timeout)
                await pub.put_layer(layer, ks, vs, timeout=s.load_timeout)
            await pub.finish()
        except Exception as exc:
            self.events("publish_failed", req_id=spec.req_id, error=f"{type(exc).__name__}: {exc}")
            log.warning("kvcs: publishing request %s failed: %s", spec.req_id, exc)
            return
        self.events(
            "published",
            req_id=spec.req_id,
            tokens=len(spec.tokens),
            blocks=len(spec.block_ids),
            bytes=pub.publisher.total_bytes,
            ms=round((time.monotonic() - t0) * 1e3, 1),
        )
        self._published.append(pub)
        while len(self._published) > MAX_PUBLICATIONS:
            await self._published.popleft().withdraw()
