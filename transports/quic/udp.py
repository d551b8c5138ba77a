"""A non-blocking UDP socket read and written in batches, with Linux UDP GSO and GRO.

Theory of operation
-------------------
Both event-loop bindings (:mod:`.asyncio_binding`, :mod:`.trio_binding`) and
both QUIC stacks (aioquic, qh3) use this one socket. The endpoint hands it a
whole flush at once (every datagram :meth:`~.endpoint.QuicEndpoint.service`
produced after servicing its connections), and it drains every datagram the
kernel holds (up to a bound) before the endpoint is serviced once, so a burst
of packets costs one round of session work, not one per packet.

**Sends: UDP GSO** (generic segmentation offload, Linux 4.18 and later). One
``sendmsg`` carrying a ``UDP_SEGMENT`` control message (level ``SOL_UDP`` =
17, type 103, a 16-bit segment size) hands the kernel a buffer that it cuts
into datagrams of that size, the last one possibly shorter, all to the same
address: one system call and one trip through the network stack for up to
:data:`GSO_MAX_SEGMENTS` (64, the kernel's ``UDP_MAX_SEGMENTS``) datagrams of
at most :data:`GSO_MAX_BYTES` (65507, the largest UDP payload over IPv4) in
all. The receiver sees ordinary datagrams. So a flush is planned
(:func:`plan_runs`, a pure function) into *runs*: the datagrams grouped per
destination address, order kept within each destination, and each group cut
into runs of consecutive datagrams of equal size, where a shorter datagram
ends its run (as GSO allows only the last segment to be shorter). A run of
one datagram goes out with a plain ``sendto``. The segments of a run are
passed to ``sendmsg`` as separate buffers (scatter-gather), never joined.
QUIC packets carrying stream data fill the datagram size, so a bulk flush is
mostly full runs: the per-datagram system-call cost (a quarter or more of a
relay's CPU with one ``sendto`` per datagram) shrinks by up to 64 times.

**Receives: UDP GRO** (generic receive offload, Linux 5.0 and later). With
the ``UDP_GRO`` socket option (``SOL_UDP``, 104) set, the kernel may hand
over several datagrams of one flow, equal in size but the last, as one
buffer, and says so with a ``UDP_GRO`` control message whose value (an int)
is the segment size; :meth:`UdpSocket.recv_batch` reads with
``recvmsg_into`` leaving room for that message and splits such a buffer back into its
datagrams (:func:`split_segments`) before the endpoint sees them. Over
loopback this is what a GSO sender's buffers arrive as (they are never cut
up on the way); over a NIC it is what the kernel's GRO coalesced. A
truncated buffer (``MSG_TRUNC``) keeps its whole segments; a truncated plain
datagram is dropped (QUIC treats it as loss).

**One receive buffer per socket.** Every receive lands in the socket's own
64 KiB ``bytearray`` (``recvmsg_into`` / ``recvfrom_into``), and each datagram
leaves it as a ``bytes`` of exactly its size. ``recvmsg(65536)`` would
allocate 64 KiB per call and shrink it in place: thousands of such short-lived
blocks a second, interleaved with the cached payloads a relay keeps for
minutes, fragmented the heap (a relay forwarding a 256 MiB cache live peaked
about 50 MiB higher than with this buffer). The copy out of the buffer is the
one the old per-segment slicing made anyway; a plain datagram costs one
``memcpy`` of its size more.

**The fallback.** Each socket probes once, when it is made: GSO only on
Linux and only if ``setsockopt(SOL_UDP, UDP_SEGMENT, 0)`` succeeds (0 sets
no default segment size; the call only proves the kernel knows the option);
GRO only if ``setsockopt(SOL_UDP, UDP_GRO, 1)`` succeeds. Without GSO a flush
is sent one ``sendto`` per datagram, in order (Python's socket module has no
``sendmmsg``); without GRO each datagram is read with ``recvfrom_into``. A GSO
``sendmsg`` refused with ``EIO``, ``EINVAL``, ``ENOPROTOOPT`` or
``EOPNOTSUPP`` (no checksum offload on the route, IPsec, a segment larger
than the route's MTU) is sent again one datagram at a time, so nothing is
lost; if no GSO send had succeeded on the socket yet, GSO is turned off for
the socket (logged once at debug level), else only for that destination (a
bounded record). The environment variable ``KVCS_UDP_GSO=0`` (also ``off``,
``no``, ``false``) turns GSO and GRO off for sockets made afterwards, to
compare the two paths (``benchmarks/bench_udp_path.py``).

**Blocking and bounds.** A send that would block (``EAGAIN``) keeps what is
unsent, in order, for when the socket is writable again: a GSO ``sendmsg``
goes out whole or not at all, the datagrams of a run sent one by one may
stop in the middle, and either way the unsent rest of that run and every
later run wait in :attr:`UdpSocket.pending` (per destination in their
original order). Beyond :data:`MAX_PENDING` datagrams the oldest are dropped
(:attr:`UdpSocket.dropped`), which QUIC treats as loss. Any other send error
drops that datagram (logged at debug level), as a lost packet would be.

**Batching in native code** (:class:`NativeUdpSocket`, what :func:`open_udp` gives
where it can). qh3, a dependency of kvcs, ships ``UdpSocketState``: quinn-udp's
batched socket I/O (``recvmmsg`` with GRO, split in native code; ``sendmsg`` with
GSO), which takes any non-blocking UDP socket's file descriptor. Receiving and
planning the runs above cost about 2.4 us of Python per datagram in each process;
there it is a list of ``(datagram, address)`` pairs out of one call, and one call
per destination's run in. Measured on 256 MiB through a relay (qh3, unpaced,
``benchmarks/bench_relay_pipeline.py``): the relay's CPU fell from 4.1-4.6 s to
3.5-3.8 s and its goodput rose by 8-20%. The socket is made and bound here as
before, then handed over; addresses come back in Python's own form (a 4-tuple for
IPv6), and ``pending``, :data:`MAX_PENDING` and the counters keep their meaning
(``gso_runs`` and ``gro_segments`` are not known there and stay 0). The state keeps
a duplicate of the socket's descriptor, so closing drops the state too (the port is
free again at once). A send error
carries how many datagrams went out before it: a would-block keeps the rest pending,
any other error drops the datagram it names (as above). ``KVCS_UDP_NATIVE=0`` (or
``KVCS_UDP_GSO=0``, which also turns the Python path's GSO and GRO off) keeps the
Python path, and so does a qh3 without ``UdpSocketState`` (not a Unix platform).

**Counters** (:meth:`UdpSocket.stats`, for benchmarks): datagrams sent, send
system calls, GSO runs sent, datagrams received, receive system calls, and
datagrams that arrived inside a GRO buffer.
"""

