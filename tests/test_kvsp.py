"""The KVSP binding (``KVSP-BINDING.md`` v0): vectors, every descriptor rule, properties.

* every value of ``kvsp-vectors.json``, byte for byte (the object payload
  example is rebuilt with the 68-octet header of profile section 3.5, here in
  the test, since the payload codec is not part of ``kvsp``);
* one negative test per Compatibility Descriptor rule (section 1);
* Hypothesis: Block Key chaining and the prefix property (section 3), section
  and codec sizes (sections 5 and 6), q8 round-trip error bounds (the bound is
  derived in ``kvcs_core/kvsp/codecs.py``; the binding gives none);
* the dtype conversions on every code of the 8- and 16-bit formats, and q8
  against an independent numpy implementation of the section 6 text.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
from decimal import Decimal
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvcs_core import kvsp
from kvcs_core.kvsp import (
    Codec,
    CompatibilityDescriptor,
    DescriptorError,
    Dtype,
    KvspError,
    SectionError,
    UnknownCodecError,
)
from kvcs_core.kvsp.descriptor import MAX_DEPTH

VECTORS_PATH = Path(__file__).resolve().parents[2] / "shared" / "spec" / "kvsp-vectors.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
INPUTS = VECTORS["inputs"]
SCOPE_KEY = bytes.fromhex(INPUTS["scope_key"])
CD_JSON: dict[str, Any] = INPUTS["compat"]
TOKENS: list[int] = INPUTS["tokens"]
CD = CompatibilityDescriptor(CD_JSON)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cd_with(**changes: Any) -> dict[str, Any]:
    out = dict(CD_JSON)
    out.update(changes)
    return out


def cd_without(name: str) -> dict[str, Any]:
    return {k: v for k, v in CD_JSON.items() if k != name}


# --------------------------------------------------------------------------- vectors


def test_vector_cd_bytes_and_compat_id() -> None:
    assert CD.cd_bytes.hex() == VECTORS["cd_bytes"]
    assert CD.compat_id.hex() == VECTORS["compat_id"]
    assert kvsp.compatibility_id(bytes.fromhex(VECTORS["cd_bytes"])).hex() == VECTORS["compat_id"]
    assert CompatibilityDescriptor.from_cd_bytes(bytes.fromhex(VECTORS["cd_bytes"])) == CD
    # the binding's section 7 table repeats these
    assert CD.compat_id.hex() == "a1146278d4c124c6e09a51af0585c8a2"


def test_vector_scope_id() -> None:
    assert kvsp.scope_id(SCOPE_KEY).hex() == VECTORS["scope_id"]
    assert kvsp.scope_id(bytearray(SCOPE_KEY)) == kvsp.scope_id(memoryview(SCOPE_KEY))


def test_vector_block_keys_anchor_and_digest() -> None:
    keys = kvsp.block_keys(SCOPE_KEY, CD, TOKENS)
    assert [k.hex() for k in keys] == VECTORS["block_keys"]  # tokens 8, 9: partial tail
    assert kvsp.anchor_key(keys, 2).hex() == VECTORS["anchor_key"]
    assert kvsp.block_keys_sha256(keys) == VECTORS["block_keys_sha256"]
    assert kvsp.block_keys_sha256(keys, 0, 2) == VECTORS["block_keys_sha256"]
    packed = kvsp.pack_tokens(TOKENS)
    assert kvsp.chain_block_keys(SCOPE_KEY, CD.compat_id, 4, packed) == keys


def test_vector_namespace_fields() -> None:
    keys = kvsp.block_keys(SCOPE_KEY, CD, TOKENS)
    fields = kvsp.namespace_fields(
        kvsp.scope_id(SCOPE_KEY), CD.compat_id, kvsp.anchor_key(keys, 2), bytes(16)
    )
    assert [f.hex() for f in fields] == VECTORS["namespace_fields_hex"]
    assert all(type(f) is bytes for f in fields)
    parsed = kvsp.parse_namespace(fields)
    assert parsed is not None
    assert parsed.fields == fields
    assert parsed.content_prefix == kvsp.namespace_prefix(
        parsed.scope_id, parsed.compat_id, parsed.anchor_key
    )


KVO_HEADER = struct.Struct(">4sBBHIIQIHHI32s")  # profile section 3.5: 68 octets
COMPONENTS = {"k": 1, "v": 2, "kv": 3}


def test_vector_object_payload() -> None:
    example = VECTORS["object_payload_example"]
    data = bytes.fromhex(example["data_hex"])
    codec = kvsp.codec_from_value(example["codec"])
    assert codec is Codec.RAW
    assert len(data) == CD.section_size == kvsp.encoded_size(codec, CD) == 64
    assert bytes(kvsp.encode_section(codec, CD, data)) == data
    assert example["token_start"] == example["block_index"] * CD.block_tokens
    assert example["token_count"] == CD.block_tokens
    header = KVO_HEADER.pack(
        b"KVO1",
        1,
        COMPONENTS[example["component"]],
        0,
        example["layer"],
        example["block_index"],
        example["token_start"],
        example["token_count"],
        int(codec),
        0,
        len(data),
        hashlib.sha256(data).digest(),
    )
    assert KVO_HEADER.size == 68
    assert (header + data).hex() == example["payload_hex"]


def test_binding_section7_table() -> None:
    keys = kvsp.block_keys(SCOPE_KEY, CD, TOKENS)
    assert kvsp.scope_id(SCOPE_KEY).hex() == "b9ec1fd448de4ffc0c079cd203515c64"
    assert keys[0].hex() == "3493998bf11b067ca250f5424e3dcd93f012dd845305257f0a5b094ef1da5ccb"
    assert keys[1].hex() == "1d4ba1bfe74d006bca12ebe25097f7d0a4a6ff6db85b5c3e7f61477b8c1cfd45"
    assert (
        kvsp.block_keys_sha256(keys)
        == "0f538d52dcc8b9fac5db6f4790900c6102cb6035e4e053540318d3ebcde1d788"
    )


# --------------------------------------------------------------------------- descriptor


def test_descriptor_fields_and_json() -> None:
    assert (CD.model, CD.layers, CD.kv_heads, CD.head_dim, CD.block_tokens) == (
        "test/tiny@1",
        2,
        2,
        4,
        4,
    )
    assert CD.dtype is Dtype.FLOAT16
    assert CD.tokenizer is None
    assert CD.section_shape == (2, 4, 4)
    assert CD.itemsize == 2
    assert CD.to_json() == CD_JSON
    assert CompatibilityDescriptor(CD.to_json()) == CD
    assert hash(CompatibilityDescriptor(dict(reversed(CD_JSON.items())))) == hash(CD)


def test_descriptor_key_order_and_types_normalised() -> None:
    class Heads(enum.IntEnum):
        TWO = 2

    same = CompatibilityDescriptor(
        dict(reversed(list(cd_with(kv_heads=Heads.TWO, dtype=Dtype.FLOAT16).items())))
    )
    assert same.cd_bytes == CD.cd_bytes
    created = CompatibilityDescriptor.create(
        model="test/tiny@1", layers=2, kv_heads=2, head_dim=4, dtype="float16", block_tokens=4
    )
    assert created == CD


def test_descriptor_optional_and_other_members_count() -> None:
    extra = {"rope": {"type": "yarn", "factor": "4.0"}, "flags": [True, False, None, -1, "x"]}
    cd = CompatibilityDescriptor(cd_with(tokenizer="tok@3", extra=extra, vendor={"k": [1, [2]]}))
    assert cd.tokenizer == "tok@3"
    assert cd.compat_id != CD.compat_id
    assert cd.to_json()["extra"] == extra
    assert cd == CompatibilityDescriptor.from_cd_bytes(cd.cd_bytes)
    assert cd == CompatibilityDescriptor.create(
        model="test/tiny@1",
        layers=2,
        kv_heads=2,
        head_dim=4,
        dtype=Dtype.FLOAT16,
        block_tokens=4,
        tokenizer="tok@3",
        extra=extra,
        vendor={"k": (1, (2,))},
    )
    # empty strings, empty containers and the integer bounds of CBOR major types 0/1
    edge = CompatibilityDescriptor(
        cd_with(model="", tokenizer="", extra={}, big=2**64 - 1, small=-(2**64), e=[])
    )
    assert edge.to_json()["big"] == 2**64 - 1


@pytest.mark.parametrize(
    "value",
    [[], "cd", None, 1, 1.5, b"cd"],
)
def test_descriptor_must_be_an_object(value: object) -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor(value)
    assert info.value.member == ""
    assert info.value.pointer == ""
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", kvsp.descriptor.REQUIRED_MEMBERS)
def test_descriptor_required_member_missing(name: str) -> None:
    with pytest.raises(DescriptorError, match="required member is missing") as info:
        CompatibilityDescriptor(cd_without(name))
    assert info.value.member == name
    assert info.value.pointer == f"/{name}"


BAD_MEMBERS: list[tuple[str, object, str]] = [
    ("kvsp", 1, "not supported"),
    ("kvsp", -1, "not supported"),
    ("kvsp", "0", "must be an integer"),
    ("kvsp", True, "must be an integer"),
    ("kvsp", False, "must be an integer"),
    ("kvsp", None, "must be an integer"),
    ("kvsp", 0.0, "floating-point"),
    ("model", 1, "must be a string"),
    ("model", None, "must be a string"),
    ("model", ["test"], "must be a string"),
    ("dtype", "int8", "is not one of"),
    ("dtype", "Float16", "is not one of"),
    ("dtype", "float16 ", "is not one of"),
    ("dtype", 16, "must be a string"),
    ("dtype", None, "must be a string"),
    ("tokenizer", 1, "must be a string"),
    ("tokenizer", None, "must be a string"),
    ("tokenizer", {}, "must be a string"),
    ("extra", "x", "must be an object"),
    ("extra", [], "must be an object"),
    ("extra", None, "must be an object"),
    ("extra", 0, "must be an object"),
]
for _name in ("layers", "kv_heads", "head_dim", "block_tokens"):
    BAD_MEMBERS += [
        (_name, 0, "must be >= 1"),
        (_name, -3, "must be >= 1"),
        (_name, "4", "must be an integer"),
        (_name, True, "must be an integer"),
        (_name, None, "must be an integer"),
        (_name, [4], "must be an integer"),
        (_name, 4.0, "floating-point"),
        (_name, 2**64, "outside"),
    ]


@pytest.mark.parametrize(("name", "value", "message"), BAD_MEMBERS)
def test_descriptor_bad_member(name: str, value: object, message: str) -> None:
    with pytest.raises(DescriptorError, match=message) as info:
        CompatibilityDescriptor(cd_with(**{name: value}))
    assert info.value.member == name
    assert info.value.pointer == f"/{name}"
    assert name in str(info.value)


@pytest.mark.parametrize(
    ("changes", "member", "pointer"),
    [
        ({"scale": 1.5}, "scale", "/scale"),
        ({"scale": -0.0}, "scale", "/scale"),
        ({"scale": math.nan}, "scale", "/scale"),
        ({"scale": math.inf}, "scale", "/scale"),
        ({"extra": {"rope": {"factor": 4.0}}}, "extra", "/extra/rope/factor"),
        ({"extra": {"list": [1, 2, [0.5]]}}, "extra", "/extra/list/2/0"),
        ({"extra": {"a/b~c": 1e-3}}, "extra", "/extra/a~1b~0c"),
        ({"other": [{"x": -math.inf}]}, "other", "/other/0/x"),
    ],
)
def test_descriptor_no_floats_anywhere(changes: dict[str, Any], member: str, pointer: str) -> None:
    with pytest.raises(DescriptorError, match="floating-point number") as info:
        CompatibilityDescriptor(cd_with(**changes))
    assert info.value.member == member
    assert info.value.pointer == pointer


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"raw", "bytes"),
        (bytearray(b"raw"), "bytearray"),
        ({1, 2}, "set"),
        (Decimal("1.5"), "Decimal"),
        (1j, "complex"),
        (object(), "object"),
    ],
)
def test_descriptor_only_json_values(value: object, message: str) -> None:
    for changes, pointer in (
        ({"other": value}, "/other"),
        ({"extra": {"x": [value]}}, "/extra/x/0"),
    ):
        with pytest.raises(DescriptorError, match=message) as info:
            CompatibilityDescriptor(cd_with(**changes))
        assert info.value.pointer == pointer


def test_descriptor_keys_must_be_strings() -> None:
    bad: dict[object, object] = {1: "x"}
    bad.update(CD_JSON.items())
    with pytest.raises(DescriptorError, match="not a string") as info:
        CompatibilityDescriptor(bad)
    assert info.value.member == ""
    with pytest.raises(DescriptorError, match="not a string") as info:
        CompatibilityDescriptor(cd_with(extra={"ok": {None: 1}}))
    assert (info.value.member, info.value.pointer) == ("extra", "/extra/ok")


def test_descriptor_strings_must_be_unicode_scalars() -> None:
    with pytest.raises(DescriptorError, match="lone surrogate") as info:
        CompatibilityDescriptor(cd_with(model="a\ud800"))
    assert info.value.pointer == "/model"
    with pytest.raises(DescriptorError, match="lone surrogate") as info:
        CompatibilityDescriptor(cd_with(extra={"\udfff": 1}))
    assert info.value.pointer == "/extra"
    str(info.value).encode("utf-8")  # the message itself is printable
    # non-ASCII is fine
    assert CompatibilityDescriptor(cd_with(model="modèle/日本@1")).model == "modèle/日本@1"


@pytest.mark.parametrize(
    "value", [2**64, -(2**64) - 1, 10**30, 10**5000], ids=["2^64", "-2^64-1", "1e30", "1e5000"]
)
def test_descriptor_integers_fit_cbor(value: int) -> None:
    with pytest.raises(DescriptorError, match="bignum") as info:
        CompatibilityDescriptor(cd_with(extra={"n": value}))
    assert info.value.pointer == "/extra/n"


def test_descriptor_depth_limit() -> None:
    deep: Any = 0
    for _ in range(MAX_DEPTH - 2):  # the CD is depth 1, "extra" depth 2
        deep = [deep]
    CompatibilityDescriptor(cd_with(extra={"d": deep}))
    with pytest.raises(DescriptorError, match="nested more than") as info:
        CompatibilityDescriptor(cd_with(extra={"d": [deep]}))
    assert info.value.member == "extra"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not valid CBOR"),
        (b"\xff", "not valid CBOR"),
        (bytes.fromhex(VECTORS["cd_bytes"])[:-1], "not valid CBOR"),
        (cbor2.dumps(CD_JSON), "deterministic"),  # insertion order, not sorted keys
        (bytes.fromhex("bf") + bytes.fromhex(VECTORS["cd_bytes"])[1:] + b"\xff", "deterministic"),
        (cbor2.dumps([1]), "JSON object"),
        (cbor2.dumps(cd_with(x=b"\x00"), canonical=True), "bytes"),
        (cbor2.dumps(cd_with(x=1.5), canonical=True), "floating-point"),
        (cbor2.dumps(cd_with(x=cbor2.CBORTag(99, 1)), canonical=True), "CBORTag"),
    ],
)
def test_descriptor_from_cd_bytes_rejects(data: bytes, message: str) -> None:
    with pytest.raises(DescriptorError, match=message):
        CompatibilityDescriptor.from_cd_bytes(data)


def test_descriptor_non_shortest_integer_rejected() -> None:
    good = bytes.fromhex(VECTORS["cd_bytes"])
    # "kvsp": 0 re-encoded as a one-octet argument (0x18 0x00)
    bad = good.replace(bytes.fromhex("646b76737000"), bytes.fromhex("646b7673701800"), 1)
    assert cbor2.loads(bad) == CD_JSON
    with pytest.raises(DescriptorError, match="deterministic"):
        CompatibilityDescriptor.from_cd_bytes(bad)


json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@FAST
@given(
    other=st.dictionaries(
        st.text(max_size=6).filter(lambda k: k not in ("tokenizer", "extra")),
        json_values,
        max_size=4,
    )
)
def test_descriptor_cbor_round_trip(other: dict[str, Any]) -> None:
    cd = CompatibilityDescriptor({**other, **CD_JSON})
    assert CompatibilityDescriptor.from_cd_bytes(cd.cd_bytes) == cd
    assert cd.to_json() == {**other, **CD_JSON}
    assert cd.compat_id == hashlib.sha256(b"KVSP-compat-v0" + cd.cd_bytes).digest()[:16]
    shuffled = dict(reversed(list({**other, **CD_JSON}.items())))
    assert CompatibilityDescriptor(shuffled).cd_bytes == cd.cd_bytes


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key", [b"", bytes(31), bytes(33), "0" * 32, None])
def test_scope_key_length_and_type(key: Any) -> None:
    with pytest.raises(KvspError, match="scope key"):
        kvsp.scope_id(key)
    with pytest.raises(KvspError, match="scope key"):
        kvsp.block_keys(key, CD, TOKENS)


@pytest.mark.parametrize(
    ("tokens", "index"), [([0, -1], 1), ([2**32], 0), ([1, 2, "3"], 2), ([0.5], 0)]
)
def test_tokens_must_be_u32(tokens: list[Any], index: int) -> None:
    with pytest.raises(KvspError, match=f"token {index} "):
        kvsp.pack_tokens(tokens)
    with pytest.raises(KvspError, match=f"token {index} "):
        kvsp.block_keys(SCOPE_KEY, CD, tokens * 4)


def test_token_bounds_accepted() -> None:
    keys = kvsp.block_keys(SCOPE_KEY, CD, [0, 2**32 - 1, 0, 2**32 - 1])
    assert len(keys) == 1


def test_partial_tail_has_no_key() -> None:
    assert kvsp.block_keys(SCOPE_KEY, CD, []) == ()
    assert kvsp.block_keys(SCOPE_KEY, CD, [1, 2, 3]) == ()
    for n in range(8, 12):
        assert kvsp.block_keys(SCOPE_KEY, CD, list(range(n))) == kvsp.block_keys(
            SCOPE_KEY, CD, TOKENS[:8]
        )
    assert kvsp.full_blocks(10, 4) == 2
    # a bad token in the tail is never looked at
    assert len(kvsp.block_keys(SCOPE_KEY, CD, [*TOKENS[:8], -1])) == 2


def test_chain_block_keys_argument_checks() -> None:
    packed = kvsp.pack_tokens(TOKENS[:8])
    with pytest.raises(KvspError, match="Compatibility ID"):
        kvsp.chain_block_keys(SCOPE_KEY, bytes(15), 4, packed)
    for bad in (0, -1, True):
        with pytest.raises(KvspError, match="block_tokens"):
            kvsp.chain_block_keys(SCOPE_KEY, CD.compat_id, bad, packed)
    with pytest.raises(KvspError, match="whole number"):
        kvsp.chain_block_keys(SCOPE_KEY, CD.compat_id, 4, packed[:-1])
    with pytest.raises(KvspError, match="previous Block Key"):
        kvsp.chain_block_keys(SCOPE_KEY, CD.compat_id, 4, packed, previous_key=bytes(31))
    with pytest.raises(KvspError):
        kvsp.full_blocks(-1, 4)


def test_anchor_key_and_segment_digest_bounds() -> None:
    keys = kvsp.block_keys(SCOPE_KEY, CD, TOKENS)
    for m in (0, 3, -1):
        with pytest.raises(KvspError, match="Anchor Key"):
            kvsp.anchor_key(keys, m)
    assert kvsp.anchor_key(keys, 1) == keys[0]
    assert kvsp.block_keys_sha256(keys, 1, 1) == hashlib.sha256(keys[1]).hexdigest()
    assert kvsp.block_keys_sha256(keys, 2, 0) == hashlib.sha256(b"").hexdigest()
    for first, blocks in ((0, 3), (3, None), (-1, 1), (1, -1)):
        with pytest.raises(KvspError, match="segment"):
            kvsp.block_keys_sha256(keys, first, blocks)
    with pytest.raises(KvspError, match="31 octets, not 32"):
        kvsp.block_keys_sha256([keys[0], keys[1][:31]])


def test_long_prompt() -> None:
    """128k tokens: 8192 keys of B=16 (about 15 ms), and the last one continues the chain."""
    cd = CompatibilityDescriptor(cd_with(block_tokens=16))
    tokens = [(i * 2654435761) % 2**32 for i in range(128 * 1024 + 5)]
    keys = kvsp.block_keys(SCOPE_KEY, cd, tokens)
    assert len(keys) == 8192
    tail = kvsp.chain_block_keys(
        SCOPE_KEY,
        cd.compat_id,
        16,
        kvsp.pack_tokens(tokens[8000 * 16 :]),
        previous_key=keys[7999],
    )
    assert tail == keys[8000:]


block_sizes = st.integers(min_value=1, max_value=6)
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=60)


@FAST
@given(block=block_sizes, tokens=token_lists, more=token_lists)
def test_prefix_property(block: int, tokens: list[int], more: list[int]) -> None:
    cd = CompatibilityDescriptor(cd_with(block_tokens=block))
    short = kvsp.block_keys(SCOPE_KEY, cd, tokens)
    long = kvsp.block_keys(SCOPE_KEY, cd, tokens + more)
    assert len(short) == len(tokens) // block
    assert len(long) == (len(tokens) + len(more)) // block
    assert long[: len(short)] == short
    assert all(len(k) == 32 for k in long)
    # the keys of the appended full blocks continue the chain from the last full block
    cut = len(short) * block
    rest = kvsp.chain_block_keys(
        SCOPE_KEY,
        cd.compat_id,
        block,
        kvsp.pack_tokens((tokens + more)[cut:]),
        previous_key=short[-1] if short else None,
    )
    assert rest == long[len(short) :]


@FAST
@given(block=block_sizes, tokens=token_lists, data=st.data())
def test_chaining(block: int, tokens: list[int], data: st.DataObject) -> None:
    """K_i depends on every token of blocks 0..i and on nothing after block i."""
    cd = CompatibilityDescriptor(cd_with(block_tokens=block))
    keys = kvsp.block_keys(SCOPE_KEY, cd, tokens)
    assume(keys)
    position = data.draw(st.integers(min_value=0, max_value=len(keys) * block - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    other = kvsp.block_keys(SCOPE_KEY, cd, changed)
    hit = position // block
    assert other[:hit] == keys[:hit]
    assert all(a != b for a, b in zip(other[hit:], keys[hit:], strict=True))
    assert len(set(keys)) == len(keys)


@FAST
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=12))
def test_keys_are_keyed_and_bound_to_compat(tokens: list[int]) -> None:
    keys = kvsp.block_keys(SCOPE_KEY, CD, tokens)
    other_scope = kvsp.block_keys(bytes(32), CD, tokens)
    other_cd = kvsp.block_keys(SCOPE_KEY, CompatibilityDescriptor(cd_with(model="m")), tokens)
    assert not set(keys) & set(other_scope)
    assert not set(keys) & set(other_cd)


# --------------------------------------------------------------------------- namespace


def test_namespace_checks() -> None:
    sid, cid, anchor, pid = bytes(16), bytes(16), bytes(32), bytes(16)
    for args in (
        (bytes(15), cid, anchor, pid),
        (sid, cid, bytes(16), pid),
        (sid, cid, anchor, b""),
    ):
        with pytest.raises(KvspError, match="octets"):
            kvsp.namespace_fields(*args)
    with pytest.raises(KvspError, match="must be bytes"):
        kvsp.namespace_fields("0" * 16, cid, anchor, pid)  # type: ignore[arg-type]
    assert kvsp.namespace_prefix(sid) == (b"kvcs-1", sid)
    assert kvsp.namespace_prefix(sid, cid) == (b"kvcs-1", sid, cid)
    assert kvsp.namespace_prefix(sid, cid, anchor) == (b"kvcs-1", sid, cid, anchor)
    with pytest.raises(KvspError, match="needs the Compatibility ID"):
        kvsp.namespace_prefix(sid, None, anchor)
    fields = kvsp.namespace_fields(sid, cid, anchor, pid)
    assert kvsp.parse_namespace([memoryview(f) for f in fields]) == kvsp.KvcsNamespace(
        sid, cid, anchor, pid
    )
    for bad in (
        fields[:4],
        (*fields, b"x"),
        (b"kvcs-2", *fields[1:]),
        (b"KVCS-1", *fields[1:]),
        (fields[0], bytes(17), *fields[2:]),
        (*fields[:3], bytes(33), fields[4]),
        (*fields[:4], bytes(15)),
        (),
    ):
        assert kvsp.parse_namespace(bad) is None


# --------------------------------------------------------------------------- codecs


def test_codec_registry() -> None:
    assert kvsp.codec_from_value(0) is Codec.RAW
    assert kvsp.codec_from_value(1) is Codec.Q8
    assert kvsp.codec_from_name("raw") is Codec.RAW
    assert kvsp.codec_from_name("q8") is Codec.Q8
    assert Codec.RAW.registry_name == "raw"
    assert Codec.Q8.registry_name == "q8"
    assert not kvsp.CODECS[Codec.RAW].lossy
    assert kvsp.CODECS[Codec.Q8].lossy
    for value, message in (
        (2, "unassigned"),
        (0x7FFF, "unassigned"),
        (0x8000, "private"),
        (0xFFFF, "private"),
        (-1, "16-bit"),
        (0x10000, "16-bit"),
    ):
        with pytest.raises(UnknownCodecError, match=message):
            kvsp.codec_from_value(value)
    for name, message in (
        ("RAW", "not a codec name"),
        ("", "not a codec name"),
        ("a" * 33, "not a codec name"),
        ("raw ", "not a codec name"),
        ("q_8", "not a codec name"),
        ("q9", "not registered"),
        ("a" * 32, "not registered"),
        ("raw-1", "not registered"),
    ):
        with pytest.raises(UnknownCodecError, match=message):
            kvsp.codec_from_name(name)
    assert kvsp.is_codec_name("x-1") and not kvsp.is_codec_name("raw\n")
    with pytest.raises(UnknownCodecError):
        kvsp.encoded_size(7, CD)
    with pytest.raises(UnknownCodecError):
        kvsp.decode_section(0x8001, CD, b"")


def test_raw_is_zero_copy_and_kv_layout() -> None:
    k = bytes(range(64))
    v = bytes(range(64, 128))
    data = bytearray(k + v)
    dk, dv = kvsp.decode_kv(Codec.RAW, CD, data)
    assert dk.obj is data and dv.obj is data  # views, not copies
    assert (bytes(dk), bytes(dv)) == (k, v)
    ek, ev = kvsp.encode_kv(0, CD, k, v)
    assert ek.obj is k and ev.obj is v
    assert kvsp.layer_digest(CD, k, v) == hashlib.sha256(bytes(ek) + bytes(ev)).digest()
    assert kvsp.layer_digest(CD, k, v) == hashlib.sha256(data).digest()
    with pytest.raises(SectionError, match="K section"):
        kvsp.layer_digest(CD, k[:-1], v)
    with pytest.raises(SectionError, match="V section"):
        kvsp.layer_digest(CD, k, v + b"\x00")
    with pytest.raises(SectionError):
        kvsp.encode_section(Codec.RAW, CD, k[:-2])
    with pytest.raises(SectionError):
        kvsp.decode_section(Codec.RAW, CD, k + b"\x00")
    with pytest.raises(SectionError, match="kv Data"):
        kvsp.decode_kv(Codec.RAW, CD, data[:-1])
    with pytest.raises(SectionError, match="kv Data"):
        kvsp.decode_kv(Codec.Q8, CD, data)


def test_q8_hand_example() -> None:
    """Shape [1, 2, 4], float16: ties to even, clip-free max, an all-zero row."""
    cd = CompatibilityDescriptor(cd_with(kv_heads=1, block_tokens=2))
    section = struct.pack("<8e", 2.5, -3.5, 1.5, 127.0, 0.0, -0.0, 0.0, 0.0)
    data = bytes(kvsp.encode_section(Codec.Q8, cd, section))
    assert data.hex() == "003c0000" + "02fc027f" + "00000000"
    assert kvsp.encoded_size(Codec.Q8, cd) == len(data) == 12
    decoded = kvsp.decode_section(Codec.Q8, cd, data)
    assert struct.unpack("<8e", decoded) == (2.0, -4.0, 2.0, 127.0, 0.0, 0.0, 0.0, 0.0)
    # kv: quantized K then quantized V
    kv = b"".join(bytes(p) for p in kvsp.encode_kv(Codec.Q8, cd, section, section))
    assert kv == data + data
    assert [bytes(p) for p in kvsp.decode_kv(Codec.Q8, cd, kv)] == [bytes(decoded)] * 2


def test_q8_decode_accepts_any_bytes_of_the_right_size() -> None:
    shape = (1, 1, 3)
    # q = -128 (never produced by the encoder), scale 1.0
    assert struct.unpack("<3e", kvsp.q8_decode(b"\x00\x3c\x80\x01\x00", Dtype.FLOAT16, shape)) == (
        -128.0,
        1.0,
        0.0,
    )
    # inf scale: q * inf, with 0 * inf = NaN; e4m3fn has no infinity
    out = struct.unpack("<3e", kvsp.q8_decode(b"\x00\x7c\xff\x01\x00", Dtype.FLOAT16, shape))
    assert out[0] == -math.inf and out[1] == math.inf and math.isnan(out[2])
    fp8 = kvsp.q8_decode(b"\x00\x7c\xff\x01\x00", Dtype.FLOAT8_E4M3FN, shape)
    assert [b & 0x7F for b in fp8] == [0x7F] * 3  # all NaN (the sign of 0 * inf is the CPU's)
    assert fp8[:2] == b"\xff\x7f"
    # largest scale and q: 127 * 65504 overflows float16 and float8, fits bfloat16
    top = b"\xff\x7b\x7f\x81\x00"
    assert kvsp.q8_decode(top, Dtype.FLOAT16, shape) == struct.pack("<3e", math.inf, -math.inf, 0)
    assert kvsp.q8_decode(top, Dtype.FLOAT8_E5M2, shape) == b"\x7c\xfc\x00"
    assert struct.unpack("<3f", kvsp.q8_decode(top, Dtype.FLOAT32, shape)) == (
        127 * 65504.0,
        -127 * 65504.0,
        0.0,
    )
    with pytest.raises(SectionError):
        kvsp.q8_decode(b"\x00\x3c\x01\x02", Dtype.FLOAT16, shape)


def test_q8_encode_rejects_what_it_cannot_represent() -> None:
    shape = (1, 2, 2)
    for bad in (math.inf, -math.inf, math.nan):
        section = struct.pack("<4e", 1.0, 2.0, bad, 0.0)
        with pytest.raises(SectionError, match=r"element \[0, 1, 0\]"):
            kvsp.q8_encode(section, Dtype.FLOAT16, shape)
    # the scale of a float32 row above ~8.3e6 does not fit float16
    with pytest.raises(SectionError, match="head 0, token 1"):
        kvsp.q8_encode(struct.pack("<4f", 1.0, 0.0, 1e7, 0.0), Dtype.FLOAT32, shape)
    ok = kvsp.q8_encode(struct.pack("<4f", 1.0, 0.0, 127 * 65504.0, 0.0), Dtype.FLOAT32, shape)
    assert ok[2:4] == b"\xff\x7b"
    # a scale that underflows float32 gives an all-zero row
    tiny = struct.unpack("<f", b"\x01\x00\x00\x00")[0]
    assert kvsp.q8_encode(struct.pack("<4f", tiny, 0.0, 0, 0), Dtype.FLOAT32, shape) == bytes(8)
    with pytest.raises(SectionError, match="octets"):
        kvsp.q8_encode(bytes(7), Dtype.FLOAT16, shape)
    with pytest.raises(SectionError, match="empty dimension"):
        kvsp.q8_encode(b"", Dtype.FLOAT16, (0, 1, 1))


shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 8))
dtypes = st.sampled_from(list(Dtype))


@FAST
@given(shape=shapes, dtype=dtypes, data=st.data())
def test_section_and_codec_sizes(
    shape: tuple[int, int, int], dtype: Dtype, data: st.DataObject
) -> None:
    heads, tokens, dim = shape
    cd = CompatibilityDescriptor(
        cd_with(kv_heads=heads, block_tokens=tokens, head_dim=dim, dtype=dtype.value)
    )
    assert cd.section_size == heads * tokens * dim * dtype.itemsize
    assert kvsp.encoded_size(Codec.RAW, cd) == cd.section_size
    assert kvsp.encoded_size(Codec.Q8, cd) == 2 * heads * tokens + heads * tokens * dim
    section = data.draw(st.binary(min_size=cd.section_size, max_size=cd.section_size))
    values = kvsp.to_float32(dtype, section)
    assert len(values) == heads * tokens * dim
    if all(map(math.isfinite, values)) and max(map(abs, values), default=0) < 8e6:
        encoded = kvsp.encode_section(Codec.Q8, cd, section)
        assert len(encoded) == kvsp.encoded_size(Codec.Q8, cd)
        assert len(kvsp.decode_section(Codec.Q8, cd, encoded)) == cd.section_size
    junk = data.draw(st.binary(min_size=2 * kvsp.q8_size(shape), max_size=2 * kvsp.q8_size(shape)))
    k, v = kvsp.decode_kv(Codec.Q8, cd, junk)
    assert len(k) == len(v) == cd.section_size


_FORMAT = {  # mantissa bits, smallest normal exponent
    Dtype.FLOAT32: (23, -126),
    Dtype.FLOAT16: (10, -14),
    Dtype.BFLOAT16: (7, -126),
    Dtype.FLOAT8_E4M3FN: (3, -6),
    Dtype.FLOAT8_E5M2: (2, -14),
}


def _half_ulp(dtype: Dtype, value: float) -> float:
    """Half the spacing of ``dtype`` in the binade of ``value`` (the rounding error bound)."""
    mantissa, emin = _FORMAT[dtype]
    exponent = max(math.frexp(value)[1] - 1, emin) if value else emin
    return math.ldexp(1.0, exponent - mantissa - 1)


def _float16(value: float) -> float:
    result: float = struct.unpack("<e", struct.pack("<e", value))[0]
    return result


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=shapes,
    dtype=st.sampled_from([Dtype.FLOAT16, Dtype.BFLOAT16, Dtype.FLOAT32, Dtype.FLOAT8_E4M3FN]),
    data=st.data(),
)
def test_q8_round_trip_error_bound(
    shape: tuple[int, int, int], dtype: Dtype, data: st.DataObject
) -> None:
    """|x - x'| <= s*(1/2 + 2**-17) + 127*|s - s16| + half an ulp of the dtype (codecs.py)."""
    count = shape[0] * shape[1] * shape[2]
    limit = {Dtype.FLOAT8_E4M3FN: 448.0, Dtype.FLOAT16: 65504.0}.get(dtype, 8e6)
    raw_values = data.draw(
        st.lists(
            st.floats(-limit, limit, width=32, allow_subnormal=True),
            min_size=count,
            max_size=count,
        )
    )
    section = kvsp.from_float32(dtype, raw_values)
    x = kvsp.to_float32(dtype, section)
    assume(all(map(math.isfinite, x)))
    decoded = kvsp.to_float32(
        dtype, kvsp.q8_decode(kvsp.q8_encode(section, dtype, shape), dtype, shape)
    )
    dim = shape[2]
    for start in range(0, count, dim):
        row, back = x[start : start + dim], decoded[start : start + dim]
        peak = max(map(abs, row))
        s = struct.unpack("<f", struct.pack("<f", peak / 127))[0]
        s16 = _float16(s)
        if s == 0:  # m == 0, or a float32 m so small that m / 127 underflows
            assert not any(back)
            continue
        for a, b in zip(row, back, strict=True):
            if math.isinf(b):
                # the one overflow of the cast: a float16 row whose max is within
                # 2**-11 of 65504 gets s16 = 516 and 127 * 516 > 65504
                assert dtype is Dtype.FLOAT16 and s16 == 516.0 and abs(a) > 65000, (a, b)
                continue
            bound = s * (0.5 + 2**-17) + 127 * abs(s - s16) + _half_ulp(dtype, b)
            assert abs(a - b) <= bound * (1 + 1e-12), (a, b, s, s16)
        if s16 == s and dtype is Dtype.FLOAT32:
            assert max(abs(a - b) for a, b in zip(row, back, strict=True)) <= s * (0.5 + 2**-17)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [Dtype.FLOAT16, Dtype.BFLOAT16])
