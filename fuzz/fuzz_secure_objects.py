"""Fuzz Secure Objects on receipt: ``read_key_id``, ``open_payload``, ``unprotect``.

Invariant: any input yields a parsed value or the typed rejection/error; any
other exception is a bug. Here: ``kvcs_core.kvcs.protection.open_payload``
never raises on peer bytes (it returns the plaintext or an ``Unopened`` with a
``ProtectionFailure``); ``read_key_id`` returns a value or raises
``KeyIdError``.

Input format (plain slicing, the same with and without atheris)::

    byte 0      bits 0..1: the cipher suite (0x0004, 0x0005, 0x0001, 0x0004);
                bit 2: structured mode; bit 3: encryption is required
    raw mode    byte 1: n; bytes 2..2+n: the IMMUTABLE_PROPERTIES value (a
                KVP list, usually holding a Key ID); then Group ID (u16),
                Object ID (u16), Publisher Priority (u8); the rest is the
                Object payload as a relay delivered it
    structured  bytes 1..5: Group ID (u16), Object ID (u16), Priority (u8);
                byte 6: the change (``CHANGES``); bytes 7..8: its argument
                (u16); the rest: the plaintext the publisher protects

Checked beyond "no other exception": in structured mode the publisher's
keyring protects the plaintext (Key ID 1) and the harness applies one change;
the oracle is exact: unchanged, the Object opens to exactly the plaintext;
every change of the ciphertext or of what the AAD authenticates (Group ID,
Object ID, priority, Key ID, track) is ``DECRYPTION_FAILED``; a removed Key
ID is ``NOT_PROTECTED`` when encryption is required, else the ciphertext is
passed on as it came (it is not the plaintext); a malformed Key ID property
is ``UNKNOWN_KEY_ID``. In raw mode a payload without a Key ID is returned
untouched (or ``NOT_PROTECTED`` when required); one that opens must be exactly
what the publisher's keyring makes of the plaintext it opened to (the seeds
hold such payloads; anything else opening would be a forgery).

Seeds: ``python3 fuzz/fuzz_secure_objects.py --make-corpus``.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from fuzzlib import fuzz_main

from kvcs_core.kvcs.protection import ProtectionFailure, Unopened, open_payload
from kvcs_core.secobj import (
    CipherSuite,
    KeyIdError,
    SecureObjectKeyring,
    key_id_properties,
    read_key_id,
)
from kvcs_core.secobj.derive import serialize_names
from kvcs_core.wire.codes import PropertyType
from kvcs_core.wire.kvp import KeyValuePair

SCOPE = bytes(range(7, 39))
TRACK = serialize_names([b"kvcs-1", b"fuzz"], b"k.raw.s0")
OTHER_TRACK = serialize_names([b"kvcs-1", b"fuzz"], b"v.raw.s0")
SUITES = (
    CipherSuite.AES_128_GCM_SHA256_128,
    CipherSuite.AES_256_GCM_SHA512_128,
    CipherSuite.AES_128_CTR_HMAC_SHA256_80,
    CipherSuite.AES_128_GCM_SHA256_128,
)
KEY_ID = 1
CHANGES = (
    "none",
    "flip",
    "truncate",
    "append",
    "group",
    "object",
    "priority",
    "key-id",
    "track",
    "no-key-id",
    "bad-key-id",
)
_LOC = struct.Struct(">HHB")
_IMMUTABLE = int(PropertyType.IMMUTABLE_PROPERTIES)


def _open(
    ring: SecureObjectKeyring,
    track: bytes,
    loc: tuple[int, int, int],
    props: tuple[KeyValuePair, ...],
    payload: bytes,
    require: bool,
) -> memoryview | Unopened:
    group, obj, prio = loc
    result = open_payload(
        ring,
        track,
        group_id=group,
        object_id=obj,
        priority=prio,
        properties=props,
        payload=memoryview(payload),
        require=require,
    )
    assert isinstance(result, memoryview | Unopened), type(result)
    if isinstance(result, Unopened):
        assert result.detail and isinstance(result.failure, ProtectionFailure)
    return result


def check_raw(suite: CipherSuite, require: bool, body: bytes) -> None:
    n = body[0] if body else 0
    inner = body[1 : 1 + n]
    rest = body[1 + n :]
    head = rest[: _LOC.size].ljust(_LOC.size, b"\0")
    loc = _LOC.unpack(head)
    payload = rest[_LOC.size :]
    props = (KeyValuePair(_IMMUTABLE, inner),)
    try:
        found = read_key_id(props)
    except KeyIdError:
        found = None
        malformed = True
    else:
        malformed = False
    ring = SecureObjectKeyring.from_scope_key(SCOPE, suite)
    result = _open(ring, TRACK, loc, props, payload, require)
    if malformed:
        assert isinstance(result, Unopened) and result.failure is ProtectionFailure.UNKNOWN_KEY_ID
    elif found is None:
        if require:
            assert isinstance(result, Unopened)
            assert result.failure is ProtectionFailure.NOT_PROTECTED
        else:
            assert isinstance(result, memoryview) and bytes(result) == payload
    elif isinstance(result, memoryview):
        # it authenticated: it must be exactly what the publisher's keyring makes of it
        kid, others = found
        again = SecureObjectKeyring.from_scope_key(SCOPE, suite).protect(
            TRACK, loc[0], loc[1], loc[2], kid, (bytes(result),), other_immutable=others
        )
        assert again == payload, "a payload the publisher did not make decrypted"


def check_structured(suite: CipherSuite, require: bool, body: bytes) -> None:
    head = body[:8].ljust(8, b"\0")
    group, obj, prio = _LOC.unpack(head[:5])
    change = CHANGES[head[5] % len(CHANGES)]
    arg = int.from_bytes(head[6:8], "big")
    plaintext = body[8:]
    sealed = SecureObjectKeyring.from_scope_key(SCOPE, suite).protect(
        TRACK, group, obj, prio, KEY_ID, (plaintext,)
    )
    props = key_id_properties(KEY_ID)
    track = TRACK
    loc = (group, obj, prio)
    data = bytearray(sealed)
    if change == "flip":
        data[arg % len(data)] ^= 1 << (arg % 8)
    elif change == "truncate":
        del data[len(data) - 1 - arg % len(data) :]
    elif change == "append":
        data += bytes([arg & 0xFF])
    elif change == "group":
        loc = (group ^ (1 + arg % 0xFFFF), obj, prio)
    elif change == "object":
        loc = (group, obj ^ (1 + arg % 0xFFFF), prio)
    elif change == "priority":
        loc = (group, obj, prio ^ (1 + arg % 0xFF))
    elif change == "key-id":
        props = key_id_properties(KEY_ID + 1 + arg)
    elif change == "track":
        track = OTHER_TRACK
    elif change == "no-key-id":
        props = ()
    elif change == "bad-key-id":
        props = (KeyValuePair(_IMMUTABLE, b"\x03\xff"),)  # type 3 with a length past the end
    ring = SecureObjectKeyring.from_scope_key(SCOPE, suite)
    result = _open(ring, track, loc, props, bytes(data), require)
    if change == "none":
        assert isinstance(result, memoryview) and bytes(result) == plaintext
    elif change == "no-key-id":
        if require:
            assert isinstance(result, Unopened)
            assert result.failure is ProtectionFailure.NOT_PROTECTED
        else:
            assert isinstance(result, memoryview) and bytes(result) == bytes(data)
    elif change == "bad-key-id":
        assert isinstance(result, Unopened) and result.failure is ProtectionFailure.UNKNOWN_KEY_ID
    else:
        assert isinstance(result, Unopened), f"{change} was not detected"
        assert result.failure is ProtectionFailure.DECRYPTION_FAILED, (change, result)


def check(data: bytes) -> None:
    mode = data[0] if data else 0
    suite = SUITES[mode & 3]
    require = bool(mode & 8)
    if mode & 4:
        check_structured(suite, require, data[1:])
    else:
        check_raw(suite, require, data[1:])


def make_corpus(out: Path) -> list[Path]:
    """Structured seeds (one per change and suite) and raw seeds built from them."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.bin"):
        old.unlink()
    written = []
    for i, change in enumerate(CHANGES):
        for s in range(3):
            mode = 4 | s | (8 if i % 2 else 0)
            body = _LOC.pack(i, i * 3, i * 11) + bytes([i]) + (i * 977).to_bytes(2, "big")
            seed = bytes([mode]) + body + bytes(range(i * 7 % 200))
            path = out / f"struct-{i:02d}-{change}-{s}.bin"
            path.write_bytes(seed)
            written.append(path)
    for s in range(3):  # raw: a real protected payload with its Key ID, as a relay gives it
        ring = SecureObjectKeyring.from_scope_key(SCOPE, SUITES[s])
        sealed = ring.protect(TRACK, 2, 3, 4, KEY_ID, (b"payload",))
        inner = key_id_properties(KEY_ID)[0].value
        assert isinstance(inner, bytes)
        seed = bytes([s, len(inner)]) + inner + _LOC.pack(2, 3, 4) + sealed
        path = out / f"raw-{s}.bin"
        path.write_bytes(seed)
        written.append(path)
    return written


def main() -> None:
    if "--make-corpus" in sys.argv:
        for path in make_corpus(Path(__file__).resolve().parent / "corpus" / "secure_objects"):
            print(path)
        return
    fuzz_main(check)


if __name__ == "__main__":
    main()
