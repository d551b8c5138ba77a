"""Control messages: the shared vectors, section 11's X1-X4, round trips and every PV rule."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from _vectors import load_vectors, vectors_of_kind
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_control import MESSAGE_STRATEGIES, control_messages

from kvcs_core.wire.codes import (
    GroupOrder,
    MessageType,
    ParameterType,
    PublishDoneCode,
    RequestErrorCode,
    SessionErrorCode,
)
from kvcs_core.wire.errors import NEED_MORE, CodecError, EncodeError
from kvcs_core.wire.filters import LocationFilter, RangeFilter
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.messages import (
    MESSAGE_CLASSES,
    ControlStreamDecoder,
    Fetch,
    FetchOk,
    Goaway,
    Namespace,
    Publish,
    PublishDone,
    PublishNamespace,
    Redirect,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    check_request_ok,
    check_request_update,
    decode_message,
    encode_message,
)
from kvcs_core.wire.names import Location, TrackNamespace
from kvcs_core.wire.params import (
    AuthorizationToken,
    Expires,
    FillParameters,
    Forward,
    GroupOrderParam,
    LargestObject,
    Parameters,
    SubgroupDeliveryTimeout,
    SubscriberPriority,
    TrackNamespacePrefix,
)

PV = SessionErrorCode.PROTOCOL_VIOLATION
KVFE = SessionErrorCode.KEY_VALUE_FORMATTING_ERROR


def h(text: str) -> bytes:
    """Hex with spaces."""
    return bytes.fromhex(text.replace(" ", ""))


def codec_error(data: bytes) -> CodecError:
    with pytest.raises(CodecError) as exc:
        decode_message(data)
    return exc.value


def frame(type_hex: str, body: bytes) -> bytes:
    return h(type_hex) + len(body).to_bytes(2, "big") + body


# --- building messages from the vector "fields" (typed construction) ----------------------

_VECTORS = load_vectors()
_NS_INFO = _VECTORS["namespace"]
_BINARY_NS_FIELDS = {
    f
    for f, how in zip(_NS_INFO["fields"], _NS_INFO["derivation"], strict=True)
    if not how.startswith("b'")
}


def _code(v: Any) -> int:
    """``"Ascending(0x1)"`` -> 1; ints unchanged."""
    if isinstance(v, int):
        return v
    m = re.search(r"\((0x[0-9a-fA-F]+)\)", v)
    assert m, v
    return int(m.group(1), 16)


def _ns(fields: list[str]) -> TrackNamespace:
    return TrackNamespace(
        tuple(bytes.fromhex(f) if f in _BINARY_NS_FIELDS else f.encode() for f in fields)
    )


def _token(v: dict[str, Any]) -> AuthorizationToken:
    return AuthorizationToken(
        _code(v["alias_type"]), v.get("alias"), v.get("token_type"), v["token_value"].encode()
    )


def _param(p: dict[str, Any]) -> Any:
    name, v = p["name"], p["value"]
    simple = {
        "EXPIRES": Expires,
        "FORWARD": Forward,
        "SUBSCRIBER_PRIORITY": SubscriberPriority,
        "SUBGROUP_DELIVERY_TIMEOUT": SubgroupDeliveryTimeout,
    }
    if name in simple:
        return simple[name](v)
    if name == "GROUP_ORDER":
        return GroupOrderParam(GroupOrder(_code(v)))
    if name == "LARGEST_OBJECT":
        return LargestObject(Location(v["group"], v["object"]))
    if name == "LOCATION_FILTER":
        f = LocationFilter(
            _code(v["filter_type"]),
            v.get("start_group"),
            v.get("start_object"),
            v.get("end_group_delta"),
            v.get("end_object"),
        )
        assert f.end_group == v.get("end_group")
        return f
    if name == "FILL_PARAMETERS":
        return FillParameters(Parameters(_param(q) for q in v))
    if name == "AUTHORIZATION_TOKEN":
        return _token(v)
    if name == "TRACK_NAMESPACE_PREFIX":
        return TrackNamespacePrefix(_ns(v))
    if name.endswith("_FILTER"):
        return RangeFilter(
            int(p["type"], 16),
            v["set_id"],
            v.get("property_type"),
            [tuple(r) for r in v["ranges"]],
        )
    raise AssertionError(f"no builder for parameter {name}")


def _params(f: dict[str, Any]) -> Parameters:
    return Parameters(_param(p) for p in f.get("parameters", []))


def _props(f: dict[str, Any]) -> tuple[KeyValuePair, ...]:
    return tuple(KeyValuePair(int(p["type"], 16), p["value"]) for p in f["track_properties"])


def _setup(f: dict[str, Any]) -> Setup:
    kw: dict[str, Any] = {}
    tokens, extras = [], []
    for o in f["options"]:
        name = o["name"]
        if name == "AUTHORIZATION_TOKEN":
            tokens.append(_token(o["value"]))
        elif name == "GREASE":
            extras.append(KeyValuePair(int(o["type"], 16), bytes.fromhex(o["value_hex"])))
        else:
            kw[name.lower()] = o["value"]
    return Setup(**kw, authorization_tokens=tokens, extra_options=extras)


def build(f: dict[str, Any]) -> Any:
    """The typed message described by a vector's ``fields``."""
    m = f["message"]
    if m == "SETUP":
        return _setup(f)
    if m in ("SUBSCRIBE", "FETCH"):
        cls = Subscribe if m == "SUBSCRIBE" else Fetch
        return cls(f["request_id"], _ns(f["track_namespace"]), f["track_name"], _params(f))
    if m == "SUBSCRIBE_OK":
        return SubscribeOk(f["track_alias"], _params(f), _props(f))
    if m == "REQUEST_OK":
        return RequestOk(_params(f), _props(f))
    if m == "REQUEST_ERROR":
        return RequestError(_code(f["error_code"]), f["retry_interval"], f["reason"])
    if m == "PUBLISH_NAMESPACE":
        return PublishNamespace(f["request_id"], _ns(f["track_namespace"]), _params(f))
    if m == "SUBSCRIBE_NAMESPACE":
        return SubscribeNamespace(f["request_id"], _ns(f["track_namespace_prefix"]), _params(f))
    if m == "NAMESPACE":
        return Namespace(_ns(f["track_namespace_suffix"]))
    if m == "PUBLISH_DONE":
        return PublishDone(_code(f["status_code"]), f["stream_count"], f["reason"])
    if m == "REQUEST_UPDATE":
        return RequestUpdate(f["request_id"], _params(f))
    if m == "GOAWAY":
        return Goaway(f["new_session_uri"], f["timeout_ms"])
    if m == "PUBLISH":
        return Publish(
            f["request_id"],
            _ns(f["track_namespace"]),
            f["track_name"],
            f["track_alias"],
            _params(f),
            _props(f),
        )
    raise AssertionError(f"no builder for message {m}")


