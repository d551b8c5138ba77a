"""Relays that stream: a KV cache through ``kvcs relay`` (one, or a two-relay tree), measured.

Run from the repository root::

    python3 benchmarks/bench_relay_pipeline.py [--mib M] [--layers L]
        [--stacks aioquic,qh3[,pquic]] [--configs NAMES] [--repeat R]
        [--layer-interval S] [--timeout S] [--no-raw] [--no-aiomoqt]
        [--runs-consecutive N] [--json FILE]

Every process is a separate one, over real QUIC on 127.0.0.1. The cache is the
synthetic Llama-shaped one (``kvcs.adapters.cachefile.synthetic``: 8 KV heads,
head_dim 128, bfloat16, 16-token blocks, 32 KiB sections; ``--layers`` 32 and
``--mib`` 256 by default, in steps of one block of every layer).

**kvcs**, the CLI as a user runs it: ``kvcs relay`` (``--upstream`` for the
leaf of a tree), ``kvcs publish --preload`` (to the root relay: it makes the
cache and computes its ``--digest`` before connecting, as the raw sender has its
bytes ready before its "go"; an inference engine's cache is in memory too) and
``kvcs fetch`` (from the leaf), all ``--json``. The configurations (``--configs``, comma-separated
names or ``fnmatch`` patterns, default every one):

* ``paced`` / ``unpaced``: ``kvcs publish --layer-interval S`` (default 0.05 s,
  a prefill) or as fast as it can;
* ``live``: the producer announces, the consumer starts, and the producer waits
  (``--wait-for-subscriber``) until the consumer's SUBSCRIBEs for every data
  track reached it through the relay(s), then publishes; ``late``: the
  consumer starts once ``kvcs publish`` reported the publication complete;
* ``relay`` / ``tree``: through one relay, or a leaf relay whose upstream is a
  root relay.

Figures per configuration (MB = 10**6 bytes):

* **goodput**: cache bytes (K/V only) / the consumer's wall time (``kvcs fetch``'s
  ``seconds``: from its retrieval's start, connected, to the last layer);
* **vs raw**: against a raw pipeline of the same stack and the same hops,
  sender -> forwarder [-> forwarder] -> receiver, each a process driving the
  stack's sans-I/O connection on the project's UDP socket
  (:func:`kvcs.transports.quic.udp.open_udp`, what kvcs uses; for pquic, which owns its
  socket, aiopquic's own asyncio API: ``_raw_pquic.py``): the sender writes every
  (layer, K or V) on its own stream in 32 KiB pieces (at most 1 MiB written and
  unsent, the kvcs pump's bound), each forwarder writes every stream's data on
  to the next hop as it reads it, the receiver places it in a buffer touched
  beforehand. The forwarders are QUIC servers towards both neighbours, as
  ``kvcs relay`` is (the second of a tree is a client of the first, as a leaf
  relay is). That is the honest ceiling of a relay hop. Goal >= 0.8x
  (unpaced configurations; a paced one is bound by the producer's pace);
* **vs aiomoqt**: unpaced, live, one relay, against aiomoqt 0.13.3's publisher
  -> aiomoqt relay -> subscriber (``.peers``, ``bash scripts/install_peers.sh``;
  the same number of bytes in objects of the same size, G = 2L groups of one
  block count of 32 KiB objects), run inside ``unshare -rn`` (aiopquic binds
  every interface); goal >= 1.0x on the best stack. Skipped, with the reason
  printed, where ``.peers`` or ``unshare`` is missing;
* **1st layer**: paced, live: ``kvcs fetch``'s first usable layer (its
  ``first_layer_ms``) over its total, from the same clock start; goal <= 1/L + 0.10;
* **checked**: ``kvcs fetch --digest`` (SHA-256 of the received K/V) equals
  ``kvcs publish --digest`` (of the published sections), and the retrieval is
  complete;
* **CPU s / peak RSS per process**: CPU in the consumer's window (``/proc/PID/stat``
  read as it starts and as it reports; ``-`` for a process that exited in
  between), CPU over its whole life (``os.wait4``: start-up, imports and the
  synthetic cache included) and peak RSS (``VmHWM`` of ``/proc/PID/status``,
  read while it runs; ``os.wait4``'s ``ru_maxrss`` where none was read).
  ``kvcs fetch`` holds its prompt's synthetic source cache as well as its
  destination (the CLI makes the prompt from it).

``--runs-consecutive N``: each configuration N times in a row, kvcs only
(``kvcs fetch``'s default stall, recovery and, unless ``--timeout`` is given,
fetch timeouts), one line per run and a
count of completed, bit-identical runs; the exit status is 1 unless all were.
``--json FILE`` writes every run's figures (with ``--runs-consecutive``, again after each
run, so a series stopped early keeps the failed runs' ``detail``: the processes' stderr); a
failed run's line ends with the last line of that detail. No figure is asserted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fnmatch
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_quic_transfer import (  # noqa: E402  (shared worker plumbing)
    MAX_UNSENT,
    Proc,
    RawPeer,
    StdinLines,
    digest_of,
    emit,
    feed_batch,
    fmt,
    section_streams,
    table,
    wait_event,
)

from kvcs.adapters.cachefile import llama_descriptor, synthetic  # noqa: E402
from kvcs.transports.quic.config import quic_configuration  # noqa: E402
from kvcs.transports.quic.stack import STACKS, StackUnavailable, load_stack  # noqa: E402
from kvcs.transports.quic.tls import TlsConfig, self_signed  # noqa: E402
from kvcs.transports.quic.udp import UdpSocket, open_udp  # noqa: E402
from kvcs_core.kvsp import CompatibilityDescriptor  # noqa: E402

MIB = 1 << 20
SEED = 7
SCOPE_KEY = bytes(range(32)).hex()
RAW_GOAL = 0.8
"""kvcs goodput / raw pipeline goodput (unpaced): at least this."""
AIOMOQT_GOAL = 1.0
"""kvcs goodput / aiomoqt goodput (unpaced, live, one relay, best stack): at least this."""
FIRST_LAYER_MARGIN = 0.10
"""First usable layer / total (paced, live): at most 1/L + this."""
START_TIMEOUT = 60.0
PEERS_PYTHON = ROOT / ".peers" / "bin" / "python"
AIOMOQT_PORT = 4443
"""The aiomoqt relay's port inside the benchmark's own network namespace."""


# --- configurations ----------------------------------------------------------------------------


@attrs.frozen
class Config:
    paced: bool
    live: bool
    hops: int  # 1: one relay; 2: leaf -> root

    @property
    def name(self) -> str:
        return "/".join(
            (
                "paced" if self.paced else "unpaced",
                "live" if self.live else "late",
                "relay" if self.hops == 1 else "tree",
            )
        )


ALL_CONFIGS = tuple(
    Config(paced, live, hops)
    for hops in (1, 2)
    for live in (True, False)
    for paced in (False, True)
)


def select_configs(spec: str) -> list[Config]:
    if spec in ("", "all"):
        return list(ALL_CONFIGS)
    out: list[Config] = []
    for pattern in (p.strip() for p in spec.split(",") if p.strip()):
        found = [c for c in ALL_CONFIGS if fnmatch.fnmatchcase(c.name, pattern)]
        if not found:
            names = ", ".join(c.name for c in ALL_CONFIGS)
            raise SystemExit(f"--configs: {pattern!r} matches none of {names}")
        out += [c for c in found if c not in out]
    return out


# --- the cache ---------------------------------------------------------------------------------


def descriptor(layers: int) -> dict[str, Any]:
    return llama_descriptor(layers=layers)


def shape(mib: float, layers: int) -> tuple[int, int, int]:
    """(tokens, blocks, cache bytes) of about ``mib`` MiB of K+V in whole blocks."""
    cd = CompatibilityDescriptor(descriptor(layers))
    per_block = 2 * cd.layers * cd.section_size
    blocks = max(1, int(mib * MIB) // per_block)
    return blocks * cd.block_tokens, blocks, blocks * per_block


# --- processes ---------------------------------------------------------------------------------


class Child(Proc):
    """A worker (:class:`bench_quic_transfer.Proc`) whose CPU and peak RSS are read from
    ``/proc`` each time its output is read, so that they are known even after it exited."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        super().__init__(name, cmd, None)
        self.watch_pid = self.pid
        """The process whose ``/proc`` entries are read (a launcher names its child)."""
        self.hwm: int | None = None
        self.window: list[float | None] = []

    def pump(self) -> None:
        super().pump()
        self.sample()

    def sample(self) -> None:
        if self.status is not None:
            return
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{self.watch_pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    kib = int(line.split()[1])
                    self.hwm = max(self.hwm or 0, kib * 1024)

    def ticks(self) -> float | None:
        if self.status is not None:
            return None
        try:
            text = Path(f"/proc/{self.watch_pid}/stat").read_text()
            fields = text.rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def mark(self) -> None:
        self.sample()
        self.window.append(self.ticks())

    @property
    def window_cpu(self) -> float | None:
        if len(self.window) < 2 or self.window[0] is None or self.window[1] is None:
            return None
        return self.window[1] - self.window[0]

    @property
    def rss(self) -> int | None:
        return self.hwm if self.hwm is not None else self.peak_rss

    def figures(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cpu_window": self.window_cpu,
            "cpu_total": self.total_cpu,
            "rss": self.rss,
            "status": self.status,
        }


def start(procs: list[Child], name: str, cmd: list[str]) -> Child:
    p = Child(name, cmd)
    procs.append(p)
    return p


def stop_all(procs: list[Child], timeout: float = 10.0) -> None:
    """SIGTERM (``kvcs`` commands end cleanly on it) or "stop" on stdin, then reap every one
    (``Proc.reap`` kills a straggler by its PID)."""
    for p in procs:
        if p.status is None and not p.poll():
            p.say("stop")
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        p.reap(timeout)


def kill_all(procs: list[Child]) -> None:
    for p in procs:
        p.kill()


def mark_all(procs: list[Child]) -> None:
    for p in procs:
        p.mark()


# --- kvcs: relay(s), publish, fetch (the CLI) --------------------------------------------------


def kvcs(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvcs", *argv]


def transport_opts(args: argparse.Namespace, stack: str) -> list[str]:
    opts = ["--stack", stack]
    if args.datagram_size:
        opts += ["--datagram-size", str(args.datagram_size)]
    return opts


def cache_opts(args: argparse.Namespace) -> list[str]:
    tokens, _, _ = shape(args.mib, args.layers)
    return [
        "--layers", str(args.layers), "--tokens", str(tokens), "--seed", str(SEED),
        "--scope-key", SCOPE_KEY,
    ]  # fmt: skip


def run_kvcs(args: argparse.Namespace, stack: str, cfg: Config) -> dict[str, Any]:
    """One transfer through ``cfg.hops`` relays; its figures (never raises for a failed run:
    ``ok`` is false and ``error`` says why)."""
    _, _, nbytes = shape(args.mib, args.layers)
    procs: list[Child] = []
    out: dict[str, Any] = {"config": cfg.name, "stack": stack, "ok": False, "error": None}
    try:
        relay_cmd = kvcs("relay", "--listen", "127.0.0.1:0", "--self-signed", "--json")
        # every process is bounded in time even if this one is killed (--run-for, --serve-for,
        # --fetch-timeout; the raw workers stop when their stdin closes)
        relay_cmd += ["--run-for", str(4 * args.timeout + 2 * START_TIMEOUT)]
        relay_cmd += transport_opts(args, stack)
        root = start(procs, "relay" if cfg.hops == 1 else "root relay", relay_cmd)
        url = wait_event(procs, root, "listening", START_TIMEOUT)["url"]
        fetch_url = url
        if cfg.hops == 2:
            leaf_cmd = [*relay_cmd, "--upstream", url, "--upstream-insecure"]
            leaf = start(procs, "leaf relay", leaf_cmd)
            fetch_url = wait_event(procs, leaf, "listening", START_TIMEOUT)["url"]
        pub_cmd = kvcs("publish", url, "-k", "--json", "--digest", "--preload", *cache_opts(args))
        pub_cmd += ["--serve-for", str(3 * args.timeout), *transport_opts(args, stack)]
        if cfg.paced:
            pub_cmd += ["--layer-interval", str(args.layer_interval)]
        if cfg.live:
            pub_cmd += ["--wait-for-subscriber", str(args.timeout)]
        fetch_cmd = kvcs("fetch", fetch_url, "-k", "--json", "--digest", "--no-verify")
        fetch_cmd += cache_opts(args)
        if not (args.runs_consecutive and args.timeout_default):  # else kvcs fetch's own
            fetch_cmd += ["--fetch-timeout", str(args.timeout)]
        fetch_cmd += transport_opts(args, stack)
        prod = start(procs, "producer", pub_cmd)
        if cfg.live:
            wait_event(procs, prod, "publishing", START_TIMEOUT)
        else:
            wait_event(procs, prod, "published", args.timeout)
        mark_all(procs)
        cons = start(procs, "consumer", fetch_cmd)
        done = wait_event(procs, cons, "done", args.timeout + START_TIMEOUT)
        mark_all(procs)
        published = prod.event("published") or {}
        if done["complete"] and not published:
            published = wait_event(procs, prod, "published", args.timeout)
        seconds = float(done["seconds"])
        first = done.get("first_layer_ms")
        out.update(
            seconds=seconds,
            rate=nbytes / seconds if seconds > 0 else None,
            first=None if first is None else float(first) / 1e3,
            complete=bool(done["complete"]),
            digest=done.get("digest"),
            published_digest=published.get("digest"),
            identical=bool(done["complete"])
            and done.get("digest") is not None
            and done.get("digest") == published.get("digest"),
            layers_ready=done.get("layers_ready"),
        )
        out["ok"] = out["identical"]
        if not out["ok"]:
            tails = "".join(f"\n[{p.name} stderr] {p.stderr_tail(600)}" for p in procs)
            out["detail"] = f"consumer: {done}{tails}"
            out["error"] = (
                "incomplete" if not done["complete"] else "digest differs from the published one"
            )
    except RuntimeError as exc:  # a process failed or a wait timed out: this run failed
        out["error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else "failed"
        out["detail"] = str(exc)[-2000:]
    finally:
        try:
            stop_all(procs)
        finally:
            kill_all(procs)
    out["procs"] = [p.figures() for p in procs]
    return out


# --- the raw pipeline (workers) ----------------------------------------------------------------


def raw_sender(args: argparse.Namespace) -> None:
    """A client of the first forwarder, as ``kvcs publish`` is of its relay: every (layer,
    K or V) on its own unidirectional stream (ids 2, 6, 10, ...), 32 KiB per write."""
    streams = section_streams(synthetic(descriptor(args.layers), args.tokens, SEED))
    digest = digest_of(p for s in streams for p in s)
    peer = RawPeer(args, server=False)
    stack = peer.stack
    unsent = stack.unsent_bytes
    current = piece = 0
    open_sids: list[int] = []
    sid: int | None = None
    ready = False
    peer.send()

    def fill() -> None:
        nonlocal current, piece, open_sids, sid
        conn = peer.conn
        budget = MAX_UNSENT - sum(unsent(conn, s) for s in open_sids)
        while budget > 0 and current < len(streams):
            if sid is None:
                sid = conn.get_next_available_stream_id(is_unidirectional=True)
                open_sids.append(sid)
            sections = streams[current]
            last = piece == len(sections) - 1
            conn.send_stream_data(sid, sections[piece], last)
            budget -= len(sections[piece])
            piece += 1
            if last:
                current, piece, sid = current + 1, 0, None
        open_sids = [s for s in open_sids if unsent(conn, s)]

    while not peer.stopped:
        for e in peer.step():
            if isinstance(e, stack.events.HandshakeCompleted) and not ready:
                ready = True
                emit("ready", digest=digest)
            elif isinstance(e, stack.events.ConnectionTerminated):
                peer.stopped = True
        for _ in range(8):  # as QuicEndpoint.service: write and send while QUIC takes data
            if ready and peer.go and current < len(streams):
                fill()
            if not peer.send():
                break
    peer.wait_stop()
    peer.udp.close()


def raw_receiver(args: argparse.Namespace) -> None:
    """A client of the last forwarder, as ``kvcs fetch`` is: stream ``4i + 3`` (the i-th
    server stream) is (layer i // 2, K or V) and goes to its place in a touched buffer."""
    cd = CompatibilityDescriptor(descriptor(args.layers))
    stream_len = (args.tokens // cd.block_tokens) * cd.section_size
    total = 2 * cd.layers * stream_len
    buf = bytearray(total)
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
                    off = (e.stream_id >> 2) * stream_len
                n = len(e.data)
                if off + n <= total:
                    view[off : off + n] = e.data
                pos[e.stream_id] = off + n
                got += n
            elif isinstance(e, ev.HandshakeCompleted):
                emit("ready")
            elif isinstance(e, ev.ConnectionTerminated):
                peer.stopped = True
        if got >= total:
            t1 = time.monotonic()
            peer.conn.close(error_code=0, reason_phrase="done")
            peer.send()
            emit("done", t0=peer.t0, t1=t1, bytes=got, digest=digest_of(iter([view])))
            peer.wait_stop()
            break
        peer.send()
    peer.udp.close()


class Forwarder:
    """A QUIC server on one UDP socket (and, with an upstream, a client on another): reads
    every stream of its source and writes the data on, as it comes, to its sink.

    The sink is the first connection accepted; the source is the upstream connection
    where there is one, else the second connection accepted. Stream ``4i + 2`` or
    ``4i + 3`` of the source (its i-th unidirectional stream) goes on as stream
    ``4i + 3`` of the sink, so stream order and placement hold through any chain.
    What the sink's QUIC has not sent yet is bounded as the kvcs pump bounds it
    (``MAX_UNSENT``); the rest waits in a queue, in arrival order (the source is
    not held back: its reads are what a relay's cache would take in).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.stack = stack = load_stack(args.stack)
        tls = self_signed(tempfile.mkdtemp(prefix="kvcs-bench-fwd-"))
        self.cfg = quic_configuration(
            stack, is_client=False, tls=tls, max_datagram_size=args.datagram_size
        )
        self.udp = open_udp("127.0.0.1", 0)
        self.accepted: dict[Any, Any] = {}  # address -> connection, in order of arrival
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.udp.fileno(), selectors.EVENT_READ, self.udp)
        self.stdin = StdinLines()
        self.sel.register(self.stdin.fd, selectors.EVENT_READ, "stdin")
        self.up: Any = None
        self.up_udp: UdpSocket | None = None
        self.writing: dict[int, bool] = {}
        if args.upstream_port:
            ccfg = quic_configuration(
                stack,
                is_client=True,
                tls=TlsConfig(verify=False),
                server_name="127.0.0.1",
                max_datagram_size=args.datagram_size,
            )
            self.up_udp = open_udp("127.0.0.1", 0)
            self.sel.register(self.up_udp.fileno(), selectors.EVENT_READ, self.up_udp)
            self.up = stack.connection(configuration=ccfg)
            self.up.connect(("127.0.0.1", args.upstream_port), now=time.monotonic())
        self.stopped = False
        self.queue: collections.deque[tuple[int, bytes, bool]] = collections.deque()
        """Data read from the source, not yet written to the sink: (sink stream, data, FIN)."""
        self.open_sids: list[int] = []

    def conns(self) -> list[tuple[Any, UdpSocket]]:
        out: list[tuple[Any, UdpSocket]] = [(c, self.udp) for c in self.accepted.values()]
        if self.up is not None and self.up_udp is not None:
            out.append((self.up, self.up_udp))
        return out

    @property
    def sink(self) -> Any:
        return next(iter(self.accepted.values()), None)

    @property
    def source(self) -> Any:
        if self.up is not None:
            return self.up
        conns = list(self.accepted.values())
        return conns[1] if len(conns) > 1 else None

    def write_on(self, sink: Any) -> None:
        """Write queued data on, while fewer than ``MAX_UNSENT`` written bytes wait to be
        sent (the kvcs pump's rule: QUIC stacks do per-packet work for every stream
        that has data waiting)."""
        unsent = self.stack.unsent_bytes
        budget = MAX_UNSENT - sum(unsent(sink, sid) for sid in self.open_sids)
        while budget > 0 and self.queue:
            sid, data, end = self.queue.popleft()
            sink.send_stream_data(sid, data, end)
            if sid not in self.open_sids:
                self.open_sids.append(sid)
            budget -= len(data)
        self.open_sids = [sid for sid in self.open_sids if unsent(sink, sid)]

    def flush(self, udp: UdpSocket, datagrams: list[tuple[bytes, Any]]) -> None:
        pending = udp.send_batch(datagrams)
        if pending != self.writing.get(udp.fileno(), False):
            self.writing[udp.fileno()] = pending
            mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
            self.sel.modify(udp.fileno(), mask, udp)

    def run(self) -> None:
        emit("listening", port=self.udp.address[1])
        ev = self.stack.events
        up_ready = False
        for conn, udp in self.conns():  # the upstream Initial (qh3 sets no timer before it)
            self.flush(udp, self.stack.datagrams_to_send(conn, time.monotonic()))
        while not self.stopped:
            timers = [t for c, _ in self.conns() if (t := c.get_timer()) is not None]
            timeout = None if not timers else max(0.0, min(timers) - time.monotonic())
            for key, mask in self.sel.select(timeout):
                if key.data == "stdin":
                    if "stop" in self.stdin.read():
                        self.stopped = True
                    continue
                udp = key.data
                if mask & selectors.EVENT_WRITE:
                    self.flush(udp, [])
                if not mask & selectors.EVENT_READ:
                    continue
                now = time.monotonic()
                batch = udp.recv_batch()
                if udp is self.up_udp:
                    feed_batch(self.stack, self.up, batch, now)
                    continue
                for data, addr in batch:
                    if addr not in self.accepted:
                        header = self.stack.pull_header(data, self.cfg.connection_id_length)
                        self.accepted[addr] = self.stack.connection(
                            configuration=self.cfg,
                            original_destination_connection_id=header.destination_cid,
                        )
                by_addr: dict[Any, list[tuple[bytes, Any]]] = {}
                for data, addr in batch:
                    by_addr.setdefault(addr, []).append((data, addr))
                for addr, run in by_addr.items():
                    feed_batch(self.stack, self.accepted[addr], run, now)
            now = time.monotonic()
            source, sink = self.source, self.sink
            for conn, _ in self.conns():
                timer = conn.get_timer()
                if timer is not None and timer <= now:
                    conn.handle_timer(now)
                while (e := conn.next_event()) is not None:
                    if conn is source and isinstance(e, ev.StreamDataReceived):
                        self.queue.append((4 * (e.stream_id >> 2) + 3, e.data, e.end_stream))
                    elif conn is self.up and isinstance(e, ev.HandshakeCompleted) and not up_ready:
                        up_ready = True
                        emit("upstream-ready")
            for _ in range(8):  # write and send while QUIC takes data
                if sink is not None and self.queue:
                    self.write_on(sink)
                sent = False
                for conn, udp in self.conns():
                    datagrams = self.stack.datagrams_to_send(conn, time.monotonic())
                    if datagrams:
                        self.flush(udp, datagrams)
                        sent = True
                if not sent:
                    break
        self.udp.close()
        if self.up_udp is not None:
            self.up_udp.close()


def run_raw(args: argparse.Namespace, stack: str, hops: int) -> dict[str, Any]:
    """sender -> ``hops`` forwarders -> receiver; the receiver's clock from its "go"."""
    _, _, nbytes = shape(args.mib, args.layers)
    procs: list[Child] = []
    out: dict[str, Any] = {"hops": hops, "stack": stack, "ok": False, "error": None}

    def worker(role: str, *extra: str) -> list[str]:
        tokens, _, _ = shape(args.mib, args.layers)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--stack", stack]
        cmd += ["--tokens", str(tokens), "--layers", str(args.layers), *extra]
        if args.datagram_size:
            cmd += ["--datagram-size", str(args.datagram_size)]
        return cmd

    try:
        first = start(procs, "raw fwd 1", worker("raw-fwd"))
        port = wait_event(procs, first, "listening", START_TIMEOUT)["port"]
        last_port = port
        if hops == 2:
            second = start(procs, "raw fwd 2", worker("raw-fwd", "--upstream-port", str(port)))
            last_port = wait_event(procs, second, "listening", START_TIMEOUT)["port"]
            wait_event(procs, second, "upstream-ready", START_TIMEOUT)
        recv = start(procs, "raw recv", worker("raw-recv", "--port", str(last_port)))
        wait_event(procs, recv, "ready", START_TIMEOUT)
        send = start(procs, "raw send", worker("raw-send", "--port", str(port)))
        digest = wait_event(procs, send, "ready", START_TIMEOUT)["digest"]
        mark_all(procs)
        recv.say("go")
        send.say("go")
        done = wait_event(procs, recv, "done", args.timeout)
        mark_all(procs)
        seconds = done["t1"] - done["t0"]
        out.update(seconds=seconds, rate=nbytes / seconds, ok=done["digest"] == digest)
        if not out["ok"]:
            out["error"] = "digest differs"
    except RuntimeError as exc:
        out["error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else "failed"
    finally:
        try:
            stop_all(procs)
        finally:
            kill_all(procs)
    out["procs"] = [p.figures() for p in procs]
    return out


# --- aiomoqt: publisher -> relay -> subscriber, inside unshare -rn ------------------------------


def aiomoqt_unavailable() -> str | None:
    """Why the aiomoqt column cannot be measured here, or ``None``."""
    if not PEERS_PYTHON.exists():
        return f"{PEERS_PYTHON.relative_to(ROOT)} missing (bash scripts/install_peers.sh)"
    if shutil.which("unshare") is None:
        return "no unshare command (aiomoqt must run in a loopback-only network namespace)"
    try:
        probe = subprocess.run(
            ["unshare", "-rn", "true"], capture_output=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -rn failed: {exc}"
    if probe.returncode != 0:
        return f"unshare -rn refused: {probe.stderr.decode(errors='replace').strip()[:200]}"
    return None


def aiomoqt_shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """(groups, objects per group, object size): the cache's bytes in its objects' size."""
    _, blocks, _ = shape(args.mib, args.layers)
    cd = CompatibilityDescriptor(descriptor(args.layers))
    return 2 * args.layers, blocks, cd.section_size


def aiomoqt_inside(args: argparse.Namespace) -> None:
    """The worker run under ``unshare -rn``: lo up, relay, publisher, subscriber; one JSON
    line with the figures."""

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(143)  # the finally clauses below stop every child by its PID

    signal.signal(signal.SIGTERM, terminated)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=False, timeout=10)
    sys.path.insert(0, str(ROOT / "tests" / "peers"))
    from make_cert import write_cert  # noqa: PLC0415  (the test peers' certificate helper)

    certs = Path(tempfile.mkdtemp(prefix="kvcs-bench-aiomoqt-"))
    write_cert(certs)
    groups, objects, size = aiomoqt_shape(args)
    peer = str(HERE / "_aiomoqt_peer.py")
    shape_opts = ["--groups", str(groups), "--objects", str(objects), "--size", str(size)]
    shape_opts += ["--port", str(AIOMOQT_PORT), "--timeout", str(args.timeout)]
    procs: list[Child] = []
    out: dict[str, Any] = {"event": "aiomoqt", "ok": False, "error": None}
    try:
        if args.via:  # aiomoqt's publisher and subscriber through kvcs relay on a stack
            relay_cmd = kvcs("relay", "--listen", f"127.0.0.1:{AIOMOQT_PORT}", "--self-signed")
            relay_cmd += ["--stack", args.via, "--json", "--run-for", str(3 * args.timeout)]
            relay = start(procs, f"kvcs relay ({args.via})", relay_cmd)
            wait_event(procs, relay, "listening", START_TIMEOUT)
        else:
            relay_cmd = [str(PEERS_PYTHON), str(ROOT / "tests" / "peers" / "aiomoqt_relay.py")]
            relay_cmd += ["--port", str(AIOMOQT_PORT), "--cert", str(certs / "cert.pem")]
            relay_cmd += ["--key", str(certs / "key.pem"), "--timeout", str(3 * args.timeout)]
            relay = start(procs, "aiomoqt relay", relay_cmd)
            relay.watch_pid = int(wait_event(procs, relay, "ready", START_TIMEOUT)["pid"])
        pub = start(procs, "aiomoqt pub", [str(PEERS_PYTHON), peer, "pub", *shape_opts])
        digest = wait_event(procs, pub, "announced", START_TIMEOUT)["digest"]
        mark_all(procs)
        sub = start(procs, "aiomoqt sub", [str(PEERS_PYTHON), peer, "sub", *shape_opts])
        done = wait_event(procs, sub, "done", args.timeout + START_TIMEOUT)
        mark_all(procs)
        seconds = done["t1"] - done["t0"]
        out.update(seconds=seconds, ok=done["digest"] == digest)
        if not out["ok"]:
            out["error"] = "digest differs"
    except RuntimeError as exc:
        out["error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else "failed"
    finally:
        try:
            stop_all(procs)
        finally:
            kill_all(procs)
            shutil.rmtree(certs, ignore_errors=True)
    out["procs"] = [p.figures() for p in procs]
    print(json.dumps(out), flush=True)


def run_aiomoqt(args: argparse.Namespace, via: str | None = None) -> dict[str, Any]:
    """aiomoqt's publisher -> relay -> subscriber in a loopback-only namespace: aiomoqt's
    relay, or with ``via`` kvcs relay on that stack."""
    _, _, nbytes = shape(args.mib, args.layers)
    cmd = ["unshare", "-rn", "--", sys.executable, str(Path(__file__).resolve())]
    cmd += ["--worker", "aiomoqt", "--mib", str(args.mib), "--layers", str(args.layers)]
    cmd += ["--timeout", str(args.timeout)]
    if via is not None:
        cmd += ["--via", via]
    procs: list[Child] = []
    try:
        ns = start(procs, "aiomoqt", cmd)
        out = wait_event(procs, ns, "aiomoqt", 3 * args.timeout + 2 * START_TIMEOUT)
    except RuntimeError as exc:
        out = {"ok": False, "error": str(exc).strip().splitlines()[0], "procs": []}
    finally:
        try:
            stop_all(procs, 30.0)
        finally:
            kill_all(procs)
    if out.get("seconds"):
        out["rate"] = nbytes / out["seconds"]
    return out


# --- report ------------------------------------------------------------------------------------


def mbps(rate: float | None) -> str:
    return fmt(None if rate is None else rate / 1e6, ".1f", " MB/s")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def verdict(value: float | None, goal: float, *, at_least: bool) -> str:
    if value is None:
        return "-"
    met = value >= goal if at_least else value <= goal
    return "met" if met else "MISSED"


def result_row(
    args: argparse.Namespace,
    k: dict[str, Any],
    raw: dict[int, dict[str, Any]],
    aio: dict[str, Any] | None,
    cfg: Config,
) -> tuple[str, ...]:
    rate = k.get("rate") if k["ok"] else None
    ref_rate = ok_rate(raw.get(cfg.hops))
    vs_raw = ratio(rate, ref_rate)
    raw_goal = (
        "n/a (paced)"
        if cfg.paced
        else f"{verdict(vs_raw, RAW_GOAL, at_least=True)} >= {RAW_GOAL:g}x"
    )
    aio_cell = aio_goal = ""
    if cfg == Config(paced=False, live=True, hops=1):
        aio_rate = ok_rate(aio)
        vs_aio = ratio(rate, aio_rate)
        aio_cell = f"{fmt(vs_aio, '.2f', 'x')} of {mbps(aio_rate)}"
        aio_goal = f"{verdict(vs_aio, AIOMOQT_GOAL, at_least=True)} >= {AIOMOQT_GOAL:g}x"
    first_cell = first_goal = ""
    if cfg.paced and cfg.live:
        goal = 1 / args.layers + FIRST_LAYER_MARGIN
        frac = None
        if k.get("first") is not None and k.get("seconds"):
            frac = k["first"] / k["seconds"]
        first_cell = f"{fmt(frac, '.2f')} ({fmt(k.get('first'), '.2f', ' s')})"
        first_goal = f"{verdict(frac, goal, at_least=False)} <= {goal:.3f}"
    checked = "bit-identical" if k["ok"] else f"FAILED: {k.get('error')}"
    return (
        cfg.name,
        mbps(rate),
        fmt(k.get("seconds"), ".2f", " s"),
        f"{fmt(vs_raw, '.2f', 'x')} of {mbps(ref_rate)}",
        raw_goal,
        aio_cell,
        aio_goal,
        first_cell,
        first_goal,
        checked,
    )


HEADER = (
    "configuration",
    "goodput",
    "time",
    "vs raw pipeline",
    "goal",
    "vs aiomoqt",
    "goal",
    "1st layer / total",
    "goal",
    "checked",
)


def proc_rows(label: str, res: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for p in res.get("procs", []):
        rows.append(
            (
                label,
                p["name"],
                fmt(p.get("cpu_window"), ".2f"),
                fmt(p.get("cpu_total"), ".2f"),
                fmt(None if p.get("rss") is None else p["rss"] / MIB, ".0f", " MiB"),
            )
        )
        label = ""
    return rows


def print_run(
    args: argparse.Namespace,
    stack: str,
    run: int,
    results: list[tuple[Config, dict[str, Any]]],
    raw: dict[int, dict[str, Any]],
    aio: dict[str, Any] | None,
    aio_reason: str | None,
) -> None:
    _, _, nbytes = shape(args.mib, args.layers)
    print(f"\n=== {stack}, run {run}: {nbytes / MIB:.0f} MiB, {args.layers} layers ===")
    table([HEADER, *(result_row(args, k, raw, aio, cfg) for cfg, k in results)])
    for hops, r in sorted(raw.items()):
        state = "ok" if r["ok"] else f"FAILED: {r.get('error')}"
        print(
            f"raw pipeline, {hops} forwarder(s): {mbps(r.get('rate'))} in "
            f"{fmt(r.get('seconds'), '.2f', ' s')} ({state})"
        )
    if aio is not None:
        state = "ok" if aio.get("ok") else f"FAILED: {aio.get('error')}"
        print(
            f"aiomoqt pub -> relay -> sub: {mbps(aio.get('rate'))} in "
            f"{fmt(aio.get('seconds'), '.2f', ' s')} ({state})"
        )
    elif aio_reason:
        print(f"aiomoqt column skipped: {aio_reason}")
    rows: list[tuple[str, ...]] = [("run", "process", "CPU s window", "CPU s total", "peak RSS")]
    for cfg, k in results:
        rows += proc_rows(cfg.name, k)
    for hops, r in sorted(raw.items()):
        rows += proc_rows(f"raw, {hops} hop(s)", r)
    if aio is not None:
        rows += proc_rows("aiomoqt", aio)
    print()
    table(rows)


def run_once(args: argparse.Namespace, stacks: list[str], configs: list[Config]) -> int:
    aio_reason = None if args.aiomoqt else "--no-aiomoqt"
    if aio_reason is None and any(c == Config(False, True, 1) for c in configs):
        aio_reason = aiomoqt_unavailable()
    record: list[dict[str, Any]] = []
    runs: list[tuple[str, Config, dict[str, Any], dict[int, dict[str, Any]], Any]] = []
    for run in range(1, args.repeat + 1):
        aio = None
        if aio_reason is None and any(c == Config(False, True, 1) for c in configs):
            aio = run_aiomoqt(args)
            record.append({"kind": "aiomoqt", "run": run, **aio})
        for stack in stacks:
            raw: dict[int, dict[str, Any]] = {}
            if args.raw:
                for hops in sorted({c.hops for c in configs}):
                    if raw_unavailable(stack) is None:
                        raw[hops] = run_raw(args, stack, hops)
                        record.append({"kind": "raw", "run": run, **raw[hops]})
            results = []
            for cfg in configs:
                k = run_kvcs(args, stack, cfg)
                record.append({"kind": "kvcs", "run": run, **k})
                results.append((cfg, k))
                print(f"  {stack} {cfg.name}: {line(k)}", flush=True)
                runs.append((stack, cfg, k, raw, aio))
            print_run(args, stack, run, results, raw, aio, aio_reason)
            if args.raw and (why := raw_unavailable(stack)):
                print(f"raw pipeline skipped for {stack}: {why}")
    if args.repeat > 1:
        print_medians(args, stacks, configs, runs)
    write_json(args, record)
    return 0


def ok_rate(reference: dict[str, Any] | None) -> float | None:
    return reference.get("rate") if reference and reference.get("ok") else None


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def print_medians(
    args: argparse.Namespace,
    stacks: list[str],
    configs: list[Config],
    runs: list[tuple[str, Config, dict[str, Any], dict[int, dict[str, Any]], Any]],
) -> None:
    """One line per (stack, configuration) over the ``--repeat`` runs: each ratio is taken
    within its own run (kvcs against the references measured in that run), then the
    median of those ratios; this machine's references move by a third between runs."""
    rows: list[tuple[str, ...]] = [
        (
            "stack",
            "configuration",
            "bit-identical",
            "goodput (median)",
            "vs raw (median of per-run)",
            "vs aiomoqt (median)",
            "1st layer / total (median)",
        )
    ]
    for stack in stacks:
        for cfg in configs:
            mine = [(k, raw, aio) for s, c, k, raw, aio in runs if s == stack and c == cfg]
            good = [(k, raw, aio) for k, raw, aio in mine if k["ok"]]
            rates = [k["rate"] for k, _, _ in good if k.get("rate")]
            vs_raw = [
                r for k, raw, _ in good if (r := ratio(k.get("rate"), ok_rate(raw.get(cfg.hops))))
            ]
            vs_aio = [
                r
                for k, _, aio in good
                if cfg == Config(paced=False, live=True, hops=1)
                and (r := ratio(k.get("rate"), ok_rate(aio))) is not None
            ]
            firsts = [
                k["first"] / k["seconds"]
                for k, _, _ in good
                if cfg.paced and cfg.live and k.get("first") is not None and k.get("seconds")
            ]
            rows.append(
                (
                    stack,
                    cfg.name,
                    f"{len(good)}/{len(mine)}",
                    mbps(median(rates)),
                    "n/a (paced)"
                    if cfg.paced
                    else f"{fmt(median(vs_raw), '.2f', 'x')} ({len(vs_raw)} runs)",
                    f"{fmt(median(vs_aio), '.2f', 'x')} ({len(vs_aio)} runs)" if vs_aio else "",
                    f"{fmt(median(firsts), '.2f')} ({len(firsts)} runs)" if firsts else "",
                )
            )
    print(f"\n=== medians over {args.repeat} runs ===")
    table(rows)


def raw_unavailable(stack: str) -> str | None:
    """The raw pipeline drives the stack's sans-I/O connection; why it cannot, or ``None``."""
    try:
        s = load_stack(stack)
    except StackUnavailable as exc:
        return str(exc)
    if stack == "pquic":
        return None  # its own workers (_raw_pquic.py): aiopquic's asyncio API
    if not hasattr(s, "connection") or not hasattr(s, "datagrams_to_send"):
        return f"{stack} has no sans-I/O connection to drive"
    return None


def line(k: dict[str, Any]) -> str:
    if not k["ok"]:
        last = [x.strip() for x in str(k.get("detail") or "").splitlines() if x.strip()]
        said = f"; last line of its detail: {last[-1][:300]}" if last else ""
        return f"FAILED ({k.get('error')}){said}"
    first = "" if k.get("first") is None else f", 1st layer at {k['first']:.2f} s"
    return f"{mbps(k.get('rate'))} in {k['seconds']:.2f} s{first}, bit-identical"


def run_consecutive(args: argparse.Namespace, stacks: list[str], configs: list[Config]) -> int:
    n = args.runs_consecutive
    record: list[dict[str, Any]] = []
    summary: list[tuple[str, ...]] = [("stack", "configuration", "completed", "bit-identical")]
    all_ok = True
    for stack in stacks:
        for cfg in configs:
            completed = identical = 0
            for i in range(1, n + 1):
                k = run_kvcs(args, stack, cfg)
                record.append({"kind": "kvcs", "run": i, **k})
                completed += bool(k.get("complete"))
                identical += bool(k["ok"])
                print(f"  {stack} {cfg.name} {i}/{n}: {line(k)}", flush=True)
                write_json(args, record)  # so far: a run stopped early keeps every detail
            all_ok = all_ok and identical == n
            summary.append((stack, cfg.name, f"{completed}/{n}", f"{identical}/{n}"))
    print()
    table(summary)
    write_json(args, record)
    return 0 if all_ok else 1


def write_json(args: argparse.Namespace, record: list[dict[str, Any]]) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


def default_stacks() -> str:
    names = ["aioquic", "qh3"]
    if "pquic" in STACKS:
        with contextlib.suppress(Exception):
            load_stack("pquic")
            names.append("pquic")
    return ",".join(names)


def run_aiomoqt_through_kvcs(args: argparse.Namespace, stacks: list[str]) -> int:
    """#11's interop must-show: aiomoqt's publisher -> kvcs relay -> aiomoqt's subscriber,
    ``--aiomoqt-through-kvcs`` runs per stack, each complete and bit-identical or not."""
    why = aiomoqt_unavailable()
    if why is not None:
        print(f"aiomoqt through kvcs relay: not run: {why}")
        return 1
    _, _, nbytes = shape(args.mib, args.layers)
    failed = 0
    for stack in stacks:
        good, rates = 0, []
        for i in range(args.aiomoqt_through_kvcs):
            out = run_aiomoqt(args, via=stack)
            ok = bool(out.get("ok"))
            good += ok
            if ok:
                rates.append(nbytes / out["seconds"] / 1e6)
            else:
                print(f"  {stack} run {i + 1}: {out.get('error')}", flush=True)
        failed += args.aiomoqt_through_kvcs - good
        shown = ", ".join(f"{r:.1f}" for r in rates) or "-"
        print(
            f"aiomoqt pub -> kvcs relay ({stack}) -> aiomoqt sub, {nbytes / MIB:.0f} MiB: "
            f"{good}/{args.aiomoqt_through_kvcs} complete and bit-identical; MB/s {shown}",
            flush=True,
        )
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="cache size in MiB (default 256)")
    ap.add_argument("--layers", type=int, default=32, help="layers L (default 32)")
    ap.add_argument("--stacks", default=None, help="comma-separated (default aioquic,qh3"
                    "[,pquic where importable])")  # fmt: skip
    ap.add_argument("--configs", default="all", help="comma-separated names or patterns, "
                    "e.g. 'unpaced/*,paced/live/tree' (default all)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--layer-interval", type=float, default=0.05, help="paced: seconds per layer")
    ap.add_argument(
        "--timeout",
        type=float,
        help="seconds per transfer (default 300; with --runs-consecutive, kvcs fetch then "
        "keeps its own default --fetch-timeout)",
    )
    ap.add_argument("--datagram-size", type=int, help="max UDP payload (default: the stack's)")
    ap.add_argument("--no-raw", dest="raw", action="store_false", help="skip the raw pipeline")
    ap.add_argument("--no-aiomoqt", dest="aiomoqt", action="store_false",
                    help="skip the aiomoqt reference")  # fmt: skip
    ap.add_argument("--runs-consecutive", type=int, metavar="N",
                    help="each configuration N times (kvcs only): count the good runs")  # fmt: skip
    ap.add_argument("--json", metavar="FILE", help="write every run's figures here")
    ap.add_argument("--aiomoqt-through-kvcs", type=int, metavar="N",
                    help="only: aiomoqt's publisher and subscriber through kvcs relay, N runs "
                    "per stack; count those complete and bit-identical")  # fmt: skip
    # worker modes (this file started by itself)
    ap.add_argument("--worker", choices=("raw-send", "raw-fwd", "raw-recv", "aiomoqt"),
                    help=argparse.SUPPRESS)  # fmt: skip
    ap.add_argument("--stack", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--via", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.timeout_default = args.timeout is None
    if args.timeout is None:
        args.timeout = 300.0
    if args.worker in ("raw-send", "raw-recv", "raw-fwd") and args.stack == "pquic":
        import _raw_pquic  # noqa: PLC0415  (imports aiopquic: only where pquic is asked for)

        _raw_pquic.run(args.worker, args)
        return 0
    if args.worker == "raw-send":
        raw_sender(args)
        return 0
    if args.worker == "raw-recv":
        raw_receiver(args)
        return 0
    if args.worker == "raw-fwd":
        Forwarder(args).run()
        return 0
    if args.worker == "aiomoqt":
        aiomoqt_inside(args)
        return 0
    stacks = [s.strip() for s in (args.stacks or default_stacks()).split(",") if s.strip()]
    for s in stacks:
        if s not in STACKS:
            raise SystemExit(f"--stacks: {s!r} is not one of {', '.join(STACKS)}")
    configs = select_configs(args.configs)
    tokens, _, nbytes = shape(args.mib, args.layers)
    print(
        f"synthetic Llama-shaped cache: {args.layers} layers x 8 KV heads x 128, bfloat16, "
        f"{tokens} tokens = {nbytes / MIB:.0f} MiB of K/V in {nbytes // 32768} objects of "
        f"32 KiB; stacks {', '.join(stacks)}; {os.cpu_count()} CPUs; configurations: "
        f"{', '.join(c.name for c in configs)}",
        flush=True,
    )
    started = time.monotonic()
    if args.aiomoqt_through_kvcs:
        status = run_aiomoqt_through_kvcs(args, stacks)
    elif args.runs_consecutive:
        status = run_consecutive(args, stacks, configs)
    else:
        status = run_once(args, stacks, configs)
    print(f"\n{time.monotonic() - started:.0f} s in all")
    return status


if __name__ == "__main__":
    sys.exit(main())
