"""Message Parameters: annotated bytes of MOQT-22-WIRE.md, round trips, and every PV rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_control import PARAM_STRATEGIES, invalid_range_filters, parameters

from kvcs_core.wire.codes import (
    MAX_VI64,
    GroupOrder,
    LocationFilterType,
    MessageType,
    ParameterType,
    SessionErrorCode,
    TokenAliasType,
)
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.filters import (
    RANGE_FILTER_TYPES,
    InvalidRangeFilter,
    LocationFilter,
    RangeFilter,
    RangeFilterRemove,
    invalid_filter_reason,
)
from kvcs_core.wire.names import Location, TrackNamespace
from kvcs_core.wire.params import (
    ALL_PARAMS,
    FETCH_PARAMS,
    FILL_INNER_PARAMS,
    PARAMETER_CLASSES,
    PUBLISH_PARAMS,
    REQUEST_OK_ANY_PARAMS,
    REQUEST_OK_PARAMS_BY_REQUEST,
    REQUEST_OK_TRACK_STATUS_PARAMS,
    REQUEST_OK_TRACK_STATUS_SEND_PARAMS,
    REQUEST_UPDATE_ANY_PARAMS,
    RU_PARAMS_BY_REQUEST,
    RU_SUBSCRIPTION_PARAMS,
    SUBSCRIBE_OK_PARAMS,
    SUBSCRIBE_PARAMS,
    SUBSCRIBE_TRACKS_PARAMS,
    AuthorizationToken,
    Expires,
    FillParameters,
    FillTimeout,
    Forward,
    GroupOrderParam,
    IncludeProperties,
    LargestObject,
    NewGroupRequest,
    Parameters,
    SubgroupDeliveryTimeout,
    SubscriberPriority,
    TrackNamespacePrefix,
    check_scope,
    decode_parameters,
    decode_token,
    encode_token,
    parameters_bytes,
    read_parameters,
)

PV = SessionErrorCode.PROTOCOL_VIOLATION
KVFE = SessionErrorCode.KEY_VALUE_FORMATTING_ERROR
P = ParameterType
NS3 = TrackNamespace.of(
    "kvcs-1",
    bytes.fromhex("d524ec9bd7e643ad062dfe4b68442e3d"),
    bytes.fromhex("ff12d188e0e5f77bd314b567eca7e6db"),
)


def h(text: str) -> bytes:
    """Hex with spaces."""
    return bytes.fromhex(text.replace(" ", ""))


def one(param_bytes: bytes) -> bytes:
    """A block holding one parameter: count 1 + the parameter bytes."""
    return b"\x01" + param_bytes


def pv(data: bytes, allowed: frozenset[int] = ALL_PARAMS) -> CodecError:
    with pytest.raises(CodecError) as exc:
        decode_parameters(data, allowed=allowed)
    return exc.value


# --- annotated bytes of sections 2.4, 5.3-5.6 and 12 ------------------------------------

ANNOTATED: list[tuple[str, Parameters]] = [
    ("21 05", Parameters.of(LocationFilter.next_object())),
    ("21 02 00 00", Parameters.of(LocationFilter.absolute_start(0, 0))),
    ("21 03 02 00 03", Parameters.of(LocationFilter.absolute_group_end(2, 0, 5))),
    ("21 00", Parameters.of(LocationFilter.none())),
    ("21 01 01", Parameters.of(LocationFilter.relative_start(1))),
    ("20 c8", Parameters.of(SubscriberPriority(200))),
    ("09 07 03", Parameters.of(LargestObject(Location(7, 3)))),
    ("35 00", Parameters.of(IncludeProperties(0))),
    (
        "23 05 01 21 02 00 00",
        Parameters.of(FillParameters(Parameters.of(LocationFilter.absolute_start(0, 0)))),
    ),
    (
        "23 06 02 21 01 01 01 02",
        Parameters.of(
            FillParameters(
                Parameters.of(
                    LocationFilter.relative_start(1), GroupOrderParam(GroupOrder.DESCENDING)
                )
            )
        ),
    ),
    ("23 01 00", Parameters.of(FillParameters(Parameters()))),
    ("26 03 00 00 03", Parameters.of(RangeFilter(P.OBJECTID_FILTER, 0, None, [(0, 3)]))),
    ("03 0b 03 00 7075622d746f6b656e", Parameters.of(AuthorizationToken.use_value(0, "pub-token"))),
    (
        "34 03 06 6b7663732d31 10 d524ec9bd7e643ad062dfe4b68442e3d"
        " 10 ff12d188e0e5f77bd314b567eca7e6db",
        Parameters.of(TrackNamespacePrefix(NS3)),
    ),
    ("06 87d0", Parameters.of(SubgroupDeliveryTimeout(2000))),
    ("08 c07530", Parameters.of(Expires(30000))),
    ("10 00", Parameters.of(Forward(0))),
]


@pytest.mark.parametrize(("hex_", "expected"), ANNOTATED, ids=[a for a, _ in ANNOTATED])
def test_annotated_single_parameter(hex_: str, expected: Parameters) -> None:
    data = one(h(hex_))
    assert parameters_bytes(expected) == data
    assert read_parameters(data, 0, allowed=ALL_PARAMS, context="t") == (expected, len(data))


@pytest.mark.parametrize(
    ("hex_", "expected"),
    [
        # fetch_absolute_group_end_objectid_filter: 0x21, delta 1 -> 0x22, delta 4 -> 0x26
        (
            "03 21 03 02 00 03 01 01 04 03 00 00 03",
            Parameters.of(
                LocationFilter.absolute_group_end(2, 0, 5),
                GroupOrderParam(GroupOrder.ASCENDING),
                RangeFilter(P.OBJECTID_FILTER, 0, None, [(0, 3)]),
            ),
        ),
        # request_update_forward1_fill_current_group
        (
            "03 10 01 10 c8 03 06 02 21 01 01 01 02",
            Parameters.of(
                Forward(1),
                SubscriberPriority(200),
                FillParameters(
                    Parameters.of(
                        LocationFilter.relative_start(1), GroupOrderParam(GroupOrder.DESCENDING)
                    )
                ),
            ),
        ),
        # publish_forward0_with_subscription_params
        (
            "04 06 87d0 03 29 07 07 00 12 01",
            Parameters.of(
                SubgroupDeliveryTimeout(2000),
                LargestObject(Location(41, 7)),
                Forward(0),
                GroupOrderParam(GroupOrder.ASCENDING),
            ),
        ),
    ],
)
def test_annotated_blocks(hex_: str, expected: Parameters) -> None:
    data = h(hex_)
    assert parameters_bytes(expected) == data
    assert decode_parameters(data, allowed=ALL_PARAMS) == expected


def test_range_delta_example() -> None:
    # Section 5.5: ranges 3-5 and 10-15 -> 03 02 05 05 (after SetID and Property Type).
    f = RangeFilter(P.OBJECT_PROPERTY_FILTER, 7, 0x3C, [(3, 5), (10, 15)])
    assert f.value_bytes() == h("07 3c 03 02 05 05")
    open_end = RangeFilter(P.SUBGROUP_FILTER, 0, None, [(3, 5), (10, None)])
    assert open_end.value_bytes() == h("00 03 02 05")
    assert decode_parameters(one(h("25 04 00 03 02 05")), allowed=ALL_PARAMS) == Parameters.of(
        open_end
    )


def test_setup_token_bytes() -> None:
    tok = decode_token(h("03 00 7372762d746f6b656e"))
    assert tok == AuthorizationToken.use_value(0, b"srv-token")
    assert encode_token(tok) == h("03 00 7372762d746f6b656e")
    reg = AuthorizationToken.register(5, 1, b"xy")
    assert encode_token(reg) == h("01 05 01 7879")
    assert decode_token(h("01 05 01 7879")) == reg
    assert decode_token(h("00 05")) == AuthorizationToken.delete(5)
    assert decode_token(h("02 05")) == AuthorizationToken.use_alias(5)
    assert decode_token(h("03 00")) == AuthorizationToken(TokenAliasType.USE_VALUE, None, 0, b"")


# --- round trips ----------------------------------------------------------------------


def _all_prefixes_incomplete(data: bytes) -> None:
    for n in range(len(data)):
        with pytest.raises(Incomplete):
            read_parameters(data[:n], 0, allowed=ALL_PARAMS, context="t")


@pytest.mark.parametrize("cls", PARAMETER_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_parameter_class_round_trip(cls: type, data: st.DataObject) -> None:
    p = data.draw(PARAM_STRATEGIES[cls])
    assert type(p) is cls
    block = Parameters.of(p)
    enc = parameters_bytes(block)
    assert read_parameters(enc, 0, allowed=ALL_PARAMS, context="t") == (block, len(enc))
    # decoding from a memoryview gives the same, owned result
    assert decode_parameters(memoryview(enc), allowed=ALL_PARAMS) == block
    _all_prefixes_incomplete(enc)


@pytest.mark.parametrize(
    "scope",
    [SUBSCRIBE_PARAMS, PUBLISH_PARAMS, FETCH_PARAMS, FILL_INNER_PARAMS, REQUEST_UPDATE_ANY_PARAMS],
    ids=["subscribe", "publish", "fetch", "fill", "ru"],
)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_parameter_block_round_trip(scope: frozenset[int], data: st.DataObject) -> None:
    block = data.draw(parameters(scope))
    enc = parameters_bytes(block)
    assert decode_parameters(enc, allowed=scope) == block
    assert block.types() <= scope
    check_scope(block, scope, "t")


@settings(max_examples=100, deadline=None)
@given(p=st.sampled_from(sorted(RANGE_FILTER_TYPES)).flatmap(invalid_range_filters))
def test_invalid_range_filter_reencodes_raw(p: InvalidRangeFilter) -> None:
    enc = parameters_bytes(Parameters.of(p))
    (back,) = decode_parameters(enc, allowed=ALL_PARAMS)
    assert isinstance(back, InvalidRangeFilter)
    assert back.raw == p.raw and back.kind == p.kind and back.reason
    assert invalid_filter_reason([back]) is not None


# --- Parameters helpers ------------------------------------------------------------------


def test_parameters_helpers() -> None:
    f1 = RangeFilter(P.OBJECTID_FILTER, 1, None, [(0, 1)])
    f0 = RangeFilter(P.OBJECTID_FILTER, 0, None, [(0, 1)])
    block = Parameters.of(f1, Forward(1), f0, SubscriberPriority(3))
    # sorted stably by type: Forward 0x10, priority 0x20, then the two 0x26 in given order
    assert [p.type for p in block] == [P.FORWARD, P.SUBSCRIBER_PRIORITY, 0x26, 0x26]
    assert block.all(RangeFilter) == (f1, f0)
    assert block.get(Forward) == Forward(1)
    assert block.get(Expires) is None
    assert block.of_type(0x26) == (f1, f0)
    assert block.types() == {P.FORWARD, P.SUBSCRIBER_PRIORITY, P.OBJECTID_FILTER}
    assert len(block) == 4
    assert Parameters.of(Forward(1), SubscriberPriority(3)) == Parameters.of(
        SubscriberPriority(3), Forward(1)
    )
    assert invalid_filter_reason(block) is None
    assert invalid_filter_reason(Parameters.of(f0, f0)) is not None
    with pytest.raises(EncodeError):
        Parameters.of(Forward(1), Forward(0))
    Parameters.of(AuthorizationToken.use_alias(1), AuthorizationToken.use_alias(2))


def test_value_constructors_refuse_bad_values() -> None:
    for bad in (
        lambda: Forward(2),
        lambda: IncludeProperties(2),
        lambda: SubscriberPriority(256),
        lambda: GroupOrderParam(3),
        lambda: Expires(-1),
        lambda: NewGroupRequest(MAX_VI64 + 1),
        lambda: LocationFilter(LocationFilterType.ABSOLUTE_START, 1),
        lambda: LocationFilter(LocationFilterType.NONE, 1),
        lambda: LocationFilter(7),
        lambda: LocationFilter(LocationFilterType.ABSOLUTE_GROUP_END, MAX_VI64, 0, 1),
        lambda: LocationFilter.absolute_group_end(5, 0, 4),
        lambda: RangeFilter(P.OBJECT_PROPERTY_FILTER, 0, 3, []),
        lambda: RangeFilter(P.OBJECT_PROPERTY_FILTER, 0, None, []),
        lambda: RangeFilter(P.OBJECTID_FILTER, 0, 2, []),
        lambda: RangeFilter(P.OBJECTID_FILTER, 256, None, []),
        lambda: RangeFilter(P.OBJECTID_FILTER, 0, None, [(0, None), (5, 6)]),
        lambda: RangeFilter(P.OBJECTID_FILTER, 0, None, [(5, 4)]),
        lambda: RangeFilter(P.OBJECTID_FILTER, 0, None, [(0, 5), (4, 6)]),
        lambda: RangeFilter(P.PRIORITY_FILTER, 0, None, [(0, 256)]),
        lambda: RangeFilter(P.FORWARD, 0, None, []),
        lambda: InvalidRangeFilter(P.OBJECTID_FILTER, b""),
        lambda: InvalidRangeFilter(P.OBJECTID_FILTER, b"\x00\x01\x02"),  # valid: {1..3}
        lambda: AuthorizationToken(TokenAliasType.USE_ALIAS),
        lambda: AuthorizationToken(TokenAliasType.DELETE, 1, 0, b""),
        lambda: AuthorizationToken(9),
        lambda: FillParameters(Parameters.of(Forward(1))),
    ):
        with pytest.raises(EncodeError):
            bad()


def test_location_filter_properties() -> None:
    f = LocationFilter.absolute_range(2, 1, 5, 9)
    assert f.end_group == 5 and f.end_group_delta == 3
    assert f.start == Location(2, 1) and f.end == Location(5, 9)
    assert LocationFilter.next_object().start is None
    assert LocationFilter.relative_start(3).end_group is None


# --- scopes (section 5.1) -----------------------------------------------------------------


def test_scope_tables() -> None:
    assert {
        0x02, 0x03, 0x04, 0x06, 0x10, 0x20, 0x21, 0x22, 0x23, 0x25, 0x26, 0x27, 0x28, 0x32, 0x35
    } == SUBSCRIBE_PARAMS  # fmt: skip
    assert {0x08, 0x09} == SUBSCRIBE_OK_PARAMS
    assert {0x02, 0x03, 0x06, 0x08, 0x09, 0x10, 0x20, 0x21, 0x22} == PUBLISH_PARAMS
    assert {0x03, 0x0A, 0x20, 0x21, 0x22, 0x25, 0x26, 0x27, 0x28, 0x35} == FETCH_PARAMS
    assert SUBSCRIBE_PARAMS | {0x29} == SUBSCRIBE_TRACKS_PARAMS  # A10
    assert {
        0x02, 0x03, 0x06, 0x10, 0x20, 0x21, 0x23, 0x25, 0x26, 0x27, 0x28, 0x32
    } == RU_SUBSCRIPTION_PARAMS  # fmt: skip
    assert {0x0A, 0x20, 0x21, 0x22, 0x25, 0x26, 0x27, 0x28} == FILL_INNER_PARAMS
    assert {0x08, 0x09} == REQUEST_OK_TRACK_STATUS_PARAMS  # A8: accepted on receive
    assert {0x09} == REQUEST_OK_TRACK_STATUS_SEND_PARAMS  # A8: never sent
    assert {0x08, 0x09} == REQUEST_OK_ANY_PARAMS
    assert frozenset().union(*RU_PARAMS_BY_REQUEST.values()) <= REQUEST_UPDATE_ANY_PARAMS
    assert frozenset().union(*REQUEST_OK_PARAMS_BY_REQUEST.values()) == REQUEST_OK_ANY_PARAMS
    assert MessageType.TRACK_STATUS not in RU_PARAMS_BY_REQUEST


# --- negative: every PV / KVFE rule -----------------------------------------------------


@pytest.mark.parametrize("t", [0x01, 0x05, 0x07, 0x0B, 0x11, 0x24, 0x2A, 0x33, 0x36, 0x9D])
def test_unknown_parameter_type_is_pv(t: int) -> None:
    assert pv(one(bytes([t]) + b"\x00\x00\x00")).code == PV


def test_parameter_not_in_scope_is_pv() -> None:
    assert pv(one(h("10 01")), allowed=SUBSCRIBE_OK_PARAMS).code == PV


def test_parameter_type_overflow_is_pv() -> None:
    data = h("02 21 05") + b"\xff" + MAX_VI64.to_bytes(8, "big") + b"\x00"
    assert pv(data).code == PV


def test_duplicate_parameter_is_pv() -> None:
    # Ambiguity A9: SUBSCRIBER_PRIORITY twice -> PV.
    assert pv(h("02 20 01 00 02")).code == PV


def test_repeatable_parameters_may_repeat() -> None:
    tok = h("03 02 02 07")
    block = decode_parameters(h("02") + tok + h("00 02 02 08"), allowed=ALL_PARAMS)
    assert block.all(AuthorizationToken) == (
        AuthorizationToken.use_alias(7),
        AuthorizationToken.use_alias(8),
    )
    filters = decode_parameters(h("02 26 03 00 00 01 00 03 01 00 01"), allowed=ALL_PARAMS)
    assert len(filters.all(RangeFilter)) == 2


@pytest.mark.parametrize("data", ["10 02", "10 ff", "35 02", "22 00", "22 03"])
def test_uint8_out_of_range_is_pv(data: str) -> None:
    assert pv(one(h(data))).code == PV


def test_location_filter_errors() -> None:
    assert pv(one(h("21 06"))).code == PV  # A2 (a): unknown Location Filter Type
    egd_overflow = h("21 03") + b"\xff" + MAX_VI64.to_bytes(8, "big") + h("00 01")
    assert pv(one(egd_overflow)).code == PV  # A2 (f)


def test_fill_parameters_errors() -> None:
    assert pv(one(h("23 03 01 02 05"))).code == PV  # OBJECT_DELIVERY_TIMEOUT inside
    assert pv(one(h("23 04 01 23 01 00"))).code == PV  # FILL inside FILL
    assert pv(one(h("23 05 01 21 01 01 00"))).code == PV  # ends before its Length
    assert pv(one(h("23 03 01 21 02 00 00"))).code == PV  # runs past its Length
    assert pv(one(h("23 00"))).code == PV  # no count at all (A3: strict)
    assert pv(one(h("23 03 01 20 05 05"))).code == PV  # 1 param but 2 bytes left
    assert pv(one(h("23 03 02 20 05 00 20 06"))).code == PV  # inner duplicate


def test_fill_parameters_ten_inner_x1() -> None:
    # A3 / X1 count case: ten inner OBJECTID_FILTERs (count 0x0a) decode fine.
    inner = h("26 03 00 00 01") + b"".join(h(f"00 03 {i:02x} 00 01") for i in range(1, 10))
    data = one(h("23 33 0a") + inner)
    (fill,) = decode_parameters(data, allowed=ALL_PARAMS)
    assert isinstance(fill, FillParameters)
    assert [f.set_id for f in fill.params.all(RangeFilter)] == list(range(10))
    assert parameters_bytes(Parameters.of(fill)) == data


def test_token_errors_are_kvfe() -> None:
    for bad in ("04 00", "01 05", "01", "", "00 05 00", "02 05 01", "00 80"):
        with pytest.raises(CodecError) as exc:
            decode_token(h(bad))
        assert exc.value.code == KVFE, bad
    # ... and inside a parameter block too
    assert pv(one(h("03 02 04 00"))).code == KVFE


def test_range_filter_problems_are_not_session_errors() -> None:
    cases = {
        "28 02 00 03": "odd Property Type",  # odd property type
        "28 01 00": "inside a field",  # missing property type
        "26 02 00 80": "inside a field",  # truncated Start
        "27 03 00 81 00": "above 255",  # priority 256
        "25 0b 00 01" + " ff" * 9: "overflows",  # End delta overflow
    }
    for data, why in cases.items():
        (p,) = decode_parameters(one(h(data)), allowed=ALL_PARAMS)
        assert isinstance(p, InvalidRangeFilter), data
        assert why in p.reason
        assert parameters_bytes(Parameters.of(p)) == one(h(data))
    (rm,) = decode_parameters(one(h("29 00")), allowed=ALL_PARAMS)
    assert rm == RangeFilterRemove(P.TRACK_PROPERTY_FILTER)
    assert pv(one(h("26 05 00 00"))).code == PV  # Length past the block: framing error


def test_decode_parameters_bounds() -> None:
    assert pv(h("01")).code == PV  # truncated
    assert pv(h("00 00")).code == PV  # trailing byte
    assert decode_parameters(h("00"), allowed=frozenset()) == Parameters()
    with pytest.raises(Incomplete):
        read_parameters(h("05 10 01"), 0, allowed=ALL_PARAMS, context="t")


def test_check_scope() -> None:
    block = Parameters.of(Expires(1), FillTimeout(2))
    check_scope(block, ALL_PARAMS, "t")
    with pytest.raises(CodecError) as exc:
        check_scope(block, REQUEST_OK_ANY_PARAMS, "REQUEST_OK")
    assert exc.value.code == PV
