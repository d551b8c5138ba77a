"""kvcs: stream LLM KV caches layer by layer over MOQT (draft-ietf-moq-transport-22).

This module is the public, typed API (asyncio). ``import kvcs`` gives:

* **Sessions over QUIC** (asyncio; the same pair on trio is :mod:`kvcs.trio`):
  :func:`serve_relay` hosts a caching relay (a :class:`RelayServer`), and
  :func:`connect` opens a MOQT session (a :class:`MoqtClient`). A client
  publishes (:meth:`MoqtClient.publish_cache` gives a :class:`CachePublication`:
  ``put_layer`` per layer, then ``finish``) or retrieves
  (:meth:`MoqtClient.retrieve_cache` gives a :class:`CacheRetrieval`: ``async for
  layer in retrieval`` yields each layer once it is usable, ``result()`` returns
  the :class:`RetrievalComplete`; :class:`RecomputeNeeded` lists what will not
  arrive).
* **Options**: :class:`TlsConfig` and :func:`self_signed` (certificates and
  trust), :class:`Backoff` (reconnection), :class:`RelayConfig` (the relay's
  bounds), :class:`ConsumerConfig` and :class:`TrackSelection` (a retrieval's
  bounds and tracks), :class:`IndexOptions` (how a retrieval uses the KVSP
  index to find a publication that only partly shares its prompt),
  :class:`TrackOffer` (a publication's tracks), :class:`ManifestSigner` (a
  signed manifest).
* **The cache**: :class:`CompatibilityDescriptor` (the KVSP descriptor: model,
  layers, heads, dtype, block size); the numpy adapter :func:`layer_sections`
  (engine arrays to K/V sections, zero-copy where it can) and
  :class:`KvDestination` (preallocated arrays the retrieval writes into); cache
  files: :func:`load`, :func:`save` (``.npz`` or ``.safetensors``),
  :class:`CacheFile`, :func:`synthetic` and :func:`llama_descriptor`.
* **Errors**, each with a one-line message: :class:`ConnectError` (network,
  setup, a lost session), :class:`TlsError`, :class:`UrlError`,
  :class:`StackUnavailable` (an unknown or missing QUIC stack),
  :class:`RetrievalFailed`, :class:`CacheFileError`, :class:`DescriptorError`,
  :class:`PublisherError` (layers out of order, sections that do not fit) and
  :class:`LocalProtocolError` (a command the session's state does not allow).

Below this API: ``kvcs.transports`` (the QUIC and loopback bindings, the
``kvcs`` command), ``kvcs.adapters`` (numpy, cache files) and the pure, sans-I/O
core ``kvcs_core``, which the names above come from.

Importing :mod:`kvcs` is cheap: each name is imported from its module the first time it
is used (PEP 562), so a process that never touches, say, the numpy adapter never imports
numpy (a relay holds no arrays: it saves the interpreter about 20 MiB and the start-up
its import costs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each name is, for type checkers and IDEs
    from kvcs.adapters.cachefile import CacheFile, llama_descriptor, load, save, synthetic
    from kvcs.adapters.files import CacheFileError
    from kvcs.adapters.numpy_kv import KvDestination, LayerSections, layer_sections
    from kvcs.transports.quic.api import (
        CachePublication,
        CacheRetrieval,
        ConnectError,
        MoqtClient,
        RelayServer,
        RetrievalFailed,
    )
    from kvcs.transports.quic.asyncio_binding import connect, serve_relay
    from kvcs.transports.quic.config import UrlError
    from kvcs.transports.quic.reconnect import Backoff
    from kvcs.transports.quic.stack import StackUnavailable
    from kvcs.transports.quic.tls import TlsConfig, TlsError, self_signed
    from kvcs_core.kvcs.consumer import (
        ConsumerConfig,
        IndexOptions,
        LayerReady,
        RecomputeNeeded,
        RetrievalComplete,
        TrackSelection,
    )
    from kvcs_core.kvcs.publisher import ManifestSigner, PublisherError, TrackOffer
    from kvcs_core.kvsp import CompatibilityDescriptor, DescriptorError
    from kvcs_core.moqt.errors import LocalProtocolError
    from kvcs_core.relay.config import RelayConfig

_HOMES: dict[str, str] = {
    "Backoff": "kvcs.transports.quic.reconnect",
    "CacheFile": "kvcs.adapters.cachefile",
    "CacheFileError": "kvcs.adapters.files",
    "CachePublication": "kvcs.transports.quic.api",
    "CacheRetrieval": "kvcs.transports.quic.api",
    "CompatibilityDescriptor": "kvcs_core.kvsp",
    "connect": "kvcs.transports.quic.asyncio_binding",
    "ConnectError": "kvcs.transports.quic.api",
    "ConsumerConfig": "kvcs_core.kvcs.consumer",
    "DescriptorError": "kvcs_core.kvsp",
    "IndexOptions": "kvcs_core.kvcs.consumer",
    "KvDestination": "kvcs.adapters.numpy_kv",
    "layer_sections": "kvcs.adapters.numpy_kv",
    "LayerReady": "kvcs_core.kvcs.consumer",
    "LayerSections": "kvcs.adapters.numpy_kv",
    "llama_descriptor": "kvcs.adapters.cachefile",
    "load": "kvcs.adapters.cachefile",
    "LocalProtocolError": "kvcs_core.moqt.errors",
    "ManifestSigner": "kvcs_core.kvcs.publisher",
    "MoqtClient": "kvcs.transports.quic.api",
    "PublisherError": "kvcs_core.kvcs.publisher",
    "RecomputeNeeded": "kvcs_core.kvcs.consumer",
    "RelayConfig": "kvcs_core.relay.config",
    "RelayServer": "kvcs.transports.quic.api",
    "RetrievalComplete": "kvcs_core.kvcs.consumer",
    "RetrievalFailed": "kvcs.transports.quic.api",
    "save": "kvcs.adapters.cachefile",
    "self_signed": "kvcs.transports.quic.tls",
    "serve_relay": "kvcs.transports.quic.asyncio_binding",
    "StackUnavailable": "kvcs.transports.quic.stack",
    "synthetic": "kvcs.adapters.cachefile",
    "TlsConfig": "kvcs.transports.quic.tls",
    "TlsError": "kvcs.transports.quic.tls",
    "TrackOffer": "kvcs_core.kvcs.publisher",
    "TrackSelection": "kvcs_core.kvcs.consumer",
    "UrlError": "kvcs.transports.quic.config",
}
"""Where each public name lives (its module is imported on first use)."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvcs' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Backoff",
    "CacheFile",
    "CacheFileError",
    "CachePublication",
    "CacheRetrieval",
    "CompatibilityDescriptor",
    "ConnectError",
    "ConsumerConfig",
    "DescriptorError",
    "IndexOptions",
    "KvDestination",
    "LayerReady",
    "LayerSections",
    "LocalProtocolError",
    "ManifestSigner",
    "MoqtClient",
    "PublisherError",
    "RecomputeNeeded",
    "RelayConfig",
    "RelayServer",
    "RetrievalComplete",
    "RetrievalFailed",
    "StackUnavailable",
    "TlsConfig",
    "TlsError",
    "TrackOffer",
    "TrackSelection",
    "UrlError",
    "connect",
    "layer_sections",
    "llama_descriptor",
    "load",
    "save",
    "self_signed",
    "serve_relay",
    "synthetic",
]
