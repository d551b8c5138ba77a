"""The UDP path's gain: Linux UDP GSO/GRO, in Python or in qh3's native batches, against
one system call per datagram.

Run from the repository root::

    python3 benchmarks/bench_udp_path.py [--mib M] [--udp-sizes 1200,1452]
        [--stacks aioquic,qh3] [--datagram-sizes default] [--repeat R] [--skip-quic]

Two parts, each figure printed beside its reference measured in the same run
(the same path with ``KVCS_UDP_GSO=0``, see :mod:`kvcs.transports.quic.udp`), three
paths each: *off* (one ``sendto`` / ``recvfrom`` per datagram), *GSO* (the Python
path: GSO runs planned in Python, GRO buffers split in Python; ``KVCS_UDP_NATIVE=0``)
and *native* (:class:`~kvcs.transports.quic.udp.NativeUdpSocket`: qh3's quinn-udp
batches, what :func:`~kvcs.transports.quic.udp.open_udp` gives by default):

* **raw UDP** over 127.0.0.1, per datagram size (``--udp-sizes``): a sender
  process writes ``--mib`` MiB in flushes of :data:`FLUSH` datagrams through
  the path's socket (with GSO: runs of up to 64 in one ``sendmsg``; without: one
  ``sendto`` each) to a receiver process reading with its ``recv_batch`` (with
  GRO: coalesced buffers split; without: one ``recvfrom`` each). The receiver acknowledges
  every 128 KiB and the sender keeps at most :data:`WINDOW` bytes
  unacknowledged, so the receive buffer never overflows and what is measured
  is delivered data: datagrams/s and MB/s (10**6 bytes) of the receiver's
  clock from its first datagram to its last, the datagrams lost, the send and
  receive system calls per datagram (the sockets' counters), and each
  process's CPU seconds.
* **QUIC through kvcs**, per stack and datagram size: the transfers of
  ``benchmarks/bench_quic_transfer.py`` (a relay, a producer and a consumer
  as three processes; and the same bytes over one raw QUIC connection of the
  same stack, two processes, on the same batched UDP socket), once per path,
  the environment inherited by every process: goodput, and CPU seconds of the
  relay (which sends and receives every byte) and of the other processes.

Every QUIC transfer is checked (SHA-256 of what arrived against what was
sent); a mismatch marks the row FAILED. No figure is asserted. On a shared
machine the goodputs move with the other load; the CPU seconds and system
calls per datagram much less.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import select
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_quic_transfer as bqt  # noqa: E402

from kvcs.transports.quic.udp import (  # noqa: E402
    GSO_ENV,
    NATIVE_ENV,
    NativeUdpSocket,
    UdpSocket,
    open_udp,
)

MIB = 1 << 20
FLUSH = 64
"""Datagrams handed to the socket per call (a QUIC endpoint's flush is of this order)."""
WINDOW = 1 << 20
"""Bytes the raw UDP sender keeps unacknowledged at most."""
ACK_EVERY = 128 * 1024
IDLE = 1.0
"""Seconds without a datagram after which the raw UDP receiver stops."""
PATHS = ("off", "gso", "native")
"""One datagram per call; GSO/GRO in Python; qh3's native batches (module docstring)."""
ENV = {"off": ("0", "0"), "gso": ("1", "0"), "native": ("1", "1")}
"""(KVCS_UDP_GSO, KVCS_UDP_NATIVE) per path."""


def path_socket(path: str, *, send: bool) -> UdpSocket:
    if path == "native":
        return NativeUdpSocket("127.0.0.1", 0)
    on = path == "gso"
    return UdpSocket("127.0.0.1", 0, gso=on and send, gro=on and not send)


def cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# --- raw UDP -----------------------------------------------------------------------------------


def udp_receiver(pipe: Connection, nbytes: int, path: str) -> None:
    rx = path_socket(path, send=False)
    pipe.send(rx.address[1])
    total = count = 0
    t_first = t_last = 0.0
    cpu0 = 0.0
    next_ack = ACK_EVERY
    peer: Any = None
    while total < nbytes:
        if not select.select([rx.sock], [], [], IDLE)[0]:
            break
        for data, addr in rx.recv_batch():
            if not count:
                t_first, cpu0 = time.perf_counter(), cpu_self()
            total += len(data)
            count += 1
            peer = addr
        t_last = time.perf_counter()
        if peer is not None and (total >= next_ack or total >= nbytes):
            rx.sock.sendto(total.to_bytes(8, "big"), peer)
            next_ack = total + ACK_EVERY
    cpu = cpu_self() - cpu0
    pipe.send(
        {"bytes": total, "count": count, "seconds": t_last - t_first, "cpu": cpu, **rx.stats()}
    )
    rx.close()


def udp_once(size: int, nbytes: int, path: str) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=udp_receiver, args=(theirs, nbytes, path), daemon=True)
    proc.start()
    try:
        if not ours.poll(30):
            raise RuntimeError("the UDP receiver did not start")
        dest = ("127.0.0.1", int(ours.recv()))
        tx = path_socket(path, send=True)
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        total = nbytes // size
        flush = [(payload, dest)] * FLUSH
        sent = acked = stalls = 0
        cpu0 = cpu_self()
        while sent < total:
            while (sent - acked) * size > WINDOW:
                if not select.select([tx.sock], [], [], 0.5)[0]:
                    stalls += 1  # lost datagrams: stop waiting for their acknowledgement
                    acked = sent
                    break
                for data, _ in tx.recv_batch():
                    acked = max(acked, int.from_bytes(data[:8], "big") // size)
            batch = flush[: min(FLUSH, total - sent)]
            sent += len(batch)
            while tx.send_batch(batch):
                batch = []
                select.select([], [tx.sock], [], 1.0)
        send_cpu = cpu_self() - cpu0
        if not ours.poll(IDLE + 30):
            raise RuntimeError("the UDP receiver did not report")
        got: dict[str, Any] = ours.recv()
        got.update(
            sent=total,
            send_cpu=send_cpu,
            send_calls=tx.send_calls,
            gso_runs=tx.gso_runs,
            gso=tx.gso,
            stalls=stalls,
        )
        tx.close()
        return got
    finally:
        proc.join(IDLE + 5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def udp_part(args: argparse.Namespace) -> None:
    nbytes = args.mib * MIB
    print(f"\n== raw UDP over 127.0.0.1: {args.mib} MiB per transfer, flushes of {FLUSH} ==")
    rows: list[tuple[str, ...]] = [
        (
            "datagram",
            "path",
            "datagrams/s",
            "MB/s",
            "vs off",
            "lost",
            "sends/dgram",
            "recvs/dgram",
            "send CPU s",
            "recv CPU s",
        )
    ]
    for size in args.udp_sizes:
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeat):
            for path in args.paths:
                r = udp_once(size, nbytes, path)
                r["rate"] = r["bytes"] / r["seconds"] if r["seconds"] > 0 else 0.0
                if path not in best or r["rate"] > best[path]["rate"]:
                    best[path] = r
        off = best.get("off", {"rate": 0.0})
        for path in args.paths:
            r = best[path]
            if path == "native":
                label = "native (qh3 quinn-udp)"
            elif path == "gso" and not r["gso"]:
                label = "GSO refused (fallback)"
            elif path == "gso":
                label = "GSO+GRO (Python)" if r["gro"] else "GSO (Python)"
            else:
                label = "off (sendto/recvfrom)"
            rows.append(
                (
                    f"{size} B",
                    label,
                    f"{r['count'] / r['seconds']:,.0f}" if r["seconds"] > 0 else "-",
                    f"{r['rate'] / 1e6:.1f}",
                    f"{r['rate'] / off['rate']:.2f}x" if off["rate"] else "-",
                    f"{r['sent'] - r['count']}",
                    f"{r['send_calls'] / r['sent']:.3f}",
                    f"{r['recv_calls'] / max(1, r['count']):.3f}",
                    f"{r['send_cpu']:.2f}",
                    f"{r['cpu']:.2f}",
                )
            )
    bqt.table(rows)


# --- QUIC through kvcs ---------------------------------------------------------------------------


def with_path(path: str, job: Any, *a: Any) -> Any:
    before = {name: os.environ.get(name) for name in (GSO_ENV, NATIVE_ENV)}
    os.environ[GSO_ENV], os.environ[NATIVE_ENV] = ENV[path]
    try:
        return job(*a)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def quic_part(args: argparse.Namespace) -> None:
    nbytes = bqt.cache_bytes(args.mib)
    print(
        f"\n== QUIC: {nbytes / MIB:.0f} MiB cache, bench_quic_transfer's transfers"
        f" ({GSO_ENV}=0 is the reference) =="
    )
    ns = argparse.Namespace(mib=args.mib, timeout=args.timeout, start="subscribed", profile=[])
    rows: list[tuple[str, ...]] = [
        (
            "stack",
            "datagram",
            "transfer",
            "UDP path",
            "goodput",
            "vs off",
            "CPU s per process",
            "checked",
        )
    ]
    for stack in args.stacks:
        for dgram in args.datagram_sizes:
            size = f"{dgram or bqt.default_datagram_size(stack)} B"
            for path, job in (("kvcs", bqt.run_kvcs), ("raw", bqt.run_raw)):
                best: dict[str, dict[str, Any]] = {}
                for _ in range(args.repeat):
                    for udp_path in args.paths:
                        r = with_path(udp_path, job, ns, stack, dgram, None)
                        r["rate"] = nbytes / r["seconds"]
                        cpu = ", ".join(
                            f"{p.name} {bqt.fmt(p.transfer_cpu, '.2f')}" for p in r["procs"]
                        )
                        print(
                            f"  {stack} {size} {path} UDP {udp_path}:"
                            f" {r['rate'] / 1e6:.1f} MB/s, CPU s {cpu}, {r['drops']} UDP drops"
                            f"{'' if r['ok'] else ', FAILED'}",
                            flush=True,
                        )
                        if udp_path not in best or r["rate"] > best[udp_path]["rate"]:
                            best[udp_path] = r
                off_rate = best["off"]["rate"] if "off" in best else 0.0
                for udp_path in args.paths:
                    r = best[udp_path]
                    rows.append(
                        (
                            stack,
                            size,
                            path,
                            udp_path,
                            f"{r['rate'] / 1e6:.1f} MB/s",
                            f"{r['rate'] / off_rate:.2f}x" if off_rate else "-",
                            " ".join(
                                f"{p.name}={bqt.fmt(p.transfer_cpu, '.2f')}" for p in r["procs"]
                            ),
                            "ok" if r["ok"] else "FAILED",
                        )
                    )
    bqt.table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=32, help="MiB per transfer (default 32)")
    ap.add_argument("--udp-sizes", default="1200,1452", help="raw UDP datagram sizes")
    ap.add_argument(
        "--stacks", default="qh3,aioquic", help="comma-separated QUIC stacks (default stack first)"
    )
    ap.add_argument(
        "--datagram-sizes",
        default="default",
        help="QUIC max_datagram_size values ('default': the stack's own), comma-separated",
    )
    ap.add_argument("--repeat", type=int, default=1, help="best of R per figure")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per QUIC transfer")
    ap.add_argument("--skip-quic", action="store_true", help="the raw UDP part only")
    ap.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"UDP paths, comma-separated (default {','.join(PATHS)})",
    )
    args = ap.parse_args()
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not args.paths or any(p not in PATHS for p in args.paths):
        ap.error(f"--paths takes some of {', '.join(PATHS)}")
    args.udp_sizes = [int(s) for s in args.udp_sizes.split(",") if s.strip()]
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    args.datagram_sizes = [
        None if s.strip() == "default" else int(s)
        for s in args.datagram_sizes.split(",")
        if s.strip()
    ]
    probe = UdpSocket("127.0.0.1", 0, gso=True, gro=True)
    load = os.getloadavg()
    print(
        f"UDP GSO {'available' if probe.gso else 'unavailable'}, GRO"
        f" {'available' if probe.gro else 'unavailable'} on this kernel ({os.uname().release});"
        f" {os.cpu_count()} CPUs, load average {load[0]:.2f}; best of {args.repeat}"
    )
    probe.close()
    native = open_udp("127.0.0.1", 0)
    if "native" in args.paths and not isinstance(native, NativeUdpSocket):
        print("qh3's native UDP batches are not available here: that path is skipped")
        args.paths = [p for p in args.paths if p != "native"]
    native.close()
    started = time.monotonic()
    udp_part(args)
    if not args.skip_quic:
        quic_part(args)
    print(f"\n{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
