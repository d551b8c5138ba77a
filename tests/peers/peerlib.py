"""Run the peer scripts of tests/peers/ from Python: the harness selftest.py uses,
and the one interop tests can use (import it with tests/peers on sys.path).

    from peerlib import PeerSet, peers_missing, loopback_only

    reason = peers_missing()            # None, or why the .peers venv is unusable
    with PeerSet(tmpdir, port=4700) as ps:
        relay = ps.relay()              # aiomoqt relay on 127.0.0.1:4700 (waits for "ready")
        pub = ps.run("pub", "aiomoqt_pub.py", "--url", ps.url(), "--ns", "kvcs", ...)
        pub.wait_event("publish_namespace_ok", 10)
        sub = ps.run("sub", "aiomoqt_sub.py", "--url", ps.url(), "--ns", "kvcs", ...)
        assert sub.finish(20) == 0, sub.last("summary")
    # every child still running is stopped here by PID (SIGTERM, then SIGKILL)

Everything that starts aiomoqt (its relay, and its clients: aiopquic binds
wildcard UDP sockets) must run in a loopback-only network namespace: check
``loopback_only()``; from outside, re-run under ``unshare -n`` (root) and
``ip link set lo up`` first, as selftest.py does. Standard library only,
Python >= 3.11 (the project's python3), so pytest can import it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEERS_PY = ROOT / ".peers" / "bin" / "python"


def loopback_only() -> bool:
    """True inside a network namespace whose only interface is ``lo``."""
    return sorted(n for _, n in socket.if_nameindex()) == ["lo"]


def can_unshare() -> bool:
    """Whether this process could create a loopback-only namespace (root + unshare)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


_MISSING: list[str | None] = []


def peers_missing() -> str | None:
    """None when .peers/bin/python imports aiomoqt, moq and moq_core; else why not
    (a reason for pytest.skip). Cached."""
    if not _MISSING:
        if not PEERS_PY.exists():
            _MISSING.append(f"{PEERS_PY} missing: run scripts/install_peers.sh")
        else:
            r = subprocess.run([str(PEERS_PY), "-c", "import aiomoqt, moq, moq_core"],
                               check=False, capture_output=True, text=True, timeout=60)
            _MISSING.append(None if r.returncode == 0 else
                            f"peers do not import: {r.stderr.strip()[-300:]}")
    return _MISSING[0]


def has_crypto() -> bool:
    return importlib.util.find_spec("cryptography") is not None

class Proc:
    """A child peer script: JSON lines from its stdout are parsed as they come."""

    def __init__(self, name: str, argv: list[str], logdir: Path):
        self.name = name
        self.argv = argv
        self.events: list[dict[str, Any]] = []
        self.other: list[str] = []
        self.cond = threading.Condition()
        self.stderr = open(logdir / f"{name}.stderr", "wb")  # noqa: SIM115
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.stderr, cwd=ROOT)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            line = raw.decode(errors="replace").strip()
            try:
                ev = json.loads(line)
            except ValueError:
                with self.cond:
                    self.other.append(line)
                continue
            with self.cond:
                self.events.append(ev)
                self.cond.notify_all()

    def wait_event(self, name: str, timeout: float) -> dict[str, Any] | None:
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                for ev in self.events:
                    if ev.get("event") == name:
                        return ev
                left = end - time.monotonic()
                if left <= 0 or self.p.poll() is not None:
                    # one last look after the process ended
                    for ev in self.events:
                        if ev.get("event") == name:
                            return ev
                    return None
                self.cond.wait(min(left, 0.1))

    def finish(self, timeout: float) -> int | None:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def last(self, name: str) -> dict[str, Any] | None:
        with self.cond:
            for ev in reversed(self.events):
                if ev.get("event") == name:
                    return ev
        return None

    def stop(self) -> None:
        """Terminate by PID if still running; keep its JSON lines in NAME.jsonl."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(3)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(3)
        self.reader.join(2)
        self.stderr.close()
        with open(Path(self.stderr.name).with_suffix(".jsonl"), "w") as f:
            for ev in self.events:
                f.write(json.dumps(ev) + "\n")


class PeerSet:
    """The peer processes of one test; a context manager that stops them all.
    ``port`` is the default port of relay() / moqrs_server() / url()."""

    def __init__(self, tmp: Path, port: int, verbose: bool = False):
        self.tmp = Path(tmp)
        self.port = port
        self.verbose = verbose
        self.procs: list[Proc] = []
        self.notes: list[str] = []

    def url(self, port: int | None = None) -> str:
        return f"moqt://127.0.0.1:{port or self.port}"

    def run(self, name: str, script: str, *args: str) -> Proc:
        argv = [str(PEERS_PY), str(HERE / script), *args]
        if self.verbose:
            print("  $", " ".join(argv), file=sys.stderr)
        p = Proc(name, argv, self.tmp)
        self.procs.append(p)
        return p

    def relay(self, port: int | None = None, *extra: str) -> Proc:
        port = port or self.port
        r = self.run(f"relay{port}", "aiomoqt_relay.py", "--port", str(port), "--cert-dir",
                     str(self.tmp / "cert"), "--cert-python", sys.executable if has_crypto()
                     else "python3", "--timeout", "60", "--log",
                     str(self.tmp / f"relay{port}.log"), *extra)
        if r.wait_event("ready", 20) is None:
            raise RuntimeError(f"aiomoqt relay on {port} not ready: {r.events[-3:]}")
        return r

    def moqrs_server(self, port: int | None = None, *extra: str) -> Proc:
        port = port or self.port
        s = self.run(f"moqrs_server{port}", "moqrs_server.py", "--port", str(port),
                     "--timeout", "60", *extra)
        if s.wait_event("ready", 15) is None:
            raise RuntimeError(f"moq-rs server on {port} not ready: {s.events[-3:]}")
        return s

    def cleanup(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def __enter__(self) -> PeerSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def free_udp_port() -> int:
    """A UDP port free on 127.0.0.1 right now (call it inside the namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


