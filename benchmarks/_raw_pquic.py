"""The raw pipeline of ``bench_relay_pipeline.py`` on aiopquic (``--stack pquic``).

picoquic owns its socket and runs on its own thread, so there is no sans-I/O
connection to drive as the other stacks' raw workers do; these workers use
aiopquic's own asyncio API (``aiopquic.asyncio.connect`` / ``serve``), the way
its users write a raw QUIC program, and keep every other rule of the raw
pipeline: the sender writes every (layer, K or V) on its own unidirectional
stream in 32 KiB pieces; a forwarder is a server towards both neighbours (or a
client of its upstream, the second of a tree), its sink is the first
connection it accepts and its source the upstream or the second one, and it
writes every stream's data on, in arrival order, to stream ``4i + 3`` of the
sink as it reads it; the receiver places each stream in a buffer touched
beforehand. The sender's writes wait for room with ``send_stream_data_drained``
(aiopquic's backpressure for raw QUIC); the forwarder's are retried every
millisecond while aiopquic refuses them for want of room (its rings and the
forwarder's queue hold what the sink has not taken, as a relay's cache would).

The parent protocol is the other workers': JSON lines on stdout (``listening``
with the port, ``upstream-ready``, ``ready`` with the sender's digest,
``done`` with the receiver's clock and digest), ``go`` and ``stop`` on stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import time
from typing import Any

from aiopquic.asyncio import connect, serve
from aiopquic.asyncio.protocol import QuicConnectionProtocol
from aiopquic.quic import events as qe
from bench_quic_transfer import StdinLines, digest_of, emit, section_streams

from kvcs.adapters.cachefile import llama_descriptor, synthetic
from kvcs.transports.quic.config import quic_configuration
from kvcs.transports.quic.stack import load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.kvsp import CompatibilityDescriptor

SEED = 7
RETRY = 0.001
"""Seconds before a write that found no room is tried again."""


def _descriptor(layers: int) -> dict[str, Any]:
    return dict(llama_descriptor(layers=layers))  # bench_relay_pipeline.descriptor


def _free_port() -> int:
    # aiopquic binds the wildcard address and does not report a port it chose itself
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client_config(args: argparse.Namespace) -> Any:
    return quic_configuration(
        load_stack("pquic"), is_client=True, tls=TlsConfig(verify=False), server_name="127.0.0.1"
    )


def _server_config(args: argparse.Namespace) -> Any:
    tls = self_signed(tempfile.mkdtemp(prefix="kvcs-bench-pquic-"))
    return quic_configuration(load_stack("pquic"), is_client=False, tls=tls)


async def _write(quic: Any, sid: int, data: bytes, end: bool) -> None:
    """One write, retried while aiopquic has no room for it (``BufferError``)."""
    while True:
        try:
            quic.send_stream_data(sid, data, end)
            return
        except BufferError:
            await asyncio.sleep(RETRY)


async def _wait_stop(stdin: StdinLines) -> None:
    await stdin.wait("stop")


class _Events:
    """A protocol class whose events go to ``handler`` (set once the connection exists)."""

    def __init__(self) -> None:
        handler = self

        class Protocol(QuicConnectionProtocol):  # type: ignore[misc]
            def quic_event_received(self, event: Any) -> None:
                handler.on_event(self, event)

        self.protocol_class = Protocol

    def on_event(self, protocol: Any, event: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


async def sender(args: argparse.Namespace) -> None:
    streams = section_streams(synthetic(_descriptor(args.layers), args.tokens, SEED))
    digest = digest_of(p for s in streams for p in s)
    stdin = StdinLines()
    async with connect("127.0.0.1", args.port, configuration=_client_config(args)) as proto:
        quic = proto._quic
        emit("ready", digest=digest)
        await stdin.wait("go")
        for sections in streams:
            sid = quic.get_next_available_stream_id(is_unidirectional=True)
            for i, piece in enumerate(sections):
                await quic.send_stream_data_drained(sid, bytes(piece), i == len(sections) - 1)
        await _wait_stop(stdin)


async def receiver(args: argparse.Namespace) -> None:
    cd = CompatibilityDescriptor(_descriptor(args.layers))
    stream_len = (args.tokens // cd.block_tokens) * cd.section_size
    total = 2 * cd.layers * stream_len
    buf = bytearray(total)
    view = memoryview(buf)
    pos: dict[int, int] = {}
    state = {"got": 0, "t0": 0.0}
    finished = asyncio.Event()
    stdin = StdinLines()

    class Receiving(_Events):
        def on_event(self, protocol: Any, e: Any) -> None:
            if isinstance(e, qe.StreamDataReceived) and e.data:
                off = pos.get(e.stream_id)
                if off is None:
                    off = (e.stream_id >> 2) * stream_len
                n = len(e.data)
                if off + n <= total:
                    view[off : off + n] = e.data
                pos[e.stream_id] = off + n
                state["got"] += n
                if state["got"] >= total and not finished.is_set():
                    state["t1"] = time.monotonic()
                    finished.set()

    events = Receiving()
    async with connect(
        "127.0.0.1",
        args.port,
        configuration=_client_config(args),
        create_protocol=events.protocol_class,
    ) as proto:
        emit("ready")
        await stdin.wait("go")
        state["t0"] = time.monotonic()
        await finished.wait()
        emit(
            "done", t0=state["t0"], t1=state["t1"], bytes=state["got"],
            digest=digest_of(iter([view])),
        )  # fmt: skip
        proto._quic.close(0)
        await _wait_stop(stdin)


async def forwarder(args: argparse.Namespace) -> None:
    accepted: list[Any] = []
    queue: asyncio.Queue[tuple[int, bytes, bool]] = asyncio.Queue()
    stdin = StdinLines()
    upstream: list[Any] = []

    def source() -> Any:
        if upstream:
            return upstream[0]
        return accepted[1] if len(accepted) > 1 else None

    class Forwarding(_Events):
        def on_event(self, protocol: Any, e: Any) -> None:
            if not protocol._quic.configuration.is_client and protocol not in accepted:
                accepted.append(protocol)  # in order of arrival: the first is the sink
            if isinstance(e, qe.StreamDataReceived) and protocol is source():
                # aiopquic hands a memoryview of its ring and takes only bytes: one copy
                queue.put_nowait(((e.stream_id >> 2) * 4 + 3, bytes(e.data), e.end_stream))

    events = Forwarding()

    async def write_on() -> None:
        while True:
            sid, data, end = await queue.get()
            sink = accepted[0]._quic
            await _write(sink, sid, data, end)

    port = _free_port()
    server = await serve(
        "0.0.0.0", port, configuration=_server_config(args),
        create_protocol=events.protocol_class,
    )  # fmt: skip
    writer = asyncio.ensure_future(write_on())
    try:
        emit("listening", port=port)
        if args.upstream_port:
            async with connect(
                "127.0.0.1",
                args.upstream_port,
                configuration=_client_config(args),
                create_protocol=events.protocol_class,
            ) as up:
                upstream.append(up)
                emit("upstream-ready")
                await _wait_stop(stdin)
        else:
            await _wait_stop(stdin)
    finally:
        writer.cancel()
        server.close()


def run(role: str, args: argparse.Namespace) -> None:
    main = {"raw-send": sender, "raw-recv": receiver, "raw-fwd": forwarder}[role]
    asyncio.run(main(args))
