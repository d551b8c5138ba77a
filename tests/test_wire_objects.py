"""Data-plane codec: vectors, round trips under every chunking, zero copy, every PV rule."""

from __future__ import annotations

import array
import contextlib
import itertools
import json
import tracemalloc
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcs_core.wire.codes import (
    EndOfRange,
    GroupOrder,
    ObjectStatus,
    SessionErrorCode,
)
from kvcs_core.wire.errors import NEED_MORE, CodecError, EncodeError
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import Location
from kvcs_core.wire.objects import (
    DataStreamDecoder,
    EndOfRangeMarker,
    FetchHeader,
    FetchObject,
    FetchStreamDecoder,
    FetchStreamWriter,
    ObjectDatagram,
    PaddingDatagram,
    PaddingStreamHeader,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    SubgroupStreamDecoder,
    SubgroupStreamWriter,
    UniStreamKind,
    decode_datagram,
    encode_datagram,
    encode_datagram_header,
    encode_fetch_stream,
    encode_subgroup_header,
    encode_subgroup_stream,
    padding_datagram,
    padding_stream,
    peek_uni_stream_type,
)

try:
    from tests.strategies_data import datagrams, fetch_streams, group_order_for, subgroup_streams
except ImportError:  # plain ``pytest`` without the repository root on sys.path
    from strategies_data import (  # type: ignore[no-redef]
        datagrams,
        fetch_streams,
        group_order_for,
        subgroup_streams,
    )

PV = SessionErrorCode.PROTOCOL_VIOLATION
MAX = (1 << 64) - 1
Decoder = SubgroupStreamDecoder | FetchStreamDecoder | DataStreamDecoder
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ----------------------------------------------------------------------


def _vectors_path() -> Path:
    return Path(__file__).resolve().parents[2] / "shared" / "spec" / "moqt22-vectors.json"


@cache
def _vectors() -> dict[str, dict[str, Any]]:
    path = _vectors_path()
    if not path.exists():
        return {}
    return {v["name"]: v for v in json.loads(path.read_text())["vectors"]}


def _vector(name: str) -> dict[str, Any]:
    v = _vectors().get(name)
    if v is None:
        pytest.skip(f"vector file {_vectors_path()} or vector {name} not available")
    return v


def _decode(dec: Decoder, chunks: Sequence[bytes | memoryview]) -> list[Any]:
    out: list[Any] = []
    for c in chunks:
        out += dec.feed(c)
    dec.close()
    return out


def _split(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def _sub_ends(items: list[Any]) -> list[int]:
    """Stream offset where each item ends, from the encoders."""
    w = SubgroupStreamWriter(items[0])
    ends = [len(w.header_bytes())]
    for o in items[1:]:
        ends.append(ends[-1] + len(w.object_bytes(o)))
    return ends


def _fetch_ends(items: list[Any]) -> list[int]:
    rid = items[0].request_id
    w = FetchStreamWriter(rid, group_order_for(rid))
    ends = [len(w.header_bytes())]
    for it in items[1:]:
        ends.append(ends[-1] + len(w.item_bytes(it)))
    return ends


def _hex(annotated: str) -> bytes:
    return bytes.fromhex(annotated.replace("|", "").replace(" ", ""))


def _stream_error(
    make: Callable[[], Decoder], data: bytes, *, bytewise: bool = False
) -> CodecError:
    """The CodecError raised for ``data`` + FIN (fed whole, or byte by byte)."""
    dec = make()
    chunks = [data[i : i + 1] for i in range(len(data))] if bytewise else [data]
    with pytest.raises(CodecError) as ei:
        _decode(dec, chunks)
    return ei.value


def _sub_err(hexstr: str) -> CodecError:
    data = bytes.fromhex(hexstr.replace(" ", ""))
    e1 = _stream_error(SubgroupStreamDecoder, data)
    e2 = _stream_error(SubgroupStreamDecoder, data, bytewise=True)
    assert (e1.code, e1.offset) == (e2.code, e2.offset)
    return e1


def _fetch_err(hexstr: str, order: GroupOrder = GroupOrder.ASCENDING) -> CodecError:
    data = bytes.fromhex(hexstr.replace(" ", ""))
    e1 = _stream_error(lambda: FetchStreamDecoder(order), data)
    e2 = _stream_error(lambda: FetchStreamDecoder(order), data, bytewise=True)
    assert (e1.code, e1.offset) == (e2.code, e2.offset)
    return e1


def _dgram_err(hexstr: str) -> CodecError:
    with pytest.raises(CodecError) as ei:
        decode_datagram(bytes.fromhex(hexstr.replace(" ", "")))
    return ei.value


# --- (a) vectors ------------------------------------------------------------------

_STATUS = {"END_OF_GROUP": ObjectStatus.END_OF_GROUP, "END_OF_TRACK": ObjectStatus.END_OF_TRACK}
_EOR = {
    "non-existent": EndOfRange.NON_EXISTENT,
    "unknown": EndOfRange.UNKNOWN,
    "timed-out": EndOfRange.TIMED_OUT,
}


def _props(spec: list[dict[str, Any]]) -> tuple[KeyValuePair, ...]:
    return tuple(
        KeyValuePair(
            int(p["type"], 16), p["value"].encode() if isinstance(p["value"], str) else p["value"]
        )
        for p in spec
    )


def _subgroup_from_fields(f: dict[str, Any]) -> list[Any]:
    flags = int(f["type_flags"], 16)
    mode = SubgroupIdMode((flags >> 1) & 3)
    prio = f["publisher_priority"]
    h = SubgroupHeader(
        track_alias=f["track_alias"],
        group_id=f["group_id"],
        subgroup_id_mode=mode,
        subgroup_id=f["subgroup_id"] if mode is not SubgroupIdMode.FIRST_OBJECT_ID else None,
        publisher_priority=prio if isinstance(prio, int) else None,
        has_properties=bool(flags & 0x01),
        end_of_group=bool(flags & 0x08),
        first_object=bool(flags & 0x40),
    )
    assert h.type_flags == flags
    objs = []
    for o in f["objects"]:
        status = _STATUS[o["status"].split("(")[0]] if "status" in o else ObjectStatus.NORMAL
        props = _props(o["properties"]) if "properties" in o else (() if h.has_properties else None)
        objs.append(SubgroupObject(o["object_id"], props, status, o.get("payload", "").encode()))
    return [h, *objs]


def _fetch_from_fields(f: dict[str, Any]) -> tuple[GroupOrder, list[Any]]:
    order = {"Ascending": GroupOrder.ASCENDING, "Descending": GroupOrder.DESCENDING}[
        f["group_order"]
    ]
    items: list[Any] = [FetchHeader(f["request_id"])]
    for e in f.get("objects", f.get("entries")):
        if "end_of_range" in e:
            items.append(
                EndOfRangeMarker(_EOR[e["end_of_range"]], Location(e["group"], e["object"]))
            )
        else:
            items.append(
                FetchObject(
                    e["group"], e["object"], e["subgroup"], e["priority"], (), e["payload"].encode()
                )
            )
    return order, items


SUBGROUP_VECTORS = [
    "subgroup_stream_3_objects_end_of_group",
    "subgroup_stream_properties_default_priority",
]
FETCH_VECTORS = ["fetch_stream_two_groups", "fill_stream_end_of_range_markers"]


@pytest.mark.parametrize("name", SUBGROUP_VECTORS)
def test_subgroup_vectors(name: str) -> None:
    v = _vector(name)
    raw = bytes.fromhex(v["hex"])
    assert len(raw) == v["length"]
    items = _subgroup_from_fields(v["fields"])
    w = SubgroupStreamWriter(items[0])
    parts = [w.header_bytes()]
    for o in items[1:]:
        parts += [
            w.object_prefix(
                o.object_id, payload_length=len(o.payload), status=o.status, properties=o.properties
            ),
            bytes(o.payload),
        ]
    assert b"".join(parts) == raw
    assert encode_subgroup_stream(items[0], items[1:]) == raw
    assert _decode(SubgroupStreamDecoder(), [raw]) == items
    assert _decode(SubgroupStreamDecoder(), [raw[i : i + 1] for i in range(len(raw))]) == items
    dec = DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)
    assert _decode(dec, [raw]) == items
    assert dec.kind is UniStreamKind.SUBGROUP
    assert peek_uni_stream_type(raw) is UniStreamKind.SUBGROUP