import contextlib
import errno
import functools
import logging
import os
import socket
import struct
import sys
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

log = logging.getLogger("kvcs.quic")

RECV_BATCH = 256
"""Datagrams (and receive system calls) per :meth:`UdpSocket.recv_batch` at most."""
MAX_DATAGRAM = 65536
"""The receive buffer: the largest UDP payload, or one GRO buffer."""
SOCKET_BUFFER = 4 * 1024 * 1024
MAX_PENDING = 4096

SOL_UDP = 17
UDP_SEGMENT = 103
"""``SOL_UDP`` option and control message: the GSO segment size (Linux 4.18)."""
UDP_GRO = 104
"""``SOL_UDP`` option and control message: receive coalesced datagrams (Linux 5.0)."""
GSO_MAX_SEGMENTS = 64
"""Datagrams in one GSO send at most (the kernel's ``UDP_MAX_SEGMENTS``)."""
GSO_MAX_BYTES = 65507
"""Bytes in one GSO send at most (the largest UDP payload over IPv4)."""
GSO_ENV = "KVCS_UDP_GSO"
"""Environment variable: ``0`` (``off``, ``no``, ``false``) turns GSO and GRO off."""
NATIVE_ENV = "KVCS_UDP_NATIVE"
"""Environment variable: ``0`` (``off``, ``no``, ``false``) keeps the Python send and
receive path (:func:`open_udp`)."""
_WOULD_BLOCK = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR})
GSO_REFUSED = frozenset(
    {errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}
)
"""``sendmsg`` errors that mean the kernel or the route will not segment this send."""
MAX_GSO_REFUSED_DESTINATIONS = 1024
"""Destinations remembered as refusing GSO (the record is cleared when full)."""

_GRO_CMSG_SPACE = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "no", "false")


def offload_enabled() -> bool:
    """GSO and GRO are wanted: Linux, and ``KVCS_UDP_GSO`` does not turn them off."""
    if not sys.platform.startswith("linux"):
        return False
    return _env_on(GSO_ENV)


