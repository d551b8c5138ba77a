"""The manifest (profile 3.6): JSON model, strict parse, validation, versions, COSE_Sign1."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Callable
from typing import Any

import cbor2
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from hypothesis import given, settings
from hypothesis import strategies as st
from pycose.algorithms import Es256
from pycose.keys.curves import P256
from pycose.keys.ec2 import EC2Key

from kvcs_core.kvcs import manifest as manifest_mod
from kvcs_core.kvcs.cose import (
    CoseKeyError,
    CoseRejectReason,
    ManifestRejected,
    sign_manifest,
    to_cose_key,
    verify_manifest,
)
from kvcs_core.kvcs.manifest import (
    Manifest,
    ManifestError,
    ManifestErrorReason,
    ManifestVersions,
    Segment,
    VersionRejected,
    VersionRejectReason,
    encode_manifest,
    kvsp_compat_id,
    parse_manifest,
    successor_conflict,
)
from kvcs_core.kvcs.names import KvcsNamespace
from kvcs_core.wire.names import TrackNamespace
from tests._vectors import load_vectors

VEC = load_vectors("kvsp-vectors.json")
E = ManifestErrorReason


def compat_id_of(cd: dict[str, Any]) -> bytes:
    """Binding section 1, written out here so the test does not need kvcs_core.kvsp."""
    return hashlib.sha256(b"KVSP-compat-v0" + cbor2.dumps(cd, canonical=True)).digest()[:16]


def hx(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


COMPAT_32 = {
    "kvsp": 0,
    "model": "org/name@rev",
    "layers": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "dtype": "bfloat16",
    "block_tokens": 16,
}

# The profile 3.6 example, as laid out there, with the placeholders filled in.
PROFILE_EXAMPLE = """{
  "kvcs": 1,
  "compat": COMPAT,
  "layers": 32,
  "block_tokens": 16,
  "deterministic": false,
  "segments": [
    { "segment": 0, "first_block": 0, "blocks": 64,
      "block_keys_sha256": "S0",
      "tracks": ["k.raw.s0", "v.raw.s0"],
      "complete": true },
    { "segment": 1, "first_block": 64, "blocks": 3,
      "block_keys_sha256": "S1",
      "tracks": ["k.raw.s1", "v.raw.s1"],
      "complete": false }
  ]
}
"""
PROFILE_EXAMPLE = (
    PROFILE_EXAMPLE.replace("COMPAT", json.dumps(COMPAT_32, indent=2))
    .replace('"S0"', f'"{hx("s0")}"')
    .replace('"S1"', f'"{hx("s1")}"')
)


def small_json(**top: Any) -> dict[str, Any]:
    """A small valid manifest as a JSON value (the vectors' descriptor: L=2, B=4)."""
    obj: dict[str, Any] = {
        "kvcs": 1,
        "compat": copy.deepcopy(VEC["inputs"]["compat"]),
        "layers": 2,
        "block_tokens": 4,
        "deterministic": True,
        "segments": [
            {
                "segment": 0,
                "first_block": 0,
                "blocks": 2,
                "block_keys_sha256": VEC["block_keys_sha256"],
                "tracks": ["k.raw.s0", "v.raw.s0"],
                "complete": True,
                "object_digests": {
                    "k.raw.s0": [[hx("k00"), hx("k01")], [hx("k10"), hx("k11")]],
                    "v.raw.s0": [[hx("v00"), hx("v01")], [hx("v10"), hx("v11")]],
                },
            },
            {
                "segment": 1,
                "first_block": 2,
                "blocks": 1,
                "block_keys_sha256": hx("s1"),
                "tracks": ["kv.q8.s1"],
                "complete": False,
                "object_digests": {"kv.q8.s1": [[hx("kv0")]]},
            },
        ],
    }
    obj.update(top)
    return obj


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def small() -> Manifest:
    return parse_manifest(dumps(small_json()))


# --- parse / encode ---------------------------------------------------------------------


def test_profile_example_parses() -> None:
    m = parse_manifest(PROFILE_EXAMPLE.encode())
    assert (m.kvcs, m.layers, m.block_tokens, m.deterministic) == (1, 32, 16, False)
    assert m.compat == COMPAT_32
    s0, s1 = m.segments
    assert (s0.segment, s0.first_block, s0.blocks, s0.complete) == (0, 0, 64, True)
    assert (s1.segment, s1.first_block, s1.blocks, s1.complete) == (1, 64, 3, False)
    assert s1.tracks == ("k.raw.s1", "v.raw.s1")
    assert s0.object_digests is None
    assert m.total_blocks == 67 and not m.complete
    assert s0.selections() == [("k.raw.s0", "v.raw.s0")]
    assert parse_manifest(m.encode()) == m


def test_encoding_is_deterministic_and_round_trips() -> None:
    m = small()
    raw = m.encode()
    assert raw == encode_manifest(m)
    assert b" " not in raw and b"\n" not in raw
    assert raw.startswith(b'{"block_tokens":4,"compat":{"block_tokens":4,"dtype":"float16"')
    assert parse_manifest(raw) == m
    assert parse_manifest(raw).encode() == raw
    # member order and whitespace of the input do not matter
    shuffled = json.dumps(dict(reversed(list(small_json().items()))), indent=3).encode()
    assert parse_manifest(shuffled).encode() == raw


def test_object_digests_omitted_when_absent() -> None:
    obj = small_json()
    for seg in obj["segments"]:
        del seg["object_digests"]
    m = parse_manifest(dumps(obj))
    assert b"object_digests" not in m.encode()
    assert m.digest_of("k.raw.s0", 0, 0) is None


def test_unknown_members_are_ignored() -> None:
    obj = small_json(future_member={"x": [1, 2]})
    obj["segments"][0]["note"] = "hi"
    assert parse_manifest(dumps(obj)) == small()


def test_lookups() -> None:
    m = small()
    assert m.digest_of("k.raw.s0", 1, 0) == bytes.fromhex(hx("k10"))
    assert m.digest_of(b"v.raw.s0", 0, 1) == bytes.fromhex(hx("v01"))
    assert m.digest_of("kv.q8.s1", 0, 0) == bytes.fromhex(hx("kv0"))
    assert m.digest_of("kv.q8.s1", 1, 0) is None  # Group 1 not completed yet
    assert m.digest_of("k.raw.s0", 2, 0) is None
    assert m.digest_of("k.raw.s0", 0, 2) is None
    assert m.digest_of("k.raw.s0", -1, 0) is None
    assert m.digest_of("k.q8.s0", 0, 0) is None  # not offered
    assert m.digest_of("k.raw.s7", 0, 0) is None
    assert m.digest_of("manifest", 0, 0) is None
    assert m.digest_of("K.raw.s0", 0, 0) is None
    assert m.segment_of_track("kv.q8.s1") is m.segments[1]
    assert m.segments[1].selections() == [("kv.q8.s1",)]
    assert m.segments[0].completed_groups("k.raw.s0") == 2
    assert m.token_start(1, 0) == 8
    assert m.segments[0].matches_block_keys(bytes.fromhex(VEC["block_keys_sha256"]))
    assert not m.segments[1].matches_block_keys(bytes(32))
    assert m.total_blocks == 3 and not m.complete


def test_lookups_asked_again_are_answered_the_same() -> None:
    """Track lookups are remembered per manifest (a consumer asks once per Object): a
    second round of the same questions gets the same answers, equal manifests stay equal,
    and what is remembered is bounded."""
    m = small()
    questions = [
        ("k.raw.s0", 1, 0), (b"v.raw.s0", 0, 1), ("kv.q8.s1", 0, 0), ("kv.q8.s1", 1, 0),
        ("k.q8.s0", 0, 0), ("k.raw.s7", 0, 0), ("manifest", 0, 0), ("K.raw.s0", 0, 0),
        (b"\xff", 0, 0),
    ]  # fmt: skip
    first = [m.digest_of(*q) for q in questions]
    assert first[0] == bytes.fromhex(hx("k10")) and first[3] is None
    assert [m.digest_of(*q) for q in questions] == first
    assert m.segment_of_track("kv.q8.s1") is m.segments[1]
    assert m.segment_of_track("k.raw.s7") is None
    assert m == small() and m.encode() == small().encode()
    for i in range(manifest_mod._FOUND_LIMIT + 10):
        assert m.digest_of(f"k.raw.s{i + 2}", 0, 0) is None
    assert len(m._found) == manifest_mod._FOUND_LIMIT
    assert m.digest_of("k.raw.s0", 1, 0) == bytes.fromhex(hx("k10"))


def test_compat_id_consistency() -> None:
    m = small()
    assert m.compat_id(compat_id_of).hex() == VEC["compat_id"]
    fields = tuple(bytes.fromhex(h) for h in VEC["namespace_fields_hex"])
    ns = KvcsNamespace.from_track_namespace(TrackNamespace(fields))
    m.check_compat_id(ns, compat_id_of)
    m.check_compat_id(ns.compat_id, compat_id_of)
    with pytest.raises(ManifestError) as info:
        m.check_compat_id(bytes(16), compat_id_of)
    assert info.value.reason is E.COMPAT_ID_MISMATCH
    other = parse_manifest(dumps(small_json(compat={**VEC["inputs"]["compat"], "model": "x"})))
    with pytest.raises(ManifestError) as info:
        other.check_compat_id(ns, compat_id_of)
    assert info.value.reason is E.COMPAT_ID_MISMATCH

    def refuses(cd: dict[str, Any]) -> bytes:
        raise ValueError("dtype not allowed")

    with pytest.raises(ManifestError) as info:
        m.check_compat_id(ns, refuses)
    assert info.value.reason is E.BAD_COMPAT

    def mutates(cd: dict[str, Any]) -> bytes:
        cd.clear()
        return compat_id_of(cd)

    with pytest.raises(ManifestError):
        m.check_compat_id(ns, mutates)
    assert m.compat == VEC["inputs"]["compat"]  # the manifest's copy is untouched


def test_compat_id_by_kvcs_core_kvsp_by_default() -> None:
    m = small()
    assert m.compat_id() == kvsp_compat_id(m.compat) == bytes.fromhex(VEC["compat_id"])
    fields = tuple(bytes.fromhex(h) for h in VEC["namespace_fields_hex"])
    m.check_compat_id(KvcsNamespace.from_track_namespace(TrackNamespace(fields)))
    # a descriptor that kvsp refuses (dtype not in the binding's list) is BAD_COMPAT
    bad = parse_manifest(dumps(small_json(compat={**VEC["inputs"]["compat"], "dtype": "int4"})))
    with pytest.raises(ManifestError) as info:
        bad.check_compat_id(bytes(16))
    assert info.value.reason is E.BAD_COMPAT


def test_compat_is_a_private_copy() -> None:
    cd = copy.deepcopy(VEC["inputs"]["compat"])
    m = Manifest(compat=cd, layers=2, block_tokens=4, deterministic=False, segments=[])
    cd["layers"] = 99
    assert m.compat["layers"] == 2
    assert m.segments == () and m.total_blocks == 0 and not m.complete


# --- strict parsing ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff{}", E.NOT_UTF8),
        (b"\xef\xbb\xbf" + dumps(small_json()), E.BAD_JSON),  # BOM
        (dumps(small_json()) + b"x", E.BAD_JSON),
        (b"", E.BAD_JSON),
        (b"{", E.BAD_JSON),
        (dumps(small_json()).replace(b'"kvcs": 1', b'"kvcs": 1, "kvcs": 1'), E.DUPLICATE_MEMBER),
        (
            dumps(small_json()).replace(b'"model"', b'"kvsp": 0, "model"'),
            E.DUPLICATE_MEMBER,
        ),
        (dumps(small_json()).replace(b'"layers": 2', b'"layers": 2.0'), E.NOT_AN_INTEGER),
        (dumps(small_json()).replace(b'"layers": 2', b'"layers": 2e0'), E.NOT_AN_INTEGER),
        (dumps(small_json()).replace(b'"head_dim": 4', b'"head_dim": NaN'), E.NOT_AN_INTEGER),
        (dumps(small_json()).replace(b'"head_dim": 4', b'"head_dim": -Infinity'), E.NOT_AN_INTEGER),
        (dumps(small_json()).replace(b'"layers": 2', b'"layers": ' + b"9" * 5000), E.BAD_JSON),
        (b"[" * 100000 + b"]" * 100000, E.BAD_JSON),
        (b"[]", E.BAD_TYPE),
        (b"null", E.BAD_TYPE),
    ],
)
def test_strict_syntax(raw: bytes, reason: ManifestErrorReason) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(raw)
    assert info.value.reason is reason, info.value


