"""The 68-octet object payload and every End Subscriber check (profile 3.5)."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcs_core.kvcs.names import Component
from kvcs_core.kvcs.payload import (
    HEADER_LEN,
    MAGIC,
    ObjectHeader,
    ObjectRejected,
    ObjectRejectReason,
    PayloadEncodeError,
    VerifiedObject,
    build_payload_parts,
    data_digest,
    encode_header,
    parse_header,
    verify_object,
)
from tests._vectors import load_vectors

EXAMPLE = load_vectors("kvsp-vectors.json")["object_payload_example"]
R = ObjectRejectReason


def _payload(
    *,
    component: Component = Component.K,
    layer: int = 3,
    block_index: int = 5,
    token_start: int = 80,
    token_count: int = 16,
    codec: int = 0,
    data: bytes = bytes(range(64)),
) -> bytes:
    header, view = build_payload_parts(
        component=component,
        layer=layer,
        block_index=block_index,
        token_start=token_start,
        token_count=token_count,
        codec=codec,
        data=data,
    )
    return header + bytes(view)  # tests only: the library never concatenates


def _rejected(result: VerifiedObject | ObjectRejected) -> ObjectRejectReason:
    assert isinstance(result, ObjectRejected), result
    return result.reason


# --- the vector ------------------------------------------------------------------


def test_vector_decodes_and_reencodes_byte_for_byte() -> None:
    payload = bytes.fromhex(EXAMPLE["payload_hex"])
    data = bytes.fromhex(EXAMPLE["data_hex"])
    result = verify_object(
        payload,
        group_id=EXAMPLE["layer"],
        object_id=EXAMPLE["block_index"],
        expected_component=Component.K,
        expected_codec=EXAMPLE["codec"],
        expected_token_count=EXAMPLE["token_count"],
        expected_token_start=EXAMPLE["token_start"],
    )
    assert isinstance(result, VerifiedObject)
    h = result.header
    assert h.component is Component.K and Component.K.token == EXAMPLE["component"]
    assert (h.layer, h.block_index) == (EXAMPLE["layer"], EXAMPLE["block_index"])
    assert (h.token_start, h.token_count) == (EXAMPLE["token_start"], EXAMPLE["token_count"])
    assert (h.codec, h.flags, h.reserved) == (EXAMPLE["codec"], 0, 0)
    assert h.data_length == len(data) == 64
    assert h.data_digest == hashlib.sha256(data).digest()
    assert bytes(result.data) == data
    assert encode_header(h) + bytes(result.data) == payload
    header, view = build_payload_parts(
        component=Component.K,
        layer=EXAMPLE["layer"],
        block_index=EXAMPLE["block_index"],
        token_start=EXAMPLE["token_start"],
        token_count=EXAMPLE["token_count"],
        codec=EXAMPLE["codec"],
        data=data,
    )
    assert header == payload[:HEADER_LEN]
    assert bytes(view) == payload[HEADER_LEN:]


def test_header_layout_is_as_drawn() -> None:
    h = ObjectHeader(
        component=Component.KV,
        layer=0x01020304,
        block_index=0x05060708,
        token_start=0x1112131415161718,
        token_count=0x21222324,
        codec=0x3132,
        data_length=0x41424344,
        data_digest=bytes(range(32)),
        flags=0x5152,
        reserved=0x6162,
    )
    raw = h.encode()
    assert len(raw) == HEADER_LEN == 68
    assert raw[:4] == b"KVO1" == MAGIC.to_bytes(4, "big")
    assert raw[4:8] == bytes([1, 3, 0x51, 0x52])
    assert raw[8:16] == bytes.fromhex("0102030405060708")
    assert raw[16:24] == bytes.fromhex("1112131415161718")
    assert raw[24:28] == bytes.fromhex("21222324")
    assert raw[28:32] == bytes.fromhex("31326162")
    assert raw[32:36] == bytes.fromhex("41424344")
    assert raw[36:] == bytes(range(32))
    assert parse_header(raw) == h
    assert h.payload_length == HEADER_LEN + 0x41424344


# --- sending -----------------------------------------------------------------------


def test_build_is_scatter_gather_and_zero_copy() -> None:
    data = bytearray(b"\x07" * 100)
    header, view = build_payload_parts(
        component=Component.V,
        layer=0,
        block_index=0,
        token_start=0,
        token_count=4,
        codec=1,
        data=data,
    )
    assert isinstance(header, bytes) and len(header) == HEADER_LEN
    assert view.obj is data
    h = parse_header(header)
    assert isinstance(h, ObjectHeader)
    assert h.data_length == 100 and h.data_digest == data_digest(data)


def test_build_accepts_typed_contiguous_buffers() -> None:
    raw = bytearray(range(32))
    typed = memoryview(raw).cast("B", (4, 8))  # 2-D, like a tensor's memory
    header, view = build_payload_parts(
        component=Component.K,
        layer=1,
        block_index=2,
        token_start=8,
        token_count=4,
        codec=0,
        data=typed,
    )
    assert view.ndim == 1 and len(view) == 32 and view.obj is raw
    assert header[36:] == hashlib.sha256(raw).digest()
    with pytest.raises(ValueError, match="contiguous"):
        data_digest(memoryview(raw)[::2])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layer", 2**32),
        ("block_index", -1),
        ("token_start", 2**64),
        ("token_count", 2**32),
        ("codec", 0x10000),
        ("component", 4),
        ("component", 0),
        ("layer", True),
        ("codec", 1.0),
    ],
)
def test_build_rejects_fields_out_of_range(field: str, value: Any) -> None:
    kw: dict[str, Any] = {
        "component": Component.K,
        "layer": 0,
        "block_index": 0,
        "token_start": 0,
        "token_count": 1,
        "codec": 0,
        "data": b"x",
    }
    kw[field] = value
    with pytest.raises(PayloadEncodeError):
        build_payload_parts(**kw)


def test_header_digest_must_be_32_octets() -> None:
    with pytest.raises(PayloadEncodeError):
        ObjectHeader(
            component=Component.K,
            layer=0,
            block_index=0,
            token_start=0,
            token_count=1,
            codec=0,
            data_length=0,
            data_digest=bytes(31),
        )


# --- receiving: every check -----------------------------------------------------------


def test_valid_payload_verifies_with_all_context() -> None:
    payload = _payload()
    result = verify_object(
        payload,
        group_id=3,
        object_id=5,
        expected_component=Component.K,
        expected_codec=0,
        expected_token_count=16,
        expected_token_start=80,
        listed_digest=hashlib.sha256(bytes(range(64))).digest(),
    )
    assert isinstance(result, VerifiedObject)
    assert bytes(result.data) == bytes(range(64))


def _patch(payload: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(payload)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda p: p[:0], R.TRUNCATED_HEADER),
        (lambda p: p[:67], R.TRUNCATED_HEADER),
        (lambda p: _patch(p, 0, ">I", 0x4B564F32), R.BAD_MAGIC),
        (lambda p: b"OVK1" + p[4:], R.BAD_MAGIC),
        (lambda p: _patch(p, 4, ">B", 0), R.BAD_VERSION),
        (lambda p: _patch(p, 4, ">B", 2), R.BAD_VERSION),
        (lambda p: _patch(p, 5, ">B", 0), R.BAD_COMPONENT),
        (lambda p: _patch(p, 5, ">B", 4), R.BAD_COMPONENT),
        (lambda p: _patch(p, 8, ">I", 4), R.LAYER_MISMATCH),
        (lambda p: _patch(p, 12, ">I", 6), R.BLOCK_INDEX_MISMATCH),
        (lambda p: p[:-1], R.DATA_TRUNCATED),
        (lambda p: p[:HEADER_LEN], R.DATA_TRUNCATED),
        (lambda p: p + b"\x00", R.TRAILING_OCTETS),
        (lambda p: _patch(p, 32, ">I", 63), R.TRAILING_OCTETS),
        (lambda p: _patch(p, 32, ">I", 65), R.DATA_TRUNCATED),
        (lambda p: _patch(p, 32, ">I", 0xFFFFFFFF), R.DATA_TRUNCATED),
        (lambda p: p[:-1] + bytes([p[-1] ^ 1]), R.DIGEST_MISMATCH),
        (lambda p: _patch(p, 36, ">B", p[36] ^ 0x80), R.DIGEST_MISMATCH),
    ],
)
def test_each_mandatory_check(mutate: Any, reason: ObjectRejectReason) -> None:
    bad = mutate(_payload())
    assert _rejected(verify_object(bad, group_id=3, object_id=5)) is reason


def test_location_is_checked_against_the_object() -> None:
    payload = _payload()
    assert _rejected(verify_object(payload, group_id=2, object_id=5)) is R.LAYER_MISMATCH
    assert _rejected(verify_object(payload, group_id=3, object_id=0)) is R.BLOCK_INDEX_MISMATCH


@pytest.mark.parametrize(
    ("context", "reason"),
    [
        ({"expected_component": Component.V}, R.COMPONENT_MISMATCH),
        ({"expected_component": Component.KV}, R.COMPONENT_MISMATCH),
        ({"expected_codec": 1}, R.CODEC_MISMATCH),
        ({"expected_token_count": 15}, R.TOKEN_COUNT_MISMATCH),
        ({"expected_token_start": 96}, R.TOKEN_START_MISMATCH),
        ({"listed_digest": bytes(32)}, R.LISTED_DIGEST_MISMATCH),
    ],
)
def test_context_checks(context: dict[str, Any], reason: ObjectRejectReason) -> None:
    result = verify_object(_payload(), group_id=3, object_id=5, **context)
    assert _rejected(result) is reason
    assert isinstance(result, ObjectRejected) and result.header is not None and result.detail


def test_flags_and_reserved_are_ignored_on_receipt() -> None:
    payload = _patch(_patch(_payload(), 6, ">H", 0xFFFF), 30, ">H", 0x1234)
    result = verify_object(payload, group_id=3, object_id=5)
    assert isinstance(result, VerifiedObject)
    assert (result.header.flags, result.header.reserved) == (0xFFFF, 0x1234)


def test_empty_data_is_allowed() -> None:
    payload = _payload(data=b"")
    assert len(payload) == HEADER_LEN
    result = verify_object(payload, group_id=3, object_id=5)
    assert isinstance(result, VerifiedObject) and len(result.data) == 0


def test_verified_data_is_a_zero_copy_view() -> None:
    as_bytes = _payload()
    result = verify_object(as_bytes, group_id=3, object_id=5)
    assert isinstance(result, VerifiedObject)
    assert result.data.obj is as_bytes
    assert bytes(result.data) == bytes(range(64))

    buf = bytearray(as_bytes)
    view = memoryview(buf)
    result = verify_object(view, group_id=3, object_id=5)
    assert isinstance(result, VerifiedObject)
    assert result.data.obj is buf
    buf[HEADER_LEN] = 0xEE  # it is the same memory
    assert result.data[0] == 0xEE

    # a view into a larger receive buffer
    big = bytearray(b"junk" + as_bytes + b"more")
    window = memoryview(big)[4 : 4 + len(as_bytes)]
    result = verify_object(window, group_id=3, object_id=5)
    assert isinstance(result, VerifiedObject) and result.data.obj is big


@given(
    component=st.sampled_from(list(Component)),
    layer=st.integers(0, 2**32 - 1),
    block=st.integers(0, 2**32 - 1),
    token_start=st.integers(0, 2**64 - 1),
    token_count=st.integers(0, 2**32 - 1),
    codec=st.integers(0, 2**16 - 1),
    data=st.binary(max_size=300),
)
def test_round_trip(
    component: Component,
    layer: int,
    block: int,
    token_start: int,
    token_count: int,
    codec: int,
    data: bytes,
) -> None:
    header, view = build_payload_parts(
        component=component,
        layer=layer,
        block_index=block,
        token_start=token_start,
        token_count=token_count,
        codec=codec,
        data=data,
    )
    payload = header + bytes(view)
    result = verify_object(
        payload,
        group_id=layer,
        object_id=block,
        expected_component=component,
        expected_codec=codec,
        expected_token_count=token_count,
        expected_token_start=token_start,
        listed_digest=hashlib.sha256(data).digest(),
    )
    assert isinstance(result, VerifiedObject)
    assert bytes(result.data) == data
    assert result.header.encode() == header


@given(st.binary(max_size=200), st.integers(0, 3), st.integers(0, 3))
def test_arbitrary_bytes_never_raise(raw: bytes, group: int, obj: int) -> None:
    result = verify_object(raw, group_id=group, object_id=obj)
    assert isinstance(result, ObjectRejected | VerifiedObject)


def test_every_single_bit_flip_is_caught() -> None:
    """All 132 x 8 one-bit corruptions of a payload with 64 octets of Data."""
    original = _payload()
    for offset in range(len(original)):
        for bit in range(8):
            _check_flip(original, offset, bit)


def _check_flip(original: bytes, offset: int, bit: int) -> None:
    payload = bytearray(original)
    payload[offset] ^= 1 << bit
    bare = verify_object(bytes(payload), group_id=3, object_id=5)
    full = verify_object(
        bytes(payload),
        group_id=3,
        object_id=5,
        expected_component=Component.K,
        expected_codec=0,
        expected_token_count=16,
        expected_token_start=80,
    )
    where = (offset, bit)
    if 6 <= offset < 8 or 30 <= offset < 32:  # Flags, Reserved: ignored on receipt
        assert isinstance(bare, VerifiedObject) and isinstance(full, VerifiedObject), where
        return
    assert isinstance(full, ObjectRejected), where
    # Component (to another valid value), Token Start, Token Count and Codec are
    # only caught with context; everything else by the mandatory checks alone.
    context_only = (offset == 5 and payload[5] in (1, 2, 3)) or 16 <= offset < 30
    assert isinstance(bare, VerifiedObject if context_only else ObjectRejected), where
