"""A malicious relay over real QUIC on 127.0.0.1 (issue 10 finding 4).

Two relays serve the same signed publication: ``honest`` and ``forger``. The
forger is a real relay (``serve_relay``) whose input is tampered: one Object of a
late layer (after the last manifest version a live consumer has seen) has its
Data changed and the Data Digest of its 68-octet header recomputed, so the Object
is self-consistent (``verify_object`` without a listed digest accepts it) and is
cached and forwarded as if it were the producer's.

The forger also withholds every manifest version after the first, so nothing it
forwards is ever listed by a version that came through it. A consumer process,
``kvcs fetch <forger> --also <honest> --producer-key PEM``, subscribes to the
forger first (the publication is announced there first). With the producer key
required, no layer is usable until a verified manifest version lists its
digests: the consumer stalls, follows the manifest through the honest relay,
whose version lists the producer's digest, so the forgery is detected
(``LISTED_DIGEST_MISMATCH``), discarded and recovered from the honest relay: the
cache is bit-identical and the command exits 0. (Before, every layer was
reported ready and the retrieval complete, with the forged bytes: exit 1, "the
received cache differs".)

Relays and publishers run in this process on asyncio; the consumer is the CLI in
its own process. Every wait has a deadline; the process is killed by its PID if
it outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvcs.adapters.cachefile import llama_descriptor, synthetic
from kvcs.adapters.numpy_kv import layer_sections
from kvcs.transports.quic import asyncio_binding as b
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.kvcs.names import Component
from kvcs_core.kvcs.payload import (
    HEADER_LEN,
    ObjectHeader,
    VerifiedObject,
    parse_header,
    verify_object,
)
from kvcs_core.kvcs.publisher import ManifestSigner
from kvcs_core.moqt import events as ev
from kvcs_core.wire.codes import ObjectStatus

ROOT = Path(__file__).resolve().parents[2]
SCOPE_HEX = "5a" * 32
LAYERS, TOKENS, SEED = 12, 64, 5
CACHE = [
    "--layers", str(LAYERS), "--kv-heads", "2", "--head-dim", "64",
    "--tokens", str(TOKENS), "--seed", str(SEED), "--scope-key", SCOPE_HEX,
]  # fmt: skip
FORGED = (Component.V, 10, 1)
"""(component, layer, block): layer 10 comes after the version listing layers 0..7 and
before the last one (at completion), so a live consumer receives it before any
verified manifest lists its digest."""
WAIT = 30.0
STALL = 2.0
"""The consumer's --stall-timeout: how long it waits for a manifest version (the forger
withholds them) before following the manifest through the other relay."""
SCENARIO_TIMEOUT = 120.0
PUB_ID = bytes(range(16))


def forge(payload: memoryview) -> bytes | None:
    """The self-consistent forgery of ``payload`` if it is the Object ``FORGED`` names."""
    header = parse_header(payload)
    if not isinstance(header, ObjectHeader):
        return None
    if (header.component, header.layer, header.block_index) != FORGED:
        return None
    data = bytearray(payload[HEADER_LEN:])
    data[0] ^= 0xFF
    digest = hashlib.sha256(data).digest()
    forged = bytes(payload[: HEADER_LEN - 32]) + digest + bytes(data)
    return forged


def tamper(relay: Any, forged: list[Any], subscribed: list[bytes], withheld: list[Any]) -> None:
    """Make ``relay`` cache and forward ``forge``\\ d payloads (its input is rewritten), and
    withhold every manifest version after the first (so that nothing it forwards would
    ever be listed by a version that came through it)."""
    original: Callable[..., bool] = relay.handle_session_event

    def handle(session: Any, event: Any, now: float) -> bool:
        if type(event) is ev.ObjectReceived and event.status is ObjectStatus.NORMAL:
            if event.location.group > 0 and not isinstance(
                parse_header(event.payload), ObjectHeader
            ):
                withheld.append(event.location)  # a later manifest version: withheld
                return True
            bad = forge(event.payload)
            if bad is not None:
                check = verify_object(
                    bad, group_id=event.location.group, object_id=event.location.object
                )
                forged.append((event.location, check))
                event = attrs.evolve(event, payload=memoryview(bad))
        elif isinstance(event, ev.SubscribeRequested):
            subscribed.append(bytes(event.track.name))
        return original(session, event, now)

    relay.handle_session_event = handle


async def _until(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _scenario(tmp: Path) -> tuple[int, list[dict[str, Any]], str, list[Any]]:
    tls = self_signed(tmp / "tls")
    trust = TlsConfig(cafile=tls.cafile)
    producer = Ed25519PrivateKey.generate()
    pem = tmp / "producer.pem"
    pem.write_bytes(
        producer.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    source = synthetic(llama_descriptor(layers=LAYERS, kv_heads=2, head_dim=64), TOKENS, SEED)
    cd = source.cd
    key = bytes.fromhex(SCOPE_HEX)
    forged: list[Any] = []
    subscribed: list[bytes] = []
    withheld: list[Any] = []
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as honest,
        b.serve_relay("127.0.0.1:0", tls=tls) as forger,
    ):
        tamper(forger.relay, forged, subscribed, withheld)
        async with (
            b.connect(forger.url, tls=trust, timeout=WAIT) as to_forger,
            b.connect(honest.url, tls=trust, timeout=WAIT) as to_honest,
        ):
            signer = ManifestSigner(producer, b"producer")
            pubs = [
                await to_forger.publish_cache(
                    source.descriptor, key, source.tokens, publication_id=PUB_ID, signer=signer
                )
            ]
            err = (tmp / "fetch.err").open("w")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvcs", "fetch", forger.url,
                "--also", honest.url, "--ca", str(tls.cafile), "--producer-key", str(pem),
                "--json", "--fetch-timeout", "60", "--stall-timeout", str(STALL), *CACHE,
                cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )  # fmt: skip
            err.close()
            try:
                # live: the consumer subscribed to the forger's data tracks before layer 0
                await _until(
                    lambda: any(n.startswith((b"k.", b"v.")) for n in subscribed),
                    "the consumer's data SUBSCRIBE at the forger",
                )
                # the same publication, also through the honest relay (announced second)
                pubs.append(
                    await to_honest.publish_cache(
                        source.descriptor, key, source.tokens, publication_id=PUB_ID, signer=signer
                    )
                )
                for layer in range(cd.layers):
                    s = layer_sections(source.k[layer], source.v[layer], cd)
                    for pub in pubs:
                        await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
                    await asyncio.sleep(0.02)
                for pub in pubs:
                    await pub.finish()
                assert proc.stdout is not None
                out, _ = await asyncio.wait_for(proc.communicate(), WAIT * 2)
                status = proc.returncode
            finally:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
    lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    assert status is not None
    assert withheld, "the forger withheld no manifest version"
    return status, lines, (tmp / "fetch.err").read_text(), forged


def test_a_forging_relay_is_detected_and_the_honest_one_recovers_the_cache(
    tmp_path: Path,
) -> None:
    status, lines, err, forged = asyncio.run(
        asyncio.wait_for(_scenario(tmp_path), SCENARIO_TIMEOUT)
    )
    assert forged, "the forger never saw the Object it forges"
    for _loc, check in forged:  # the forgery is self-consistent: its own digest verifies
        assert isinstance(check, VerifiedObject), check
    done = [line for line in lines if line.get("event") == "done"]
    assert len(done) == 1, (lines, err)
    report = done[0]
    assert report["complete"] is True, (report, err)
    assert report["bit_identical"] is True, (report, err)
    assert report["discarded"] >= 1, (report, err)
    assert "LISTED_DIGEST_MISMATCH" in err, err
    assert status == 0, (status, report, err)
