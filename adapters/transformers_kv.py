"""Hugging Face transformers (5.x) models and their KV caches <-> kvcs publications.

Theory of operation
-------------------
This adapter joins three things: a transformers 5.x causal LM, whose cache is a
:class:`transformers.DynamicCache` (``cache.layers[l].keys`` / ``.values``, each
``[batch, kv_heads, seq, head_dim]``); the torch adapter
(:mod:`kvcs.adapters.torch_kv`: ``layer_sections`` and ``TorchKvDestination``);
and the publisher and consumer of :mod:`kvcs.transports.quic.api`. It does no
I/O itself: the caller runs the model and the event loop.

**Descriptor.** :func:`model_descriptor` builds the KVSP Compatibility
Descriptor of a model's cache from its config: ``model`` is ``"<id>@<revision>"``
(for a local directory :func:`directory_revision` gives a SHA-256 over the config
and weight files, so two copies of the same weights match and any change of them
does not), ``layers``, ``kv_heads``, ``head_dim``, ``dtype`` of the loaded model,
and in ``extra`` everything else of the config that changes K/V values: the
model type, the RoPE parameters (scaling type and factors, theta), partial rotary
factors, sliding windows and layer types, QK norms. Floats are written as
decimal strings (a descriptor holds no floating-point numbers).

**Publishing during prefill** (:class:`PrefillTap`). A forward hook on every
decoder layer fires as soon as that layer has run; by then the layer has written
its K and V into ``cache.layers[l]``. The hook turns them into K/V sections
(``torch_kv.layer_sections``: one gather copy into section order, so later
growth of the cache cannot change what is published) and hands
``(layer, sections)`` to a ``sink``. The forward pass runs in a worker thread;
the sink is a thread-safe handoff into the event loop (``loop.call_soon_threadsafe``
or ``trio.from_thread``), where a coroutine awaits ``CachePublication.put_layer``
for each layer in order. The hook never waits for the network: layer ``l`` is in
the loop's hands when the hook returns, and the model goes on with layer
``l + 1`` while layer ``l`` is sent. Backpressure (``put_layer`` waiting while too
much is queued) holds back the loop side only; the handoff holds at most one
layer's sections per layer of the model.

**Consuming while computing** (:class:`StreamedCache`, :class:`LayerFeed`). A
``StreamedCache`` is a ``DynamicCache`` whose layers report the cached prefix
length at once (so position ids and masks are right before anything arrived)
and, on their first ``update`` (the moment decoder layer ``l`` needs its past
keys), block until the retrieval has reported layer ``l`` usable, then take the
received K and V (``TorchKvDestination.layer``) and append the new tokens' K/V.
The loop side calls :meth:`LayerFeed.ready` for each layer the retrieval yields
(``async for layer in retrieval``); the forward pass over the uncached tokens
runs in a worker thread and proceeds layer by layer as the cache arrives. A
layer that will not arrive (:meth:`LayerFeed.fail`) or does not arrive in time
raises :class:`CacheUnavailable` in the forward pass.

**Whole caches.** :func:`dynamic_cache` builds a ready ``DynamicCache`` from a
complete destination; :func:`q8_layer_into` decodes a layer received on the
joint ``kv.q8`` track into a destination's raw sections.

**transformers' sharp edges.** 5.24 renamed the forward/generate argument
``past_key_values`` to ``cache``, and earlier 5.x releases silently ignore an
unknown ``cache=`` (the model then recomputes from nothing): always pass the
cache through :func:`cache_kwargs`, which asks the model's signature.
``generate()`` needs the cache to cover ``input_ids[:, :-1]`` (it computes at
least the last prompt token itself): :func:`reusable_tokens` gives the longest
full-block prefix that leaves the last token out.

Only full-attention layers are supported (``DynamicLayer``); a model with sliding
window or linear-attention cache layers is refused with ``ValueError``. Batch
size is 1.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch
from transformers import DynamicCache  # type: ignore[import-not-found, unused-ignore]
from transformers.cache_utils import (  # type: ignore[import-not-found, unused-ignore]
    Cache,
    DynamicLayer,
)

from kvcs.adapters.numpy_kv import q8_decode_section
from kvcs.adapters.torch_kv import TorchKvDestination, layer_sections
from kvcs_core.kvsp.codecs import q8_size
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

__all__ = [
    "DTYPE_NAMES",
    "CacheUnavailable",
    "ComputeTrace",
    "LayerFeed",
    "PrefillTap",
    "Q8Staging",
    "StreamedCache",
    "cache_argument",
    "cache_kwargs",
    "decoder_layers",
    "directory_revision",
    "dynamic_cache",
    "model_descriptor",
    "q8_layer_into",
    "reusable_tokens",
    "trimmed_cache",
]

DTYPE_NAMES: Final[Mapping[torch.dtype, str]] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
"""KVSP dtype names of the torch dtypes a cache may have."""

_VALUE_KEYS: Final = (
    "model_type",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "rotary_pct",
    "sliding_window",
    "layer_types",
    "use_qk_norm",
    "qk_layernorm",
    "attention_multiplier",
    "query_pre_attn_scalar",
    "position_embedding_type",
    "max_position_embeddings",
)
"""Config members that change K/V values (beyond the weights), copied into ``extra``."""

_CHUNK: Final = 1 << 20


class CacheUnavailable(RuntimeError):
    """A layer the forward pass needs will not arrive (or did not arrive in time)."""


# --- descriptors ---------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    """A config value as a descriptor holds it: floats as decimal strings, tuples as lists."""
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return str(value)


def directory_revision(directory: str | Path) -> str:
    """``"sha256:<hex>"`` over a model directory's ``config.json`` and weight files.

    The files are ``config.json``, ``*.safetensors`` and ``*.bin`` at the top of the
    directory, in name order, each hashed as its name, its length and its bytes. The
    same weights give the same revision wherever the directory lies.

    Raises:
        OSError: a file cannot be read.
        ValueError: no config.json or no weight file.
    """
    root = Path(directory)
    files = sorted(
        p
        for p in root.iterdir()
        if p.is_file() and (p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    )
    names = {p.name for p in files}
    if "config.json" not in names or len(files) < 2:
        raise ValueError(f"{root}: not a model directory (config.json and weight files)")
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def model_descriptor(
    config: Any,
    *,
    model_id: str,
    revision: str,
    dtype: torch.dtype | str,
    block_tokens: int = 16,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """The KVSP Compatibility Descriptor of a model's KV cache (a JSON object).

    Args:
        config: the model's ``PretrainedConfig`` (``model.config``).
        model_id: the model's name (e.g. ``"meta-llama/Llama-3.2-1B"``).
        revision: the weights' revision (a commit, or :func:`directory_revision`).
        dtype: the cache's element type (``model.dtype``, or a KVSP name).
        block_tokens: tokens per block (default 16).
        tokenizer: an identity of the tokenizer, if any.

    Raises:
        ValueError: a dtype KVSP has no name for, or a config without the sizes.
    """
    text = _text_config(config)
    name = DTYPE_NAMES.get(dtype) if isinstance(dtype, torch.dtype) else dtype
    if name is None:
        raise ValueError(f"no KVSP dtype for {dtype}")
    try:
        layers = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"the config does not give the cache's sizes: {exc}") from None
    keys: tuple[str, ...] = _VALUE_KEYS
    if getattr(text, "rope_parameters", None) is not None:  # 5.x: rope_scaling is its alias
        keys = tuple(k for k in keys if k not in ("rope_scaling", "rope_theta"))
    extra = {
        key: _json_value(getattr(text, key)) for key in keys if getattr(text, key, None) is not None
    }
    fields: dict[str, Any] = {
        "model": f"{model_id}@{revision}",
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": name,
        "block_tokens": block_tokens,
        "extra": extra,
    }
    if tokenizer is not None:
        fields["tokenizer"] = tokenizer
    cd = CompatibilityDescriptor.create(**fields)
    return dict(cd.to_json())


# --- transformers' API --------------------------------------------------------------------


def cache_argument(model: Any) -> str:
    """The name under which ``model``'s forward takes the cache: ``"cache"`` (5.24 and
    later) or ``"past_key_values"`` (earlier 5.x, which ignore an unknown ``cache=``)."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise ValueError(f"{type(model).__name__}.forward takes no cache argument")


