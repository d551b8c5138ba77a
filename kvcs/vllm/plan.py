"""What the scheduler side tells the worker side each step: which blocks to load, which to publish.

Theory of operation
-------------------
vLLM's scheduler decides, per request, how many prompt tokens an external cache
supplies (``get_num_new_matched_tokens``), allocates blocks
(``update_state_after_alloc``), then builds one metadata object per step
(``build_connector_meta``) that the worker side receives before the forward
pass. :class:`StepPlanner` is that bookkeeping, on plain values (no vLLM types,
so it is tested with plain data):

* **lookup.** Only full blocks are loaded, and never the prompt's last token
  (vLLM must compute at least one token to sample from): the candidates are the
  first ``(len(prompt) - 1) // B`` blocks. The ``lookup`` callable (the relay
  query, :mod:`.scheduler`) starts the question and returns a future of how many
  of them are published; until it is answered the engine is told ``None`` ("ask
  again later": vLLM skips the request this step and keeps scheduling the
  others), so the scheduler loop never waits for the network. The answer is kept
  per request and the engine is told ``found * B - num_computed`` tokens, or 0.
* **load.** After allocation, the request's next step carries a :class:`LoadSpec`:
  the tokens of the published prefix, the first block not already computed
  locally, and the vLLM block IDs of blocks ``0 .. found-1`` (from the scheduled
  request's block table). The load is synchronous: it happens in the forward
  pass of that very step (``wait_for_layer_load`` per layer).
* **publish.** A producer publishes each prompt's full blocks once they are all
  computed: at the step where ``num_computed + num_scheduled`` reaches them
  (under chunked prefill that is the last chunk's step; the earlier chunks'
  blocks are in the pages by then), a :class:`SaveSpec` with the tokens and the
  block IDs goes to the worker. A ``kv_both`` engine publishes only when it
  computed more than it loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import attrs

from .config import Role

__all__ = ["CachedRequest", "Found", "LoadSpec", "NewRequest", "SaveSpec", "StepPlanner"]


@attrs.frozen
class Found:
    """A lookup's answer: ``blocks`` leading full blocks are published; ``exact`` when a
    publication of exactly those blocks was announced (else only the KVSP index said so:
    the publication is longer, and the load goes through the index at once)."""

    blocks: int
    exact: bool = True


@attrs.frozen
class LoadSpec:
    """Load the published prefix ``tokens`` into the blocks ``block_ids[first_block:]``."""

    req_id: str
    tokens: tuple[int, ...]
    """The prefix to retrieve: ``len(block_ids) * B`` tokens, or one block more when the
    publication also holds the block of the prompt's last token (retrieved for an exact
    match, never written: vLLM computes that block)."""
    first_block: int
    """Blocks before this one were computed locally (prefix cache): not written."""
    block_ids: tuple[int, ...]
    """vLLM block IDs of the prefix's blocks ``0 .. len - 1``."""
    exact: bool = True
    """As :attr:`Found.exact`."""

    @property
    def blocks(self) -> int:
        return len(self.block_ids)


@attrs.frozen
class SaveSpec:
    """Publish ``tokens`` (full blocks) from the blocks ``block_ids``."""

    req_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


@attrs.frozen
class NewRequest:
    """A request scheduled for the first time in this step (vLLM's ``NewRequestData``)."""

    req_id: str
    prompt: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_computed: int
    num_scheduled: int


@attrs.frozen
class CachedRequest:
    """A request scheduled again (vLLM's ``CachedRequestData`` row)."""

    req_id: str
    new_block_ids: tuple[int, ...] | None
    resumed: bool
    """Resumed from preemption: ``new_block_ids`` is then the whole block table."""
    num_computed: int
    num_scheduled: int


@attrs.define
class _Saving:
    tokens: tuple[int, ...]
    block_ids: list[int]


