"""Cross-check the wire codec against caprid-moq-core, in process, both directions.

Per ../shared/peers/INTEROP.md, caprid (``moq_core`` 0.1.0) is an independent
draft-22 codec. For every message and data stream both implement:

* kvcs encodes -> caprid decodes -> the decoded content equals what kvcs encoded
  (converted field by field), and caprid's re-encoding is byte-identical;
* caprid encodes -> kvcs decodes -> the same content, and kvcs re-encodes the
  same bytes.

caprid has no SUBSCRIBE_TRACKS codec, no datagram codec and no fetch-stream
encoder, and keeps range filters opaque; those cases are excluded explicitly
below. Where the two disagree, MOQT-22-WIRE.md section 11 (Ambiguities) settles
it and ``TestDisagreements`` pins the reference's answer.
"""

from __future__ import annotations

from typing import Any

import _caprid as cp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies_control import MESSAGE_STRATEGIES
from strategies_data import fetch_streams, group_order_for, subgroup_streams

from kvcs_core.wire import messages as m
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import (
    EndOfRange,
    GroupOrder,
    LocationFilterType,
    MessageType,
    ObjectStatus,
)
from kvcs_core.wire.errors import CodecError
from kvcs_core.wire.fetch import EndOfRangeMarker, FetchHeader, FetchObject
from kvcs_core.wire.filters import InvalidRangeFilter, RangeFilter, RangeFilterRemove
from kvcs_core.wire.kvp import KeyValuePair, read_kvps
from kvcs_core.wire.names import TrackNamespace
from kvcs_core.wire.objects import DataStreamDecoder
from kvcs_core.wire.subgroup import (
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    SubgroupStreamDecoder,
    encode_subgroup_stream,
)
from kvcs_core.wire.varint import read_vi64

cm = cp.cm
MAX_VI64 = (1 << 64) - 1

# --- kvcs -> caprid model ----------------------------------------------------


def _ns(ns: TrackNamespace) -> list[str]:
    return [cp.s(f) for f in ns.fields]


def _kvps(pairs: tuple[KeyValuePair, ...]) -> list[Any]:
    return [cm.KeyValuePair(kv.type, kv.value) for kv in pairs]


def _location_filter(lf: p.LocationFilter) -> Any:
    t = lf.filter_type
    if t == LocationFilterType.NONE:
        return cm.NoLocationFilter()
    if t == LocationFilterType.NEXT_OBJECT:
        return cm.NextObjectFilter()
    if t == LocationFilterType.RELATIVE_START:
        return cm.RelativeGroupFilter(groups_before_next=lf.start_group)
    return cm.AbsoluteLocationFilter(
        start=cm.Location(lf.start_group, lf.start_object),
        end_group_delta=lf.end_group_delta,
        end_object=lf.end_object,
    )


def to_caprid_params(params: p.Parameters) -> Any:
    out = cm.MessageParameters()
    for item in params:
        if isinstance(item, p.ObjectDeliveryTimeout):
            out.object_delivery_timeout = item.ms
        elif isinstance(item, p.SubgroupDeliveryTimeout):
            out.subgroup_delivery_timeout = item.ms
        elif isinstance(item, p.RendezvousTimeout):
            out.rendezvous_timeout = item.ms
        elif isinstance(item, p.FillTimeout):
            out.fill_timeout = item.ms
        elif isinstance(item, p.Expires):
            out.expires = item.ms
        elif isinstance(item, p.AuthorizationToken):
            out.authorization_tokens = [*(out.authorization_tokens or []), p.encode_token(item)]
        elif isinstance(item, p.LargestObject):
            out.largest_object = cm.Location(item.location.group, item.location.object)
        elif isinstance(item, p.Forward):
            out.forward = item.value
        elif isinstance(item, p.SubscriberPriority):
            out.subscriber_priority = item.value
        elif isinstance(item, p.LocationFilter):
            out.location_filter = _location_filter(item)
        elif isinstance(item, p.GroupOrderParam):
            out.group_order = "ascending" if item.order == GroupOrder.ASCENDING else "descending"
        elif isinstance(item, p.FillParameters):
            out.fill_parameters = to_caprid_params(item.params)
        elif isinstance(item, p.NewGroupRequest):
            out.new_group_request = item.value
        elif isinstance(item, p.TrackNamespacePrefix):
            out.track_namespace_prefix = _ns(item.namespace)
        elif isinstance(item, p.IncludeProperties):
            out.include_properties = item.value
        elif isinstance(item, RangeFilter | RangeFilterRemove | InvalidRangeFilter):
            raw = bytearray()
            item.encode_value(raw)
            # caprid keeps range filters opaque: the length-prefixed value without its prefix.
            value, used = _strip_length(bytes(raw))
            assert used == len(raw)
            out.range_filters = [*(out.range_filters or []), cm.RangeFilter(int(item.type), value)]
        else:  # pragma: no cover - a new parameter class must be mapped here
            raise AssertionError(f"unmapped parameter {item!r}")
    return out