CONTROL_VECTORS = vectors_of_kind("control")


def test_vector_file_has_the_control_vectors() -> None:
    assert len(CONTROL_VECTORS) == 17
    assert {v["fields"]["message"] for v in CONTROL_VECTORS} >= {"SETUP", "SUBSCRIBE", "PUBLISH"}


@pytest.mark.parametrize("vec", CONTROL_VECTORS, ids=[v["name"] for v in CONTROL_VECTORS])
def test_control_vector(vec: dict[str, Any]) -> None:
    wire = bytes.fromhex(vec["hex"])
    assert len(wire) == vec["length"]
    msg = build(vec["fields"])
    assert int(vec["fields"]["type"], 16) == msg.TYPE
    assert encode_message(msg) == wire
    assert decode_message(wire) == (msg, vec["length"])
    for n in range(len(wire)):
        assert decode_message(wire[:n]) is NEED_MORE


def test_vectors_decode_as_one_stream() -> None:
    wire = b"".join(bytes.fromhex(v["hex"]) for v in CONTROL_VECTORS)
    dec = ControlStreamDecoder()
    got = []
    for i in range(0, len(wire), 7):
        got += dec.feed(wire[i : i + 7])
    dec.close()
    assert got == [build(v["fields"]) for v in CONTROL_VECTORS]


def test_vector_decoded_types() -> None:
    by_name = {v["name"]: bytes.fromhex(v["hex"]) for v in CONTROL_VECTORS}
    err = decode_message(by_name["request_error_does_not_exist"])
    assert err is not NEED_MORE
    assert type(err[0].error_code) is RequestErrorCode
    done = decode_message(by_name["publish_done_track_ended"])
    assert done is not NEED_MORE
    assert done[0].status_code is PublishDoneCode.TRACK_ENDED
    setup = decode_message(by_name["setup_server_with_token_and_grease"])
    assert setup is not NEED_MORE
    assert setup[0].extra_options == (KeyValuePair(0x9D, b"\x00\x01"),)


