"""Message Parameters (d21 section 9.20; d22 encodings per MOQT-22-WIRE.md section 5).

Theory of operation
-------------------
A parameter block (wire reference 2.4) is ``Number of Parameters (vi64)``
followed by that many ``Type Delta (vi64), Value`` pairs; types ascend and are
delta coded from 0. Unlike a KVP list the value encoding is fixed per type
(section 5.2) and cannot be skipped, so:

* an unknown type is a PROTOCOL_VIOLATION, and so is a known type that the
  message in hand does not allow (section 5.1 "Per-message view", the
  ``*_PARAMS`` frozensets of ``scopes.py``), a resolved type over 2**64-1, and
  an unexpected repeat (only AUTHORIZATION_TOKEN and the range filters may
  repeat; Ambiguity A9: PV);
* uint8 values (FORWARD, SUBSCRIBER_PRIORITY, GROUP_ORDER, INCLUDE_PROPERTIES)
  are one raw byte; out-of-range FORWARD/INCLUDE_PROPERTIES/GROUP_ORDER is PV;
* varint values are one vi64; LARGEST_OBJECT is a bare Location;
* AUTHORIZATION_TOKEN, FILL_PARAMETERS and the range filters are
  length-prefixed; TRACK_NAMESPACE_PREFIX is a bare Track Namespace and
  LOCATION_FILTER is self-delimiting (both d22, see ``filters.py``).

Each parameter type has one frozen attrs class (a :class:`MessageParameter`);
:class:`Parameters` holds them in wire order (sorted stably by type on
construction, so any construction order encodes and compares the same).

REQUEST_OK and REQUEST_UPDATE carry parameters whose allowed set depends on the
request they answer or update, which a stateless codec cannot know: the codec
decodes them with the unions ``REQUEST_OK_ANY_PARAMS`` /
``REQUEST_UPDATE_ANY_PARAMS`` and the session calls :func:`check_scope` with
the precise set (``REQUEST_OK_PARAMS_BY_REQUEST`` / ``RU_PARAMS_BY_REQUEST``)
once it knows. The scope sets live in ``scopes.py`` and are re-exported here.

The AUTHORIZATION_TOKEN value (the Token structure, section 5.3) is also the
value of the SETUP option 0x03, so :class:`AuthorizationToken` and
:func:`encode_token` / :func:`read_token` / :func:`decode_token` live in
``setup.py`` and are re-exported here. An undecodable Token closes the session
with KEY_VALUE_FORMATTING_ERROR.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar, Final, TypeAlias, TypeVar

import attrs

from kvcs_core.wire.codes import MAX_VI64, GroupOrder, ParameterType
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.filters import (
    RANGE_FILTER_TYPES,
    InvalidRangeFilter,
    LocationFilter,
    MessageParameter,
    RangeFilter,
    RangeFilterRemove,
    invalid_filter_reason,
    read_location_filter,
    read_range_filter,
    vi64_validator,
)
from kvcs_core.wire.names import (
    Location,
    TrackNamespace,
    encode_location,
    encode_namespace,
    read_location,
    read_namespace,
)
from kvcs_core.wire.reader import read_u8, read_vi64
from kvcs_core.wire.scopes import (
    ALL_PARAMS,
    FETCH_OK_PARAMS,
    FETCH_PARAMS,
    FILL_INNER_PARAMS,
    NAMESPACE_REQUEST_PARAMS,
    PUBLISH_PARAMS,
    PUBLISH_STATE_NOTIFY_PARAMS,
    REQUEST_OK_ANY_PARAMS,
    REQUEST_OK_PARAMS_BY_REQUEST,
    REQUEST_OK_PUBLISH_NAMESPACE_PARAMS,
    REQUEST_OK_PUBLISH_PARAMS,
    REQUEST_OK_REQUEST_UPDATE_PARAMS,
    REQUEST_OK_SUBSCRIBE_NAMESPACE_PARAMS,
    REQUEST_OK_SUBSCRIBE_TRACKS_PARAMS,
    REQUEST_OK_TRACK_STATUS_PARAMS,
    REQUEST_OK_TRACK_STATUS_SEND_PARAMS,
    REQUEST_UPDATE_ANY_PARAMS,
    RU_FETCH_PARAMS,
    RU_PARAMS_BY_REQUEST,
    RU_PUBLISH_NAMESPACE_PARAMS,
    RU_PUBLISH_REQUESTER_PARAMS,
    RU_SUBSCRIBE_NAMESPACE_PARAMS,
    RU_SUBSCRIBE_TRACKS_PARAMS,
    RU_SUBSCRIPTION_PARAMS,
    SUBSCRIBE_OK_PARAMS,
    SUBSCRIBE_PARAMS,
    SUBSCRIBE_TRACKS_PARAMS,
    SUBSCRIBE_TRACKS_SEND_PARAMS,
    TRACK_STATUS_PARAMS,
)
from kvcs_core.wire.setup import AuthorizationToken, decode_token, encode_token, read_token
from kvcs_core.wire.varint import Buffer, encode_vi64

__all__ = [
    "ALL_PARAMS",
    "EMPTY_PARAMETERS",
    "FETCH_OK_PARAMS",
    "FETCH_PARAMS",
    "FILL_INNER_PARAMS",
    "NAMESPACE_REQUEST_PARAMS",
    "PARAMETER_CLASSES",
    "PUBLISH_PARAMS",
    "PUBLISH_STATE_NOTIFY_PARAMS",
    "REPEATABLE_PARAMS",
    "REQUEST_OK_ANY_PARAMS",
    "REQUEST_OK_PARAMS_BY_REQUEST",
    "REQUEST_OK_PUBLISH_NAMESPACE_PARAMS",
    "REQUEST_OK_PUBLISH_PARAMS",
    "REQUEST_OK_REQUEST_UPDATE_PARAMS",
    "REQUEST_OK_SUBSCRIBE_NAMESPACE_PARAMS",
    "REQUEST_OK_SUBSCRIBE_TRACKS_PARAMS",
    "REQUEST_OK_TRACK_STATUS_PARAMS",
    "REQUEST_OK_TRACK_STATUS_SEND_PARAMS",
    "REQUEST_UPDATE_ANY_PARAMS",
    "RU_FETCH_PARAMS",
    "RU_PARAMS_BY_REQUEST",
    "RU_PUBLISH_NAMESPACE_PARAMS",
    "RU_PUBLISH_REQUESTER_PARAMS",
    "RU_SUBSCRIBE_NAMESPACE_PARAMS",
    "RU_SUBSCRIBE_TRACKS_PARAMS",
    "RU_SUBSCRIPTION_PARAMS",
    "SUBSCRIBE_OK_PARAMS",
    "SUBSCRIBE_PARAMS",
    "SUBSCRIBE_TRACKS_PARAMS",
    "SUBSCRIBE_TRACKS_SEND_PARAMS",
    "TRACK_STATUS_PARAMS",
    "AuthorizationToken",
    "Expires",
    "FillParameters",
    "FillTimeout",
    "Forward",
    "GroupOrderParam",
    "IncludeProperties",
    "InvalidRangeFilter",
    "LargestObject",
    "LocationFilter",
    "MessageParameter",
    "NewGroupRequest",
    "ObjectDeliveryTimeout",
    "Parameter",
    "Parameters",
    "RangeFilter",
    "RangeFilterRemove",
    "RendezvousTimeout",
    "SubgroupDeliveryTimeout",
    "SubscriberPriority",
    "TrackNamespacePrefix",
    "check_scope",
    "decode_parameters",
    "decode_token",
    "encode_parameters",
    "encode_token",
    "invalid_filter_reason",
    "parameters_bytes",
    "read_parameters",
    "read_token",
]

P = ParameterType

# --- the fixed-encoding parameters -----------------------------------------------


@attrs.frozen
class _Milliseconds(MessageParameter):
    """Base of the parameters whose value is one vi64 of milliseconds."""

    ms: int = attrs.field(validator=vi64_validator)

    def encode_value(self, out: bytearray) -> None:
        """Append the vi64."""
        out += encode_vi64(self.ms)


@attrs.frozen
class ObjectDeliveryTimeout(_Milliseconds):
    """OBJECT_DELIVERY_TIMEOUT (0x02): subscriber's per-object timeout, ms (0 = none)."""

    TYPE: ClassVar[ParameterType] = P.OBJECT_DELIVERY_TIMEOUT