@pytest.mark.parametrize("name", FETCH_VECTORS)
def test_fetch_vectors(name: str) -> None:
    v = _vector(name)
    raw = bytes.fromhex(v["hex"])
    assert len(raw) == v["length"]
    order, items = _fetch_from_fields(v["fields"])
    w = FetchStreamWriter(items[0].request_id, order)
    parts = [w.header_bytes()]
    for it in items[1:]:
        if isinstance(it, EndOfRangeMarker):
            parts.append(w.end_of_range(it.kind, it.location))
        else:
            parts += [
                w.object_prefix(
                    it.group_id,
                    it.object_id,
                    subgroup_id=it.subgroup_id,
                    publisher_priority=it.publisher_priority,
                    properties=None,
                    payload_length=len(it.payload),
                ),
                bytes(it.payload),
            ]
    assert b"".join(parts) == raw
    assert encode_fetch_stream(items[0].request_id, order, items[1:]) == raw
    assert _decode(FetchStreamDecoder(order), [raw]) == items
    assert (
        _decode(FetchStreamDecoder(lambda rid: order), [raw[i : i + 1] for i in range(len(raw))])
        == items
    )
    dec = DataStreamDecoder(fetch_group_order=order)
    assert _decode(dec, [raw]) == items
    assert dec.kind is UniStreamKind.FETCH
    assert peek_uni_stream_type(raw) is UniStreamKind.FETCH


@pytest.mark.parametrize("name", ["object_datagram_payload", "object_datagram_status_end_of_track"])
def test_datagram_vectors(name: str) -> None:
    v = _vector(name)
    f = v["fields"]
    raw = bytes.fromhex(v["hex"])
    d = ObjectDatagram(
        track_alias=f["track_alias"],
        group_id=f["group_id"],
        object_id=f["object_id"],
        publisher_priority=f["publisher_priority"],
        status=_STATUS[f["status"].split("(")[0]] if "status" in f else None,
        payload=f.get("payload", "").encode(),
    )
    assert d.type_flags == int(f["type_flags"], 16)
    assert encode_datagram(d) == raw
    assert encode_datagram_header(d) + bytes(d.payload) == raw
    assert decode_datagram(raw) == d


def test_padding_vector() -> None:
    v = _vector("padding_stream_and_datagram")
    raw = bytes.fromhex(v["hex"])
    cut = v["fields"]["split_at"]
    units = v["fields"]["units"]
    assert padding_stream(units[0]["zero_bytes"]) == raw[:cut]
    assert padding_datagram(units[1]["zero_bytes"]) == raw[cut:]
    assert encode_datagram(PaddingDatagram(units[1]["zero_bytes"])) == raw[cut:]
    assert decode_datagram(raw[cut:]) == PaddingDatagram(3)
    assert peek_uni_stream_type(raw[:cut]) is UniStreamKind.PADDING
    for chunks in ([raw[:cut]], [raw[i : i + 1] for i in range(cut)]):
        dec = DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)
        assert _decode(dec, chunks) == [PaddingStreamHeader()]
        assert dec.discarded == 4
        assert dec.kind is UniStreamKind.PADDING


# Section 12 "Annotated bytes" of MOQT-22-WIRE.md, transcribed with its field breaks.
ANNOTATED = {
    "subgroup_stream_3_objects_end_of_group": (
        "50 01 07 80 | 00 02 6d30 | 00 02 6d31 | 00 02 6d32 | 00 00 03"
    ),
    "subgroup_stream_properties_default_priority": (
        "79 05 29 | 08 07 7a 83e8 01 02 6b76 02 7038 | 00 00 02 7039 | 01 02 3e 01 02 7062"
    ),
    "fetch_stream_two_groups": (
        "05 04 | 1c 02 00 80 04 67326f30 | 00 04 67326f31 | 0c 00 00 04 67336f30"
        " | 04 02 04 67336f32"
    ),
    "fill_stream_end_of_range_markers": (
        "05 00 | 1c 05 00 40 01 61 | 02 01 62 | 80 8c 05 04 | 0d 00 00 01 63 | 81 0c 06 03"
        " | 1f 00 03 00 80 01 64"
    ),
    "object_datagram_payload": "00 01 09 04 80 646772616d",
    "object_datagram_status_end_of_track": "24 01 0b 80 04",
    "padding_stream_and_datagram": "f0132b3e28 00000000 | f0132b3e29 000000",
}


