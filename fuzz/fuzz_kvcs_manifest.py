"""Fuzz the KVCS manifest: strict JSON parse and the ``manifest.cose`` envelope.

Invariant: any input yields a parsed value or the typed rejection/error; any
other exception is a bug. Here: ``parse_manifest`` returns a ``Manifest`` or
raises ``ManifestError``; ``verify_manifest`` (with a fixed Ed25519 producer
key) returns the payload octets or a ``ManifestRejected``, never raises;
``Manifest.compat_id`` returns 16 octets or raises ``ManifestError``.

Input format (plain slicing, the same with and without atheris)::

    byte 0   mode: bit 0 reads the body as a ``manifest.cose`` payload (COSE_Sign1)
             and parses the payload it yields; otherwise the body is manifest
             JSON. Bit 1 (JSON only) also signs the body with the fixed key
             and verifies it. Bit 2 parses with ``max_size`` one octet below
             the body's length (must be ``TOO_LARGE``).
    rest     the body

Checked beyond "no other exception":

* an accepted manifest round-trips: ``parse_manifest(m.encode()) == m``, and
  the encoding is a fixed point (encoding the re-parsed value gives the same
  octets); its lookups (``digest_of``, ``segment_of_track``, ``token_start``)
  answer without raising;
* a COSE body that verifies is signed by the fixed key: re-signing its payload
  gives a payload that verifies to the same octets; a body we sign ourselves
  verifies to the body, and with any other kid is ``UNKNOWN_KID``.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric import ed25519
from fuzzlib import fuzz_main

from kvcs_core.kvcs.cose import (
    CoseRejectReason,
    ManifestRejected,
    sign_manifest,
    verify_manifest,
)
from kvcs_core.kvcs.manifest import (
    Manifest,
    ManifestError,
    ManifestErrorReason,
    parse_manifest,
)

KEY = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
"""The fixed producer key (the same as tests/test_kvcs_manifest.py's ED_KEY)."""
KID = b"fuzz-ed25519"
KEYS = {KID: KEY.public_key()}
MAX_LOOKUPS = 64


def parse(body: bytes, **kwargs: int) -> Manifest | ManifestError:
    try:
        m = parse_manifest(body, **kwargs)
    except ManifestError as e:
        assert isinstance(e.reason, ManifestErrorReason), e
        return e
    assert isinstance(m, Manifest), type(m)
    return m


def check_manifest(m: Manifest) -> None:
    enc = m.encode()
    again = parse_manifest(enc)
    assert again == m, "parse_manifest(m.encode()) != m"
    assert again.encode() == enc, "encoding is not deterministic"
    assert enc.isascii()
    try:
        cid = m.compat_id()
    except ManifestError as e:
        assert e.reason is ManifestErrorReason.BAD_COMPAT, e
    else:
        assert isinstance(cid, bytes) and len(cid) == 16, cid
    assert m.total_blocks >= 0
    lookups = 0
    for n, seg in enumerate(m.segments):
        assert m.token_start(n, 0) == seg.first_block * m.block_tokens
        for track in seg.tracks:
            assert m.segment_of_track(track) is seg
            for layer in (0, m.layers - 1, m.layers):
                for block in (0, seg.blocks - 1, seg.blocks):
                    lookups += 1
                    if lookups > MAX_LOOKUPS:
                        return
                    d = m.digest_of(track, layer, block)
                    assert d is None or len(d) == 32, d


def check_cose(body: bytes) -> None:
    got = verify_manifest(body, KEYS)
    if isinstance(got, ManifestRejected):
        assert isinstance(got.reason, CoseRejectReason), got
        return
    assert isinstance(got, bytes), f"verify_manifest returned {type(got).__name__}"
    resigned = sign_manifest(got, KEY, KID)
    assert verify_manifest(resigned, KEYS) == got
    parsed = parse(got)
    if isinstance(parsed, Manifest):
        check_manifest(parsed)


def check(data: bytes) -> None:
    mode = data[0] if data else 0
    body = data[1:]
    if mode & 1:
        check_cose(body)
        return
    got = parse(body)
    if isinstance(got, Manifest):
        check_manifest(got)
    if mode & 2:
        signed = sign_manifest(body, KEY, KID)
        assert verify_manifest(signed, KEYS) == body, "own signature does not verify"
        other = verify_manifest(signed, {b"someone-else": KEY.public_key()})
        assert isinstance(other, ManifestRejected), other
        assert other.reason is CoseRejectReason.UNKNOWN_KID, other
    if mode & 4 and body:
        small = parse(body, max_size=len(body) - 1)
        assert isinstance(small, ManifestError), "a manifest over max_size was accepted"
        assert small.reason is ManifestErrorReason.TOO_LARGE, small


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
