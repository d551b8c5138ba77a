"""KV caches as numpy arrays <-> KVSP K/V sections, with every copy explicit.

Theory of operation
-------------------
The core (``kvcs_core``) sees only bytes. This adapter is the edge where an
inference engine's KV cache, held as numpy arrays, becomes the K and V
sections of ``KVSP-BINDING.md`` section 5 (publisher side) and where verified
Object Data becomes engine arrays again (consumer side). It follows STYLE.md
R13: conversions are zero-copy views wherever the memory layout allows, the
one copy a layout needs is documented and happens at a call the user can see,
and a non-contiguous input array is an error, never a silent copy (calling
``np.ascontiguousarray`` is the caller's choice).

**Section order.** The K section of block ``b`` of layer ``l`` is the key
tensor of shape ``[kv_heads, block_tokens, head_dim]`` in C order, elements in
the descriptor ``dtype``, little-endian. Element ``(h, j, d)`` of the section
is token ``t = b*B + j`` (``B = block_tokens``) of head ``h``, at byte offset
``((h*B + j)*D + d) * itemsize``. All blocks of one layer in section order
(block ``i`` at offset ``i * section_size``) is therefore an array of shape
``[blocks, kv_heads, B, head_dim]``: head-major *inside* a block, block-major
across blocks. This is exactly the page layout of a paged "HND" cache
(``[num_pages, kv_heads, page_size, head_dim]``, FlashInfer's
``kv_layout="HND"``) with ``page_size == block_tokens``.

**Element types.** numpy has no bfloat16 or float8, so those are carried as
their raw bit patterns: ``uint16`` for ``bfloat16``, ``uint8`` for
``float8_e4m3fn`` and ``float8_e5m2`` (:func:`engine_dtype`). An array whose
dtype is *named* like the descriptor dtype with the right item size (the
``ml_dtypes`` types) is accepted too and viewed as the raw bits (no copy).
Arrays must be little-endian: byte-swapping is a copy, the caller's choice.

**Engine layouts accepted** (always one layer, C-contiguous; a whole cache
``[layers, kv_heads, tokens, head_dim]`` gives its layers with
:func:`cache_layer`, a view):

* ``"HND"`` ``[kv_heads, tokens, head_dim]`` (the default). One block is
  ``kv_heads`` separate runs of ``B*D`` elements, ``tokens*D`` elements apart,
  so a section is contiguous in the engine array only when ``kv_heads == 1`` or
  the array holds exactly one block (``tokens == B``). Otherwise a gather copy
  is unavoidable: a section is one contiguous byte string in which head
  ``h+1`` follows head ``h`` after ``B*D`` elements, while in the engine array
  they are ``tokens*D`` elements apart, so no view of the engine memory is
  that byte string.
* ``"NHD"`` ``[tokens, kv_heads, head_dim]`` (vLLM/FlashInfer "NHD"). A
  block is contiguous but in ``[B, kv_heads, D]`` order, so a section is a view
  only when ``kv_heads == 1`` or ``B == 1``; otherwise a gather (transpose)
  copy.
* paged ``[num_pages, kv_heads, B, head_dim]`` (:func:`page_sections`): every
  page is a section, always a zero-copy view.

Publisher side, per layout (``H`` = ``kv_heads``):

==============  ===============================  ==================================
call            zero-copy when                   otherwise
==============  ===============================  ==================================
block_sections  HND: H == 1, or tokens == B;     one gather copy per section
                NHD: H == 1, or B == 1           (H runs) into ``out`` or a new
                                                 buffer
layer_sections  HND: H == 1, or a single block   one gather copy per layer and
                and tokens == B; NHD: H == 1,    component into one contiguous
                or B == 1                        buffer; per-block views are free
page_sections   always                           never copies
==============  ===============================  ==================================

``layer_sections`` is the one to use for publishing: one gather pass over the
layer (H runs of ``blocks*B*D`` elements, written block-major), then every
block's section is a ``memoryview`` slice of that buffer, handed to the core
without further copies (scatter/gather send, ARCHITECTURE.md "Data path and
memory").

Consumer side: :class:`KvDestination` preallocates, per layer and per
component, one writable buffer in section order (block ``i`` at offset
``i * section_size``). The consumer machine writes verified Data into it: the
one copy from the wire. Reading it back as engine arrays:

* :meth:`KvDestination.as_paged_arrays`: ``[blocks, H, B, D]``, always a view;
* :meth:`KvDestination.as_engine_arrays` with ``"HND"``: ``[H, tokens, D]`` is
  a view (``np.frombuffer`` + reshape + transpose) only when ``H == 1`` or
  ``blocks == 1``: the token axis of section order has two strides (``D``
  within a block, ``H*B*D`` between blocks), which one numpy stride cannot
  express. Otherwise it makes exactly one copy, into ``out`` (for example
  the engine's own preallocated cache layer) or into a new array;
* ``"NHD"``: a view only when ``H == 1`` or ``B == 1``; otherwise one copy.

A consumer that wants the engine array itself as the destination (no section
buffer at all) calls :func:`write_block`: one copy from the wire straight into
the engine layout (a scatter of ``H`` runs for HND).

**q8** (binding section 6) is vectorised here: :func:`q8_encode`,
:func:`q8_decode` (float32 arrays), :func:`q8_decode_section` (bytes in the
descriptor dtype). They give exactly the bytes of the pure reference
``kvcs_core.kvsp.codecs.q8_encode`` / ``q8_decode`` (same float32 arithmetic,
same rounding; NaN results are the quiet NaN with the sign the CPU gives, as
in the reference; the binding fixes no NaN payloads). :func:`to_float32` and
:func:`from_float32` are the vectorised dtype conversions (IEEE
round-to-nearest-even, same overflow and NaN rules as
``kvcs_core.kvsp.dtypes``). Their cost is numpy's: for a float16 cache the
float16 <-> float32 casts dominate (``benchmarks/bench_numpy_adapter.py``).

**Ownership and lifetime.** A view returned from an engine array (zero-copy
case) aliases the engine's memory: it is valid, and shows the engine's
current values, as long as the engine does not overwrite those tokens;
publishing it means the engine must keep the block unchanged until the core
has sent it. A gathered buffer belongs to the returned views (numpy keeps it
alive while any view exists); one passed as ``out`` belongs to the caller,
who must not reuse it while views of it are queued for sending. A
:class:`KvDestination` owns its buffers; arrays and memoryviews taken from it
keep them alive.
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from kvcs_core.kvcs.names import Component
from kvcs_core.kvsp.codecs import Q8_MAX, Q8_SCALE_SIZE, Codec, codec_from_value, q8_size
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.kvsp.dtypes import ITEMSIZE, Dtype
from kvcs_core.kvsp.errors import SectionError

__all__ = [
    "KvDestination",
    "LayerSections",
    "Layout",
    "block_sections",
    "cache_layer",
    "engine_dtype",
    "from_float32",
    "layer_sections",
    "page_sections",
    "q8_decode",
    "q8_decode_blocks",
    "q8_decode_section",
    "q8_encode",
    "section_array",
    "section_of",
    "to_float32",
    "write_block",
]

Layout: TypeAlias = Literal["HND", "NHD"]
"""Axis order of one engine layer: ``HND`` [heads, tokens, dim] or ``NHD`` [tokens, heads, dim]."""

Array: TypeAlias = npt.NDArray[Any]
BufferLike: TypeAlias = bytes | bytearray | memoryview
WritableBuffer: TypeAlias = bytearray | memoryview | npt.NDArray[Any]

_RAW: Final[dict[Dtype, np.dtype[Any]]] = {
    Dtype.FLOAT32: np.dtype("<f4"),
    Dtype.FLOAT16: np.dtype("<f2"),
    Dtype.BFLOAT16: np.dtype("<u2"),
    Dtype.FLOAT8_E4M3FN: np.dtype("u1"),
    Dtype.FLOAT8_E5M2: np.dtype("u1"),
}
_BITS: Final[dict[int, np.dtype[Any]]] = {
    1: np.dtype("u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
}
_LAYOUTS: Final = ("HND", "NHD")
_F32: Final = np.dtype("<f4")
_F16: Final = np.dtype("<f2")
_F32_SIGN: Final = np.uint32(0x80000000)
_F32_QNAN: Final = np.uint32(0x7FC00000)


def engine_dtype(dtype: Dtype | str) -> np.dtype[Any]:
    """The numpy dtype that holds elements of a descriptor ``dtype``.

    ``float32`` -> ``<f4``, ``float16`` -> ``<f2``, ``bfloat16`` -> ``<u2``
    (raw bits), ``float8_e4m3fn`` / ``float8_e5m2`` -> ``u1`` (raw bits).
    """
    return _RAW[Dtype(dtype)]


# --------------------------------------------------------------------------- checks


def _check_dtype(arr: Array, dtype: Dtype, what: str) -> Array:
    """``arr`` viewed as the raw dtype of ``dtype`` (no copy), or ValueError."""
    want = _RAW[dtype]
    have = arr.dtype
    if have == want:
        return arr
    if have.name == dtype.value and have.itemsize == ITEMSIZE[dtype] and have.byteorder in "=|<":
        return arr.view(_BITS[have.itemsize])  # ml_dtypes-style named type: same bits
    if have.byteorder == ">" and have.newbyteorder("<") == want:
        raise ValueError(
            f"{what} is big-endian ({have.str}); sections are little-endian and "
            f"byte-swapping is a copy: call {what}.astype({want.str!r}) explicitly"
        )
    hint = ""
    if dtype in (Dtype.BFLOAT16, Dtype.FLOAT8_E4M3FN, Dtype.FLOAT8_E5M2):
        hint = f" ({dtype.value} is carried as raw bits: .view(np.{want.name}))"
    raise ValueError(
        f"{what} has dtype {have}, but the descriptor dtype {dtype.value} needs {want}{hint}"
    )


def _check_contiguous(arr: Array, what: str) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what} is not C-contiguous (strides {arr.strides}); the adapter never copies "
            f"silently: call np.ascontiguousarray({what}) if a copy is what you want"
        )


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'HND' or 'NHD', not {layout!r}")


def _check_engine_layer(
    arr: object, descriptor: CompatibilityDescriptor, layout: str, what: str
) -> tuple[Array, int]:
    """Validate one engine layer; return it as raw bits (a view) and its token count."""
    _check_layout(layout)
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{what} must be a numpy.ndarray, not {type(arr).__name__}")
    heads, head_dim = descriptor.kv_heads, descriptor.head_dim
    expect = "[kv_heads, tokens, head_dim]" if layout == "HND" else "[tokens, kv_heads, head_dim]"
    if arr.ndim != 3:
        extra = " (for a whole cache [layers, ...] use cache_layer(cache, layer, ...))"
        raise ValueError(
            f"{what} has shape {arr.shape}; one {layout} layer is {expect}"
            + (extra if arr.ndim == 4 else "")
        )
    h, t = (arr.shape[0], arr.shape[1]) if layout == "HND" else (arr.shape[1], arr.shape[0])
    if h != heads or arr.shape[2] != head_dim:
        raise ValueError(
            f"{what} has shape {arr.shape}; the descriptor needs {layout} {expect} with "
            f"kv_heads={heads}, head_dim={head_dim}"
        )
    raw = _check_dtype(arr, descriptor.dtype, what)
    _check_contiguous(arr, what)
    return raw, t


def _check_blocks(
    tokens: int,
    descriptor: CompatibilityDescriptor,
    first_block: int,
    blocks: int | None,
    what: str,
) -> int:
    """Validate a block range of an engine array with ``tokens`` tokens; return the count."""
    b = descriptor.block_tokens
    full = tokens // b
    if first_block < 0:
        raise ValueError(f"first block {first_block} is negative")
    if blocks is None:
        blocks = full - first_block
    if blocks < 1 or first_block + blocks > full:
        raise ValueError(
            f"blocks {first_block}..{first_block + blocks - 1} are not full blocks of {what} "
            f"({tokens} tokens = {full} full blocks of {b})"
        )
    return blocks


def _section_order(raw: Array, layout: str, first: int, blocks: int, b: int) -> Array:
    """A *view* of blocks ``first..first+blocks-1`` of an engine layer as [blocks, H, B, D]."""
    s, e = first * b, (first + blocks) * b
    if layout == "HND":
        h, _, d = raw.shape
        return raw[:, s:e, :].reshape(h, blocks, b, d).transpose(1, 0, 2, 3)
    _, h, d = raw.shape
    return raw[s:e].reshape(blocks, b, h, d).transpose(0, 2, 1, 3)


def _bytes_of(arr: Array) -> memoryview:
    """A flat byte ``memoryview`` of a C-contiguous array (no copy)."""
    flat = arr.reshape(-1)  # a view: arr is C-contiguous
    return flat.view(np.uint8).data


def _writable(out: object, size: int, what: str) -> Array:
    """``out`` as a writable flat uint8 array of exactly ``size`` octets (no copy)."""
    try:
        view = memoryview(out)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{what} must be a writable buffer, not {type(out).__name__}") from None
    if view.readonly:
        raise ValueError(f"{what} is read-only")
    if not view.c_contiguous:
        raise ValueError(f"{what} is not a C-contiguous buffer")
    view = view.cast("B")
    if len(view) != size:
        raise ValueError(f"{what} is {len(view)} octets, not {size}")
    return np.frombuffer(view, np.uint8)


def _readable(data: object, what: str) -> memoryview:
    """Any bytes-like object (C-contiguous ndarray included) as a flat byte view."""
    if isinstance(data, np.ndarray):
        _check_contiguous(data, what)
        return _bytes_of(data)
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{what} must be bytes-like, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError(f"{what} is not a C-contiguous buffer")
    return view.cast("B")


# --------------------------------------------------------------------------- publisher side


def cache_layer(cache: Array, layer: int, descriptor: CompatibilityDescriptor) -> Array:
    """Layer ``layer`` of a whole cache ``[layers, ...]`` as a 3-D view (no copy).

    ``cache`` is ``[layers, kv_heads, tokens, head_dim]`` (or ``[layers,
    tokens, kv_heads, head_dim]`` for NHD); its layer is C-contiguous when the
    cache is.

    Raises:
        ValueError: not a 4-D array with ``descriptor.layers`` layers, or
            ``layer`` out of range.
    """
    if not isinstance(cache, np.ndarray) or cache.ndim != 4:
        shape = getattr(cache, "shape", type(cache).__name__)
        raise ValueError(f"cache must be a 4-D numpy array [layers, ...], not {shape}")
    if cache.shape[0] != descriptor.layers:
        raise ValueError(f"cache has {cache.shape[0]} layers, the descriptor {descriptor.layers}")
    if not 0 <= layer < descriptor.layers:
        raise ValueError(f"layer {layer} is not in 0..{descriptor.layers - 1}")
    result: Array = cache[layer]
    return result


def section_of(
    layer_array: Array,
    block: int,
    descriptor: CompatibilityDescriptor,
    *,
    layout: Layout = "HND",
    out: WritableBuffer | None = None,
    what: str = "layer_array",
) -> memoryview:
    """The KVSP section (raw bytes) of block ``block`` of one engine layer.

    A zero-copy view of ``layer_array`` when the section is contiguous there
    (HND: ``kv_heads == 1`` or ``tokens == block_tokens``; NHD: ``kv_heads ==
    1`` or ``block_tokens == 1``); otherwise exactly one gather copy into
    ``out`` (``section_size`` writable octets, used only when a copy is
    needed) or, without ``out``, into a new buffer.

    Raises:
        ValueError: wrong shape, dtype, byte order, non-contiguous array,
            block out of range, or a bad ``out``.
    """
    raw, tokens = _check_engine_layer(layer_array, descriptor, layout, what)
    _check_blocks(tokens, descriptor, block, 1, what)
    src = _section_order(raw, layout, block, 1, descriptor.block_tokens)[0]
    if src.flags.c_contiguous:
        return _bytes_of(src)
    if out is None:
        dst = np.empty(src.shape, src.dtype)
    else:
        dst = _writable(out, descriptor.section_size, "out").view(src.dtype).reshape(src.shape)
    np.copyto(dst, src)
    return _bytes_of(dst)


def block_sections(
    k_layer: Array,
    v_layer: Array,
    block: int,
    descriptor: CompatibilityDescriptor,
    *,
    layout: Layout = "HND",
    out: tuple[WritableBuffer, WritableBuffer] | None = None,
) -> tuple[memoryview, memoryview]:
    """``(K section, V section)`` of block ``block`` of one layer (see :func:`section_of`).

    ``out``, when given, is a pair of preallocated ``section_size`` buffers
    for the K and V gather copies; when the layout allows a view it is not
    touched, so always use the returned views.
    """
    k_out, v_out = out if out is not None else (None, None)
    return (
        section_of(k_layer, block, descriptor, layout=layout, out=k_out, what="k_layer"),
        section_of(v_layer, block, descriptor, layout=layout, out=v_out, what="v_layer"),
    )


@attrs.frozen(eq=False)
class LayerSections:
    """The sections of a run of blocks of one layer, as produced by :func:`layer_sections`.

    Attributes:
        first_block: block index of ``k[0]`` and ``v[0]``.
        k: one K section per block, each a ``memoryview`` of ``section_size``
            octets (a slice of ``k_data``).
        v: the V sections, likewise.
        k_data: all K sections back to back (section order, block ``i`` at
            ``i * section_size``).
        v_data: all V sections back to back.
        copied: ``False`` when the views alias the engine arrays (zero-copy),
            ``True`` when one gather copy per component was made.
    """

    first_block: int
    k: tuple[memoryview, ...]
    v: tuple[memoryview, ...]
    k_data: memoryview
    v_data: memoryview
    copied: bool


def layer_sections(
    k_layer: Array,
    v_layer: Array,
    descriptor: CompatibilityDescriptor,
    *,
    first_block: int = 0,
    blocks: int | None = None,
    layout: Layout = "HND",
    out: tuple[WritableBuffer, WritableBuffer] | None = None,
) -> LayerSections:
    """The K and V sections of blocks ``first_block ..`` of one layer, with at most one copy.

    ``blocks`` defaults to every remaining full block (a partial tail block
    is never cached). When blocks ``first_block..`` of the layer are already
    in section order in memory (HND: ``kv_heads == 1``, or one block that is
    the whole token axis; NHD: ``kv_heads == 1`` or ``block_tokens == 1``)
    the sections are views of the engine arrays. Otherwise one gather copy
    per component writes them, in section order, into one contiguous buffer:
    ``out`` (a pair of ``blocks * section_size`` writable buffers, e.g.
    reused from layer to layer once the previous layer is sent) or new ones;
    every block's section is then a ``memoryview`` slice of that buffer.

    Raises:
        ValueError: wrong shapes, dtypes or byte order, non-contiguous input,
            K and V of different token counts, a bad block range or ``out``.
    """
    k_raw, k_tokens = _check_engine_layer(k_layer, descriptor, layout, "k_layer")
    v_raw, v_tokens = _check_engine_layer(v_layer, descriptor, layout, "v_layer")
    if k_tokens != v_tokens:
        raise ValueError(f"k_layer has {k_tokens} tokens, v_layer {v_tokens}")
    n = _check_blocks(k_tokens, descriptor, first_block, blocks, "k_layer")
    size = descriptor.section_size
    b = descriptor.block_tokens
    k_src = _section_order(k_raw, layout, first_block, n, b)
    v_src = _section_order(v_raw, layout, first_block, n, b)
    copied = not k_src.flags.c_contiguous
    if copied:
        k_out, v_out = out if out is not None else (None, None)
        datas = []
        for src, o, name in ((k_src, k_out, "out[0]"), (v_src, v_out, "out[1]")):
            if o is None:
                dst = np.empty(src.shape, src.dtype)
            else:
                dst = _writable(o, n * size, name).view(src.dtype).reshape(src.shape)
            np.copyto(dst, src)
            datas.append(_bytes_of(dst))
        k_data, v_data = datas
    else:
        k_data, v_data = _bytes_of(k_src), _bytes_of(v_src)
    return LayerSections(
        first_block=first_block,
        k=tuple(k_data[i * size : (i + 1) * size] for i in range(n)),
        v=tuple(v_data[i * size : (i + 1) * size] for i in range(n)),
        k_data=k_data,
        v_data=v_data,
        copied=copied,
    )


def page_sections(
    k_pages: Array, v_pages: Array, page: int, descriptor: CompatibilityDescriptor
) -> tuple[memoryview, memoryview]:
    """``(K section, V section)`` of one page of a paged HND cache: always zero-copy.

    ``k_pages`` and ``v_pages`` are ``[num_pages, kv_heads, block_tokens,
    head_dim]`` (page size = ``block_tokens``); a page is a section as is. The
    caller maps block indices to pages through its own block table.

    Raises:
        ValueError: wrong shapes, dtypes, non-contiguous input, page out of range.
    """
    views = []
    shape = descriptor.section_shape
    for arr, name in ((k_pages, "k_pages"), (v_pages, "v_pages")):
        if not isinstance(arr, np.ndarray) or arr.ndim != 4 or tuple(arr.shape[1:]) != shape:
            got = getattr(arr, "shape", type(arr).__name__)
            raise ValueError(f"{name} has shape {got}; pages are [num_pages, *{shape}]")
        raw = _check_dtype(arr, descriptor.dtype, name)
        _check_contiguous(arr, name)
        if not 0 <= page < arr.shape[0]:
            raise ValueError(f"page {page} is not in 0..{arr.shape[0] - 1}")
        views.append(_bytes_of(raw[page]))
    return views[0], views[1]


# --------------------------------------------------------------------------- consumer side


def section_array(section: BufferLike | Array, descriptor: CompatibilityDescriptor) -> Array:
    """A section's bytes as a ``[kv_heads, block_tokens, head_dim]`` array of raw dtype (a view).

    Read-only when ``section`` is (``bytes``).

    Raises:
        SectionError: not ``section_size`` octets.
    """
    view = _readable(section, "section")
    if len(view) != descriptor.section_size:
        raise SectionError(f"section is {len(view)} octets, not {descriptor.section_size}")
    result: Array = np.frombuffer(view, _RAW[descriptor.dtype]).reshape(descriptor.section_shape)
    return result


def write_block(
    layer_array: Array,
    block: int,
    section: BufferLike | Array,
    descriptor: CompatibilityDescriptor,
    *,
    layout: Layout = "HND",
) -> None:
    """Copy one (verified, raw) section straight into an engine layer: the one copy.

    For a consumer whose destination is the engine's own cache array: block
    ``block`` of ``layer_array`` (HND or NHD, C-contiguous, writable) receives
    ``section``; a scatter into ``kv_heads`` runs for HND.

    Raises:
        ValueError: as for :func:`section_of`, or a read-only array.
        SectionError: ``section`` is not ``section_size`` octets.
    """
    raw, tokens = _check_engine_layer(layer_array, descriptor, layout, "layer_array")
    if not raw.flags.writeable:
        raise ValueError("layer_array is read-only")
    _check_blocks(tokens, descriptor, block, 1, "layer_array")
    dst = _section_order(raw, layout, block, 1, descriptor.block_tokens)[0]
    np.copyto(dst, section_array(section, descriptor))


_COMPONENT_INDEX: Final = {"k": 0, "v": 1}


def _component(component: Component | int | str) -> int:
    if isinstance(component, str):
        if component in _COMPONENT_INDEX:
            return _COMPONENT_INDEX[component]
    elif component in (Component.K, Component.V):
        return int(component) - 1
    raise ValueError(
        f"component must be 'k' or 'v' (Component.K or Component.V), not {component!r}"
    )


class KvDestination:
    """Preallocated section-order buffers that a consumer writes verified Data into.

    One writable buffer per (layer, component) holds ``blocks`` sections back
    to back (block ``i`` at ``i * section_size``): ``2 * layers * blocks *
    section_size`` octets in all, zero-filled and touched here, at construction:
    the pages are the process's before a retrieval writes into them, so no write
    of a verified Object takes a page fault. (Left to the first write, the faults
    cost a consumer more CPU than hashing every Object: in ``kvcs fetch`` over
    pquic, whose network thread maps and unmaps its buffers as data flows, about
    0.5 s per 128 MiB against 25 ms for touching the same memory up front.)
    The consumer machine writes each verified Object's Data into
    :meth:`buffer` / :meth:`section` (the one copy from the wire), or calls
    :meth:`write`, which also decodes ``q8``. The engine then reads the layer
    as arrays: :meth:`as_paged_arrays` (always a view) or
    :meth:`as_engine_arrays` (a view or one documented copy).

    The destination owns the memory; arrays and memoryviews taken from it
    keep it alive and see later writes.

    Args:
        descriptor: the publication's Compatibility Descriptor.
        tokens: tokens to receive, a positive multiple of ``block_tokens``
            (only full blocks are cached; a partial tail is recomputed:
            pass ``(n // block_tokens) * block_tokens`` for an ``n``-token
            prompt).

    Raises:
        ValueError: ``tokens`` is not a positive multiple of ``block_tokens``.
    """

    def __init__(self, descriptor: CompatibilityDescriptor, tokens: int) -> None:
        b = descriptor.block_tokens
        if tokens < b or tokens % b:
            raise ValueError(
                f"tokens must be a positive multiple of block_tokens={b}, not {tokens} "
                f"(only full blocks are cached: use {(tokens // b) * b} and recompute the tail)"
            )
        self.descriptor: Final = descriptor
        self.tokens: Final = tokens
        self.blocks: Final = tokens // b
        self.layer_size: Final = self.blocks * descriptor.section_size
        """Octets of one (layer, component) buffer."""
        self._storage: Final[Array] = np.empty((descriptor.layers, 2, self.layer_size), np.uint8)
        self._storage.fill(0)  # touched now: see the class docstring

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.descriptor.layers:
            raise ValueError(f"layer {layer} is not in 0..{self.descriptor.layers - 1}")
        return layer

    def _block(self, block: int) -> int:
        if not 0 <= block < self.blocks:
            raise ValueError(f"block {block} is not in 0..{self.blocks - 1}")
        return block

    def buffer(self, layer: int, component: Component | int | str) -> memoryview:
        """The writable section-order buffer of ``layer`` and ``"k"`` / ``"v"`` (a view)."""
        row: Array = self._storage[self._layer(layer), _component(component)]
        return row.data

    def section(self, layer: int, component: Component | int | str, block: int) -> memoryview:
        """The writable ``section_size`` slice of :meth:`buffer` that holds block ``block``."""
        size = self.descriptor.section_size
        start = self._block(block) * size
        return self.buffer(layer, component)[start : start + size]

    def write(
        self,
        layer: int,
        component: Component | int | str,
        block: int,
        data: BufferLike,
        codec: Codec | int = Codec.RAW,
    ) -> None:
        """Store the (verified) Data of one Object: one copy (raw) or one decode (q8).

        ``component`` may be ``Component.KV`` (or ``"kv"``): the Data is then
        the encoded K section followed by the encoded V section.

        Raises:
            UnknownCodecError: ``codec`` is not in the registry.
            SectionError: ``data`` has the wrong size for the codec.
            ValueError: bad layer, block or component.
        """
        codec = codec_from_value(codec)
        view = _readable(data, "data")
        is_kv = component == "kv" if isinstance(component, str) else component == Component.KV
        indices = (0, 1) if is_kv else (_component(component),)
        each = (
            self.descriptor.section_size
            if codec is Codec.RAW
            else q8_size(self.descriptor.section_shape)
        )
        if len(view) != each * len(indices):
            raise SectionError(
                f"{codec.registry_name} Data of component {component!r} is {len(view)} "
                f"octets, not {each * len(indices)}"
            )
        for n, index in enumerate(indices):
            part = view[n * each : (n + 1) * each]
            dst = self.section(layer, "kv"[index], block)
            if codec is Codec.RAW:
                dst[:] = part
            else:
                q8_decode_section(part, self.descriptor, out=dst)

    def as_paged_arrays(self, layer: int) -> tuple[Array, Array]:
        """``(k, v)`` of ``layer`` as ``[blocks, kv_heads, block_tokens, head_dim]`` views.

        Always zero-copy (this is section order); raw dtype (:func:`engine_dtype`).
        """
        shape = (self.blocks, *self.descriptor.section_shape)
        dt = _RAW[self.descriptor.dtype]
        k = self._storage[self._layer(layer), 0].view(dt).reshape(shape)
        v = self._storage[layer, 1].view(dt).reshape(shape)
        return k, v

    def engine_view_possible(self, layout: Layout = "HND") -> bool:
        """Whether :meth:`as_engine_arrays` returns views (no copy) for ``layout``.

        HND: ``kv_heads == 1`` or one block; NHD: ``kv_heads == 1`` or
        ``block_tokens == 1``.
        """
        _check_layout(layout)
        d = self.descriptor
        if layout == "HND":
            return d.kv_heads == 1 or self.blocks == 1
        return d.kv_heads == 1 or d.block_tokens == 1

    def as_engine_arrays(
        self, layer: int, *, layout: Layout = "HND", out: tuple[Array, Array] | None = None
    ) -> tuple[Array, Array]:
        """``(k, v)`` of ``layer`` as engine arrays (HND ``[kv_heads, tokens, head_dim]``).

        Zero-copy views (``np.frombuffer`` + reshape + transpose) when
        :meth:`engine_view_possible`; ``out`` must then be ``None``. Otherwise
        exactly one copy per component: into ``out`` (two writable,
        C-contiguous engine layers of the descriptor's shape and raw dtype
        with at least ``tokens`` tokens; the first ``tokens`` are written), or
        into new C-contiguous arrays.

        Raises:
            ValueError: bad layer or layout, ``out`` where no copy is made, or
                a bad ``out``.
        """
        d = self.descriptor
        paged = self.as_paged_arrays(layer)
        if self.engine_view_possible(layout):
            if out is not None:
                raise ValueError(
                    "as_engine_arrays makes no copy for this layout (views are returned); "
                    "out is not written: drop it, or copy the views yourself"
                )
            return self._views(paged[0], layout), self._views(paged[1], layout)
        result = []
        for i, src in enumerate(paged):
            if out is None:
                shape = (
                    (d.kv_heads, self.tokens, d.head_dim)
                    if layout == "HND"
                    else (self.tokens, d.kv_heads, d.head_dim)
                )
                dst: Array = np.empty(shape, src.dtype)
            else:
                dst = out[i]
                raw, out_tokens = _check_engine_layer(dst, d, layout, f"out[{i}]")
                if not raw.flags.writeable:
                    raise ValueError(f"out[{i}] is read-only")
                _check_blocks(out_tokens, d, 0, self.blocks, f"out[{i}]")
                dst = raw
            np.copyto(_section_order(dst, layout, 0, self.blocks, d.block_tokens), src)
            result.append(out[i] if out is not None else dst)
        return result[0], result[1]

    def _views(self, paged: Array, layout: str) -> Array:
        """The engine-layout view of ``[blocks, H, B, D]`` (only when it is one)."""
        n, h, b, d = paged.shape
        if layout == "HND":
            moved = paged.transpose(1, 0, 2, 3)
            shape = (h, n * b, d)
        else:
            moved = paged.transpose(0, 2, 1, 3)
            shape = (n * b, h, d)
        # engine_view_possible guarantees that ``moved`` is C-contiguous, so this is a view
        result: Array = moved.reshape(shape)
        return result


# --------------------------------------------------------------------------- dtypes


def _fp8_table(exp_bits: int, man_bits: int, ieee_specials: bool) -> list[float]:
    """The value of each of the 256 codes (binding section 1 formats; see kvsp.dtypes)."""
    bias = (1 << (exp_bits - 1)) - 1
    exp_max = (1 << exp_bits) - 1
    man_max = (1 << man_bits) - 1
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> man_bits) & exp_max
        man = code & man_max
        if exp == exp_max and ieee_specials:
            value = math.inf if man == 0 else math.nan
        elif exp == exp_max and man == man_max:  # e4m3fn: S.1111.111 is NaN
            value = math.nan
        elif exp == 0:
            value = math.ldexp(man, 1 - bias - man_bits)
        else:
            value = math.ldexp(man + (1 << man_bits), exp - bias - man_bits)
        values.append(sign * value)
    return values


@attrs.frozen(eq=False)
class _Fp8:
    decode: Array  # float32[256]
    ladder: Array  # float64: positive codes 0..max_code ascending, then the next value
    max_code: int
    overflow: int
    nan: int


def _fp8(exp_bits: int, man_bits: int, ieee: bool, max_code: int, overflow: int, nan: int) -> _Fp8:
    table = _fp8_table(exp_bits, man_bits, ieee)
    top, below = table[max_code], table[max_code - 1]
    ladder = np.array([*table[: max_code + 1], top + (top - below)], np.float64)
    return _Fp8(np.array(table, np.float32), ladder, max_code, overflow, nan)


_FP8: Final = {
    Dtype.FLOAT8_E4M3FN: _fp8(4, 3, False, max_code=0x7E, overflow=0x7F, nan=0x7F),
    Dtype.FLOAT8_E5M2: _fp8(5, 2, True, max_code=0x7B, overflow=0x7C, nan=0x7E),
}


def to_float32(raw: Array, dtype: Dtype | str) -> Array:
    """Elements of ``dtype`` (raw dtype array, :func:`engine_dtype`) as float32, exactly.

    float32 input is returned as is (no copy); other dtypes make one new array.

    Raises:
        ValueError: ``raw`` does not have the raw dtype of ``dtype``.
    """
    dtype = Dtype(dtype)
    raw = _check_dtype(np.asarray(raw), dtype, "raw")
    if dtype is Dtype.FLOAT32:
        return raw
    if dtype is Dtype.FLOAT16:
        return raw.astype(_F32)
    if dtype is Dtype.BFLOAT16:
        result: Array = (raw.astype(np.uint32) << np.uint32(16)).view(_F32)
        return result
    table: Array = _FP8[dtype].decode[raw]
    return table


def from_float32(x: Array, dtype: Dtype | str, *, out: Array | None = None) -> Array:
    """float32 values rounded to ``dtype`` (raw dtype array), as ``kvsp.dtypes.from_float32``.

    IEEE round-to-nearest-even with subnormals; overflow to +-inf (NaN for
    float8_e4m3fn); NaN stays NaN with its sign (float16 0x7E00, bfloat16
    0x7FC0, float8 0x7E / 0x7F; float32 NaNs pass through unchanged).

    Raises:
        ValueError: ``x`` is not float32, or a bad ``out``.
    """
    dtype = Dtype(dtype)
    x = np.asarray(x)
    if x.dtype != _F32:
        raise ValueError(f"x must be float32, not {x.dtype}")
    want = _RAW[dtype]
    if out is None:
        out = np.empty(x.shape, want)
    elif out.dtype != want or out.shape != x.shape:
        raise ValueError(f"out must be {want} of shape {x.shape}, not {out.dtype} {out.shape}")
    if dtype is Dtype.FLOAT32:
        np.copyto(out, x)
    elif dtype is Dtype.FLOAT16:
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(out, x, casting="unsafe")
        nan = np.isnan(x)
        if nan.any():  # pin the NaN to 0x7E00 with its sign, whatever the payload
            out.view(np.uint16)[nan] = np.where(np.signbit(x[nan]), 0xFE00, 0x7E00)
    elif dtype is Dtype.BFLOAT16:
        bits = x.view(np.uint32)
        rounded = (
            bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        ) >> np.uint32(16)
        np.copyto(out, rounded, casting="unsafe")
        nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        if nan.any():
            out[nan] = ((bits[nan] >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    else:
        _fp8_encode(x, _FP8[dtype], out)
    return out


def _fp8_encode(x: Array, fmt: _Fp8, out: Array) -> None:
    """Round-to-nearest-even to an 8-bit float: the reference's bisection, vectorised."""
    with np.errstate(invalid="ignore"):  # a signalling NaN widens quietly
        a = np.abs(x.astype(np.float64))
    ladder = fmt.ladder
    top = len(ladder) - 1
    i = np.searchsorted(ladder, a, side="left")
    over = i > top
    ic = np.minimum(i, top)
    hi = ladder[ic]
    lo = ladder[np.maximum(ic - 1, 0)]
    with np.errstate(invalid="ignore"):
        below, above = a - lo, hi - a
        down = (hi != a) & (ic > 0) & ((below < above) | ((below == above) & ((ic - 1) % 2 == 0)))
    code = ic - down
    code = np.where(over | (code > fmt.max_code), fmt.overflow, code)
    code = np.where(np.isnan(x), fmt.nan, code)
    code |= np.where(np.signbit(x), 0x80, 0)
    np.copyto(out, code, casting="unsafe")


# --------------------------------------------------------------------------- q8


def _q8_geometry(descriptor: CompatibilityDescriptor, blocks: int) -> tuple[int, int, int]:
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, not {blocks}")
    h, b, d = descriptor.section_shape
    return h * b, d, q8_size(descriptor.section_shape)


def q8_encode(
    sections: BufferLike | Array,
    descriptor: CompatibilityDescriptor,
    *,
    blocks: int = 1,
    out: WritableBuffer | None = None,
) -> memoryview:
    """q8-encode ``blocks`` sections (back to back) into ``blocks`` q8 Data (back to back).

    Byte for byte the result of ``kvcs_core.kvsp.q8_encode`` on each section
    (float32 arithmetic: ``scale = float32(m / 127)``, ``q =
    clip(rint(float32(x / scale)), -127, 127)``, zero rows for a zero scale,
    stored scale rounded to float16). ``sections`` is bytes-like or a
    C-contiguous array (any shape) of raw dtype elements. The result is
    written into ``out`` (``blocks * q8_size`` writable octets) or a new
    buffer.

    Raises:
        SectionError: wrong size, a non-finite element, or a scale beyond
            float16 (as the reference).
        ValueError: bad ``blocks`` or ``out``, or an array of the wrong dtype.
    """
    rows, dim, size = _q8_geometry(descriptor, blocks)
    dtype = descriptor.dtype
    if isinstance(sections, np.ndarray):
        _check_dtype(sections, dtype, "sections")
    view = _readable(sections, "sections")
    want = blocks * descriptor.section_size
    if len(view) != want:
        raise SectionError(f"sections are {len(view)} octets, not {want} ({blocks} blocks)")
    x = to_float32(np.frombuffer(view, _RAW[dtype]).reshape(blocks, rows, dim), dtype)
    with np.errstate(invalid="ignore"):
        peak = np.abs(x).max(axis=2)  # NaN and inf propagate: one pass finds them
    if not np.isfinite(peak).all():
        finite = np.isfinite(x)
        index = int(np.argmin(finite.reshape(-1)))
        blk, rest = divmod(index, rows * dim)
        h, rest = divmod(rest, descriptor.block_tokens * dim)
        t, e = divmod(rest, dim)
        value = float(x.reshape(-1)[index])
        raise SectionError(
            f"block {blk} element [{h}, {t}, {e}] is {value!r}: q8 encodes only finite values"
        )
    scale = peak / np.float32(Q8_MAX)  # float32 division, correctly rounded
    with np.errstate(over="ignore"):
        stored = scale.astype(_F16)
    if np.isinf(stored).any():
        index = int(np.argmax(np.isinf(stored).reshape(-1)))
        blk, row = divmod(index, rows)
        raise SectionError(
            f"q8 scale {float(scale.reshape(-1)[index])!r} of block {blk} head "
            f"{row // descriptor.block_tokens}, token {row % descriptor.block_tokens} is beyond "
            f"float16 (row max above ~8.3e6)"
        )
    zero = scale == 0
    q = x / np.where(zero, np.float32(1), scale)[:, :, None]  # float32 quotient
    np.rint(q, out=q)  # ties to even
    np.clip(q, -Q8_MAX, Q8_MAX, out=q)
    q[zero] = 0
    if out is None:
        dst = np.empty(blocks * size, np.uint8)
    else:
        dst = _writable(out, blocks * size, "out")
    grid = dst.reshape(blocks, size)
    grid[:, : rows * Q8_SCALE_SIZE].view(_F16)[...] = stored
    np.copyto(
        grid[:, rows * Q8_SCALE_SIZE :].view(np.int8).reshape(blocks, rows, dim),
        q,
        casting="unsafe",
    )
    return dst.data


def _q8_products(
    data: BufferLike | Array, descriptor: CompatibilityDescriptor, blocks: int, out: Array | None
) -> Array:
    """float32 ``q * scale`` of ``blocks`` q8 Data, shape [blocks, H*B, D]."""
    rows, dim, size = _q8_geometry(descriptor, blocks)
    view = _readable(data, "data")
    if len(view) != blocks * size:
        raise SectionError(f"q8 Data is {len(view)} octets, not {blocks * size} ({blocks} blocks)")
    grid = np.frombuffer(view, np.uint8).reshape(blocks, size)
    scales = grid[:, : rows * Q8_SCALE_SIZE].view(_F16).astype(_F32)
    q = grid[:, rows * Q8_SCALE_SIZE :].view(np.int8).reshape(blocks, rows, dim)
    if out is None:
        out = np.empty((blocks, rows, dim), _F32)
    with np.errstate(invalid="ignore", over="ignore"):
        np.multiply(q, scales[:, :, None], out=out, dtype=_F32)
    if not np.isfinite(scales).all():  # NaN results: the quiet NaN, keeping the CPU's sign
        bits = out.view(np.uint32)
        nan = np.isnan(out)
        bits[nan] = (bits[nan] & _F32_SIGN) | _F32_QNAN
    return out


def q8_decode(data: BufferLike | Array, descriptor: CompatibilityDescriptor) -> Array:
    """q8 Data of one section as float32 ``[kv_heads, block_tokens, head_dim]``.

    ``x = float32(q) * float32(scale)`` (exact); before the cast to the
    descriptor dtype, which :func:`q8_decode_section` does.

    Raises:
        SectionError: ``data`` is not ``q8_size`` octets.
    """
    result: Array = _q8_products(data, descriptor, 1, None).reshape(descriptor.section_shape)
    return result


def q8_decode_blocks(
    data: BufferLike | Array, descriptor: CompatibilityDescriptor, blocks: int
) -> Array:
    """``blocks`` q8 Data back to back as float32 ``[blocks, kv_heads, block_tokens, head_dim]``."""
    result: Array = _q8_products(data, descriptor, blocks, None).reshape(
        blocks, *descriptor.section_shape
    )
    return result


def q8_decode_section(
    data: BufferLike | Array,
    descriptor: CompatibilityDescriptor,
    *,
    blocks: int = 1,
    out: WritableBuffer | None = None,
) -> memoryview:
    """q8 Data back to raw sections in the descriptor dtype: ``kvcs_core.kvsp.q8_decode``'s bytes.

    Written into ``out`` (``blocks * section_size`` writable octets, e.g.
    :meth:`KvDestination.section`) or a new buffer.

    Raises:
        SectionError: wrong size of ``data``.
        ValueError: bad ``blocks`` or ``out``.
    """
    rows, dim, _ = _q8_geometry(descriptor, blocks)
    want = blocks * descriptor.section_size
    dst = np.empty(want, np.uint8) if out is None else _writable(out, want, "out")
    target = dst.view(_RAW[descriptor.dtype]).reshape(blocks, rows, dim)
    if descriptor.dtype is Dtype.FLOAT32:
        _q8_products(data, descriptor, blocks, target)
    else:
        from_float32(_q8_products(data, descriptor, blocks, None), descriptor.dtype, out=target)
    return dst.data
