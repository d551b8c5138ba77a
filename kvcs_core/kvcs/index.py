"""The KVSP index carried over MOQT: index namespaces, replica records, prefix search.

Theory of operation
-------------------
Implements ``../shared/spec/KVSP-BINDING.md`` section 9 (profile 5.1's KVSP Index
Service). A consumer can compute the Anchor Key only of prefixes it holds; a
publication whose prompt is *longer* than the part the consumer shares has an
Anchor Key it cannot compute. So each publication also announces, for its block
``i`` (every block, or every ``s``-th and the last for a stride ``s``), the
**index namespace** ``("kvcs-idx-1", Scope ID, Compatibility ID, K_i, P)``,
holding one track, ``replica`` (JSON) or ``replica.cose`` (COSE_Sign1 with the
producer key, same rules as ``manifest.cose``), whose Object 0 of Group 0 is the
**replica record**::

    {"kvsp": 0, "namespace": ["kvcs-1", hex, hex, hex, hex], "blocks": n,
     "block_index": i, "block_key": hex K_i}

optionally with ``"holder"`` (an MOQT URI). :func:`encode_record` writes it
deterministically (sorted keys, no spaces); :func:`parse_record` is strict and
never raises on peer input: a bad record is an :class:`IndexRecordRejected` with
an :class:`IndexRejectReason`. :func:`open_record` adds the envelope rules of
``manifest.cose`` (``_verify.open_manifest``) and the consumer's own checks: the
record's ``block_key`` and ``block_index`` must equal the consumer's ``K_i`` and
``i`` (what binds the record to the lookup), and its namespace must be of the
consumer's scope and descriptor with at least ``i + 1`` blocks.

**How many records.** Each index namespace is announced with a PUBLISH_NAMESPACE of
its own, a request that stays open while the publication lives, and a relay
bounds the requests of one session (``max_concurrent_peer_requests``, 1024 by
default, and the QUIC stream credit behind it). A publication whose index needs
more than that is not indexed past the bound: with stride 1 that was any prompt
of more than about 1000 blocks (16,000 tokens in 16-token blocks), and a consumer
searching it settled on a short prefix. So a publisher announces at most
``max_records`` records (:data:`DEFAULT_MAX_INDEX_RECORDS`, 512: half a default
relay's bound, leaving room for the publication's own requests):
:func:`effective_index_stride` doubles the configured stride until every
``stride``-th prefix length and the last block fit. The binding lets the
publisher choose its stride (section 9: "every ``s``-th block and the last"); the
doubling is kvcs's choice of ``s``, and the search below finds it without being
told.

**Prefix search.** Shared prefixes are nested: if some publication shares ``j``
blocks with the prompt, it shares every ``j' < j`` too. :class:`PrefixSearch`
looks up multiples ``n * s`` of the consumer's stride ``s`` (``n`` in ``1..c``,
``c = m // s``), one bit of ``n`` at a time from the highest: it tries ``n =
base + 2^k`` and keeps it as ``base`` when a usable record for ``K_(n*s - 1)``
is found. That is a binary search (``ceil(log2(c + 1))`` lookups, as many as one
over ``1..c``), and it has one more property: every lookup at bit ``k`` is a
multiple of ``2^k * s``, so a publication indexed every ``2^p * s`` blocks (a
doubled stride, above) is found at the longest multiple of its stride it
shares, since the lookups at bits ``k >= p`` are all on its lattice. With
several publications of different strides it finds the longest such multiple
over all of them. Then :meth:`PrefixSearch.extend` may add one lookup: a
record found names its publication's block count ``B``, and the publisher
always indexes its last block, so a prompt that extends the whole publication
(``found < B <= m``, the common case of a conversation's next turn) is found at
exactly ``B`` even when ``B`` is off the stride. A lying index can only
hide entries (the search then finds a shorter prefix) or offer records that
:func:`open_record` refuses (treated as "not found"); the record is a pointer,
and the data it leads to is verified against the publication's manifest.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from kvcs_core.kvcs._consumer_events import IndexRejectReason
from kvcs_core.kvcs._verify import Refusal, open_manifest
from kvcs_core.kvcs.cose import VerificationKey
from kvcs_core.kvcs.names import (
    ANCHOR_KEY_LEN,
    COMPAT_ID_LEN,
    KVCS_NAMESPACE_TAG,
    PUBLICATION_ID_LEN,
    SCOPE_ID_LEN,
    KvcsNamespace,
)
from kvcs_core.wire.names import FullTrackName, TrackNamespace

__all__ = [
    "DEFAULT_MAX_INDEX_RECORDS",
    "INDEX_NAMESPACE_TAG",
    "MAX_RECORD_BYTES",
    "REPLICA_COSE_TRACK",
    "REPLICA_TRACK",
    "IndexNamespace",
    "IndexRecord",
    "IndexRecordRejected",
    "IndexRejectReason",
    "OpenedRecord",
    "PrefixSearch",
    "effective_index_stride",
    "encode_record",
    "index_block_indices",
    "index_prefix",
    "open_record",
    "parse_record",
]

INDEX_NAMESPACE_TAG: Final = b"kvcs-idx-1"
"""Field 0 of an index namespace (binding 9)."""
REPLICA_TRACK: Final = "replica"
REPLICA_COSE_TRACK: Final = "replica.cose"
MAX_RECORD_BYTES: Final = 4096
"""A record (JSON or COSE) larger than this is refused: a real one is about 400 octets."""

_BLOCK_KEY_HEX: Final = 2 * ANCHOR_KEY_LEN
_MEMBERS: Final = frozenset({"kvsp", "namespace", "blocks", "block_index", "block_key", "holder"})
_MAX_BLOCKS: Final = 1 << 32
DEFAULT_MAX_INDEX_RECORDS: Final = 512
"""The most index records a publication announces by default (module docstring, "How
many records"): one request each, against a relay's 1024 per session."""


@attrs.frozen
class IndexRecordRejected:
    """A refused record and why (never raised: returned)."""

    reason: IndexRejectReason
    detail: str


@attrs.frozen
class IndexNamespace:
    """Fields 1 to 4 of an index namespace (field 0 is ``kvcs-idx-1``)."""

    scope_id: bytes
    compat_id: bytes
    block_key: bytes
    publication_id: bytes

    @classmethod
    def try_parse(cls, ns: TrackNamespace) -> IndexNamespace | None:
        """The index namespace, or None if ``ns`` is not one (then it is ignored)."""
        f = ns.fields
        if len(f) != 5 or f[0] != INDEX_NAMESPACE_TAG:
            return None
        lens = (SCOPE_ID_LEN, COMPAT_ID_LEN, ANCHOR_KEY_LEN, PUBLICATION_ID_LEN)
        if any(len(x) != n for x, n in zip(f[1:], lens, strict=True)):
            return None
        return cls(f[1], f[2], f[3], f[4])

    def to_track_namespace(self) -> TrackNamespace:
        fields = (self.scope_id, self.compat_id, self.block_key, self.publication_id)
        return TrackNamespace((INDEX_NAMESPACE_TAG, *fields))

    def track(self, signed: bool) -> FullTrackName:
        """``replica.cose`` (signed) or ``replica`` in this namespace."""
        name = REPLICA_COSE_TRACK if signed else REPLICA_TRACK
        return FullTrackName(self.to_track_namespace(), name.encode("ascii"))


def index_prefix(scope_id: bytes, compat_id: bytes, block_key: bytes) -> TrackNamespace:
    """``("kvcs-idx-1", Scope ID, Compatibility ID, K_(j-1))``: one lookup (binding 9)."""
    for value, n, what in (
        (scope_id, SCOPE_ID_LEN, "Scope ID"),
        (compat_id, COMPAT_ID_LEN, "Compatibility ID"),
        (block_key, ANCHOR_KEY_LEN, "Block Key"),
    ):
        if len(value) != n:
            raise ValueError(f"{what} must be {n} octets, not {len(value)}")
    return TrackNamespace((INDEX_NAMESPACE_TAG, scope_id, compat_id, block_key))


def index_block_indices(blocks: int, stride: int) -> tuple[int, ...]:
    """Block indices a publication of ``blocks`` blocks indexes: every ``stride``-th
    prefix length (``i + 1`` a multiple of ``stride``) and the last block."""
    if stride < 1:
        raise ValueError("the index stride must be >= 1")
    out = list(range(stride - 1, blocks, stride))
    if blocks and (not out or out[-1] != blocks - 1):
        out.append(blocks - 1)
    return tuple(out)


def _record_count(blocks: int, stride: int) -> int:
    return blocks // stride + (1 if blocks % stride else 0)


def effective_index_stride(blocks: int, stride: int, max_records: int | None) -> int:
    """The stride a publication of ``blocks`` blocks indexes with: ``stride``, doubled
    until :func:`index_block_indices` holds at most ``max_records`` entries (None: no
    bound). Module docstring, "How many records"."""
    if not isinstance(stride, int) or stride < 1:
        raise ValueError("the index stride must be an integer >= 1")
    if max_records is None:
        return stride
    if not isinstance(max_records, int) or max_records < 1:
        raise ValueError("max_index_records must be an integer >= 1 (None: no bound)")
    while _record_count(blocks, stride) > max_records:
        stride *= 2  # ends: past ``blocks`` only the last block is left
    return stride


@attrs.frozen(kw_only=True)
class IndexRecord:
    """A replica record (binding 9)."""

    namespace: KvcsNamespace
    """The publication's own namespace (its Anchor Key is ``K_(blocks-1)``)."""
    blocks: int
    block_index: int
    block_key: bytes
    holder: str | None = None

    def index_namespace(self) -> IndexNamespace:
        """Where this record is published."""
        ns = self.namespace
        return IndexNamespace(ns.scope_id, ns.compat_id, self.block_key, ns.publication_id)

    def to_json(self) -> dict[str, Any]:
        ns = self.namespace
        out: dict[str, Any] = {
            "kvsp": 0,
            "namespace": [
                KVCS_NAMESPACE_TAG.decode("ascii"),
                ns.scope_id.hex(),
                ns.compat_id.hex(),
                ns.anchor_key.hex(),
                ns.publication_id.hex(),
            ],
            "blocks": self.blocks,
            "block_index": self.block_index,
            "block_key": self.block_key.hex(),
        }
        if self.holder is not None:
            out["holder"] = self.holder
        return out


def encode_record(record: IndexRecord) -> bytes:
    """The record's JSON: sorted keys, no whitespace, ASCII (deterministic)."""
    return json.dumps(record.to_json(), sort_keys=True, separators=(",", ":")).encode("ascii")


def _bad(detail: str) -> IndexRecordRejected:
    return IndexRecordRejected(IndexRejectReason.MALFORMED, detail)


def _hex(value: Any, octets: int, what: str) -> bytes | IndexRecordRejected:
    if not isinstance(value, str) or len(value) != 2 * octets:
        return _bad(f"{what} must be {2 * octets} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        return _bad(f"{what} is not hex")


def _count(value: Any, what: str, low: int) -> int | IndexRecordRejected:
    if type(value) is not int or not low <= value < _MAX_BLOCKS:
        return _bad(f"{what} must be an integer in {low}..{_MAX_BLOCKS - 1}")
    return value


def parse_record(data: bytes | bytearray | memoryview) -> IndexRecord | IndexRecordRejected:
    """Strictly parse a record's JSON; never raises on bad input."""
    if len(data) > MAX_RECORD_BYTES:
        return IndexRecordRejected(IndexRejectReason.TOO_LARGE, f"{len(data)} octets")
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return _bad(f"not JSON: {e}")
    if not isinstance(obj, dict):
        return _bad("not a JSON object")
    missing = {"kvsp", "namespace", "blocks", "block_index", "block_key"} - obj.keys()
    if missing:
        return _bad(f"missing {sorted(missing)}")
    extra = obj.keys() - _MEMBERS
    if extra:
        return _bad(f"unknown members {sorted(extra)}")
    if type(obj["kvsp"]) is not int or obj["kvsp"] != 0:
        return _bad("kvsp must be 0")
    fields = obj["namespace"]
    if not isinstance(fields, list) or len(fields) != 5:
        return _bad("namespace must be an array of five fields")
    if fields[0] != KVCS_NAMESPACE_TAG.decode("ascii"):
        return _bad("namespace field 0 must be 'kvcs-1'")
    raw: list[bytes] = []
    for value, n, what in zip(
        fields[1:],
        (SCOPE_ID_LEN, COMPAT_ID_LEN, ANCHOR_KEY_LEN, PUBLICATION_ID_LEN),
        ("Scope ID", "Compatibility ID", "Anchor Key", "Publication ID"),
        strict=True,
    ):
        got = _hex(value, n, what)
        if isinstance(got, IndexRecordRejected):
            return got
        raw.append(got)
    blocks = _count(obj["blocks"], "blocks", 1)
    if isinstance(blocks, IndexRecordRejected):
        return blocks
    index = _count(obj["block_index"], "block_index", 0)
    if isinstance(index, IndexRecordRejected):
        return index
    if index >= blocks:
        return _bad(f"block_index {index} is not below blocks {blocks}")
    key = _hex(obj["block_key"], ANCHOR_KEY_LEN, "block_key")
    if isinstance(key, IndexRecordRejected):
        return key
    holder = obj.get("holder")
    if holder is not None and (not isinstance(holder, str) or not holder or len(holder) > 1024):
        return _bad("holder must be a non-empty string (an MOQT URI)")
    return IndexRecord(
        namespace=KvcsNamespace(raw[0], raw[1], raw[2], raw[3]),
        blocks=blocks,
        block_index=index,
        block_key=key,
        holder=holder,
    )


@attrs.frozen
class OpenedRecord:
    """A record the consumer may use, and whether a producer key verified it."""

    record: IndexRecord
    authenticated: bool


def open_record(
    payload: bytes | bytearray | memoryview,
    *,
    signed: bool,
    index_ns: IndexNamespace,
    block_key: bytes,
    block_index: int,
    keys: Mapping[bytes, VerificationKey] | None,
    require_authenticity: bool,
) -> OpenedRecord | IndexRecordRejected:
    """Envelope, JSON and the consumer's checks (module docstring); never raises.

    Args:
        payload: Object 0 of Group 0 of the ``replica`` / ``replica.cose`` track.
        signed: it came from ``replica.cose``.
        index_ns: the index namespace it came from.
        block_key: the consumer's own ``K_i`` for this lookup.
        block_index: ``i``.
        keys: trusted producer keys by ``kid`` (or None).
        require_authenticity: only signed, verified records are usable.
    """
    if len(payload) > MAX_RECORD_BYTES:
        return IndexRecordRejected(IndexRejectReason.TOO_LARGE, f"{len(payload)} octets")
    opened = open_manifest(
        memoryview(bytes(payload)),
        signed=signed,
        keys=keys,
        require_authenticity=require_authenticity,
        max_size=MAX_RECORD_BYTES,
    )
    if isinstance(opened, Refusal):
        reason = IndexRejectReason.BAD_SIGNATURE if signed else IndexRejectReason.UNSIGNED
        return IndexRecordRejected(reason, opened.detail)
    record = parse_record(opened.json)
    if isinstance(record, IndexRecordRejected):
        return record
    if record.block_index != block_index or record.block_key != block_key:
        return IndexRecordRejected(
            IndexRejectReason.WRONG_BLOCK,
            f"record names block {record.block_index}, the lookup is for block {block_index}",
        )
    if record.index_namespace() != index_ns:
        return IndexRecordRejected(
            IndexRejectReason.WRONG_NAMESPACE,
            "the record does not belong to the index namespace it came from",
        )
    return OpenedRecord(record, authenticated=opened.authenticated)


class PrefixSearch:
    """Bitwise binary search for the longest shared prefix (module docstring).

    The lengths that can be looked up are the multiples of ``stride`` up to
    ``prompt_blocks`` (:attr:`candidate_count` of them), plus at most one length
    offered to :meth:`extend`. Ask :attr:`next_probe`, look that length up, tell the
    result with :meth:`answer`; when :attr:`next_probe` is None, :attr:`found` is the
    longest length known to be shared (0: none).
    """

    def __init__(self, prompt_blocks: int, stride: int = 1) -> None:
        if prompt_blocks < 1:
            raise ValueError("prompt_blocks must be >= 1")
        if stride < 1:
            raise ValueError("stride must be >= 1")
        self.prompt_blocks: Final = prompt_blocks
        self.stride: Final = stride
        self.candidate_count: Final = prompt_blocks // stride
        """Multiples of the stride up to ``prompt_blocks``: the search is over ``1..this``."""
        self._base = 0  # multiplier known shared (a lookup found it)
        self._floor = 0  # multiplier known shared without a lookup (raise_floor)
        self._bit = 1 << (self.candidate_count.bit_length() - 1) if self.candidate_count else 0
        self._extension: int | None = None  # a length offered to extend, not yet looked up
        self._extended = 0  # a length found shared by the extension lookup
        self._extension_tried = False
        self.lookups = 0
        self.probed: list[tuple[int, bool]] = []
        self._settle()

    def _settle(self) -> None:
        """Move past bits whose lookup is not needed (beyond ``c``, or at or below the floor)."""
        while self._bit:
            n = self._base + self._bit
            if n > self.candidate_count:
                self._bit >>= 1
            elif n <= self._floor:
                self._base = n
                self._bit >>= 1
            else:
                return

    @property
    def next_probe(self) -> int | None:
        """The prefix length to look up next, or None when the search is over."""
        if self._bit:
            return (self._base + self._bit) * self.stride
        return self._extension

    @property
    def found(self) -> int:
        """The longest prefix length known to be shared (0: none)."""
        return max(max(self._base, self._floor) * self.stride, self._extended)

    def raise_floor(self, length: int) -> None:
        """``length`` blocks are known to be shared (a publication found directly): no
        lookup at or below it is needed."""
        self._floor = max(self._floor, min(length, self.prompt_blocks) // self.stride)
        self._settle()

    def extend(self, length: int) -> bool:
        """Offer one more lookup once the search is over: ``length`` is the block count
        of a publication a record found (its last block is always indexed). Taken (True)
        only when it could lengthen :attr:`found` and nothing was offered before."""
        if (
            self._bit
            or self._extension is not None
            or self._extension_tried
            or not self.found < length <= self.prompt_blocks
            or any(j == length for j, _ in self.probed)
        ):
            return False
        self._extension = length
        return True

    def answer(self, length: int, shared: bool) -> None:
        """The lookup of ``length`` (the current :attr:`next_probe`) found a usable record
        (``shared``) or not."""
        if length != self.next_probe:
            raise ValueError(f"{length} is not the pending probe {self.next_probe}")
        self.lookups += 1
        self.probed.append((length, shared))
        if not self._bit:  # the extension lookup
            self._extension = None
            self._extension_tried = True
            if shared:
                self._extended = length
            return
        if shared:
            self._base += self._bit
        self._bit >>= 1
        self._settle()
