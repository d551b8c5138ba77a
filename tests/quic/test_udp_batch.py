"""The batched UDP path (``transports/quic/udp.py``): GSO runs, GRO splitting, the fallback.

The run planning and the GRO helpers are pure functions, tested as such (with
a Hypothesis property). The socket tests use real sockets on 127.0.0.1: a GSO
send of N segments must arrive as N datagrams with the exact bytes; a GRO
socket must split the coalesced buffer back; with ``KVCS_UDP_GSO=0``, or when
the kernel refuses a GSO send (made real with ``SO_NO_CHECK``, which the
kernel does not allow with UDP_SEGMENT: EINVAL), every datagram still
arrives. A send that would block is injected by a wrapper around the real
socket (loopback UDP never blocks a sender: the kernel frees the send buffer
as soon as a datagram is queued at the receiver, or dropped), to check that
what was not sent waits in order. :class:`NativeUdpSocket` (qh3's quinn-udp
batches) is checked the same way on real sockets, and with a stand-in for the
native state that blocks or fails where told. Last, kvcs transfers a cache over
real QUIC on each stack and loop: through the native batches (what
:func:`open_udp` gives by default), with the Python path's GSO on
(``KVCS_UDP_NATIVE=0``: bit-identical, and GSO runs and GRO segments were used:
the endpoint hands the socket whole flushes) and with ``KVCS_UDP_GSO=0``
(bit-identical, one send call per datagram).
"""

from __future__ import annotations

import asyncio
import errno
import select
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from kvcs.adapters.cachefile import llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import KvDestination, layer_sections
from kvcs.transports.quic import asyncio_binding, trio_binding, udp
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs.transports.quic.udp import (
    GSO_MAX_BYTES,
    GSO_MAX_SEGMENTS,
    MAX_PENDING,
    SOL_UDP,
    UDP_GRO,
    NativeUdpSocket,
    Run,
    UdpSocket,
    gro_segment_size,
    open_udp,
    plan_runs,
    split_segments,
)

LINUX = sys.platform.startswith("linux")
SO_NO_CHECK = 11
"""Linux ``SO_NO_CHECK`` (no UDP checksums on send; GSO then fails with EINVAL)."""
WAIT = 10.0


def _sizes(runs: list[Run]) -> list[list[int]]:
    return [[len(d) for d in r.datagrams] for r in runs]


# --- run planning (pure) -------------------------------------------------------------------

A = ("127.0.0.1", 1000)
B = ("127.0.0.1", 2000)


def test_equal_sizes_make_one_run() -> None:
    runs = plan_runs([(bytes([i]) * 1200, A) for i in range(10)])
    assert len(runs) == 1
    assert runs[0].addr == A and runs[0].segment_size == 1200
    assert runs[0].datagrams == [bytes([i]) * 1200 for i in range(10)]


def test_a_shorter_datagram_ends_its_run() -> None:
    sizes = [1200, 1200, 1200, 700, 1200, 1200, 50, 40]
    runs = plan_runs([(b"x" * n, A) for n in sizes])
    assert _sizes(runs) == [[1200, 1200, 1200, 700], [1200, 1200, 50], [40]]
    assert [r.segment_size for r in runs] == [1200, 1200, 40]


def test_a_longer_datagram_starts_a_new_run() -> None:
    runs = plan_runs([(b"x" * n, A) for n in (500, 500, 1200, 1200, 1200)])
    assert _sizes(runs) == [[500, 500], [1200, 1200, 1200]]


def test_runs_are_per_destination_in_order() -> None:
    flush = []
    for i in range(6):
        flush.append((b"a%d" % i + b"." * 998, A))
        flush.append((b"b%d" % i + b"." * 998, B))
    flush.append((b"a-ack", A))
    runs = plan_runs(flush)
    assert [r.addr for r in runs] == [A, B]
    assert runs[0].datagrams == [d for d, a in flush if a == A]
    assert runs[1].datagrams == [d for d, a in flush if a == B]


def test_at_most_64_segments_per_run() -> None:
    runs = plan_runs([(b"x" * 100, A)] * 130)
    assert [len(r.datagrams) for r in runs] == [GSO_MAX_SEGMENTS, GSO_MAX_SEGMENTS, 2]


