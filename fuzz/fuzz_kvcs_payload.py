"""Fuzz the KVCS object payload checks: ``verify_object``, ``parse_header``, ``check_object``.

Invariant: any input yields a parsed value or the typed rejection/error; any
other exception is a bug. Here: ``verify_object`` and the consumer's
``_verify.check_object`` never raise on peer bytes; they return the Data or a
typed rejection, and they agree with each other.

Two modes, chosen by bit 7 of the first byte.

**Raw mode** (bit 7 clear): the input is the payload as it came off the wire
(plain slicing, the same with and without atheris)::

    byte 0      bit 0 takes Group/Object ID from the header's Layer and Block
                Index (so the location checks pass and the fuzzer gets past
                them); bit 1 passes the header's own Component, Codec, Token
                Count and Token Start as the expected context; bit 2 passes the
                header's Data Digest as the listed digest; bit 3 hands the
                payload over as a ``memoryview`` slice of a larger
                ``bytearray`` instead of ``bytes``
    bytes 1..8  Group ID and Object ID (u32 big-endian each), unless bit 0
    rest        the Object payload

Checked beyond "no other exception":

* ``parse_header`` agrees with ``verify_object`` (a header rejection is the
  same rejection; otherwise the same header);
* a ``VerifiedObject``'s ``data`` is a zero-copy slice of the payload buffer
  (``data.obj`` is the buffer given), exactly the octets after the 68-octet
  header, ``Data Length`` of them, and SHA-256 of it is the Data Digest; the
  header re-encodes to the payload's first 68 octets; and
  ``build_payload_parts`` over that Data rebuilds the header (Flags and
  Reserved zero) - so a verified payload round-trips;
* a rejection after the header was decoded carries that header;
* ``check_object`` (the consumer's fast path, then its full check) given the
  header's own context agrees with ``verify_object`` (bits 0..2 all set).

**Structured mode** (bit 7 set): the input *describes* an Object; the harness
builds it with the right Magic, Version, Data Length and SHA-256 Data Digest
over the fuzzed Data and applies at most one fuzzer-chosen corruption, so
nearly every execution gets past the header checks into the context checks,
the digests and what the consumer does with a verified Object::

    byte 0       bits 0..3: verify_object is given the expected Component and
                 Codec (bit 0), Token Count (bit 1), Token Start (bit 2), the
                 listed digest (bit 3, hex-decoded the way the consumer reads
                 a manifest's ``object_digests``); bit 4: the payload is a
                 memoryview slice of a larger bytearray; bit 5: the codec's
                 Data Length given to check_object is off by a few octets
    bytes 1..27  Component (1, mod 3), Layer (4), Block Index (4), Token Start
                 (8), Token Count (4), Codec (2), Flags (2), Reserved (2)
    byte 28      the corruption (``MUTATIONS``), modulo their number
    bytes 29..32 its argument (u32)
    rest         the Data

The oracle is exact: an uncorrupted Object must verify (Flags and Reserved are
ignored on receipt, whatever their value) with its Data a zero-copy view, and
each corruption must be refused with *its* reason (every check before it passes
by construction; a corruption of a context check forces that context to be
given). ``check_object``, which always gets the full context, must agree with
``verify_object`` given the same, and refuse a wrong codec Data Length as
DATA_LENGTH. A self-consistent forgery (Data changed, Data Digest recomputed)
verifies unless the listed digest is given, and then it is
LISTED_DIGEST_MISMATCH. A verified Object is then copied into a destination
buffer at its block's offset, the way the consumer places it, and the
neighbouring blocks must be untouched.

Seeds: ``python3 fuzz/fuzz_kvcs_payload.py --make-corpus`` writes the
structured ones (``struct-*.bin``, one or more per corruption) next to the raw
ones.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

from fuzzlib import fuzz_main

from kvcs_core.kvcs._consumer_events import DiscardReason
from kvcs_core.kvcs._verify import ObjectVerdict, check_object
from kvcs_core.kvcs.names import Component
from kvcs_core.kvcs.payload import (
    HEADER_LEN,
    MAGIC,
    VERSION,
    ObjectHeader,
    ObjectRejected,
    ObjectRejectReason,
    VerifiedObject,
    build_payload_parts,
    parse_header,
    verify_object,
)

_HEADER_REASONS = frozenset(
    {
        ObjectRejectReason.TRUNCATED_HEADER,
        ObjectRejectReason.BAD_MAGIC,
        ObjectRejectReason.BAD_VERSION,
        ObjectRejectReason.BAD_COMPONENT,
    }
)
PAD = 3
"""Octets before the payload in the ``memoryview`` variant (an unaligned slice)."""


def split(data: bytes) -> tuple[int, int, int, bytes]:
    """``(mode, group_id, object_id, payload)`` of a fuzz input."""
    mode = data[0] if data else 0
    ids = data[1:9].ljust(8, b"\0")
    return mode, int.from_bytes(ids[:4], "big"), int.from_bytes(ids[4:], "big"), data[9:]


def check(data: bytes) -> None:
    if data[:1] and data[0] & 0x80:
        check_structured(data)
    else:
        check_raw(data)


def check_raw(data: bytes) -> None:
    mode, group_id, object_id, payload = split(data)
    if mode & 8:
        backing = bytearray(b"\xa5" * PAD + payload + b"\x5a" * PAD)
        buf: bytes | memoryview = memoryview(backing)[PAD : PAD + len(payload)]
    else:
        buf = payload
    parsed = parse_header(buf)
    assert isinstance(parsed, ObjectHeader | ObjectRejected), type(parsed)
    kwargs: dict[str, object] = {}
    if isinstance(parsed, ObjectHeader):
        if mode & 1:
            group_id, object_id = parsed.layer, parsed.block_index
        if mode & 2:
            kwargs.update(
                expected_component=parsed.component,
                expected_codec=parsed.codec,
                expected_token_count=parsed.token_count,
                expected_token_start=parsed.token_start,
            )
        if mode & 4:
            kwargs["listed_digest"] = parsed.data_digest
    got = verify_object(buf, group_id=group_id, object_id=object_id, **kwargs)  # type: ignore[arg-type]

    if isinstance(got, ObjectRejected):
        assert isinstance(got.reason, ObjectRejectReason), got
        if isinstance(parsed, ObjectHeader) and mode & 7 == 7:
            # the consumer's check, given the same (full) context, refuses it alike
            verdict = check_object(
                memoryview(buf),
                layer=group_id,
                object_id=object_id,
                component=parsed.component,
                codec=parsed.codec,
                block_tokens=parsed.token_count,
                token_start=parsed.token_start,
                listed_digest=parsed.data_digest,
                data_length=parsed.data_length,
            )
            assert verdict == ObjectVerdict(DiscardReason.PAYLOAD_CHECK, got.reason, got.detail), (
                f"check_object {verdict} but verify_object {got}"
            )
        if isinstance(parsed, ObjectRejected):
            assert got == parsed, f"verify_object {got} but parse_header {parsed}"
            assert got.reason in _HEADER_REASONS, got
        else:
            assert got.reason not in _HEADER_REASONS, f"{got} for a header that parses"
            assert got.header == parsed, "rejection carries another header"
            if mode & 7 == 7:
                # every context check passes by construction: only the length
                # and the digest can fail
                assert got.reason in (
                    ObjectRejectReason.DATA_TRUNCATED,
                    ObjectRejectReason.TRAILING_OCTETS,
                    ObjectRejectReason.DIGEST_MISMATCH,
                ), got
        return

    assert isinstance(got, VerifiedObject), f"verify_object returned {type(got).__name__}"
    assert isinstance(parsed, ObjectHeader), "verified a payload whose header is rejected"
    h = got.header
    assert h == parsed, "verify_object and parse_header disagree on the header"
    assert (h.layer, h.block_index) == (group_id, object_id)
    view = got.data
    assert isinstance(view, memoryview), type(view)
    expected_obj = backing if mode & 8 else payload
    assert view.obj is expected_obj, "Data is not a view of the payload buffer"
    assert len(payload) == HEADER_LEN + h.data_length == HEADER_LEN + len(view)
    assert bytes(view) == payload[HEADER_LEN:], "Data is not the octets after the header"
    assert hashlib.sha256(view).digest() == h.data_digest, "digest does not match the Data"
    assert h.encode() == payload[:HEADER_LEN], "header does not re-encode to its octets"
    head, data_view = build_payload_parts(
        component=h.component,
        layer=h.layer,
        block_index=h.block_index,
        token_start=h.token_start,
        token_count=h.token_count,
        codec=h.codec,
        data=view,
    )
    assert bytes(data_view) == payload[HEADER_LEN:]
    if h.flags == 0 and h.reserved == 0:
        assert head == payload[:HEADER_LEN], "build_payload_parts gives another header"
    again = verify_object(head + bytes(data_view), group_id=h.layer, object_id=h.block_index)
    assert isinstance(again, VerifiedObject), f"rebuilt payload rejected: {again}"
    consumer = check_object(
        memoryview(buf),
        layer=group_id,
        object_id=object_id,
        component=h.component,
        codec=h.codec,
        block_tokens=h.token_count,
        token_start=h.token_start,
        listed_digest=h.data_digest,
        data_length=h.data_length,
    )
    assert not isinstance(consumer, ObjectVerdict), f"check_object refused it: {consumer}"
    assert bytes(consumer[0]) == bytes(view) and consumer[1] == h.data_digest


# --- structured mode ------------------------------------------------------------

_FIELDS = struct.Struct(">BIIQIHHH")
"""Component, Layer, Block Index, Token Start, Token Count, Codec, Flags, Reserved."""
_SPEC_LEN = 1 + _FIELDS.size + 1 + 4
"""Mode byte, the fields, the corruption and its argument: where the Data starts."""
_U32 = 0xFFFF_FFFF

R = ObjectRejectReason
MUTATIONS: tuple[tuple[str, ObjectRejectReason | None], ...] = (
    ("none", None),
    ("magic", R.BAD_MAGIC),
    ("version", R.BAD_VERSION),
    ("component", R.BAD_COMPONENT),
    ("truncate-header", R.TRUNCATED_HEADER),
    ("group-id", R.LAYER_MISMATCH),
    ("object-id", R.BLOCK_INDEX_MISMATCH),
    ("length-long", R.DATA_TRUNCATED),
    ("length-short", R.TRAILING_OCTETS),
    ("trailing", R.TRAILING_OCTETS),
    ("expected-component", R.COMPONENT_MISMATCH),
    ("expected-codec", R.CODEC_MISMATCH),
    ("expected-token-count", R.TOKEN_COUNT_MISMATCH),
    ("expected-token-start", R.TOKEN_START_MISMATCH),
    ("listed-digest", R.LISTED_DIGEST_MISMATCH),
    ("header-digest", R.DIGEST_MISMATCH),
    ("data-byte", R.DIGEST_MISMATCH),
    ("forgery", None),  # Data changed, digest recomputed: only a listed digest tells
)
"""The corruptions of structured mode and the reason each must be refused with."""


def split_structured(data: bytes) -> tuple[int, tuple[int, ...], int, int, bytes]:
    """``(mode, fields, corruption, argument, Data)`` of a structured-mode input."""
    spec = data[:_SPEC_LEN].ljust(_SPEC_LEN, b"\0")
    fields = _FIELDS.unpack_from(spec, 1)
    corruption = spec[1 + _FIELDS.size] % len(MUTATIONS)
    arg = int.from_bytes(spec[-4:], "big")
    return data[0], fields, corruption, arg, data[_SPEC_LEN:]


def check_structured(data: bytes) -> None:
    mode, fields, corruption, arg, body = split_structured(data)
    component = Component(1 + fields[0] % 3)
    _, layer, block, token_start, token_count, codec, flags, reserved = fields
    what, reason = MUTATIONS[corruption]
    digest = hashlib.sha256(body).digest()
    listed = digest
    group_id, object_id = layer, block
    exp_component, exp_codec, exp_count, exp_start = component, codec, token_count, token_start
    wire_component, magic, version, length = int(component), MAGIC, VERSION, len(body)
    head_digest = digest
    payload_data = body
    force = 0  # context that the corruption needs verify_object to be given
    nz = arg | 1  # a non-zero XOR mask from the argument
    if what == "magic":
        magic ^= nz
    elif what == "version":
        version ^= nz & 0xFF
    elif what == "component":
        wire_component = (0, *range(4, 256))[arg % 253]
    elif what == "group-id":
        group_id = layer ^ nz
    elif what == "object-id":
        object_id = block ^ nz
    elif what == "length-long":
        if length == _U32:
            return  # cannot say more than u32 (not reachable with a fuzz input)
        length = min(_U32, length + 1 + arg % 1024)
    elif what == "length-short":
        if not body:
            what, reason = "trailing", R.TRAILING_OCTETS
        else:
            length -= 1 + arg % len(body)
    elif what == "expected-component":
        exp_component = Component(1 + (int(component) + arg % 2) % 3)
        force = 1
    elif what == "expected-codec":
        exp_codec = codec ^ (nz & 0xFFFF)
        force = 1
    elif what == "expected-token-count":
        exp_count = token_count ^ nz
        force = 2
    elif what == "expected-token-start":
        exp_start = token_start ^ nz
        force = 4
    elif what == "listed-digest":
        listed = bytes([listed[0] ^ 1]) + listed[1:]
        force = 8
    elif what == "header-digest":
        head_digest = bytes([digest[0] ^ (nz & 0xFF)]) + digest[1:]
        listed = head_digest  # the manifest agrees with the header; the Data does not
    elif what == "data-byte":
        if not body:
            what, reason = "header-digest", R.DIGEST_MISMATCH
            head_digest = bytes([digest[0] ^ (nz & 0xFF)]) + digest[1:]
            listed = head_digest
        else:
            at = arg % len(body)
            payload_data = body[:at] + bytes([body[at] ^ (nz & 0xFF)]) + body[at + 1 :]
    elif what == "forgery":
        at = arg % (len(body) + 1)
        payload_data = body[:at] + bytes([nz & 0xFF]) + body[at:]  # one octet more
        length = len(payload_data)
        head_digest = hashlib.sha256(payload_data).digest()  # recomputed: self-consistent
        if mode & 8:
            reason = R.LISTED_DIGEST_MISMATCH  # the manifest still lists the original
    header = struct.pack(
        ">IBBHIIQIHHI32s",
        magic,
        version,
        wire_component,
        flags,
        layer,
        block,
        token_start,
        token_count,
        codec,
        reserved,
        length,
        head_digest,
    )
    payload = header + payload_data
    if what == "truncate-header":
        payload = payload[: arg % HEADER_LEN]
    elif what == "trailing":
        payload += (arg & 0xFF).to_bytes(1, "big") * (1 + arg % 7)
    if mode & 0x10:
        backing = bytearray(b"\xa5" * PAD + payload + b"\x5a" * PAD)
        buf: bytes | memoryview = memoryview(backing)[PAD : PAD + len(payload)]
    else:
        buf = payload

    given = mode | force
    kwargs: dict[str, object] = {}
    if given & 1:
        kwargs.update(expected_component=exp_component, expected_codec=exp_codec)
    if given & 2:
        kwargs["expected_token_count"] = exp_count
    if given & 4:
        kwargs["expected_token_start"] = exp_start
    if given & 8:
        kwargs["listed_digest"] = bytes.fromhex(listed.hex())  # as read from a manifest
    got = verify_object(buf, group_id=group_id, object_id=object_id, **kwargs)  # type: ignore[arg-type]
    if reason is None:
        assert isinstance(got, VerifiedObject), f"{what}: refused a good Object: {got}"
        assert bytes(got.data) == payload_data and got.header.data_digest == head_digest
        assert (got.header.flags, got.header.reserved) == (flags, reserved)
        assert got.data.obj is (backing if mode & 0x10 else payload), "Data was copied"
    else:
        assert isinstance(got, ObjectRejected), f"{what}: accepted, expected {reason.name}"
        assert got.reason is reason, f"{what}: {got.reason.name}, expected {reason.name}"
        assert (got.header is None) == (reason in _HEADER_REASONS), got

    # The consumer's check always has the full context (and the listed digest).
    data_length = len(payload_data)  # what the codec gives: the Data actually sent
    if mode & 0x20:
        data_length = max(0, data_length + (arg % 5 + 1) * (1 if arg & 0x100 else -1))
    verdict = check_object(
        memoryview(buf),
        layer=group_id,
        object_id=object_id,
        component=exp_component,
        codec=exp_codec,
        block_tokens=exp_count,
        token_start=exp_start,
        listed_digest=listed if (given & 8 or what != "forgery") else None,
        data_length=data_length,
    )
    full = verify_object(
        buf,
        group_id=group_id,
        object_id=object_id,
        expected_component=exp_component,
        expected_codec=exp_codec,
        expected_token_count=exp_count,
        expected_token_start=exp_start,
        listed_digest=listed if (given & 8 or what != "forgery") else None,
    )
    if isinstance(full, ObjectRejected):
        assert verdict == ObjectVerdict(DiscardReason.PAYLOAD_CHECK, full.reason, full.detail), (
            f"{what}: check_object {verdict} but verify_object {full}"
        )
        if reason is not None and what != "forgery":
            assert full.reason is reason, f"{what}: full context gives {full.reason.name}"
        return
    if len(full.data) != data_length:
        assert isinstance(verdict, ObjectVerdict), f"{what}: wrong Data Length accepted"
        assert (verdict.reason, verdict.check) == (DiscardReason.DATA_LENGTH, None), verdict
        return
    assert not isinstance(verdict, ObjectVerdict), f"{what}: check_object refused {verdict}"
    view, seen_digest = verdict
    assert isinstance(view, memoryview) and view.obj is full.data.obj, "Data was copied"
    assert bytes(view) == payload_data and seen_digest == head_digest

    # What the consumer does with it: one copy into its place in the layer.
    slot = block % 3
    dest = bytearray(b"\xee" * (3 * data_length))
    dest[slot * data_length : (slot + 1) * data_length] = view
    assert dest[slot * data_length : (slot + 1) * data_length] == payload_data
    rest = dest[: slot * data_length] + dest[(slot + 1) * data_length :]
    assert rest == b"\xee" * (2 * data_length), "a neighbouring block was written"


def structured_input(
    *,
    mode: int = 0x8F,
    component: int = 0,
    layer: int = 0,
    block: int = 0,
    token_start: int = 0,
    token_count: int = 16,
    codec: int = 1,
    flags: int = 0,
    reserved: int = 0,
    corruption: str = "none",
    arg: int = 0,
    data: bytes = b"",
) -> bytes:
    """A structured-mode fuzz input (what :func:`split_structured` takes apart)."""
    index = [name for name, _ in MUTATIONS].index(corruption)
    fields = _FIELDS.pack(component, layer, block, token_start, token_count, codec, flags, reserved)
    return bytes([mode | 0x80]) + fields + bytes([index]) + arg.to_bytes(4, "big") + data


def make_corpus(out: Path) -> list[Path]:
    """Structured seeds, one or more per corruption; the raw seeds are kept."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("struct-*.bin"):
        old.unlink()
    written = []
    datas = (b"", b"\x01", bytes(range(64)), bytes(200))
    for i, (name, _) in enumerate(MUTATIONS):
        for j, data in enumerate(datas if name in ("none", "forgery", "data-byte") else datas[2:3]):
            seed = structured_input(
                mode=(0x8F, 0x80, 0x9F, 0xA7)[(i + j) % 4],
                component=i % 3,
                layer=i,
                block=j,
                token_start=(j * 16),
                token_count=16,
                codec=1 + i % 3,
                flags=i % 2,
                reserved=(i * 7) % 3,
                corruption=name,
                arg=i * 31 + j,
                data=data,
            )
            path = out / f"struct-{i:02d}-{name}-{j}.bin"
            path.write_bytes(seed)
            written.append(path)
    return written


def main() -> None:
    if "--make-corpus" in sys.argv:
        for path in make_corpus(Path(__file__).resolve().parent / "corpus" / "kvcs_payload"):
            print(path)
        return
    fuzz_main(check)


if __name__ == "__main__":
    main()