def _strip_length(raw: bytes) -> tuple[bytes, int]:
    length, pos = read_vi64(raw, 0)
    return raw[pos : pos + length], pos + length


def to_caprid(msg: Any) -> Any:
    """The caprid message with the same content as a kvcs message."""
    P = to_caprid_params
    if isinstance(msg, m.Setup):
        return cm.Setup(options=_kvps(tuple(_setup_pairs(msg))))
    if isinstance(msg, m.Goaway):
        return cm.Goaway(new_session_uri=cp.s(msg.new_session_uri), timeout=msg.timeout_ms)
    if isinstance(msg, m.Subscribe):
        return cm.Subscribe(
            request_id=msg.request_id,
            track_namespace=_ns(msg.namespace),
            track_name=cp.s(msg.name),
            parameters=P(msg.params),
        )
    if isinstance(msg, m.Fetch):
        return cm.Fetch(
            request_id=msg.request_id,
            track_namespace=_ns(msg.namespace),
            track_name=cp.s(msg.name),
            parameters=P(msg.params),
        )
    if isinstance(msg, m.TrackStatus):
        return cm.TrackStatus(
            request_id=msg.request_id,
            track_namespace=_ns(msg.namespace),
            track_name=cp.s(msg.name),
            parameters=P(msg.params),
        )
    if isinstance(msg, m.SubscribeNamespace):
        return cm.SubscribeNamespace(
            request_id=msg.request_id,
            track_namespace_prefix=_ns(msg.prefix),
            parameters=P(msg.params),
        )
    if isinstance(msg, m.SubscribeOk):
        return cm.SubscribeOk(
            track_alias=msg.track_alias,
            parameters=P(msg.params),
            track_properties=_kvps(msg.track_properties),
        )
    if isinstance(msg, m.RequestOk):
        return cm.RequestOk(parameters=P(msg.params), track_properties=_kvps(msg.track_properties))
    if isinstance(msg, m.RequestError):
        redirect = None
        if msg.redirect is not None:
            redirect = cm.Redirect(
                connect_uri=cp.s(msg.redirect.connect_uri),
                track_namespace=_ns(msg.redirect.namespace),
                track_name=cp.s(msg.redirect.track_name),
            )
        return cm.RequestError(
            error_code=int(msg.error_code),
            retry_interval=msg.retry_interval,
            reason=cp.s(msg.reason),
            redirect=redirect,
        )
    if isinstance(msg, m.RequestUpdate):
        return cm.RequestUpdate(request_id=msg.request_id, parameters=P(msg.params))
    if isinstance(msg, m.PublishStateNotify):
        return cm.PublishStateNotify(parameters=P(msg.params))
    if isinstance(msg, m.PublishDone):
        count = None if msg.stream_count == MAX_VI64 else msg.stream_count
        return cm.PublishDone(
            status_code=int(msg.status_code), stream_count=count, reason=cp.s(msg.reason)
        )
    if isinstance(msg, m.Publish):
        return cm.Publish(
            request_id=msg.request_id,
            track_namespace=_ns(msg.namespace),
            track_name=cp.s(msg.name),
            track_alias=msg.track_alias,
            parameters=P(msg.params),
            track_properties=_kvps(msg.track_properties),
        )
    if isinstance(msg, m.PublishNamespace):
        return cm.PublishNamespace(
            request_id=msg.request_id, track_namespace=_ns(msg.namespace), parameters=P(msg.params)
        )
    if isinstance(msg, m.FetchOk):
        return cm.FetchOk(
            end_of_track=msg.end_of_track,
            end_location=cm.Location(msg.end_location.group, msg.end_location.object),
            parameters=P(msg.params),
            track_properties=_kvps(msg.track_properties),
        )
    if isinstance(msg, m.Namespace):
        return cm.Namespace(track_namespace_suffix=_ns(msg.suffix))
    if isinstance(msg, m.NamespaceDone):
        return cm.NamespaceDone(track_namespace_suffix=_ns(msg.suffix))
    if isinstance(msg, m.PublishSkipped):
        return cm.PublishSkipped(track_namespace_suffix=_ns(msg.suffix), track_name=cp.s(msg.name))
    raise AssertionError(f"caprid has no model for {type(msg).__name__}")


