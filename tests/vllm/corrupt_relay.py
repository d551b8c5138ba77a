"""A real kvcs relay (``serve_relay``) below an upstream relay, that corrupts one Object.

``python corrupt_relay.py --upstream URL --upstream-ca PEM --cert-dir DIR --layer L
--block B [--component k|v]``

The relay is the library's own (QUIC on 127.0.0.1, port chosen by the OS, its own
self-signed certificate in DIR); only its input is tampered: the Object of the given
component, layer and block has one octet of its Data flipped as it arrives from
upstream, its 68-octet header (and Data Digest) left as they were. The relay caches
and forwards the corrupted Object like any other. It prints one JSON line
``{"event": "listening", "url": ..., "ca": ...}``, then ``{"event": "tampered", ...}``
for each corrupted Object, and runs until stdin closes (bounded by ``--run-for``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import attrs

from kvcs.transports.quic import asyncio_binding as b
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.kvcs.names import Component
from kvcs_core.kvcs.payload import HEADER_LEN, ObjectHeader, parse_header
from kvcs_core.moqt import events as ev
from kvcs_core.wire.codes import ObjectStatus


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def tamper(relay: Any, target: tuple[Component, int, int]) -> None:
    original = relay.handle_session_event

    def handle(session: Any, event: Any, now: float) -> bool:
        if type(event) is ev.ObjectReceived and event.status is ObjectStatus.NORMAL:
            header = parse_header(event.payload)
            if isinstance(header, ObjectHeader) and (
                (header.component, header.layer, header.block_index) == target
            ):
                data = bytearray(event.payload)
                data[HEADER_LEN] ^= 0x5A
                event = attrs.evolve(event, payload=memoryview(bytes(data)))
                _say(event="tampered", layer=header.layer, block=header.block_index)
        return bool(original(session, event, now))

    relay.handle_session_event = handle


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--upstream-ca", required=True)
    p.add_argument("--cert-dir", required=True)
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--block", type=int, required=True)
    p.add_argument("--component", default="k", choices=("k", "v"))
    p.add_argument("--run-for", type=float, default=600.0)
    args = p.parse_args()
    tls = self_signed(args.cert_dir)
    comp = Component.K if args.component == "k" else Component.V
    async with b.serve_relay(
        "127.0.0.1:0",
        tls=tls,
        upstream=args.upstream,
        upstream_tls=TlsConfig(cafile=args.upstream_ca),
    ) as relay:
        tamper(relay.relay, (comp, args.layer, args.block))
        _say(event="listening", url=relay.url, ca=tls.cafile)
        loop = asyncio.get_running_loop()
        stdin_closed = loop.run_in_executor(None, sys.stdin.read)
        deadline = time.monotonic() + args.run_for
        while not stdin_closed.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