def _native_state_class() -> Any:
    """qh3's ``UdpSocketState`` when it is wanted and there (module docstring), else None."""
    if not (offload_enabled() and _env_on(NATIVE_ENV)):
        return None
    try:
        from qh3._hazmat import UdpSocketState  # noqa: PLC0415  (optional native code)
    except ImportError:
        return None
    return UdpSocketState


def open_udp(host: str, port: int, *, family: int | None = None) -> "UdpSocket":
    """The socket kvcs uses: a :class:`NativeUdpSocket` where qh3's batched I/O is there
    and not turned off, else a :class:`UdpSocket` (module docstring)."""
    state_class = _native_state_class()
    if state_class is None:
        return UdpSocket(host, port, family=family)
    return NativeUdpSocket(host, port, family=family, state_class=state_class)


class Run(NamedTuple):
    """Datagrams for one GSO send: one destination, all ``segment_size`` but the last."""

    addr: Any
    datagrams: list[bytes]
    segment_size: int


def plan_runs(
    datagrams: Iterable[tuple[bytes, Any]],
    *,
    max_segments: int = GSO_MAX_SEGMENTS,
    max_bytes: int = GSO_MAX_BYTES,
) -> list[Run]:
    """Group ``(datagram, address)`` pairs into GSO runs (see the module docstring).

    Destinations come in the order of their first datagram; each destination's
    datagrams keep their order. A run holds consecutive datagrams of the size
    of its first; a shorter one is its last; a longer one starts the next run;
    a run holds at most ``max_segments`` datagrams and ``max_bytes`` bytes (a
    single datagram larger than that, or an empty one, is a run of its own).
    """
    by_addr: dict[Any, list[bytes]] = {}
    for data, addr in datagrams:
        group = by_addr.get(addr)
        if group is None:
            by_addr[addr] = [data]
        else:
            group.append(data)
    runs: list[Run] = []
    for addr, group in by_addr.items():
        current: list[bytes] = []
        size = total = 0
        for data in group:
            n = len(data)
            if n == 0:  # an empty datagram cannot be a segment: a run of its own
                if current:
                    runs.append(Run(addr, current, size))
                    current = []
                runs.append(Run(addr, [data], 0))
                continue
            if current and (n > size or len(current) >= max_segments or total + n > max_bytes):
                runs.append(Run(addr, current, size))
                current = []
            if not current:
                size = total = n
                current = [data]
                continue
            current.append(data)
            total += n
            if n < size:  # a shorter datagram can only be the last segment
                runs.append(Run(addr, current, size))
                current = []
        if current:
            runs.append(Run(addr, current, size))
    return runs


def split_segments(data: bytes | memoryview, segment_size: int) -> list[bytes]:
    """The datagrams of a GRO buffer: ``segment_size`` bytes each, the last possibly shorter.

    Each is a ``bytes`` of its own (a copy), so ``data`` may be a view of a buffer
    that is reused afterwards.
    """
    if segment_size <= 0 or len(data) <= segment_size:
        return [bytes(data)]
    return [bytes(data[i : i + segment_size]) for i in range(0, len(data), segment_size)]


def gro_segment_size(ancdata: Iterable[tuple[int, int, bytes]]) -> int | None:
    """The segment size a ``UDP_GRO`` control message carries, ``None`` without one."""
    for level, kind, value in ancdata:
        if level == SOL_UDP and kind == UDP_GRO and len(value) >= 4:
            size: int = struct.unpack("=i", value[:4])[0]
            return size if size > 0 else None
    return None


@functools.lru_cache(maxsize=64)
def _segment_cmsg(size: int) -> list[tuple[int, int, bytes]]:
    return [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]


