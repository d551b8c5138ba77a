"""A child process whose stdout goes to a file, read back as JSON lines (tests/vllm and
``benchmarks/bench_vllm_ttft.py``).

Engines and relays print a lot (vLLM logs to stdout, ``kvcs relay --json`` a stats line
every interval); a pipe nobody reads fills up and stalls the process that writes to it,
so stdout goes to a file, which :meth:`Proc.wait_event` polls. :meth:`Proc.stop` closes
stdin (the processes here stop on that), then waits, then kills by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]


class Proc:
    """A child process whose stdout goes to a file (never a pipe that could fill up and
    stall it), read back line by line (JSON lines are parsed)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._out: IO[bytes] = log.open("wb")
        self._err: IO[bytes] = log.with_suffix(".err").open("wb")
        self.p = subprocess.Popen(
            args,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=self._out,
            stderr=self._err,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
        self._read = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> None:
        with self.log.open("rb") as f:
            f.seek(self._read)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._read += end
        for line in data[:end].decode(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    self.events.append(json.loads(line))

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            for e in self.events:
                if e.get("event") == name:
                    return e
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.poll()
                err = self.log.with_suffix(".err").read_text(errors="replace")[-3000:]
                raise AssertionError(f"no {name!r} from {self.p.args!r}; stderr:\n{err}")
            time.sleep(0.1)

    def send(self, line: bytes) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line)
        self.p.stdin.flush()

    def stop(self, grace: float = 20.0) -> None:
        """Close stdin and wait ``grace`` s; then SIGTERM (``kvcs relay`` stops on it), and
        SIGKILL if that does not end it within 10 s. By PID, always."""
        if self.p.poll() is None:
            with contextlib.suppress(Exception):
                assert self.p.stdin is not None
                self.p.stdin.close()
            for signal_it, wait in ((None, grace), (self.p.terminate, 10.0), (self.p.kill, 10.0)):
                if signal_it is not None:
                    signal_it()
                try:
                    self.p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._out.close()
        self._err.close()