def cache_kwargs(model: Any, cache: Cache | None) -> dict[str, Any]:
    """``{name: cache}`` for ``model(**...)`` and ``model.generate(**...)``."""
    return {cache_argument(model): cache}


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """The decoder layers of a causal LM, in order (``model.model.layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found")
    return list(layers)


def _check_full_attention(config: Any) -> None:
    text = _text_config(config)
    kinds = getattr(text, "layer_types", None) or ()
    other = sorted({k for k in kinds if k != "full_attention"})
    if other or (
        getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    ):
        raise ValueError(
            "only full-attention caches are supported "
            f"(this model has {other or 'a sliding window'})"
        )


def reusable_tokens(prompt_tokens: int, block_tokens: int) -> int:
    """Tokens of a prompt whose cache ``generate()`` can reuse: the full blocks of
    ``input_ids[:, :-1]`` (``generate`` computes at least the last prompt token)."""
    return max(prompt_tokens - 1, 0) // block_tokens * block_tokens


# --- producer: publishing during prefill ------------------------------------------------------


Sink = Callable[[int, Any], None]
"""``sink(layer, sections)``: receives each layer's sections from the forward thread."""


class PrefillTap:
    """Forward hooks that hand each decoder layer's K/V sections to ``sink`` as soon as the
    layer has run (publishing during prefill).

    Use as a context manager around one forward pass that writes into ``cache``::

        cache = DynamicCache(config=model.config)
        with PrefillTap(model, cache, descriptor, sink):
            model(input_ids, **cache_kwargs(model, cache), use_cache=True)

    Args:
        model: the causal LM.
        cache: the ``DynamicCache`` the forward pass fills (batch 1).
        descriptor: the publication's descriptor (:func:`model_descriptor`).
        sink: called in the forward's thread with ``(layer, LayerSections)``; it must
            not block on the network (hand over to the event loop).
        tokens: tokens to publish (a multiple of ``block_tokens``; default: every full
            block of the cache).
        pace: seconds to sleep after each layer (simulates a slower prefill; default 0).
        clock: the clock of :attr:`events` (default ``time.perf_counter``).

    Attributes:
        events: ``("published", layer, t)`` for each layer handed to ``sink``.
    """

    def __init__(
        self,
        model: Any,
        cache: Cache,
        descriptor: Mapping[str, Any],
        sink: Sink,
        *,
        tokens: int | None = None,
        pace: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        _check_full_attention(model.config)
        self.cd = CompatibilityDescriptor(dict(descriptor))
        self.cache = cache
        self.sink = sink
        self.tokens = tokens
        self.pace = pace
        self.clock = clock
        self.events: list[tuple[str, int, float]] = []
        self._layers = decoder_layers(model)
        if len(self._layers) != self.cd.layers:
            raise ValueError(
                f"the model has {len(self._layers)} decoder layers, the descriptor {self.cd.layers}"
            )
        self._handles: list[Any] = []

    def _hook(self, layer: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            entry: Any = self.cache.layers[layer]
            k, v = entry.keys, entry.values
            if k is None or v is None or k.dim() != 4 or k.shape[0] != 1:
                raise ValueError(f"layer {layer}: no batch-1 K/V in the cache after the layer ran")
            n = self.tokens if self.tokens is not None else k.shape[2]
            n = n // self.cd.block_tokens * self.cd.block_tokens
            sections = layer_sections(
                k[0, :, :n].contiguous(), v[0, :, :n].contiguous(), self.cd, layout="HND"
            )
            self.events.append(("published", layer, self.clock()))
            self.sink(layer, sections)
            if self.pace:
                time.sleep(self.pace)

        return hook

    def __enter__(self) -> PrefillTap:
        for i, module in enumerate(self._layers):
            self._handles.append(module.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# --- consumer: computing while the cache arrives ----------------------------------------------


class Q8Staging:
    """Buffers for the joint ``kv.q8`` track: the ``destinations`` of a q8 retrieval.

    Each layer's buffer holds ``blocks`` q8 Data back to back (quantized K then V);
    :func:`q8_layer_into` decodes a usable layer into a destination's raw sections.
    """

    def __init__(self, descriptor: CompatibilityDescriptor, tokens: int) -> None:
        self.cd = descriptor
        self.blocks = tokens // descriptor.block_tokens
        self.each = q8_size(descriptor.section_shape)
        self._bufs = [bytearray(self.blocks * 2 * self.each) for _ in range(descriptor.layers)]

    def buffer(self, layer: int, component: Any) -> memoryview:
        """The ``destinations`` callable of ``retrieve_cache`` (component ``kv``)."""
        return memoryview(self._bufs[layer])

    def data(self, layer: int) -> memoryview:
        return memoryview(self._bufs[layer])


def q8_layer_into(staging: Q8Staging, layer: int, dest: TorchKvDestination) -> None:
    """Decode ``layer`` of a q8 retrieval into ``dest``'s K and V buffers (the descriptor
    dtype, as ``kvcs_core.kvsp.q8_decode`` gives it), before ``dest.layer_ready``."""
    cd = staging.cd
    size = cd.section_size
    data = staging.data(layer)
    k_out = dest.buffer(layer, "k")
    v_out = dest.buffer(layer, "v")
    for block in range(staging.blocks):
        at = block * 2 * staging.each
        part = slice(block * size, (block + 1) * size)
        q8_decode_section(data[at : at + staging.each], cd, out=k_out[part])
        q8_decode_section(data[at + staging.each : at + 2 * staging.each], cd, out=v_out[part])


class LayerFeed:
    """Received layers handed from the event loop to a forward pass in another thread.

    The loop calls :meth:`ready` for each layer the retrieval reports usable (after
    decoding, for q8) and :meth:`fail` when the retrieval ends without some layers; the
    forward thread calls :meth:`get`, which waits for the layer.

    Attributes:
        events: ``("arrived", layer, t)`` from :meth:`ready` and ``("taken", layer, t)``
            when the forward pass took the layer, in the order they happened.
    """

    def __init__(
        self,
        dest: TorchKvDestination,
        layers: int,
        *,
        timeout: float = 120.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.dest = dest
        self.timeout = timeout
        self.clock = clock
        self.events: list[tuple[str, int, float]] = []
        self._ready = [threading.Event() for _ in range(layers)]
        self._failed: str | None = None
        self._lock = threading.Lock()

    def _record(self, what: str, layer: int) -> None:
        with self._lock:
            self.events.append((what, layer, self.clock()))

    def ready(self, layer: int) -> None:
        self.dest.layer_ready(layer)
        self._record("arrived", layer)
        self._ready[layer].set()

    def fail(self, reason: str) -> None:
        """Every layer not yet ready will not be: waiting forward passes raise."""
        self._failed = reason
        for e in self._ready:
            e.set()

    def get(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``tokens`` tokens of ``layer``, ``[1, kv_heads, tokens,
        head_dim]``, once usable.

        Raises:
            CacheUnavailable: the layer will not arrive, or not within ``timeout``.
        """
        event = self._ready[layer]
        if not event.wait(self.timeout):
            raise CacheUnavailable(f"layer {layer} did not arrive within {self.timeout:g} s")
        if not self.dest_has(layer):
            raise CacheUnavailable(f"layer {layer} will not arrive: {self._failed}")
        self.dest.wait_layer(layer)
        k, v = self.dest.layer(layer, "HND")
        self._record("taken", layer)
        return k[:, :tokens].unsqueeze(0), v[:, :tokens].unsqueeze(0)

    def dest_has(self, layer: int) -> bool:
        return any(e[0] == "arrived" and e[1] == layer for e in self.events)


class ComputeTrace:
    """Forward hooks recording ``("computed", layer, t)`` into ``feed.events`` when a
    decoder layer finishes its first forward pass (the pass over the uncached tokens; a
    context manager), to show that pass proceeding while later layers still arrive."""

    def __init__(self, model: Any, feed: LayerFeed) -> None:
        self.feed = feed
        self._layers = decoder_layers(model)
        self._handles: list[Any] = []
        self._seen: set[int] = set()

    def __enter__(self) -> ComputeTrace:
        for i, module in enumerate(self._layers):

            def hook(module: Any, args: Any, output: Any, i: int = i) -> None:
                if i not in self._seen:
                    self._seen.add(i)
                    self.feed._record("computed", i)

            self._handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _StreamedLayer(DynamicLayer):  # type: ignore[misc, no-untyped-call, unused-ignore]
    """A full-attention cache layer whose first ``prefix`` tokens come from a feed."""

    def __init__(self, index: int, prefix: int, feed: LayerFeed) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self.index = index
        self.prefix = prefix
        self.feed = feed

    def get_seq_length(self) -> int:
        if not self.is_initialized:  # type: ignore[has-type, unused-ignore]
            return self.prefix
        return int(super().get_seq_length())

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:  # type: ignore[has-type, unused-ignore]
            k, v = self.feed.get(self.index, self.prefix)
            self.device = key_states.device
            self.keys = k.to(key_states.device, key_states.dtype)
            self.values = v.to(value_states.device, value_states.dtype)
            self.is_initialized = True
        out: tuple[torch.Tensor, torch.Tensor] = super().update(
            key_states, value_states, *args, **kwargs
        )
        return out


class StreamedCache(DynamicCache):  # type: ignore[misc, unused-ignore]
    """A ``DynamicCache`` whose first ``prefix`` tokens arrive over the network, layer by
    layer: decoder layer ``l`` waits (in its ``update``) until layer ``l`` is usable.

    Pass it to ``model(...)`` or ``model.generate(...)`` through :func:`cache_kwargs`,
    with ``input_ids`` the whole prompt (``generate``) or the uncached tokens (forward).
    """

    def __init__(self, config: Any, prefix: int, feed: LayerFeed) -> None:
        _check_full_attention(config)
        count = int(_text_config(config).num_hidden_layers)
        Cache.__init__(self, layers=[_StreamedLayer(i, prefix, feed) for i in range(count)])


def _kv_of(entry: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = getattr(entry, "keys", None), getattr(entry, "values", None)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ValueError(f"layer {layer} of the cache holds no K/V tensors")
    return k, v


def trimmed_cache(cache: Cache, config: Any, tokens: int) -> DynamicCache:
    """A new ``DynamicCache`` holding the first ``tokens`` tokens of ``cache`` (views):
    e.g. a prefill cache cut to ``input_ids[:, :-1]`` for ``generate()``."""
    out = DynamicCache(config=config)
    for layer, entry in enumerate(cache.layers):
        k, v = _kv_of(entry, layer)
        out.update(k[:, :, :tokens], v[:, :, :tokens], layer)
    return out


def dynamic_cache(dest: TorchKvDestination, config: Any, tokens: int) -> DynamicCache:
    """A ready ``DynamicCache`` holding the first ``tokens`` tokens of every layer of a
    complete destination (views of its tensors where the torch adapter gives views)."""
    cache = DynamicCache(config=config)
    for layer in range(int(_text_config(config).num_hidden_layers)):
        dest.wait_layer(layer)
        k, v = dest.layer(layer, "HND")
        cache.update(k[:, :tokens].unsqueeze(0), v[:, :tokens].unsqueeze(0), layer)
    return cache