@attrs.frozen
class RendezvousTimeout(_Milliseconds):
    """RENDEZVOUS_TIMEOUT (0x04): how long a relay holds a SUBSCRIBE, ms (A7: vi64)."""

    TYPE: ClassVar[ParameterType] = P.RENDEZVOUS_TIMEOUT


@attrs.frozen
class SubgroupDeliveryTimeout(_Milliseconds):
    """SUBGROUP_DELIVERY_TIMEOUT (0x06): subscriber's per-subgroup timeout, ms (0 = none)."""

    TYPE: ClassVar[ParameterType] = P.SUBGROUP_DELIVERY_TIMEOUT


@attrs.frozen
class Expires(_Milliseconds):
    """EXPIRES (0x08): ms after which the sender ends the request (0 = none/unknown)."""

    TYPE: ClassVar[ParameterType] = P.EXPIRES


@attrs.frozen
class LargestObject(MessageParameter):
    """LARGEST_OBJECT (0x09): the largest Location the sender has seen (no Length)."""

    TYPE: ClassVar[ParameterType] = P.LARGEST_OBJECT
    location: Location

    def encode_value(self, out: bytearray) -> None:
        """Append Group and Object."""
        encode_location(self.location, out)


@attrs.frozen
class FillTimeout(_Milliseconds):
    """FILL_TIMEOUT (0x0A): a relay's upstream budget for a FETCH or fill, ms (A7: vi64)."""

    TYPE: ClassVar[ParameterType] = P.FILL_TIMEOUT


