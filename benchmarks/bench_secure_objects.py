"""Secure Objects cost: protect/unprotect throughput per suite, and ``--encrypt`` end to end.

Run from the repository root::

    python3 benchmarks/bench_secure_objects.py [--sizes 4096,32768,262144]
        [--total-mib M] [--mib E2E_MIB] [--repeat R] [--e2e-repeat R2] [--no-e2e]

**Per Object** (``kvcs_core.secobj``): for each cipher suite and Object Data
size (default 4 KiB, 32 KiB: one Llama block of 16 tokens x 8 KV heads x 128
x bfloat16, and 256 KiB), ``--total-mib`` of Objects (each its 68-octet KVCS
header and its Data, passed as two chunks as the publisher does) are
protected with one keyring, then unprotected with another (the consumer's).
Each row gives MB/s (MB = 10**6 bytes of Data+header) for protect and
unprotect, best of R, and beside them ``hashlib.sha256`` over the same bytes
timed right before (``x sha256``: how many times faster than the digest the
consumer computes for every Object anyway).

**End to end** (``--encrypt``): a synthetic Llama-shaped cache of ``--mib``
MiB (32 layers, 8 KV heads, head_dim 128, bfloat16; 128 KiB of K+V per token)
through an in-process relay (``serve_relay``) over QUIC on 127.0.0.1, with a
live consumer (``retrieve_cache`` subscribed before the first layer): without
encryption, then with each suite (``require_encryption`` on the consumer).
Goodput is cache bytes per second from the first ``put_layer`` to the
consumer's RetrievalComplete; every run is checked bit-identical. Producer,
relay and consumer share this process and its event loop (one core), so the
figures are lower than with one process per role; the ratio to the
unencrypted run is what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcs.adapters.cachefile import llama_descriptor, same_bits, synthetic
from kvcs.adapters.numpy_kv import KvDestination, layer_sections
from kvcs.transports.quic import asyncio_binding as b
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.secobj import CipherSuite, SecureObjectKeyring, Unprotected
from kvcs_core.secobj.derive import serialize_names

SCOPE = bytes(range(32))
TRACK = serialize_names([b"kvcs-1", b"bench"], b"k.raw.s0")
SUITES = (
    ("aes128gcm", CipherSuite.AES_128_GCM_SHA256_128),
    ("aes256gcm", CipherSuite.AES_256_GCM_SHA512_128),
    ("aes128ctr-hmac", CipherSuite.AES_128_CTR_HMAC_SHA256_80),
)


def best_of(repeat: int, fn: Any) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _time_suite(
    suite: CipherSuite, heads: list[bytes], datas: list[memoryview], repeat: int
) -> tuple[float, float, float, float]:
    """Best-of times: sha256, protect, sha256 again, unprotect (keys derived beforehand)."""

    def sha() -> None:
        for h, d in zip(heads, datas, strict=True):
            m = hashlib.sha256(h)
            m.update(d)
            m.digest()

    def ring() -> SecureObjectKeyring:
        r = SecureObjectKeyring.from_scope_key(SCOPE, suite)
        r.protect(TRACK, 0, 0, 32, 0, (b"warm",))  # derives this track's key now
        return r

    sealed: list[bytes] = []
    protect_rings = [ring() for _ in range(repeat)]
    open_rings = [ring() for _ in range(repeat)]

    def protect() -> None:
        r = protect_rings.pop()
        sealed[:] = [
            r.protect(TRACK, 1, i, 32, 0, (h, d))
            for i, (h, d) in enumerate(zip(heads, datas, strict=True))
        ]

    def unprotect() -> None:
        r = open_rings.pop()
        for i, s in enumerate(sealed):
            out = r.unprotect(TRACK, 1, i, 32, 0, s)
            assert isinstance(out, Unprotected)

    return (
        best_of(repeat, sha),
        best_of(repeat, protect),
        best_of(repeat, sha),
        best_of(repeat, unprotect),
    )


def per_object(sizes: list[int], total: int, repeat: int) -> None:
    print("per Object: protect / unprotect, beside hashlib.sha256 over the same bytes")
    print(
        f"{'suite':<16}{'Data':>9}{'objects':>9}{'sha256 MB/s':>13}{'protect MB/s':>14}"
        f"{'x sha256':>10}{'unprotect MB/s':>16}{'x sha256':>10}"
    )
    for size in sizes:
        n = max(1, total // size)
        heads = [bytes([i % 251]) * 68 for i in range(n)]
        datas = [memoryview(bytes([(i * 7) % 256]) * size) for i in range(n)]
        mb = n * (68 + size) / 1e6
        for name, suite in SUITES:
            t_sha, t_p, t_sha2, t_u = _time_suite(suite, heads, datas, repeat)
            print(
                f"{name:<16}{size:>9}{n:>9}{mb / t_sha:>13.0f}{mb / t_p:>14.0f}"
                f"{t_sha / t_p:>10.2f}{mb / t_u:>16.0f}{t_sha2 / t_u:>10.2f}"
            )


async def one_transfer(tmp: Path, mib: int, suite: CipherSuite | None) -> tuple[float, bool]:
    cd_json = llama_descriptor(layers=32, kv_heads=8, head_dim=128)
    tokens = mib * 1024 * 1024 // (128 * 1024)
    source = synthetic(cd_json, tokens, 3)
    cd = source.cd
    tls = self_signed(tmp / "tls")
    trust = TlsConfig(cafile=tls.cafile)
    encrypt = suite is not None
    cs = suite or CipherSuite.AES_128_GCM_SHA256_128
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as relay,
        b.connect(relay.url, tls=trust, timeout=30) as producer,
        b.connect(relay.url, tls=trust, timeout=30) as consumer,
    ):
        pub = await producer.publish_cache(
            source.descriptor, SCOPE, source.tokens, encrypt=encrypt, cipher_suite=cs
        )
        dest = KvDestination(cd, tokens)
        retrieval = consumer.retrieve_cache(
            source.descriptor,
            SCOPE,
            source.tokens,
            destinations=dest.buffer,
            require_authenticity=False,
            require_encryption=encrypt,
            cipher_suite=cs,
        )
        deadline = time.monotonic() + 30
        while len(relay.relay._cache) < 3:  # the live consumer's tracks are subscribed
            if time.monotonic() > deadline:
                raise TimeoutError("the consumer did not subscribe")
            await asyncio.sleep(0.01)
        sections = [layer_sections(source.k[i], source.v[i], cd) for i in range(cd.layers)]
        t0 = time.perf_counter()
        for layer, s in enumerate(sections):
            await pub.put_layer(layer, s.k, s.v, timeout=60)
        await pub.finish()
        done = await retrieval.result(timeout=120)
        elapsed = time.perf_counter() - t0
    return elapsed, bool(done.complete and same_bits(source, dest, tokens))


def end_to_end(mib: int, repeat: int) -> None:
    nbytes = mib * 1024 * 1024
    print(f"\nend to end: {mib} MiB cache, producer -> relay -> live consumer, QUIC 127.0.0.1,")
    print("one process (best of runs by goodput)")
    print(f"{'publication':<24}{'seconds':>9}{'goodput MB/s':>14}{'vs clear':>10}{'checked':>9}")
    base = None
    for label, suite in (("clear", None), *((f"--encrypt {n}", s) for n, s in SUITES)):
        best = float("inf")
        ok = True
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as tmp:
                t, same = asyncio.run(one_transfer(Path(tmp), mib, suite))
            ok = ok and same
            best = min(best, t)
        if base is None:
            base = best
        rate = nbytes / best / 1e6
        print(f"{label:<24}{best:>9.3f}{rate:>14.1f}{base / best:>10.2f}{'yes' if ok else 'NO':>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,32768,262144")
    parser.add_argument("--total-mib", type=int, default=16)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--e2e-repeat", type=int, default=3)
    parser.add_argument("--no-e2e", action="store_true")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    per_object(sizes, args.total_mib * 1024 * 1024, args.repeat)
    if not args.no_e2e:
        end_to_end(args.mib, args.e2e_repeat)


if __name__ == "__main__":
    main()
