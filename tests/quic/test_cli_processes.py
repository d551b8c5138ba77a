"""The ``kvcs`` command over real QUIC on 127.0.0.1, every role in its own process.

Relays (``kvcs relay --listen 127.0.0.1:0 --self-signed --json``), a publisher
(``kvcs publish``) and consumers (``kvcs fetch``) run as separate processes, the
way a user runs them: several consumers at once, a two-relay tree, a consumer
that loses its relay (SIGKILL) mid-transfer and must finish through a second
relay, and the exit statuses of ``transports/cli/common.py`` ``Exit``.

Every process is started through :class:`Procs`, which kills whatever is still
running (by PID) when the test ends; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcs.adapters.cachefile import llama_descriptor, synthetic_layers
from kvcs.adapters.numpy_kv import layer_sections
from kvcs.transports.quic.tls import self_signed

ROOT = Path(__file__).resolve().parents[2]
SCOPE_HEX = "5a" * 32
CACHE = [
    "--layers", "6", "--kv-heads", "2", "--head-dim", "64", "--tokens", "64",
    "--seed", "5", "--scope-key", SCOPE_HEX,
]  # fmt: skip
"""A small synthetic cache: 6 layers x 4 blocks of 16 tokens (2 heads x 64, bfloat16)."""
BLOCKS = 4
START_TIMEOUT = 20.0
RUN_TIMEOUT = 60.0


class Procs:
    """The processes of one test; :meth:`kill_all` ends each by its PID."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.running: list[tuple[str, subprocess.Popen[str]]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[str]:
        """``python -m kvcs.transports.cli ARGS``; stdout piped, stderr to ``<name>.err``."""
        err = (self.tmp / f"{name}.err").open("w")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvcs", *args],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        finally:
            err.close()
        self.running.append((name, proc))
        return proc

    def stderr(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def relay(
        self, name: str, *extra: str, verbose: bool = False
    ) -> tuple[subprocess.Popen[str], str, str]:
        """A relay on a free port; its URL (from the JSON ``listening`` line) and CA file."""
        proc = self.start(
            name, *(["-v"] if verbose else []), "relay",
            "--listen", "127.0.0.1:0", "--self-signed", "--json", *extra,
        )  # fmt: skip
        line = read_line(proc, START_TIMEOUT, f"the 'listening' line of {name}")
        info = json.loads(line)
        assert info["event"] == "listening", info
        assert re.fullmatch(r"moqt://127\.0\.0\.1:\d+", info["url"]), info
        return proc, info["url"], info["ca"]

    def finish(self, proc: subprocess.Popen[str], timeout: float = RUN_TIMEOUT) -> str:
        """Wait for the exit (killing it after ``timeout``); the rest of stdout."""
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
            raise AssertionError(f"{proc.args[3:]} did not end within {timeout} s") from None
        return _UNREAD.pop(proc.pid, b"").decode() + out

    def kill_all(self) -> None:
        for _, proc in self.running:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for _, proc in self.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.kill_all()


_UNREAD: dict[int, bytes] = {}
"""Bytes read from a process's stdout pipe past the last line returned, by PID.

:func:`read_line` reads the pipe's file descriptor itself, never the buffered text
stream: a buffered ``readline`` would take several lines out of the pipe at once
(``progress`` lines come in bursts), and a ``select`` on the descriptor would then
wait for more while the next line sits in the buffer. :meth:`Procs.finish` puts
what is left here in front of the rest of stdout."""


def read_line(proc: subprocess.Popen[str], timeout: float, what: str) -> str:
    """One line of ``proc``'s stdout within ``timeout`` seconds."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = _UNREAD.pop(proc.pid, b"")
    deadline = time.monotonic() + timeout
    try:
        while b"\n" not in buf:
            wait = min(0.05, max(0.0, deadline - time.monotonic()))
            if select.select([fd], [], [], wait)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # EOF
                buf += chunk
            elif time.monotonic() >= deadline or proc.poll() is not None:
                break
        if b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            return line.decode() + "\n"
    finally:
        _UNREAD[proc.pid] = buf
    raise AssertionError(f"no {what} within {timeout} s (exit status {proc.poll()})")


def read_event(proc: subprocess.Popen[str], event: str, timeout: float) -> dict[str, Any]:
    """The next JSON line of ``proc`` whose ``event`` is ``event`` (``progress`` and other
    lines before it are passed over), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        line = json.loads(read_line(proc, max(0.0, left), f"the {event!r} line"))
        if line.get("event") == event:
            return dict(line)


def _lines_so_far(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """The JSON lines ``proc`` has written so far (read without waiting for more)."""
    out = []
    while True:
        try:
            out.append(json.loads(read_line(proc, 0.0, "line")))
        except AssertionError:
            return out


def kvcs(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcs", *args],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def fetch_args(url: str, *extra: str) -> list[str]:
    return ["fetch", url, *CACHE, "--json", "--fetch-timeout", "45", *extra]


def assert_bit_identical(name: str, proc: subprocess.Popen[str], out: str, procs: Procs) -> None:
    err = procs.stderr(name)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{out}\n{err}"
    done = [d for d in json_lines(out) if d.get("event") == "done"]
    assert len(done) == 1, out
    assert done[0]["complete"] is True, (name, done[0], err)
    assert done[0]["blocks"] == BLOCKS, (name, done[0])
    assert done[0]["bit_identical"] is True, (name, done[0], err)
    assert "Traceback" not in err, err


def free_udp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def one_error_line(stderr: str) -> str:
    """The single ``kvcs: error: ...`` line (and no traceback)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr
    return errors[0]


# --- one relay, one publisher, several consumer processes ---------------------------------


def test_publish_to_concurrent_fetch_processes(procs: Procs) -> None:
    relay, url, ca = procs.relay("relay")
    pub = procs.start(
        "publisher", "publish", url, "-k", *CACHE, "--layer-interval", "0.15",
        "--serve-for", "60", "--json",
    )  # fmt: skip
    first = json.loads(read_line(pub, START_TIMEOUT, "the publisher's first line"))
    assert first["event"] == "publishing"
    assert first["layers"] == 6 and first["blocks"] == BLOCKS
    # three consumers at once while the cache is being produced: one verifies the
    # relay's certificate with its CA, one runs on trio
    variants = {
        "fetch-insecure": ["-k"],
        "fetch-ca": ["--ca", ca],
        "fetch-trio": ["-k", "--loop", "trio"],
    }
    fetches = {name: procs.start(name, *fetch_args(url, *v)) for name, v in variants.items()}
    outs = {name: procs.finish(p) for name, p in fetches.items()}
    for name, p in fetches.items():
        assert_bit_identical(name, p, outs[name], procs)
    published = read_event(pub, "published", RUN_TIMEOUT)
    assert published["event"] == "published", published
    # a late consumer: the cache is complete (and cached by the relay)
    late = procs.start("fetch-late", *fetch_args(url, "-k"))
    assert_bit_identical("fetch-late", late, procs.finish(late), procs)
    # SIGTERM ends the publisher and the relay cleanly (exit 0)
    for p in (pub, relay):
        p.send_signal(signal.SIGTERM)
        procs.finish(p, timeout=15)
        assert p.returncode == 0, p.args
    for name in ("publisher", "relay"):
        assert "Traceback" not in procs.stderr(name), procs.stderr(name)


@pytest.mark.parametrize("preload", [False, True], ids=["one-layer-at-a-time", "preload"])
def test_publish_digest_matches_what_fetch_received(procs: Procs, preload: bool) -> None:
    # --digest of kvcs publish (computed before connecting with --preload, after the
    # timing without) equals kvcs fetch --digest of what arrived, and of the other mode
    _, url, _ = procs.relay("relay")
    pub = procs.start(
        "publisher", "publish", url, "-k", *CACHE, "--digest", "--serve-for", "60", "--json",
        *(["--preload"] if preload else []),
    )  # fmt: skip
    published = read_event(pub, "published", RUN_TIMEOUT)
    fetch = procs.start("fetch", *fetch_args(url, "-k", "--digest"))
    out = procs.finish(fetch)
    assert_bit_identical("fetch", fetch, out, procs)
    done = next(d for d in json_lines(out) if d.get("event") == "done")
    assert done["digest"] == published["digest"] == _cache_digest()


def _cache_digest() -> str:
    """SHA-256 of the sections of :data:`CACHE`, made here: per layer every K, then every V."""
    desc = llama_descriptor(layers=6, kv_heads=2, head_dim=64)
    source = synthetic_layers(desc, 64, 5)
    h = hashlib.sha256()
    for k, v in source.layers():
        sections = layer_sections(k, v, source.cd)
        for part in [*sections.k, *sections.v]:
            h.update(memoryview(part).cast("B"))
    return h.hexdigest()


# --- a two-relay tree ----------------------------------------------------------------------


def test_two_relay_tree(procs: Procs) -> None:
    _, root_url, _ = procs.relay("relay-a")
    _, leaf_url, _ = procs.relay("relay-b", "--upstream", root_url, "--upstream-insecure")
    assert leaf_url != root_url
    pub = procs.start(
        "publisher", "publish", root_url, "-k", *CACHE, "--layer-interval", "0.1",
        "--serve-for", "60", "--json",
    )  # fmt: skip
    assert json.loads(read_line(pub, START_TIMEOUT, "the publisher's first line"))["event"] == (
        "publishing"
    )
    fetches = {
        name: procs.start(name, *fetch_args(leaf_url, "-k")) for name in ("fetch-b1", "fetch-b2")
    }
    for name, p in fetches.items():
        assert_bit_identical(name, p, procs.finish(p), procs)
    # once complete, a consumer of the leaf is served again (from B's cache or through A)
    late = procs.start("fetch-b-late", *fetch_args(leaf_url, "-k", "--loop", "trio"))
    assert_bit_identical("fetch-b-late", late, procs.finish(late), procs)
    ls = kvcs("ls", leaf_url, "-k", "--json", timeout=30)
    assert ls.returncode == 0, ls.stderr
    assert len(json_lines(ls.stdout)) == 1, ls.stdout  # the one publication, seen through B


# --- a consumer whose relay dies mid-transfer -------------------------------------------------

RECOVERY_LAYERS = 8
RECOVERY_CACHE = [*CACHE[:1], str(RECOVERY_LAYERS), *CACHE[2:]]
LAYER_BYTES = 2 * BLOCKS * 2 * 16 * 64 * 2  # K and V sections of one layer


def _cache_bytes(log: str) -> int:
    """The last ``cache N bytes`` a relay logged with ``-v`` (once a second)."""
    found = re.findall(r"relay: \d+ connections, \d+ tracks, cache (\d+) bytes", log)
    return int(found[-1]) if found else 0


def test_consumer_recovers_through_second_relay_when_its_relay_is_killed(procs: Procs) -> None:
    """R0 <- R1, R0 <- R2; the publisher on R0; ``fetch R1 --also R2``. The relay that
    carries the consumer's data (the one whose cache fills) is SIGKILLed while the
    publisher is still producing; the consumer must still finish, bit for bit."""
    _, root, _ = procs.relay("r0")
    relays = {}
    for name in ("r1", "r2"):
        proc, url, _ = procs.relay(name, "--upstream", root, "--upstream-insecure", verbose=True)
        relays[name] = (proc, url)
    (_, url1), (_, url2) = relays["r1"], relays["r2"]
    pub = procs.start(
        "publisher", "publish", root, "-k", *RECOVERY_CACHE, "--layer-interval", "0.6",
        "--serve-for", "90", "--json",
    )  # fmt: skip
    assert json.loads(read_line(pub, START_TIMEOUT, "the publisher's first line"))["event"] == (
        "publishing"
    )
    fetch = procs.start(
        "fetch", "fetch", url1, "--also", url2, "-k", *RECOVERY_CACHE, "--json",
        "--fetch-timeout", "60",
    )  # fmt: skip
    # wait until one relay has passed at least one whole layer to the consumer
    deadline = time.monotonic() + 20
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, "no relay carried the consumer's data"
        assert fetch.poll() is None, f"fetch ended early: {procs.stderr('fetch')}"
        for name in ("r1", "r2"):
            if _cache_bytes(procs.stderr(name)) >= LAYER_BYTES:
                victim = name
                break
        time.sleep(0.05)
    proc, _ = relays[victim]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    # the kill landed mid-transfer: production (and so the retrieval) was not over
    assert pub.poll() is None
    so_far = _lines_so_far(pub)  # its progress lines, and no 'published' yet
    assert all(line["event"] == "progress" for line in so_far), (
        "the publisher had already finished: the kill came too late",
        so_far,
    )
    out = procs.finish(fetch, timeout=90)
    survivor = "r2" if victim == "r1" else "r1"
    assert fetch.returncode == 0, (
        f"the consumer did not recover through {survivor} after {victim} was killed: "
        f"exit {fetch.returncode}\n{out}\n{procs.stderr('fetch')}"
    )
    done = json_lines(out)[-1]
    assert done["complete"] is True and done["bit_identical"] is True, done


# --- exit statuses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("fetch",),  # no URL
        ("publish", "moqt://127.0.0.1:1", "--tokens", "many"),
        ("relay", "--listen", "not-a-port:x", "--self-signed"),
        ("fetch", "http://127.0.0.1:1", "-k", "--scope-key", SCOPE_HEX, "--tokens", "32"),
        ("publish", "moqt://127.0.0.1:1", "--scope-key", "abcd"),
        ("fetch", "moqt://[::1", "-k", "--scope-key", SCOPE_HEX),  # unclosed IPv6 bracket
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: tuple[str, ...]) -> None:
    r = kvcs(*args, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    one_error_line(r.stderr)


@pytest.mark.parametrize("command", ["fetch", "ls"])
def test_unreachable_relay_exits_3_with_one_line(command: str) -> None:
    port = free_udp_port()
    cache = [] if command == "ls" else [*CACHE]
    r = kvcs(command, f"moqt://127.0.0.1:{port}", "-k", *cache, "--timeout", "1", timeout=30)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    line = one_error_line(r.stderr)
    assert line.startswith("kvcs: error: "), line
    assert f"127.0.0.1:{port}" in line


def test_relay_with_bad_certificate_files_exits_4(tmp_path: Path) -> None:
    missing = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--cert", str(tmp_path / "none.pem"),
        "--key", str(tmp_path / "none.key"), "--run-for", "1", timeout=30,
    )  # fmt: skip
    assert missing.returncode == 4, (missing.stdout, missing.stderr)
    assert "not found" in one_error_line(missing.stderr)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("this is not a certificate\n")
    bad = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--cert", str(garbage), "--key", str(garbage),
        "--run-for", "1", timeout=30,
    )  # fmt: skip
    assert bad.returncode == 4, (bad.stdout, bad.stderr)
    one_error_line(bad.stderr)
    # a real certificate with a key that does not belong to it
    a, b = self_signed(tmp_path / "a"), self_signed(tmp_path / "b")
    assert a.certfile is not None and b.keyfile is not None
    mismatch = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--cert", a.certfile, "--key", b.keyfile,
        "--run-for", "1", timeout=30,
    )  # fmt: skip
    assert mismatch.returncode == 4, (mismatch.stdout, mismatch.stderr)
    one_error_line(mismatch.stderr)


def test_client_distrusting_the_relay_exits_4(procs: Procs, tmp_path: Path) -> None:
    _, url, _ = procs.relay("relay")
    other = self_signed(tmp_path / "other")
    assert other.cafile is not None
    r = kvcs("ls", url, "--ca", other.cafile, "--timeout", "10", timeout=30)
    assert r.returncode == 4, (r.returncode, r.stderr)
    assert "certificate" in one_error_line(r.stderr)


@pytest.mark.parametrize("command", ["fetch", "publish"])
def test_missing_cache_file_exits_5(command: str, tmp_path: Path) -> None:
    r = kvcs(
        command, "moqt://127.0.0.1:1", "-k", "--scope-key", SCOPE_HEX,
        "--file", str(tmp_path / "absent.npz"), timeout=30,
    )  # fmt: skip
    assert r.returncode == 5, (r.returncode, r.stderr)
    assert "absent.npz" in one_error_line(r.stderr)


def test_unwritable_certificate_directory_exits_5(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = kvcs(
        "relay", "--listen", "127.0.0.1:0", "--self-signed", "--cert-dir", str(blocker / "x"),
        "--run-for", "1", timeout=30,
    )  # fmt: skip
    assert r.returncode == 5, (r.returncode, r.stderr)
    assert "certificate" in one_error_line(r.stderr)


# --- the documented command lines -----------------------------------------------------------


def _port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        return False
    finally:
        s.close()
    return True


def test_relay_on_4443_exactly_as_documented(procs: Procs) -> None:
    if not _port_free(4443):
        pytest.skip("UDP 127.0.0.1:4443 is in use on this machine")
    relay = procs.start("relay", "relay", "--listen", "127.0.0.1:4443", "--self-signed")
    line = read_line(relay, START_TIMEOUT, "the relay's 'listening' line")
    m = re.match(r"kvcs relay: listening on moqt://127\.0\.0\.1:4443 .*CA (\S+)\)$", line)
    assert m, line
    ca = m.group(1)
    # reachable, with the certificate verified against the CA it printed
    r = kvcs("ls", "moqt://127.0.0.1:4443", "--ca", ca, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "0 namespace(s)" in r.stderr
    relay.send_signal(signal.SIGTERM)
    procs.finish(relay, timeout=15)
    assert relay.returncode == 0


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_demo_every_consumer_bit_for_bit(loop: str) -> None:
    r = kvcs("demo", "--tokens", "64", "--loop", loop, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.endswith("bit for bit")]
    names = sorted(line.split()[0] for line in rows)
    assert names == ["half", "late", "live", "mid", "partial"], r.stdout
    assert "FAILED" not in r.stdout
    assert "Traceback" not in r.stderr