def _setup_pairs(msg: m.Setup) -> list[KeyValuePair]:
    """The Setup Options of a kvcs Setup as KVPs, in wire order (read back from our bytes)."""
    frame = m.encode_message(msg)
    body_start = len(frame) - int.from_bytes(frame[2:4], "big")
    return list(read_kvps(frame, body_start, len(frame)))


CAPRID_TYPES = [
    t
    for t in MESSAGE_STRATEGIES
    if t is not m.SubscribeTracks  # caprid: no SUBSCRIBE_TRACKS codec
]


@st.composite
def caprid_messages(draw: st.DrawFn) -> Any:
    cls = draw(st.sampled_from(CAPRID_TYPES))
    return draw(MESSAGE_STRATEGIES[cls])


# --- the two directions -------------------------------------------------------


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(caprid_messages())
def test_kvcs_encodes_caprid_decodes(msg: Any) -> None:
    frame = m.encode_message(msg)
    decoded = cp.decode_control(frame)
    assert decoded == to_caprid(msg)
    assert cp.encode_control(decoded) == frame


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(caprid_messages())
def test_caprid_encodes_kvcs_decodes(msg: Any) -> None:
    frame = cp.encode_control(to_caprid(msg))
    assert m.decode_message(frame) == (msg, len(frame))
    assert m.encode_message(msg) == frame


def test_every_caprid_message_type_is_covered() -> None:
    kinds = {cls.TYPE for cls in CAPRID_TYPES}
    assert kinds == set(MessageType) - {MessageType.SUBSCRIBE_TRACKS}


# --- data streams ---------------------------------------------------------------


_STATUS_NAME = {
    ObjectStatus.NORMAL: "normal",
    ObjectStatus.END_OF_GROUP: "end-of-group",
    ObjectStatus.END_OF_TRACK: "end-of-track",
}
_RANGE_NAME = {
    EndOfRange.NON_EXISTENT: "non-existent",
    EndOfRange.UNKNOWN: "unknown",
    EndOfRange.TIMED_OUT: "timed-out",
}


def _expected_subgroup_objects(items: list[Any]) -> list[Any]:
    header: SubgroupHeader = items[0]
    objects: list[SubgroupObject] = items[1:]
    if header.subgroup_id_mode is SubgroupIdMode.FIRST_OBJECT_ID:
        subgroup = objects[0].object_id if objects else None
    else:
        subgroup = header.subgroup_id
    return [
        cp.obs.MoqtObject(
            group_id=header.group_id,
            object_id=o.object_id,
            subgroup_id=subgroup,
            priority=header.publisher_priority,
            status=_STATUS_NAME[o.status],
            properties=_kvps(o.properties or ()),
            payload=bytes(o.payload),
        )
        for o in objects
    ]