def test_at_most_65507_bytes_per_run() -> None:
    runs = plan_runs([(b"x" * 1452, A)] * 60)
    per_run = GSO_MAX_BYTES // 1452  # 45
    assert [len(r.datagrams) for r in runs] == [per_run, 60 - per_run]
    assert all(sum(map(len, r.datagrams)) <= GSO_MAX_BYTES for r in runs)
    big = plan_runs([(b"x" * 16000, A)] * 9)
    assert [len(r.datagrams) for r in big] == [4, 4, 1]


def test_a_short_last_segment_that_would_pass_the_byte_cap_starts_a_run() -> None:
    runs = plan_runs([(b"x" * 1452, A)] * 45 + [(b"y" * 500, A)])
    assert _sizes(runs) == [[1452] * 45, [500]]


def test_empty_and_oversized_datagrams_are_runs_of_their_own() -> None:
    runs = plan_runs([(b"x" * 10, A), (b"", A), (b"x" * 10, A), (b"z" * 70000, A), (b"x", A)])
    assert _sizes(runs) == [[10], [0], [10], [70000], [1]]


@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1, 40, 1199, 1200, 1452, 16000]), st.sampled_from([A, B])),
        max_size=300,
    ),
    st.integers(1, 70),
)
def test_runs_keep_every_datagram_in_order_within_the_bounds(
    items: list[tuple[int, Any]], cap: int
) -> None:
    flush = [(bytes([i % 251]) * n, addr) for i, (n, addr) in enumerate(items)]
    runs = plan_runs(flush, max_segments=cap)
    for addr in (A, B):
        assert [d for r in runs if r.addr == addr for d in r.datagrams] == [
            d for d, a in flush if a == addr
        ]
    for r in runs:
        assert r.datagrams
        if len(r.datagrams) > 1:
            assert len(r.datagrams) <= cap
            assert sum(map(len, r.datagrams)) <= GSO_MAX_BYTES
            assert all(len(d) == r.segment_size for d in r.datagrams[:-1])
            assert 0 < len(r.datagrams[-1]) <= r.segment_size


def test_split_segments_and_the_gro_control_message() -> None:
    data = b"".join(bytes([i]) * 1200 for i in range(5)) + b"end"
    assert split_segments(data, 1200) == [bytes([i]) * 1200 for i in range(5)] + [b"end"]
    assert split_segments(b"x" * 1200, 1200) == [b"x" * 1200]
    assert split_segments(b"x" * 10, 0) == [b"x" * 10]
    cmsg = (SOL_UDP, UDP_GRO, (1200).to_bytes(4, sys.byteorder))
    assert gro_segment_size([cmsg]) == 1200
    assert gro_segment_size([(socket.SOL_SOCKET, UDP_GRO, cmsg[2])]) is None
    assert gro_segment_size([]) is None


# --- real sockets on 127.0.0.1 ---------------------------------------------------------------


def _segments(n: int, size: int = 1200, last: int = 333) -> list[bytes]:
    out = [bytes([i % 256]) * (size - 2) + i.to_bytes(2, "big") for i in range(n - 1)]
    return [*out, b"L" * last]


