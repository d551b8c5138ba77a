"""KV caches as torch tensors (CPU or CUDA) <-> KVSP K/V sections, with every copy explicit.

Theory of operation
-------------------
The torch twin of :mod:`kvcs.adapters.numpy_kv` (read its theory of operation
first: section order, layouts and ownership are the same). The core sees only
bytes; this module is where an engine's torch KV cache becomes the K and V
sections of ``KVSP-BINDING.md`` section 5 (publisher side) and where verified
Object Data becomes engine tensors again (consumer side). STYLE.md R13 rules:
zero-copy views where the memory layout allows, every copy at a call the user
can see and documented here, a non-contiguous tensor is an error (calling
``.contiguous()`` is the caller's choice), and device-to-host or host-to-device
transfers happen only in this module.

**Section order** (binding section 5): one block's section is ``[kv_heads,
block_tokens, head_dim]`` in C order, little-endian elements of the descriptor
``dtype``; a layer's blocks back to back are ``[blocks, kv_heads, B, head_dim]``
(``B = block_tokens``), which is the page layout of a paged "HND" cache.

**Element types.** ``float32`` and ``float16`` are carried as they are;
``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2`` go through integer views of
the same bits (``int16``, ``uint8``): reinterpretations, never conversions, so
the sections are the numpy adapter's bytes bit for bit (NaN payloads
included). Tensors of the real torch dtype are accepted, and so are tensors of
the raw integer dtype of the same item size (``int16``/``uint16`` for bfloat16,
``uint8`` for float8). torch tensors are in native byte order; this module
refuses to run on a big-endian host (sections are little-endian).

**Layouts accepted** (``H`` = ``kv_heads``, ``D`` = ``head_dim``):

==============================  ======================  ===============================
input                           zero-copy (CPU) when    otherwise
==============================  ======================  ===============================
``layer_sections`` HND          H == 1, or one block    one gather copy per component
``[H, tokens, D]``              that is the whole axis
``layer_sections`` NHD          H == 1, or B == 1       one gather copy per component
``[tokens, H, D]``
``page_sections`` HND pages     always (CPU)            --
``[pages, H, page_size, D]``
``page_sections`` NHD pages     H == 1, or B == 1       one gather copy per page
``[pages, page_size, H, D]``
``paged_layer_sections``        never                   one gather (advanced indexing
(either page order, any                                 through the slot mapping) per
page size, slot mapping)                                component
==============================  ======================  ===============================

On CPU every copy and gather runs through numpy views of the same memory
(``np.copyto``, numpy advanced indexing): single-threaded and, on a loaded
machine, several times faster than torch's pooled copies
(``benchmarks/bench_torch_adapter.py``); on CUDA they are torch's.

A slot mapping gives, for every token ``t``, its slot ``page * page_size +
offset`` in the paged cache (vLLM's ``slot_mapping``);
:func:`slots_from_page_table` builds one from a page (block) table.

**CUDA tensors, publisher side.** :func:`layer_sections` /
:func:`page_sections` / :func:`paged_layer_sections` on CUDA tensors do the
gather (when the layout needs one) on the device, then exactly one blocking
device-to-host copy into new host memory (or ``out``). To overlap that copy with
compute, :class:`TorchLayerPublisher` enqueues each layer's device-to-host copy
with ``non_blocking=True`` on a side stream into a pinned host buffer and
records a CUDA event; a layer is handed out for publishing (:meth:`~TorchLayerPublisher.ready`)
once its event has completed. The publication holds the sections by reference
for its whole life (late consumers FETCH them), so a pinned buffer given out is
never reused; at most ``max_in_flight`` copies are outstanding.

**Consumer side.** :class:`TorchKvDestination` preallocates the whole cache in
section order on ``device`` (``[layers, 2, blocks * section_size]`` octets), so
every layer's K and V are views of it: :meth:`~TorchKvDestination.paged` (always
a view), :meth:`~TorchKvDestination.layer` (a view when the layout allows it,
as ``KvDestination.as_engine_arrays``; otherwise one copy), or a scatter into
an engine's own paged cache (:meth:`~TorchKvDestination.scatter_into_pages`).

* CPU: :meth:`~TorchKvDestination.buffer` is a writable view of the device
  storage itself (zero-filled lazily by the OS, ``np.zeros`` shared with torch):
  the consumer's one copy from the wire lands in the final tensor;
  ``layer_ready`` has nothing to copy.
* CUDA, the ``buffer`` path (``retrieve_cache(destinations=dest.buffer)``): the
  consumer machine takes every layer's buffer once, when the retrieval starts,
  and may write any layer at any time (layers arrive interleaved), so each
  layer needs its own host staging: one pinned host buffer per layer (the whole
  cache in pinned memory, allocated on the first ``buffer`` call of the layer
  and never reused). ``layer_ready(l)`` enqueues the layer's host-to-device
  copy with ``non_blocking=True`` on the destination's side stream and records
  the layer's CUDA event; ``wait_layer(l)`` makes the current stream wait for
  that event (the host does not block).
* CUDA, the ``write`` path (:meth:`~TorchKvDestination.write`, one call per
  verified Object, e.g. from ``retrieval.consumer.data(layer, component, block)``
  when no destinations are given; ``q8`` Data is decoded in place of the copy): the Data is copied
  into the next slot of a bounded, reused ring of
  ``ring_slots`` pinned section buffers and copied at once to its block's place
  on the device on the side stream; each slot remembers the CUDA event of its
  last copy, and :meth:`_PinnedRing.acquire` waits for that event before the
  slot is written again, so no pinned buffer is reused before its copy has
  finished. ``layer_ready`` then only records the layer's event.

**CUDA is untested on the machine this was written on** (no GPU): the CUDA
tests in ``tests/test_adapter_torch.py`` skip there and run where
``torch.cuda.is_available()``.

**Ownership.** Views returned from engine tensors alias the engine's memory
(the engine must not overwrite those tokens until they are sent); gathered
host buffers belong to the returned memoryviews (numpy and torch keep them
alive). A :class:`TorchKvDestination` owns its storage and staging; tensors and
memoryviews taken from it keep them alive and see later writes.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

import numpy as np
import torch

from kvcs.adapters.numpy_kv import (
    LayerSections,
    Layout,
    _check_blocks,
    _check_layout,
    _component,
    q8_decode_section,
)
from kvcs_core.kvcs.names import Component
from kvcs_core.kvsp.codecs import Codec, codec_from_value, q8_size
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.kvsp.dtypes import Dtype
from kvcs_core.kvsp.errors import SectionError

__all__ = [
    "LayerSections",
    "Layout",
    "TorchKvDestination",
    "TorchLayerPublisher",
    "layer_sections",
    "page_sections",
    "paged_layer_sections",
    "slots_from_page_table",
    "torch_dtype",
]

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch build is in use
    raise ImportError("kvcs.adapters.torch_kv needs a little-endian host (sections are LE)")

_TORCH: Final[dict[Dtype, torch.dtype]] = {
    Dtype.FLOAT32: torch.float32,
    Dtype.FLOAT16: torch.float16,
    Dtype.BFLOAT16: torch.bfloat16,
    Dtype.FLOAT8_E4M3FN: torch.float8_e4m3fn,
    Dtype.FLOAT8_E5M2: torch.float8_e5m2,
}
_BITS: Final[dict[Dtype, torch.dtype]] = {
    Dtype.FLOAT32: torch.int32,
    Dtype.FLOAT16: torch.int16,
    Dtype.BFLOAT16: torch.int16,
    Dtype.FLOAT8_E4M3FN: torch.uint8,
    Dtype.FLOAT8_E5M2: torch.uint8,
}
_RAW_ALIASES: Final[dict[Dtype, tuple[torch.dtype, ...]]] = {
    Dtype.FLOAT32: (),
    Dtype.FLOAT16: (),
    Dtype.BFLOAT16: (torch.int16, torch.uint16),
    Dtype.FLOAT8_E4M3FN: (torch.uint8,),
    Dtype.FLOAT8_E5M2: (torch.uint8,),
}


def torch_dtype(dtype: Dtype | str) -> torch.dtype:
    """The torch dtype of a descriptor ``dtype`` (``"bfloat16"`` -> ``torch.bfloat16``, ...)."""
    return _TORCH[Dtype(dtype)]


# --------------------------------------------------------------------------- checks


def _new_event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call,unused-ignore]


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call,unused-ignore]


def _done(event: torch.cuda.Event | None) -> bool:
    """Whether the work before ``event`` has completed (``None``: nothing was queued)."""
    return event is None or bool(event.query())  # type: ignore[no-untyped-call,unused-ignore]


def _device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} asked for, but torch.cuda.is_available() is false")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:n]', not {str(dev)!r}")
    return dev


def _bits(t: torch.Tensor, dtype: Dtype, what: str) -> torch.Tensor:
    """``t`` reinterpreted as the integer dtype that carries ``dtype`` (a view, no copy)."""
    if t.dtype != _TORCH[dtype] and t.dtype not in _RAW_ALIASES[dtype]:
        raw = ", ".join(str(a) for a in _RAW_ALIASES[dtype])
        also = f" (or its raw bits as {raw})" if raw else ""
        raise ValueError(
            f"{what} has dtype {t.dtype}, but the descriptor dtype {dtype.value} needs "
            f"{_TORCH[dtype]}{also}"
        )
    return t if t.dtype == _BITS[dtype] else t.view(_BITS[dtype])


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(
            f"{what} is a {t.layout} tensor; only dense (strided) tensors are accepted"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} is on {t.device}; only CPU and CUDA tensors are accepted")
    if not t.is_contiguous():
        raise ValueError(
            f"{what} is not contiguous (strides {tuple(t.stride())}); the adapter never copies "
            f"silently: call {what}.contiguous() if a copy is what you want"
        )
    return t.detach()  # a view without autograd history: .numpy() refuses grad tensors


def _check_layer(
    t: object, descriptor: CompatibilityDescriptor, layout: str, what: str
) -> tuple[torch.Tensor, int]:
    """Validate one engine layer; return it as integer bits (a view) and its token count."""
    _check_layout(layout)
    tensor = _check_tensor(t, what)
    heads, head_dim = descriptor.kv_heads, descriptor.head_dim
    expect = "[kv_heads, tokens, head_dim]" if layout == "HND" else "[tokens, kv_heads, head_dim]"
    shape = tuple(tensor.shape)
    if tensor.dim() != 3:
        raise ValueError(f"{what} has shape {shape}; one {layout} layer is {expect}")
    h, tokens = (shape[0], shape[1]) if layout == "HND" else (shape[1], shape[0])
    if h != heads or shape[2] != head_dim:
        raise ValueError(
            f"{what} has shape {shape}; the descriptor needs {layout} {expect} with "
            f"kv_heads={heads}, head_dim={head_dim}"
        )
    return _bits(tensor, descriptor.dtype, what), tokens


def _check_pages(
    t: object, descriptor: CompatibilityDescriptor, page_layout: str, what: str
) -> torch.Tensor:
    """Validate a paged cache layer; return it as integer bits in HND page order (a view)."""
    _check_layout(page_layout)
    tensor = _check_tensor(t, what)
    h, d = descriptor.kv_heads, descriptor.head_dim
    shape = tuple(tensor.shape)
    ok = tensor.dim() == 4 and (
        (shape[1] == h and shape[3] == d)
        if page_layout == "HND"
        else (shape[2] == h and shape[3] == d)
    )
    if not ok:
        expect = (
            "[num_pages, kv_heads, page_size, head_dim]"
            if page_layout == "HND"
            else "[num_pages, page_size, kv_heads, head_dim]"
        )
        raise ValueError(
            f"{what} has shape {shape}; {page_layout} pages are {expect} with kv_heads={h}, "
            f"head_dim={d}"
        )
    bits = _bits(tensor, descriptor.dtype, what)
    return bits if page_layout == "HND" else bits.permute(0, 2, 1, 3)


def _section_order(bits: torch.Tensor, layout: str, first: int, n: int, b: int) -> torch.Tensor:
    """A *view* of blocks ``first..first+n-1`` of an engine layer as ``[n, H, B, D]``."""
    s, e = first * b, (first + n) * b
    if layout == "HND":
        h, _, d = bits.shape
        return bits[:, s:e, :].reshape(h, n, b, d).permute(1, 0, 2, 3)
    _, h, d = bits.shape
    return bits[s:e].reshape(n, b, h, d).permute(0, 2, 1, 3)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A flat byte ``memoryview`` of a contiguous CPU tensor (no copy; keeps it alive)."""
    flat = t.reshape(-1).view(torch.uint8)
    data: memoryview = flat.numpy().data  # typed so with and without torch's stubs
    return data


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` (same shape, integer bits): numpy's copy on CPU, ``copy_`` else.

    On CPU both are strided numpy views of the tensors' memory (no extra copy);
    ``np.copyto`` is single-threaded and kept pace with the memory bus in
    ``benchmarks/bench_torch_adapter.py``, where torch's pooled copy slowed down
    many times over on a loaded machine.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def _gather(hnd: torch.Tensor, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``hnd[p, h, s]`` (advanced indexing: a new contiguous tensor); numpy's on CPU."""
    if hnd.device.type == "cpu":  # several times faster than torch's here, as _copy
        return torch.from_numpy(hnd.numpy()[tuple(i.numpy() for i in index)])
    return hnd[index]


def _scatter(hnd: torch.Tensor, index: tuple[torch.Tensor, ...], src: torch.Tensor) -> None:
    """``hnd[p, h, s] = src`` in place (``hnd`` a view of the engine's pages)."""
    if hnd.device.type == "cpu":
        hnd.numpy()[tuple(i.numpy() for i in index)] = src.numpy()
    else:
        hnd[index] = src


def _host_out(out: object, size: int, what: str) -> torch.Tensor:
    """``out`` (a writable buffer or CPU tensor) as a flat uint8 CPU tensor of ``size`` octets."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"{what} must be a contiguous CPU tensor")
        flat = out.detach().reshape(-1).view(torch.uint8)
    else:
        try:
            view = memoryview(out)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                f"{what} must be a writable buffer or CPU tensor, not {type(out).__name__}"
            ) from None
        if view.readonly:
            raise ValueError(f"{what} is read-only")
        if not view.c_contiguous:
            raise ValueError(f"{what} is not a C-contiguous buffer")
        flat = torch.from_numpy(np.frombuffer(view.cast("B"), np.uint8))
    if flat.numel() != size:
        raise ValueError(f"{what} is {flat.numel()} octets, not {size}")
    return flat


def _to_host(src: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """``src`` ([n, H, B, D] bits, any device) as a contiguous CPU tensor; whether it copied.

    CPU: the tensor itself when already contiguous, else one gather copy (into
    ``out`` or a new tensor). CUDA: a device-side gather when needed, then one
    blocking device-to-host copy into ``out`` or new (pageable) host memory.
    """
    if src.device.type == "cpu" and src.is_contiguous():
        return src, False
    if src.device.type == "cuda" and not src.is_contiguous():
        src = src.contiguous()  # the device-side gather
    dst = (
        torch.empty(src.shape, dtype=src.dtype)
        if out is None
        else out.view(src.dtype).reshape(src.shape)
    )
    _copy(dst, src)  # CPU: the gather; CUDA: the blocking device-to-host copy
    return dst, True


def _sections(
    first: int, n: int, size: int, k: torch.Tensor, v: torch.Tensor, copied: bool
) -> LayerSections:
    k_data, v_data = _bytes_of(k), _bytes_of(v)
    return LayerSections(
        first_block=first,
        k=tuple(k_data[i * size : (i + 1) * size] for i in range(n)),
        v=tuple(v_data[i * size : (i + 1) * size] for i in range(n)),
        k_data=k_data,
        v_data=v_data,
        copied=copied,
    )


def _outs(
    out: tuple[object, object] | None, size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if out is None:
        return None, None
    return _host_out(out[0], size, "out[0]"), _host_out(out[1], size, "out[1]")


# --------------------------------------------------------------------------- publisher side


def layer_sections(
    k: torch.Tensor,
    v: torch.Tensor,
    descriptor: CompatibilityDescriptor,
    *,
    layout: Layout = "HND",
    first_block: int = 0,
    blocks: int | None = None,
    out: tuple[object, object] | None = None,
) -> LayerSections:
    """The K and V sections of blocks ``first_block ..`` of one layer, bit for bit numpy's.

    ``k`` and ``v`` are ``[kv_heads, tokens, head_dim]`` (HND) or ``[tokens,
    kv_heads, head_dim]`` (NHD), contiguous, CPU or CUDA, in the descriptor
    dtype (or its raw integer bits). The result is what
    :func:`kvcs.adapters.numpy_kv.layer_sections` gives for the same values
    (``CachePublication.put_layer(layer, s.k, s.v)`` takes it). ``blocks``
    defaults to every remaining full block.

    CPU: views of ``k`` / ``v`` when the blocks are already in section order
    (HND: ``kv_heads == 1`` or one block spanning the token axis; NHD:
    ``kv_heads == 1`` or ``block_tokens == 1``), else one gather copy per
    component into ``out`` or new host memory. CUDA: a device-side gather when
    the layout needs one, then one blocking device-to-host copy per component
    into ``out`` or new host memory (:class:`TorchLayerPublisher` overlaps it).
    ``out`` is a pair of writable buffers or CPU tensors of ``blocks *
    section_size`` octets, used only when a copy is made.

    Raises:
        ValueError: wrong shapes, dtypes, devices, non-contiguous input, K and
            V of different token counts or devices, a bad block range or ``out``.
    """
    k_bits, k_tokens = _check_layer(k, descriptor, layout, "k")
    v_bits, v_tokens = _check_layer(v, descriptor, layout, "v")
    if k_tokens != v_tokens:
        raise ValueError(f"k has {k_tokens} tokens, v {v_tokens}")
    if k_bits.device != v_bits.device:
        raise ValueError(f"k is on {k_bits.device}, v on {v_bits.device}")
    n = _check_blocks(k_tokens, descriptor, first_block, blocks, "k")
    b, size = descriptor.block_tokens, descriptor.section_size
    k_out, v_out = _outs(out, n * size)
    k_host, k_copied = _to_host(_section_order(k_bits, layout, first_block, n, b), k_out)
    v_host, _ = _to_host(_section_order(v_bits, layout, first_block, n, b), v_out)
    return _sections(first_block, n, size, k_host, v_host, k_copied)


def page_sections(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page: int,
    descriptor: CompatibilityDescriptor,
    *,
    page_layout: Layout = "HND",
) -> tuple[memoryview, memoryview]:
    """``(K section, V section)`` of one page of a paged cache whose page size is ``block_tokens``.

    ``page_layout="HND"``: pages ``[num_pages, kv_heads, block_tokens,
    head_dim]``, a page is a section as is (zero-copy on CPU). ``"NHD"``:
    ``[num_pages, block_tokens, kv_heads, head_dim]``, one gather per page
    unless ``kv_heads == 1`` or ``block_tokens == 1``. CUDA pages: one blocking
    device-to-host copy per component. The caller maps blocks to pages.

    Raises:
        ValueError: wrong shapes, dtypes, page size, non-contiguous input,
            page out of range.
    """
    views = []
    for t, name in ((k_pages, "k_pages"), (v_pages, "v_pages")):
        hnd = _check_pages(t, descriptor, page_layout, name)
        if hnd.shape[2] != descriptor.block_tokens:
            raise ValueError(
                f"{name} has page size {hnd.shape[2]}, not block_tokens={descriptor.block_tokens} "
                f"(use paged_layer_sections with a slot mapping)"
            )
        if not 0 <= page < hnd.shape[0]:
            raise ValueError(f"page {page} is not in 0..{hnd.shape[0] - 1}")
        host, _ = _to_host(hnd[page : page + 1], None)
        views.append(_bytes_of(host))
    return views[0], views[1]


def slots_from_page_table(
    page_table: torch.Tensor | Sequence[int], tokens: int, page_size: int
) -> torch.Tensor:
    """The slot mapping (``page * page_size + offset`` per token) of ``tokens`` tokens.

    ``page_table[i]`` is the page that holds tokens ``i*page_size ..
    (i+1)*page_size - 1`` (vLLM's block table row, FlashInfer's page indices).
    The result is int64 on the page table's device (CPU for a sequence).

    Raises:
        ValueError: ``page_size < 1``, or the table is too short for ``tokens``.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, not {page_size}")
    table = torch.as_tensor(page_table, dtype=torch.int64)
    need = -(-tokens // page_size)
    if table.dim() != 1 or table.numel() < need:
        raise ValueError(
            f"page_table must be 1-D with at least {need} pages for {tokens} tokens, "
            f"not shape {tuple(table.shape)}"
        )
    t = torch.arange(tokens, dtype=torch.int64, device=table.device)
    return table[t // page_size] * page_size + t % page_size


def _slot_index(
    slot_mapping: torch.Tensor | Sequence[int],
    hnd: torch.Tensor,
    descriptor: CompatibilityDescriptor,
    first: int,
    blocks: int | None,
    what: str,
) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Validate a slot mapping; the block count and the broadcast index of ``[n, H, B]``."""
    slots = torch.as_tensor(slot_mapping, dtype=torch.int64)
    if slots.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D (one slot per token), not {tuple(slots.shape)}")
    n = _check_blocks(slots.numel(), descriptor, first, blocks, "slot_mapping")
    b = descriptor.block_tokens
    pages, heads, page_size, _ = hnd.shape
    used = slots[first * b : (first + n) * b]
    lo, hi = int(used.min()), int(used.max())  # one sync on CUDA; a bad index there is fatal
    if lo < 0 or hi >= pages * page_size:
        raise ValueError(
            f"slot_mapping holds slots {lo}..{hi}; {what} has {pages} pages of {page_size} "
            f"(slots 0..{pages * page_size - 1})"
        )
    used = used.to(hnd.device).view(n, 1, b)
    h = torch.arange(heads, device=hnd.device).view(1, heads, 1)
    return n, (used // page_size, h, used % page_size)


def paged_layer_sections(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor | Sequence[int],
    descriptor: CompatibilityDescriptor,
    *,
    page_layout: Layout,
    first_block: int = 0,
    blocks: int | None = None,
) -> LayerSections:
    """The sections of blocks ``first_block ..`` of one layer of a paged cache, any page size.

    ``k_pages`` / ``v_pages`` are ``[num_pages, page_size, kv_heads, head_dim]``
    (``page_layout="NHD"``, vLLM) or ``[num_pages, kv_heads, page_size,
    head_dim]`` (``"HND"``); ``slot_mapping[t]`` is token ``t``'s slot
    (:func:`slots_from_page_table`). One gather per component (advanced
    indexing, on the pages' device) writes the blocks straight in section
    order; on CUDA one blocking device-to-host copy follows.

    Raises:
        ValueError: wrong shapes, dtypes, non-contiguous input, slots out of
            range, a bad block range.
    """
    k_hnd = _check_pages(k_pages, descriptor, page_layout, "k_pages")
    v_hnd = _check_pages(v_pages, descriptor, page_layout, "v_pages")
    if k_hnd.shape != v_hnd.shape or k_hnd.device != v_hnd.device:
        raise ValueError("k_pages and v_pages differ in shape or device")
    n, (p, h, s) = _slot_index(slot_mapping, k_hnd, descriptor, first_block, blocks, "k_pages")
    hosts = []
    for hnd in (k_hnd, v_hnd):
        gathered = _gather(hnd, (p, h, s))  # [n, H, B, D], contiguous: the one gather
        host, _ = _to_host(gathered, None)
        hosts.append(host)
    return _sections(first_block, n, descriptor.section_size, hosts[0], hosts[1], True)


class TorchLayerPublisher:
    """Device-to-host copies of whole layers overlapped with compute (CUDA), then sections.

    :meth:`submit` takes one layer's K and V (engine layout, the tensors the
    model just wrote). On CUDA it makes the side stream wait for the current
    stream (the producer of ``k`` / ``v``), gathers on the side stream when the
    layout needs it, copies into a new pinned host buffer with
    ``non_blocking=True`` and records a CUDA event; ``k`` and ``v`` are
    recorded on the side stream so the caching allocator does not reuse their
    memory before the copy. :meth:`ready` returns, in submission order, the
    layers whose copy has completed (event queried, no blocking), each once, as
    :class:`LayerSections` for ``CachePublication.put_layer``; :meth:`wait`
    blocks on one layer's event. The engine must not overwrite ``k`` / ``v``
    until the layer is ready.

    Pinned buffers are never reused: the publication keeps sections by
    reference for its whole life. At most ``max_in_flight`` copies are
    outstanding; :meth:`submit` blocks on the oldest one beyond that.

    CPU tensors: :meth:`submit` calls :func:`layer_sections` (views or one
    gather copy) at once; the layer is ready immediately.

    Raises (constructor):
        ValueError: a bad device or ``max_in_flight``.
    """

    def __init__(
        self,
        descriptor: CompatibilityDescriptor,
        *,
        device: str | torch.device = "cpu",
        layout: Layout = "HND",
        max_in_flight: int = 4,
    ) -> None:
        _check_layout(layout)
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, not {max_in_flight}")
        self.descriptor: Final = descriptor
        self.device: Final = _device(device)
        self.layout: Final[Layout] = layout
        self.max_in_flight: Final = max_in_flight
        self._stream = _new_stream(self.device) if self.device.type == "cuda" else None
        self._pending: OrderedDict[int, tuple[LayerSections, torch.cuda.Event | None]] = (
            OrderedDict()
        )

    def submit(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Start the copy of one layer (``k`` / ``v`` on this publisher's device).

        Raises:
            ValueError: bad tensors (as :func:`layer_sections`), a tensor on
                another device, a layer outside the descriptor or already pending.
        """
        d = self.descriptor
        if not 0 <= layer < d.layers:
            raise ValueError(f"layer {layer} is not in 0..{d.layers - 1}")
        if layer in self._pending:
            raise ValueError(f"layer {layer} is already pending")
        k_bits, k_tokens = _check_layer(k, d, self.layout, "k")
        v_bits, v_tokens = _check_layer(v, d, self.layout, "v")
        if k_bits.device != self.device or v_bits.device != self.device:
            raise ValueError(
                f"k and v must be on {self.device}, not {k_bits.device}/{v_bits.device}"
            )
        if self._stream is None:
            self._pending[layer] = (layer_sections(k, v, d, layout=self.layout), None)
            return
        if k_tokens != v_tokens:
            raise ValueError(f"k has {k_tokens} tokens, v {v_tokens}")
        while True:
            busy = [e for _, e in self._pending.values() if e is not None and not _done(e)]
            if len(busy) < self.max_in_flight:
                break
            busy[0].synchronize()
        n = _check_blocks(k_tokens, d, 0, None, "k")
        b = d.block_tokens
        hosts = []
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bits in (k_bits, v_bits):
                src = _section_order(bits, self.layout, 0, n, b).contiguous()  # gather if needed
                host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                host.copy_(src, non_blocking=True)
                bits.record_stream(stream)
                src.record_stream(stream)
                hosts.append(host)
            event = _new_event()
            event.record(stream)
        self._pending[layer] = (_sections(0, n, d.section_size, hosts[0], hosts[1], True), event)

    def ready(self) -> list[tuple[int, LayerSections]]:
        """The pending layers whose copy has completed, in submission order (each once)."""
        done = []
        for layer, (sections, event) in list(self._pending.items()):
            if not _done(event):
                break
            done.append((layer, sections))
            del self._pending[layer]
        return done

    def wait(self, layer: int) -> LayerSections:
        """Block until ``layer``'s copy has completed; its sections (removed from pending).

        Raises:
            ValueError: ``layer`` is not pending.
        """
        if layer not in self._pending:
            raise ValueError(f"layer {layer} is not pending (submit it first)")
        sections, event = self._pending.pop(layer)
        if event is not None:
            event.synchronize()
        return sections


# --------------------------------------------------------------------------- consumer side


class _PinnedRing:
    """A bounded ring of pinned host buffers; a slot is reused only after its copy finished.

    :meth:`acquire` hands out slots round-robin and, before handing out a slot
    whose last host-to-device copy was recorded with :meth:`recorded`, blocks
    on that copy's CUDA event (``Event.synchronize``).
    """

    def __init__(self, slot_bytes: int, slots: int) -> None:
        self._buffers = [
            torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)
        ]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self.waits = 0
        """How many times :meth:`acquire` had to wait for a copy (observability)."""

    def acquire(self) -> tuple[int, torch.Tensor]:
        i = self._next
        event = self._events[i]
        if event is not None:
            if not _done(event):
                self.waits += 1
            event.synchronize()
            self._events[i] = None
        self._next = (i + 1) % len(self._buffers)
        return i, self._buffers[i]

    def recorded(self, slot: int, event: torch.cuda.Event) -> None:
        self._events[slot] = event


class TorchKvDestination:
    """The whole cache preallocated on ``device`` in section order; what a consumer writes into.

    ``buffer`` is the ``destinations`` callable of
    ``MoqtClient.retrieve_cache`` (as ``KvDestination.buffer``); call
    :meth:`layer_ready` when the retrieval reports a layer usable
    (``async for layer in retrieval``), then :meth:`wait_layer` and
    :meth:`layer` (or :meth:`paged`, :meth:`scatter_into_pages`). See the module
    docstring for what each step copies on CPU and on CUDA.

    Args:
        descriptor: the publication's Compatibility Descriptor.
        tokens: tokens to receive, a positive multiple of ``block_tokens``.
        device: ``"cpu"`` (default) or a CUDA device.
        ring_slots: pinned section buffers of the :meth:`write` ring on CUDA
            (default 8; unused on CPU).

    Raises:
        ValueError: ``tokens`` is not a positive multiple of ``block_tokens``,
            a bad device (CUDA without ``torch.cuda.is_available()``), or
            ``ring_slots < 1``.
    """

    def __init__(
        self,
        descriptor: CompatibilityDescriptor,
        tokens: int,
        *,
        device: str | torch.device = "cpu",
        ring_slots: int = 8,
    ) -> None:
        b = descriptor.block_tokens
        if tokens < b or tokens % b:
            raise ValueError(
                f"tokens must be a positive multiple of block_tokens={b}, not {tokens} "
                f"(only full blocks are cached: use {(tokens // b) * b} and recompute the tail)"
            )
        if ring_slots < 1:
            raise ValueError(f"ring_slots must be >= 1, not {ring_slots}")
        self.descriptor: Final = descriptor
        self.tokens: Final = tokens
        self.blocks: Final = tokens // b
        self.device: Final = _device(device)
        self.layer_size: Final = self.blocks * descriptor.section_size
        """Octets of one (layer, component) buffer."""
        shape = (descriptor.layers, 2, self.layer_size)
        self._ready: set[int] = set()
        self._mirror: dict[int, torch.Tensor] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._ring: _PinnedRing | None = None
        self._ring_slots = ring_slots
        if self.device.type == "cpu":
            self._storage = torch.from_numpy(np.zeros(shape, np.uint8))  # lazily zeroed by the OS
            self._stream: torch.cuda.Stream | None = None
        else:
            self._storage = torch.zeros(shape, dtype=torch.uint8, device=self.device)
            self._stream = _new_stream(self.device)
            # the zero fill runs on the current stream: the side stream's copies come after it
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            # and the caching allocator must not hand the storage out again while a
            # side-stream copy into it may still run
            self._storage.record_stream(self._stream)

    # -- where the wire's bytes go

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.descriptor.layers:
            raise ValueError(f"layer {layer} is not in 0..{self.descriptor.layers - 1}")
        return layer

    def _host(self, layer: int) -> torch.Tensor:
        """The host bytes of ``layer`` ``[2, layer_size]``: the storage (CPU) or pinned staging."""
        if self._stream is None:
            return self._storage[layer]
        staging = self._mirror.get(layer)
        if staging is None:
            staging = torch.zeros((2, self.layer_size), dtype=torch.uint8, pin_memory=True)
            self._mirror[layer] = staging
        return staging

    def buffer(self, layer: int, component: Component | int | str) -> memoryview:
        """The writable section-order buffer of ``layer`` and ``"k"`` / ``"v"``.

        Block ``i`` at ``i * section_size``. CPU: a view of the tensor storage
        itself; CUDA: a view of the layer's pinned host staging, copied to the
        device by :meth:`layer_ready`.
        """
        ci = _component(component)
        return _bytes_of(self._host(self._layer(layer))[ci])

    def section(self, layer: int, component: Component | int | str, block: int) -> memoryview:
        """The writable ``section_size`` slice of :meth:`buffer` that holds block ``block``."""
        if not 0 <= block < self.blocks:
            raise ValueError(f"block {block} is not in 0..{self.blocks - 1}")
        size = self.descriptor.section_size
        return self.buffer(layer, component)[block * size : (block + 1) * size]

    def write(
        self,
        layer: int,
        component: Component | int | str,
        block: int,
        data: object,
        codec: Codec | int = Codec.RAW,
    ) -> None:
        """Store the verified Data of one Object (``component`` ``"kv"``: K then V).

        ``raw`` Data is copied; ``q8`` Data is decoded (numpy adapter's
        :func:`~kvcs.adapters.numpy_kv.q8_decode_section`, the reference's
        bytes) straight into the same place. CPU: into the storage. CUDA: into
        the next slot of the pinned ring, then a non-blocking host-to-device
        copy on the side stream into the block's place (the slot is reused
        only after that copy). Do not mix :meth:`write` and :meth:`buffer` for
        one layer on CUDA: ``layer_ready`` copies the whole staged layer.

        Raises:
            UnknownCodecError: ``codec`` is not in the registry.
            SectionError: ``data`` is not the size of the component's Data.
            ValueError: bad layer, block or component, or ``data`` not bytes-like.
        """
        codec = codec_from_value(codec)
        self._layer(layer)
        if not 0 <= block < self.blocks:
            raise ValueError(f"block {block} is not in 0..{self.blocks - 1}")
        try:
            view = memoryview(data).cast("B")  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(f"data must be bytes-like, not {type(data).__name__}") from None
        is_kv = component == "kv" if isinstance(component, str) else component == Component.KV
        indices = (0, 1) if is_kv else (_component(component),)
        size = self.descriptor.section_size
        each = size if codec is Codec.RAW else q8_size(self.descriptor.section_shape)
        if len(view) != each * len(indices):
            raise SectionError(
                f"{codec.registry_name} Data of component {component!r} is {len(view)} "
                f"octets, not {each * len(indices)}"
            )
        start = block * size
        for n, ci in enumerate(indices):
            part = view[n * each : (n + 1) * each]
            if self._stream is None:
                self._store(part, _bytes_of(self._storage[layer, ci])[start : start + size], codec)
                continue
            if self._ring is None:
                self._ring = _PinnedRing(size, self._ring_slots)
            slot, pinned = self._ring.acquire()
            self._store(part, _bytes_of(pinned), codec)
            with torch.cuda.stream(self._stream):
                self._storage[layer, ci, start : start + size].copy_(pinned, non_blocking=True)
                event = _new_event()
                event.record(self._stream)
            self._ring.recorded(slot, event)

    def _store(self, part: memoryview, target: memoryview, codec: Codec) -> None:
        if codec is Codec.RAW:
            target[:] = part
        else:
            q8_decode_section(part, self.descriptor, out=target)

    # -- layer readiness

    def layer_ready(self, layer: int) -> None:
        """The retrieval reported ``layer`` usable: make it usable on ``device``.

        CPU: nothing to copy. CUDA: the layer's pinned staging (when
        :meth:`buffer` was taken for it) is copied to the device with
        ``non_blocking=True`` on the side stream, and the layer's CUDA event is
        recorded there after that copy and every :meth:`write` of the layer.
        """
        self._layer(layer)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                staging = self._mirror.get(layer)
                if staging is not None:
                    self._storage[layer].copy_(staging, non_blocking=True)
                event = _new_event()
                event.record(self._stream)
            self._events[layer] = event
        self._ready.add(layer)

    def is_ready(self, layer: int) -> bool:
        """Whether ``layer`` is on the device now (CUDA: its event completed; no blocking)."""
        if self._layer(layer) not in self._ready:
            return False
        event = self._events.get(layer)
        return _done(event)

    def wait_layer(self, layer: int) -> None:
        """Make ``layer`` usable by work on the current stream.

        CPU: returns at once. CUDA: the current stream waits for the layer's
        event (``Stream.wait_event``), so kernels queued after this call see
        the layer; the host does not block (``torch.cuda.synchronize`` or
        :meth:`is_ready` for that).

        Raises:
            ValueError: :meth:`layer_ready` was not called for ``layer``.
        """
        if self._layer(layer) not in self._ready:
            raise ValueError(f"layer {layer} is not ready: call layer_ready({layer}) first")
        event = self._events.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # -- reading layers

    def _paged_bits(self, layer: int, ci: int) -> torch.Tensor:
        d = self.descriptor
        return self._storage[layer, ci].view(_BITS[d.dtype]).view(self.blocks, *d.section_shape)

    def paged(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` as ``[blocks, kv_heads, block_tokens, head_dim]``: views, always.

        Calls :meth:`wait_layer` first (so :meth:`layer_ready` is required).
        """
        self.wait_layer(layer)
        dt = _TORCH[self.descriptor.dtype]
        return self._paged_bits(layer, 0).view(dt), self._paged_bits(layer, 1).view(dt)

    def view_possible(self, layout: Layout = "HND") -> bool:
        """Whether :meth:`layer` returns views for ``layout`` (as ``KvDestination``'s rule)."""
        _check_layout(layout)
        d = self.descriptor
        if layout == "HND":
            return d.kv_heads == 1 or self.blocks == 1
        return d.kv_heads == 1 or d.block_tokens == 1

    def layer(
        self,
        layer: int,
        layout: Layout = "HND",
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` in ``layout``, the descriptor's torch dtype, on ``device``.

        HND ``[kv_heads, tokens, head_dim]`` or NHD ``[tokens, kv_heads,
        head_dim]``. Views of the storage when :meth:`view_possible` (``out``
        must then be ``None``); otherwise one copy per component (on the current
        stream for CUDA) into ``out`` (two contiguous engine layers on
        ``device`` with at least ``tokens`` tokens; the first ``tokens`` are
        written) or new tensors. Calls :meth:`wait_layer` first.

        Raises:
            ValueError: bad layer or layout, layer not ready, ``out`` where no
                copy is made, or a bad ``out``.
        """
        _check_layout(layout)
        k, v = self.paged(layer)
        d = self.descriptor
        if self.view_possible(layout):
            if out is not None:
                raise ValueError(
                    "layer() makes no copy for this layout (views are returned); "
                    "out is not written: drop it, or copy the views yourself"
                )
            return _engine_view(k, layout), _engine_view(v, layout)
        result = []
        for i, src in enumerate((k, v)):
            if out is None:
                shape = (
                    (d.kv_heads, self.tokens, d.head_dim)
                    if layout == "HND"
                    else (self.tokens, d.kv_heads, d.head_dim)
                )
                dst = torch.empty(shape, dtype=src.dtype, device=self.device)
                target = dst.view(_BITS[d.dtype])
            else:
                dst = out[i]
                bits, out_tokens = _check_layer(dst, d, layout, f"out[{i}]")
                if bits.device != self.device:
                    raise ValueError(f"out[{i}] is on {bits.device}, not {self.device}")
                _check_blocks(out_tokens, d, 0, self.blocks, f"out[{i}]")
                target = bits
            view = _section_order(target, layout, 0, self.blocks, d.block_tokens)
            _copy(view, src.view(view.dtype))
            result.append(dst)
        return result[0], result[1]

    def scatter_into_pages(
        self,
        layer: int,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        page_layout: Layout,
    ) -> None:
        """Copy ``layer`` into an engine's paged cache through its slot mapping: one scatter.

        ``k_pages`` / ``v_pages``: as :func:`paged_layer_sections`, on
        ``device``; ``slot_mapping[t]`` is where token ``t`` goes (at least
        ``tokens`` entries; the first ``tokens`` are used). Calls
        :meth:`wait_layer` first; on CUDA the scatter runs on the current stream.

        Raises:
            ValueError: as :func:`paged_layer_sections`, pages on another device,
                or the layer not ready.
        """
        k, v = self.paged(layer)
        d = self.descriptor
        for src, pages, name in ((k, k_pages, "k_pages"), (v, v_pages, "v_pages")):
            hnd = _check_pages(pages, d, page_layout, name)
            if hnd.device != self.device:
                raise ValueError(f"{name} is on {hnd.device}, not {self.device}")
            _, (p, h, s) = _slot_index(slot_mapping, hnd, d, 0, self.blocks, name)
            _scatter(hnd, (p, h, s), src.view(hnd.dtype))


def _engine_view(paged: torch.Tensor, layout: str) -> torch.Tensor:
    """The engine-layout view of ``[blocks, H, B, D]`` (only called when it is one)."""
    n, h, b, d = paged.shape
    if layout == "HND":
        return paged.permute(1, 0, 2, 3).view(h, n * b, d)
    return paged.permute(0, 2, 1, 3).view(n * b, h, d)