class StepPlanner:
    """The scheduler side's per-request bookkeeping (see the module docstring)."""

    def __init__(
        self, role: Role, block_tokens: int, lookup: Callable[[Sequence[int]], Future[Found]]
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, not {block_tokens}")
        self.role = role
        self.block_tokens = block_tokens
        self._lookup = lookup
        self._asked: dict[str, tuple[tuple[int, ...], Future[Found]]] = {}
        self._found: dict[str, tuple[tuple[int, ...], Found, int]] = {}
        self._to_load: dict[str, tuple[tuple[int, ...], int, int, bool]] = {}
        self._saving: dict[str, _Saving] = {}

    # -- get_num_new_matched_tokens / update_state_after_alloc

    def matched(self, req_id: str, prompt: Sequence[int], num_computed: int) -> int | None:
        """External tokens beyond ``num_computed`` that can be loaded (0: none; ``None``:
        the lookup is still running, ask again)."""
        if not self.role.loads:
            return 0
        b = self.block_tokens
        usable = max(len(prompt) - 1, 0) // b
        if usable <= num_computed // b:
            return 0
        if req_id not in self._found:
            if req_id not in self._asked:
                # every full block is looked up, the last token's too: the same prompt
                # prefilled elsewhere is then an exact hit even when it ends on a block
                # boundary (only the blocks before the last token's are loaded)
                full = len(prompt) // b
                prefix = tuple(int(t) for t in prompt[: full * b])
                self._asked[req_id] = (prefix, self._lookup(prefix))
            prefix, future = self._asked[req_id]
            if not future.done():
                return None
            del self._asked[req_id]
            try:
                answer = future.result()
                found = Found(min(max(int(answer.blocks), 0), len(prefix) // b), answer.exact)
            except Exception:  # a lookup that failed is a miss
                found = Found(0)
            loadable = min(found.blocks, usable)
            self._found[req_id] = (prefix[: found.blocks * b], found, loadable)
        _, _, loadable = self._found[req_id]
        return max(loadable * b - num_computed, 0)

    def allocated(self, req_id: str, num_external: int) -> None:
        """Blocks were allocated; ``num_external`` tokens are to be loaded (0: none)."""
        entry = self._found.pop(req_id, None)
        if num_external <= 0 or entry is None:
            return
        tokens, found, loadable = entry
        first = loadable - num_external // self.block_tokens
        self._to_load[req_id] = (tokens, max(first, 0), loadable, found.exact)

    # -- build_connector_meta

    def build(
        self, new: Sequence[NewRequest], cached: Sequence[CachedRequest]
    ) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """The loads and saves of this step."""
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        b = self.block_tokens
        for r in new:
            end = 0
            if (entry := self._to_load.pop(r.req_id, None)) is not None:
                tokens, first, loadable, exact = entry
                ids = tuple(r.block_ids[:loadable])
                loads.append(LoadSpec(r.req_id, tokens, first, ids, exact))
                end = loadable * b
            full = len(r.prompt) // b
            if self.role.publishes and full and full * b > end:
                self._saving[r.req_id] = _Saving(tuple(r.prompt[: full * b]), list(r.block_ids))
            self._maybe_save(r.req_id, r.num_computed + r.num_scheduled, saves)
        for c in cached:
            if c.resumed and (entry := self._to_load.pop(c.req_id, None)) is not None:
                tokens, first, loadable, exact = entry
                ids = tuple(c.new_block_ids or ())[:loadable]
                if len(ids) == loadable:
                    loads.append(LoadSpec(c.req_id, tokens, first, ids, exact))
            if (s := self._saving.get(c.req_id)) is not None and c.new_block_ids is not None:
                if c.resumed:
                    s.block_ids = list(c.new_block_ids)
                else:
                    s.block_ids.extend(c.new_block_ids)
            self._maybe_save(c.req_id, c.num_computed + c.num_scheduled, saves)
        return loads, saves

    def _maybe_save(self, req_id: str, computed: int, saves: list[SaveSpec]) -> None:
        s = self._saving.get(req_id)
        if s is None or computed < len(s.tokens):
            return
        blocks = len(s.tokens) // self.block_tokens
        if len(s.block_ids) >= blocks:
            saves.append(SaveSpec(req_id, s.tokens, tuple(s.block_ids[:blocks])))
        del self._saving[req_id]

    def finished(self, req_id: str) -> None:
        """The request is over: forget it."""
        for table in (self._asked, self._found, self._to_load, self._saving):
            table.pop(req_id, None)

    @property
    def tracked(self) -> int:
        """Requests with state here (for tests: it must return to 0)."""
        keys: set[str] = set()
        for table in (self._asked, self._found, self._to_load, self._saving):
            keys.update(table)
        return len(keys)
