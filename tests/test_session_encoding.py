"""The data pump's own subgroup object prefixes are the wire codec's bytes.

``Publisher._subgroup_prefix`` encodes object prefixes on the per-Object path
without the codec's per-call validation (the objects come from a TrackStore,
valid and ascending) and memoises the common ones; these tests hold it to
``SubgroupStreamWriter.object_prefix`` for any sequence of objects a store can
hold on one subgroup stream.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.output import Output
from kvcs_core.moqt.publishing import Publisher, _Kind, _Sender
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire.codes import ObjectStatus
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace
from kvcs_core.wire.subgroup import SubgroupHeader, SubgroupIdMode, SubgroupStreamWriter

_PROPS = st.lists(
    st.one_of(
        st.builds(KeyValuePair, st.sampled_from([2, 4, 0x3C]), st.integers(0, 2**62)),
        st.builds(KeyValuePair, st.sampled_from([1, 0x0B]), st.binary(max_size=20)),
    ),
    max_size=3,
).map(lambda ps: tuple(sorted(ps, key=lambda p: p.type)))

_OBJECT = st.tuples(
    st.integers(0, 300),  # gap before the Object ID
    st.one_of(st.just(0), st.integers(1, 70_000), st.integers(2**14, 2**20)),  # size
    _PROPS,
)

_HEADER = SubgroupHeader(
    track_alias=0,
    group_id=5,
    subgroup_id_mode=SubgroupIdMode.ZERO,
    subgroup_id=0,
    publisher_priority=128,
    has_properties=True,
    first_object=False,
)


@settings(max_examples=200, deadline=None)
@given(
    first=st.integers(0, 2**40),
    objects=st.lists(_OBJECT, min_size=1, max_size=12),
    end=st.sampled_from([None, ObjectStatus.END_OF_GROUP, ObjectStatus.END_OF_TRACK]),
)
def test_subgroup_prefixes_match_the_codec(
    first: int,
    objects: list[tuple[int, int, tuple[KeyValuePair, ...]]],
    end: ObjectStatus | None,
) -> None:
    store = TrackStore(FullTrackName(TrackNamespace.of("t"), b"x"))
    oid = first
    for gap, size, props in objects:
        oid += gap
        store.append(5, oid, bytes(size), properties=props)
        oid += 1
    if end is not None:
        store.append(5, oid, status=end)
    pub = Publisher(Output(), SessionConfig(role=Role.SERVER))
    for _round in range(2):  # the second round is served from the memo
        sender = _Sender(sid=0, kind=_Kind.SUBGROUP, served=None)  # type: ignore[arg-type]
        writer = SubgroupStreamWriter(_HEADER)
        for obj in store.objects_in(Location(0, 0)):
            want = writer.object_prefix(
                obj.location.object,
                payload_length=obj.size,
                status=obj.status,
                properties=obj.properties,
            )
            assert pub._subgroup_prefix(sender, obj) == want