def _receive(rx: UdpSocket, count: int, timeout: float = WAIT) -> list[tuple[bytes, Any]]:
    """Read until ``count`` datagrams arrived (or ``timeout``)."""
    got: list[tuple[bytes, Any]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        select.select([rx.sock], [], [], 0.2)
        got += rx.recv_batch()
    return got


def _gso_sender() -> UdpSocket:
    tx = UdpSocket("127.0.0.1", 0, gso=True)
    if not tx.gso:
        tx.close()
        pytest.skip("this kernel refuses UDP_SEGMENT (GSO needs Linux 4.18 or later)")
    return tx


def test_a_gso_send_arrives_as_separate_datagrams() -> None:
    tx, rx = _gso_sender(), UdpSocket("127.0.0.1", 0, gro=False)
    try:
        segs = _segments(20)
        assert not tx.send_batch([(d, rx.address) for d in segs])
        assert (tx.send_calls, tx.gso_runs, tx.datagrams_sent) == (1, 1, 20)
        got = _receive(rx, 20)
        assert [d for d, _ in got] == segs
        assert {a for _, a in got} == {tx.address}
        assert rx.gro_segments == 0 and rx.recv_calls == 20
    finally:
        tx.close()
        rx.close()


def test_a_gro_socket_splits_the_coalesced_buffer() -> None:
    tx, rx = _gso_sender(), UdpSocket("127.0.0.1", 0, gro=True)
    if not rx.gro:
        pytest.skip("this kernel refuses UDP_GRO (needs Linux 5.0 or later)")
    try:
        first, second = _segments(30), _segments(7, size=1452, last=1452)
        tx.send_batch([(d, rx.address) for d in first] + [(d, rx.address) for d in second])
        assert tx.gso_runs == 2
        got = _receive(rx, 37)
        assert [d for d, _ in got] == first + second
        # over loopback a GSO send reaches a GRO socket as one buffer, split here
        assert rx.recv_calls == 2 and rx.gro_segments == 37 and rx.datagrams_received == 37
    finally:
        tx.close()
        rx.close()


def test_gso_off_by_environment_sends_one_datagram_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCS_UDP_GSO", "0")
    tx, rx = UdpSocket("127.0.0.1", 0), UdpSocket("127.0.0.1", 0)
    try:
        assert not tx.gso and not tx.gro and not rx.gro
        segs = _segments(12)
        assert not tx.send_batch([(d, rx.address) for d in segs])
        assert (tx.send_calls, tx.gso_runs, tx.datagrams_sent) == (12, 0, 12)
        assert [d for d, _ in _receive(rx, 12)] == segs
    finally:
        tx.close()
        rx.close()
    monkeypatch.setenv("KVCS_UDP_GSO", "1")
    on = UdpSocket("127.0.0.1", 0)
    try:
        assert on.gso is LINUX
    finally:
        on.close()


def test_a_refused_first_gso_send_turns_gso_off_and_still_delivers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tx, rx = _gso_sender(), UdpSocket("127.0.0.1", 0, gro=False)
    tx.sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)  # the kernel now answers EINVAL
    try:
        segs = _segments(10)
        with caplog.at_level("DEBUG", logger="kvcs.quic"):
            tx.send_batch([(d, rx.address) for d in segs[:5]])
            tx.send_batch([(d, rx.address) for d in segs[5:]])
        assert not tx.gso and tx.gso_runs == 0
        assert tx.send_calls == 1 + 10  # the refused sendmsg, then one sendto each
        assert sum("GSO refused" in r.getMessage() for r in caplog.records) == 1
        assert [d for d, _ in _receive(rx, 10)] == segs
    finally:
        tx.close()
        rx.close()


def test_a_refusal_after_gso_worked_affects_that_destination_only() -> None:
    tx = _gso_sender()
    rx1, rx2 = UdpSocket("127.0.0.1", 0, gro=False), UdpSocket("127.0.0.1", 0, gro=False)
    try:
        segs = _segments(6)
        tx.send_batch([(d, rx1.address) for d in segs])
        assert tx.gso_runs == 1
        tx.sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
        tx.send_batch([(d, rx2.address) for d in segs])
        assert tx.gso and tx.gso_runs == 1
        calls = tx.send_calls
        tx.send_batch([(d, rx2.address) for d in segs])  # no second refused sendmsg
        assert tx.send_calls == calls + 6
        assert [d for d, _ in _receive(rx1, 6)] == segs
        assert [d for d, _ in _receive(rx2, 12)] == segs + segs
    finally:
        tx.close()
        rx1.close()
        rx2.close()


class _BlockingSocket:
    """The real socket, but chosen send calls fail with EAGAIN (as a full buffer would)."""

    def __init__(self, sock: socket.socket, block_calls: set[int]) -> None:
        self.sock = sock
        self.block_calls = block_calls
        self.calls = 0

    def _maybe_block(self) -> None:
        self.calls += 1
        if self.calls in self.block_calls:
            raise BlockingIOError(errno.EAGAIN, "would block")

    def sendmsg(self, *args: Any) -> int:
        self._maybe_block()
        return self.sock.sendmsg(*args)

    def sendto(self, *args: Any) -> int:
        self._maybe_block()
        return self.sock.sendto(*args)