def test_size_limit() -> None:
    raw = dumps(small_json())
    assert parse_manifest(raw, max_size=len(raw)) == small()
    with pytest.raises(ManifestError) as info:
        parse_manifest(raw, max_size=len(raw) - 1)
    assert info.value.reason is E.TOO_LARGE


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        target: Any = obj
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value

    return apply


def _del(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        target: Any = obj
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]

    return apply


def _all(*fns: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        for f in fns:
            f(obj)

    return apply


S0 = ["segments", 0]
S1 = ["segments", 1]
KD = [*S0, "object_digests", "k.raw.s0"]

VALIDATION_CASES = [
    ("version 2", _set(["kvcs"], 2), E.UNSUPPORTED_VERSION, "kvcs"),
    ("version true", _set(["kvcs"], True), E.UNSUPPORTED_VERSION, "kvcs"),
    ("version string", _set(["kvcs"], "1"), E.UNSUPPORTED_VERSION, "kvcs"),
    ("no version", _del(["kvcs"]), E.MISSING_MEMBER, "kvcs"),
    ("no compat", _del(["compat"]), E.MISSING_MEMBER, "compat"),
    ("no layers", _del(["layers"]), E.MISSING_MEMBER, "layers"),
    ("no block_tokens", _del(["block_tokens"]), E.MISSING_MEMBER, "block_tokens"),
    ("no deterministic", _del(["deterministic"]), E.MISSING_MEMBER, "deterministic"),
    ("no segments", _del(["segments"]), E.MISSING_MEMBER, "segments"),
    ("compat array", _set(["compat"], []), E.BAD_TYPE, "compat"),
    ("layers string", _set(["layers"], "2"), E.BAD_TYPE, "layers"),
    ("layers bool", _set(["layers"], True), E.BAD_TYPE, "layers"),
    ("layers 0", _set(["layers"], 0), E.BAD_VALUE, "layers"),
    ("block_tokens -4", _set(["block_tokens"], -4), E.BAD_VALUE, "block_tokens"),
    ("deterministic 1", _set(["deterministic"], 1), E.BAD_TYPE, "deterministic"),
    ("segments object", _set(["segments"], {}), E.BAD_TYPE, "segments"),
    ("layers != compat", _set(["layers"], 3), E.LAYERS_MISMATCH, "layers"),
    ("compat layers", _set(["compat", "layers"], 3), E.LAYERS_MISMATCH, "layers"),
    ("compat no layers", _del(["compat", "layers"]), E.MISSING_MEMBER, "compat.layers"),
    ("block_tokens != compat", _set(["block_tokens"], 8), E.BLOCK_TOKENS_MISMATCH, "block_tokens"),
    (
        "compat no block_tokens",
        _del(["compat", "block_tokens"]),
        E.MISSING_MEMBER,
        "compat.block_tokens",
    ),
    ("compat lone surrogate", _set(["compat", "model"], "\ud800"), E.BAD_VALUE, "compat.model"),
    ("segment entry array", _set(S0, []), E.BAD_TYPE, "segments[0]"),
    ("segment missing member", _del([*S0, "blocks"]), E.MISSING_MEMBER, "segments[0].blocks"),
    (
        "segment numbering",
        _all(
            _set([*S1, "segment"], 2),
            _set([*S1, "tracks"], ["kv.q8.s2"]),
            _set([*S1, "object_digests"], {"kv.q8.s2": []}),
        ),
        E.SEGMENT_NUMBERING,
        "segments[1].segment",
    ),
    ("segment 0 numbered 1", _set([*S0, "segment"], 1), E.TRACK_SEGMENT_MISMATCH, "tracks[0]"),
    ("first_block gap", _set([*S1, "first_block"], 3), E.FIRST_BLOCK_GAP, "first_block"),
    ("first_block overlap", _set([*S1, "first_block"], 1), E.FIRST_BLOCK_GAP, "first_block"),
    ("segment 0 not at 0", _set([*S0, "first_block"], 1), E.FIRST_BLOCK_GAP, "first_block"),
    ("zero blocks", _set([*S1, "blocks"], 0), E.BAD_VALUE, "segments[1].blocks"),
    ("complete null", _set([*S0, "complete"], None), E.BAD_TYPE, "segments[0].complete"),
    ("keys hex short", _set([*S0, "block_keys_sha256"], "ab"), E.BAD_HEX, "block_keys_sha256"),
    ("keys hex upper", _set([*S0, "block_keys_sha256"], hx("a").upper()), E.BAD_HEX, ""),
    ("keys hex int", _set([*S0, "block_keys_sha256"], 5), E.BAD_TYPE, "block_keys_sha256"),
    ("tracks string", _set([*S0, "tracks"], "k.raw.s0"), E.BAD_TYPE, "segments[0].tracks"),
    ("tracks empty", _set([*S1, "tracks"], []), E.BAD_VALUE, "segments[1].tracks"),
    ("track not str", _set([*S1, "tracks"], [7]), E.BAD_TYPE, "tracks[0]"),
    ("track bad grammar", _set([*S1, "tracks"], ["kv.Q8.s1"]), E.BAD_TRACK_NAME, "tracks[0]"),
    ("track leading 0", _set([*S1, "tracks"], ["kv.q8.s01"]), E.BAD_TRACK_NAME, "tracks[0]"),
    ("manifest as track", _set([*S1, "tracks"], ["manifest"]), E.BAD_TRACK_NAME, "tracks[0]"),
    (
        "track other segment",
        _set([*S0, "tracks"], ["k.raw.s0", "v.raw.s1"]),
        E.TRACK_SEGMENT_MISMATCH,
        "segments[0].tracks[1]",
    ),
    (
        "duplicate track",
        _set([*S0, "tracks"], ["k.raw.s0", "k.raw.s0"]),
        E.DUPLICATE_TRACK,
        "tracks[1]",
    ),
    ("digests array", _set([*S0, "object_digests"], []), E.BAD_TYPE, "object_digests"),
    ("digests null", _set([*S0, "object_digests"], None), E.BAD_TYPE, "object_digests"),
    (
        "digests lack a track",
        _del([*S0, "object_digests", "v.raw.s0"]),
        E.DIGEST_TRACKS_MISMATCH,
        "object_digests",
    ),
    (
        "digests extra track",
        _set([*S1, "object_digests", "k.raw.s1"], []),
        E.DIGEST_TRACKS_MISMATCH,
        "object_digests",
    ),
    ("digests groups not array", _set(KD, {}), E.BAD_TYPE, "object_digests.k.raw.s0"),
    ("digests group not array", _set([*KD, 0], hx("x")), E.BAD_TYPE, "k.raw.s0[0]"),
    ("group too short", _set([*KD, 0], [hx("x")]), E.DIGEST_SHAPE, "k.raw.s0[0]"),
    ("group too long", _set([*KD, 1], [hx("x")] * 3), E.DIGEST_SHAPE, "k.raw.s0[1]"),
    ("complete lacks a group", _set(KD, [[hx("a"), hx("b")]]), E.DIGEST_SHAPE, "k.raw.s0"),
    (
        "more groups than layers",
        _set([*S1, "object_digests", "kv.q8.s1"], [[hx("a")]] * 3),
        E.DIGEST_SHAPE,
        "kv.q8.s1",
    ),
    ("digest not hex", _set([*KD, 0, 1], "zz" * 32), E.BAD_HEX, "k.raw.s0[0][1]"),
    ("digest int", _set([*KD, 0, 1], 0), E.BAD_TYPE, "k.raw.s0[0][1]"),
    # a whole Group is checked in one pass; each of these must still name its digest
    ("digest upper", _set([*KD, 1, 0], hx("u").upper()), E.BAD_HEX, "k.raw.s0[1][0]"),
    ("digest spaced", _set([*KD, 0, 1], hx("s")[:60] + " ab "), E.BAD_HEX, "k.raw.s0[0][1]"),
    ("digest short", _set([*KD, 0, 0], hx("s")[:62]), E.BAD_HEX, "k.raw.s0[0][0]"),
    ("digest long", _set([*KD, 0, 1], hx("s") + "00"), E.BAD_HEX, "k.raw.s0[0][1]"),
    ("digest non-ascii", _set([*KD, 0, 1], hx("s")[:63] + "\u0660"), E.BAD_HEX, "[0][1]"),
    ("token start overflow", _set([*S1, "blocks"], 2**32), E.BAD_VALUE, "segments[1].blocks"),
]


@pytest.mark.parametrize(
    ("mutate", "reason", "path"),
    [c[1:] for c in VALIDATION_CASES],
    ids=[c[0] for c in VALIDATION_CASES],
)
def test_validation_errors(
    mutate: Callable[[dict[str, Any]], None], reason: ManifestErrorReason, path: str
) -> None:
    obj = small_json()
    mutate(obj)
    # a huge block count also needs compat numbers that reach the 64-bit limit
    if reason is E.BAD_VALUE and obj["segments"][1]["blocks"] == 2**32:
        obj["block_tokens"] = obj["compat"]["block_tokens"] = 2**32 - 1
        del obj["segments"][1]["object_digests"]
    with pytest.raises(ManifestError) as info:
        parse_manifest(dumps(obj))
    err = info.value
    assert err.reason is reason, err
    assert path in err.path, err
    assert isinstance(err, ValueError) and err.detail


def test_digests_must_be_exactly_str() -> None:
    class Text(str):
        pass

    digests = {"k.raw.s0": ((hx("a"), Text(hx("b"))),)}
    with pytest.raises(ManifestError) as info:
        Segment(
            segment=0,
            first_block=0,
            blocks=2,
            block_keys_sha256=hx("k"),
            tracks=["k.raw.s0"],
            complete=False,
            object_digests=digests,
        )
    assert info.value.reason is E.BAD_TYPE and info.value.path.endswith("[0][1]")


def test_direct_construction_validates_too() -> None:
    seg = Segment(
        segment=0,
        first_block=0,
        blocks=1,
        block_keys_sha256=hx("k"),
        tracks=["k.raw.s0", "v.raw.s0"],
        complete=False,
    )
    assert seg.tracks == ("k.raw.s0", "v.raw.s0")
    m = Manifest(
        compat=VEC["inputs"]["compat"],
        layers=2,
        block_tokens=4,
        deterministic=False,
        segments=[seg],
    )
    assert parse_manifest(m.encode()) == m
    with pytest.raises(ManifestError) as info:
        Manifest(
            compat={"layers": 2, "block_tokens": 4, "x": 0.5},
            layers=2,
            block_tokens=4,
            deterministic=False,
            segments=[],
        )
    assert info.value.reason is E.NOT_AN_INTEGER
    with pytest.raises(ManifestError) as info:
        Manifest(
            compat={"layers": 2, "block_tokens": 4, "x": object()},
            layers=2,
            block_tokens=4,
            deterministic=False,
            segments=[],
        )
    assert info.value.reason is E.BAD_TYPE
    with pytest.raises(ManifestError) as info:
        Manifest(
            compat={"layers": 2, "block_tokens": 4},
            layers=2,
            block_tokens=4,
            deterministic=False,
            segments=["nope"],
        )
    assert info.value.reason is E.BAD_TYPE


# --- property: valid manifests round trip ---------------------------------------------------

hex_digests = st.binary(min_size=32, max_size=32).map(bytes.hex)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    layers = draw(st.integers(1, 4))
    block_tokens = draw(st.integers(1, 64))
    compat = {
        "kvsp": 0,
        "model": draw(st.text(max_size=10)),
        "layers": layers,
        "block_tokens": block_tokens,
        "extra": draw(
            st.dictionaries(st.text(max_size=4), st.integers() | st.booleans(), max_size=3)
        ),
    }
    segments = []
    first = 0
    for n in range(draw(st.integers(0, 3))):
        blocks = draw(st.integers(1, 3))
        codecs = draw(
            st.lists(st.sampled_from(["raw", "q8", "x-1"]), min_size=1, max_size=2, unique=True)
        )
        tracks = [f"{c}.{codec}.s{n}" for codec in codecs for c in ("k", "v")]
        complete = draw(st.booleans())
        digests = None
        if draw(st.booleans()):
            digests = {}
            for t in tracks:
                groups = layers if complete else draw(st.integers(0, layers))
                digests[t] = [[draw(hex_digests) for _ in range(blocks)] for _ in range(groups)]
        segments.append(
            Segment(
                segment=n,
                first_block=first,
                blocks=blocks,
                block_keys_sha256=draw(hex_digests),
                tracks=tracks,
                complete=complete,
                object_digests=digests,
            )
        )
        first += blocks
    return Manifest(
        compat=compat,
        layers=layers,
        block_tokens=block_tokens,
        deterministic=draw(st.booleans()),
        segments=segments,
    )


@settings(max_examples=60)
@given(manifests())
def test_encode_parse_round_trip(m: Manifest) -> None:
    raw = m.encode()
    back = parse_manifest(raw)
    assert back == m
    assert back.encode() == raw
    assert json.loads(raw) == m.to_json()


@given(st.binary(max_size=64))
def test_garbage_raises_only_manifest_error(raw: bytes) -> None:
    with contextlib.suppress(ManifestError):
        parse_manifest(raw)


# --- versions -------------------------------------------------------------------------------


def _grown() -> Manifest:
    obj = small_json()
    obj["segments"][1]["object_digests"]["kv.q8.s1"].append([hx("kv1")])
    obj["segments"][1]["complete"] = True
    obj["segments"][1]["tracks"].append("k.raw.s1")
    obj["segments"][1]["object_digests"]["k.raw.s1"] = [[hx("a")], [hx("b")]]
    obj["segments"].append(
        {
            "segment": 2,
            "first_block": 3,
            "blocks": 1,
            "block_keys_sha256": hx("s2"),
            "tracks": ["kv.q8.s2"],
            "complete": False,
        }
    )
    return parse_manifest(dumps(obj))


def test_versions_go_forward_only() -> None:
    v = ManifestVersions()
    assert (v.latest, v.latest_group) == (None, None)
    m0 = small()
    assert v.offer(4, m0) is m0
    assert (v.latest_group, v.latest) == (4, m0)
    dup = v.offer(4, m0)
    assert isinstance(dup, VersionRejected) and dup.reason is VersionRejectReason.DUPLICATE
    stale = v.offer(3, m0)
    assert isinstance(stale, VersionRejected) and stale.reason is VersionRejectReason.STALE
    m1 = _grown()
    assert v.offer(7, m1) is m1  # gaps are fine (a version may be missed)
    assert v.latest_group == 7
    back = v.offer(8, m0)  # newer Group, but it takes back what m1 said
    assert isinstance(back, VersionRejected) and back.reason is VersionRejectReason.INCONSISTENT
    assert v.latest is m1


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (_set(["deterministic"], False), "deterministic changed"),
        (_set(["compat", "model"], "other"), "compat changed"),
        (_del(["segments", 1]), "segments went from 2 to 1"),
        (_all(_del([*S1, "object_digests"]), _set([*S1, "blocks"], 5)), "first_block, blocks"),
        (_set([*S1, "block_keys_sha256"], hx("zz")), "block_keys_sha256"),
        (_set([*S0, "complete"], False), "complete went back to false"),
        (_set([*S1, "tracks"], ["kv.q8.s1", "kv.q9.s1"]), None),  # digests lack kv.q9.s1
        (_set([*KD, 1, 0], hx("changed")), "listed digests of k.raw.s0"),
    ],
)
def test_successor_conflicts(mutate: Callable[[dict[str, Any]], None], why: str | None) -> None:
    obj = small_json()
    mutate(obj)
    try:
        new = parse_manifest(dumps(obj))
    except ManifestError:
        assert why is None
        return
    assert why is not None
    conflict = successor_conflict(small(), new)
    assert conflict is not None and why in conflict