@settings(max_examples=300, deadline=None)
@given(subgroup_streams(), st.sampled_from([0, 1, 7]))
def test_subgroup_stream_kvcs_to_caprid(stream: tuple[list[Any], bytes], chunk: int) -> None:
    items, data = stream
    header, objects = cp.read_subgroup_stream(data, chunk)
    h: SubgroupHeader = items[0]
    assert header.type == h.type_flags
    assert (header.track_alias, header.group_id, header.priority) == (
        h.track_alias,
        h.group_id,
        h.publisher_priority,
    )
    assert (header.has_properties, header.end_of_group, header.first_object) == (
        h.has_properties,
        h.end_of_group,
        h.first_object,
    )
    assert objects == _expected_subgroup_objects(items)


@st.composite
def caprid_subgroups(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[int, bytes, Any, str]]]:
    has_props = draw(st.booleans())
    header = {
        "track_alias": draw(st.integers(0, MAX_VI64)),
        "group_id": draw(st.integers(0, MAX_VI64)),
        "priority": draw(st.none() | st.integers(0, 255)),
        "has_properties": has_props,
        "end_of_group": draw(st.booleans()),
    }
    objects = []
    oid = draw(st.integers(0, 1 << 40))
    for i in range(draw(st.integers(0, 6))):
        oid += draw(st.integers(1, 1000)) if i else 0
        last = draw(st.integers(0, 3)) == 0
        status = draw(st.sampled_from(["end-of-group", "end-of-track"])) if last else "normal"
        payload = draw(st.binary(min_size=1, max_size=30)) if status == "normal" else b""
        props = None
        if has_props and status == "normal":
            props = [
                cm.KeyValuePair(
                    t, draw(st.integers(0, 1000)) if t % 2 == 0 else draw(st.binary(max_size=5))
                )
                for t in sorted(draw(st.lists(st.integers(0, 300), max_size=3)))
            ]
        objects.append((oid, payload, props, status))
        if last:
            break
    return header, objects


@settings(max_examples=300, deadline=None)
@given(caprid_subgroups())
def test_subgroup_stream_caprid_to_kvcs(case: tuple[dict[str, Any], list[Any]]) -> None:
    header, objects = case
    data = cp.encode_subgroup_stream(
        header["track_alias"],
        header["group_id"],
        header["priority"],
        objects,
        has_properties=header["has_properties"],
        end_of_group=header["end_of_group"],
    )
    dec = SubgroupStreamDecoder()
    items = dec.feed(data)
    dec.close()
    h = items[0]
    assert isinstance(h, SubgroupHeader)
    assert (h.track_alias, h.group_id, h.publisher_priority, h.subgroup_id) == (
        header["track_alias"],
        header["group_id"],
        header["priority"],
        0,
    )
    assert h.first_object and h.subgroup_id_mode is SubgroupIdMode.ZERO
    got = [(o.object_id, bytes(o.payload), o.properties, _STATUS_NAME[o.status]) for o in items[1:]]
    want = [
        (
            oid,
            payload,
            (
                tuple(KeyValuePair(kv.type, kv.value) for kv in props or ())
                if header["has_properties"]
                else None
            ),
            status,
        )
        for oid, payload, props, status in objects
    ]
    assert got == want
    # and our own writer reproduces caprid's bytes
    assert encode_subgroup_stream(h, items[1:]) == data