# --- section 11: X1..X4 ------------------------------------------------------------------

X1 = h(
    "03003c0001016101740123330a260300000100030100010003020001000303000100030400010003050001"
    "0003060001000307000100030800010003090001"
)
X2 = h("0700080208c07530010703")
X3 = h("05000434000178")
X4 = h("03000b0001016101740220010002")


def test_x1_fill_parameters_with_ten_inner_parameters() -> None:
    res = decode_message(X1)
    assert res is not NEED_MORE
    msg, used = res
    assert used == len(X1)
    assert isinstance(msg, Subscribe)
    fill = msg.params.get(FillParameters)
    assert fill is not None and len(fill.params) == 10
    assert encode_message(msg) == X1


def test_x2_expires_in_track_status_ok_accepted() -> None:
    res = decode_message(X2)
    assert res is not NEED_MORE
    msg, used = res
    assert used == len(X2)
    assert isinstance(msg, RequestOk)
    assert msg.params == Parameters.of(Expires(30000), LargestObject(Location(7, 3)))
    check_request_ok(msg, MessageType.TRACK_STATUS)  # A8: accepted (and ignored)


def test_x3_redirect_without_redirect_is_pv() -> None:
    assert codec_error(X3).code == PV  # A11


def test_x4_duplicate_parameter_is_pv() -> None:
    assert codec_error(X4).code == PV  # A9


# --- round trips ------------------------------------------------------------------------


def _check_round_trip(msg: Any) -> None:
    wire = encode_message(msg)
    assert msg.to_bytes() == wire
    assert decode_message(wire) == (msg, len(wire))
    for n in range(len(wire)):
        assert decode_message(wire[:n]) is NEED_MORE


@pytest.mark.parametrize("cls", list(MESSAGE_CLASSES.values()), ids=lambda c: c.__name__)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_message_round_trip(cls: type, data: st.DataObject) -> None:
    msg = data.draw(MESSAGE_STRATEGIES[cls])
    assert type(msg) is cls
    _check_round_trip(msg)


@settings(max_examples=150, deadline=None)
@given(
    msgs=st.lists(control_messages(), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 4000), max_size=12),
)
def test_stream_decoder_any_split(msgs: list[Any], cuts: list[int]) -> None:
    wire = b"".join(encode_message(m) for m in msgs)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    dec = ControlStreamDecoder()
    got: list[Any] = []
    for a, b in itertools.pairwise(points):
        got += dec.feed(memoryview(wire)[a:b])
        assert dec.pending_bytes <= 11 + 0xFFFF
    assert got == msgs
    assert dec.pending_bytes == 0
    dec.close()


def test_decoded_messages_own_their_bytes() -> None:
    msg = Publish(
        1,
        TrackNamespace.of("ns"),
        b"name",
        2,
        Parameters.of(AuthorizationToken.use_value(0, b"tok")),
        (KeyValuePair(0x0B, b"imm"),),
    )
    buf = bytearray(encode_message(msg))
    res = decode_message(memoryview(buf))
    assert res is not NEED_MORE
    got = res[0]
    dec = ControlStreamDecoder()
    (streamed,) = dec.feed(buf)
    buf[:] = bytes(len(buf))  # scribble over the caller's buffer
    assert got == msg and streamed == msg
    assert type(got.name) is bytes
    assert type(got.namespace.fields[0]) is bytes


def test_setup_merges_options_in_type_order() -> None:
    s = Setup(
        path="/p",
        max_request_updates=4,
        authorization_tokens=[AuthorizationToken.register(1, 0, b"t")],
        extra_options=[KeyValuePair(0x9D, b""), KeyValuePair(0x02, 7)],
    )
    assert [kv.type for kv in s.options()] == [0x01, 0x02, 0x03, 0x08, 0x9D]
    _check_round_trip(s)


# --- negative: every PV rule -------------------------------------------------------------


@pytest.mark.parametrize("type_hex", ["01", "40 40", "40 41", "20", "21", "1e", "09", "80 01"])
def test_unknown_or_reserved_message_type_is_pv_at_once(type_hex: str) -> None:
    assert codec_error(h(type_hex)).code == PV  # no Length byte needed
    dec = ControlStreamDecoder()
    with pytest.raises(CodecError):
        dec.feed(h(type_hex))