def test_successor_conflicts_completion_and_tracks() -> None:
    done = small_json()
    done["segments"][1]["complete"] = True
    done["segments"][1]["object_digests"]["kv.q8.s1"].append([hx("kv1")])
    m_done = parse_manifest(dumps(done))
    assert successor_conflict(small(), m_done) is None
    assert "complete went back" in (successor_conflict(m_done, small()) or "")
    fewer = small_json()
    fewer["segments"][0]["tracks"] = ["k.raw.s0"]
    del fewer["segments"][0]["object_digests"]["v.raw.s0"]
    assert "withdrawn" in (successor_conflict(small(), parse_manifest(dumps(fewer))) or "")
    shrunk = small_json()
    shrunk["segments"][1]["object_digests"]["kv.q8.s1"] = []
    assert "shrank" in (successor_conflict(small(), parse_manifest(dumps(shrunk))) or "")
    assert successor_conflict(small(), _grown()) is None


# --- COSE_Sign1 (manifest.cose) --------------------------------------------------------------

ED_KEY = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
ED_KID = b"producer-ed25519"
P256_KEY = ec.derive_private_key(0x1234567890ABCDEF, ec.SECP256R1())
P256_KID = b"producer-p256"
KEYS: dict[bytes, Any] = {ED_KID: ED_KEY.public_key(), P256_KID: P256_KEY.public_key()}


