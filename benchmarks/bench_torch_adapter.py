"""torch KV adapter throughput on CPU tensors, beside SHA-256 of the same bytes.

Run from the repository root (needs torch: ``pip install 'kvcs[torch]'``)::

    python3 benchmarks/bench_torch_adapter.py [--tokens N] [--heads H] [--dim D]
                                              [--block B] [--dtype DT] [--repeat R]
                                              [--threads T]

The default is one Llama-like layer (8 KV heads, head_dim 128, 4096 tokens,
bfloat16, blocks of 16 tokens: 256 blocks, 8 MiB for K and 8 MiB for V). In
the same run it measures:

* consumer: every Object's verified Data written into a
  ``TorchKvDestination`` the way the consumer machine does it (one
  ``memoryview`` slice assignment per Object into ``dest.buffer``), then
  ``layer_ready`` and the layer read as torch tensors: ``paged()`` (views),
  ``layer("HND")`` (one copy back to ``[kv_heads, tokens, head_dim]``, new
  tensors or ``out``);
* publisher: ``layer_sections`` from torch tensors in HND and NHD (one gather
  copy per component), ``paged_layer_sections`` from an NHD paged cache
  through a slot mapping (one gather);
* ``Tensor.copy_`` and ``np.copyto`` of the same number of bytes, contiguous
  (memcpy floors; the adapter copies CPU tensors through numpy views, see
  ``_copy`` in ``adapters/torch_kv.py``).

Every row gives the bytes, the best of R runs (``time.perf_counter``), MB/s
(MB = 10**6 bytes) and ``x sha256``: how many times faster than
``hashlib.sha256`` over the same bytes, timed right before the case so that
machine load hits both sides (the consumer hashes every Object anyway: a data
path at >= 1x costs no more than its verification).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from kvcs.adapters import numpy_kv as nk
from kvcs.adapters import torch_kv as tk
from kvcs_core.kvsp import CompatibilityDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_numpy_adapter import best_of, sha256_all  # the same timing and reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(tk._TORCH))
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cd = CompatibilityDescriptor.create(
        model="bench/llama-like@1",
        layers=1,
        kv_heads=args.heads,
        head_dim=args.dim,
        dtype=args.dtype,
        block_tokens=args.block,
    )
    blocks = args.tokens // args.block
    tokens = blocks * args.block
    size = cd.section_size
    dt = tk.torch_dtype(cd.dtype)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(args.heads, tokens, args.dim, generator=gen).to(dt)
    v = torch.randn(args.heads, tokens, args.dim, generator=gen).to(dt)
    k_nhd, v_nhd = k.permute(1, 0, 2).contiguous(), v.permute(1, 0, 2).contiguous()
    engine = [tk._bytes_of(k), tk._bytes_of(v)]

    sections = tk.layer_sections(k, v, cd)
    objects = list(sections.k) + list(sections.v)  # what arrives: one Data per Object
    dest = tk.TorchKvDestination(cd, tokens)
    targets = [dest.buffer(0, "k"), dest.buffer(0, "v")]
    out = (torch.empty_like(k), torch.empty_like(v))

    def receive() -> None:
        for ci, target in enumerate(targets):
            for b in range(blocks):
                target[b * size : (b + 1) * size] = objects[ci * blocks + b]
        dest.layer_ready(0)

    def receive_paged() -> None:
        receive()
        dest.paged(0)

    def receive_layer() -> None:
        receive()
        dest.layer(0, "HND")

    def receive_layer_out() -> None:
        receive()
        dest.layer(0, "HND", out=out)

    # an NHD paged cache (vLLM's [num_pages, page_size, kv_heads, head_dim]), pages shuffled
    pages = blocks
    perm = torch.randperm(pages, generator=gen)
    k_pages = torch.empty(pages, args.block, args.heads, args.dim, dtype=dt)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm] = k_nhd.view(blocks, args.block, args.heads, args.dim)
    v_pages[perm] = v_nhd.view(blocks, args.block, args.heads, args.dim)
    slots = tk.slots_from_page_table(perm, tokens, args.block)
    check = tk.paged_layer_sections(k_pages, v_pages, slots, cd, page_layout="NHD")
    assert bytes(check.k_data) == bytes(sections.k_data), "paged gather differs"
    raw = nk.engine_dtype(cd.dtype)
    k_np, v_np = (t.view(tk._BITS[cd.dtype]).numpy().view(raw) for t in (k, v))
    ref = nk.layer_sections(k_np, v_np, cd)
    assert bytes(sections.k_data) == bytes(ref.k_data), "torch sections differ from numpy's"

    flat_src = torch.cat([k.reshape(-1), v.reshape(-1)])
    flat_dst = torch.empty_like(flat_src)
    np_src = flat_src.view(tk._BITS[cd.dtype]).numpy()
    np_dst = np.empty_like(np_src)
    cases: list[tuple[str, list[memoryview], Callable[[], object]]] = [
        ("Tensor.copy_, contiguous (memcpy floor)", engine, lambda: flat_dst.copy_(flat_src)),
        ("np.copyto, contiguous (memcpy floor)", engine, lambda: np.copyto(np_dst, np_src)),
        (f"consumer: {2 * blocks} Objects -> dest, paged()", objects, receive_paged),
        (f"consumer: {2 * blocks} Objects -> dest, layer()", objects, receive_layer),
        (f"consumer: {2 * blocks} Objects -> layer(out=)", objects, receive_layer_out),
        ("publisher: layer_sections HND", engine, lambda: tk.layer_sections(k, v, cd)),
        (
            "publisher: layer_sections NHD",
            engine,
            lambda: tk.layer_sections(k_nhd, v_nhd, cd, layout="NHD"),
        ),
        (
            "publisher: paged_layer_sections NHD pages",
            engine,
            lambda: tk.paged_layer_sections(k_pages, v_pages, slots, cd, page_layout="NHD"),
        ),
    ]

    print(
        f"layer: kv_heads={args.heads} head_dim={args.dim} tokens={tokens} {args.dtype}, "
        f"block_tokens={args.block} ({blocks} blocks, section {size} B); torch "
        f"{torch.__version__} on CPU, {torch.get_num_threads()} threads; best of {args.repeat}"
    )
    header = f"{'case':44} {'in MB':>7} {'ms':>9} {'MB/s':>9} {'sha256 ms':>10} {'x sha256':>9}"
    print(header)
    print("-" * len(header))
    for name, parts, fn in cases:
        nbytes = sum(len(p) for p in parts)
        sha = best_of(args.repeat, lambda parts=parts: sha256_all(parts))
        t = best_of(args.repeat, fn)
        print(
            f"{name:44} {nbytes / 1e6:7.2f} {t * 1e3:9.2f} {nbytes / t / 1e6:9.0f} "
            f"{sha * 1e3:10.2f} {sha / t:9.2f}"
        )


if __name__ == "__main__":
    main()