@pytest.mark.parametrize(
    ("mode", "blocked_calls", "sent_first"),
    [
        # GSO runs to rx1 of 54 (the byte cap at 1200 bytes) and 16, to rx2 of 9: the 2nd blocks
        ("gso", {2, 4}, 54),
        # one sendto per datagram: the 30th blocks (twice)
        ("each", {30, 31}, 29),
        # GSO refused for rx1 after it worked elsewhere: its run goes one by one; call 10 blocks
        ("gso-refused", {10}, 7),
    ],
)
def test_a_blocked_send_keeps_the_rest_in_order(
    mode: str, blocked_calls: set[int], sent_first: int
) -> None:
    tx = UdpSocket("127.0.0.1", 0, gso=False) if mode == "each" else _gso_sender()
    rx0, rx1, rx2 = (UdpSocket("127.0.0.1", 0, gro=False) for _ in range(3))
    real = tx.sock
    try:
        tx.sock = _BlockingSocket(real, blocked_calls)  # type: ignore[assignment]
        if mode == "gso-refused":
            tx.send_batch([(d, rx0.address) for d in _segments(3)])  # call 1: GSO works
            assert tx.gso_runs == 1
            real.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)  # call 2 is refused
        to1, to2 = _segments(70), _segments(9)
        flush = [(d, rx1.address) for d in to1] + [(d, rx2.address) for d in to2]
        assert tx.send_batch(flush)
        waiting = list(tx.pending)
        assert [d for d, a in waiting if a == rx1.address] == to1[sent_first:]
        assert [d for d, a in waiting if a == rx2.address] == to2
        for _ in range(5):  # writable again (a later call may block once more)
            if not tx.send_batch([]):
                break
        assert not tx.pending and tx.dropped == 0
        assert [d for d, _ in _receive(rx1, 70)] == to1
        assert [d for d, _ in _receive(rx2, 9)] == to2
        assert tx.datagrams_sent == 79 + (3 if mode == "gso-refused" else 0)
    finally:
        tx.sock = real
        for s in (tx, rx0, rx1, rx2):
            s.close()


def test_a_stuck_socket_drops_the_oldest_beyond_the_bound() -> None:
    tx = UdpSocket("127.0.0.1", 0, gso=True)
    real = tx.sock
    try:
        tx.sock = _BlockingSocket(real, set(range(1, 100)))  # type: ignore[assignment]
        flush = [(i.to_bytes(4, "big"), A) for i in range(MAX_PENDING + 100)]
        assert tx.send_batch(flush)
        assert tx.dropped == 100
        assert [d for d, _ in tx.pending] == [d for d, _ in flush[100:]]
    finally:
        tx.sock = real
        tx.close()


# --- the native batches (qh3's UdpSocketState) ---------------------------------------------


def _native() -> NativeUdpSocket:
    s = open_udp("127.0.0.1", 0)
    if not isinstance(s, NativeUdpSocket):
        s.close()
        pytest.skip("qh3's UdpSocketState is not available here")
    return s


def test_open_udp_gives_the_native_batches_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVCS_UDP_GSO", raising=False)
    monkeypatch.delenv("KVCS_UDP_NATIVE", raising=False)
    s = _native()
    assert s.stats()["native"] is True
    s.close()
    for env in ("KVCS_UDP_NATIVE", "KVCS_UDP_GSO"):
        with monkeypatch.context() as m:
            m.setenv(env, "0")
            s = open_udp("127.0.0.1", 0)
            assert type(s) is UdpSocket and "native" not in s.stats()
            s.close()


def test_closing_a_native_socket_frees_its_port() -> None:
    s = _native()
    port = s.address[1]
    s.close()
    assert s.recv_batch() == [] and not s.send_batch([(b"x", A)])  # closed: quietly nothing
    again = UdpSocket("127.0.0.1", port)  # the native state's duplicate went with it
    assert again.address[1] == port
    again.close()


