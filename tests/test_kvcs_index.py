"""The KVSP index (binding 9): record codec (JSON and COSE), bad records, prefix search."""

from __future__ import annotations

import json
import math

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvcs_core.kvcs._index_serving import IndexAnnouncer
from kvcs_core.kvcs.cose import sign_manifest
from kvcs_core.kvcs.index import (
    IndexNamespace,
    IndexRecord,
    IndexRecordRejected,
    IndexRejectReason,
    OpenedRecord,
    PrefixSearch,
    encode_record,
    index_block_indices,
    index_prefix,
    open_record,
    parse_record,
)
from kvcs_core.kvcs.names import KvcsNamespace
from kvcs_core.kvcs.publisher import ManifestSigner

SCOPE, COMPAT, PUB = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
KEYS = [bytes([i]) * 32 for i in range(1, 11)]  # K_0 .. K_9 of a 10-block publication
NS = KvcsNamespace(SCOPE, COMPAT, KEYS[-1], PUB)
PRODUCER = Ed25519PrivateKey.generate()


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
    assert s.candidates == (4, 8, 12, 16, 20)
    assert s.found == 12
    assert all(j % 4 == 0 for j, _ in s.probed)
    assert run(PrefixSearch(3, stride=4), 3).found == 0  # no multiple fits: nothing to look up


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
