"""A KV cache over real QUIC on 127.0.0.1: producer -> relay -> consumer versus raw QUIC.

Run from the repository root::

    python3 benchmarks/bench_quic_transfer.py [--mib M] [--stacks aioquic,qh3]
        [--datagram-sizes default,16000] [--repeat R] [--start subscribed|together]
        [--timeout S] [--profile ROLE ...] [--top K]

The cache is a synthetic Llama-shaped one (``kvcs.adapters.cachefile.synthetic``: 32
layers, 8 KV heads, head_dim 128, bfloat16, 16-token blocks: 32 KiB per
Object, 128 KiB of K+V per token): ``--mib 256`` (the default) is 2048 tokens,
8192 Objects. ``--mib`` scales the token count (2 MiB steps) for quicker runs.

Per QUIC stack (``--stacks``) and datagram size (``--datagram-sizes``: the
stack's default, 1200 for aioquic and 1280 for qh3, and 16000, a loopback-sized
one) two transfers run, in this order, R times:

* **kvcs**, three processes: a relay (``kvcs relay --listen 127.0.0.1:0
  --self-signed``, the CLI), a producer and a consumer (worker modes of this
  file, written against :mod:`kvcs.transports.quic.asyncio_binding` as ``kvcs
  publish`` and ``kvcs fetch`` are). The producer connects and announces its
  publication (PUBLISH_NAMESPACE accepted), the consumer connects; then both
  get "go", the consumer first. The consumer starts its retrieval (discovery,
  manifest, data SUBSCRIBEs: profile 5.1 to 5.3). With ``--start subscribed``
  (the default) the producer waits until the relay's SUBSCRIBEs for the
  consumer's data tracks reached it, then puts every layer as fast as
  ``put_layer`` lets it (one gather copy per layer, as ``kvcs publish`` does):
  the consumer's clock, from its "go" to RetrievalComplete, covers the whole
  transfer through the relay, set-up included, and nothing was published
  before it subscribed. ``--start together``: the producer starts at "go"
  too, so most of the cache is published before the consumer's SUBSCRIBE
  reaches the relay, which then takes it from the producer as a fill before
  serving the consumer (store and forward for that part).
* **raw**: the same bytes (the same K/V sections in the same order) over ONE
  QUIC connection of the same stack, with the same ``QuicConfiguration``
  (:func:`kvcs.transports.quic.config.quic_configuration`: same datagram size,
  windows, TLS), between two processes. The sender is the server, as the relay
  is towards a consumer (qh3 servers do no path MTU discovery, so at the
  default size qh3 sends 1280-byte datagrams from a server, up to 1472 from a
  client): it drives the stack's sans-I/O ``QuicConnection`` from a plain
  ``selectors`` loop on the same batched UDP socket (:mod:`kvcs.transports.quic.udp`),
  one unidirectional stream per (layer, K or V), written in 32 KiB pieces with
  at most 1 MiB written but not yet sent (the kvcs pump's bound), up to 8
  write-and-send rounds per wake-up (as ``QuicEndpoint.service``). The
  receiver (client) copies each stream's data into a buffer it touched
  beforehand; its clock runs from its "go" (sent once the handshake is done,
  before the sender's) to the last byte.

Figures (MB = 10**6 bytes; best of R by goodput, the other rows from that run):

* **goodput**: cache bytes (K/V sections only, no MOQT or KVCS headers) per
  second of the receiving side's clock, kvcs beside raw, and their ratio.
  Target: kvcs >= 0.85x raw (the MOQT and KVCS layers must not be what limits
  the speed). Both receivers write into memory touched beforehand.
* **1st layer**: from the consumer's "go" to its first LayerReady (a layer is
  1/32 of the cache).
* **CPU-bound ceilings**: cache bytes / CPU seconds of the busiest process of
  each transfer: the goodput each would reach if every process had a core of
  its own and nothing else held it up. The relay does the QUIC work of both
  raw processes (it receives and sends every byte), so where the raw transfer
  keeps both its processes busy, a relayed path cannot reach 0.85x raw on a
  machine without a free core per process: see the ceilings' ratio.
* **CPU s** per process: user + system seconds during the transfer (from
  ``/proc/<pid>/stat`` at "go" and at the end; Linux, 10 ms ticks), beside
  the raw process(es) doing the same QUIC work ("vs raw": producer / raw
  sender, consumer / raw receiver, relay / both); and for the whole process
  lifetime (``os.wait4``: start-up, imports, the synthetic cache and the final
  check included).
* **peak RSS** per process: ``os.wait4``'s ``ru_maxrss`` (Linux carries a
  parent's high-water mark into its children, so this process never holds a
  cache itself). The producer holds the source cache and its section copies
  (2x the cache), the relay its cache of every Object, the consumer its
  destination; the raw sender its sections, the raw receiver its buffer.
* **UDP drops** per process: datagrams its socket's receive buffer had no room
  for (``/proc/net/udp``), each one a loss for QUIC to recover.

Each run's line also gives the machine's CPU use during the transfer, ours
and everything else's (``/proc/stat``): on a shared machine other work takes
cores from the transfers and the goodputs move with it; the CPU seconds move
much less. Every run is checked: the consumer's destination and the raw
receiver's buffer are compared (SHA-256) with what the producer and the raw
sender sent; a mismatch marks the row FAILED. No figure is asserted.

Time: aioquic at 1200-byte datagrams is the slow case, about 20-60 s for a
256 MiB kvcs transfer on a 2-core machine; a default run (2 stacks x 2 sizes,
R = 1) takes 2-4 minutes, process start-up (imports, a 256 MiB synthetic
cache per process) adding a few seconds per transfer outside the clocks.

``--profile ROLE`` (relay, producer, consumer, raw-send, raw-recv;
repeatable) runs that process under ``python -m cProfile`` (slower: the
goodput of that run is then not representative) and prints its top ``--top``
functions by own time and its own time summed per component (QUIC stack,
``kvcs.transports.quic``, ``kvcs_core`` packages, syscalls, waiting).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import pstats
import random
import resource
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcs.adapters.cachefile import CacheFile, llama_descriptor, synthetic  # noqa: E402
from kvcs.adapters.numpy_kv import KvDestination, layer_sections  # noqa: E402
from kvcs.transports.quic import asyncio_binding as b  # noqa: E402
from kvcs.transports.quic.config import quic_configuration  # noqa: E402
from kvcs.transports.quic.stack import load_stack  # noqa: E402
from kvcs.transports.quic.tls import TlsConfig, self_signed  # noqa: E402
from kvcs.transports.quic.udp import open_udp  # noqa: E402
from kvcs_core.kvcs.consumer import ConsumerConfig  # noqa: E402
from kvcs_core.kvcs.publisher import AttachState  # noqa: E402
from kvcs_core.kvsp import CompatibilityDescriptor  # noqa: E402
from kvcs_core.moqt import events as ev  # noqa: E402

MIB = 1 << 20
TARGET = 0.85
"""kvcs goodput / raw goodput: at least this."""
SCOPE_KEY = bytes(range(32))
SEED = 7
MAX_UNSENT = 1 << 20
"""The raw sender's bound on written-but-unsent bytes (the kvcs pump's default)."""
ROLES = ("relay", "producer", "consumer", "raw-send", "raw-recv")
START_TIMEOUT = 60.0


# --- the cache, shared by every process ---------------------------------------------------------


def descriptor() -> dict[str, Any]:
    return llama_descriptor()


def token_count(mib: int) -> int:
    cd = CompatibilityDescriptor(descriptor())
    per_token = 2 * cd.layers * cd.section_size // cd.block_tokens
    blocks = max(1, mib * MIB // (per_token * cd.block_tokens))
    return blocks * cd.block_tokens


def cache_bytes(mib: int) -> int:
    cd = CompatibilityDescriptor(descriptor())
    return 2 * cd.layers * (token_count(mib) // cd.block_tokens) * cd.section_size


def prompt(tokens: int) -> tuple[int, ...]:
    """The prompt's token IDs (the producer's and the consumer's; any values would do)."""
    rng = random.Random(SEED)
    return tuple(rng.randrange(128_000) for _ in range(tokens))