@pytest.mark.parametrize("name", sorted(ANNOTATED))
def test_annotated_bytes(name: str) -> None:
    """The section 12 bytes equal the vectors, and each ``|`` is an item boundary."""
    v = _vector(name)
    pieces = [bytes.fromhex(p.replace(" ", "")) for p in ANNOTATED[name].split("|")]
    raw = b"".join(pieces)
    assert raw.hex() == v["hex"]
    if v["kind"] != "data-stream":
        return
    if name.startswith("subgroup"):
        items = _subgroup_from_fields(v["fields"])
        dec: Decoder = SubgroupStreamDecoder()
    else:
        order, items = _fetch_from_fields(v["fields"])
        dec = FetchStreamDecoder(order)
    # Feeding piece by piece yields exactly one item per annotated piece.
    got = [dec.feed(p) for p in pieces]
    dec.close()
    assert [len(g) for g in got] == [1] * len(pieces)
    assert [g[0] for g in got] == items


# --- (b) properties: round trips, every chunking, prefixes, zero copy -------------


def _check_views(items: list[Any], chunks: list[bytes]) -> None:
    """Each payload is a view of the one chunk holding it, or a fresh exact-size buffer."""
    ids = {id(c) for c in chunks}
    for it in items:
        payload = getattr(it, "payload", None)
        if payload is None or not payload.nbytes:
            continue
        if id(payload.obj) not in ids:  # assembled once, into an exact-size fresh buffer
            assert type(payload.obj) in (bytes, bytearray)
            assert len(payload.obj) == payload.nbytes


@FAST
@given(subgroup_streams())
def test_subgroup_roundtrip_one_buffer_zero_copy(case: tuple[list[Any], bytes]) -> None:
    items, data = case
    got = _decode(SubgroupStreamDecoder(), [data])
    assert got == items
    for it in got[1:]:
        if it.payload.nbytes:
            assert it.payload.obj is data  # zero copy: a view of the fed object
    assert encode_subgroup_header(items[0]) == data[: len(encode_subgroup_header(items[0]))]


@FAST
@given(subgroup_streams(), st.lists(st.integers(0, 1 << 16), max_size=12))
def test_subgroup_any_split(case: tuple[list[Any], bytes], cuts: list[int]) -> None:
    items, data = case
    chunks = _split(data, cuts)
    got = _decode(SubgroupStreamDecoder(), chunks)
    assert got == items
    _check_views(got, chunks)
    dec = DataStreamDecoder(fetch_group_order=group_order_for)
    assert _decode(dec, chunks) == items


def _check_prefixes(
    items: list[Any], data: bytes, ends: list[int], make: Callable[[], Decoder]
) -> None:
    assert ends[-1] == len(data)
    # Byte by byte: after each byte exactly the items ending there are out.
    dec = make()
    got: list[Any] = []
    for i in range(len(data)):
        got += dec.feed(data[i : i + 1])
        done = sum(1 for e in ends if e <= i + 1)
        assert got == items[:done]
        assert dec.at_item_boundary == ((i + 1) in ends)
    dec.close()
    # Every strict prefix fed at once: no error, only complete items, FIN judged right.
    for cut in range(len(data)):
        dec = make()
        got = dec.feed(data[:cut])
        assert got == items[: sum(1 for e in ends if e <= cut)]
        if cut == 0 or cut in ends:
            dec.close()
        else:
            with pytest.raises(CodecError) as ei:
                dec.close()
            assert ei.value.code == PV


@FAST
@given(subgroup_streams(max_objects=5, max_payload=12))
def test_subgroup_prefixes(case: tuple[list[Any], bytes]) -> None:
    items, data = case
    _check_prefixes(items, data, _sub_ends(items), SubgroupStreamDecoder)


@FAST
@given(fetch_streams())
def test_fetch_roundtrip_one_buffer_zero_copy(case: tuple[list[Any], bytes]) -> None:
    items, data = case
    got = _decode(FetchStreamDecoder(group_order_for), [data])
    assert got == items
    for it in got:
        if isinstance(it, FetchObject) and it.payload.nbytes:
            assert it.payload.obj is data


@FAST
@given(fetch_streams(), st.lists(st.integers(0, 1 << 16), max_size=12))
def test_fetch_any_split(case: tuple[list[Any], bytes], cuts: list[int]) -> None:
    items, data = case
    chunks = _split(data, cuts)
    got = _decode(FetchStreamDecoder(group_order_for), chunks)
    assert got == items
    _check_views(got, chunks)
    assert _decode(DataStreamDecoder(fetch_group_order=group_order_for), chunks) == items


@FAST
@given(fetch_streams(max_items=6, max_payload=10))
def test_fetch_prefixes(case: tuple[list[Any], bytes]) -> None:
    items, data = case
    _check_prefixes(items, data, _fetch_ends(items), lambda: FetchStreamDecoder(group_order_for))


@FAST
@given(st.sampled_from([GroupOrder.ASCENDING, GroupOrder.DESCENDING]), fetch_streams())
def test_fetch_writer_explicit_order(order: GroupOrder, case: tuple[list[Any], bytes]) -> None:
    """The same items re-encoded with the order from the callable give the same bytes."""
    items, data = case
    rid = items[0].request_id
    if group_order_for(rid) is order:
        assert encode_fetch_stream(rid, order, items[1:]) == data


@FAST
@given(datagrams())
def test_datagram_roundtrip(case: tuple[ObjectDatagram | PaddingDatagram, bytes]) -> None:
    d, data = case
    got = decode_datagram(data)
    assert got == d
    if isinstance(got, ObjectDatagram):
        assert encode_datagram(got) == data
        if got.payload.nbytes:
            assert got.payload.obj is data
        header = len(encode_datagram_header(got))
        for cut in range(len(data)):
            if cut < header:
                with pytest.raises(CodecError) as ei:
                    decode_datagram(data[:cut])
                assert ei.value.code == PV  # truncation is never "need more"
            else:
                assert decode_datagram(data[:cut]) == ObjectDatagram(
                    got.track_alias,
                    got.group_id,
                    got.object_id,
                    got.publisher_priority,
                    got.properties,
                    got.status,
                    got.end_of_group,
                    data[header:cut],
                )


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64), st.lists(st.integers(0, 64), max_size=6))
def test_garbage_only_codec_errors(data: bytes, cuts: list[int]) -> None:
    """Any bytes, any chunking: decoders raise CodecError or nothing."""
    for make in (
        SubgroupStreamDecoder,
        lambda: FetchStreamDecoder(GroupOrder.DESCENDING),
        lambda: DataStreamDecoder(fetch_group_order=group_order_for),
        lambda: SubgroupStreamDecoder(max_payload_size=3, max_properties_size=2),
    ):
        with contextlib.suppress(CodecError):
            _decode(make(), _split(data, cuts))
    with contextlib.suppress(CodecError):
        decode_datagram(data)
    with contextlib.suppress(CodecError):
        peek_uni_stream_type(data)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(subgroup_streams(max_objects=4), fetch_streams(max_items=5)),
    st.integers(0, 1 << 16),
    st.integers(0, 255),
)
def test_mutations_only_codec_errors(case: tuple[list[Any], bytes], where: int, value: int) -> None:
    """A valid stream with one byte changed: still only CodecError, whole or byte by byte."""
    _, data = case
    b = bytearray(data)
    b[where % len(b)] = value
    bad = bytes(b)
    for chunks in ([bad], [bad[i : i + 1] for i in range(len(bad))]):
        try:
            _decode(DataStreamDecoder(fetch_group_order=group_order_for), chunks)
        except CodecError as e:
            assert e.offset >= 0


