"""Peak memory of ``kvcs publish``, ``kvcs relay`` and ``kvcs fetch`` beside the cache size.

Run from the repository root::

    python3 benchmarks/bench_memory.py [--mib 64] [--stack aioquic] [--order late|live]
        [--out] [--synthetic] [--consumers N] [--timeout 300]

A synthetic Llama-shaped cache (``kvcs.adapters.cachefile.synthetic``: 32 layers, 8
KV heads, head_dim 128, bfloat16, 16-token blocks, 128 KiB of K+V per token) of
``--mib`` MiB is written to a temporary ``.npz`` file by a child process; then
three processes run the CLI on 127.0.0.1, as a user runs them:

* ``kvcs relay --listen 127.0.0.1:0 --self-signed --json``;
* ``kvcs publish URL --file CACHE.npz`` (``--synthetic``: the same cache made in
  the process instead of read from the file), serving until told to stop;
* ``kvcs fetch URL --file CACHE.npz`` (the prompt, and the bits it verifies
  the result against), ``--out`` also writing the result to a file.

``--order late`` (the default): the consumer starts once the producer reported
``published`` (the relay fetches the whole cache for it); ``live``: the consumer
starts as soon as the producer reported ``publishing``.

Peak RSS of each process is its ``VmHWM`` (``/proc/PID/status``: the high-water
mark of its resident set, start-up and imports included), read once the consumer
reported ``done`` (after its verification and ``--out``), with the processes still
running. (``os.wait4``'s ``ru_maxrss`` would carry this process's size at ``fork``
into the children's figures.) The line per process gives
the peak, the peak minus the cache size, the peak as a multiple of the
cache, and what is left beyond the cache and the peak of an idle ``kvcs relay``
(the interpreter and the imports, measured after the run). The goal (issue 11,
"Memory"): each process within the cache's size plus a fixed margin (64 MiB
beside an idle process's ~60-70 MiB of imports). ``--consumers N`` starts N
consumers at once (a relay fanning one cache out: what it holds per consumer).
Nothing is asserted; each consumer's result is checked (``complete`` and
``bit_identical``) and a failed run is marked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from kvcs.transports.quic.stack import DEFAULT_STACK

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
PER_TOKEN = 2 * 32 * 8 * 128 * 2
"""K+V octets per token of the synthetic cache (32 layers, 8 heads, 128, bfloat16)."""
SCOPE_HEX = "6b" * 32

_WRITE = """
import sys
from kvcs.adapters.cachefile import llama_descriptor, save, synthetic
save(sys.argv[1], synthetic(llama_descriptor(), int(sys.argv[2]), 1))
"""


class Proc:
    """``python -m kvcs.transports.cli ARGS``: stdout lines read without blocking, rusage kept."""

    def __init__(self, name: str, args: list[str], tmp: Path) -> None:
        self.name = name
        self.err_path = tmp / f"{name}.err"
        with self.err_path.open("wb") as err:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "kvcs", *args],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.out: IO[bytes] = self.p.stdout  # type: ignore[assignment]
        self.buf = b""
        self.lines: list[dict[str, Any]] = []
        self.maxrss: int | None = None
        self.status: int | None = None

    def mark_peak(self) -> None:
        """Its VmHWM so far (Linux), while it runs."""
        with contextlib.suppress(OSError, StopIteration, ValueError):
            text = Path(f"/proc/{self.p.pid}/status").read_text()
            line = next(x for x in text.splitlines() if x.startswith("VmHWM:"))
            self.maxrss = int(line.split()[1]) * 1024

    def pump(self, wait: float = 0.0) -> None:
        if self.out.closed:
            return
        ready, _, _ = select.select([self.out], [], [], wait)
        if not ready:
            return
        chunk = os.read(self.out.fileno(), 65536)
        if not chunk:
            self.out.close()
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for ln in lines:
            with contextlib.suppress(ValueError):
                self.lines.append(json.loads(ln))

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.lines if e.get("event") == name), None)

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.05)
            found = self.event(name)
            if found is not None:
                return found
            if self.poll():
                self.pump(0.0)
                found = self.event(name)
                if found is not None:
                    return found
                raise RuntimeError(f"{self.name} exited ({self.status}): {self.err_tail()}")
        raise RuntimeError(f"no {name!r} from {self.name} within {timeout} s: {self.err_tail()}")

    def poll(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.p.pid, os.WNOHANG)
            if pid:
                self._reaped(status)
        return self.status is not None

    def _reaped(self, status: int) -> None:
        self.status = os.waitstatus_to_exitcode(status)
        self.p.returncode = self.status  # Popen must not wait for it again

    def stop(self, timeout: float) -> None:
        """SIGTERM (a clean exit), SIGKILL after ``timeout``; reaped here."""
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while not self.poll():
            self.pump(0.05)
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.p.pid, signal.SIGKILL)
                _, status = os.waitpid(self.p.pid, 0)
                self._reaped(status)
        with contextlib.suppress(OSError):
            self.out.close()

    def err_tail(self) -> str:
        return self.err_path.read_text(errors="replace")[-1500:]


def run(args: argparse.Namespace, tmp: Path) -> int:
    tokens = max(16, args.mib * MIB // PER_TOKEN // 16 * 16)
    cache = tokens * PER_TOKEN
    path = tmp / "cache.npz"
    subprocess.run(
        [sys.executable, "-c", _WRITE, str(path), str(tokens)], cwd=ROOT, check=True, timeout=300
    )
    transport = ["--stack", args.stack]
    src = (
        ["--synthetic", "--tokens", str(tokens), "--seed", "1"]
        if args.synthetic
        else ["--file", str(path)]
    )
    procs: list[Proc] = []
    try:
        relay = Proc(
            "relay",
            ["relay", "--listen", "127.0.0.1:0", "--self-signed", "--json", *transport],
            tmp,
        )
        procs.append(relay)
        url = relay.wait_event("listening", 60)["url"]
        common = ["-k", "--scope-key", SCOPE_HEX, "--json", *transport]
        pub = Proc("producer", ["publish", url, *src, *common, "--serve-for", "3600"], tmp)
        procs.append(pub)
        pub.wait_event("publishing", args.timeout)
        if args.order == "late":
            pub.wait_event("published", args.timeout)
        out = ["--out", str(tmp / "result.npz")] if args.out else []
        fetches = []
        for i in range(args.consumers):
            fetch = Proc(
                "consumer" if i == 0 else f"consumer{i + 1}",
                ["fetch", url, "--file", str(path), *common, "--fetch-timeout",
                 str(args.timeout), *out],
                tmp,
            )  # fmt: skip
            procs.append(fetch)
            fetches.append(fetch)
        dones = wait_done(fetches, args.timeout + 30)
        for p in (pub, relay):
            p.mark_peak()
        for p in (*fetches, pub, relay):
            p.stop(60)
        ok = all(bool(d.get("complete")) and d.get("bit_identical") is True for d in dones)
        base = idle(args, tmp)
        print(
            f"cache {cache / MIB:.0f} MiB ({tokens} tokens, 32 layers, {args.stack}, "
            f"{args.order} consumer{'s' if args.consumers > 1 else ''}"
            f"{f' x{args.consumers}' if args.consumers > 1 else ''}"
            f"{', --out' if args.out else ''}"
            f"{', --synthetic producer' if args.synthetic else ''}): "
            + ("complete, bit-identical" if ok else f"FAILED: {dones}")
        )
        for p in (pub, relay, *fetches):
            assert p.maxrss is not None
            print(
                f"  {p.name:<9} peak RSS {p.maxrss / MIB:7.1f} MiB   "
                f"cache + {(p.maxrss - cache) / MIB:6.1f} MiB   {p.maxrss / cache:5.2f}x cache   "
                f"beyond cache and idle: {(p.maxrss - cache - base) / MIB:5.1f} MiB (goal 64)"
            )
        print(f"  (an idle kvcs relay, the interpreter and the imports: {base / MIB:.1f} MiB)")
        return 0 if ok else 1
    finally:
        for p in procs:
            p.stop(10)


def wait_done(fetches: list[Proc], timeout: float) -> list[dict[str, Any]]:
    """Every consumer's ``done`` event, each one's peak read while it still runs (a
    consumer exits soon after its ``done``)."""
    dones: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(dones) < len(fetches):
        if time.monotonic() > deadline:
            missing = len(fetches) - len(dones)
            raise RuntimeError(f"no 'done' from {missing} consumers in {timeout} s")
        for i, f in enumerate(fetches):
            if i in dones:
                continue
            f.mark_peak()
            f.pump(0.02)
            done = f.event("done")
            if done is not None:
                f.mark_peak()
                dones[i] = done
            elif f.poll():
                f.pump(0.0)
                if f.event("done") is None:
                    raise RuntimeError(f"{f.name} exited ({f.status}): {f.err_tail()}")
    return [dones[i] for i in range(len(fetches))]


def idle(args: argparse.Namespace, tmp: Path) -> int:
    """The peak of a relay that serves nothing: the interpreter and the imports."""
    p = Proc("idle", ["relay", "--listen", "127.0.0.1:0", "--self-signed", "--json",
                      "--stack", args.stack], tmp)  # fmt: skip
    try:
        p.wait_event("listening", 60)
        p.mark_peak()
    finally:
        p.stop(10)
    assert p.maxrss is not None
    return p.maxrss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="cache size (default 64)")
    ap.add_argument("--stack", default=DEFAULT_STACK, help=f"QUIC stack (default {DEFAULT_STACK})")
    ap.add_argument("--order", choices=("late", "live"), default="late")
    ap.add_argument("--out", action="store_true", help="the consumer also writes --out")
    ap.add_argument("--synthetic", action="store_true", help="the producer makes the cache")
    ap.add_argument("--timeout", type=float, default=300.0, metavar="S")
    ap.add_argument("--consumers", type=int, default=1, help="consumers at once (default 1)")
    args = ap.parse_args()
    if args.consumers < 1:
        ap.error("--consumers: at least 1")
    with tempfile.TemporaryDirectory(prefix="kvcs-bench-mem-") as d:
        status = run(args, Path(d))
    sys.exit(status)


if __name__ == "__main__":
    main()