def test_non_minimal_type_is_accepted() -> None:
    res = decode_message(h("80 10 00 02 00 00"))
    assert res == (Goaway(b"", 0), 6)


def test_message_type_split_is_need_more() -> None:
    assert decode_message(h("af")) is NEED_MORE
    assert decode_message(h("af 00 00")) is NEED_MORE


def test_body_longer_than_layout_is_pv() -> None:
    assert codec_error(frame("10", h("00 00 00"))).code == PV  # GOAWAY + junk
    assert codec_error(frame("08", h("00 00"))).code == PV  # NAMESPACE + empty param block
    assert codec_error(frame("0f", h("00 00 00"))).code == PV  # PUBLISH_SKIPPED + junk


def test_body_shorter_than_layout_is_pv() -> None:
    assert codec_error(frame("10", h("00"))).code == PV
    assert codec_error(frame("03", h("00 00"))).code == PV  # SUBSCRIBE without name/params
    assert codec_error(frame("18", h("00 00"))).code == PV  # FETCH_OK w/o object, params


def test_reason_phrase_limit() -> None:
    ok = frame("0b", h("02 03") + h("84 00") + b"x" * 1024)
    assert decode_message(ok) is not NEED_MORE
    assert codec_error(frame("0b", h("02 03") + h("84 01") + b"x" * 1025)).code == PV
    with pytest.raises(EncodeError):
        PublishDone(2, 0, b"x" * 1025)


def test_goaway_uri_limit() -> None:
    assert decode_message(frame("10", h("a0 00") + b"u" * 8192 + h("00"))) is not NEED_MORE
    assert codec_error(frame("10", h("a0 01") + b"u" * 8193 + h("00"))).code == PV
    with pytest.raises(EncodeError):
        Goaway(b"u" * 8193)


def test_fetch_ok_rules() -> None:
    good = frame("18", h("01 05 02 00"))
    assert decode_message(good) == (FetchOk(True, Location(5, 2)), len(good))
    assert codec_error(frame("18", h("02 05 02 00"))).code == PV  # End Of Track 2
    assert codec_error(frame("18", h("00 05 02 01 08 00"))).code == PV  # a parameter


def test_parameter_scope_per_message_is_pv() -> None:
    assert codec_error(frame("04", h("01 01 10 01"))).code == PV  # FORWARD in SUBSCRIBE_OK
    assert codec_error(frame("50", h("00 00 01 20 01"))).code == PV  # priority in SUB_NS
    assert codec_error(frame("07", h("01 10 01"))).code == PV  # FORWARD in REQUEST_OK


def test_setup_rules() -> None:
    dup = frame("af 00", h("06 01 00 01"))  # MAX_FILTER_RANGES twice
    assert codec_error(dup).code == PV
    delete = frame("af 00", h("03 02 00 05"))  # DELETE token in SETUP
    assert codec_error(delete).code == PV
    use_alias = frame("af 00", h("03 02 02 05"))
    assert codec_error(use_alias).code == PV
    bad_token = frame("af 00", h("03 02 07 05"))  # unknown Alias Type
    assert codec_error(bad_token).code == KVFE
    unknown_dup = frame("af 00", h("0a 01 00 02 80 93 00 00 00"))  # 0x0A twice, 0x9D twice
    res = decode_message(unknown_dup)
    assert res is not NEED_MORE
    assert [kv.type for kv in res[0].extra_options] == [0x0A, 0x0A, 0x9D, 0x9D]
    two_tokens = frame("af 00", h("03 02 03 00 00 02 03 01"))
    res = decode_message(two_tokens)
    assert res is not NEED_MORE and len(res[0].authorization_tokens) == 2
    assert codec_error(frame("af 00", h("01 05 00"))).code == PV  # KVP runs past the body


def test_track_properties_run_past_body_is_pv() -> None:
    assert codec_error(frame("04", h("01 00 0b 05 00"))).code == PV


def test_names_rules_are_pv() -> None:
    too_many = h("21") + h("01 61") * 33
    assert codec_error(frame("08", too_many)).code == PV
    assert codec_error(frame("08", h("01 00"))).code == PV  # empty field
    big = h("01 a0 00") + b"n" * 4096 + h("81 00") + b"x" * 256 + h("00")
    assert codec_error(frame("03", h("00") + big)).code == PV  # full name > 4096


