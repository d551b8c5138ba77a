"""``kvcs selfcheck``: the codec checked against the MOQT draft-22 byte vectors.

``kvcs selfcheck``
    Encodes and decodes every MOQT draft-22 byte vector of
    ``shared/spec/moqt22-vectors.json`` (found through ``--vectors``, the
    ``KVCS_SHARED`` environment variable, or the ``shared/`` folder beside the
    repository) and a built-in set of messages, streams and a datagram built
    from the codec's own classes and compared byte for byte with hex copied
    from that file. Prints one line per check; exits 0 only if all pass.

``-v`` turns on debug logging (with the traceback of a failing check).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcs_core.wire.codes import ALPN, GroupOrder, ObjectStatus
from kvcs_core.wire.errors import NEED_MORE
from kvcs_core.wire.filters import LocationFilter
from kvcs_core.wire.messages import (
    ControlStreamDecoder,
    Setup,
    Subscribe,
    decode_message,
    encode_message,
)
from kvcs_core.wire.names import TrackNamespace
from kvcs_core.wire.objects import (
    DataStreamDecoder,
    FetchHeader,
    FetchObject,
    ObjectDatagram,
    PaddingDatagram,
    PaddingStreamHeader,
    SubgroupHeader,
    SubgroupObject,
    UniStreamKind,
    decode_datagram,
    encode_datagram,
    encode_fetch_stream,
    encode_subgroup_stream,
    padding_stream,
    peek_uni_stream_type,
)
from kvcs_core.wire.params import FillParameters, GroupOrderParam, Parameters
from kvcs_core.wire.varint import encode_vi64, read_vi64

log = logging.getLogger("kvcs")

VECTOR_FILE = "moqt22-vectors.json"
SHARED_ENV = "KVCS_SHARED"


class CheckFailed(Exception):
    """A self-check found a difference."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)


def _same_bytes(got: bytes, want: bytes, what: str) -> None:
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        at = min(len(got), len(want)) if at is None else at
        raise CheckFailed(
            f"{what}: {len(got)} bytes differ from the expected {len(want)} at offset {at}"
            f" (got {got[at : at + 8].hex() or '<end>'}, want {want[at : at + 8].hex() or '<end>'})"
        )


@dataclass(frozen=True)
class Check:
    source: str
    name: str
    run: Callable[[], str]


@dataclass(frozen=True)
class Result:
    check: Check
    ok: bool
    detail: str


# --- decoding helpers (the codec's public decoders, fed whole and byte by byte) ---------


def _feed(decoder: Any, chunks: Iterable[bytes]) -> list[Any]:
    items: list[Any] = []
    for chunk in chunks:
        items += decoder.feed(chunk)
    decoder.close()
    return items


def _bytewise(raw: bytes) -> list[bytes]:
    return [raw[i : i + 1] for i in range(len(raw))]


def _roundtrip_message(raw: bytes, expect_name: str | None = None) -> str:
    got = decode_message(raw)
    _expect(got is not NEED_MORE, "decode_message says NEED_MORE on a whole frame")
    assert got is not NEED_MORE  # for the type checker
    msg, used = got
    _expect(used == len(raw), f"decode_message used {used} of {len(raw)} bytes")
    name = msg.TYPE.name
    _expect(expect_name in (None, name), f"decoded {name}, the vector says {expect_name}")
    _same_bytes(encode_message(msg), raw, f"encode_message({name})")
    _expect(
        _feed(ControlStreamDecoder(), _bytewise(raw)) == [msg],
        "ControlStreamDecoder fed byte by byte gives a different message",
    )
    return f"{name}, {len(raw)} bytes"


def _decode_stream(raw: bytes, order: GroupOrder) -> list[Any]:
    def make() -> DataStreamDecoder:
        return DataStreamDecoder(fetch_group_order=order)

    items = _feed(make(), [raw])
    _expect(
        _feed(make(), _bytewise(raw)) == items,
        "DataStreamDecoder fed byte by byte gives different items",
    )
    return items


def _roundtrip_stream(raw: bytes, order: GroupOrder = GroupOrder.ASCENDING) -> str:
    kind = peek_uni_stream_type(raw)
    items = _decode_stream(raw, order)
    _expect(bool(items), "no items decoded")
    header, *rest = items
    if kind is UniStreamKind.SUBGROUP:
        _expect(isinstance(header, SubgroupHeader), f"first item is {type(header).__name__}")
        encoded = encode_subgroup_stream(header, rest)
    elif kind is UniStreamKind.FETCH:
        _expect(isinstance(header, FetchHeader), f"first item is {type(header).__name__}")
        encoded = encode_fetch_stream(header.request_id, order, rest)
    else:
        raise CheckFailed(f"stream classified as {kind!r}, not subgroup or fetch")
    _same_bytes(encoded, raw, "re-encoded stream")
    return f"{kind.name.lower()} stream, {len(rest)} objects/markers, {len(raw)} bytes"


def _roundtrip_datagram(raw: bytes) -> str:
    d = decode_datagram(raw)
    _same_bytes(encode_datagram(d), raw, "encode_datagram")
    return f"{type(d).__name__}, {len(raw)} bytes"


