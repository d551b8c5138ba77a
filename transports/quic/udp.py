"""A non-blocking UDP socket read and written in batches (used by both event-loop bindings).

Reading drains every datagram the kernel holds (up to a bound) before the
endpoint is serviced once, so a burst of packets costs one round of session
work, not one per packet. A send that would block keeps the rest in order for
when the socket is writable again (bounded: beyond ``max_pending`` datagrams
the oldest are dropped, which QUIC treats as loss).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections import deque
from typing import Any

log = logging.getLogger("kvcs.quic")

RECV_BATCH = 256
MAX_DATAGRAM = 65536
SOCKET_BUFFER = 4 * 1024 * 1024
MAX_PENDING = 4096


class UdpSocket:
    """One bound, non-blocking UDP socket."""

    def __init__(self, host: str, port: int, *, family: int | None = None) -> None:
        infos = socket.getaddrinfo(host, port, family or socket.AF_UNSPEC, socket.SOCK_DGRAM)
        fam, _, _, _, addr = infos[0]
        self.sock = socket.socket(fam, socket.SOCK_DGRAM)
        try:
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
            self.sock.bind(addr)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.family = fam
        self.pending: deque[tuple[bytes, Any]] = deque()
        self.dropped = 0

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_batch(self) -> list[tuple[bytes, Any]]:
        out: list[tuple[bytes, Any]] = []
        for _ in range(RECV_BATCH):
            try:
                data, addr = self.sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # e.g. ICMP port unreachable reported on Linux
                log.debug("udp receive error: %s", exc)
                if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH):
                    break
                continue
            out.append((data, addr))
        return out

    def send_batch(self, datagrams: list[tuple[bytes, Any]]) -> bool:
        """Send in order; return ``True`` when datagrams wait for the socket to be writable."""
        self.pending.extend(datagrams)
        while self.pending:
            data, addr = self.pending[0]
            try:
                self.sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.debug("udp send error to %s: %s", addr, exc)
            self.pending.popleft()
        while len(self.pending) > MAX_PENDING:
            self.pending.popleft()
            self.dropped += 1
        return bool(self.pending)

    def close(self) -> None:
        self.sock.close()
