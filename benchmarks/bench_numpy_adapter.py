"""numpy KV adapter throughput: section gather and q8 versus SHA-256 of the same bytes.

Run from the repository root::

    python3 benchmarks/bench_numpy_adapter.py [--tokens N] [--heads H] [--dim D]
                                              [--block B] [--repeat R]

The default is one Llama-like layer (8 KV heads, head_dim 128, 4096 tokens,
float16; blocks of 16 tokens, 256 blocks): 8 MiB for K and 8 MiB for V, in
the engine layout ``[kv_heads, tokens, head_dim]``. In the same run it
measures:

* ``layer_sections``: the one gather copy per layer and component (K and V)
  into section order, plus the per-block memoryview slices;
* ``block_sections`` for every block: one gather copy per section (new
  buffers, then preallocated ``out`` buffers);
* ``KvDestination.as_engine_arrays``: the consumer's one copy back to
  ``[kv_heads, tokens, head_dim]``;
* q8 encode and decode of the whole layer (K and V) in one call, to float32
  and to float16, and q8 decode called once per block;
* the pure-Python ``kvcs_core.kvsp.q8_decode`` on one block, extrapolated to
  the layer (what the adapter replaces);
* ``np.copyto`` of the same number of bytes, contiguous (a memcpy floor).

Every row gives the bytes read, the best of R runs (``time.perf_counter``),
MB/s (MB = 10**6 bytes) and ``x sha256``: how many times faster than
``hashlib.sha256`` over the same input bytes, timed right before the case so
that machine load hits both sides (the consumer hashes every Object's Data
anyway, so a data path at >= 1x costs no more than the verification).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from kvcs.adapters import numpy_kv as nk
from kvcs_core.kvsp import CompatibilityDescriptor, q8_decode, q8_size


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def sha256_all(parts: list[memoryview]) -> None:
    for part in parts:
        hashlib.sha256(part).digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    cd = CompatibilityDescriptor.create(
        model="bench/llama-like@1",
        layers=1,
        kv_heads=args.heads,
        head_dim=args.dim,
        dtype="float16",
        block_tokens=args.block,
    )
    blocks = args.tokens // args.block
    tokens = blocks * args.block
    rng = np.random.default_rng(0)
    shape = (args.heads, tokens, args.dim)
    k = rng.standard_normal(shape, dtype=np.float32).astype("<f2")
    v = rng.standard_normal(shape, dtype=np.float32).astype("<f2")
    engine_bytes = [
        k.reshape(-1).view(np.uint8).data,
        v.reshape(-1).view(np.uint8).data,
    ]
    size = cd.section_size

    sections = nk.layer_sections(k, v, cd)
    section_parts = list(sections.k) + list(sections.v)
    q8_k = nk.q8_encode(sections.k_data, cd, blocks=blocks)
    q8_v = nk.q8_encode(sections.v_data, cd, blocks=blocks)
    q8_parts = [q8_k, q8_v]
    q8_block = q8_size(cd.section_shape)
    q8_blocks = [q8_k[i * q8_block : (i + 1) * q8_block] for i in range(blocks)] + [
        q8_v[i * q8_block : (i + 1) * q8_block] for i in range(blocks)
    ]
    dest = nk.KvDestination(cd, tokens)
    dest.buffer(0, "k")[:] = sections.k_data
    dest.buffer(0, "v")[:] = sections.v_data
    out_k, out_v = bytearray(size), bytearray(size)
    dst_k, dst_v = np.empty_like(k), np.empty_like(v)
    flat_src = np.concatenate([k.reshape(-1), v.reshape(-1)])
    flat_dst = np.empty_like(flat_src)

    def all_blocks(out: tuple[bytearray, bytearray] | None) -> None:
        for b in range(blocks):
            nk.block_sections(k, v, b, cd, out=out)

    def decode_per_block() -> None:
        for part in q8_blocks:
            nk.q8_decode(part, cd)

    one_block_ref = best_of(
        max(1, args.repeat // 3), lambda: q8_decode(q8_blocks[0], cd.dtype, cd.section_shape)
    )

    cases: list[tuple[str, list[memoryview], Callable[[], object]]] = [
        (
            "np.copyto, contiguous (memcpy floor)",
            engine_bytes,
            lambda: np.copyto(flat_dst, flat_src),
        ),
        ("layer_sections (gather K+V, 1 copy)", engine_bytes, lambda: nk.layer_sections(k, v, cd)),
        (f"block_sections x{blocks}, new buffers", engine_bytes, lambda: all_blocks(None)),
        (
            f"block_sections x{blocks}, out buffers",
            engine_bytes,
            lambda: all_blocks((out_k, out_v)),
        ),
        (
            "as_engine_arrays (1 copy back to HND)",
            section_parts,
            lambda: dest.as_engine_arrays(0, out=(dst_k, dst_v)),
        ),
        (
            "q8 encode layer K+V (1 call each)",
            [sections.k_data, sections.v_data],
            lambda: [
                nk.q8_encode(p, cd, blocks=blocks) for p in (sections.k_data, sections.v_data)
            ],
        ),
        (
            "q8 decode layer -> float32 (1 call each)",
            q8_parts,
            lambda: [nk.q8_decode_blocks(p, cd, blocks) for p in q8_parts],
        ),
        (
            "q8 decode layer -> float16 sections",
            q8_parts,
            lambda: [nk.q8_decode_section(p, cd, blocks=blocks) for p in q8_parts],
        ),
        (f"q8 decode -> float32, {2 * blocks} calls", q8_parts, decode_per_block),
    ]

    print(
        f"layer: kv_heads={args.heads} head_dim={args.dim} tokens={tokens} float16, "
        f"block_tokens={args.block} ({blocks} blocks, section {size} B, q8 Data {q8_block} B); "
        f"numpy {np.__version__}; best of {args.repeat}"
    )
    header = f"{'case':44} {'in MB':>7} {'ms':>9} {'MB/s':>9} {'sha256 ms':>10} {'x sha256':>9}"
    print(header)
    print("-" * len(header))
    for name, parts, fn in cases:
        nbytes = sum(len(p) for p in parts)
        sha = best_of(args.repeat, partial(sha256_all, parts))
        t = best_of(args.repeat, fn)
        print(
            f"{name:44} {nbytes / 1e6:7.2f} {t * 1e3:9.2f} {nbytes / t / 1e6:9.0f} "
            f"{sha * 1e3:10.2f} {sha / t:9.2f}"
        )
    nbytes = sum(len(p) for p in q8_parts)
    sha = best_of(args.repeat, lambda: sha256_all(q8_parts))
    t = one_block_ref * 2 * blocks
    print(
        f"{'pure kvsp.q8_decode (1 block, x' + str(2 * blocks) + ')':44} {nbytes / 1e6:7.2f} "
        f"{t * 1e3:9.2f} {nbytes / t / 1e6:9.0f} {sha * 1e3:10.2f} {sha / t:9.2f}"
    )


if __name__ == "__main__":
    main()
