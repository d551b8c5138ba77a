"""The KVSP index (binding 9): record codec (JSON and COSE), bad records, prefix search."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kvcs_fixtures import SCOPE_KEY, make_cd

from kvcs_core.kvcs._index_serving import IndexAnnouncer
from kvcs_core.kvcs.cose import sign_manifest
from kvcs_core.kvcs.index import (
    IndexNamespace,
    IndexRecord,
    IndexRecordRejected,
    IndexRejectReason,
    OpenedRecord,
    PrefixSearch,
    effective_index_stride,
    encode_record,
    index_block_indices,
    index_prefix,
    open_record,
    parse_record,
)
from kvcs_core.kvcs.names import KvcsNamespace
from kvcs_core.kvcs.publisher import KvcsPublisher, ManifestSigner, PublisherError

SCOPE, COMPAT, PUB = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
KEYS = [bytes([i]) * 32 for i in range(1, 11)]  # K_0 .. K_9 of a 10-block publication
NS = KvcsNamespace(SCOPE, COMPAT, KEYS[-1], PUB)
PRODUCER = Ed25519PrivateKey.generate()
CD = make_cd(layers=1, kv_heads=1, head_dim=8)


def record(i: int, **kw: object) -> IndexRecord:
    args: dict[str, object] = {
        "namespace": NS, "blocks": 10, "block_index": i, "block_key": KEYS[i], **kw
    }
    return IndexRecord(**args)  # type: ignore[arg-type]


def ins(i: int) -> IndexNamespace:
    return IndexNamespace(SCOPE, COMPAT, KEYS[i], PUB)


# --- codec -------------------------------------------------------------------------------


def test_record_json_is_exactly_the_binding_shape() -> None:
    obj = json.loads(encode_record(record(3)))
    assert obj == {
        "kvsp": 0,
        "namespace": ["kvcs-1", SCOPE.hex(), COMPAT.hex(), KEYS[-1].hex(), PUB.hex()],
        "blocks": 10,
        "block_index": 3,
        "block_key": KEYS[3].hex(),
    }
    assert parse_record(encode_record(record(3))) == record(3)
    with_holder = record(3, holder="moqt://relay.example:4443")
    assert parse_record(encode_record(with_holder)) == with_holder


def test_index_namespace_and_prefix() -> None:
    r = record(4)
    assert r.index_namespace().to_track_namespace().fields == (
        b"kvcs-idx-1", SCOPE, COMPAT, KEYS[4], PUB,
    )
    full = r.index_namespace().to_track_namespace()
    assert index_prefix(SCOPE, COMPAT, KEYS[4]).is_prefix_of(full)
    assert IndexNamespace.try_parse(r.index_namespace().to_track_namespace()) == ins(4)
    assert IndexNamespace.try_parse(NS.to_track_namespace()) is None
    with pytest.raises(ValueError):
        index_prefix(SCOPE, COMPAT, b"short")


@pytest.mark.parametrize(
    ("edit", "detail"),
    [
        (lambda o: o.pop("block_key"), "missing"),
        (lambda o: o.update(kvsp=1), "kvsp"),
        (lambda o: o.update(extra=1), "unknown"),
        (lambda o: o.update(blocks=0), "blocks"),
        (lambda o: o.update(block_index=10), "below"),
        (lambda o: o.update(block_index=True), "block_index"),
        (lambda o: o.update(block_key="zz" * 32), "hex"),
        (lambda o: o.update(block_key="00"), "hex digits"),
        (lambda o: o["namespace"].__setitem__(0, "kvcs-2"), "field 0"),
        (lambda o: o["namespace"].pop(), "five"),
        (lambda o: o.update(holder=""), "holder"),
    ],
)
def test_bad_records_are_typed(edit: object, detail: str) -> None:
    obj = json.loads(encode_record(record(2)))
    edit(obj)  # type: ignore[operator]
    got = parse_record(json.dumps(obj).encode())
    assert isinstance(got, IndexRecordRejected)
    assert got.reason is IndexRejectReason.MALFORMED
    assert detail in got.detail


def test_not_json_and_too_large() -> None:
    assert parse_record(b"\xff{").reason is IndexRejectReason.MALFORMED  # type: ignore[union-attr]
    assert parse_record(b"[1]").reason is IndexRejectReason.MALFORMED  # type: ignore[union-attr]
    big = parse_record(b" " * 5000)
    assert isinstance(big, IndexRecordRejected) and big.reason is IndexRejectReason.TOO_LARGE


def _open(payload: bytes, i: int, *, signed: bool, require: bool, at: int | None = None) -> object:
    keys = {b"p": PRODUCER.public_key()}
    return open_record(
        payload, signed=signed, index_ns=ins(i if at is None else at), block_key=KEYS[i],
        block_index=i, keys=keys if (signed or require) else None, require_authenticity=require,
    )  # fmt: skip


def test_signed_record_verifies_and_is_bound_to_the_lookup() -> None:
    cose = sign_manifest(encode_record(record(5)), PRODUCER, b"p")
    got = _open(cose, 5, signed=True, require=True)
    assert isinstance(got, OpenedRecord) and got.authenticated and got.record == record(5)
    # a genuine signed record of block 5 offered for the lookup of block 4: refused
    wrong = open_record(
        cose, signed=True, index_ns=ins(4), block_key=KEYS[4], block_index=4,
        keys={b"p": PRODUCER.public_key()}, require_authenticity=True,
    )  # fmt: skip
    assert isinstance(wrong, IndexRecordRejected)
    assert wrong.reason is IndexRejectReason.WRONG_BLOCK


def test_forged_records_are_refused_with_a_reason() -> None:
    rogue = Ed25519PrivateKey.generate()
    forged = sign_manifest(encode_record(record(5)), rogue, b"p")
    got = _open(forged, 5, signed=True, require=True)
    assert isinstance(got, IndexRecordRejected) and got.reason is IndexRejectReason.BAD_SIGNATURE
    unsigned = _open(encode_record(record(5)), 5, signed=False, require=True)
    assert isinstance(unsigned, IndexRecordRejected)
    assert unsigned.reason is IndexRejectReason.UNSIGNED
    # unsigned is usable where authenticity is not required
    ok = _open(encode_record(record(5)), 5, signed=False, require=False)
    assert isinstance(ok, OpenedRecord) and not ok.authenticated
    # a record that names another publication than the index namespace it came from
    other = record(5, namespace=KvcsNamespace(SCOPE, COMPAT, KEYS[-1], b"\x09" * 16))
    moved = _open(encode_record(other), 5, signed=False, require=False)
    assert isinstance(moved, IndexRecordRejected)
    assert moved.reason is IndexRejectReason.WRONG_NAMESPACE
    # right block index but another key (the lookup is for our K_5)
    lie = record(5, block_key=KEYS[6])
    bad = _open(encode_record(lie), 5, signed=False, require=False)
    assert isinstance(bad, IndexRecordRejected) and bad.reason is IndexRejectReason.WRONG_BLOCK


def test_announcer_builds_one_signed_record_per_indexed_block() -> None:
    ann = IndexAnnouncer(NS, KEYS, stride=3, signer=ManifestSigner(PRODUCER, b"p"))
    assert sorted(ann.records) == [2, 5, 8, 9]  # every 3rd prefix length, and the last block
    assert len(ann.namespaces) == 4
    assert ann.record_bytes > 0
    assert index_block_indices(10, 1) == tuple(range(10))
    assert index_block_indices(9, 3) == (2, 5, 8)
    assert index_block_indices(1, 4) == (0,)


def test_the_stride_doubles_until_the_records_fit() -> None:
    assert effective_index_stride(512, 1, 512) == 1
    assert effective_index_stride(513, 1, 512) == 2  # 256 multiples of 2 and the last
    assert effective_index_stride(1062, 1, 512) == 4  # 531 + 1 > 512 with 2; 265 + 1 with 4
    assert effective_index_stride(1062, 3, 512) == 3
    assert effective_index_stride(1062, 1, None) == 1
    assert effective_index_stride(100, 1, 1) == 128  # past the blocks: the last alone
    assert index_block_indices(100, 128) == (99,)
    for blocks in (1, 7, 1000, 1024, 1025, 100_000):
        for cap in (1, 2, 3, 512):
            stride = effective_index_stride(blocks, 1, cap)
            assert len(index_block_indices(blocks, stride)) <= cap
            assert stride == 1 or len(index_block_indices(blocks, stride // 2)) > cap
    with pytest.raises(ValueError):
        effective_index_stride(10, 1, 0)
    with pytest.raises(ValueError):
        effective_index_stride(10, 0, 5)


def test_the_announcer_and_publisher_stay_within_max_index_records() -> None:
    pub = KvcsPublisher(CD, SCOPE_KEY, list(range(CD["block_tokens"] * 1062)), PUB)
    assert pub.index is not None
    assert pub.index.stride == 4 and len(pub.index.records) == 266
    assert max(pub.index.records) == 1061  # the last block is always indexed
    pub = KvcsPublisher(
        CD, SCOPE_KEY, list(range(CD["block_tokens"] * 40)), PUB, max_index_records=8
    )
    assert pub.index is not None and pub.index.stride == 8
    assert sorted(pub.index.records) == [7, 15, 23, 31, 39]
    pub = KvcsPublisher(
        CD, SCOPE_KEY, list(range(CD["block_tokens"] * 600)), PUB, max_index_records=None
    )
    assert pub.index is not None and pub.index.stride == 1 and len(pub.index.records) == 600
    for bad in (0, -1, 2.0):
        with pytest.raises(PublisherError):
            KvcsPublisher(CD, SCOPE_KEY, list(range(64)), PUB, max_index_records=bad)  # type: ignore[arg-type]


# --- prefix search -------------------------------------------------------------------------


def run(search: PrefixSearch, shared_up_to: int) -> PrefixSearch:
    """Answer every lookup as an index holding prefixes 1..shared_up_to would."""
    while (j := search.next_probe) is not None:
        search.answer(j, j <= shared_up_to)
    return search


@pytest.mark.parametrize("m", [1, 2, 3, 7, 15, 16, 31, 62, 100])
def test_binary_search_finds_the_longest_nested_prefix(m: int) -> None:
    for shared in sorted({0, 1, m // 2, m - 1, m}):
        s = run(PrefixSearch(m), shared)
        assert s.found == shared
        assert s.lookups <= math.ceil(math.log2(m)) + 1
        assert s.lookups <= math.ceil(math.log2(m + 1))


def test_stride_searches_its_multiples_only() -> None:
    s = run(PrefixSearch(20, stride=4), 13)
    assert s.candidate_count == 5  # 4, 8, 12, 16, 20
    assert s.found == 12
    assert all(j % 4 == 0 for j, _ in s.probed)
    assert run(PrefixSearch(3, stride=4), 3).found == 0  # no multiple fits: nothing to look up


def indexed_every(stride: int, blocks: int, shared: int) -> Callable[[int], bool]:
    """A publication of ``blocks`` blocks indexed every ``stride``-th prefix length and at
    its last block, sharing ``shared`` blocks with the prompt."""
    return lambda j: j <= shared and (j % stride == 0 or j == blocks)


def run_with(search: PrefixSearch, *pubs: Callable[[int], bool]) -> PrefixSearch:
    while (j := search.next_probe) is not None:
        search.answer(j, any(pub(j) for pub in pubs))
    return search


@pytest.mark.parametrize("p", [0, 1, 2, 3, 5])
def test_the_search_finds_a_doubled_stride_without_being_told(p: int) -> None:
    stride = 1 << p
    for m in (1, 5, 64, 100, 1066):
        for shared in sorted({0, 1, m // 3, m // 2, m - 1, m}):
            s = run_with(PrefixSearch(m), indexed_every(stride, 10_000, shared))
            assert s.found == shared // stride * stride, (m, shared)
            assert s.lookups <= math.ceil(math.log2(m + 1))
    # a consumer stride s finds publishers indexing every 2^p * s
    s = run_with(PrefixSearch(1000, stride=3), indexed_every(3 * stride, 10_000, 700))
    assert s.found == 700 // (3 * stride) * (3 * stride)


def test_the_longest_over_publications_of_different_strides() -> None:
    s = run_with(PrefixSearch(128), indexed_every(1, 5, 5), indexed_every(8, 1000, 100))
    assert s.found == 96
    s = run_with(PrefixSearch(128), indexed_every(1, 120, 99), indexed_every(8, 1000, 100))
    assert s.found == 99


def test_one_more_lookup_finds_the_whole_publication_off_the_stride() -> None:
    # the prompt extends a 1063-block publication indexed every 4 blocks: the lookups
    # below 4 (1062, 1061) are off its stride, 1063 = 1060 + 3 is never tried by bits
    pub = indexed_every(4, 1063, 1063)
    s = run_with(PrefixSearch(1066), pub)
    assert s.found == 1060 and s.next_probe is None
    assert s.extend(1063) and s.next_probe == 1063
    assert not s.extend(1061)  # one extension only
    s.answer(1063, pub(1063))
    assert s.found == 1063 and s.next_probe is None
    assert s.lookups <= math.ceil(math.log2(1066 + 1)) + 1
    # an extension that is not shared leaves the result; none beyond the prompt, at or
    # below what was found, or already looked up
    s = run_with(PrefixSearch(1066), indexed_every(4, 1063, 1000))
    assert s.found == 1000 and s.extend(1063)
    s.answer(1063, False)
    assert s.found == 1000 and s.next_probe is None and not s.extend(1063)
    s = run_with(PrefixSearch(50), indexed_every(4, 1063, 1063))
    assert s.found == 48 and not s.extend(1063) and not s.extend(48)
    s = run_with(PrefixSearch(1066), indexed_every(4, 1062, 1062))
    assert s.found == 1062  # the bits reached it: 1060 + 2
    assert not PrefixSearch(50).extend(50)  # not before the search is over


def test_no_match_and_a_lying_index() -> None:
    s = run(PrefixSearch(30), 0)
    assert s.found == 0 and [j for j, _ in s.probed][-1] == 1
    # an index that hides entries (a record refused counts as "not found") can only make
    # the result shorter, never longer than what is really shared
    s = PrefixSearch(30)
    while (j := s.next_probe) is not None:
        s.answer(j, j <= 20 and j != 15)
    assert s.found <= 20
    with pytest.raises(ValueError):
        s.answer(5, True)  # not the pending probe
    with pytest.raises(ValueError):
        PrefixSearch(0)
