"""Fuzz the KVCS object payload checks: ``verify_object`` and ``parse_header``.

Invariant: any input yields a parsed value or the typed rejection/error; any
other exception is a bug. Here: ``verify_object`` never raises on peer bytes,
it returns a ``VerifiedObject`` or an ``ObjectRejected``.

Input format (plain slicing, the same with and without atheris)::

    byte 0      mode: bit 0 takes Group/Object ID from the header's Layer and
                Block Index (so the location checks pass and the fuzzer gets
                past them); bit 1 passes the header's own Component, Codec,
                Token Count and Token Start as the expected context; bit 2
                passes the header's Data Digest as the listed digest; bit 3
                hands the payload over as a ``memoryview`` slice of a larger
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
* a rejection after the header was decoded carries that header.
"""

from __future__ import annotations

import hashlib

from fuzzlib import fuzz_main

from kvcs_core.kvcs.payload import (
    HEADER_LEN,
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


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