def _zero_or_one(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value not in (0, 1) or isinstance(value, bool):
        raise EncodeError(f"{attr.name} must be 0 or 1, not {value!r}")


def _uint8(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise EncodeError(f"{attr.name} {value!r} outside 0..255")


@attrs.frozen
class Forward(MessageParameter):
    """FORWARD (0x10): Forward State, uint8 0 or 1 (anything else is PV)."""

    TYPE: ClassVar[ParameterType] = P.FORWARD
    value: int = attrs.field(validator=_zero_or_one)

    def encode_value(self, out: bytearray) -> None:
        """Append the byte."""
        out.append(self.value)


@attrs.frozen
class SubscriberPriority(MessageParameter):
    """SUBSCRIBER_PRIORITY (0x20): uint8, 0 = most urgent (default 128)."""

    TYPE: ClassVar[ParameterType] = P.SUBSCRIBER_PRIORITY
    value: int = attrs.field(validator=_uint8)

    def encode_value(self, out: bytearray) -> None:
        """Append the byte."""
        out.append(self.value)


def _to_group_order(value: int) -> GroupOrder:
    try:
        return GroupOrder(value)
    except ValueError:
        raise EncodeError(f"GROUP_ORDER {value!r} is neither 1 nor 2") from None


@attrs.frozen
class GroupOrderParam(MessageParameter):
    """GROUP_ORDER (0x22): uint8 1 Ascending / 2 Descending (anything else is PV)."""

    TYPE: ClassVar[ParameterType] = P.GROUP_ORDER
    order: GroupOrder = attrs.field(converter=_to_group_order)

    def encode_value(self, out: bytearray) -> None:
        """Append the byte."""
        out.append(self.order)


@attrs.frozen
class NewGroupRequest(MessageParameter):
    """NEW_GROUP_REQUEST (0x32): largest known Group ID + 1, or 0 (vi64)."""

    TYPE: ClassVar[ParameterType] = P.NEW_GROUP_REQUEST
    value: int = attrs.field(validator=vi64_validator)

    def encode_value(self, out: bytearray) -> None:
        """Append the vi64."""
        out += encode_vi64(self.value)


@attrs.frozen
class TrackNamespacePrefix(MessageParameter):
    """TRACK_NAMESPACE_PREFIX (0x34): new prefix, d22 bare Track Namespace (no Length)."""

    TYPE: ClassVar[ParameterType] = P.TRACK_NAMESPACE_PREFIX
    namespace: TrackNamespace

    def encode_value(self, out: bytearray) -> None:
        """Append the Track Namespace structure."""
        encode_namespace(self.namespace, out)


@attrs.frozen
class IncludeProperties(MessageParameter):
    """INCLUDE_PROPERTIES (0x35): uint8 0 or 1 (anything else is PV); default 1."""

    TYPE: ClassVar[ParameterType] = P.INCLUDE_PROPERTIES
    value: int = attrs.field(validator=_zero_or_one)

    def encode_value(self, out: bytearray) -> None:
        """Append the byte."""
        out.append(self.value)


REPEATABLE_PARAMS: Final[frozenset[int]] = frozenset({P.AUTHORIZATION_TOKEN} | RANGE_FILTER_TYPES)
"""Types that may appear more than once in one block (section 2.4)."""

_T = TypeVar("_T")


def _sorted_params(items: Iterable[Parameter]) -> tuple[Parameter, ...]:
    items = tuple(items)
    for p in items:
        if not isinstance(p, MessageParameter):
            raise EncodeError(f"{p!r} is not a Message Parameter")
    return tuple(sorted(items, key=lambda p: p.type))


@attrs.frozen
class Parameters:
    """A parameter block in wire order (items sorted stably by type on construction).

    Construction refuses repeats of non-repeatable types (EncodeError).
    """

    items: tuple[Parameter, ...] = attrs.field(default=(), converter=_sorted_params)

    def __attrs_post_init__(self) -> None:
        seen: set[int] = set()
        for p in self.items:
            t = p.type
            if t in seen and t not in REPEATABLE_PARAMS:
                raise EncodeError(f"{t.name} must not repeat")
            seen.add(t)

    @classmethod
    def of(cls, *items: Parameter) -> Parameters:
        """``Parameters.of(Forward(1), SubscriberPriority(64))``."""
        return cls(items)

    def get(self, cls: type[_T]) -> _T | None:
        """The first parameter of class ``cls``, or ``None``."""
        for p in self.items:
            if isinstance(p, cls):
                return p
        return None

    def all(self, cls: type[_T]) -> tuple[_T, ...]:
        """Every parameter of class ``cls``, in wire order."""
        return tuple(p for p in self.items if isinstance(p, cls))

    def of_type(self, type_: int) -> tuple[Parameter, ...]:
        """Every parameter whose type code is ``type_``, in wire order."""
        return tuple(p for p in self.items if p.type == type_)

    def types(self) -> frozenset[ParameterType]:
        """The set of type codes present."""
        return frozenset(p.type for p in self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Parameter]:
        return iter(self.items)


EMPTY_PARAMETERS: Final = Parameters()
"""The empty block (``00`` on the wire)."""


@attrs.frozen
class FillParameters(MessageParameter):
    """FILL_PARAMETERS (0x23): Length + a counted inner parameter block (section 5.6).

    Only FILL_INNER_PARAMS types may appear inside; an empty block is ``23 01 00``.
    """

    TYPE: ClassVar[ParameterType] = P.FILL_PARAMETERS
    params: Parameters = attrs.field(factory=Parameters)

    def __attrs_post_init__(self) -> None:
        for p in self.params:
            if p.type not in FILL_INNER_PARAMS:
                raise EncodeError(f"{p.type.name} is not allowed inside FILL_PARAMETERS")

    def encode_value(self, out: bytearray) -> None:
        """Append ``Length``, ``Number of Parameters`` and the inner parameters."""
        inner = bytearray()
        encode_parameters(self.params, inner)
        out += encode_vi64(len(inner))
        out += inner


Parameter: TypeAlias = (
    ObjectDeliveryTimeout
    | AuthorizationToken
    | RendezvousTimeout
    | SubgroupDeliveryTimeout
    | Expires
    | LargestObject
    | FillTimeout
    | Forward
    | SubscriberPriority
    | LocationFilter
    | GroupOrderParam
    | FillParameters
    | RangeFilter
    | RangeFilterRemove
    | InvalidRangeFilter
    | NewGroupRequest
    | TrackNamespacePrefix
    | IncludeProperties
)
"""Any Message Parameter class."""

PARAMETER_CLASSES: Final[tuple[type[MessageParameter], ...]] = (
    ObjectDeliveryTimeout,
    AuthorizationToken,
    RendezvousTimeout,
    SubgroupDeliveryTimeout,
    Expires,
    LargestObject,
    FillTimeout,
    Forward,
    SubscriberPriority,
    LocationFilter,
    GroupOrderParam,
    FillParameters,
    RangeFilter,
    RangeFilterRemove,
    InvalidRangeFilter,
    NewGroupRequest,
    TrackNamespacePrefix,
    IncludeProperties,
)
"""Every parameter class, in type-code order (the range filters have three classes)."""


def encode_parameters(params: Parameters, out: bytearray) -> None:
    """Append ``Number of Parameters`` and the parameters with delta-coded types."""
    out += encode_vi64(len(params.items))
    prev = 0
    for p in params.items:
        t = p.type
        out += encode_vi64(t - prev)
        prev = t
        p.encode_value(out)


def parameters_bytes(params: Parameters) -> bytes:
    """``encode_parameters`` into a new bytes object."""
    out = bytearray()
    encode_parameters(params, out)
    return bytes(out)


# --- decoding ---------------------------------------------------------------------

_Reader = Callable[[Buffer, int, ParameterType], tuple[Parameter, int]]


def _vi64_reader(cls: Callable[[int], Parameter]) -> _Reader:
    def read(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
        v, pos = read_vi64(buf, pos)
        return cls(v), pos

    return read


def _read_token_param(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
    length, pos = read_vi64(buf, pos)
    end = pos + length
    if end > len(buf):
        raise Incomplete
    return read_token(buf, pos, end), end


def _read_largest(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
    loc, pos = read_location(buf, pos)
    return LargestObject(loc), pos


def _read_zero_one(cls: Callable[[int], Parameter], name: str) -> _Reader:
    def read(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
        v, end = read_u8(buf, pos)
        if v > 1:
            raise CodecError(f"{name} value {v} is neither 0 nor 1", offset=pos)
        return cls(v), end

    return read


def _read_priority(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
    v, pos = read_u8(buf, pos)
    return SubscriberPriority(v), pos


def _read_group_order(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
    v, end = read_u8(buf, pos)
    if v not in (GroupOrder.ASCENDING, GroupOrder.DESCENDING):
        raise CodecError(f"GROUP_ORDER value {v} is neither 1 nor 2", offset=pos)
    return GroupOrderParam(GroupOrder(v)), end


def _read_location_filter(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
    return read_location_filter(buf, pos)


def _read_range(buf: Buffer, pos: int, t: ParameterType) -> tuple[Parameter, int]:
    return read_range_filter(buf, pos, t)


def _read_prefix(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
    ns, pos = read_namespace(buf, pos)
    return TrackNamespacePrefix(ns), pos


def _read_fill(buf: Buffer, pos: int, _t: ParameterType) -> tuple[Parameter, int]:
    start = pos
    length, pos = read_vi64(buf, pos)
    end = pos + length
    if end > len(buf):
        raise Incomplete
    try:
        # Ambiguity A3: Length + count + parameters, decoded strictly.
        inner, ipos = read_parameters(
            buf[:end], pos, allowed=FILL_INNER_PARAMS, context="FILL_PARAMETERS"
        )
    except Incomplete:
        raise CodecError("FILL_PARAMETERS block runs past its Length", offset=start) from None
    if ipos != end:
        raise CodecError("FILL_PARAMETERS block ends before its Length", offset=ipos)
    return FillParameters(inner), end


_READERS: Final[dict[int, _Reader]] = {
    P.OBJECT_DELIVERY_TIMEOUT: _vi64_reader(ObjectDeliveryTimeout),
    P.AUTHORIZATION_TOKEN: _read_token_param,
    P.RENDEZVOUS_TIMEOUT: _vi64_reader(RendezvousTimeout),
    P.SUBGROUP_DELIVERY_TIMEOUT: _vi64_reader(SubgroupDeliveryTimeout),
    P.EXPIRES: _vi64_reader(Expires),
    P.LARGEST_OBJECT: _read_largest,
    P.FILL_TIMEOUT: _vi64_reader(FillTimeout),
    P.FORWARD: _read_zero_one(Forward, "FORWARD"),
    P.SUBSCRIBER_PRIORITY: _read_priority,
    P.LOCATION_FILTER: _read_location_filter,
    P.GROUP_ORDER: _read_group_order,
    P.FILL_PARAMETERS: _read_fill,
    P.SUBGROUP_FILTER: _read_range,
    P.OBJECTID_FILTER: _read_range,
    P.PRIORITY_FILTER: _read_range,
    P.OBJECT_PROPERTY_FILTER: _read_range,
    P.TRACK_PROPERTY_FILTER: _read_range,
    P.NEW_GROUP_REQUEST: _vi64_reader(NewGroupRequest),
    P.TRACK_NAMESPACE_PREFIX: _read_prefix,
    P.INCLUDE_PROPERTIES: _read_zero_one(IncludeProperties, "INCLUDE_PROPERTIES"),
}


def read_parameters(
    buf: Buffer, pos: int, *, allowed: frozenset[int], context: str
) -> tuple[Parameters, int]:
    """Read a parameter block at ``pos``; return it and the position after it.

    ``allowed`` is the set of types the message (``context``, for error text)
    admits. Unknown or disallowed types, a type overflow and a repeated
    non-repeatable type are PROTOCOL_VIOLATION. Raises :class:`Incomplete` when
    the buffer ends first (callers bound the buffer to the message body).
    """
    count, pos = read_vi64(buf, pos)
    items: list[Parameter] = []
    seen: set[int] = set()
    prev = 0
    for _ in range(count):  # each parameter takes >= 1 byte, so this ends with the buffer
        at = pos
        delta, pos = read_vi64(buf, pos)
        t = prev + delta
        if t > MAX_VI64:
            raise CodecError(f"{context}: parameter type overflows 2**64-1", offset=at)
        prev = t
        reader = _READERS.get(t)
        if reader is None:
            raise CodecError(f"{context}: unknown parameter type {t:#x}", offset=at)
        ptype = ParameterType(t)
        if t not in allowed:
            raise CodecError(f"{context}: parameter {ptype.name} not allowed", offset=at)
        if t in seen and t not in REPEATABLE_PARAMS:
            # Ambiguity A9 (MOQT-22-WIRE.md section 11): duplicates are PV.
            raise CodecError(f"{context}: parameter {ptype.name} repeated", offset=at)
        seen.add(t)
        p, pos = reader(buf, pos, ptype)
        items.append(p)
    return Parameters(items), pos


def decode_parameters(
    buf: Buffer, *, allowed: frozenset[int], context: str = "parameters"
) -> Parameters:
    """Decode a block that fills ``buf`` exactly; short or long input is PV."""
    try:
        params, pos = read_parameters(buf, 0, allowed=allowed, context=context)
    except Incomplete:
        raise CodecError(f"{context}: block truncated", offset=len(buf)) from None
    if pos != len(buf):
        raise CodecError(f"{context}: trailing bytes after the block", offset=pos)
    return params


def check_scope(params: Parameters, allowed: frozenset[int], context: str) -> None:
    """Raise CodecError(PROTOCOL_VIOLATION) if a parameter is outside ``allowed``.

    For the session, once it knows which request a REQUEST_OK or REQUEST_UPDATE
    belongs to (see ``REQUEST_OK_PARAMS_BY_REQUEST`` and ``RU_PARAMS_BY_REQUEST``).
    """
    for p in params:
        if p.type not in allowed:
            raise CodecError(f"{context}: parameter {p.type.name} not allowed")