def test_16_bit_codes_round_trip(dtype: Dtype) -> None:
    raw = struct.pack("<65536H", *range(65536))
    values = kvsp.to_float32(dtype, raw)
    back = struct.unpack("<65536H", kvsp.from_float32(dtype, values))
    for code, (value, again) in enumerate(zip(values, back, strict=True)):
        if math.isnan(value):
            assert again & 0x7FFF in ((0x7E00,) if dtype is Dtype.FLOAT16 else (0x7FC0,))
        else:
            assert again == code


@pytest.mark.parametrize("dtype", [Dtype.FLOAT8_E4M3FN, Dtype.FLOAT8_E5M2])
def test_8_bit_codes_round_trip(dtype: Dtype) -> None:
    values = kvsp.to_float32(dtype, bytes(range(256)))
    back = kvsp.from_float32(dtype, values)
    nans = [code for code, v in enumerate(values) if math.isnan(v)]
    if dtype is Dtype.FLOAT8_E4M3FN:
        assert nans == [0x7F, 0xFF]
        assert max(v for v in values if not math.isnan(v)) == 448.0
        assert values[1] == 2.0**-9
    else:
        assert nans == [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
        assert values[0x7C] == math.inf and values[0x7B] == 57344.0
        assert values[1] == 2.0**-16
    for code, (value, again) in enumerate(zip(values, back, strict=True)):
        if not math.isnan(value):
            assert again == code


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [
        (Dtype.FLOAT8_E4M3FN, 464.0, 0x7E),  # tie between 448 (even) and 480 (NaN code)
        (Dtype.FLOAT8_E4M3FN, 464.00003, 0x7F),  # above it: NaN (non-saturating)
        (Dtype.FLOAT8_E4M3FN, -math.inf, 0xFF),
        (Dtype.FLOAT8_E4M3FN, 2.0**-10, 0x00),  # half the smallest subnormal: tie to 0
        (Dtype.FLOAT8_E4M3FN, 3 * 2.0**-10, 0x02),  # 1.5 subnormal steps: tie to even (2)
        (Dtype.FLOAT8_E4M3FN, -0.0, 0x80),
        (Dtype.FLOAT8_E5M2, 61440.0, 0x7C),  # tie between 57344 (odd) and 65536: inf
        (Dtype.FLOAT8_E5M2, 61439.996, 0x7B),
        (Dtype.FLOAT8_E5M2, math.nan, 0x7E),
        (Dtype.FLOAT8_E5M2, 1.125, 0x3C),  # tie between 1.0 (even) and 1.25
        (Dtype.FLOAT8_E5M2, 1.375, 0x3E),  # tie between 1.25 and 1.5 (even)
    ],
)
def test_fp8_rounding(dtype: Dtype, value: float, expected: int) -> None:
    value = struct.unpack("<f", struct.pack("<f", value))[0]
    assert kvsp.from_float32(dtype, [value]) == bytes([expected])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1 + 2.0**-8, 0x3F80),  # tie: even (1.0)
        (1 + 3 * 2.0**-8, 0x3F82),  # tie: even (1 + 2**-6)
        (1 + 2.0**-8 + 2.0**-20, 0x3F81),
        (math.ldexp(2 - 2**-8, 127), 0x7F80),  # tie above the largest finite (odd): inf
        (math.ldexp(2 - 2**-8 - 2**-20, 127), 0x7F7F),
        (-math.inf, 0xFF80),
        (-0.0, 0x8000),
    ],
)
def test_bfloat16_rounding(value: float, expected: int) -> None:
    value = struct.unpack("<f", struct.pack("<f", value))[0]
    assert kvsp.from_float32(Dtype.BFLOAT16, [value]) == struct.pack("<H", expected)