def _sig_structure(phdr: bytes, payload: bytes) -> bytes:
    return cbor2.dumps(["Signature1", phdr, b"", payload])


def _ed_sign1(
    phdr: dict[Any, Any] | bytes,
    uhdr: dict[Any, Any],
    payload: Any,
    *,
    tag: int | None = 18,
    key: ed25519.Ed25519PrivateKey = ED_KEY,
) -> bytes:
    """An EdDSA COSE_Sign1 built by hand (independently of pycose)."""
    phdr_bytes = phdr if isinstance(phdr, bytes) else cbor2.dumps(phdr)
    sig = key.sign(_sig_structure(phdr_bytes, payload if isinstance(payload, bytes) else b""))
    body = [phdr_bytes, uhdr, payload, sig]
    return cbor2.dumps(cbor2.CBORTag(tag, body) if tag is not None else body)


def test_ed25519_golden_bytes() -> None:
    payload = small().encode()
    signed = sign_manifest(payload, ED_KEY, ED_KID)
    # built independently: protected {1: -8, 4: kid}, empty unprotected map, tag 18
    phdr = b"\xa2\x01\x27\x04" + cbor2.dumps(ED_KID)
    assert phdr == cbor2.dumps({1: -8, 4: ED_KID})
    sig = ED_KEY.sign(_sig_structure(phdr, payload))
    assert signed == cbor2.dumps(cbor2.CBORTag(18, [phdr, {}, payload, sig]))
    assert signed == sign_manifest(payload, ED_KEY, ED_KID)  # deterministic
    tiny = sign_manifest(b"{}", ED_KEY, b"k")
    assert tiny.hex() == (
        "d28446a2012704416ba0427b7d5840"
        + ED_KEY.sign(_sig_structure(bytes.fromhex("a20127044" + "16b"), b"{}")).hex()
    )
    assert verify_manifest(signed, KEYS) == payload
    assert parse_manifest(verify_manifest(signed, KEYS)) == small()  # type: ignore[arg-type]


