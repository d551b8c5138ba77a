"""Peak memory of ``kvcs publish`` and ``kvcs fetch`` processes (issue 11, "Memory").

A 32 MiB cache file goes producer -> relay -> consumer over real QUIC on
127.0.0.1, each in its own process; each process's peak resident set (``VmHWM``
in ``/proc/PID/status``, read while it runs: ``ru_maxrss`` would carry this
test process's own size into its children) must stay within the cache's size
plus a fixed margin above an idle ``kvcs`` process (the interpreter and the
imports). Before
the fix the producer held the file's arrays beside its gathered sections and the
consumer the source beside its destination: about twice the cache each. No time
is asserted; every wait has a deadline and every process is stopped by its PID.
(The relay's own figure is printed, not asserted: the relay core is measured by
``benchmarks/bench_memory.py``.)
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcs.adapters.cachefile import llama_descriptor, save, synthetic

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
TOKENS = 512
"""32 layers x 8 heads x 128, bfloat16: 128 KiB per token, 64 MiB in all."""
CACHE_BYTES = TOKENS * 2 * 32 * 8 * 128 * 2
MARGIN = 56 * MIB
"""Allowed above an idle process plus the cache, a fixed margin (#11 allows 64 MiB):
per-Object bookkeeping, QUIC buffers, one layer in flight, the allocator's slack
(measured 20-30 MiB on Python 3.11 at 32 to 256 MiB caches, 43 MiB once on 3.13 in a
full CI run). A second copy of the cache (64 MiB) is beyond it."""
SCOPE = "3c" * 32
TIMEOUT = 240.0

try:
    import qh3  # noqa: F401

    STACK = "qh3"  # the faster stack: the test runs in seconds
except ImportError:  # pragma: no cover - qh3 is a test dependency
    STACK = "aioquic"


class Proc:
    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.name = name
        self.err = tmp / f"{name}.err"
        with self.err.open("wb") as err:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "kvcs", *args],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.lines: list[dict[str, Any]] = []
        self.buf = b""
        self.peak: int | None = None
        self.status: int | None = None

    def mark_peak(self) -> int:
        """The process's peak resident set so far (its VmHWM), while it runs."""
        status = Path(f"/proc/{self.p.pid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith("VmHWM:"))
        self.peak = int(line.split()[1]) * 1024
        return self.peak

    def wait_event(self, event: str, timeout: float) -> dict[str, Any]:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if line.get("event") == event:
                    return line
            ready, _, _ = select.select([self.p.stdout], [], [], 0.1)
            if ready:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                if not chunk:
                    break
                self.buf += chunk
                *done, self.buf = self.buf.split(b"\n")
                for raw in done:
                    with contextlib.suppress(ValueError):
                        self.lines.append(json.loads(raw))
        raise AssertionError(f"no {event!r} from {self.name}: {self.err.read_text()[-2000:]}")

    def stop(self, timeout: float = 30.0, *, signal_first: bool = True) -> None:
        """SIGTERM (unless it ends by itself), SIGKILL after ``timeout``."""
        if self.status is not None:
            return
        if signal_first:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.p.pid, signal.SIGKILL)
                _, status = os.waitpid(self.p.pid, 0)
                break
            time.sleep(0.05)
        self.status = os.waitstatus_to_exitcode(status)
        self.p.returncode = self.status
        if self.p.stdout is not None:
            self.p.stdout.close()


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB and /proc: Linux")
def test_publish_and_fetch_hold_the_cache_once(tmp_path: Path) -> None:
    path = tmp_path / "cache.npz"
    save(path, synthetic(llama_descriptor(), TOKENS, 4))  # (this process's memory: not measured)
    procs: list[Proc] = []
    try:
        idle = Proc(tmp_path, "idle", "relay", "--listen", "127.0.0.1:0", "--self-signed",
                    "--json", "--stack", STACK)  # fmt: skip
        procs.append(idle)
        idle.wait_event("listening", 60)
        idle.mark_peak()
        idle.stop()
        relay = Proc(tmp_path, "relay", "relay", "--listen", "127.0.0.1:0", "--self-signed",
                     "--json", "--stack", STACK)  # fmt: skip
        procs.append(relay)
        url = relay.wait_event("listening", 60)["url"]
        common = ["-k", "--scope-key", SCOPE, "--json", "--stack", STACK, "--file", str(path)]
        pub = Proc(tmp_path, "producer", "publish", url, *common, "--serve-for", "600")
        procs.append(pub)
        pub.wait_event("published", TIMEOUT)
        out = tmp_path / "out.safetensors"
        fetch = Proc(tmp_path, "consumer", "fetch", url, *common, "--out", str(out),
                     "--fetch-timeout", str(TIMEOUT))  # fmt: skip
        procs.append(fetch)
        done = fetch.wait_event("done", TIMEOUT + 30)  # after its verification and --out
        fetch.mark_peak()
        pub.mark_peak()
        relay.mark_peak()
        assert done["complete"] is True and done["bit_identical"] is True, done
        fetch.stop(60, signal_first=False)  # it exits once done
        for p in (pub, relay):
            p.stop()
        assert fetch.status == 0 and pub.status == 0, (fetch.status, pub.status)
    finally:
        for p in procs:
            p.stop(10)
    assert idle.peak is not None and pub.peak is not None and fetch.peak is not None
    figures = {p.name: round((p.peak or 0) / MIB, 1) for p in (idle, pub, relay, fetch)}
    print(f"peak RSS (MiB) of a {CACHE_BYTES / MIB:.0f} MiB cache: {figures}")
    limit = idle.peak + CACHE_BYTES + MARGIN
    assert pub.peak < limit, (figures, limit / MIB)
    assert fetch.peak < limit, (figures, limit / MIB)
    assert out.stat().st_size > CACHE_BYTES  # written (layer by layer) from the destination
