"""Data-plane codec throughput: object framing decode versus SHA-256 of the same bytes.

Run from the repository root::

    python3 benchmarks/bench_wire_decode.py [--objects N] [--size BYTES] [--repeat R]

It builds a subgroup stream and a fetch stream of N objects (default 512 of
32 KiB = 16 MiB each), then, in the same run, measures:

* decode throughput with the whole stream fed as one buffer, in 64 KiB chunks
  and in 1200-byte chunks (QUIC-packet-like), payloads returned as views (one
  chunk) or assembled once (spanning chunks);
* ``hashlib.sha256`` over the same bytes, and the ratio decode / SHA-256
  (target: >= 5x, reported per case);
* encode throughput of the SubgroupStreamWriter / FetchStreamWriter prefixes
  (payloads are never concatenated, so only the prefixes cost anything).

Timings are the best of R repeats of ``time.perf_counter``. MB = 10**6 bytes.
SHA-256 is timed right before each case so that machine load hits both sides.

The consumer here drops each item once ``feed`` returns it, as a receiver that
copies payloads onward does. A consumer that keeps every assembled payload
alive makes each one land in memory the kernel must first fault in (measured
here at roughly 5 ms per 8 MiB on a fresh heap, depending on the allocator's
state); that cost belongs to the allocation, which any copying design pays, not
to the framing.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcs_core.wire.codes import GroupOrder
from kvcs_core.wire.objects import (
    FetchStreamDecoder,
    FetchStreamWriter,
    SubgroupHeader,
    SubgroupStreamDecoder,
    SubgroupStreamWriter,
)

TARGET = 5.0


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def payload_of(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(size % 256)


def check(
    make: Callable[[], SubgroupStreamDecoder | FetchStreamDecoder],
    chunks: list[bytes],
    payload: bytes,
) -> None:
    """Once, untimed: every decoded payload is the one that was encoded."""
    dec = make()
    items = [it for c in chunks for it in dec.feed(c)]
    dec.close()
    for it in items[1:]:
        if getattr(it, "payload", None) != payload:
            raise SystemExit(f"wrong payload in {it!r}")


def build_subgroup(n: int, size: int) -> tuple[bytes, list[bytes]]:
    payload = payload_of(size)
    w = SubgroupStreamWriter(
        SubgroupHeader(track_alias=1, group_id=7, publisher_priority=64, end_of_group=True)
    )
    parts = [w.header_bytes()]
    for oid in range(n):
        parts.append(w.object_prefix(oid, payload_length=size))
        parts.append(payload)
    return b"".join(parts), parts


def build_fetch(n: int, size: int) -> bytes:
    payload = payload_of(size)
    w = FetchStreamWriter(9, GroupOrder.ASCENDING)
    parts = [w.header_bytes()]
    per_group = 64
    for i in range(n):
        parts.append(
            w.object_prefix(
                i // per_group,
                i % per_group,
                subgroup_id=0,
                publisher_priority=64,
                payload_length=size,
            )
        )
        parts.append(payload)
    return b"".join(parts)


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def decode_all(
    make: Callable[[], SubgroupStreamDecoder | FetchStreamDecoder],
    chunks: list[bytes],
    expect: int,
    *,
    retain: bool = False,
) -> Callable[[], None]:
    def run() -> None:
        dec = make()
        feed = dec.feed
        count = 0
        if retain:
            kept: list[object] = []
            for c in chunks:
                kept += feed(c)
            count = len(kept)
        else:
            for c in chunks:
                count += len(feed(c))  # the consumer drops each item after using it
        dec.close()
        if count != expect:
            raise SystemExit(f"decoded {count} items, expected {expect}")

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=512)
    ap.add_argument("--size", type=int, default=32 * 1024)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n, size, rep = args.objects, args.size, args.repeat

    sub, _ = build_subgroup(n, size)
    fet = build_fetch(n, size)
    print(
        f"streams: {n} objects x {size} B; subgroup {len(sub)} B, fetch {len(fet)} B; best of {rep}"
    )

    def sha(data: bytes) -> Callable[[], None]:
        return lambda: hashlib.sha256(data).digest()

    # SHA-256 is measured right before each case (same bytes, best of R), so
    # that load from other processes hits both sides of each ratio alike.
    header = f"{'case':<34}{'MB/s':>10}{'sha MB/s':>10}{'x sha256':>10}  target >= {TARGET:g}x"
    print(header)
    print("-" * len(header))
    rows: list[tuple[str, float, float, float]] = []
    for label, data, make in (
        ("subgroup", sub, SubgroupStreamDecoder),
        ("fetch", fet, lambda: FetchStreamDecoder(GroupOrder.ASCENDING)),
    ):
        for cname, csize in (
            ("one buffer", 0),
            ("64 KiB chunks", 64 * 1024),
            ("1200 B chunks", 1200),
        ):
            chunks = [data] if csize == 0 else chunked(data, csize)
            check(make, chunks, payload_of(size))
            t_sha = best_of(rep, sha(data))
            t = best_of(rep, decode_all(make, chunks, n + 1))
            mbs = len(data) / 1e6
            rows.append((f"decode {label}, {cname}", mbs / t, mbs / t_sha, t_sha / t))
    for name, mbs, sha_mbs, ratio in rows:
        verdict = "met" if ratio >= TARGET else "NOT met"
        print(f"{name:<34}{mbs:>10.0f}{sha_mbs:>10.0f}{ratio:>10.2f}  {verdict}")
    print(
        "(the consumer drops each item after feed returns it; payloads that span chunks"
        " are copied once)"
    )

    # Encode: prefixes only (the payload buffers are sent as they are).
    def enc_sub() -> None:
        w = SubgroupStreamWriter(SubgroupHeader(track_alias=1, group_id=7, publisher_priority=64))
        w.header_bytes()
        op = w.object_prefix
        for oid in range(n):
            op(oid, payload_length=size)

    def enc_fet() -> None:
        w = FetchStreamWriter(9, GroupOrder.ASCENDING)
        w.header_bytes()
        op = w.object_prefix
        for i in range(n):
            op(i // 64, i % 64, subgroup_id=0, publisher_priority=64, payload_length=size)

    print()
    for name, fn, total in (
        ("encode subgroup prefixes", enc_sub, len(sub)),
        ("encode fetch prefixes", enc_fet, len(fet)),
    ):
        t = best_of(rep, fn)
        print(
            f"{name:<34}{total / 1e6 / t:>10.0f}  ({t / n * 1e6:.2f} us/object,"
            f" {n / t / 1e3:.0f} k objects/s; stream MB/s, payloads not copied)"
        )


if __name__ == "__main__":
    main()