def test_float16_overflow_is_inf() -> None:
    out = kvsp.from_float32(Dtype.FLOAT16, [65519.0, 65520.0, -1e9, 1.0])
    assert struct.unpack("<4H", out) == (0x7BFF, 0x7C00, 0xFC00, 0x3C00)
    with pytest.raises(ValueError, match="whole number"):
        kvsp.to_float32(Dtype.FLOAT16, b"\x00")


# --------------------------------------------------------------------------- numpy reference


def test_q8_matches_a_vectorised_reference() -> None:
    """q8 as a numpy implementation of section 6 writes it (float32 arithmetic)."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(20250101)
    np_dtypes = {Dtype.FLOAT16: np.dtype("<f2"), Dtype.FLOAT32: np.dtype("<f4")}

    def encode(x: Any, rows: int, dim: int) -> bytes:
        x32 = x.astype(np.float32).reshape(rows, dim)
        s = (np.abs(x32).max(axis=1) / np.float32(127)).astype(np.float32)
        safe = np.where(s == 0, np.float32(1), s)
        q = np.clip(np.rint((x32 / safe[:, None]).astype(np.float32)), -127, 127)
        q[s == 0] = 0
        return bytes(s.astype("<f2").tobytes() + q.astype(np.int8).tobytes())

    def decode(blob: bytes, dtype: Any, rows: int, dim: int) -> Any:
        s = np.frombuffer(blob[: 2 * rows], "<f2").astype(np.float32)
        q = np.frombuffer(blob[2 * rows :], np.int8).reshape(rows, dim).astype(np.float32)
        with np.errstate(all="ignore"):
            return (q * s[:, None]).astype(dtype)

    for trial in range(400):
        dtype = (Dtype.FLOAT16, Dtype.FLOAT32)[trial % 2]
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 17)))
        rows, dim = shape[0] * shape[1], shape[2]
        scale = 10.0 ** int(rng.integers(-7, 5))
        x = (rng.standard_normal(rows * dim) * scale).astype(np_dtypes[dtype])
        if trial % 3 == 0:
            x[rng.random(rows * dim) < 0.5] = 0
        if trial % 5 == 0:  # exact multiples: many ties
            x = (rng.integers(-6, 7, rows * dim) * 0.5).astype(np_dtypes[dtype])
        section = x.tobytes()
        mine = kvsp.q8_encode(section, dtype, shape)
        assert mine == encode(x, rows, dim), (dtype, x)
        junk = rng.integers(0, 256, kvsp.q8_size(shape), dtype=np.uint8).tobytes()
        for blob in (mine, junk):
            got = np.frombuffer(kvsp.q8_decode(blob, dtype, shape), np_dtypes[dtype])
            want = decode(blob, np_dtypes[dtype], rows, dim).reshape(-1)
            assert np.array_equal(got, want, equal_nan=True)
            assert np.array_equal(
                np.signbit(got) | np.isnan(got), np.signbit(want) | np.isnan(want)
            )


def test_float16_cast_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[~np.isnan(values)]
    with np.errstate(all="ignore"):
        want = values.astype("<f2").tobytes()
    assert kvsp.from_float32(Dtype.FLOAT16, values.astype(np.float64).tolist()) == want