def section_streams(cache: CacheFile) -> list[list[memoryview]]:
    """Per (layer, K then V): the layer's 32 KiB sections, in order (what is sent)."""
    cd = cache.cd
    out: list[list[memoryview]] = []
    for layer in range(cd.layers):
        s = layer_sections(cache.k[layer], cache.v[layer], cd)
        out += [[memoryview(x).cast("B") for x in s.k], [memoryview(x).cast("B") for x in s.v]]
    return out


def digest_of(parts: Iterator[Any]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


# --- worker plumbing ------------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class StdinLines:
    """Lines from the parent on stdin, read without blocking (fd readiness)."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        os.set_blocking(self.fd, False)
        self.buf = b""
        self.eof = False

    def read(self) -> list[str]:
        try:
            chunk = os.read(self.fd, 4096)
        except BlockingIOError:
            return []
        if not chunk:
            self.eof = True
            return ["stop"]
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [ln.decode().strip() for ln in lines]

    async def wait(self, word: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for line in self.read():
                if line in (word, "stop"):
                    return
            fut: asyncio.Future[None] = loop.create_future()

            def readable(f: asyncio.Future[None] = fut) -> None:
                if not f.done():
                    f.set_result(None)

            loop.add_reader(self.fd, readable)
            try:
                await fut
            finally:
                loop.remove_reader(self.fd)


def udp_port(client: Any) -> int:
    """The local UDP port of a client of :mod:`kvcs.transports.quic.asyncio_binding`."""
    return int(client.driver.udp.address[1])


def worker_tls() -> Any:
    return TlsConfig(verify=False)  # a self-signed certificate, for this run only


# --- the kvcs producer and consumer (workers) ------------------------------------------------


async def producer(args: argparse.Namespace) -> None:
    desc = descriptor()
    cd = CompatibilityDescriptor(desc)
    cache = synthetic(desc, args.tokens, SEED)
    tokens = prompt(args.tokens)
    stdin = StdinLines()
    async with b.connect(
        args.url, tls=worker_tls(), stack=args.stack, max_datagram_size=args.datagram_size
    ) as client:
        pub = await client.publish_cache(desc, SCOPE_KEY, tokens)
        session = client.session
        await client.driver.wait_for(
            lambda: pub.publisher.attach_state(session) is not AttachState.PENDING, 10.0
        )
        if pub.publisher.attach_state(session) is not AttachState.ACCEPTED:
            raise SystemExit("the relay refused the publication")
        data_tracks = {n.encode() for n in pub.publisher.track_names[1:]}
        subscribed: set[bytes] = set()

        def watch(pump: Any, e: Any, now: float) -> None:
            if isinstance(e, ev.SubscribeRequested):
                subscribed.add(e.track.name)

        client.app.watchers.append(watch)
        digest = digest_of(p for s in section_streams(cache) for p in s)
        emit("ready", digest=digest, port=udp_port(client))
        await stdin.wait("go")
        t0, cpu0 = time.monotonic(), cpu_self()
        if args.start == "subscribed":  # the relay's SUBSCRIBEs for the consumer are here
            await client.driver.wait_for(lambda: data_tracks <= subscribed, args.timeout)
        t_sub = time.monotonic()
        for layer in range(cd.layers):
            s = layer_sections(cache.k[layer], cache.v[layer], cd)
            await pub.put_layer(layer, s.k, s.v, timeout=args.timeout)
        await pub.finish()
        t_put = time.monotonic()
        await pub.drained(timeout=args.timeout)
        emit(
            "published",
            t0=t0,
            t_sub=t_sub,
            t_put=t_put,
            t1=time.monotonic(),
            cpu=cpu_self() - cpu0,
            sent=client.pump.bytes_pulled,
        )
        await stdin.wait("stop")


async def consumer(args: argparse.Namespace) -> None:
    desc = descriptor()
    cd = CompatibilityDescriptor(desc)
    tokens = prompt(args.tokens)
    dest = KvDestination(cd, args.tokens)
    for layer in range(cd.layers):  # touch the memory now: an engine's KV memory exists
        for comp in ("k", "v"):
            dest.buffer(layer, comp)[:] = bytes(dest.layer_size)
    stdin = StdinLines()
    async with b.connect(
        args.url, tls=worker_tls(), stack=args.stack, max_datagram_size=args.datagram_size
    ) as client:
        emit("ready", port=udp_port(client))
        await stdin.wait("go")
        t0, cpu0 = time.monotonic(), cpu_self()
        retrieval = client.retrieve_cache(
            desc,
            SCOPE_KEY,
            tokens,
            destinations=dest.buffer,
            require_authenticity=False,
            config=ConsumerConfig(stall_timeout=args.timeout),
        )
        timeline: dict[str, float] = {}
        handle = retrieval.handle
        drain = handle.drain

        def timed_drain() -> None:  # when each kind of consumer event first appeared
            n = len(handle.history)
            drain()
            for e in handle.history[n:]:
                timeline.setdefault(type(e).__name__, time.monotonic() - t0)

        handle.drain = timed_drain  # type: ignore[method-assign]
        first = None
        ready: list[float] = []
        async for _layer in retrieval:
            ready.append(time.monotonic() - t0)
            if first is None:
                first = time.monotonic()
        result = await retrieval.result(timeout=args.timeout, strict=False)
        t1, cpu1 = time.monotonic(), cpu_self()
        digest = digest_of(
            dest.buffer(layer, comp) for layer in range(cd.layers) for comp in ("k", "v")
        )
        emit(
            "done",
            t0=t0,
            first=first,
            t1=t1,
            cpu=cpu1 - cpu0,
            complete=result.complete,
            blocks=result.blocks,
            digest=digest,
            ready=ready,
            timeline=timeline,
        )
        await stdin.wait("stop")


def run_async_worker(args: argparse.Namespace) -> None:
    job = producer if args.worker == "producer" else consumer
    asyncio.run(job(args))


# --- the raw QUIC transfer (workers) ----------------------------------------------------------


def feed_batch(stack: Any, conn: Any, batch: list[tuple[bytes, Any]], now: float) -> None:
    """Datagrams read together into one connection the way kvcs's pump feeds them: runs
    from one address in one call where the stack takes a batch (qh3's
    ``receive_many_datagrams``), else one by one, so the raw reference gets the same
    per-datagram saving as kvcs."""
    many = stack.receive_many
    i = 0
    while i < len(batch):
        addr = batch[i][1]
        j = i + 1
        while j < len(batch) and batch[j][1] == addr:
            j += 1
        if many is not None and j - i > 1:
            many(conn, [d for d, _ in batch[i:j]], addr, now)
        else:
            for data, a in batch[i:j]:
                conn.receive_datagram(data, a, now)
        i = j


class RawPeer:
    """One ``QuicConnection`` on one UDP socket, driven by a ``selectors`` loop.

    The server end (the sender, as the relay is towards a consumer) creates its
    connection from the first Initial; the client end connects at once.
    """

    def __init__(self, args: argparse.Namespace, *, server: bool) -> None:
        self.stack = stack = load_stack(args.stack)
        self.udp = open_udp("127.0.0.1", 0)
        self.conn: Any = None
        if server:
            tls = self_signed(tempfile.mkdtemp(prefix="kvcs-bench-"))
            self.cfg = quic_configuration(
                stack, is_client=False, tls=tls, max_datagram_size=args.datagram_size
            )
        else:
            self.cfg = quic_configuration(
                stack,
                is_client=True,
                tls=worker_tls(),
                server_name="127.0.0.1",
                max_datagram_size=args.datagram_size,
            )
            self.conn = stack.connection(configuration=self.cfg)
            self.conn.connect(("127.0.0.1", args.port), now=time.monotonic())
        self.stdin = StdinLines()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.udp.fileno(), selectors.EVENT_READ, "udp")
        self.sel.register(self.stdin.fd, selectors.EVENT_READ, "stdin")
        self.writing = False
        self.stopped = False
        self.told_stop = False
        self.go = False
        self.t0 = self.cpu0 = 0.0

    def step(self) -> list[Any]:
        """Wait for input or the timer, feed it to the connection; the connection's events."""
        conn = self.conn
        timer = None if conn is None else conn.get_timer()
        timeout = None if timer is None else max(0.0, timer - time.monotonic())
        for key, mask in self.sel.select(timeout):
            if key.data == "stdin":
                for line in self.stdin.read():
                    if line == "stop":
                        self.stopped = self.told_stop = True
                    elif line == "go" and not self.go:
                        self.go = True
                        self.t0, self.cpu0 = time.monotonic(), cpu_self()
                continue
            if mask & selectors.EVENT_READ:
                now = time.monotonic()
                batch = self.udp.recv_batch()
                if batch and self.conn is None:
                    header = self.stack.pull_header(batch[0][0], self.cfg.connection_id_length)
                    self.conn = self.stack.connection(
                        configuration=self.cfg,
                        original_destination_connection_id=header.destination_cid,
                    )
                if self.conn is not None:
                    feed_batch(self.stack, self.conn, batch, now)
            if mask & selectors.EVENT_WRITE:
                self.flush([])
        events: list[Any] = []
        if self.conn is None:
            return events
        now = time.monotonic()
        timer = self.conn.get_timer()
        if timer is not None and timer <= now:
            self.conn.handle_timer(now)
        while (e := self.conn.next_event()) is not None:
            events.append(e)
        return events

    def wait_stop(self) -> None:
        """Keep the socket (and its drop count) until the parent says "stop"."""
        while not self.told_stop:
            self.told_stop = "stop" in self.stdin.read() or self.stdin.eof
            if not self.told_stop:
                select.select([self.stdin.fd], [], [], 1.0)

    def flush(self, datagrams: list[tuple[bytes, Any]]) -> None:
        pending = self.udp.send_batch(datagrams)
        if pending != self.writing:
            self.writing = pending
            mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
            self.sel.modify(self.udp.fileno(), mask, "udp")

    def send(self) -> list[tuple[bytes, Any]]:
        if self.conn is None:
            return []
        datagrams = self.stack.datagrams_to_send(self.conn, time.monotonic())
        if datagrams:
            self.flush(datagrams)
        return datagrams


def raw_sender(args: argparse.Namespace) -> None:
    """The server end: every (layer, K or V) on its own stream, 32 KiB per write."""
    streams = section_streams(synthetic(descriptor(), args.tokens, SEED))
    digest = digest_of(p for s in streams for p in s)
    peer = RawPeer(args, server=True)
    emit("listening", port=peer.udp.address[1])
    stack = peer.stack
    ev = stack.events
    unsent = stack.unsent_bytes
    sids: list[int | None] = [None] * len(streams)
    current = piece = 0
    open_sids: list[int] = []
    ready = False

    def fill() -> None:
        """Write while fewer than ``MAX_UNSENT`` written bytes wait (the pump's rule)."""
        nonlocal current, piece, open_sids
        conn = peer.conn
        budget = MAX_UNSENT - sum(unsent(conn, sid) for sid in open_sids)
        while budget > 0 and current < len(streams):
            sid = sids[current]
            if sid is None:
                sid = sids[current] = conn.get_next_available_stream_id(is_unidirectional=True)
                open_sids.append(sid)
            sections = streams[current]
            last = piece == len(sections) - 1
            conn.send_stream_data(sid, sections[piece], last)
            budget -= len(sections[piece])
            piece += 1
            if last:
                current, piece = current + 1, 0
        open_sids = [sid for sid in open_sids if unsent(conn, sid)]

    while not peer.stopped:
        for e in peer.step():
            if isinstance(e, ev.HandshakeCompleted):
                ready = True
            elif isinstance(e, ev.ConnectionTerminated):
                peer.stopped = True
        for _ in range(8):  # as QuicEndpoint.service: write and send while QUIC takes data
            if ready and peer.go and current < len(streams):
                fill()
            if not peer.send():
                break
    emit("finished", t0=peer.t0, t1=time.monotonic(), cpu=cpu_self() - peer.cpu0, digest=digest)
    peer.wait_stop()
    peer.udp.close()


def raw_receiver(args: argparse.Namespace) -> None:
    """The client end: copies each stream's data into a buffer touched beforehand."""
    cd = CompatibilityDescriptor(descriptor())
    stream_len = (args.tokens // cd.block_tokens) * cd.section_size
    total = 2 * cd.layers * stream_len
    buf = bytearray(total)  # zero-filled: the pages are touched now
    view = memoryview(buf)
    peer = RawPeer(args, server=False)
    ev = peer.stack.events
    pos: dict[int, int] = {}
    got = 0
    peer.send()
    while not peer.stopped:
        for e in peer.step():
            if isinstance(e, ev.StreamDataReceived) and e.data:
                off = pos.get(e.stream_id)
                if off is None:
                    off = (e.stream_id >> 2) * stream_len  # server uni streams 3, 7, 11, ...
                n = len(e.data)
                view[off : off + n] = e.data
                pos[e.stream_id] = off + n
                got += n
            elif isinstance(e, ev.HandshakeCompleted):
                emit("ready", port=peer.udp.address[1])
            elif isinstance(e, ev.ConnectionTerminated):
                peer.stopped = True
        if got >= total:
            t1, cpu1 = time.monotonic(), cpu_self()
            peer.conn.close(error_code=0, reason_phrase="done")
            peer.send()
            digest = digest_of(iter([view]))
            emit("done", t0=peer.t0, t1=t1, cpu=cpu1 - peer.cpu0, bytes=got, digest=digest)
            peer.wait_stop()
            break
        peer.send()
    peer.udp.close()


# --- the parent: processes, clocks, rusage ----------------------------------------------------


class Proc:
    """A child process: JSON lines on stdout, stderr to a file, rusage from ``os.wait4``."""

    def __init__(self, name: str, cmd: list[str], profile_dir: Path | None) -> None:
        self.name = name
        self.prof: Path | None = None
        if profile_dir is not None:
            self.prof = profile_dir / f"{name}.prof"
            cmd = [cmd[0], "-m", "cProfile", "-o", str(self.prof), *cmd[1:]]
        self.err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as self)
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, cwd=ROOT
        )
        assert self.p.stdout is not None
        os.set_blocking(self.p.stdout.fileno(), False)
        self.buf = b""
        self.events: list[dict[str, Any]] = []
        self.rusage: resource.struct_rusage | None = None
        self.status: int | None = None
        self.cpu_marks: list[float | None] = []
        self.port: int | None = None
        """Its UDP port on 127.0.0.1."""
        self.drops: int | None = None
        """Datagrams its socket's receive buffer had no room for (Linux)."""

    @property
    def pid(self) -> int:
        return self.p.pid

    def pump(self) -> None:
        assert self.p.stdout is not None
        try:
            chunk = os.read(self.p.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for ln in lines:
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(ln))

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)

    def say(self, line: str) -> None:
        assert self.p.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.p.stdin.write(line.encode() + b"\n")
            self.p.stdin.flush()

    def mark_drops(self) -> None:
        self.drops = socket_drops(self.port)

    def mark_cpu(self) -> None:
        """User + system seconds so far, from ``/proc`` (``None`` where unavailable)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])
            self.cpu_marks.append(ticks / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            self.cpu_marks.append(None)

    @property
    def transfer_cpu(self) -> float | None:
        if len(self.cpu_marks) < 2 or None in self.cpu_marks[:2]:
            return None
        return self.cpu_marks[1] - self.cpu_marks[0]  # type: ignore[operator]

    def poll(self) -> bool:
        """Has the process exited? (Reaped here with ``os.wait4``, keeping its rusage.)"""
        if self.status is None:
            pid, status, ru = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self._reaped(status, ru)
        return self.status is not None

    def _reaped(self, status: int, ru: resource.struct_rusage) -> None:
        self.status = os.waitstatus_to_exitcode(status)
        self.p.returncode = self.status  # so that Popen never waits for it itself
        self.rusage = ru
        self.pump()

    def reap(self, timeout: float) -> None:
        """Wait for the exit (killing the process after ``timeout``); keep its rusage."""
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() >= deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                _, status, ru = os.wait4(self.pid, 0)
                self._reaped(status, ru)
                break
            time.sleep(0.02)

    def kill(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.reap(5.0)
        for f in (self.p.stdin, self.p.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def stderr_tail(self, n: int = 1500) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-n:]

    @property
    def total_cpu(self) -> float | None:
        return None if self.rusage is None else self.rusage.ru_utime + self.rusage.ru_stime

    @property
    def peak_rss(self) -> int | None:
        if self.rusage is None:
            return None
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return self.rusage.ru_maxrss * scale


def wait_event(procs: Sequence[Proc], who: Proc, name: str, timeout: float) -> dict[str, Any]:
    """Read every child's output until ``who`` reports ``name``."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.pump()
        found = who.event(name)
        if found is not None:
            return found
        for p in procs:
            if p.poll() and (p is who or p.status != 0):
                found = who.event(name)
                if found is not None:
                    return found
                raise RuntimeError(
                    f"{p.name} exited with status {p.status} (waiting for {who.name} "
                    f"{name!r}):\n{p.stderr_tail()}"
                )
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{who.name} did not report {name!r} within {timeout:g} s")
        fds = [p.p.stdout.fileno() for p in procs if p.p.stdout is not None]
        select.select(fds, [], [], min(left, 0.5))