def test_native_batches_keep_each_destinations_order() -> None:
    tx = _native()
    rx1, rx2 = _native(), UdpSocket("127.0.0.1", 0, gro=False)
    try:
        to1, to2 = _segments(150), _segments(9, size=900)
        flush = (
            [(d, rx1.address) for d in to1[:100]]
            + [(d, rx2.address) for d in to2]
            + [(d, rx1.address) for d in to1[100:]]
        )
        assert not tx.send_batch(flush)
        assert tx.datagrams_sent == 159 and tx.send_calls == 3  # one call per run
        got1, got2 = _receive(rx1, 150), _receive(rx2, 9)
        assert [d for d, _ in got1] == to1 and [d for d, _ in got2] == to2
        assert {a for _, a in got1} == {tx.address} and {a for _, a in got2} == {tx.address}
        assert rx1.datagrams_received == 150 and rx1.recv_calls < 150  # batched
    finally:
        for s in (tx, rx1, rx2):
            s.close()


class _FakeState:
    """Stands in for ``UdpSocketState``: the calls in ``script`` (1-based) send only that
    many datagrams, then raise OSError with ``errno`` and ``datagrams_sent``."""

    max_gso_segments = 64
    gro_segments = 64

    def __init__(self, fd: int, script: dict[int, tuple[int, int]] | None = None) -> None:
        self.script = script or {}
        self.calls = 0
        self.sent: list[tuple[bytes, Any]] = []

    def recv(self) -> list[tuple[bytes, Any]]:
        return []

    def send(self, datagrams: list[bytes], addr: Any) -> int:
        self.calls += 1
        if self.calls in self.script:
            n, code = self.script[self.calls]
            self.sent += [(d, addr) for d in datagrams[:n]]
            exc = OSError(code, "scripted")
            exc.datagrams_sent = n  # type: ignore[attr-defined]
            raise exc
        self.sent += [(d, addr) for d in datagrams]
        return len(datagrams)


def _scripted(script: dict[int, tuple[int, int]]) -> tuple[NativeUdpSocket, _FakeState]:
    states: list[_FakeState] = []

    def make(fd: int) -> _FakeState:
        states.append(_FakeState(fd, script))
        return states[-1]

    return NativeUdpSocket("127.0.0.1", 0, state_class=make), states[0]


def test_native_would_block_keeps_the_rest_and_an_error_drops_one_datagram() -> None:
    to_a, to_b = _segments(10), _segments(4)
    flush = [(d, A) for d in to_a] + [(d, B) for d in to_b]
    # call 1: 6 to A go out, then would block; the rest waits, in order
    tx, state = _scripted({1: (6, errno.EAGAIN)})
    try:
        assert tx.send_batch(flush)
        assert list(tx.pending) == flush[6:] and tx.datagrams_sent == 6
        assert not tx.send_batch([])  # writable again
        assert state.sent == flush and tx.dropped == 0
    finally:
        tx.close()
    # call 1: 3 go out, then a hard error: the 4th is dropped, the rest still goes
    tx, state = _scripted({1: (3, errno.EMSGSIZE)})
    try:
        assert not tx.send_batch(flush)
        assert state.sent == flush[:3] + flush[4:] and not tx.pending
        assert tx.datagrams_sent == len(flush) - 1
    finally:
        tx.close()


def test_a_stuck_native_socket_drops_the_oldest_beyond_the_bound() -> None:
    tx, _ = _scripted({i: (0, errno.EAGAIN) for i in range(1, 100)})
    try:
        flush = [(i.to_bytes(4, "big"), A) for i in range(MAX_PENDING + 100)]
        assert tx.send_batch(flush)
        assert tx.dropped == 100
        assert [d for d, _ in tx.pending] == [d for d, _ in flush[100:]]
    finally:
        tx.close()


def test_the_probe_is_linux_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not udp.offload_enabled()
    s = UdpSocket("127.0.0.1", 0, gso=True, gro=True)
    try:
        assert not s.gso and not s.gro
    finally:
        s.close()


# --- kvcs over real QUIC with GSO on -----------------------------------------------------------

SCOPE_KEY = bytes(range(32))
TOKENS = 96
LOOPS = {"asyncio": asyncio_binding, "trio": trio_binding}
try:
    import qh3  # noqa: F401

    HAVE_QH3 = True
except ImportError:
    HAVE_QH3 = False


def _run(loop: str, fn: Callable[[], Awaitable[Any]], timeout: float = 60.0) -> Any:
    if loop == "trio":

        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await fn()

        return trio.run(bounded)
    return asyncio.run(asyncio.wait_for(fn(), timeout))