class UdpSocket:
    """One bound, non-blocking UDP socket (see the module docstring).

    ``gso`` / ``gro``: use UDP GSO for sends / GRO for receives where the
    kernel has them; ``None`` (the default): as :func:`offload_enabled` says.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        family: int | None = None,
        gso: bool | None = None,
        gro: bool | None = None,
    ) -> None:
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
        """Datagrams dropped, oldest first, beyond :data:`MAX_PENDING` waiting."""
        self.datagrams_sent = 0
        self.send_calls = 0
        """Send system calls made (``sendmsg`` and ``sendto``, successful or not)."""
        self.gso_runs = 0
        """GSO sends that went out (each carried two or more datagrams)."""
        self.datagrams_received = 0
        self.recv_calls = 0
        """Receive system calls that returned a datagram or a GRO buffer."""
        self.gro_segments = 0
        """Datagrams that arrived inside a GRO buffer of two or more."""
        self._rx = bytearray(MAX_DATAGRAM)
        self._rx_view = memoryview(self._rx)
        self._gso_worked = False
        self._gso_refused: set[Any] = set()
        wanted = offload_enabled()
        self.gso = (wanted if gso is None else gso) and self._probe(UDP_SEGMENT, 0, "GSO")
        """GSO is used for sends on this socket."""
        self.gro = (
            (wanted if gro is None else gro)
            and _GRO_CMSG_SPACE > 0
            and self._probe(UDP_GRO, 1, "GRO")
        )
        """GRO is on for receives on this socket."""

    def _probe(self, option: int, value: int, name: str) -> bool:
        """Set a ``SOL_UDP`` option once (Linux only): does the kernel have it?"""
        if not sys.platform.startswith("linux"):
            return False
        try:
            self.sock.setsockopt(SOL_UDP, option, value)
        except OSError as exc:
            log.debug("UDP %s unavailable (%s): falling back", name, exc)
            return False
        return True

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    def fileno(self) -> int:
        return self.sock.fileno()

    def stats(self) -> dict[str, int | bool]:
        """The counters (module docstring) and whether GSO and GRO are on."""
        return {
            "gso": self.gso,
            "gro": self.gro,
            "datagrams_sent": self.datagrams_sent,
            "send_calls": self.send_calls,
            "gso_runs": self.gso_runs,
            "datagrams_received": self.datagrams_received,
            "recv_calls": self.recv_calls,
            "gro_segments": self.gro_segments,
            "dropped": self.dropped,
        }

    # --- receive ------------------------------------------------------------------------------

    def recv_batch(self) -> list[tuple[bytes, Any]]:
        """Every datagram waiting, up to about :data:`RECV_BATCH` (GRO buffers split)."""
        out: list[tuple[bytes, Any]] = []
        gro = self.gro
        buf, view = self._rx, self._rx_view
        for _ in range(RECV_BATCH):
            try:
                if gro:
                    n, ancdata, flags, addr = self.sock.recvmsg_into([buf], _GRO_CMSG_SPACE)
                else:
                    n, addr = self.sock.recvfrom_into(buf)
                    ancdata, flags = None, 0
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # e.g. ICMP port unreachable reported on Linux
                log.debug("udp receive error: %s", exc)
                if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH):
                    break
                continue
            self.recv_calls += 1
            if gro:
                size = gro_segment_size(ancdata) if ancdata else None
                if flags & socket.MSG_TRUNC:
                    if size is None:
                        log.debug("udp receive: truncated datagram from %s dropped", addr)
                        continue
                    n -= n % size  # its whole segments
                    if not n:
                        continue
                if size is not None and n > size:
                    segments = split_segments(view[:n], size)
                    self.gro_segments += len(segments)
                    self.datagrams_received += len(segments)
                    out.extend((s, addr) for s in segments)
                    if len(out) >= RECV_BATCH:
                        break
                    continue
            self.datagrams_received += 1
            out.append((bytes(view[:n]), addr))
            if len(out) >= RECV_BATCH:
                break
        return out

    # --- send ---------------------------------------------------------------------------------

    def send_batch(self, datagrams: list[tuple[bytes, Any]]) -> bool:
        """Send a flush (with what waited); ``True`` when datagrams wait for writability."""
        pending = self.pending
        pending.extend(datagrams)
        if pending:
            if self.gso:
                self._send_runs()
            else:
                self._send_each_pending()
        while len(pending) > MAX_PENDING:
            pending.popleft()
            self.dropped += 1
        return bool(pending)

    def _send_each_pending(self) -> None:
        pending = self.pending
        sock = self.sock
        while pending:
            data, addr = pending[0]
            self.send_calls += 1
            try:
                sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("udp send error to %s: %s", addr, exc)
            else:
                self.datagrams_sent += 1
            pending.popleft()

    def _send_runs(self) -> None:
        runs = plan_runs(self.pending)
        self.pending.clear()
        for i, run in enumerate(runs):
            done = self._send_run(run)
            if done < len(run.datagrams):  # blocked: keep the rest, in order
                self.pending.extend((d, run.addr) for d in run.datagrams[done:])
                for later in runs[i + 1 :]:
                    self.pending.extend((d, later.addr) for d in later.datagrams)
                return

    def _send_run(self, run: Run) -> int:
        """Send one run; the number of its datagrams done with (sent or dropped)."""
        n = len(run.datagrams)
        if n > 1 and self.gso and run.addr not in self._gso_refused:
            self.send_calls += 1
            try:
                self.sock.sendmsg(run.datagrams, _segment_cmsg(run.segment_size), 0, run.addr)
            except (BlockingIOError, InterruptedError):
                return 0
            except OSError as exc:
                if exc.errno in GSO_REFUSED:
                    self._gso_refused_by(run.addr, exc)
                else:
                    log.debug("udp GSO send error to %s: %s (sending one by one)", run.addr, exc)
            else:
                self._gso_worked = True
                self.gso_runs += 1
                self.datagrams_sent += n
                return n
        return self._send_each(run.datagrams, run.addr)

    def _send_each(self, datagrams: list[bytes], addr: Any) -> int:
        sock = self.sock
        for i, data in enumerate(datagrams):
            self.send_calls += 1
            try:
                sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return i
            except OSError as exc:
                log.debug("udp send error to %s: %s", addr, exc)
            else:
                self.datagrams_sent += 1
        return len(datagrams)

    def _gso_refused_by(self, addr: Any, exc: OSError) -> None:
        if not self._gso_worked:
            self.gso = False
            log.debug("UDP GSO refused (%s): one sendto per datagram on this socket", exc)
            return
        if len(self._gso_refused) >= MAX_GSO_REFUSED_DESTINATIONS:
            self._gso_refused.clear()
        if addr not in self._gso_refused:
            log.debug("UDP GSO refused for %s (%s): one sendto per datagram there", addr, exc)
        self._gso_refused.add(addr)

    def close(self) -> None:
        self.sock.close()


class NativeUdpSocket(UdpSocket):
    """A :class:`UdpSocket` whose batches are read and written by qh3's ``UdpSocketState``
    (quinn-udp; module docstring, "Batching in native code")."""

    def __init__(
        self, host: str, port: int, *, family: int | None = None, state_class: Any = None
    ) -> None:
        super().__init__(host, port, family=family, gso=False, gro=False)
        if state_class is None:
            state_class = _native_state_class()
            if state_class is None:
                self.sock.close()
                raise OSError("qh3's UdpSocketState is not available or is turned off")
        try:
            self._state: Any = state_class(self.sock.fileno())
            self.gso = self._state.max_gso_segments > 1
            self.gro = self._state.gro_segments > 1
        except Exception:
            self.sock.close()
            raise

    def stats(self) -> dict[str, int | bool]:
        return {**super().stats(), "native": True}

    def close(self) -> None:
        """Close the socket: the native state holds a duplicate of its descriptor, which
        goes with the state (else the port stayed bound until the state was collected)."""
        self._state = None
        super().close()

    def recv_batch(self) -> list[tuple[bytes, Any]]:
        """Every datagram waiting, up to about :data:`RECV_BATCH` (GRO split natively)."""
        out: list[tuple[bytes, Any]] = []
        if self._state is None:
            return out  # closed (the Python path would read nothing either)
        recv = self._state.recv
        while len(out) < RECV_BATCH:
            try:
                got = recv()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.debug("udp receive error: %s", exc)
                if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH):
                    break
                continue
            if not got:
                break
            self.recv_calls += 1
            out.extend(got)
        self.datagrams_received += len(out)
        return out

    def send_batch(self, datagrams: list[tuple[bytes, Any]]) -> bool:
        """Send a flush (with what waited), one native call per run of one destination;
        ``True`` when datagrams wait for writability."""
        pending = self.pending
        if self._state is None:
            pending.clear()  # closed: nothing can go out any more
            return False
        pending.extend(datagrams)
        send = self._state.send
        while pending:
            addr = pending[0][1]
            run: list[bytes] = []
            for data, to in pending:
                if to != addr:
                    break
                run.append(data)
            self.send_calls += 1
            try:
                sent = send(run, addr)
            except OSError as exc:
                sent = int(getattr(exc, "datagrams_sent", 0) or 0)
                self.datagrams_sent += sent
                for _ in range(sent):
                    pending.popleft()
                if exc.errno in _WOULD_BLOCK or isinstance(exc, BlockingIOError):
                    break
                log.debug("udp send error to %s: %s", addr, exc)
                if pending:
                    pending.popleft()  # the datagram it names is dropped, as a lost packet
                continue
            self.datagrams_sent += sent
            for _ in range(min(sent, len(run))):
                pending.popleft()
            if sent < len(run):
                break  # the kernel took a prefix only: the rest waits for writability
        while len(pending) > MAX_PENDING:
            pending.popleft()
            self.dropped += 1
        return bool(pending)
