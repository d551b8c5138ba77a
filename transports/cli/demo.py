"""``kvcs demo``: the main job, end to end over real QUIC on 127.0.0.1.

What runs:

1. a relay: ``kvcs relay --listen 127.0.0.1:0 --self-signed`` in a child process
   (``--in-process`` keeps it in this process instead);
2. a producer that publishes a synthetic Llama-shaped cache (32 layers, 8 KV
   heads, head_dim 128, bfloat16, 16-token blocks; ``--tokens`` long) layer by
   layer through the relay, one layer every ``--layer-interval`` seconds, as a
   prefill would;
3. consumers, each on its own QUIC connection: *live* (subscribed before the
   first layer), *mid* (joins halfway through production), *late* (after the
   cache is complete: FETCH from the relay's cache) and *partial* (its prompt
   extends the producer's by a few blocks: it finds the shorter publication by
   discovery and receives exactly the shared blocks) and *half* (its prompt shares
   only the first half of the producer's blocks, then differs: the publication's
   Anchor Key is not one it can compute, so it finds it through the KVSP index,
   binding 9, and receives exactly the shared half, rounded down to a multiple of
   the index's stride past 512 blocks; the table says in how many index lookups).

Every consumer's result is compared bit for bit with the source cache. The
table reports, per consumer, the time to its first usable layer and to the
end, the bytes and the rate, and whether the bits match; below it, the bytes
the producer sent against the bytes the relay delivered. The exit status is 0
only if every consumer verified its cache bit for bit.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs

from kvcs.transports.quic.api import CacheRetrieval, MoqtClient
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.kvcs.consumer import ManifestAccepted, ObjectDiscarded, PublicationSelected
from kvcs_core.kvcs.index import DEFAULT_MAX_INDEX_RECORDS, effective_index_stride

from .common import CliError, Exit, Progress
from .config import child_environment

if TYPE_CHECKING:
    from kvcs.adapters.cachefile import CacheFile
    from kvcs.adapters.numpy_kv import KvDestination

SCOPE_KEY = bytes(range(32))
RELAY_START_TIMEOUT = 30.0


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokens",
        type=int,
        default=256,
        help="prompt length of the synthetic cache (default 256: 32 MiB of K+V)",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--layer-interval",
        type=float,
        default=0.02,
        metavar="S",
        help="time to 'compute' each layer (default 0.02 s)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the relay in this process instead of a child process",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="give up after S seconds (default 120)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON lines")


@attrs.define
class Consumer:
    name: str
    how: str
    tokens: tuple[int, ...]
    expect_blocks: int
    dest: KvDestination
    started: float = 0.0
    first: float | None = None
    ended: float | None = None
    retrieval: CacheRetrieval | None = None
    complete: bool = False
    blocks: int = 0
    identical: bool = False
    same: bool = False
    """The data it holds equals the source's (whether or not it is complete)."""
    discarded: int = 0
    missing: int = 0
    recompute: list[str] = attrs.field(factory=list)
    """RecomputeNeeded events (layers and blocks the consumer gave up on)."""
    lookups: int = 0
    """KVSP index lookups it made (0: found directly)."""


async def demo(b: ModuleType, args: argparse.Namespace) -> int:
    from kvcs.adapters.cachefile import llama_descriptor, synthetic

    desc = llama_descriptor(layers=args.layers)
    if args.tokens < 2 * desc["block_tokens"]:
        raise CliError("--tokens must cover at least two blocks", Exit.USAGE)
    source = synthetic(desc, args.tokens, args.seed)
    cd = source.cd
    blocks = args.tokens // cd.block_tokens
    mib = 2 * cd.layers * blocks * cd.section_size / 2**20
    text = sys.stderr if args.json else sys.stdout  # with --json, stdout is JSON lines only
    print(
        f"kvcs demo: a synthetic Llama-shaped cache: {cd.layers} layers x {cd.kv_heads} KV "
        f"heads x {cd.head_dim}, {cd.dtype}, {args.tokens} tokens = {blocks} blocks, "
        f"{mib:.1f} MiB of K+V; {args.stack} on {args.loop}",
        file=text,
        flush=True,
    )
    async with relay_url(b, args) as url:
        print(f"kvcs demo: relay at {url}", file=text, flush=True)
        return await run_demo(b, args, url, source)


