"""Shared helpers of the standalone peer scripts in tests/peers/.

Standard library only, so the peer scripts (run by ``.peers/bin/python``,
Python >= 3.12) and our own tests (the project's ``python3``) can both import
it. Nothing here imports aiomoqt or moq.

* ``emit(event, **fields)``: one JSON line on stdout, flushed.
* ``payload(group, obj, size, seed)``: the deterministic object payload every
  peer publisher sends, so any subscriber can verify bytes without a side
  channel. ``sha256(payload)`` is what subscribers print.
* ``parse_field`` / ``field_json``: namespace fields and track names on the
  command line: ``hex:0a0b`` is binary given in hex, anything else is UTF-8.
* ``install_watchdog(seconds)``: a hard ``os._exit(124)`` in case native
  code (picoquic, moq-ffi) hangs past the script's own asyncio timeout.
* ``Expect``: the N groups x M objects check a subscriber runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

# Exit statuses shared by every peer script.
EXIT_OK = 0
EXIT_FAIL = 1  # verification failed, request refused, protocol error
EXIT_USAGE = 2
EXIT_TIMEOUT = 3  # the script's own --timeout ran out
EXIT_WATCHDOG = 124  # the hard watchdog fired (native code hung)

_T0 = time.monotonic()
_OUT: list[Any] = []  # where JSON lines go once claim_stdout() ran


def claim_stdout() -> None:
    """Keep stdout for JSON lines only: later writes to fd 1 (stray prints of
    the libraries, C code included) go to stderr instead."""
    if _OUT:
        return
    sys.stdout.flush()
    _OUT.append(os.fdopen(os.dup(1), "w", buffering=1))
    os.dup2(2, 1)


def emit(event: str, **fields: Any) -> None:
    """Print one machine-readable JSON line on stdout."""
    rec = {"event": event, "t": round(time.monotonic() - _T0, 4), **fields}
    out = _OUT[0] if _OUT else sys.stdout
    out.write(json.dumps(rec, sort_keys=False) + "\n")
    out.flush()


def payload(group: int, obj: int, size: int, seed: str = "") -> bytes:
    """Deterministic payload of object (group, obj): SHA-256 blocks of
    ``b"kvcs-peer|<seed>|<group>|<obj>|<block>"`` concatenated, cut to size."""
    out = bytearray()
    block = 0
    while len(out) < size:
        out += hashlib.sha256(f"kvcs-peer|{seed}|{group}|{obj}|{block}".encode()).digest()
        block += 1
    return bytes(out[:size])


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_field(text: str) -> bytes:
    """A namespace field or track name from the command line."""
    if text.startswith("hex:"):
        return bytes.fromhex(text[4:])
    return text.encode()


def field_json(value: bytes | str) -> str:
    """Inverse of parse_field: printable UTF-8 as itself, else ``hex:...``."""
    if isinstance(value, str):
        return value
    try:
        text = value.decode()
    except UnicodeDecodeError:
        return "hex:" + value.hex()
    if text.startswith("hex:") or not text.isprintable():
        return "hex:" + value.hex()
    return text


def ns_json(fields: Iterable[bytes | str]) -> list[str]:
    return [field_json(f) for f in fields]


def jsonable(value: Any) -> Any:
    """A JSON-safe copy: bytes as hex, mappings and sequences recursively."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "hex:" + bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def add_common_args(parser: argparse.ArgumentParser, *, url: bool = True) -> None:
    if url:
        parser.add_argument(
            "--url", default="moqt://127.0.0.1:4443",
            help="moqt://127.0.0.1:PORT[/path] (raw QUIC, ALPN moqt-22)")
    parser.add_argument(
        "--ns", action="append", default=[], metavar="FIELD",
        help="one namespace field; repeat for a tuple (--ns a --ns b); "
             "'hex:0a0b' gives a binary field")
    parser.add_argument("--track", default="track", help="track name ('hex:..' for binary)")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="hard limit for the whole run, seconds (default 20)")


def add_track_shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=3, help="groups N (default 3)")
    parser.add_argument("--objects", type=int, default=5, help="objects per group M (default 5)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes per object")
    parser.add_argument("--seed", default="", help="payload seed (see peer_common.payload)")


def loopback_only() -> tuple[bool, list[str]]:
    """Whether this process's network namespace has no interface but ``lo``
    (if_nameindex asks the kernel about this namespace; /sys/class/net would
    show the host's under a bare ``unshare -n``)."""
    names = sorted(name for _, name in socket.if_nameindex())
    return names == ["lo"], names


def require_loopback_netns() -> None:
    """aiopquic (under aiomoqt) binds its UDP sockets to every interface,
    clients included: refuse to run outside ``unshare -n``."""
    ok, names = loopback_only()
    if not ok:
        emit("error", error="refusing: aiomoqt must run in a loopback-only network namespace",
             interfaces=names, hint="unshare -n bash -c 'ip link set lo up; ...'")
        hard_exit(EXIT_USAGE)


def install_watchdog(seconds: float) -> None:
    """Kill the process outright ``seconds`` from now. Also claims stdout
    for the JSON lines (claim_stdout)."""
    claim_stdout()

    def fire() -> None:
        emit("error", error="watchdog", detail=f"hard limit {seconds:.1f}s reached")
        os._exit(EXIT_WATCHDOG)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def hard_exit(code: int) -> None:
    """Exit now, skipping interpreter teardown (native threads of aiopquic /
    moq-ffi can otherwise delay or hang it)."""
    if _OUT:
        _OUT[0].flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Expect:
    """Collects (group, object) -> payload and checks an N x M track."""

    def __init__(self, groups: int | None, objects: int, size: int, seed: str,
                 start: tuple[int, int] = (0, 0), end: tuple[int, int] | None = None):
        self.groups = groups
        self.objects = objects
        self.size = size
        self.seed = seed
        self.start = start
        self.end = end  # inclusive last (group, object), None = through the track's end
        self.got: dict[tuple[int, int], bytes] = {}
        self.duplicates = 0

    def wanted(self) -> set[tuple[int, int]]:
        if self.groups is None:
            return set()
        last = self.end or (self.groups - 1, self.objects - 1)
        return {
            (g, o)
            for g in range(self.groups)
            for o in range(self.objects)
            if self.start <= (g, o) <= last
        }

    def add(self, group: int, obj: int, data: bytes) -> None:
        if (group, obj) in self.got:
            self.duplicates += 1
        self.got[(group, obj)] = data

    def complete(self) -> bool:
        return self.groups is not None and self.wanted() <= set(self.got)

    def problems(self) -> list[str]:
        if self.groups is None:
            return []
        out: list[str] = []
        wanted = self.wanted()
        for loc in sorted(wanted - set(self.got)):
            out.append(f"missing {loc[0]}.{loc[1]}")
        for loc in sorted(set(self.got) - wanted):
            out.append(f"unexpected {loc[0]}.{loc[1]}")
        for loc in sorted(wanted & set(self.got)):
            if self.got[loc] != payload(loc[0], loc[1], self.size, self.seed):
                out.append(f"payload mismatch {loc[0]}.{loc[1]} ({len(self.got[loc])} bytes)")
        if self.duplicates:
            out.append(f"{self.duplicates} duplicate object(s)")
        return out
