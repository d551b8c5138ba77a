"""Protected publications (secure objects) through real relays over QUIC on 127.0.0.1.

1. A publication published with ``encrypt=True`` (each cipher suite) through an
   in-process relay (``serve_relay``) is retrieved bit-identical by a live
   consumer (SUBSCRIBE, served as the objects arrive), one that joins after
   layer 1 (its fill and subscription, served while the relay is still
   receiving) and a late one (FETCH, served from the relay's cache). The
   relay's cache is then walked: every cached object carries its Secure
   Object Key ID, and neither a known Data block nor the model name appears in
   any cached payload. The same search on an unprotected run finds both, so
   the search is able to find them.
2. A tampering relay, next to an honest one: it flips one ciphertext byte of an
   object, or replays an object's (valid) ciphertext one Group later. The
   consumer is ``kvcs fetch <tamperer> --also <honest> --require-encryption``
   in its own process: the object is discarded (``DECRYPTION_FAILED`` on
   stderr), recovered from the honest relay, the cache is bit-identical and
   the command exits 0.

Relays and publishers run in this process on asyncio. Every wait has a
deadline; the consumer process is killed by its PID if it outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvcs.adapters.cachefile import llama_descriptor, same_bits, synthetic
from kvcs.adapters.numpy_kv import KvDestination, layer_sections
from kvcs.transports.quic import asyncio_binding as b
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.moqt import events as ev
from kvcs_core.secobj import SUITE_NAMES, read_key_id
from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.names import Location

ROOT = Path(__file__).resolve().parents[2]
SCOPE_HEX = "3c" * 32
LAYERS, TOKENS, SEED, HEAD_DIM = 4, 64, 9, 64
KEY_ID = 5
WAIT = 30.0
SCENARIO_TIMEOUT = 120.0
PUB_ID = bytes(range(16, 32))
CACHE = [
    "--layers", str(LAYERS), "--kv-heads", "2", "--head-dim", str(HEAD_DIM),
    "--tokens", str(TOKENS), "--seed", str(SEED), "--scope-key", SCOPE_HEX,
]  # fmt: skip


def _source() -> Any:
    return synthetic(llama_descriptor(layers=LAYERS, kv_heads=2, head_dim=HEAD_DIM), TOKENS, SEED)


async def _until(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _cached(relay: Any) -> list[Any]:
    """Every Normal object in the relay's cache (its TrackStores)."""
    out = []
    for entry in relay._cache._entries.values():
        for obj in entry.store.objects_in(Location(0, 0)):
            if obj.status is ObjectStatus.NORMAL:
                out.append((bytes(entry.store.name.name), obj))
    return out


async def _through_relay(tmp: Path, suite: str | None) -> dict[str, Any]:
    tls = self_signed(tmp / "tls")
    trust = TlsConfig(cafile=tls.cafile)
    source = _source()
    cd = source.cd
    key = bytes.fromhex(SCOPE_HEX)
    encrypt = suite is not None
    cs = SUITE_NAMES[suite or "aes128gcm"]
    opts: dict[str, Any] = {
        "require_authenticity": False,
        "require_encryption": encrypt,
        "cipher_suite": cs,
    }
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as relay,
        b.connect(relay.url, tls=trust, timeout=WAIT) as producer,
        b.connect(relay.url, tls=trust, timeout=WAIT) as live_client,
        b.connect(relay.url, tls=trust, timeout=WAIT) as mid_client,
    ):
        pub = await producer.publish_cache(
            source.descriptor,
            key,
            source.tokens,
            publication_id=PUB_ID,
            encrypt=encrypt,
            cipher_suite=cs,
            key_id=KEY_ID,
        )
        live_dest = KvDestination(cd, TOKENS)
        live = live_client.retrieve_cache(
            source.descriptor, key, source.tokens, destinations=live_dest.buffer, **opts
        )
        # live: wait until the relay has the data tracks subscribed upstream
        await _until(lambda: len(relay.relay._cache) >= 3, "the live consumer's tracks")
        mid_dest = KvDestination(cd, TOKENS)
        mid = None
        for layer in range(cd.layers):
            s = layer_sections(source.k[layer], source.v[layer], cd)
            await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
            if layer == 1:  # a consumer joining mid-production: fill + live, cut-through
                mid = mid_client.retrieve_cache(
                    source.descriptor, key, source.tokens, destinations=mid_dest.buffer, **opts
                )
        await pub.finish()
        live_done = await live.result(timeout=WAIT)
        assert mid is not None
        mid_done = await mid.result(timeout=WAIT)
        async with b.connect(relay.url, tls=trust, timeout=WAIT) as late_client:
            late_dest = KvDestination(cd, TOKENS)
            late = late_client.retrieve_cache(
                source.descriptor, key, source.tokens, destinations=late_dest.buffer, **opts
            )
            late_done = await late.result(timeout=WAIT)
            cached = _cached(relay.relay)
    return {
        "source": source,
        "live": (live_done, same_bits(source, live_dest, TOKENS)),
        "mid": (mid_done, same_bits(source, mid_dest, TOKENS)),
        "late": (late_done, same_bits(source, late_dest, TOKENS)),
        "cached": cached,
    }