# --- the vector file ------------------------------------------------------------------


def find_vectors(explicit: Path | None = None) -> tuple[Path | None, list[Path]]:
    """The vector file to use (or None) and the places looked at."""
    if explicit is not None:
        return (explicit if explicit.is_file() else None), [explicit]
    candidates: list[Path] = []
    env = os.environ.get(SHARED_ENV)
    if env:
        candidates += [Path(env) / "spec" / VECTOR_FILE, Path(env) / VECTOR_FILE]
    candidates.append(Path(__file__).resolve().parents[3] / "shared" / "spec" / VECTOR_FILE)
    for c in candidates:
        if c.is_file():
            return c, candidates
    return None, candidates


def _vector_check(v: dict[str, Any]) -> str:
    kind = v.get("kind")
    fields = v.get("fields", {})
    raw = bytes.fromhex(v["hex"])
    if "length" in v:
        _expect(v["length"] == len(raw), f"hex has {len(raw)} bytes, 'length' says {v['length']}")
    if kind == "primitive":
        values = [int(x) for x in fields["values"]]
        pos, decoded = 0, []
        while pos < len(raw):
            value, pos = read_vi64(raw, pos)
            decoded.append(value)
        _expect(decoded == values, "decoded vi64 values differ")
        _same_bytes(b"".join(encode_vi64(x) for x in values), raw, "encode_vi64")
        return f"{len(values)} vi64 values"
    if kind == "control":
        return _roundtrip_message(raw, fields.get("message"))
    if kind == "data-stream":
        order = GroupOrder[str(fields.get("group_order", "Ascending")).upper()]
        return _roundtrip_stream(raw, order)
    if kind == "datagram":
        return _roundtrip_datagram(raw)
    if kind == "padding":
        cut = int(fields["split_at"])
        stream, dgram = raw[:cut], raw[cut:]
        dec = DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)
        _expect(_feed(dec, [stream]) == [PaddingStreamHeader()], "padding stream not recognised")
        _same_bytes(padding_stream(dec.discarded), stream, "padding_stream")
        d = decode_datagram(dgram)
        _expect(isinstance(d, PaddingDatagram), f"padding datagram decoded as {type(d).__name__}")
        _same_bytes(encode_datagram(d), dgram, "encode_datagram(padding)")
        return f"padding stream ({dec.discarded} bytes) + padding datagram"
    raise CheckFailed(f"no checker for vector kind {kind!r}")