async def _transfer(b: ModuleType, stack: str, tls: TlsConfig) -> dict[str, dict[str, Any]]:
    source = synthetic(llama_descriptor(layers=4, kv_heads=4, head_dim=64), TOKENS, 5)
    cd = source.cd
    dest = KvDestination(cd, TOKENS)
    trust = TlsConfig(cafile=tls.cafile)
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls, stack=stack) as server,
        b.connect(server.url, tls=trust, stack=stack, timeout=WAIT) as producer,
    ):
        pub = await producer.publish_cache(source.descriptor, SCOPE_KEY, source.tokens)
        for layer in range(cd.layers):
            s = layer_sections(source.k[layer], source.v[layer], cd)
            await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
        await pub.finish()
        await pub.drained(timeout=3 * WAIT)
        async with b.connect(server.url, tls=trust, stack=stack, timeout=WAIT) as consumer:
            r = consumer.retrieve_cache(
                source.descriptor,
                SCOPE_KEY,
                source.tokens,
                destinations=dest.buffer,
                require_authenticity=False,
            )
            result = await r.result(timeout=3 * WAIT)
            assert result.complete, r.events
            stats = {
                "relay": server.driver.udp.stats(),
                "producer": producer.driver.udp.stats(),
                "consumer": consumer.driver.udp.stats(),
            }
    for layer in range(cd.layers):
        k, v = dest.as_engine_arrays(layer)
        assert np.array_equal(k, source.k[layer]) and np.array_equal(v, source.v[layer])
    return stats


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return self_signed(tmp_path_factory.mktemp("tls"))


STACKS = [
    "aioquic",
    pytest.param("qh3", marks=pytest.mark.skipif(not HAVE_QH3, reason="qh3 is not installed")),
]


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_kvcs_over_quic_uses_the_native_batches(
    loop: str, stack: str, tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCS_UDP_GSO", raising=False)
    monkeypatch.delenv("KVCS_UDP_NATIVE", raising=False)
    _native().close()  # (skips where it is not available)
    stats = _run(loop, lambda: _transfer(LOOPS[loop], stack, tls))
    for who, s in stats.items():
        assert s["native"] and s["dropped"] == 0, (who, s)
    # the cache went out in batches and arrived in batches (the consumer's ACKs may
    # well go one per flush)
    relay, producer, consumer = stats["relay"], stats["producer"], stats["consumer"]
    assert relay["send_calls"] < relay["datagrams_sent"], relay
    assert producer["send_calls"] < producer["datagrams_sent"], producer
    assert relay["recv_calls"] < relay["datagrams_received"], relay
    assert consumer["recv_calls"] < consumer["datagrams_received"], consumer


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_kvcs_over_quic_uses_gso_and_gro(
    loop: str, stack: str, tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCS_UDP_GSO", raising=False)
    monkeypatch.setenv("KVCS_UDP_NATIVE", "0")  # the Python path's GSO and GRO
    probe = UdpSocket("127.0.0.1", 0)
    gso, gro = probe.gso, probe.gro
    probe.close()
    if not gso:
        pytest.skip("this kernel refuses UDP_SEGMENT (the fallback is tested with GSO off)")
    stats = _run(loop, lambda: _transfer(LOOPS[loop], stack, tls))
    for who, s in stats.items():
        assert s["gso"] and s["dropped"] == 0, (who, s)
    # the endpoint handed the socket whole flushes: the cache went out in GSO runs
    relay, producer, consumer = stats["relay"], stats["producer"], stats["consumer"]
    assert relay["gso_runs"] > 0 and relay["send_calls"] < relay["datagrams_sent"], relay
    assert producer["gso_runs"] > 0 and producer["send_calls"] < producer["datagrams_sent"]
    if gro:  # and arrived coalesced, split again by the receiving socket
        assert relay["gro_segments"] > 0 and consumer["gro_segments"] > 0, stats


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_kvcs_over_quic_with_gso_off(
    loop: str, stack: str, tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCS_UDP_GSO", "0")
    stats = _run(loop, lambda: _transfer(LOOPS[loop], stack, tls))
    for who, s in stats.items():
        assert not s["gso"] and not s["gro"] and s["gso_runs"] == 0, (who, s)
        assert s["send_calls"] == s["datagrams_sent"] > 0 and s["gro_segments"] == 0, (who, s)
