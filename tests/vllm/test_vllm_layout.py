"""vLLM's paged KV tensors <-> KVSP blocks (``kvcs.vllm.layout``), against the way the
attention backends themselves read the tensors."""

from __future__ import annotations

import pytest
import torch

from kvcs.adapters.cachefile import llama_descriptor
from kvcs.adapters.torch_kv import TorchKvDestination, layer_sections
from kvcs.vllm.layout import gather_sections, layer_index, layer_order, paged_views, write_blocks
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

H, D, B, PAGES = 2, 64, 32, 8


def _cd(dtype: str = "bfloat16") -> CompatibilityDescriptor:
    return CompatibilityDescriptor(
        dict(llama_descriptor(layers=2, kv_heads=H, head_dim=D, block_tokens=B, dtype=dtype))
    )


def _cpu_kv_of(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM 0.32's CPU_ATTN backend reads as K and V ``[blocks, H, B, D]``."""
    n, h, b, _ = cache.size()
    return cache.view((n, h, b * 2, -1)).chunk(2, dim=2)


def test_layer_names_map_to_layer_numbers() -> None:
    assert layer_index("model.layers.11.self_attn.attn") == 11
    assert layer_index("layers.0.attn") == 0
    names = [f"model.layers.{i}.self_attn.attn" for i in (1, 0)]
    assert layer_order(names, 2) == {names[0]: 1, names[1]: 0}
    with pytest.raises(ValueError, match="no layer number"):
        layer_index("model.attn")
    with pytest.raises(ValueError, match="numbered \\[0, 2\\]"):
        layer_order(["model.layers.0.attn", "model.layers.2.attn"], 2)


def test_cpu_pages_are_what_the_cpu_backend_reads() -> None:
    cd = _cd()
    cache = torch.randn(PAGES, H, B, 2 * D).to(torch.bfloat16)
    pages = paged_views(cache, cd)
    k, v = _cpu_kv_of(cache)
    assert pages.page_layout == "HND"
    assert torch.equal(pages.k, k) and torch.equal(pages.v, v)
    assert pages.k.data_ptr() == cache.data_ptr()  # views, not copies


def test_written_blocks_are_read_back_by_the_backend_and_published_alike() -> None:
    cd = _cd()
    cache = torch.zeros(PAGES, H, B, 2 * D, dtype=torch.bfloat16)
    pages = paged_views(cache, cd)
    k_src = torch.randn(3, H, B, D).to(torch.bfloat16)
    v_src = torch.randn(3, H, B, D).to(torch.bfloat16)
    ids = [5, 1, 6]
    write_blocks(pages, ids, k_src, v_src)
    k, v = _cpu_kv_of(cache)
    assert torch.equal(k[ids], k_src) and torch.equal(v[ids], v_src)
    untouched = [i for i in range(PAGES) if i not in ids]
    assert not k[untouched].any() and not v[untouched].any()
    # gathering the same blocks gives the KVSP sections of the same K/V in token order
    ks, vs = gather_sections(pages, ids, cd)
    ref = layer_sections(
        k_src.permute(1, 0, 2, 3).reshape(H, 3 * B, D),
        v_src.permute(1, 0, 2, 3).reshape(H, 3 * B, D),
        cd,
        layout="HND",
    )
    assert [bytes(x) for x in ks] == [bytes(x) for x in ref.k]
    assert [bytes(x) for x in vs] == [bytes(x) for x in ref.v]


def test_gathered_sections_do_not_alias_the_pages() -> None:
    cd = _cd()
    cache = torch.randn(PAGES, H, B, 2 * D).to(torch.bfloat16)
    pages = paged_views(cache, cd)
    ks, _ = gather_sections(pages, [2], cd)
    before = bytes(ks[0])
    cache.zero_()  # the engine reuses the block
    assert bytes(ks[0]) == before


def test_a_received_destination_goes_into_the_pages() -> None:
    cd = _cd("float32")
    k_src = torch.randn(H, 2 * B, D)
    v_src = torch.randn(H, 2 * B, D)
    s = layer_sections(k_src, v_src, cd, layout="HND")
    dest = TorchKvDestination(cd, 2 * B)
    for comp, secs in (("k", s.k), ("v", s.v)):
        buf = dest.buffer(0, comp)
        for i, sec in enumerate(secs):
            buf[i * cd.section_size : (i + 1) * cd.section_size] = sec
    dest.layer_ready(0)
    cache = torch.zeros(PAGES, H, B, 2 * D)
    pages = paged_views(cache, cd)
    k, v = dest.paged(0)
    write_blocks(pages, [3, 0], k, v)
    got_k, got_v = _cpu_kv_of(cache)
    assert torch.equal(got_k[3], k_src[:, :B]) and torch.equal(got_k[0], k_src[:, B:])
    assert torch.equal(got_v[3], v_src[:, :B]) and torch.equal(got_v[0], v_src[:, B:])


def test_gpu_layouts_split_k_and_v() -> None:
    cd = _cd("float32")
    flash = torch.randn(2, PAGES, B, H, D)  # FlashAttention: [2, blocks, block, heads, dim]
    p = paged_views(flash, cd)
    assert p.page_layout == "NHD" and torch.equal(p.k, flash[0]) and torch.equal(p.v, flash[1])
    infer = torch.randn(PAGES, 2, B, H, D)  # FlashInfer: [blocks, 2, block, heads, dim]
    p = paged_views(infer, cd)
    assert torch.equal(p.k, infer[:, 0]) and torch.equal(p.v, infer[:, 1])
    k_src, v_src = torch.randn(1, H, B, D), torch.randn(1, H, B, D)
    write_blocks(p, [4], k_src, v_src)
    assert torch.equal(infer[4, 0], k_src[0].permute(1, 0, 2))


def test_unknown_layouts_and_bad_blocks_are_refused() -> None:
    cd = _cd()
    with pytest.raises(ValueError, match="not a layout the connector knows"):
        paged_views(torch.zeros(PAGES, H, 16, 2 * D, dtype=torch.bfloat16), cd)  # block 16
    pages = paged_views(torch.zeros(PAGES, H, B, 2 * D, dtype=torch.bfloat16), cd)
    with pytest.raises(ValueError, match="block IDs outside"):
        gather_sections(pages, [PAGES], cd)
    with pytest.raises(ValueError, match="dtype"):
        write_blocks(pages, [0], torch.zeros(1, H, B, D), torch.zeros(1, H, B, D))