@pytest.mark.parametrize("suite", [None, *sorted(SUITE_NAMES)])
def test_protected_publication_through_a_relay(tmp_path: Path, suite: str | None) -> None:
    out = asyncio.run(asyncio.wait_for(_through_relay(tmp_path, suite), SCENARIO_TIMEOUT))
    for name in ("live", "mid", "late"):
        done, identical = out[name]
        assert done.complete, (name, done)
        assert identical, name
    source = out["source"]
    cached = out["cached"]
    names = {n for n, _ in cached}
    assert any(n.startswith(b"manifest") for n in names) and b"k.raw.s0" in names, names
    # a Data block the consumer received (layer 2, block 1 of K: its first 64 bytes)
    sections = layer_sections(source.k[2], source.v[2], source.cd)
    block = bytes(memoryview(sections.k[1]))[:64]
    model = str(source.descriptor["model"]).encode()
    everything = b"".join(obj.payload_bytes() for _, obj in cached)
    if suite is None:
        assert block in everything and model in everything  # the search finds them in clear
        assert all(read_key_id(obj.properties) is None for _, obj in cached)
    else:
        assert block not in everything
        assert model not in everything
        for _, obj in cached:  # forwarded and cached with its Key ID, untouched
            found = read_key_id(obj.properties)
            assert found is not None and found[0] == KEY_ID


# --- 2. a tampering relay and an honest one, the consumer in its own process ----------------

TAMPERED = Location(2, 1)


def tamper(relay: Any, how: str, done: list[Any]) -> None:
    """Rewrite the relay's input: ``flip`` one ciphertext byte of the object at TAMPERED,
    or ``move`` (replay) the valid ciphertext of the object one Group below into it."""
    original: Callable[..., bool] = relay.handle_session_event
    seen: dict[tuple[int, int], Any] = {}

    def handle(session: Any, event: Any, now: float) -> bool:
        if type(event) is ev.ObjectReceived and event.status is ObjectStatus.NORMAL:
            loc = event.location
            if loc.group == TAMPERED.group - 1 and loc.object == TAMPERED.object:
                seen[(event.request_id, loc.object)] = event
            if loc == TAMPERED and read_key_id(event.properties) is not None:
                if how == "flip":
                    data = bytearray(event.payload)
                    data[len(data) // 2] ^= 0x10
                    event = attrs.evolve(event, payload=memoryview(bytes(data)))
                    done.append(loc)
                else:
                    below = seen.get((event.request_id, loc.object))
                    if below is not None:
                        event = attrs.evolve(
                            event, payload=below.payload, properties=below.properties
                        )
                        done.append(loc)
        return original(session, event, now)

    relay.handle_session_event = handle


async def _tampered(tmp: Path, how: str) -> tuple[int, list[dict[str, Any]], str, list[Any]]:
    tls = self_signed(tmp / "tls")
    trust = TlsConfig(cafile=tls.cafile)
    source = _source()
    cd = source.cd
    key = bytes.fromhex(SCOPE_HEX)
    done: list[Any] = []
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as tamperer,
        b.serve_relay("127.0.0.1:0", tls=tls) as honest,
    ):
        tamper(tamperer.relay, how, done)
        async with (
            b.connect(tamperer.url, tls=trust, timeout=WAIT) as to_tamperer,
            b.connect(honest.url, tls=trust, timeout=WAIT) as to_honest,
        ):
            pubs = [
                await c.publish_cache(
                    source.descriptor, key, source.tokens, publication_id=PUB_ID, encrypt=True
                )
                for c in (to_tamperer, to_honest)
            ]
            for layer in range(cd.layers):
                s = layer_sections(source.k[layer], source.v[layer], cd)
                for pub in pubs:
                    await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
            for pub in pubs:
                await pub.finish()
            err = (tmp / "fetch.err").open("w")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvcs", "fetch", tamperer.url, "--also", honest.url,
                "--ca", str(tls.cafile), "--require-encryption", "--json",
                "--fetch-timeout", "60", "--stall-timeout", "2", *CACHE,
                cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )  # fmt: skip
            err.close()
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), WAIT * 2)
                status = proc.returncode
            finally:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
    lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    assert status is not None
    return status, lines, (tmp / "fetch.err").read_text(), done


TAMPER_ATTEMPTS = 8
"""Runs of the tampering scenario until the tamperer was asked for its Object."""


@pytest.mark.parametrize("how", ["flip", "move"])
def test_a_tampering_relay_is_detected_and_the_honest_one_recovers(
    tmp_path: Path, how: str
) -> None:
    # `kvcs fetch --also` takes each Object from whichever relay answers first, so in some
    # runs it never asks the tamperer for the one Object it tampers with (seen on an idle
    # machine in about half the runs): the scenario is then run again, since only a run
    # in which the tampering happened can show it detected
    for attempt in range(TAMPER_ATTEMPTS):
        tmp = tmp_path / f"attempt-{attempt}"
        tmp.mkdir()
        status, lines, err, done = asyncio.run(
            asyncio.wait_for(_tampered(tmp, how), SCENARIO_TIMEOUT)
        )
        if done:
            break
    assert done, "the tampering relay never saw the object it tampers with"
    reports = [line for line in lines if line.get("event") == "done"]
    assert len(reports) == 1, (lines, err)
    report = reports[0]
    assert report["complete"] is True, (report, err)
    assert report["bit_identical"] is True, (report, err)
    assert report["discarded"] >= 1, (report, err)
    assert "DECRYPTION_FAILED" in err, err
    assert f"layer {TAMPERED.group} block {TAMPERED.object}" in err, err
    assert status == 0, (status, report, err)