def test_es256_sign_and_verify() -> None:
    payload = small().encode()
    signed = sign_manifest(payload, P256_KEY, P256_KID)
    assert verify_manifest(signed, KEYS) == payload
    decoded = cbor2.loads(signed)
    assert decoded.tag == 18 and cbor2.loads(decoded.value[0]) == {1: -7, 4: P256_KID}
    assert len(decoded.value[3]) == 64  # r || s, not DER
    # independent check of the signature with cryptography (DER-wrap r || s)
    r, s = (int.from_bytes(decoded.value[3][i : i + 32], "big") for i in (0, 32))
    P256_KEY.public_key().verify(
        encode_dss_signature(r, s),
        _sig_structure(decoded.value[0], payload),
        ec.ECDSA(hashes.SHA256()),
    )


def test_keys_as_pycose_objects() -> None:
    payload = b'{"x":1}'
    cose_priv = to_cose_key(P256_KEY)
    assert isinstance(cose_priv, EC2Key) and cose_priv.crv is P256
    signed = sign_manifest(payload, cose_priv, b"p")
    pub = to_cose_key(P256_KEY.public_key())
    assert verify_manifest(signed, {b"p": pub}) == payload
    ed_pub = to_cose_key(ED_KEY.public_key())
    assert (
        verify_manifest(sign_manifest(payload, to_cose_key(ED_KEY), b"e"), {b"e": ed_pub})
        == payload
    )
    # a private key works as the verification key too
    assert verify_manifest(sign_manifest(payload, ED_KEY, b"e"), {b"e": ED_KEY}) == payload


