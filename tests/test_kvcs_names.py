"""KVCS namespaces (profile 3.1, binding 4) and the Track Name grammar (profile 3.2)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcs_core.kvcs.names import (
    KVCS_NAMESPACE_TAG,
    Component,
    DataTrackName,
    KvcsNameError,
    KvcsNamespace,
    ManifestTrackName,
    TrackNameSpec,
    check_codec_name,
    content_prefix,
    data_track_name,
    is_kvcs_namespace,
    parse_track_name,
    scope_prefix,
)
from kvcs_core.wire.names import FullTrackName, TrackNamespace
from tests._vectors import load_vectors

VEC = load_vectors("kvsp-vectors.json")
FIELDS = [bytes.fromhex(h) for h in VEC["namespace_fields_hex"]]


# --- namespace ------------------------------------------------------------------


def test_vector_namespace_parses_and_rebuilds() -> None:
    wire = TrackNamespace(tuple(FIELDS))
    ns = KvcsNamespace.from_track_namespace(wire)
    assert ns.scope_id.hex() == VEC["scope_id"]
    assert ns.compat_id.hex() == VEC["compat_id"]
    assert ns.anchor_key.hex() == VEC["anchor_key"]
    assert ns.publication_id == bytes(16)
    assert ns.to_track_namespace() == wire
    assert FIELDS[0] == KVCS_NAMESPACE_TAG == b"kvcs-1"


def test_prefixes() -> None:
    ns = KvcsNamespace.from_track_namespace(TrackNamespace(tuple(FIELDS)))
    full = ns.to_track_namespace()
    assert ns.scope_prefix() == TrackNamespace((b"kvcs-1", ns.scope_id))
    assert ns.scope_prefix() == scope_prefix(ns.scope_id)
    assert ns.content_prefix() == TrackNamespace(tuple(FIELDS[:4]))
    assert ns.content_prefix() == content_prefix(ns.scope_id, ns.compat_id, ns.anchor_key)
    assert ns.scope_prefix().is_prefix_of(ns.content_prefix())
    assert ns.content_prefix().is_prefix_of(full)
    assert full.suffix_after(ns.content_prefix()).fields == (ns.publication_id,)


def test_full_track_name() -> None:
    ns = KvcsNamespace(b"s" * 16, b"c" * 16, b"a" * 32, b"p" * 16)
    ftn = ns.full_track_name("k.raw.s0")
    assert ftn == FullTrackName(ns.to_track_namespace(), b"k.raw.s0")
    assert ns.full_track_name(ManifestTrackName(signed=True)).name == b"manifest.cose"
    with pytest.raises(KvcsNameError):
        ns.full_track_name("k.RAW.s0")


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (FIELDS[:4], "5 fields"),
        ([*FIELDS, b"x"], "5 fields"),
        ([b"kvcs-2", *FIELDS[1:]], "field 0"),
        ([b"KVCS-1", *FIELDS[1:]], "field 0"),
        ([FIELDS[0], FIELDS[1][:15], *FIELDS[2:]], "Scope ID"),
        ([*FIELDS[:2], FIELDS[2] + b"\0", *FIELDS[3:]], "Compatibility ID"),
        ([*FIELDS[:3], FIELDS[3][:16], FIELDS[4]], "Anchor Key"),
        ([*FIELDS[:4], bytes(32)], "Publication ID"),
    ],
)
def test_non_kvcs_namespaces(fields: list[bytes], why: str) -> None:
    wire = TrackNamespace(tuple(fields))
    with pytest.raises(KvcsNameError, match=why):
        KvcsNamespace.from_track_namespace(wire)
    assert KvcsNamespace.try_parse(wire) is None
    assert not is_kvcs_namespace(wire)


def test_constructor_validates_lengths_and_types() -> None:
    with pytest.raises(KvcsNameError, match="Anchor Key must be 32 octets"):
        KvcsNamespace(bytes(16), bytes(16), bytes(16), bytes(16))
    with pytest.raises(KvcsNameError, match="must be bytes"):
        KvcsNamespace("x" * 16, bytes(16), bytes(32), bytes(16))  # type: ignore[arg-type]
    with pytest.raises(KvcsNameError):
        scope_prefix(bytes(15))
    with pytest.raises(KvcsNameError):
        content_prefix(bytes(16), bytes(16), bytes(31))


# --- track names --------------------------------------------------------------------

ACCEPT = [
    ("manifest", ManifestTrackName(signed=False)),
    ("manifest.cose", ManifestTrackName(signed=True)),
    ("k.raw.s0", DataTrackName(Component.K, "raw", 0)),
    ("v.raw.s0", DataTrackName(Component.V, "raw", 0)),
    ("kv.q8.s12", DataTrackName(Component.KV, "q8", 12)),
    ("k.a.s0", DataTrackName(Component.K, "a", 0)),
    ("k.-.s1", DataTrackName(Component.K, "-", 1)),
    ("k.0.s9", DataTrackName(Component.K, "0", 9)),
    ("v.my-codec-2.s1000000", DataTrackName(Component.V, "my-codec-2", 1000000)),
    ("kv." + "z" * 32 + ".s10", DataTrackName(Component.KV, "z" * 32, 10)),
]


@pytest.mark.parametrize(("text", "spec"), ACCEPT)
def test_grammar_accepts(text: str, spec: TrackNameSpec) -> None:
    assert TrackNameSpec.parse(text) == spec
    assert TrackNameSpec.parse(text.encode()) == spec
    assert parse_track_name(text) == spec
    assert spec.build() == text.encode()
    assert str(spec) == text
    assert spec.is_manifest == text.startswith("manifest")


REJECT = [
    ("", "empty"),
    ("Manifest", "3 dot-separated"),
    ("MANIFEST", "3 dot-separated"),
    ("manifest.", "3 dot-separated"),
    ("manifest.COSE", "3 dot-separated"),
    ("manifest.json", "3 dot-separated"),
    ("manifest.cose.s0", "component"),
    ("k.raw.s01", "leading zero"),
    ("k.raw.s00", "leading zero"),
    ("k.raw.s0001", "leading zero"),
    ("k.raw.s", "missing"),
    ("k.raw.0", "start with 's'"),
    ("k.raw.S0", "start with 's'"),
    ("k.raw.seg0", "digits"),
    ("k.raw.s-1", "digits"),
    ("k.raw.s+1", "digits"),
    ("k.raw.s1a", "digits"),
    ("k.raw.s 1", "digits"),
    ("k.raw.s1_000", "digits"),
    ("k.raw.s\u0661", "ASCII"),  # ARABIC-INDIC DIGIT ONE: str.isdigit() would say yes
    ("K.raw.s0", "component"),
    ("KV.raw.s0", "component"),
    ("x.raw.s0", "component"),
    ("kvv.raw.s0", "component"),
    ("vk.raw.s0", "component"),
    (".raw.s0", "component"),
    ("k.Raw.s0", "'R'"),
    ("k.RAW.s0", "'R'"),
    ("k.ra_w.s0", "'_'"),
    ("k.ra w.s0", "' '"),
    ("k..s0", "codec name is empty"),
    ("k." + "a" * 33 + ".s0", "33 characters"),
    ("k.r\u00e4w.s0", "ASCII"),
    ("k.raw", "3 dot-separated"),
    ("k.raw.s0.x", "3 dot-separated"),
    ("k.ra.w.s0", "3 dot-separated"),
    (" k.raw.s0", "component"),
    ("k.raw.s0 ", "digits"),
    ("k.raw.s0\n", "digits"),
]


@pytest.mark.parametrize(("text", "why"), REJECT)
def test_grammar_rejects(text: str, why: str) -> None:
    with pytest.raises(KvcsNameError, match=why) as info:
        TrackNameSpec.parse(text)
    assert isinstance(info.value, ValueError)
    assert info.value.reason


@pytest.mark.parametrize(
    "raw", [b"k.raw.s\xff", b"\x80", b"k.r\xc3\xa4w.s0", b"k.raw.s0\x00", b"m" * 5000]
)
def test_grammar_rejects_bytes(raw: bytes) -> None:
    with pytest.raises(KvcsNameError):
        TrackNameSpec.parse(raw)


def test_wrong_input_type() -> None:
    with pytest.raises(KvcsNameError, match="bytes or str"):
        TrackNameSpec.parse(7)  # type: ignore[arg-type]


def test_components() -> None:
    assert [int(c) for c in Component] == [1, 2, 3]
    assert [c.token for c in Component] == ["k", "v", "kv"]
    assert Component.from_token("kv") is Component.KV
    with pytest.raises(KvcsNameError):
        Component.from_token("K")


def test_data_track_constructor_validates() -> None:
    assert data_track_name(Component.V, "raw", 3) == "v.raw.s3"
    assert DataTrackName(2, "raw", 0).component is Component.V
    with pytest.raises(KvcsNameError, match="component"):
        DataTrackName(4, "raw", 0)
    with pytest.raises(KvcsNameError, match="empty"):
        DataTrackName(Component.K, "", 0)
    with pytest.raises(KvcsNameError, match="33"):
        DataTrackName(Component.K, "a" * 33, 0)
    with pytest.raises(KvcsNameError, match="'A'"):
        DataTrackName(Component.K, "A", 0)
    with pytest.raises(KvcsNameError, match="segment"):
        DataTrackName(Component.K, "raw", -1)
    with pytest.raises(KvcsNameError, match="segment"):
        DataTrackName(Component.K, "raw", True)
    assert check_codec_name("q8") == "q8"


codecs = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=32)


@given(st.sampled_from(list(Component)), codecs, st.integers(0, 10**30))
def test_build_parse_round_trip(component: Component, codec: str, segment: int) -> None:
    spec = DataTrackName(component, codec, segment)
    assert TrackNameSpec.parse(spec.build()) == spec


@given(st.text(alphabet="kvs.raw-019AS_ é", max_size=20) | st.binary(max_size=20))
def test_parse_is_a_bijection_or_a_typed_error(name: str | bytes) -> None:
    try:
        spec = TrackNameSpec.parse(name)
    except KvcsNameError:
        return
    assert spec.build() == (name.encode() if isinstance(name, str) else name)