def test_redirect_request_error() -> None:
    redirect = Redirect(b"moqt://other", TrackNamespace.of("a"), b"t")
    msg = RequestError(RequestErrorCode.REDIRECT, 1, "moved", redirect)
    _check_round_trip(msg)
    wire = encode_message(msg)
    short = frame("05", wire[3:-1])
    assert codec_error(short).code == PV
    with pytest.raises(EncodeError):
        RequestError(RequestErrorCode.REDIRECT)
    with pytest.raises(EncodeError):
        RequestError(RequestErrorCode.TIMEOUT, redirect=redirect)
    unknown = decode_message(frame("05", h("80 99 00 00")))
    assert unknown is not NEED_MORE
    code = unknown[0].error_code
    assert code == 0x99
    assert not isinstance(code, RequestErrorCode)


def test_constructors_refuse_out_of_scope_parameters() -> None:
    with pytest.raises(EncodeError):
        Subscribe(0, TrackNamespace.of("a"), b"t", Parameters.of(Expires(1)))
    with pytest.raises(EncodeError):
        FetchOk(False, Location(0, 0), Parameters.of(Expires(1)))
    with pytest.raises(EncodeError):
        Setup(authorization_tokens=[AuthorizationToken.delete(1)])
    with pytest.raises(EncodeError):
        Setup(extra_options=[KeyValuePair(0x06, 1)])
    with pytest.raises(EncodeError):
        FetchOk(1, Location(0, 0))  # type: ignore[arg-type]


def test_encode_body_limit() -> None:
    big = SubscribeOk(1, Parameters(), (KeyValuePair(0x0B, b"x" * 65535),))
    with pytest.raises(EncodeError):
        encode_message(big)


def test_stream_decoder_close_and_limits() -> None:
    dec = ControlStreamDecoder()
    assert dec.feed(h("10 00 02 00")) == []
    assert dec.pending_bytes == 4
    with pytest.raises(CodecError) as exc:
        dec.close()  # FIN mid-message
    assert exc.value.code == PV
    small = ControlStreamDecoder(max_message_size=16)
    with pytest.raises(CodecError):
        small.feed(h("10 00 11"))  # Length 17 > local limit, before the body arrives
    with pytest.raises(CodecError):
        small.feed(b"")  # dead after an error
    dead = ControlStreamDecoder()
    with pytest.raises(CodecError):
        dead.feed(X3)
    with pytest.raises(CodecError):
        dead.close()


def test_check_request_ok_and_update() -> None:
    ok_props = RequestOk(Parameters(), (KeyValuePair(0x0E, 1),))
    for answers in (MessageType.PUBLISH, MessageType.REQUEST_UPDATE):
        with pytest.raises(CodecError):
            check_request_ok(ok_props, answers)
    check_request_ok(ok_props, MessageType.TRACK_STATUS)
    check_request_ok(ok_props, MessageType.SUBSCRIBE_TRACKS)  # A26: tolerated
    largest = RequestOk(Parameters.of(LargestObject(Location(1, 1))))
    with pytest.raises(CodecError):
        check_request_ok(largest, MessageType.PUBLISH)  # PUBLISH_OK: EXPIRES only
    with pytest.raises(CodecError):
        check_request_ok(largest, MessageType.SUBSCRIBE)  # not answered by REQUEST_OK
    fwd = RequestUpdate(4, Parameters.of(Forward(1)))
    check_request_update(fwd, MessageType.SUBSCRIBE)
    check_request_update(fwd, MessageType.SUBSCRIBE_TRACKS)
    for req in (MessageType.FETCH, MessageType.TRACK_STATUS, MessageType.PUBLISH_NAMESPACE):
        with pytest.raises(CodecError) as exc:
            check_request_update(fwd, req)
        assert exc.value.code == PV
    with pytest.raises(CodecError):
        check_request_update(fwd, MessageType.PUBLISH, from_publisher=True)  # A23: token only
    check_request_update(RequestUpdate(6), MessageType.PUBLISH, from_publisher=True)


def test_range_filter_type_codes_in_messages() -> None:
    f = RangeFilter(ParameterType.TRACK_PROPERTY_FILTER, 1, 0x30, [(1, 1)])
    with pytest.raises(EncodeError):
        Subscribe(0, TrackNamespace.of("a"), b"t", Parameters.of(f))  # 0x29 not in SUBSCRIBE