# --- zero copy and assembly, directly ------------------------------------------------


def test_payload_spanning_chunks_is_assembled_once() -> None:
    h = SubgroupHeader(track_alias=1, group_id=2, publisher_priority=3)
    payload = bytes(range(256)) * 40
    data = encode_subgroup_stream(
        h, [SubgroupObject(0, payload=payload), SubgroupObject(1, payload=b"x")]
    )
    hdr = len(encode_subgroup_header(h))
    chunks = [data[: hdr + 5], data[hdr + 5 : hdr + 3000], data[hdr + 3000 :]]
    dec = SubgroupStreamDecoder()
    got = [it for c in chunks for it in dec.feed(c)]
    o0, o1 = got[1], got[2]
    assert o0.payload == payload
    assert type(o0.payload.obj) is bytes and len(o0.payload.obj) == len(payload)
    assert all(o0.payload.obj is not c for c in chunks)
    assert o1.payload.obj is chunks[2]  # the small one after it is a view again


def test_header_split_then_view_of_next_chunk() -> None:
    """A header cut by a chunk boundary is finished from the next chunk, whose payload is a view."""
    h = SubgroupHeader(track_alias=1, group_id=2, has_properties=True)
    props = (KeyValuePair(0x3F, b"p" * 300),)
    payload = b"q" * 100_000
    data = encode_subgroup_stream(h, [SubgroupObject(5, props, payload=payload)])
    hdr = len(encode_subgroup_header(h))
    prefix = SubgroupStreamWriter(h).object_prefix(5, payload_length=len(payload), properties=props)
    assert len(prefix) > 300
    for cut in range(hdr, hdr + len(prefix)):
        first, second = data[:cut], data[cut:]
        dec = SubgroupStreamDecoder()
        out = dec.feed(first)
        out += dec.feed(second)
        dec.close()
        assert out[1] == SubgroupObject(5, props, payload=payload)
        assert out[1].payload.obj is second


def test_memoryview_and_bytearray_input() -> None:
    items, data = _sub_vector_items()
    mv = memoryview(bytearray(data))
    got = _decode(SubgroupStreamDecoder(), [mv[:7], mv[7:]])
    assert got == items
    assert _decode(SubgroupStreamDecoder(), [bytearray(data)]) == items
    arr = array.array("B", data)
    assert _decode(SubgroupStreamDecoder(), [memoryview(arr)]) == items


def _sub_vector_items() -> tuple[list[Any], bytes]:
    h = SubgroupHeader(track_alias=1, group_id=7, publisher_priority=0x80)
    objs = [SubgroupObject(i, payload=f"m{i}".encode()) for i in range(3)]
    objs.append(SubgroupObject(3, status=ObjectStatus.END_OF_GROUP))
    return [h, *objs], encode_subgroup_stream(h, objs)


def test_first_object_id_mode_resolves_header() -> None:
    h = SubgroupHeader(
        track_alias=3,
        group_id=4,
        subgroup_id_mode=SubgroupIdMode.FIRST_OBJECT_ID,
        publisher_priority=1,
    )
    data = encode_subgroup_stream(
        h, [SubgroupObject(17, payload=b"a"), SubgroupObject(18, payload=b"b")]
    )
    dec = SubgroupStreamDecoder()
    out = dec.feed(data[:4])
    assert out[0].subgroup_id is None and dec.subgroup_id is None
    assert dec.header is not None and dec.header.subgroup_id is None
    out += dec.feed(data[4:])
    assert dec.subgroup_id == 17
    assert dec.header is not None and dec.header.subgroup_id == 17
    assert out[0].subgroup_id is None  # the emitted item does not depend on chunking
    assert dec.last_object_id == 18


def test_limits_are_local_pv() -> None:
    h = SubgroupHeader(track_alias=1, group_id=1, has_properties=True)
    data = encode_subgroup_stream(
        h, [SubgroupObject(0, (KeyValuePair(1, b"abcd"),), payload=b"12345")]
    )
    e = _stream_error(lambda: SubgroupStreamDecoder(max_payload_size=4), data)
    assert e.code == PV and "max_payload_size" in e.reason
    e = _stream_error(lambda: SubgroupStreamDecoder(max_properties_size=5), data)
    assert e.code == PV and "max_properties_size" in e.reason
    assert (
        _decode(SubgroupStreamDecoder(max_payload_size=5, max_properties_size=6), [data])[1].payload
        == b"12345"
    )
    fdata = encode_fetch_stream(1, GroupOrder.ASCENDING, [FetchObject(0, 0, 0, 0, payload=b"123")])
    e = _stream_error(lambda: FetchStreamDecoder(GroupOrder.ASCENDING, max_payload_size=2), fdata)
    assert e.code == PV and "max_payload_size" in e.reason


# --- peek and DataStreamDecoder --------------------------------------------------------


def test_peek_uni_stream_type() -> None:
    assert peek_uni_stream_type(b"") is NEED_MORE
    assert peek_uni_stream_type(b"\xaf") is NEED_MORE
    assert peek_uni_stream_type(b"\xaf\x00") is UniStreamKind.CONTROL
    assert peek_uni_stream_type(b"\x05") is UniStreamKind.FETCH
    assert peek_uni_stream_type(b"\x80\x05") is UniStreamKind.FETCH  # judged by value (A20)
    assert peek_uni_stream_type(b"\x50\x01") is UniStreamKind.SUBGROUP
    assert peek_uni_stream_type(b"\x80\x50") is UniStreamKind.SUBGROUP
    assert peek_uni_stream_type(b"\xf0\x13\x2b\x3e") is NEED_MORE
    assert peek_uni_stream_type(b"\xf0\x13\x2b\x3e\x28") is UniStreamKind.PADDING
    for bad in ("00", "04", "06", "40", "8080", "f0132b3e29", "af01"):
        with pytest.raises(CodecError) as ei:
            peek_uni_stream_type(bytes.fromhex(bad))
        assert ei.value.code == PV


