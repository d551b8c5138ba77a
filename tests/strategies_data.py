"""Hypothesis strategies for the MOQT data plane: subgroup streams, fetch streams, datagrams.

Each strategy draws valid items and returns ``(items, encoded)``: the items a
decoder must return (header first) and the bytes the kvcs encoders produce for
them. Fetch streams need their request's group order to be decoded; this module
fixes it as a function of the Request ID, :func:`group_order_for` (odd IDs are
Descending), so decode them with ``FetchStreamDecoder(group_order_for)`` (or
``DataStreamDecoder(fetch_group_order=group_order_for)``).

Reused by the fuzz corpus builder: keep the signatures stable.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvcs_core.wire.codes import EndOfRange, GroupOrder, ObjectStatus
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import Location
from kvcs_core.wire.objects import (
    EndOfRangeMarker,
    FetchHeader,
    FetchObject,
    ObjectDatagram,
    PaddingDatagram,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    encode_datagram,
    encode_fetch_stream,
    encode_subgroup_stream,
)

MAX_VI64 = (1 << 64) - 1
VI64_EDGES = (
    0, 1, 63, 64, 127, 128, 255, 16383, 16384, (1 << 21) - 1, 1 << 21, (1 << 28) - 1,
    1 << 28, 1 << 35, 1 << 42, 1 << 49, (1 << 56) - 1, 1 << 56, MAX_VI64 - 1, MAX_VI64,
)  # fmt: skip

__all__ = [
    "datagrams",
    "fetch_streams",
    "group_order_for",
    "kvp_lists",
    "subgroup_streams",
    "vi64s",
]


def group_order_for(request_id: int) -> GroupOrder:
    """The group order :func:`fetch_streams` uses for ``request_id`` (odd: Descending)."""
    return GroupOrder.DESCENDING if request_id & 1 else GroupOrder.ASCENDING


def vi64s() -> st.SearchStrategy[int]:
    """Integers 0..2**64-1, biased to small values and vi64 length boundaries."""
    return st.one_of(st.integers(0, 130), st.sampled_from(VI64_EDGES), st.integers(0, MAX_VI64))


def _kvp(t: int, draw: st.DrawFn) -> KeyValuePair:
    if t & 1:
        return KeyValuePair(t, draw(st.binary(max_size=12)))
    return KeyValuePair(t, draw(vi64s()))


@st.composite
def kvp_lists(draw: st.DrawFn, max_size: int = 3) -> tuple[KeyValuePair, ...]:
    """A valid KVP list (types non-decreasing, repeats allowed)."""
    types = sorted(
        draw(
            st.lists(
                st.one_of(st.integers(0, 0x80), st.sampled_from((0x3E, 0x3FFF, 1 << 40))),
                max_size=max_size,
            )
        )
    )
    return tuple(_kvp(t, draw) for t in types)


@st.composite
def subgroup_streams(
    draw: st.DrawFn, max_objects: int = 8, max_payload: int = 40
) -> tuple[list[SubgroupHeader | SubgroupObject], bytes]:
    """A SUBGROUP_HEADER and ascending objects (a status object may end the stream)."""
    mode = draw(st.sampled_from(SubgroupIdMode))
    has_props = draw(st.booleans())
    header = SubgroupHeader(
        track_alias=draw(vi64s()),
        group_id=draw(vi64s()),
        subgroup_id_mode=mode,
        subgroup_id=draw(vi64s()) if mode is SubgroupIdMode.EXPLICIT else None,
        publisher_priority=draw(st.none() | st.integers(0, 255)),
        has_properties=has_props,
        end_of_group=draw(st.booleans()),
        first_object=draw(st.booleans()),
    )
    n = draw(st.integers(0, max_objects))
    objects: list[SubgroupObject] = []
    oid = draw(vi64s())
    for i in range(n):
        if i:
            oid += 1 + draw(st.one_of(st.just(0), st.integers(0, 200), st.integers(0, 1 << 40)))
            if oid > MAX_VI64:
                break
        status = ObjectStatus.NORMAL
        if i == n - 1:
            status = draw(
                st.sampled_from(
                    (ObjectStatus.NORMAL,) * 3
                    + (ObjectStatus.END_OF_GROUP, ObjectStatus.END_OF_TRACK)
                )
            )
        if status is ObjectStatus.NORMAL:
            payload = draw(st.binary(max_size=max_payload))
            props = draw(kvp_lists()) if has_props else None
        else:
            payload = b""
            props = () if has_props else None
        objects.append(SubgroupObject(oid, props, status, payload))
    return [header, *objects], encode_subgroup_stream(header, objects)


@st.composite
def fetch_streams(
    draw: st.DrawFn, max_items: int = 10, max_payload: int = 32
) -> tuple[list[FetchHeader | FetchObject | EndOfRangeMarker], bytes]:
    """A FETCH_HEADER and objects/markers in the order of ``group_order_for(request_id)``."""
    rid = draw(vi64s())
    descending = group_order_for(rid) is GroupOrder.DESCENDING
    n = draw(st.integers(0, max_items))
    gaps = st.one_of(st.just(0), st.integers(0, 5), st.integers(0, 1 << 40))
    g = draw(vi64s())
    o = draw(vi64s())
    items: list[FetchObject | EndOfRangeMarker] = []
    sub = -1
    prio = -1
    for i in range(n):
        if i:
            if draw(st.booleans()):
                o += 1 + draw(gaps)
            else:
                step = 1 + draw(gaps)
                g = g - step if descending else g + step
                o = draw(st.one_of(st.integers(0, 3), vi64s()))
            if not 0 <= g <= MAX_VI64 or o > MAX_VI64:
                break
        if draw(st.integers(0, 4)) == 0:
            items.append(EndOfRangeMarker(draw(st.sampled_from(EndOfRange)), Location(g, o)))
            continue
        datagram = draw(st.integers(0, 5)) == 0
        sg: int | None = None
        if not datagram:
            choices = [st.just(0), vi64s()]
            if sub >= 0:
                choices.append(st.just(sub))
                if sub < MAX_VI64:
                    choices.append(st.just(sub + 1))
            sg = draw(st.one_of(*choices))
            sub = sg
        p = draw(st.integers(0, 255) if prio < 0 else st.one_of(st.just(prio), st.integers(0, 255)))
        prio = p
        items.append(
            FetchObject(
                g,
                o,
                sg,
                p,
                draw(st.one_of(st.just(()), kvp_lists())),
                draw(st.binary(max_size=max_payload)),
                datagram,
            )
        )
    encoded = encode_fetch_stream(rid, group_order_for(rid), items)
    return [FetchHeader(rid), *items], encoded


@st.composite
def datagrams(
    draw: st.DrawFn, max_payload: int = 64
) -> tuple[ObjectDatagram | PaddingDatagram, bytes]:
    """A valid OBJECT_DATAGRAM (payload or status) or a padding datagram."""
    if draw(st.integers(0, 9)) == 0:
        d: ObjectDatagram | PaddingDatagram = PaddingDatagram(draw(st.integers(0, 40)))
        return d, encode_datagram(d)
    status = draw(st.none() | st.sampled_from(ObjectStatus))
    props = draw(kvp_lists())
    if status is not None and status is not ObjectStatus.NORMAL:
        props = ()
    d = ObjectDatagram(
        track_alias=draw(vi64s()),
        group_id=draw(vi64s()),
        object_id=draw(st.one_of(st.just(0), vi64s())),
        publisher_priority=draw(st.none() | st.integers(0, 255)),
        properties=props,
        status=status,
        end_of_group=False if status is not None else draw(st.booleans()),
        payload=b"" if status is not None else draw(st.binary(max_size=max_payload)),
    )
    return d, encode_datagram(d)
