"""KVCS publisher and consumer data paths versus SHA-256 of the same Data.

Run from the repository root::

    python3 benchmarks/bench_kvcs_paths.py [--layers L] [--tokens N] [--heads H]
                                           [--dim D] [--block B] [--repeat R]

Default: a Llama-like layer set, 8 layers of 8 KV heads x head_dim 128 x 1024
tokens, bfloat16, 16-token blocks: 64 blocks per layer, 32 KiB per K or V
section, 1024 Objects and 32 MiB of Data in all (the "cache size").

Figures (best of R runs, ``time.perf_counter``; MB = 10**6 bytes):

* ``publisher put_layer``: ``KvcsPublisher.put_layer`` for every layer (no
  session attached: the Objects go into the publisher's TrackStores), which
  per Object builds the 68-octet header and the SHA-256 Data Digest, and per
  layer publishes manifest versions with the digests. The publisher is built
  outside the timed region (a fresh one per run).
* ``publisher build_payload_parts``: the per-Object step alone.
* ``consumer verify+copy``: the consumer machine's per-Object steps, measured
  directly because the full machine needs MOQT sessions to be driven (not
  cheap enough to isolate here): ``check_object`` (``verify_object`` with every
  context check the consumer passes: component, codec, Token Count, Token
  Start, the listed digest, plus the codec's Data Length) on a contiguous
  payload, then one copy of the verified Data into the ``KvDestination``
  buffer of its layer and component. Session decoding and the manifest digest
  lookup are not included.
* ``consumer peak memory``: ``tracemalloc`` peak over one consumer run,
  including the ``KvDestination`` allocation (numpy reports its buffers to
  tracemalloc); the received payloads already exist (they are the input).

Each throughput is compared with ``hashlib.sha256`` over the same Data bytes
(one call per Object), timed in the same run right before the case.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from adapters.numpy_kv import KvDestination
from kvcs_core.kvcs._verify import check_object
from kvcs_core.kvcs.names import Component
from kvcs_core.kvcs.payload import VerifiedObject, build_payload_parts
from kvcs_core.kvcs.publisher import KvcsPublisher
from kvcs_core.kvsp import CompatibilityDescriptor

MIB = 1 << 20
CODEC_RAW = 1
"""KVSP codec registry value of ``raw``."""
SCOPE_KEY = bytes(range(32))
PUB_ID = bytes(range(16, 32))


def best_of(
    repeat: int, fn: Callable[[], object], setup: Callable[[], object] | None = None
) -> float:
    best = float("inf")
    for _ in range(repeat):
        arg = setup() if setup is not None else None
        gc.collect()
        t0 = time.perf_counter()
        fn() if setup is None else fn(arg)  # type: ignore[call-arg]
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    compat = {
        "kvsp": 0,
        "model": "bench/llama-like@0",
        "layers": args.layers,
        "kv_heads": args.heads,
        "head_dim": args.dim,
        "dtype": "bfloat16",
        "block_tokens": args.block,
    }
    cd = CompatibilityDescriptor(compat)
    blocks = args.tokens // args.block
    size = cd.section_size
    cache = 2 * args.layers * blocks * size
    rng = np.random.default_rng(1)
    # sections[layer][c][block]: 32 KiB views into one array per layer and component
    raw = rng.integers(0, 256, (args.layers, 2, blocks * size), dtype=np.uint8)
    sections = [
        [[raw[layer, c, b * size : (b + 1) * size].data for b in range(blocks)] for c in range(2)]
        for layer in range(args.layers)
    ]
    all_data = [s for layer in sections for comp in layer for s in comp]
    tokens = list(range(args.tokens))
    print(
        f"{args.layers} layers x {args.heads} heads x {args.dim} dim x {args.tokens} tokens "
        f"bfloat16, {args.block}-token blocks: {len(all_data)} Objects of {size} octets, "
        f"cache {cache / MIB:.1f} MiB; best of {args.repeat}"
    )

    def sha_all() -> None:
        for d in all_data:
            hashlib.sha256(d).digest()

    # --- (a) publisher ---------------------------------------------------------------
    def new_publisher() -> KvcsPublisher:
        return KvcsPublisher(compat, SCOPE_KEY, tokens, PUB_ID)

    def put_all(pub: KvcsPublisher) -> None:
        for layer in range(args.layers):
            pub.put_layer(layer, sections[layer][0], sections[layer][1], now=0.0)

    def parts_all() -> None:
        for layer in range(args.layers):
            for c, comp in ((0, Component.K), (1, Component.V)):
                for b, d in enumerate(sections[layer][c]):
                    build_payload_parts(
                        component=comp,
                        layer=layer,
                        block_index=b,
                        token_start=b * args.block,
                        token_count=args.block,
                        codec=CODEC_RAW,
                        data=d,
                    )

    rows: list[tuple[str, float, float, str, str]] = []

    def throughput(
        name: str, fn: Callable[..., object], setup: Callable[[], object] | None = None
    ) -> None:
        ref = best_of(args.repeat, sha_all)
        got = best_of(args.repeat, fn, setup)
        rows.append((name, cache / got / 1e6, cache / ref / 1e6, "MB/s", ">= 0.8x sha256"))

    throughput("publisher put_layer (all layers)", put_all, new_publisher)
    throughput("publisher build_payload_parts", parts_all)

    # --- (b) consumer ------------------------------------------------------------------
    payloads: list[tuple[int, Component, int, bytes, bytes]] = []
    for layer in range(args.layers):
        for c, comp in ((0, Component.K), (1, Component.V)):
            for b, d in enumerate(sections[layer][c]):
                head, view = build_payload_parts(
                    component=comp,
                    layer=layer,
                    block_index=b,
                    token_start=b * args.block,
                    token_count=args.block,
                    codec=CODEC_RAW,
                    data=d,
                )
                payloads.append((layer, comp, b, head + bytes(view), head[36:68]))

    def receive() -> KvDestination:
        dest = KvDestination(cd, blocks * args.block)
        bufs = {
            (layer, comp): dest.buffer(layer, comp)
            for layer in range(args.layers)
            for comp in (Component.K, Component.V)
        }
        for layer, comp, b, payload, listed in payloads:
            got = check_object(
                memoryview(payload),
                layer=layer,
                object_id=b,
                component=comp,
                codec=CODEC_RAW,
                block_tokens=args.block,
                token_start=b * args.block,
                listed_digest=listed,
                data_length=size,
            )
            assert isinstance(got, VerifiedObject), got
            bufs[(layer, comp)][b * size : (b + 1) * size] = got.data
        return dest

    throughput("consumer verify+copy (per-Object steps)", receive)
    dest = receive()
    for layer in range(args.layers):  # the destination holds exactly the published Data
        assert bytes(dest.buffer(layer, Component.K)) == raw[layer, 0].tobytes()
        assert bytes(dest.buffer(layer, Component.V)) == raw[layer, 1].tobytes()
    del dest

    peaks = []
    for _ in range(args.repeat):
        gc.collect()
        tracemalloc.start()
        d = receive()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        del d
    peak = min(peaks)

    print()
    print(f"{'figure':<42} {'value':>12} {'reference':>16} {'ratio':>7}  {'target':<22} result")
    for name, value, ref, unit, target in rows:
        ratio = value / ref
        met = "met" if ratio >= 0.8 else "MISSED"
        print(
            f"{name:<42} {value:>7.0f} {unit:<4} {ref:>7.0f} {unit} sha {ratio:>6.2f}x"
            f"  {target:<22} {met}"
        )
    limit = cache + 64 * MIB
    print(
        f"{'consumer peak memory (tracemalloc)':<42} {peak / MIB:>7.1f} MiB "
        f"{cache / MIB:>7.1f} MiB cache {peak / cache:>5.2f}x  {'<= cache + 64 MiB':<22} "
        f"{'met' if peak <= limit else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
