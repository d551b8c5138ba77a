"""Cost of the KVSP index over MOQT (binding 9, issue #15), over real QUIC on 127.0.0.1.

Run from the repository root::

    python3 benchmarks/bench_index.py [--blocks 256] [--lookups 20] [--stack qh3]

What is measured, each beside a reference taken in the same run:

* **announcement time**: from ``publish_cache`` until the relay has accepted every
  PUBLISH_NAMESPACE of the publication (its namespace and, with the index, one per
  indexed block: 256 for a 256-block publication), for ``index_stride`` 1 and 0 (the
  reference: no index);
* **relay memory**: the resident set size (``VmRSS``) of a ``kvcs relay`` child
  process before and after the index is announced, and after one lookup of every
  block (the records then sit in the relay's cache), beside the same for a
  publication without index; RSS counts pages, so small differences are coarse;
* **lookup latency** through one relay and through a two-relay tree (consumer ->
  leaf -> root <- publisher): one index lookup as the consumer makes it
  (SUBSCRIBE_NAMESPACE on ``("kvcs-idx-1", Scope ID, Compatibility ID, K_(j-1))``
  until the NAMESPACE, then SUBSCRIBE ``replica.cose`` until the record arrives),
  beside the reference: one SUBSCRIBE_NAMESPACE round trip of direct discovery
  (the publication's ``("kvcs-1", Scope ID, Compatibility ID, Anchor Key)`` prefix
  until its NAMESPACE) on the same relay. Each lookup uses another block (the first
  time the relay sees that prefix), median and 90th percentile of ``--lookups``.

Every relay runs as its own process (``kvcs relay``), stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from kvcs.adapters.cachefile import llama_descriptor, synthetic  # noqa: E402
from kvcs.adapters.numpy_kv import layer_sections  # noqa: E402
from kvcs.transports.quic import asyncio_binding as b  # noqa: E402
from kvcs.transports.quic.api import MoqtClient  # noqa: E402
from kvcs.transports.quic.tls import TlsConfig, self_signed  # noqa: E402
from kvcs_core.kvcs.index import IndexNamespace, index_prefix  # noqa: E402
from kvcs_core.kvcs.publisher import ManifestSigner  # noqa: E402
from kvcs_core.moqt import events as ev  # noqa: E402
from kvcs_core.wire import params as p  # noqa: E402
from kvcs_core.wire.names import TrackNamespace  # noqa: E402

SCOPE_KEY = bytes(range(32))
KID = b"producer"
WAIT = 60.0


@contextmanager
def relay_process(certs: Path, upstream: str | None = None) -> Iterator[tuple[str, int]]:
    """A ``kvcs relay`` child process: (URL, PID); stopped by its PID at the end."""
    cmd = [sys.executable, "-m", "kvcs", "relay", "--listen", "127.0.0.1:0", "--json",
           "--stack", os.environ.get("BENCH_RELAY_STACK", "qh3"),
           "--cert", str(certs / "cert.pem"), "--key", str(certs / "key.pem")]  # fmt: skip
    if upstream is not None:
        cmd += ["--upstream", upstream, "--upstream-ca", str(certs / "ca.pem")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the relay exited")
            obj = json.loads(line)
            url = obj.get("url")
        if url is None:
            raise RuntimeError("the relay did not start")
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def publish(client: MoqtClient, src: Any, pub_id: bytes, stride: int) -> tuple[Any, float]:
    """Publish (1 layer) and wait until every PUBLISH_NAMESPACE is accepted; the time."""
    t0 = time.perf_counter()
    pub = await client.publish_cache(
        src.descriptor, SCOPE_KEY, src.tokens, publication_id=pub_id, index_stride=stride,
        signer=ManifestSigner(Ed25519PrivateKey.generate(), KID),
    )  # fmt: skip
    publisher = pub.publisher
    want = 0 if publisher.index is None else len(publisher.index.namespaces)
    session = client.session

    def accepted() -> bool:
        index_ok = publisher.index is None or publisher.index.accepted(session) >= want
        return index_ok and publisher.attach_state(session) is not None and (
            publisher.attach_state(session).name == "ACCEPTED"  # type: ignore[union-attr]
        )

    try:
        await client.driver.wait_for(accepted, WAIT)
    except TimeoutError:
        got = 0 if publisher.index is None else publisher.index.accepted(session)
        held = session.held_requests
        raise RuntimeError(f"{got} of {want} index namespaces accepted; {held} held") from None
    took = time.perf_counter() - t0
    for layer in range(src.cd.layers):
        s = layer_sections(src.k[layer], src.v[layer], src.cd)
        await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
    await pub.finish()
    return pub, took


async def namespace_rtt(client: MoqtClient, prefix: TrackNamespace) -> tuple[float, Any]:
    """SUBSCRIBE_NAMESPACE ``prefix`` until its first NAMESPACE: (seconds, namespace)."""
    got: list[Any] = []
    rid: list[int] = []

    def watch(pump: Any, e: ev.SessionEvent, now: float) -> None:
        if isinstance(e, ev.NamespaceAnnounced) and rid and e.request_id == rid[0] and not got:
            got.append(e.namespace)

    client.app.watchers.append(watch)
    t0 = time.perf_counter()
    try:
        rid.append(client.session.subscribe_namespace(prefix, now=client.driver.now()))
        client.driver.wake()
        await client.driver.wait_for(lambda: bool(got), WAIT)
        return time.perf_counter() - t0, got[0]
    finally:
        client.app.watchers.remove(watch)
        client.session.cancel(rid[0], now=client.driver.now())
        client.driver.wake()


async def record_rtt(client: MoqtClient, namespace: TrackNamespace) -> float:
    """SUBSCRIBE ``replica.cose`` (Next Object + fill Relative Start 1) until Object 0."""
    ins = IndexNamespace.try_parse(namespace)
    assert ins is not None
    got: list[bool] = []
    rid: list[int] = []

    def watch(pump: Any, e: ev.SessionEvent, now: float) -> None:
        if isinstance(e, ev.ObjectReceived) and rid and e.request_id == rid[0]:
            got.append(True)

    client.app.watchers.append(watch)
    t0 = time.perf_counter()
    try:
        rid.append(
            client.session.subscribe(
                ins.track(True),
                now=client.driver.now(),
                location_filter=p.LocationFilter.next_object(),
                fill=p.Parameters.of(p.LocationFilter.relative_start(1)),
            )
        )
        client.driver.wake()
        await client.driver.wait_for(lambda: bool(got), WAIT)
        return time.perf_counter() - t0
    finally:
        client.app.watchers.remove(watch)
        client.session.cancel(rid[0], now=client.driver.now())
        client.driver.wake()


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]
    return f"median {statistics.median(xs) * 1e3:7.2f} ms  p90 {p90 * 1e3:7.2f} ms"


async def lookups(url: str, trust: TlsConfig, pubs: dict[str, Any], n: int, stack: str) -> None:
    pub = pubs["index"].publisher
    kns = pub.kvcs_namespace
    async with b.connect(url, tls=trust, stack=stack) as client:
        direct = []
        for _ in range(n):
            t, _ns = await namespace_rtt(client, kns.content_prefix())
            direct.append(t)
        ns_times, rec_times, total = [], [], []
        keys = pub.block_keys
        for j in range(n):
            key = keys[(j * 7) % len(keys)]
            t_ns, found = await namespace_rtt(
                client, index_prefix(kns.scope_id, kns.compat_id, key)
            )
            t_rec = await record_rtt(client, found)
            ns_times.append(t_ns)
            rec_times.append(t_rec)
            total.append(t_ns + t_rec)
    print(f"    reference: direct SUBSCRIBE_NAMESPACE round trip   {stats(direct)}  (same prefix)")
    print(f"    index lookup: SUBSCRIBE_NAMESPACE -> NAMESPACE      {stats(ns_times)}")
    print(f"    index lookup: SUBSCRIBE replica.cose -> record     {stats(rec_times)}")
    print(f"    index lookup, whole (namespace + record)           {stats(total)}")


async def main_async(args: argparse.Namespace) -> None:
    desc = llama_descriptor(layers=1, kv_heads=1, head_dim=8, block_tokens=16)
    src = synthetic(desc, args.blocks * 16, 3)
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp, ExitStack() as stack:
        tls = self_signed(Path(tmp))
        certs = Path(tmp)
        trust = TlsConfig(cafile=tls.cafile)
        root, root_pid = stack.enter_context(relay_process(certs))
        leaf, _leaf_pid = stack.enter_context(relay_process(certs, upstream=root))
        print(f"bench_index: {args.blocks}-block publication (16-token blocks), "
              f"{args.stack}, relays as processes")  # fmt: skip
        async with b.connect(root, tls=trust, stack=args.stack) as producer:
            await asyncio.sleep(0.5)
            rss0 = rss_kib(root_pid)
            pubs: dict[str, Any] = {}
            _ref, t_ref = await publish(producer, src, bytes([1]) * 16, 0)
            await asyncio.sleep(0.5)
            rss1 = rss_kib(root_pid)
            pubs["index"], t_idx = await publish(producer, src, bytes([2]) * 16, 1)
            await asyncio.sleep(0.5)
            rss2 = rss_kib(root_pid)
            ann = pubs["index"].publisher.index
            print("announcement (publish_cache -> every PUBLISH_NAMESPACE accepted):")
            print(f"    reference, no index (1 namespace):        {t_ref * 1e3:8.1f} ms")
            print(f"    index stride 1 ({len(ann.namespaces) + 1} namespaces):         "
                  f"{t_idx * 1e3:8.1f} ms")  # fmt: skip
            print(f"    records held by the publisher: {ann.record_bytes} bytes")
            print("relay memory (VmRSS of the root relay process):")
            print(f"    a publication without index:    +{rss1 - rss0:6d} KiB")
            print(f"    its {len(ann.namespaces)}-entry index:           +{rss2 - rss1:6d} KiB")
            async with b.connect(root, tls=trust, stack=args.stack) as client:
                kns = pubs["index"].publisher.kvcs_namespace
                for key in pubs["index"].publisher.block_keys:
                    _t, found = await namespace_rtt(
                        client, index_prefix(kns.scope_id, kns.compat_id, key)
                    )
                    await record_rtt(client, found)
            await asyncio.sleep(0.5)
            rss3 = rss_kib(root_pid)
            print(f"    after a lookup of every block:  +{rss3 - rss2:6d} KiB "
                  "(records cached, upstream subscriptions)")  # fmt: skip
            print(f"lookup latency through one relay ({args.lookups} lookups):")
            await lookups(root, trust, pubs, args.lookups, args.stack)
            print(f"lookup latency through two relays (leaf -> root, {args.lookups} lookups):")
            await lookups(leaf, trust, pubs, args.lookups, args.stack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--lookups", type=int, default=20)
    ap.add_argument("--stack", default="qh3", choices=("qh3", "aioquic"))
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(asyncio.wait_for(main_async(args), 300))


if __name__ == "__main__":
    main()
