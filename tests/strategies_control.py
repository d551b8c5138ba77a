"""Hypothesis strategies for valid MOQT draft-22 control messages and Message Parameters.

Public entry points (for the codec tests, the fuzz corpus and interop tests):

* :func:`control_messages` - any valid control message (every class of
  ``kvcs_core.wire.messages.MESSAGE_CLASSES``); :data:`MESSAGE_STRATEGIES` maps
  each message class to its own strategy.
* :func:`parameters` - a valid :class:`Parameters` block whose types are drawn
  from ``allowed`` (default: every type), respecting the repeat rules.
* :data:`PARAM_STRATEGIES` - one strategy per parameter class;
  :func:`parameter_of_type` - one parameter of a given type code.
* building blocks: :func:`vi64s`, :func:`namespaces`, :func:`track_names`,
  :func:`locations`, :func:`tokens`, :func:`location_filters`,
  :func:`range_filters`, :func:`invalid_range_filters`, :func:`kvps`.

Sizes are kept small so that every drawn message stays far below the 65535-byte
body limit and tests stay fast.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvcs_core.wire.codes import (
    MAX_VI64,
    GroupOrder,
    LocationFilterType,
    ParameterType,
    PublishDoneCode,
    RequestErrorCode,
    SetupOption,
)
from kvcs_core.wire.filters import (
    PROPERTY_FILTER_TYPES,
    RANGE_FILTER_TYPES,
    InvalidRangeFilter,
    LocationFilter,
    RangeFilter,
    RangeFilterRemove,
)
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.messages import (
    ControlMessageBase,
    Fetch,
    FetchOk,
    Goaway,
    Namespace,
    NamespaceDone,
    Publish,
    PublishDone,
    PublishNamespace,
    PublishSkipped,
    PublishStateNotify,
    Redirect,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackStatus,
)
from kvcs_core.wire.names import Location, TrackNamespace
from kvcs_core.wire.params import (
    ALL_PARAMS,
    FETCH_PARAMS,
    FILL_INNER_PARAMS,
    NAMESPACE_REQUEST_PARAMS,
    PUBLISH_PARAMS,
    PUBLISH_STATE_NOTIFY_PARAMS,
    REPEATABLE_PARAMS,
    REQUEST_OK_ANY_PARAMS,
    REQUEST_UPDATE_ANY_PARAMS,
    SUBSCRIBE_OK_PARAMS,
    SUBSCRIBE_PARAMS,
    SUBSCRIBE_TRACKS_PARAMS,
    TRACK_STATUS_PARAMS,
    AuthorizationToken,
    Expires,
    FillParameters,
    FillTimeout,
    Forward,
    GroupOrderParam,
    IncludeProperties,
    LargestObject,
    NewGroupRequest,
    ObjectDeliveryTimeout,
    Parameters,
    RendezvousTimeout,
    SubgroupDeliveryTimeout,
    SubscriberPriority,
    TrackNamespacePrefix,
)
from kvcs_core.wire.varint import encode_vi64

SearchStrategy = st.SearchStrategy

_BOUNDARIES = (0, 63, 64, 127, 128, 16383, 16384, (1 << 21) - 1, 1 << 21, 1 << 28, 1 << 35,
               1 << 42, 1 << 49, 1 << 56, MAX_VI64 - 1, MAX_VI64)  # fmt: skip


def vi64s(max_value: int = MAX_VI64) -> SearchStrategy[int]:
    """Integers 0..max_value, biased to small values and vi64 length boundaries."""
    return st.one_of(
        st.integers(0, min(200, max_value)),
        st.sampled_from([b for b in _BOUNDARIES if b <= max_value]),
        st.integers(0, max_value),
    )


def namespaces(min_fields: int = 0, max_fields: int = 4) -> SearchStrategy[TrackNamespace]:
    """Small Track Namespaces (fields of 1..12 bytes)."""
    return st.lists(
        st.binary(min_size=1, max_size=12), min_size=min_fields, max_size=max_fields
    ).map(lambda fs: TrackNamespace(tuple(fs)))


def track_names() -> SearchStrategy[bytes]:
    """Track Names (possibly empty)."""
    return st.binary(max_size=16)


def locations() -> SearchStrategy[Location]:
    """Any Location."""
    return st.builds(Location, vi64s(), vi64s())


def tokens(*, setup: bool = False) -> SearchStrategy[AuthorizationToken]:
    """Valid Tokens; ``setup=True`` only REGISTER and USE_VALUE (the SETUP rule)."""
    value = st.binary(max_size=24)
    kinds = [
        st.builds(AuthorizationToken.register, vi64s(), vi64s(), value),
        st.builds(AuthorizationToken.use_value, vi64s(), value),
    ]
    if not setup:
        kinds += [
            st.builds(AuthorizationToken.delete, vi64s()),
            st.builds(AuthorizationToken.use_alias, vi64s()),
        ]
    return st.one_of(kinds)


@st.composite
def _start_and_delta(draw: st.DrawFn) -> tuple[int, int, int]:
    sg = draw(vi64s())
    egd = draw(vi64s(MAX_VI64 - sg))
    return sg, draw(vi64s()), egd


def location_filters() -> SearchStrategy[LocationFilter]:
    """Every Location Filter Type with valid fields."""
    lft = LocationFilterType
    return st.one_of(
        st.just(LocationFilter.none()),
        st.just(LocationFilter.next_object()),
        st.builds(LocationFilter.relative_start, vi64s()),
        st.builds(LocationFilter.absolute_start, vi64s(), vi64s()),
        _start_and_delta().map(lambda t: LocationFilter(lft.ABSOLUTE_GROUP_END, *t)),
        st.tuples(_start_and_delta(), vi64s()).map(
            lambda t: LocationFilter(lft.ABSOLUTE_RANGE, *t[0], t[1])
        ),
    )


@st.composite
def range_filters(draw: st.DrawFn, kind: ParameterType) -> RangeFilter:
    """A valid RangeFilter of ``kind`` with 0..4 ascending ranges (last maybe open)."""
    ptype = draw(vi64s()) & ~1 if kind in PROPERTY_FILTER_TYPES else None
    limit = 255 if kind == ParameterType.PRIORITY_FILTER else MAX_VI64
    n = draw(st.integers(0, 4))
    ranges: list[tuple[int, int | None]] = []
    prev = 0
    for i in range(n):
        s = draw(st.one_of(st.integers(prev, min(prev + 300, limit)), st.integers(prev, limit)))
        if i == n - 1 and draw(st.booleans()):
            ranges.append((s, None))
            break
        e = draw(st.one_of(st.integers(s, min(s + 300, limit)), st.integers(s, limit)))
        ranges.append((s, e))
        prev = e
    return RangeFilter(kind, draw(st.integers(0, 255)), ptype, ranges)


@st.composite
def invalid_range_filters(draw: st.DrawFn, kind: ParameterType) -> InvalidRangeFilter:
    """A malformed range-filter value of ``kind`` (REQUEST_ERROR INVALID_FILTER material)."""
    raw = bytes([draw(st.integers(0, 255))])
    recipes = ["overflow", "truncated"]
    if kind in PROPERTY_FILTER_TYPES:
        recipes += ["odd_property", "no_property"]
    if kind == ParameterType.PRIORITY_FILTER:
        recipes.append("priority")
    recipe = draw(st.sampled_from(recipes))
    if recipe == "no_property":
        return InvalidRangeFilter(kind, raw)
    if recipe == "odd_property":
        return InvalidRangeFilter(kind, raw + encode_vi64(draw(vi64s()) | 1))
    if kind in PROPERTY_FILTER_TYPES:
        raw += encode_vi64(draw(vi64s()) & ~1)
    if recipe == "overflow":
        start = draw(st.one_of(st.integers(1, 300), st.integers(1, MAX_VI64)))
        raw += encode_vi64(start) + encode_vi64(draw(st.integers(MAX_VI64 - start + 1, MAX_VI64)))
    elif recipe == "truncated":
        raw += encode_vi64(draw(st.integers(128, MAX_VI64)))[:-1]
    else:  # priority
        raw += encode_vi64(draw(st.integers(256, MAX_VI64)))
    return InvalidRangeFilter(kind, raw)


_RANGE_KINDS = sorted(RANGE_FILTER_TYPES)


def _fill_parameters() -> SearchStrategy[FillParameters]:
    return parameters(FILL_INNER_PARAMS, max_size=4).map(FillParameters)


PARAM_STRATEGIES: dict[type, SearchStrategy[Any]] = {
    ObjectDeliveryTimeout: st.builds(ObjectDeliveryTimeout, vi64s()),
    AuthorizationToken: tokens(),
    RendezvousTimeout: st.builds(RendezvousTimeout, vi64s()),
    SubgroupDeliveryTimeout: st.builds(SubgroupDeliveryTimeout, vi64s()),
    Expires: st.builds(Expires, vi64s()),
    LargestObject: st.builds(LargestObject, locations()),
    FillTimeout: st.builds(FillTimeout, vi64s()),
    Forward: st.builds(Forward, st.integers(0, 1)),
    SubscriberPriority: st.builds(SubscriberPriority, st.integers(0, 255)),
    LocationFilter: location_filters(),
    GroupOrderParam: st.builds(GroupOrderParam, st.sampled_from(GroupOrder)),
    FillParameters: st.deferred(_fill_parameters),
    RangeFilter: st.sampled_from(_RANGE_KINDS).flatmap(range_filters),
    RangeFilterRemove: st.builds(RangeFilterRemove, st.sampled_from(_RANGE_KINDS)),
    InvalidRangeFilter: st.sampled_from(_RANGE_KINDS).flatmap(invalid_range_filters),
    NewGroupRequest: st.builds(NewGroupRequest, vi64s()),
    TrackNamespacePrefix: st.builds(TrackNamespacePrefix, namespaces()),
    IncludeProperties: st.builds(IncludeProperties, st.integers(0, 1)),
}
"""One strategy per parameter class."""

_BY_TYPE: dict[int, SearchStrategy[Any]] = {
    getattr(cls, "TYPE"): s  # noqa: B009 - the range-filter classes have no TYPE
    for cls, s in PARAM_STRATEGIES.items()
    if hasattr(cls, "TYPE")
}


def parameter_of_type(type_: int) -> SearchStrategy[Any]:
    """One valid parameter of type code ``type_`` (range filters: valid, remove or invalid)."""
    if type_ in RANGE_FILTER_TYPES:
        kind = ParameterType(type_)
        return st.one_of(
            range_filters(kind),
            st.just(RangeFilterRemove(kind)),
            invalid_range_filters(kind),
        )
    return _BY_TYPE[type_]


@st.composite
def parameters(
    draw: st.DrawFn, allowed: frozenset[int] | None = None, max_size: int = 5
) -> Parameters:
    """A valid parameter block drawn from ``allowed`` (default: every type)."""
    pool = sorted(ALL_PARAMS if allowed is None else allowed)
    if not pool:
        return Parameters()
    chosen = draw(st.lists(st.sampled_from(pool), max_size=max_size))
    items = []
    seen: set[int] = set()
    for t in chosen:
        if t in seen and t not in REPEATABLE_PARAMS:
            continue
        seen.add(t)
        items.append(draw(parameter_of_type(t)))
    return Parameters(items)


def _kv(types: SearchStrategy[int]) -> SearchStrategy[KeyValuePair]:
    return types.flatmap(
        lambda t: (st.binary(max_size=8) if t & 1 else vi64s()).map(lambda v: KeyValuePair(t, v))
    )


def kvps(types: SearchStrategy[int] | None = None) -> SearchStrategy[tuple[KeyValuePair, ...]]:
    """A KVP list (Track Properties, Setup extras) with non-decreasing types."""
    types = types if types is not None else st.one_of(st.integers(0, 0x120), vi64s())
    return st.lists(_kv(types), max_size=4).map(lambda ps: tuple(sorted(ps, key=lambda p: p.type)))


_SETUP_EXTRA_TYPES = st.one_of(st.integers(0, 0x200), vi64s()).filter(
    lambda t: t not in set(SetupOption)
)


def _opt(s: SearchStrategy[Any]) -> SearchStrategy[Any]:
    return st.none() | s


_NON_REDIRECT_CODE = st.one_of(st.sampled_from(RequestErrorCode), vi64s()).filter(
    lambda c: c != RequestErrorCode.REDIRECT
)
_reason = st.binary(max_size=40)

MESSAGE_STRATEGIES: dict[type[ControlMessageBase], SearchStrategy[Any]] = {
    Setup: st.builds(
        Setup,
        path=_opt(st.binary(max_size=12)),
        authority=_opt(st.binary(max_size=12)),
        max_filter_ranges=_opt(vi64s()),
        max_request_updates=_opt(vi64s()),
        max_auth_token_cache_size=_opt(vi64s()),
        moqt_implementation=_opt(st.binary(max_size=12)),
        authorization_tokens=st.lists(tokens(setup=True), max_size=2),
        extra_options=kvps(_SETUP_EXTRA_TYPES),
    ),
    Goaway: st.builds(Goaway, st.binary(max_size=40), vi64s()),
    RequestOk: st.builds(RequestOk, parameters(REQUEST_OK_ANY_PARAMS), kvps()),
    RequestError: st.one_of(
        st.builds(RequestError, _NON_REDIRECT_CODE, vi64s(), _reason),
        st.builds(
            RequestError,
            st.just(RequestErrorCode.REDIRECT),
            vi64s(),
            _reason,
            st.builds(Redirect, st.binary(max_size=20), namespaces(), track_names()),
        ),
    ),
    RequestUpdate: st.builds(RequestUpdate, vi64s(), parameters(REQUEST_UPDATE_ANY_PARAMS)),
    Subscribe: st.builds(
        Subscribe, vi64s(), namespaces(), track_names(), parameters(SUBSCRIBE_PARAMS)
    ),
    SubscribeOk: st.builds(SubscribeOk, vi64s(), parameters(SUBSCRIBE_OK_PARAMS), kvps()),
    Publish: st.builds(
        Publish,
        vi64s(),
        namespaces(),
        track_names(),
        vi64s(),
        parameters(PUBLISH_PARAMS),
        kvps(),
    ),
    PublishDone: st.builds(
        PublishDone, st.one_of(st.sampled_from(PublishDoneCode), vi64s()), vi64s(), _reason
    ),
    PublishStateNotify: st.builds(PublishStateNotify, parameters(PUBLISH_STATE_NOTIFY_PARAMS)),
    Fetch: st.builds(Fetch, vi64s(), namespaces(), track_names(), parameters(FETCH_PARAMS)),
    FetchOk: st.builds(FetchOk, st.booleans(), locations(), st.just(Parameters()), kvps()),
    TrackStatus: st.builds(
        TrackStatus, vi64s(), namespaces(), track_names(), parameters(TRACK_STATUS_PARAMS)
    ),
    PublishNamespace: st.builds(
        PublishNamespace, vi64s(), namespaces(), parameters(NAMESPACE_REQUEST_PARAMS)
    ),
    SubscribeNamespace: st.builds(
        SubscribeNamespace, vi64s(), namespaces(), parameters(NAMESPACE_REQUEST_PARAMS)
    ),
    Namespace: st.builds(Namespace, namespaces()),
    NamespaceDone: st.builds(NamespaceDone, namespaces()),
    SubscribeTracks: st.builds(
        SubscribeTracks, vi64s(), namespaces(), parameters(SUBSCRIBE_TRACKS_PARAMS)
    ),
    PublishSkipped: st.builds(PublishSkipped, namespaces(), track_names()),
}
"""One strategy per control message class."""


def control_messages() -> SearchStrategy[Any]:
    """Any valid control message."""
    return st.one_of(*MESSAGE_STRATEGIES.values())
