"""``KvcsConnector``: kvcs behind vLLM's ``KVConnectorBase_V1`` (vLLM 0.32.0), layer by layer.

Theory of operation
-------------------
vLLM builds two instances of a connector: one for the scheduler
(``KVConnectorRole.SCHEDULER``) and one per worker (``WORKER``); they share
nothing but the metadata object the scheduler builds each step. This class is
the thin adapter between vLLM's calls and kvcs's pieces:

================================  ===================================================
vLLM calls                        kvcs does
================================  ===================================================
``get_num_new_matched_tokens``    :class:`~.scheduler.Lookup` through
                                  :class:`~.plan.StepPlanner`: published full blocks
                                  of the prompt (never its last token); sync load
``update_state_after_alloc``      :meth:`~.plan.StepPlanner.allocated`
``build_connector_meta``          :meth:`~.plan.StepPlanner.build`: loads and saves,
                                  with block IDs, in :class:`KvcsConnectorMetadata`
``request_finished``              forget the request (blocks are free at once: saves
                                  copy their data during the step)
``register_kv_caches``            :meth:`~.worker.Worker.register` (page views)
``start_load_kv``                 start retrievals and publications
``wait_for_layer_load``           wait for the layer, write its verified blocks
``save_kv_layer``                 copy the layer's blocks out, publish them
``wait_for_save``                 every layer of the step's saves is copied out
``get_block_ids_with_load_errors``  blocks that did not load (vLLM recomputes)
``shutdown``                      close the relay session and the loop thread
================================  ===================================================

**Descriptor.** The KVSP Compatibility Descriptor comes from the engine's model
config (:func:`engine_descriptor`): the Hugging Face config through
:func:`kvcs.adapters.transformers_kv.model_descriptor`, the cache dtype (the
model's, or the fp8 type of ``--kv-cache-dtype``), ``block_tokens`` = vLLM's
``block_size``, and the model's identity: ``model_id`` (default ``"local"`` for a
local directory, as ``kvcs prefill``, else the model name) at ``revision``
(default: the SHA-256 of a local directory's config and weights, else vLLM's
``--revision`` or ``"main"``). Engines (and ``kvcs prefill``) with the same
identity, dtype and block size share caches; any other difference gives another
Compatibility ID, so caches are never mixed.

Only models with one full-attention KV cache group are supported (Llama-style
decoders); others are refused at construction with a one-line error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcs.adapters.transformers_kv import directory_revision, model_descriptor
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

from ._loop import EventLog, LoopThread
from .config import ConnectorConfigError, ConnectorSettings, parse_settings
from .plan import CachedRequest, LoadSpec, NewRequest, SaveSpec, StepPlanner
from .scheduler import Lookup
from .worker import Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvcsConnector", "KvcsConnectorMetadata", "engine_descriptor"]

log = logging.getLogger("kvcs.vllm")

_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


class KvcsConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """One step's plan, from the scheduler side to the workers (pickled between processes)."""

    def __init__(self, loads: list[LoadSpec], saves: list[SaveSpec]) -> None:
        self.loads = loads
        self.saves = saves


def engine_descriptor(vllm_config: VllmConfig, settings: ConnectorSettings) -> dict[str, Any]:
    """The KVSP Compatibility Descriptor of the engine's KV cache (see the module docstring).

    Raises:
        ConnectorConfigError: a cache dtype or config KVSP cannot describe.
    """
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    cache_dtype = str(cc.cache_dtype)
    dtype: torch.dtype | str = mc.dtype if cache_dtype == "auto" else _FP8.get(cache_dtype, "")
    if not dtype:
        raise ConnectorConfigError(f"kv-cache-dtype {cache_dtype} has no KVSP dtype")
    local = Path(mc.model).is_dir()
    model_id = settings.model_id or ("local" if local else mc.model)
    if settings.revision is not None:
        revision = settings.revision
    elif local:
        revision = directory_revision(mc.model)
    else:
        revision = mc.revision or "main"
    try:
        return model_descriptor(
            mc.hf_config,
            model_id=model_id,
            revision=revision,
            dtype=dtype,
            block_tokens=int(cc.block_size),
        )
    except ValueError as exc:
        raise ConnectorConfigError(f"cannot describe the engine's KV cache: {exc}") from None


class KvcsConnector(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """kvcs as a vLLM v1 KV connector (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = parse_settings(tc.kv_role, tc.kv_connector_extra_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ConnectorConfigError(
                "KvcsConnector supports models with one full-attention KV cache group, "
                f"not {len(kv_cache_config.kv_cache_groups)}"
            )
        if self.settings.role.loads and tc.kv_load_failure_policy != "recompute":
            log.warning(
                "kvcs: kv_load_failure_policy is %r: a cache that fails to load or verify "
                "fails the request; set it to 'recompute' to recompute it instead",
                tc.kv_load_failure_policy,
            )
        self.descriptor_json = engine_descriptor(vllm_config, self.settings)
        self.descriptor = CompatibilityDescriptor(dict(self.descriptor_json))
        self.events = EventLog(self.settings.event_log)
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.loop = LoopThread(self.settings, name=f"kvcs-{side}")
        self.loop.submit(self._warm_up())
        self.planner: StepPlanner | None = None
        self.worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.planner = StepPlanner(
                self.settings.role,
                self.descriptor.block_tokens,
                Lookup(self.loop, self.descriptor, self.events),
            )
        else:
            self.worker = Worker(self.loop, self.descriptor, self.descriptor_json, self.events)
        self.events(
            "started",
            side=side,
            role=self.settings.role.name.lower(),
            relay=self.settings.relay,
            compat_id=self.descriptor.compat_id.hex(),
            block_tokens=self.descriptor.block_tokens,
        )

    async def _warm_up(self) -> None:
        """Connect to the relay early (the first lookup or publication need not wait for the
        handshake); a failure here is retried at first use."""
        try:
            await self.loop.client()
        except Exception as exc:
            log.warning("kvcs: relay %s not reachable yet: %s", self.settings.relay, exc)

    # ---- worker side ---------------------------------------------------------------------

    def _w(self) -> Worker:
        assert self.worker is not None, "a worker-side method on the scheduler-side connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcsConnectorMetadata)
        worker = self._w()
        worker.start_loads(meta.loads)
        worker.start_saves(meta.saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w().wait_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._w().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._w().wait_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().load_errors()

    def shutdown(self) -> None:
        self.loop.close()

    # ---- scheduler side ------------------------------------------------------------------

    def _p(self) -> StepPlanner:
        assert self.planner is not None, "a scheduler-side method on a worker-side connector"
        return self.planner

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        n = self._p().matched(request.request_id, prompt, num_computed_tokens)
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._p().allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        counts = scheduler_output.num_scheduled_tokens
        new = [
            NewRequest(
                r.req_id,
                tuple(r.prompt_token_ids or ()),
                tuple(r.block_ids[0]) if r.block_ids else (),
                r.num_computed_tokens,
                counts.get(r.req_id, 0),
            )
            for r in scheduler_output.scheduled_new_reqs
        ]
        c = scheduler_output.scheduled_cached_reqs
        cached = []
        for i, req_id in enumerate(c.req_ids):
            groups = c.new_block_ids[i]
            cached.append(
                CachedRequest(
                    req_id,
                    None if groups is None else tuple(groups[0]),
                    req_id in c.resumed_req_ids,
                    c.num_computed_tokens[i],
                    counts.get(req_id, 0),
                )
            )
        loads, saves = self._p().build(new, cached)
        return KvcsConnectorMetadata(loads, saves)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._p().finished(request.request_id)
        return False, None