def test_data_stream_decoder_refuses_control_and_unknown() -> None:
    for raw in (b"\xaf\x00\x00", b"\x06", b"\x81\x00"):
        dec = DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)
        with pytest.raises(CodecError) as ei:
            dec.feed(raw[:1])
            dec.feed(raw[1:])
        assert ei.value.code == PV
        with pytest.raises(CodecError):  # stays failed
            dec.feed(b"\x00")
    dec = DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)
    dec.close()  # a stream FIN'd before its first byte carries nothing
    dec = DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)
    dec.feed(b"\xf0\x13")
    assert not dec.at_item_boundary
    with pytest.raises(CodecError):
        dec.close()


def test_fetch_group_order_callable_gets_request_id() -> None:
    seen: list[int] = []

    def order(rid: int) -> GroupOrder:
        seen.append(rid)
        return GroupOrder.DESCENDING

    items = [FetchObject(9, 0, 0, 1, payload=b"a"), FetchObject(7, 0, 0, 1, payload=b"b")]
    data = encode_fetch_stream(300, GroupOrder.DESCENDING, items)
    dec = FetchStreamDecoder(order)
    got = [it for i in range(len(data)) for it in dec.feed(data[i : i + 1])]
    dec.close()
    assert seen == [300]
    assert got == [FetchHeader(300), *items]
    assert dec.request_id == 300 and dec.group_order is GroupOrder.DESCENDING
    # the group delta 1 means 9 - (1 + 1) = 7 descending, 9 + 1 + 1 = 11 ascending
    asc = _decode(FetchStreamDecoder(GroupOrder.ASCENDING), [data])
    assert [it.group_id for it in asc[1:]] == [9, 11]


# --- (c) every PV rule ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hexstr", "why"),
    [
        ("8080 01 02", "Type Flags 128 (padded, value >= 128)"),
        ("80ff 01 02", "Type Flags 255"),
        ("40 01 02", "bit 0x10 clear"),
        ("05 01", "a FETCH_HEADER is not a subgroup header"),
        ("16 01 02", "SUBGROUP_ID_MODE 0b11"),
        ("1e 01 02", "SUBGROUP_ID_MODE 0b11 with END_OF_GROUP"),
        ("57 01 02 00", "mode 0b11 + PROPERTIES"),
        (
            "50 01 02 80 ffffffffffffffffff 01 61 00 01 62",
            "Object ID overflow (first = 2^64-1, next delta 0)",
        ),
        ("50 01 02 80 00 00 01", "Object Status 0x1 (old drafts only)"),
        ("50 01 02 80 00 00 02", "Object Status 0x2"),
        ("50 01 02 80 00 00 05", "unknown Object Status 0x5"),
        ("50 01 02 80 00 00 8080", "unknown Object Status 128"),
        ("51 01 02 80 00 02 0201 00 03", "properties on an End of Group object"),
        ("51 01 02 80 00 02 0201 00 04", "properties on an End of Track object"),
        ("51 01 02 80 00 03 0105 61 00 00", "KVP value runs past the Properties Length"),
        ("51 01 02 80 00 02 01 05 00 00", "odd KVP without enough bytes"),
        ("51 01 02 80 00 01 ff 01 61", "KVP type overflow inside the properties"),
        ("50 01 02 80 00 05 6162", "FIN inside a payload"),
        ("50 01 02 80 00", "FIN inside an object header"),
        ("50 01 02 80 00 00", "FIN before the Object Status"),
        ("51 01 02 80 00 04 0201", "FIN inside the properties"),
        ("54 01 02", "FIN inside the header (before Subgroup ID)"),
        ("50 01 02", "FIN before the priority byte"),
        ("af", "FIN inside the Type Flags vi64"),
    ],
)
def test_subgroup_pv(hexstr: str, why: str) -> None:
    assert _sub_err(hexstr).code == PV, why


def test_subgroup_status_and_flag_rules_accept_valid() -> None:
    # Padded Type Flags are judged by value (A20); Normal status 0 with properties is fine.
    got = _decode(SubgroupStreamDecoder(), [bytes.fromhex("8051 01 02 80 00 02 0201 00 00")])
    assert got[0].type_flags == 0x51 and got[1] == SubgroupObject(0, (KeyValuePair(2, 1),))
    # All 48 valid flag values decode.
    valid = [f for f in range(0x10, 0x80) if f & 0x10 and (f >> 1) & 3 != 3]
    assert len(valid) == 48
    for f in valid:
        raw = (
            bytes([f, 1, 2])
            + (b"\x09" if (f >> 1) & 3 == 2 else b"")
            + (b"" if f & 0x20 else b"\x80")
        )
        h = _decode(SubgroupStreamDecoder(), [raw])[0]
        assert h.type_flags == f and encode_subgroup_header(h) == raw


def test_subgroup_error_offsets_and_stickiness() -> None:
    dec = SubgroupStreamDecoder()
    dec.feed(bytes.fromhex("50 01 02 80 00 01 61"))
    with pytest.raises(CodecError) as ei:
        dec.feed(bytes.fromhex("00 00 07"))
    assert ei.value.offset == 9  # stream offset of the bad Object Status
    with pytest.raises(CodecError) as ei2:
        dec.feed(b"\x00")
    assert ei2.value is ei.value
    with pytest.raises(CodecError):
        dec.close()
    ok = SubgroupStreamDecoder()
    ok.feed(bytes.fromhex("50 01 02 80"))
    ok.close()
    with pytest.raises(CodecError) as ei3:
        ok.feed(b"\x00")
    assert ei3.value.code == PV