@contextlib.asynccontextmanager
async def relay_url(b: ModuleType, args: argparse.Namespace) -> AsyncIterator[str]:
    if args.in_process:
        certs = tempfile.mkdtemp(prefix="kvcs-demo-")
        atexit.register(shutil.rmtree, certs, True)  # the private key goes with the run
        tls = self_signed(certs)
        async with b.serve_relay(
            "127.0.0.1:0",
            tls=tls,
            stack=args.stack,
            max_datagram_size=args.datagram_size,
            idle_timeout=args.idle_timeout,
        ) as server:
            yield server.url
        return
    cmd = [
        sys.executable,
        "-m",
        "kvcs",
        "relay",
        "--listen",
        "127.0.0.1:0",
        "--self-signed",
        "--json",
        "--stack",
        args.stack,
        "--loop",
        args.loop,
    ]
    if args.datagram_size:
        cmd += ["--datagram-size", str(args.datagram_size)]
    cmd += ["--idle-timeout", str(args.idle_timeout)]
    env = child_environment(os.environ)  # its options are all on its command line
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
    try:
        line = await wait_line(b, proc)
        # the relay goes on writing JSON lines (stats, connection_ended): read and drop
        # them, so that a long demo never fills the pipe and stalls the relay
        assert proc.stdout is not None
        threading.Thread(target=_discard, args=(proc.stdout.fileno(),), daemon=True).start()
        yield json.loads(line)["url"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _discard(fd: int) -> None:
    """Read ``fd`` to its end, dropping what comes (a thread: the reads block)."""
    with contextlib.suppress(OSError):
        os.set_blocking(fd, True)  # wait_line made it non-blocking
        while os.read(fd, 65536):
            pass


async def wait_line(b: ModuleType, proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    deadline = time.monotonic() + RELAY_START_TIMEOUT
    buf = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CliError(f"the relay process exited with status {proc.returncode}", Exit.NETWORK)
        ready, _, _ = select.select([fd], [], [], 0)
        if ready:
            chunk = os.read(fd, 4096).decode()
            buf += chunk
            if "\n" in buf:
                return buf.split("\n", 1)[0]
        await b.sleep(0.05)
    raise CliError("the relay process did not start listening in time", Exit.NETWORK)


async def run_demo(b: ModuleType, args: argparse.Namespace, url: str, source: CacheFile) -> int:
    from kvcs.adapters.numpy_kv import KvDestination, layer_sections

    cd = source.cd
    tls = TlsConfig(verify=False)  # the relay's certificate is self-signed for this run
    blocks = len(source.tokens) // cd.block_tokens
    extra = tuple(range(900_000, 900_000 + 4 * cd.block_tokens + 5))
    # a multiple of the stride the publication's index uses (1 up to 512 blocks, then
    # doubled: kvcs_core.kvcs.index, "How many records"), so that the index can find
    # all of the shared part
    stride = effective_index_stride(blocks, 1, DEFAULT_MAX_INDEX_RECORDS)
    half = blocks // 2 // stride * stride
    other = tuple(range(800_000, 800_000 + 3 * cd.block_tokens))  # differs from block `half`
    consumers = [
        Consumer(
            "live",
            "SUBSCRIBE before layer 0",
            source.tokens,
            blocks,
            KvDestination(cd, blocks * cd.block_tokens),
        ),
        Consumer(
            "mid",
            "SUBSCRIBE halfway (fill + live)",
            source.tokens,
            blocks,
            KvDestination(cd, blocks * cd.block_tokens),
        ),
        Consumer(
            "late",
            "FETCH after completion",
            source.tokens,
            blocks,
            KvDestination(cd, blocks * cd.block_tokens),
        ),
        Consumer(
            "partial",
            "longer prompt: shared prefix",
            source.tokens + extra,
            blocks,
            KvDestination(cd, (blocks + 4) * cd.block_tokens),
        ),
        Consumer(
            "half",
            "shares half, then differs: index",
            source.tokens[: half * cd.block_tokens] + other,
            half,
            KvDestination(cd, (half + 3) * cd.block_tokens),
        ),
    ]
    live, mid, late, partial, half_c = consumers
    t0 = time.monotonic()
    async with b.connect(
        url,
        tls=tls,
        stack=args.stack,
        max_datagram_size=args.datagram_size,
        idle_timeout=args.idle_timeout,
    ) as producer:
        pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)

        async def consume(c: Consumer, ready: list[bool]) -> None:
            async with b.connect(
                url,
                tls=tls,
                stack=args.stack,
                max_datagram_size=args.datagram_size,
                idle_timeout=args.idle_timeout,
            ) as client:
                await retrieve(b, client, c, source, ready, args.timeout)

        async def produce(ready: list[bool]) -> None:
            await b.sleep(0)
            while not ready[0]:  # the live consumer has the manifest: start "prefill"
                await b.sleep(0.01)
            bar = Progress("producing", cd.layers)
            for layer in range(cd.layers):
                s = layer_sections(source.k[layer], source.v[layer], cd)
                await pub.put_layer(layer, s.k, s.v, timeout=args.timeout)
                bar.update(layer + 1)
                if layer == cd.layers // 2:
                    mid_go[0] = True
                await b.sleep(args.layer_interval)
            await pub.finish()
            await pub.drained(timeout=args.timeout)

        live_ready: list[bool] = [False]
        mid_go: list[bool] = [False]

        async def mid_job() -> None:
            while not mid_go[0]:
                await b.sleep(0.01)
            await consume(mid, [False])

        async def after_job() -> None:
            while not (pub.publisher.complete and live.ended is not None):
                await b.sleep(0.02)
            await b.gather(
                lambda: consume(late, [False]),
                lambda: consume(partial, [False]),
                lambda: consume(half_c, [False]),
            )

        await b.gather(
            lambda: produce(live_ready), lambda: consume(live, live_ready), mid_job, after_job
        )
        sent = producer.pump.bytes_pulled
    total = time.monotonic() - t0
    return report(args, consumers, source, sent, total)


async def retrieve(
    b: ModuleType,
    client: MoqtClient,
    c: Consumer,
    source: CacheFile,
    ready: list[bool],
    timeout: float,
) -> None:
    from kvcs.adapters.cachefile import same_bits

    c.started = time.monotonic()
    r = client.retrieve_cache(
        source.descriptor,
        SCOPE_KEY,
        c.tokens,
        destinations=c.dest.buffer,
        require_authenticity=False,
    )
    c.retrieval = r
    bar = Progress(c.name, source.cd.layers)

    async def watch_manifest() -> None:
        while not ready[0]:
            if any(isinstance(e, ManifestAccepted | PublicationSelected) for e in r.events):
                ready[0] = True
            await b.sleep(0.005)
            if r.complete is not None:
                ready[0] = True

    async def layers() -> None:
        async for _layer in r:
            if c.first is None:
                c.first = time.monotonic() - c.started
            bar.update(len(r.ready))

    await b.gather(watch_manifest, layers)
    result = await r.result(timeout=timeout, strict=False)
    c.ended = time.monotonic()
    c.complete = result.complete
    c.blocks = result.blocks
    c.same = same_bits(source, c.dest, c.blocks * source.cd.block_tokens)
    c.identical = c.complete and c.blocks == c.expect_blocks and c.same
    c.discarded = sum(1 for e in r.events if isinstance(e, ObjectDiscarded))
    c.missing = r.consumer.missing_objects
    c.recompute = [str(e) for e in r.recompute][:4]
    c.lookups = r.consumer.index_lookups


def report(
    args: argparse.Namespace, consumers: list[Consumer], source: CacheFile, sent: int, total: float
) -> int:
    cd = source.cd
    rows: list[dict[str, Any]] = []
    delivered = 0
    for c in consumers:
        nbytes = 2 * cd.layers * c.blocks * cd.section_size
        delivered += nbytes
        secs = (c.ended or time.monotonic()) - c.started
        rows.append(
            {
                "consumer": c.name,
                "how": c.how,
                "blocks": f"{c.blocks}/{len(c.tokens) // cd.block_tokens}",
                "first_layer_ms": None if c.first is None else round(c.first * 1e3, 1),
                "seconds": round(secs, 2),
                "mb": round(nbytes / 1e6, 1),
                "mb_per_s": round(nbytes / secs / 1e6, 1) if secs > 0 else None,
                "bit_identical": c.identical,
                # why not, when it is not: retrieval incomplete, or bits that differ
                "complete": c.complete,
                "same_bits": c.same,
                "discarded": c.discarded,
                "missing": c.missing,
                "recompute": c.recompute,
                "index_lookups": c.lookups,
            }
        )
    if args.json:
        for row in rows:
            print(json.dumps({"event": "consumer", **row}), flush=True)
        print(
            json.dumps(
                {
                    "event": "summary",
                    "producer_sent": sent,
                    "delivered": delivered,
                    "seconds": round(total, 2),
                }
            ),
            flush=True,
        )
    else:
        head = (
            f"{'consumer':<9}{'how':<34}{'blocks':>8}{'1st layer':>11}{'total':>8}"
            f"{'MB':>7}{'MB/s':>7}  verified"
        )
        print()
        print(head)
        print("-" * len(head))
        for row in rows:
            first = "-" if row["first_layer_ms"] is None else f"{row['first_layer_ms']:.0f} ms"
            rate = "-" if row["mb_per_s"] is None else f"{row['mb_per_s']:.1f}"
            ok = "bit for bit" if row["bit_identical"] else "FAILED"
            print(
                f"{row['consumer']:<9}{row['how']:<34}{row['blocks']:>8}{first:>11}"
                f"{row['seconds']:>7.2f}s{row['mb']:>7.1f}{rate:>7}  {ok}"
            )
        for c in consumers:
            if c.lookups:
                print(f"{c.name}: found through the KVSP index in {c.lookups} lookups")
        print()
        print(
            f"producer sent {sent:,} bytes once; the relay delivered {delivered:,} bytes of "
            f"K/V data to {len(consumers)} consumers ({delivered / max(sent, 1):.1f}x); "
            f"{total:.1f} s in all"
        )
    if not all(c.identical for c in consumers):
        print("kvcs: error: a consumer did not receive its cache bit for bit", file=sys.stderr)
        return Exit.FAILED
    return Exit.OK