def test_ed448_is_eddsa_too() -> None:
    key = ed448.Ed448PrivateKey.from_private_bytes(bytes(57))
    signed = sign_manifest(b"{}", key, b"448")
    assert verify_manifest(signed, {b"448": key.public_key()}) == b"{}"


def _reason(result: bytes | ManifestRejected) -> CoseRejectReason:
    assert isinstance(result, ManifestRejected), result
    return result.reason


def test_tampered_payload_and_wrong_key() -> None:
    payload = small().encode()
    for key, kid in ((ED_KEY, ED_KID), (P256_KEY, P256_KID)):
        signed = sign_manifest(payload, key, kid)
        tampered = signed.replace(b'"deterministic":true', b'"deterministic":fals')
        assert len(tampered) == len(signed)
        tampered = tampered.replace(b"fals", b"f\x00ls")
        assert _reason(verify_manifest(tampered, KEYS)) is CoseRejectReason.BAD_SIGNATURE
        flipped = bytearray(signed)
        flipped[-1] ^= 1
        assert _reason(verify_manifest(bytes(flipped), KEYS)) is CoseRejectReason.BAD_SIGNATURE
    other_ed = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(32))
    signed = sign_manifest(payload, other_ed, ED_KID)
    r = verify_manifest(signed, KEYS)
    assert _reason(r) is CoseRejectReason.BAD_SIGNATURE
    assert isinstance(r, ManifestRejected) and r.kid == ED_KID
    other_p = ec.derive_private_key(7, ec.SECP256R1())
    assert (
        _reason(verify_manifest(sign_manifest(payload, other_p, P256_KID), KEYS))
        is CoseRejectReason.BAD_SIGNATURE
    )


