"""The ``kvcs`` command's lifecycle over real QUIC on 127.0.0.1, each role its own process.

Exit statuses and one-line errors on trio (strict exception groups), Ctrl-C (SIGINT)
on trio, a publisher that stays up while idle, a wrong ``--upstream-ca``, the
temporary certificates of ``--self-signed``, ``-v`` after the subcommand, a server
that closes the session right after SETUP, and ``--fetch-timeout`` bounding a
retrieval whose layers never come. Every process is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cli_processes import (
    CACHE,
    START_TIMEOUT,
    Procs,
    fetch_args,
    free_udp_port,
    json_lines,
    kvcs,
    one_error_line,
    read_event,
    read_line,
)
from test_lifecycle import _closing_server

from kvcs.transports.quic import asyncio_binding
from kvcs.transports.quic.tls import self_signed


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.kill_all()


_WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'kvcs'; runpy.run_module('kvcs.transports.cli', run_name='__main__')"
)
"""``python -m kvcs.transports.cli`` with SIGINT handled as at a terminal (a process started
from a non-interactive shell's background job inherits SIGINT ignored)."""


def _start_default_signals(procs: Procs, name: str, *args: str) -> subprocess.Popen[str]:
    """As ``procs.start``, with Ctrl-C (SIGINT) working in the child."""
    err = (procs.tmp / f"{name}.err").open("w")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WITH_CTRL_C, *args],
            cwd=Path(__file__).resolve().parents[2],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    finally:
        err.close()
    procs.running.append((name, proc))
    return proc


# --- trio: one line, the documented status ------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "fetch"])
def test_unreachable_relay_on_trio_exits_3_with_one_line(command: str) -> None:
    port = free_udp_port()
    cache = [] if command == "ls" else [*CACHE]
    r = kvcs(
        command, f"moqt://127.0.0.1:{port}", "-k", *cache, "--timeout", "1", "--loop", "trio",
        timeout=30,
    )  # fmt: skip
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert f"127.0.0.1:{port}" in one_error_line(r.stderr)


def test_client_distrusting_the_relay_on_trio_exits_4(procs: Procs, tmp_path: Path) -> None:
    _, url, _ = procs.relay("relay")
    other = self_signed(tmp_path / "other")
    assert other.cafile is not None
    r = kvcs("ls", url, "--ca", other.cafile, "--timeout", "10", "--loop", "trio", timeout=30)
    assert r.returncode == 4, (r.returncode, r.stderr)
    assert "certificate" in one_error_line(r.stderr)


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_ctrl_c_ends_relay_and_fetch_with_130(procs: Procs, loop: str) -> None:
    relay = _start_default_signals(
        procs, "relay", "-v", "relay", "--listen", "127.0.0.1:0", "--self-signed", "--json",
        "--loop", loop,
    )  # fmt: skip
    url = json.loads(read_line(relay, START_TIMEOUT, "the relay's 'listening' line"))["url"]
    # a fetch that waits (nothing is published): interrupted while it runs
    fetch = _start_default_signals(
        procs, "fetch", *fetch_args(url, "-k", "--loop", loop, "--stall-timeout", "60")
    )
    deadline = time.monotonic() + START_TIMEOUT
    while not re.search(r"relay: [1-9]\d* connections", procs.stderr("relay")):
        assert time.monotonic() < deadline, "the fetch never connected"
        assert fetch.poll() is None, procs.stderr("fetch")
        time.sleep(0.05)
    for name, proc in (("fetch", fetch), ("relay", relay)):
        assert proc.poll() is None, (name, procs.stderr(name))
        proc.send_signal(signal.SIGINT)
        procs.finish(proc, timeout=20)
        err = procs.stderr(name)
        assert proc.returncode == 130, (name, proc.returncode, err)
        assert "Traceback" not in err and "ExceptionGroup" not in err, err
        assert "interrupted" in err, err


# --- idle sessions ------------------------------------------------------------------------