@pytest.mark.parametrize(
    ("hexstr", "order", "why"),
    [
        ("06 01", "asc", "not FETCH_HEADER"),
        ("05 01 80 80 00 00", "asc", "Serialization Flags 0x80 (not a marker)"),
        ("05 01 80 8d 00 00", "asc", "0x8D"),
        ("05 01 81 0d 00 00", "asc", "0x10D"),
        ("05 01 82 00 00 00", "asc", "0x200"),
        ("05 01 ffffffffffffffffff 00 00", "asc", "2^64-1"),
        ("05 01 14 80 00", "asc", "first object without Group/Object ID (0x10 only)"),
        ("05 01 18 00 80 00", "asc", "first object without Object ID (0x04)"),
        ("05 01 14 00 80 00", "asc", "first object without Group ID (0x08)"),
        ("05 01 1d 00 00 80 00", "asc", "first object, subgroup mode 1 (prior)"),
        ("05 01 1e 00 00 80 00", "asc", "first object, subgroup mode 2 (prior + 1)"),
        ("05 01 0c 00 00 00", "asc", "first object without priority"),
        ("05 01 808c 05 04 01 00", "asc", "after only a marker: mode 1 with no prior real object"),
        ("05 01 808c 05 04 02 00", "asc", "after only a marker: mode 2 with no prior real object"),
        ("05 01 808c 05 04 00 00", "asc", "after only a marker: no priority to inherit"),
        ("05 01 5c 00 00 80 00 02 00", "asc", "after a datagram object only: no prior Subgroup ID"),
        ("05 01 1c 01 00 80 00 08 01 00", "desc", "descending group underflow 1 - 2"),
        ("05 01 1c 00 00 80 00 08 00 00", "desc", "descending group underflow 0 - 1"),
        ("05 01 1c fffffffffffffffffe 00 80 00 08 01 00", "asc", "ascending group overflow"),
        ("05 01 1c 00 ffffffffffffffffff 80 00 00 00", "asc", "Object ID prior + 1 overflow"),
        ("05 01 1c 00 fffffffffffffffffe 80 00 04 02 00", "asc", "Object ID + delta overflow"),
        ("05 01 1f 00 ffffffffffffffffff 00 80 00 02 00", "asc", "Subgroup ID prior + 1 overflow"),
        ("05 01 1c 00 00 80 05 6162", "asc", "FIN inside a payload"),
        ("05 01 808c 05", "asc", "FIN inside a marker"),
        ("05 01 1c 00", "asc", "FIN inside an object header"),
        ("05 01 3c 00 00 80 03 0201", "asc", "FIN inside properties"),
        ("05 01 3c 00 00 80 02 0105 00", "asc", "KVP past the Properties Length"),
        ("05", "asc", "FIN inside the FETCH_HEADER"),
    ],
)
def test_fetch_pv(hexstr: str, order: str, why: str) -> None:
    go = GroupOrder.ASCENDING if order == "asc" else GroupOrder.DESCENDING
    assert _fetch_err(hexstr, go).code == PV, why


def test_fetch_marker_semantics() -> None:
    """After a marker: prior Group/Object are its own; prior subgroup/priority the last object's."""
    raw = _hex("05 01 1f 03 07 05 40 00 | 810c 03 09 | 01 00 | 820c 04 02 | 0e 00 00 00")
    got = _decode(FetchStreamDecoder(GroupOrder.ASCENDING), [raw])
    assert got == [
        FetchHeader(1),
        FetchObject(3, 5, 7, 0x40),
        EndOfRangeMarker(EndOfRange.UNKNOWN, Location(3, 9)),
        FetchObject(3, 10, 7, 0x40),  # 0x01: same subgroup 7, Object ID marker's 9 + 1
        EndOfRangeMarker(EndOfRange.TIMED_OUT, Location(4, 2)),
        FetchObject(5, 0, 8, 0x40),  # 0x0E: group 4 + 0 + 1, Object ID 0, subgroup 7 + 1
    ]
    # Zero-length payload objects are fine and have no status on fetch streams.
    assert got[1].payload.nbytes == 0
    # A marker first, then an object relative to it.
    w = FetchStreamWriter(2, GroupOrder.ASCENDING)
    data = (
        w.header_bytes()
        + w.end_of_range(EndOfRange.NON_EXISTENT, Location(0, 4))
        + w.object_prefix(0, 5, subgroup_id=0, publisher_priority=9, payload_length=1)
        + b"z"
    )
    assert data == _hex("05 02 | 808c 00 04 | 10 09 01 7a")  # same group, ID + 1: only 0x10
    got = _decode(FetchStreamDecoder(GroupOrder.ASCENDING), [data])
    assert got[2] == FetchObject(0, 5, 0, 9, payload=b"z")


def test_fetch_a5_object_id_arithmetic() -> None:
    # Same group + 0x04: prior + delta (no +1); delta 0 repeats the ID (malformed track, not PV).
    raw = bytes.fromhex("05 01 1c 02 05 80 00 04 00 00 04 03 00")
    got = _decode(FetchStreamDecoder(GroupOrder.ASCENDING), [raw])
    assert [(it.group_id, it.object_id) for it in got[1:]] == [(2, 5), (2, 5), (2, 8)]
    # Group change with 0x04 clear: Object ID = prior Object ID + 1, "regardless of group".
    raw = bytes.fromhex("05 01 1c 02 05 80 00 08 00 00")
    got = _decode(FetchStreamDecoder(GroupOrder.ASCENDING), [raw])
    assert [(it.group_id, it.object_id) for it in got[1:]] == [(2, 5), (3, 6)]
    got = _decode(FetchStreamDecoder(GroupOrder.DESCENDING), [raw])
    assert [(it.group_id, it.object_id) for it in got[1:]] == [(2, 5), (1, 6)]


@pytest.mark.parametrize(
    ("hexstr", "why"),
    [
        ("", "empty datagram"),
        ("10 01 02 03 80", "reserved bit 0x10"),
        ("11 01 02 03 80", "reserved bit 0x10 with properties"),
        ("40 01 02 03 80", "undefined bit 0x40"),
        ("8080 01 02 03 80", "undefined bit 0x80 (padded vi64)"),
        ("c04000 01 02", "0x4000"),
        ("f0132b3e28", "the padding *stream* type in a datagram"),
        ("22 01 02 03 80 00", "STATUS with END_OF_GROUP"),
        ("23 01 02 03 80 00 00", "STATUS + END_OF_GROUP + PROPERTIES"),
        ("01 01 02 03 80 00 61", "PROPERTIES with Length 0"),
        ("21 01 02 03 80 02 0201 03", "STATUS + PROPERTIES with End of Group"),
        ("21 01 02 03 80 02 0201 04", "STATUS + PROPERTIES with End of Track"),
        ("20 01 02 03 80 01", "unknown status 0x1"),
        ("20 01 02 03 80 07", "unknown status 0x7"),
        ("20 01 02 03 80 00 00", "bytes after the Object Status"),
        ("01 01 02 03 80 05 0201", "Properties Length past the end"),
        ("01 01 02 03 80 02 0105", "KVP runs past the Properties Length"),
        ("00 01 02 03", "truncated before the priority"),
        ("00 01 02", "truncated before the Object ID"),
        ("20 01 02 03 80", "truncated before the status"),
        ("20 01 02 03 80 80", "truncated inside the status"),
        ("af", "truncated inside the Type Flags"),
        ("f0132b3e", "truncated padding type"),
    ],
)
def test_datagram_pv(hexstr: str, why: str) -> None:
    assert _dgram_err(hexstr).code == PV, why