def test_unknown_kid_and_wrong_alg() -> None:
    payload = b"{}"
    assert (
        _reason(verify_manifest(sign_manifest(payload, ED_KEY, b"who"), KEYS))
        is CoseRejectReason.UNKNOWN_KID
    )
    assert (
        _reason(verify_manifest(sign_manifest(payload, ED_KEY, ED_KID), {}))
        is CoseRejectReason.UNKNOWN_KID
    )
    # EdDSA message, kid maps to a P-256 key; ES256 message, kid maps to an Ed25519 key
    assert (
        _reason(verify_manifest(sign_manifest(payload, ED_KEY, P256_KID), KEYS))
        is CoseRejectReason.KEY_MISMATCH
    )
    assert (
        _reason(verify_manifest(sign_manifest(payload, P256_KEY, ED_KID), KEYS))
        is CoseRejectReason.KEY_MISMATCH
    )
    restricted = to_cose_key(P256_KEY.public_key())
    restricted.alg = Es256
    ok = sign_manifest(payload, P256_KEY, b"r")
    assert verify_manifest(ok, {b"r": restricted}) == payload


GARBAGE = [
    b"",
    b"\xff",
    b"\x00",
    b"garbage bytes that are not CBOR",
    cbor2.dumps([]),
    cbor2.dumps({"a": 1}),
    cbor2.dumps(cbor2.CBORTag(18, [b"", {}, b"x"])),
    cbor2.dumps(cbor2.CBORTag(18, [b"", {}, b"x", b"s", b"extra"])),
    cbor2.dumps(cbor2.CBORTag(98, [b"", {}, b"x", b"s"])),  # COSE_Sign, not COSE_Sign1
    cbor2.dumps(cbor2.CBORTag(18, ["", {}, b"x", b"s"])),
    cbor2.dumps(cbor2.CBORTag(18, [b"", [], b"x", b"s"])),
    cbor2.dumps(cbor2.CBORTag(18, [b"", {}, "x", b"s"])),
    cbor2.dumps(cbor2.CBORTag(18, [b"", {}, b"x", 5])),
    cbor2.dumps(cbor2.CBORTag(18, [b"", {}, None, b"s"])),  # detached payload
    cbor2.dumps(cbor2.CBORTag(18, [b"\xff", {}, b"x", b"s"])),  # protected not CBOR
    cbor2.dumps(cbor2.CBORTag(18, [cbor2.dumps([1]), {}, b"x", b"s"])),  # protected not a map
    cbor2.dumps(cbor2.CBORTag(18, [cbor2.dumps({1: -8}) + b"\x00", {}, b"x", b"s"])),
    cbor2.dumps(cbor2.CBORTag(18, [cbor2.dumps({1.5: -8}), {}, b"x", b"s"])),
    cbor2.dumps(cbor2.CBORTag(18, [cbor2.dumps({1: -8}), {1: -8}, b"x", b"s"])),  # both buckets
    b"\xd2\x84\x43\xa1\x01\x27\xa2\x04\x41a\x04\x41b\x41x\x41s",  # duplicate label 4
]