@settings(max_examples=300, deadline=None)
@given(fetch_streams())
def test_fetch_stream_kvcs_to_caprid(stream: tuple[list[Any], bytes]) -> None:
    items, data = stream
    header: FetchHeader = items[0]
    descending = group_order_for(header.request_id) == GroupOrder.DESCENDING
    request_id, entries = cp.read_fetch_stream(data, descending)
    assert request_id == header.request_id
    want: list[Any] = []
    for it in items[1:]:
        if isinstance(it, EndOfRangeMarker):
            want.append(
                cp.obs.FetchEndOfRange(
                    status=_RANGE_NAME[it.kind],
                    group_id=it.location.group,
                    object_id=it.location.object,
                )
            )
        else:
            assert isinstance(it, FetchObject)
            want.append(
                cp.obs.FetchObject(
                    group_id=it.group_id,
                    object_id=it.object_id,
                    subgroup_id=it.subgroup_id,
                    priority=it.publisher_priority,
                    properties=_kvps(it.properties),
                    payload=bytes(it.payload),
                )
            )
    assert entries == want
    # kvcs agrees with itself on the same bytes through the generic data-stream decoder
    dec = DataStreamDecoder(fetch_group_order=group_order_for)
    assert dec.feed(data) == items
    dec.close()


# --- where the two disagree, the reference decides (MOQT-22-WIRE.md section 11) ------


class TestDisagreements:
    def test_a9_duplicate_parameter_is_a_protocol_violation(self) -> None:
        # X4: SUBSCRIBE with SUBSCRIBER_PRIORITY twice. caprid keeps the last value;
        # the reference (A9) says PV, as aiomoqt does.
        x4 = bytes.fromhex("03000b0001016101740220010002")
        caprid_view = cp.decode_control(x4)
        assert caprid_view.parameters.subscriber_priority == 2
        with pytest.raises(CodecError) as err:
            m.decode_message(x4)
        assert err.value.code.name == "PROTOCOL_VIOLATION"

    def test_a8_expires_in_track_status_ok_is_accepted(self) -> None:
        # X2: REQUEST_OK with EXPIRES and LARGEST_OBJECT. aiomoqt closes on it when it
        # answers TRACK_STATUS; caprid accepts; A8 says accept (and never send it).
        x2 = bytes.fromhex("0700080208c07530010703")
        assert cp.decode_control(x2).parameters.expires == 30000
        msg, used = m.decode_message(x2)
        assert used == len(x2)
        m.check_request_ok(msg, MessageType.TRACK_STATUS)  # no error

    def test_a11_redirect_without_structure_is_a_protocol_violation(self) -> None:
        # X3: REQUEST_ERROR code REDIRECT with no Redirect. caprid closes (truncated);
        # aiomoqt accepts; A11 says PV. kvcs agrees with caprid here.
        x3 = bytes.fromhex("05000434000178")
        with pytest.raises(cp.CapridError):
            cp.decode_control(x3)
        with pytest.raises(CodecError) as err:
            m.decode_message(x3)
        assert err.value.code.name == "PROTOCOL_VIOLATION"

    def test_a3_ten_fill_parameters_decode(self) -> None:
        # X1: FILL_PARAMETERS holding ten OBJECTID_FILTERs. aiomoqt 0.13 fails on a count
        # >= 10; caprid accepts; A3 says decode strictly by Length + count.
        x1 = bytes.fromhex(
            "03003c0001016101740123330a260300000100030100010003020001000303000100030400010003"
            "0500010003060001000307000100030800010003090001"
        )
        assert len(cp.decode_control(x1).parameters.fill_parameters.range_filters) == 10
        msg, used = m.decode_message(x1)
        assert used == len(x1)
        assert isinstance(msg, m.Subscribe)
        fill = msg.params.get(p.FillParameters)
        assert fill is not None and len(fill.params) == 10
        assert m.encode_message(msg) == x1

    def test_fetch_first_object_without_ids_both_refuse(self) -> None:
        # d21 11.4.1.1: the first fetch object must carry Group and Object IDs.
        bad = bytes.fromhex("050010800161")  # flags 0x10: priority only
        with pytest.raises(cp.CapridError):
            cp.read_fetch_stream(bad)
        dec = DataStreamDecoder(fetch_group_order=lambda _rid: GroupOrder.ASCENDING)
        with pytest.raises(CodecError):
            dec.feed(bad)
            dec.close()