def test_datagram_valid_flags() -> None:
    valid = set(range(0x10)) | {0x20, 0x21, 0x24, 0x25, 0x28, 0x29, 0x2C, 0x2D}
    for f in range(0x80):
        body = bytes([f, 1, 2]) + (b"" if f & 0x04 else b"\x03") + (b"" if f & 0x08 else b"\x80")
        body += b"\x02\x02\x01" if f & 0x01 else b""
        body += b"\x00" if f & 0x20 else b"pay"
        if f in valid:
            d = decode_datagram(body)
            assert isinstance(d, ObjectDatagram) and d.type_flags == f
            assert encode_datagram(d) == body
        else:
            with pytest.raises(CodecError) as ei:
                decode_datagram(body)
            assert ei.value.code == PV
    # Normal status with properties is allowed; padded flags are judged by value.
    d = decode_datagram(bytes.fromhex("8021 01 02 03 80 02 0201 00"))
    assert isinstance(d, ObjectDatagram) and d.status is ObjectStatus.NORMAL and d.properties
    assert decode_datagram(bytes.fromhex("f0132b3e29 00 07")) == PaddingDatagram(
        2
    )  # content ignored
    assert decode_datagram(bytes.fromhex("f0132b3e29")) == PaddingDatagram(0)


# --- encoders refuse impossible input --------------------------------------------------


def test_subgroup_encoder_errors() -> None:
    with pytest.raises(EncodeError):
        SubgroupHeader(track_alias=-1, group_id=0)
    with pytest.raises(EncodeError):
        SubgroupHeader(track_alias=0, group_id=1 << 64)
    with pytest.raises(EncodeError):
        SubgroupHeader(track_alias=0, group_id=0, publisher_priority=256)
    with pytest.raises(EncodeError):
        SubgroupHeader(track_alias=0, group_id=0, subgroup_id_mode=3)
    with pytest.raises(EncodeError):
        SubgroupHeader(track_alias=0, group_id=0, subgroup_id_mode=SubgroupIdMode.EXPLICIT)
    with pytest.raises(EncodeError):
        SubgroupHeader(track_alias=0, group_id=0, subgroup_id=4)
    with pytest.raises(EncodeError):
        SubgroupObject(0, status=ObjectStatus.END_OF_GROUP, payload=b"x")
    with pytest.raises(EncodeError):
        SubgroupObject(0, (KeyValuePair(2, 1),), ObjectStatus.END_OF_TRACK)
    with pytest.raises(EncodeError):
        SubgroupObject(0, status=7)
    w = SubgroupStreamWriter(SubgroupHeader(track_alias=0, group_id=0))
    w.object_prefix(5, payload_length=1)
    with pytest.raises(EncodeError):
        w.object_prefix(5, payload_length=1)  # not ascending
    with pytest.raises(EncodeError):
        w.object_prefix(6, payload_length=1, properties=(KeyValuePair(2, 1),))  # no PROPERTIES flag
    with pytest.raises(EncodeError):
        w.object_prefix(6, payload_length=1, status=ObjectStatus.END_OF_GROUP)
    assert w.object_prefix(7, payload_length=0, status=ObjectStatus.END_OF_GROUP) == b"\x01\x00\x03"
    with pytest.raises(EncodeError):
        w.object_prefix(8, payload_length=1)  # after End of Group
    w2 = SubgroupStreamWriter(
        SubgroupHeader(
            track_alias=0,
            group_id=0,
            subgroup_id_mode=SubgroupIdMode.FIRST_OBJECT_ID,
            subgroup_id=4,
        )
    )
    with pytest.raises(EncodeError):
        w2.object_prefix(3, payload_length=1)
    assert w2.object_prefix(4, payload_length=0) == b"\x04\x00\x00"


def test_fetch_encoder_errors() -> None:
    w = FetchStreamWriter(1, GroupOrder.ASCENDING)
    w.object_prefix(5, 5, subgroup_id=0, publisher_priority=1, payload_length=0)
    with pytest.raises(EncodeError):
        w.object_prefix(5, 5, subgroup_id=0, publisher_priority=1, payload_length=0)
    with pytest.raises(EncodeError):
        w.object_prefix(4, 0, subgroup_id=0, publisher_priority=1, payload_length=0)
    with pytest.raises(EncodeError):
        w.object_prefix(6, 0, subgroup_id=1, publisher_priority=1, payload_length=0, datagram=True)
    with pytest.raises(EncodeError):
        w.object_prefix(6, 0, subgroup_id=None, publisher_priority=1, payload_length=0)
    with pytest.raises(EncodeError):
        w.object_prefix(6, 0, subgroup_id=0, publisher_priority=300, payload_length=0)
    with pytest.raises(EncodeError):
        w.end_of_range(EndOfRange.UNKNOWN, Location(5, 5))
    with pytest.raises(EncodeError):
        FetchStreamWriter(1, 3)  # type: ignore[arg-type]
    d = FetchStreamWriter(1, GroupOrder.DESCENDING)
    d.object_prefix(5, 0, subgroup_id=0, publisher_priority=1, payload_length=0)
    with pytest.raises(EncodeError):
        d.object_prefix(6, 0, subgroup_id=0, publisher_priority=1, payload_length=0)
    with pytest.raises(EncodeError):
        FetchObject(0, 0, None, 0)
    with pytest.raises(EncodeError):
        FetchObject(0, 0, 0, 0, datagram=True)


def test_fetch_encoder_flag_choices() -> None:
    """Wire reference 7.5 'Encoder': 0x1C first, 0x04 when needed, priority on change, modes."""
    w = FetchStreamWriter(1, GroupOrder.ASCENDING)
    p = w.object_prefix
    assert p(2, 0, subgroup_id=5, publisher_priority=9, payload_length=0)[0] == 0x1F
    assert p(2, 1, subgroup_id=5, publisher_priority=9, payload_length=0)[0] == 0x01
    assert p(2, 2, subgroup_id=6, publisher_priority=9, payload_length=0)[0] == 0x02
    assert p(2, 4, subgroup_id=0, publisher_priority=8, payload_length=0)[0] == 0x14
    assert p(3, 5, subgroup_id=0, publisher_priority=8, payload_length=0)[0] == 0x0C
    assert (
        p(3, 6, subgroup_id=None, publisher_priority=8, payload_length=0, datagram=True)[0] == 0x40
    )
    assert (
        p(3, 7, subgroup_id=1, publisher_priority=8, payload_length=0)[0] == 0x02
    )  # prior real = 0
    assert (
        p(
            3,
            8,
            subgroup_id=9,
            publisher_priority=8,
            payload_length=0,
            properties=(KeyValuePair(2, 1),),
        )[0]
        == 0x23
    )


