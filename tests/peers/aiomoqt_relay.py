"""Launch aiomoqt's interop relay (raw QUIC, draft 22) on 127.0.0.1, bounded in time.

    unshare -n bash -c 'ip link set lo up; \\
        .peers/bin/python tests/peers/aiomoqt_relay.py --port 4443 --cert-dir /tmp/c --timeout 60'

SAFETY: aiomoqt's server ignores its bind address and listens on 0.0.0.0, so
this launcher refuses to start unless the process sits in a network namespace
whose only interface is loopback (``unshare -n``), and brings ``lo`` up.

* ``--cert/--key`` PEM files, or ``--cert-dir DIR``: uses DIR/cert.pem and
  DIR/key.pem, generating them (P-256, SAN localhost + 127.0.0.1) when absent.
  The ``.peers`` venv has no ``cryptography``; generation then runs
  ``make_cert.py`` under ``--cert-python`` (default: ``python3``, the project's).
* The relay runs as a child (``python -m aiomoqt.tools.moq_interop_relay
  --bind 127.0.0.1 --port P --quic --draft 22``) that dies with this launcher
  (PR_SET_PDEATHSIG), its log goes to ``--log`` (default: stderr).
* Objects over about 1 MiB need a bigger per-stream send ring, else the relay
  silently never forwards them: ``-- --stream-ring-cap 16777216
  --max-inflight-bytes 8388608`` (anything after ``--`` goes to the relay).
* Prints ``{"event": "ready", "port": P, "pid": CHILD}`` once a draft-22 SETUP
  to it completes, then waits. SIGTERM/SIGINT or ``--timeout`` seconds stop
  the child (SIGTERM, then SIGKILL) and exit 0; a child that dies first exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import peer_common as pc
from aiomoqt.client import MOQTClient
from aiomoqt.utils.logger import set_log_level

try:  # needs the cryptography package, which .peers lacks
    from make_cert import write_cert
except ImportError:
    write_cert = None

HERE = Path(__file__).resolve().parent


def ensure_cert(args: argparse.Namespace) -> tuple[str, str]:
    if args.cert and args.key:
        return args.cert, args.key
    if not args.cert_dir:
        raise SystemExit("give --cert and --key, or --cert-dir")
    d = Path(args.cert_dir)
    cert, key = d / "cert.pem", d / "key.pem"
    if not (cert.exists() and key.exists()):
        if write_cert is not None:
            write_cert(d)
        else:
            subprocess.run([args.cert_python, str(HERE / "make_cert.py"), str(d)],
                           check=True, stdout=subprocess.DEVNULL, timeout=60)
    return str(cert), str(key)


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def probe(port: int, timeout: float) -> bool:
    set_log_level(logging.WARNING)
    client = MOQTClient("127.0.0.1", port, use_quic=True, verify_tls=False,
                        supported_drafts=22)
    try:
        async with asyncio.timeout(timeout), client.connect() as session:
            # client_session_init returns None and raises when SETUP fails.
            await session.client_session_init(timeout=max(1, int(timeout)))
            session.close()
            return True
    except Exception:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=4443)
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--cert-dir")
    p.add_argument("--cert-python", default="python3")
    p.add_argument("--draft", default="22", help="drafts the relay serves (default 22)")
    p.add_argument("--upstream", action="append", default=[],
                   help="origin the relay dials for tracks no client publishes "
                        "(e.g. moqt://127.0.0.1:4444/), repeatable")
    p.add_argument("--log", help="relay log file (default: inherit stderr)")
    p.add_argument("--debug", action="store_true", help="relay --debug logging")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="stop the relay after this many seconds (default 120)")
    p.add_argument("--ready-timeout", type=float, default=15.0)
    p.add_argument("--unsafe-allow-network", action="store_true",
                   help=argparse.SUPPRESS)
    p.add_argument("relay_args", nargs=argparse.REMAINDER,
                   help="after '--': more moq_interop_relay options, e.g. "
                        "-- --stream-ring-cap 16777216 --max-inflight-bytes 8388608 "
                        "(needed for objects over ~1 MiB)")
    args = p.parse_args()

    lo_only, names = pc.loopback_only()
    if not lo_only and not args.unsafe_allow_network:
        pc.emit("error", error="refusing: not in a loopback-only network namespace",
                interfaces=names, hint="run inside: unshare -n bash -c 'ip link set lo up; ...'")
        pc.hard_exit(pc.EXIT_USAGE)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=False, timeout=10)
    cert, key = ensure_cert(args)

    cmd = [sys.executable, "-m", "aiomoqt.tools.moq_interop_relay", "--bind", "127.0.0.1",
           "--port", str(args.port), "--cert", cert, "--key", key, "--quic",
           "--draft", args.draft]
    for u in args.upstream:
        cmd += ["--upstream", u]
    if args.debug:
        cmd.append("--debug")
    cmd += [a for a in args.relay_args if a != "--"]
    log = open(args.log, "ab") if args.log else None  # noqa: SIM115
    child = subprocess.Popen(cmd, stdout=log or sys.stderr, stderr=subprocess.STDOUT,
                             preexec_fn=_die_with_parent)  # noqa: PLW1509 (no threads yet)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = pc.EXIT_OK
    try:
        t_end = time.monotonic() + args.ready_timeout
        ready = False
        while not ready and not stopping and child.poll() is None and time.monotonic() < t_end:
            ready = asyncio.run(probe(args.port, 2.0))
            if not ready:
                time.sleep(0.2)
        if not ready:
            pc.emit("error", error="relay did not become ready", returncode=child.poll())
            code = pc.EXIT_FAIL
        else:
            pc.emit("ready", port=args.port, pid=child.pid, cert=cert, key=key,
                    url=f"moqt://127.0.0.1:{args.port}")
            deadline = time.monotonic() + args.timeout
            while not stopping and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if child.poll() is not None and not stopping:
                pc.emit("error", error="relay exited", returncode=child.returncode)
                code = pc.EXIT_FAIL
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5)
        if log:
            log.close()
        with contextlib.suppress(Exception):
            pc.emit("exit", code=code, relay_returncode=child.returncode)
    pc.hard_exit(code)


if __name__ == "__main__":
    main()