def test_idle_publisher_keeps_serving(procs: Procs) -> None:
    """``kvcs publish`` with no consumer, quiet for three idle timeouts: still serving,
    and a late ``kvcs fetch`` gets the cache bit for bit."""
    idle = ["--idle-timeout", "1"]
    relay, url, _ = procs.relay("relay", *idle)
    pub = procs.start("publisher", "publish", url, "-k", *CACHE, "--json", *idle)
    assert json.loads(read_line(pub, START_TIMEOUT, "the 'publishing' line"))["event"] == (
        "publishing"
    )
    published = read_event(pub, "published", START_TIMEOUT)
    assert published["event"] == "published"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:  # the idle period itself
        assert pub.poll() is None, procs.stderr("publisher")
        time.sleep(0.1)
    late = procs.start("fetch", *fetch_args(url, "-k", *idle))
    out = procs.finish(late)
    done = [d for d in json_lines(out) if d.get("event") == "done"]
    assert late.returncode == 0 and done and done[0]["bit_identical"] is True, (
        out,
        procs.stderr("fetch"),
    )
    assert pub.poll() is None, procs.stderr("publisher")
    for p in (pub, relay):
        p.send_signal(signal.SIGTERM)
        procs.finish(p, timeout=15)
        assert p.returncode == 0


# --- relay options ------------------------------------------------------------------------


def test_wrong_upstream_ca_exits_4(procs: Procs, tmp_path: Path) -> None:
    _, root, _ = procs.relay("root")
    other = self_signed(tmp_path / "other")
    assert other.cafile is not None
    r = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--self-signed", "--upstream", root,
        "--upstream-ca", other.cafile, "--run-for", "1", timeout=60,
    )  # fmt: skip
    assert r.returncode == 4, (r.returncode, r.stderr)
    line = one_error_line(r.stderr)
    assert "certificate" in line and "cannot listen" not in line, line


def test_self_signed_temporary_certificates_are_removed(tmp_path: Path) -> None:
    r = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--self-signed", "--json", "--run-for", "0.5",
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    ca = Path(json_lines(r.stdout)[0]["ca"])
    assert not ca.parent.exists(), f"{ca.parent} (a private key) was left behind"
    kept = tmp_path / "certs"
    r = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--self-signed", "--cert-dir", str(kept),
        "--run-for", "0.5", timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    key = kept / "key.pem"
    assert key.is_file() and (kept / "cert.pem").is_file()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_verbose_after_the_subcommand() -> None:
    r = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--self-signed", "--run-for", "1.5", "-v",
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "INFO" in r.stderr and re.search(r"relay: \d+ connections", r.stderr), r.stderr


# --- a session closed during setup; --fetch-timeout ----------------------------------------


@pytest.fixture
def closing_server(tmp_path: Path) -> Iterator[str]:
    """A QUIC server (in a thread of this process) that closes every MOQT session right
    after SETUP; its URL."""
    tls = self_signed(tmp_path / "tls")
    box: dict[str, Any] = {}
    ready = threading.Event()

    async def serve() -> None:
        stop = asyncio.Event()
        box["stop"] = (asyncio.get_running_loop(), stop)
        async with _closing_server(asyncio_binding, tls) as url:
            box["url"] = url
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(START_TIMEOUT)
    try:
        yield str(box["url"])
    finally:
        loop, stop = box["stop"]
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
@pytest.mark.parametrize("command", ["ls", "fetch"])
def test_session_closed_during_setup_exits_3_with_the_reason(
    closing_server: str, command: str, loop: str
) -> None:
    cache = [] if command == "ls" else [*CACHE, "--fetch-timeout", "5"]
    t0 = time.monotonic()
    r = kvcs(command, closing_server, "-k", *cache, "--loop", loop, timeout=60)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "refused for the test" in one_error_line(r.stderr)
    assert time.monotonic() - t0 < 30


def test_fetch_timeout_bounds_a_retrieval_whose_layers_never_come(procs: Procs) -> None:
    _, url, _ = procs.relay("relay")
    pub = procs.start(
        "publisher", "publish", url, "-k", *CACHE, "--layer-interval", "600", "--json"
    )  # layer 0, then nothing for ten minutes
    assert json.loads(read_line(pub, START_TIMEOUT, "the 'publishing' line"))["event"] == (
        "publishing"
    )
    t0 = time.monotonic()
    fetch = procs.start(
        "fetch", "fetch", url, "-k", *CACHE, "--json", "--fetch-timeout", "4",
        "--stall-timeout", "300",
    )  # fmt: skip
    procs.finish(fetch, timeout=60)
    took = time.monotonic() - t0
    assert fetch.returncode == 1, (fetch.returncode, procs.stderr("fetch"))
    assert "did not finish within --fetch-timeout 4 s" in one_error_line(procs.stderr("fetch"))
    assert took < 40, took