def busy_share(
    after: tuple[float, float] | None, before: tuple[float, float] | None
) -> tuple[float, float] | None:
    """(busy CPU seconds, wall seconds x cores) between two :func:`machine_cpu` readings."""
    if after is None or before is None:
        return None
    return after[0] - before[0], after[1] - before[1]


def diff(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def socket_drops(port: int | None) -> int | None:
    """Datagrams dropped at the UDP socket on ``127.0.0.1:port`` (``/proc/net/udp``)."""
    if port is None:
        return None
    want = f"0100007F:{port:04X}"
    try:
        for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == want:
                return int(fields[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def machine_cpu() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine so far, all cores (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in fields]
    except (OSError, ValueError, IndexError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def udp_drops() -> int | None:
    """Datagrams the kernel dropped for want of receive-buffer room (all sockets; Linux)."""
    try:
        lines = [ln.split() for ln in Path("/proc/net/snmp").read_text().splitlines()]
        names, values = (ln for ln in lines if ln and ln[0] == "Udp:")
        return int(values[names.index("RcvbufErrors")])
    except (OSError, ValueError):
        return None


def worker_cmd(role: str, args: argparse.Namespace, stack: str, dgram: int | None) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        role,
        "--stack",
        stack,
        "--tokens",
        str(token_count(args.mib)),
        "--timeout",
        str(args.timeout),
        "--start",
        args.start,
    ]
    if dgram is not None:
        cmd += ["--datagram-size", str(dgram)]
    return cmd


def spawn(
    procs: list[Proc], role: str, cmd: list[str], args: argparse.Namespace, run_dir: Path | None
) -> Proc:
    p = Proc(role, cmd, run_dir if role in args.profile else None)
    procs.append(p)
    return p


def finish(procs: list[Proc], stop: Sequence[Proc]) -> None:
    """Ask the processes in ``stop`` to end, then reap everyone (killing stragglers by PID)."""
    for p in stop:
        if p.name == "relay":
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        else:
            p.say("stop")
    for p in procs:
        p.reap(10.0)


def run_kvcs(
    args: argparse.Namespace, stack: str, dgram: int | None, run_dir: Path | None
) -> dict[str, Any]:
    procs: list[Proc] = []
    try:
        relay_cmd = [sys.executable, "-m", "kvcs", "relay", "--listen", "127.0.0.1:0"]
        relay_cmd += ["--self-signed", "--json", "--stack", stack]
        if dgram is not None:
            relay_cmd += ["--datagram-size", str(dgram)]
        relay = spawn(procs, "relay", relay_cmd, args, run_dir)
        url = wait_event(procs, relay, "listening", START_TIMEOUT)["url"]
        relay.port = int(url.rsplit(":", 1)[1])
        prod, cons = (
            spawn(procs, role, [*worker_cmd(role, args, stack, dgram), "--url", url], args, run_dir)
            for role in ("producer", "consumer")
        )
        ready = wait_event(procs, prod, "ready", START_TIMEOUT)
        digest, prod.port = ready["digest"], ready["port"]
        cons.port = wait_event(procs, cons, "ready", START_TIMEOUT)["port"]
        for p in procs:
            p.mark_cpu()
        drops, machine, window = udp_drops(), machine_cpu(), time.monotonic()
        cons.say("go")
        prod.say("go")
        done = wait_event(procs, cons, "done", args.timeout + 30)
        for p in procs:
            p.mark_cpu()
            p.mark_drops()
        drops, machine = diff(udp_drops(), drops), busy_share(machine_cpu(), machine)
        window = time.monotonic() - window
        published = wait_event(procs, prod, "published", args.timeout)
        finish(procs, [prod, relay, cons])
    finally:
        for p in procs:
            p.kill()
    return {
        "seconds": done["t1"] - done["t0"],
        "first": None if done["first"] is None else done["first"] - done["t0"],
        "ok": bool(done["complete"]) and done["digest"] == digest,
        "digest": digest,
        "drops": drops,
        "machine": machine,
        "window": window,
        "put_seconds": published["t_put"] - published["t0"],
        "ready": done["ready"],
        "timeline": done["timeline"],
        "t_sub": published["t_sub"] - published["t0"],
        "procs": procs,
    }


def run_raw(
    args: argparse.Namespace, stack: str, dgram: int | None, run_dir: Path | None
) -> dict[str, Any]:
    procs: list[Proc] = []
    try:
        send = spawn(procs, "raw-send", worker_cmd("raw-send", args, stack, dgram), args, run_dir)
        port = send.port = wait_event(procs, send, "listening", START_TIMEOUT)["port"]
        cmd = [*worker_cmd("raw-recv", args, stack, dgram), "--port", str(port)]
        recv = spawn(procs, "raw-recv", cmd, args, run_dir)
        recv.port = wait_event(procs, recv, "ready", START_TIMEOUT)["port"]
        for p in procs:
            p.mark_cpu()
        drops, machine, window = udp_drops(), machine_cpu(), time.monotonic()
        recv.say("go")
        send.say("go")
        done = wait_event(procs, recv, "done", args.timeout + 30)
        for p in procs:
            p.mark_cpu()
            p.mark_drops()
        drops, machine = diff(udp_drops(), drops), busy_share(machine_cpu(), machine)
        window = time.monotonic() - window
        sent = wait_event(procs, send, "finished", 30.0)
        finish(procs, [send, recv])
    finally:
        for p in procs:
            p.kill()
    return {
        "seconds": done["t1"] - done["t0"],
        "ok": done["digest"] == sent["digest"],
        "digest": sent["digest"],
        "drops": drops,
        "machine": machine,
        "window": window,
        "procs": procs,
    }


COMPONENTS = (
    ("epoll", "waiting (epoll/select)"),
    ("'poll'", "waiting (epoll/select)"),
    ("sendto", "UDP send (syscall)"),
    ("sendmsg", "UDP send (syscall)"),
    ("recvfrom", "UDP receive (syscall)"),
    ("recvmsg", "UDP receive (syscall)"),
    ("sha256", "SHA-256"),
    ("openssl", "AEAD / crypto (C)"),
    ("/aioquic/", "aioquic (Python)"),
    ("/qh3/", "qh3 (Python)"),
    ("qh3", "qh3 (native)"),
    ("transports/quic", "kvcs.transports.quic"),
    ("kvcs_core/wire", "kvcs_core.wire"),
    ("kvcs_core/moqt", "kvcs_core.moqt"),
    ("kvcs_core/relay", "kvcs_core.relay"),
    ("kvcs_core/kvcs", "kvcs_core.kvcs"),
    ("adapters/", "adapters"),
    ("asyncio", "asyncio"),
    ("importlib", "start-up (imports)"),
    ("<frozen", "start-up (imports)"),
    ("compile", "start-up (imports)"),
    ("marshal", "start-up (imports)"),
    ("cryptography", "start-up / TLS (cryptography)"),
)


def show_profile(path: Path | None, title: str, top: int) -> None:
    if path is None or not path.exists():
        print(f"(no profile for {title})")
        return
    print(f"--- profile: {title} ---")
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)
    own: dict[str, float] = {}
    for (file, _, func), row in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{file}:{func}"
        name = next((n for key, n in COMPONENTS if key in where), "other (builtins, stdlib)")
        own[name] = own.get(name, 0.0) + row[2]
    total = sum(own.values())
    print(f"own time by component ({title}):")
    for name, tt in sorted(own.items(), key=lambda kv: -kv[1]):
        print(f"  {name:34} {tt:7.3f} s  {100 * tt / total:5.1f} %")


# --- report ------------------------------------------------------------------------------------


def default_datagram_size(stack: str) -> int:

    return int(load_stack(stack).configuration(is_client=True).max_datagram_size)


def fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def ceiling(res: dict[str, Any], nbytes: int) -> tuple[float | None, str]:
    """Cache bytes per CPU second of the transfer's busiest process, and its name."""
    cpu = {p.name: p.transfer_cpu for p in res["procs"]}
    if not cpu or None in cpu.values():
        return None, "-"
    name = max(cpu, key=lambda n: cpu[n] or 0.0)
    busiest = cpu[name] or 0.0
    return (nbytes / busiest if busiest > 0 else None), name


RAW_COUNTERPART = {
    "producer": ("raw-send",),
    "consumer": ("raw-recv",),
    "relay": ("raw-send", "raw-recv"),
}
"""The raw processes doing the same QUIC work as each kvcs process."""


def versus_raw(p: Proc, raw_cpu: dict[str, float | None]) -> str:
    names = RAW_COUNTERPART.get(p.name)
    if names is None or p.transfer_cpu is None:
        return ""
    parts = [raw_cpu.get(n) for n in names]
    if None in parts or not sum(parts):  # type: ignore[arg-type]
        return "-"
    return f"{p.transfer_cpu / sum(parts):.2f}x"  # type: ignore[arg-type]


def run_line(res: dict[str, Any]) -> str:
    """One transfer in a line: goodput, time, CPU use against the machine's, drops."""
    text = f"{res['rate'] / 1e6:.1f} MB/s in {res['seconds']:.2f} s"
    ours = [p.transfer_cpu for p in res["procs"]]
    if res["machine"] is not None and None not in ours:
        busy, capacity = res["machine"]
        text += (
            f", CPU {100 * sum(ours) / capacity:.0f}% ours + "
            f"{100 * max(0.0, busy - sum(ours)) / capacity:.0f}% others of"
            f" {capacity / res['window']:.0f} cores"
        )
    if res["drops"] is not None:
        text += f", {res['drops']} UDP drops"
    return text


def measure(
    args: argparse.Namespace, stack: str, dgram: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    nbytes = cache_bytes(args.mib)
    best_k: dict[str, Any] | None = None
    best_r: dict[str, Any] | None = None
    label = f"{stack}-{dgram or 'default'}"
    for i in range(args.repeat):
        run_dir = None
        if args.profile:
            run_dir = Path(tempfile.mkdtemp(prefix=f"kvcs-bench-{label}-{i}-"))
        k = run_kvcs(args, stack, dgram, run_dir)
        r = run_raw(args, stack, dgram, run_dir)
        for res in (k, r):
            res["rate"] = nbytes / res["seconds"]
        print(f"  {label} run {i + 1}: kvcs {run_line(k)}; raw {run_line(r)}", flush=True)
        if best_k is None or k["rate"] > best_k["rate"]:
            best_k = k
        if best_r is None or r["rate"] > best_r["rate"]:
            best_r = r
        if run_dir is not None:
            for p in [*k["procs"], *r["procs"]]:
                if p.name in args.profile:
                    show_profile(p.prof, f"{p.name}, {label}, run {i + 1}", args.top)
    assert best_k is not None and best_r is not None
    return best_k, best_r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="cache size in MiB (default 256)")
    ap.add_argument(
        "--stacks", default="qh3,aioquic", help="comma-separated QUIC stacks (default stack first)"
    )
    ap.add_argument(
        "--datagram-sizes",
        default="default,16000",
        help="comma-separated max_datagram_size values ('default': the stack's own)",
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per transfer")
    ap.add_argument(
        "--profile",
        action="append",
        default=[],
        choices=ROLES,
        help="run this process under cProfile and print its top functions (repeatable)",
    )
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--start",
        choices=("subscribed", "together"),
        default="subscribed",
        help="when the producer starts putting layers: once the consumer's data SUBSCRIBEs"
        " reached it through the relay (default), or at once, with the consumer (most of the"
        " cache is then already published when the consumer subscribes)",
    )
    # worker modes (this file started by itself)
    ap.add_argument("--worker", choices=ROLES, help=argparse.SUPPRESS)
    ap.add_argument("--stack", help=argparse.SUPPRESS)
    ap.add_argument("--datagram-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        if args.worker in ("producer", "consumer"):
            run_async_worker(args)
        elif args.worker == "raw-send":
            raw_sender(args)
        else:
            raw_receiver(args)
        return

    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    sizes = [
        None if s.strip() == "default" else int(s)
        for s in args.datagram_sizes.split(",")
        if s.strip()
    ]
    tokens = token_count(args.mib)
    nbytes = cache_bytes(args.mib)
    print(
        f"synthetic Llama-shaped cache: 32 layers x 8 KV heads x 128, bfloat16, {tokens} tokens"
        f" = {nbytes / MIB:.0f} MiB of K/V in {nbytes // 32768} Objects of 32 KiB; "
        f"{os.cpu_count()} CPUs; best of {args.repeat}",
        flush=True,
    )
    started = time.monotonic()
    results = []
    for stack in stacks:
        for dgram in sizes:
            results.append((stack, dgram, *measure(args, stack, dgram)))
    print()
    rows: list[tuple[str, ...]] = [
        (
            "stack",
            "datagram",
            "kvcs goodput",
            "raw goodput",
            "ratio",
            "target",
            "1st layer",
            "checked",
        )
    ]
    for stack, dgram, k, r in results:
        size = dgram or default_datagram_size(stack)
        ratio = k["rate"] / r["rate"]
        rows.append(
            (
                stack,
                f"{size} B" + ("" if dgram else " (default)"),
                f"{k['rate'] / 1e6:.1f} MB/s",
                f"{r['rate'] / 1e6:.1f} MB/s",
                f"{ratio:.2f}x",
                f"{'met' if ratio >= TARGET else 'MISSED'} (>= {TARGET:g}x)",
                fmt(None if k["first"] is None else k["first"] * 1e3, ".0f", " ms"),
                "ok" if k["ok"] and r["ok"] and k["digest"] == r["digest"] else "FAILED",
            )
        )
    table(rows)
    print()
    print("CPU-bound ceilings (cache bytes / CPU seconds of the busiest process of the transfer:")
    print("the goodput if every process had a core of its own and nothing else held it up)")
    rows = [("stack", "datagram", "kvcs ceiling", "busiest", "raw ceiling", "busiest", "ratio")]
    for stack, dgram, k, r in results:
        kc, kp = ceiling(k, nbytes)
        rc, rp = ceiling(r, nbytes)
        rows.append(
            (
                stack,
                f"{dgram or default_datagram_size(stack)} B",
                fmt(None if kc is None else kc / 1e6, ".1f", " MB/s"),
                kp,
                fmt(None if rc is None else rc / 1e6, ".1f", " MB/s"),
                rp,
                fmt(None if kc is None or rc is None else kc / rc, ".2f", "x"),
            )
        )
    table(rows)
    print()
    rows = [
        (
            "stack",
            "datagram",
            "process",
            "CPU s transfer",
            "vs raw",
            "CPU s total",
            "peak RSS",
            "UDP drops",
        )
    ]
    for stack, dgram, k, r in results:
        first = (stack, f"{dgram or default_datagram_size(stack)} B")
        raw_cpu = {p.name: p.transfer_cpu for p in r["procs"]}
        for p in [*k["procs"], *r["procs"]]:
            rows.append(
                (
                    *first,
                    p.name,
                    fmt(p.transfer_cpu, ".2f"),
                    versus_raw(p, raw_cpu),
                    fmt(p.total_cpu, ".2f"),
                    fmt(None if p.peak_rss is None else p.peak_rss / MIB, ".0f", " MiB"),
                    fmt(p.drops, "d"),
                )
            )
            first = ("", "")
    table(rows)
    print(
        "vs raw: CPU seconds in the transfer over those of the raw process(es) doing the same"
        " QUIC work: producer / raw-send, consumer / raw-recv, relay / (raw-send + raw-recv)"
    )
    print(f"\n{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