def test_datagram_encoder_errors() -> None:
    with pytest.raises(EncodeError):
        ObjectDatagram(1, 2, 3, status=ObjectStatus.NORMAL, end_of_group=True)
    with pytest.raises(EncodeError):
        ObjectDatagram(1, 2, 3, status=ObjectStatus.END_OF_GROUP, payload=b"x")
    with pytest.raises(EncodeError):
        ObjectDatagram(1, 2, 3, properties=(KeyValuePair(2, 1),), status=ObjectStatus.END_OF_TRACK)
    with pytest.raises(EncodeError):
        ObjectDatagram(1, 2, 3, publisher_priority=-1)
    with pytest.raises(EncodeError):
        padding_datagram(-1)
    with pytest.raises(EncodeError):
        padding_stream(-1)
    assert ObjectDatagram(1, 2, 3, properties=()).properties is None


# --- assembly modes, bounded re-parsing ---------------------------------------------


def _one_object_stream(payload: bytes) -> tuple[bytes, int]:
    h = SubgroupHeader(track_alias=1, group_id=2, publisher_priority=3)
    data = encode_subgroup_stream(h, [SubgroupObject(0, payload=payload)])
    return data, len(data) - len(payload)


def test_assembly_keeps_big_pieces_and_joins_once() -> None:
    payload = bytes(range(256)) * 64
    data, start = _one_object_stream(payload)
    cuts = [start + 100, start + 700, start + 5000, start + 9000]
    chunks = _split(data, cuts)
    assert all(len(c) >= 512 for c in chunks[1:-1])
    got = _decode(SubgroupStreamDecoder(), chunks)
    assert got[1].payload == payload
    assert type(got[1].payload.obj) is bytes and got[1].payload.readonly


def test_assembly_switches_to_buffer_mode_on_small_pieces() -> None:
    payload = bytes(range(256)) * 64
    data, start = _one_object_stream(payload)
    for cuts in (
        [start + 100, start + 700, start + 800, start + 5000],  # a 100-byte middle piece
        [start + 1, *range(start + 2, len(data), 7)],  # QUIC frames of 7 bytes
        [start + 5000, start + 5001],  # a 1-byte piece after a big one
    ):
        chunks = _split(data, cuts)
        dec = SubgroupStreamDecoder()
        got: list[Any] = []
        fed = 0
        for c in chunks:
            got += dec.feed(c)
            fed += len(c)
            assert dec.bytes_received == fed
        dec.close()
        assert got[1].payload == payload
        assert type(got[1].payload.obj) is bytearray
        assert len(got[1].payload.obj) == len(payload)
    # memoryview chunks take the same paths
    mv = memoryview(data)
    got = _decode(
        SubgroupStreamDecoder(), [mv[: start + 3], mv[start + 3 : start + 9], mv[start + 9 :]]
    )
    assert got[1].payload == payload


def test_buffer_mode_holds_the_bytes_received_not_the_declared_length() -> None:
    """A header declaring a big payload, then tiny frames: memory follows the frames.

    Before, the first small piece allocated a buffer of the whole declared Object
    Payload Length (up to ``max_payload_size``, 64 MiB) for a few bytes received,
    per stream: a peer could make us commit gigabytes with a few hundred bytes.
    """
    declared = 16 * 1024 * 1024
    data, start = _one_object_stream(bytes(declared))
    head = data[: start + 100]
    del data
    dec = SubgroupStreamDecoder()
    tracemalloc.start()
    try:
        dec.feed(head)
        for i in range(50):
            dec.feed(bytes([i]) * 10)  # tiny STREAM frames: buffer mode
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dec.bytes_received == start + 100 + 500
    assert peak < 256 * 1024, f"{peak} bytes held for 600 bytes received"
    # and the payload still completes to the right bytes
    payload = bytes(declared)
    got = dec.feed(payload[600:])
    dec.close()
    expected = bytes(100) + b"".join(bytes([i]) * 10 for i in range(50)) + payload[600:]
    assert got[0].payload == expected


def test_properties_fed_byte_by_byte_are_parsed_once() -> None:
    """A big header cut into 1-byte chunks is re-parsed a bounded number of times."""
    h = SubgroupHeader(track_alias=1, group_id=2, has_properties=True)
    props = tuple(KeyValuePair(0x3F, bytes([i]) * 60_000) for i in range(2))
    data = encode_subgroup_stream(h, [SubgroupObject(4, props, payload=b"xyz")])
    hdr = len(encode_subgroup_header(h))
    dec = SubgroupStreamDecoder()
    assert dec.feed(data[:hdr]) == [h]
    calls = 0
    parse = dec._parse

    def counting(self: Any, buf: Any, pos: int) -> Any:
        nonlocal calls
        calls += 1
        return parse(self, buf, pos)

    dec._parse = counting
    got: list[Any] = []
    for i in range(hdr, len(data)):
        got += dec.feed(data[i : i + 1])
    dec.close()
    assert got == [SubgroupObject(4, props, payload=b"xyz")]
    assert calls < 40


def test_flags_judged_by_value_everywhere() -> None:
    """Padded vi64 forms of stream types, flags and markers (wire reference A20)."""
    raw = _hex("80 05 | 01 | 80 1c 00 00 80 01 61 | c0 00 8c 00 05 | 00 01 62")
    got = _decode(FetchStreamDecoder(GroupOrder.ASCENDING), [raw])
    assert got == [
        FetchHeader(1),
        FetchObject(0, 0, 0, 0x80, payload=b"a"),
        EndOfRangeMarker(EndOfRange.NON_EXISTENT, Location(0, 5)),
        FetchObject(0, 6, 0, 0x80, payload=b"b"),
    ]
    assert decode_datagram(_hex("80 00 01 02 03 80 61")) == ObjectDatagram(
        1, 2, 3, 0x80, payload=b"a"
    )


def test_data_after_fin_and_empty_feeds() -> None:
    items, data = _sub_vector_items()
    dec = SubgroupStreamDecoder()
    assert dec.feed(b"") == []
    assert dec.feed(data) == items
    dec.close()
    assert dec.feed(b"") == []
    with pytest.raises(CodecError) as ei:
        dec.feed(b"\x00")
    assert ei.value.code == PV and ei.value.offset == len(data)
    d2 = DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)
    d2.close()
    with pytest.raises(CodecError):
        d2.feed(b"\x05")
