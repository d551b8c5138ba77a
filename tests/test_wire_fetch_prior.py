"""Regression: the fetch writer's "prior Subgroup ID" after an object in Subgroup 0.

Found by the caprid cross-check: objects (2,1) in Subgroup 1, (2,2) in Subgroup 0,
an End-of-Range marker, then (4,0) in Subgroup 1. The writer's fast path for the
next object of a run wrote (2,2) with mode 0 but kept 1 as the prior Subgroup ID,
so it wrote (4,0) with mode 1 ("prior's"), which every decoder reads as 0.
"""

from __future__ import annotations

from kvcs_core.wire.codes import EndOfRange, GroupOrder
from kvcs_core.wire.fetch import (
    EndOfRangeMarker,
    FetchObject,
    FetchStreamDecoder,
    encode_fetch_stream,
)
from kvcs_core.wire.names import Location


def _obj(g: int, o: int, sub: int) -> FetchObject:
    return FetchObject(group_id=g, object_id=o, subgroup_id=sub, publisher_priority=0, payload=b"")


def test_subgroup_zero_becomes_the_prior_subgroup() -> None:
    items = [
        _obj(2, 1, 1),
        _obj(2, 2, 0),
        EndOfRangeMarker(kind=EndOfRange.NON_EXISTENT, location=Location(3, 0)),
        _obj(4, 0, 1),
        _obj(4, 1, 1),
        _obj(4, 2, 0),
        _obj(4, 3, 0),
        _obj(4, 4, 1),
    ]
    raw = encode_fetch_stream(0, GroupOrder.ASCENDING, items)
    got = FetchStreamDecoder(GroupOrder.ASCENDING).feed(raw)
    objects = [(i.group_id, i.object_id, i.subgroup_id) for i in got if isinstance(i, FetchObject)]
    assert objects == [(2, 1, 1), (2, 2, 0), (4, 0, 1), (4, 1, 1), (4, 2, 0), (4, 3, 0), (4, 4, 1)]