def vector_checks(path: Path) -> list[Check]:
    """One check per vector in the file (or one failing check if it cannot be read)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vectors = data["vectors"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = f"cannot read {path}: {type(e).__name__}: {e}"

        def fail() -> str:
            raise CheckFailed(msg)

        return [Check("vectors", "load vector file", fail)]

    def runner(v: dict[str, Any]) -> Callable[[], str]:
        return lambda: _vector_check(v)

    return [Check("vectors", str(v.get("name", f"#{i}")), runner(v)) for i, v in enumerate(vectors)]


# --- the built-in set (embedded default) ------------------------------------------------

# The KVCS vector namespace: "kvcs-1" and four keyed binary fields (moqt22-vectors.json).
_NAMESPACE = TrackNamespace.of(
    "kvcs-1",
    bytes.fromhex("d524ec9bd7e643ad062dfe4b68442e3d"),
    bytes.fromhex("ff12d188e0e5f77bd314b567eca7e6db"),
    bytes.fromhex("05f1abc1896d002e11be73ffe4b1800548b9be75c58ecd85e07a4f08d8b17e0c"),
    bytes.fromhex("1ea2406e740288cbdc352f542c3798fa"),
)

# Hex copied from moqt22-vectors.json (vectors of the same names).
_SETUP_HEX = (
    "af00002a01042f6d6f71041172656c61792e6578616d706c652e636f6d0108010b6b7663732d70792f302e310104"
)
_SUBSCRIBE_HEX = (
    "0300720005066b7663732d3110d524ec9bd7e643ad062dfe4b68442e3d10ff12d188e0e5f77bd314b567"
    "eca7e6db2005f1abc1896d002e11be73ffe4b1800548b9be75c58ecd85e07a4f08d8b17e0c101ea2406e"
    "740288cbdc352f542c3798fa086d616e6966657374032105010101050121020000"
)
_SUBGROUP_HEX = "5001078000026d3000026d3100026d32000003"
_FETCH_HEX = "05041c0200800467326f30000467326f310c00000467336f3004020467336f32"
_DATAGRAM_HEX = "0001090480646772616d"


def _builtin_setup() -> str:
    msg = Setup(
        path="/moq",
        authority="relay.example.com",
        max_filter_ranges=8,
        moqt_implementation="kvcs-py/0.1",
        max_request_updates=4,
    )
    _same_bytes(encode_message(msg), bytes.fromhex(_SETUP_HEX), "encode_message(SETUP)")
    return _roundtrip_message(bytes.fromhex(_SETUP_HEX), "SETUP")


def _builtin_subscribe() -> str:
    msg = Subscribe(
        request_id=0,
        namespace=_NAMESPACE,
        name=b"manifest",
        params=Parameters.of(
            LocationFilter.next_object(),
            GroupOrderParam(GroupOrder.ASCENDING),
            FillParameters(Parameters.of(LocationFilter.absolute_start(0, 0))),
        ),
    )
    raw = bytes.fromhex(_SUBSCRIBE_HEX)
    _same_bytes(encode_message(msg), raw, "encode_message(SUBSCRIBE)")
    _expect(decode_message(raw) == (msg, len(raw)), "decoded SUBSCRIBE differs")
    return "NEXT_OBJECT + FILL_PARAMETERS(Absolute Start 0,0); " + _roundtrip_message(raw)


def _builtin_subgroup() -> str:
    header = SubgroupHeader(track_alias=1, group_id=7, publisher_priority=128)
    objects = [
        SubgroupObject(0, payload=b"m0"),
        SubgroupObject(1, payload=b"m1"),
        SubgroupObject(2, payload=b"m2"),
        SubgroupObject(3, status=ObjectStatus.END_OF_GROUP),
    ]
    raw = bytes.fromhex(_SUBGROUP_HEX)
    _same_bytes(encode_subgroup_stream(header, objects), raw, "encode_subgroup_stream")
    _expect(_decode_stream(raw, GroupOrder.ASCENDING) == [header, *objects], "decoded differs")
    return _roundtrip_stream(raw)


def _builtin_fetch() -> str:
    objects = [
        FetchObject(2, 0, 0, 128, payload=b"g2o0"),
        FetchObject(2, 1, 0, 128, payload=b"g2o1"),
        FetchObject(3, 0, 0, 128, payload=b"g3o0"),
        FetchObject(3, 2, 0, 128, payload=b"g3o2"),
    ]
    raw = bytes.fromhex(_FETCH_HEX)
    _same_bytes(encode_fetch_stream(4, GroupOrder.ASCENDING, objects), raw, "encode_fetch_stream")
    _expect(
        _decode_stream(raw, GroupOrder.ASCENDING) == [FetchHeader(4), *objects], "decoded differs"
    )
    return _roundtrip_stream(raw)


def _builtin_datagram() -> str:
    d = ObjectDatagram(
        track_alias=1, group_id=9, object_id=4, publisher_priority=128, payload=b"dgram"
    )
    raw = bytes.fromhex(_DATAGRAM_HEX)
    _same_bytes(encode_datagram(d), raw, "encode_datagram")
    _expect(decode_datagram(raw) == d, "decoded datagram differs")
    return _roundtrip_datagram(raw)


BUILTIN_CHECKS: tuple[Check, ...] = (
    Check("built-in", "SETUP (client, native QUIC)", _builtin_setup),
    Check("built-in", "SUBSCRIBE next object + fill", _builtin_subscribe),
    Check("built-in", "subgroup stream, End of Group", _builtin_subgroup),
    Check("built-in", "fetch stream, two groups", _builtin_fetch),
    Check("built-in", "OBJECT_DATAGRAM with payload", _builtin_datagram),
)


# --- running and reporting --------------------------------------------------------------


def run_checks(checks: Sequence[Check]) -> list[Result]:
    results = []
    for c in checks:
        try:
            detail = c.run()
        except Exception as e:  # a failing check is reported, not raised
            log.debug("check %s / %s failed", c.source, c.name, exc_info=True)
            results.append(Result(c, False, f"{type(e).__name__}: {e}"))
        else:
            results.append(Result(c, True, detail))
    return results


def selfcheck(vectors: Path | None, *, builtin_only: bool) -> int:
    print(f"kvcs selfcheck: the MOQT draft-22 codec (ALPN {ALPN})")
    checks: list[Check] = []
    if builtin_only:
        print("vectors: skipped (--builtin-only)")
    else:
        path, looked = find_vectors(vectors)
        if path is None:
            print(f"vectors: {VECTOR_FILE} not found (looked at: {', '.join(map(str, looked))})")
            print("         running the built-in checks only")
        else:
            log.info("using vectors from %s", path)
            checks += vector_checks(path)
            print(f"vectors: {path} ({len(checks)} vectors)")
    checks += BUILTIN_CHECKS
    results = run_checks(checks)

    width = max(len(r.check.name) for r in results)
    print()
    print(f"{'RESULT':<6}  {'SOURCE':<8}  {'CHECK':<{width}}  DETAIL")
    for r in results:
        verdict = "OK" if r.ok else "FAIL"
        print(f"{verdict:<6}  {r.check.source:<8}  {r.check.name:<{width}}  {r.detail}")
    print()
    for source, label in (("vectors", "vector"), ("built-in", "built-in")):
        mine = [r for r in results if r.check.source == source]
        if mine:
            ok = sum(r.ok for r in mine)
            print(f"{label} checks: {ok} of {len(mine)} OK")
    failed = sum(not r.ok for r in results)
    print("selfcheck: all checks passed" if not failed else f"selfcheck: {failed} check(s) FAILED")
    return 0 if not failed else 1