@pytest.mark.parametrize("raw", GARBAGE)
def test_malformed_is_a_typed_rejection(raw: bytes) -> None:
    assert _reason(verify_manifest(raw, KEYS)) is CoseRejectReason.MALFORMED


def test_trailing_bytes_and_size_limit() -> None:
    signed = sign_manifest(b"{}", ED_KEY, ED_KID)
    assert _reason(verify_manifest(signed + b"\x00", KEYS)) is CoseRejectReason.MALFORMED
    assert verify_manifest(signed, KEYS, max_size=len(signed)) == b"{}"
    assert (
        _reason(verify_manifest(signed, KEYS, max_size=len(signed) - 1))
        is CoseRejectReason.TOO_LARGE
    )


def test_header_rules() -> None:
    p = b"{}"
    # untagged COSE_Sign1 is accepted (RFC 9052 section 2), also with kid unprotected
    assert verify_manifest(_ed_sign1({1: -8, 4: ED_KID}, {}, p, tag=None), KEYS) == p
    assert verify_manifest(_ed_sign1({1: -8}, {4: ED_KID}, p), KEYS) == p
    assert verify_manifest(memoryview(_ed_sign1({1: -8}, {4: ED_KID}, p)), KEYS) == p
    # alg: missing, unprotected, unsupported, a string
    cases: list[tuple[bytes, CoseRejectReason]] = [
        (_ed_sign1({4: ED_KID}, {}, p), CoseRejectReason.UNSUPPORTED_ALG),
        (_ed_sign1(b"", {1: -8, 4: ED_KID}, p), CoseRejectReason.UNSUPPORTED_ALG),
        (_ed_sign1({1: -35, 4: ED_KID}, {}, p), CoseRejectReason.UNSUPPORTED_ALG),
        (_ed_sign1({1: "EdDSA", 4: ED_KID}, {}, p), CoseRejectReason.UNSUPPORTED_ALG),
        (_ed_sign1({1: -8, 2: [4], 4: ED_KID}, {}, p), CoseRejectReason.CRITICAL_HEADER),
        (_ed_sign1({1: -8}, {}, p), CoseRejectReason.MISSING_KID),
        (_ed_sign1({1: -8, 4: "text-kid"}, {}, p), CoseRejectReason.MALFORMED),
        (
            _ed_sign1(
                {1: -8, 4: ED_KID},
                {},
                p,
                key=ed25519.Ed25519PrivateKey.from_private_bytes(bytes(32)),
            ),
            CoseRejectReason.BAD_SIGNATURE,
        ),
        (_ed_sign1({1: -8, 4: ED_KID}, {}, p)[:-3] + b"\x41\x00", CoseRejectReason.MALFORMED),
    ]
    for raw, reason in cases:
        assert _reason(verify_manifest(raw, KEYS)) is reason, (raw.hex(), reason)
    # a signature of the wrong length for ES256
    short = cbor2.dumps(cbor2.CBORTag(18, [cbor2.dumps({1: -7, 4: P256_KID}), {}, p, b"\x01"]))
    assert _reason(verify_manifest(short, KEYS)) is CoseRejectReason.BAD_SIGNATURE


@given(st.binary(max_size=120))
def test_arbitrary_bytes_never_raise(raw: bytes) -> None:
    assert isinstance(verify_manifest(raw, KEYS), ManifestRejected)


@settings(max_examples=50)
@given(st.integers(0, 200), st.integers(0, 7))
def test_any_bit_flip_is_rejected(index: int, bit: int) -> None:
    signed = bytearray(sign_manifest(b'{"kvcs":1}', ED_KEY, ED_KID))
    signed[index % len(signed)] ^= 1 << bit
    assert isinstance(verify_manifest(bytes(signed), KEYS), ManifestRejected)


def test_signing_key_misuse() -> None:
    with pytest.raises(CoseKeyError, match="P-256"):
        sign_manifest(b"{}", ec.derive_private_key(5, ec.SECP384R1()), b"k")
    with pytest.raises(CoseKeyError, match="unsupported"):
        sign_manifest(b"{}", rsa.generate_private_key(65537, 1024), b"k")  # type: ignore[arg-type]
    with pytest.raises(CoseKeyError, match="private"):
        sign_manifest(b"{}", to_cose_key(ED_KEY.public_key()), b"k")
    with pytest.raises(CoseKeyError, match="kid"):
        sign_manifest(b"{}", ED_KEY, b"")
    with pytest.raises(CoseKeyError, match="kid"):
        sign_manifest(b"{}", ED_KEY, "k")  # type: ignore[arg-type]
    restricted = to_cose_key(ED_KEY)
    restricted.alg = Es256
    with pytest.raises(CoseKeyError):
        sign_manifest(b"{}", restricted, b"k")
