"""Fuzz the subgroup stream decoder, ``SubgroupStreamDecoder``.

Invariant: any input yields items or CodecError; any other exception is a bug.

The input's first two bytes choose a split point (``FuzzedDataProvider``, see
``fuzzlib.split_input``); the rest is one subgroup stream, ended by FIN. For
those bytes:

* fed whole, split at the fuzzer-chosen point, and one byte at a time (short
  inputs), the decoder gives the same header and objects (payloads compared
  byte for byte), or the same error code; items never change after they were
  returned (payload views stay valid), and a failed decoder keeps failing;
* ``DataStreamDecoder`` (which classifies the stream by its first vi64) agrees
  with ``SubgroupStreamDecoder`` whenever the stream type is a subgroup one;
* a stream that decodes cleanly re-encodes (``encode_subgroup_stream``, up to
  and including its first End of Group / End of Track object: the writer
  refuses objects after one) to bytes that decode to the same items.
"""

from __future__ import annotations

from fuzzlib import assert_same_outcome, chunkings, fuzz_main, normalize, run_stream, split_input

from kvcs_core.wire.codes import GroupOrder, ObjectStatus
from kvcs_core.wire.errors import CodecError
from kvcs_core.wire.objects import (
    DataStreamDecoder,
    SubgroupHeader,
    SubgroupObject,
    SubgroupStreamDecoder,
    UniStreamKind,
    encode_subgroup_stream,
    peek_uni_stream_type,
)


def _data_stream_decoder() -> DataStreamDecoder:
    return DataStreamDecoder(fetch_group_order=GroupOrder.ASCENDING)


def check(data: bytes) -> None:
    body, cut = split_input(data)
    ways = chunkings(body, cut)
    results = [(name, run_stream(SubgroupStreamDecoder, chunks)) for name, chunks in ways]
    try:
        kind = peek_uni_stream_type(body)
    except CodecError:
        kind = None
    if kind is UniStreamKind.SUBGROUP:
        results += [(f"data-{n}", run_stream(_data_stream_decoder, c)) for n, c in ways[:2]]
    assert_same_outcome(results)

    outcome = results[0][1]
    if outcome.error is not None or not outcome.raw:
        return
    header, *objects = outcome.raw
    assert isinstance(header, SubgroupHeader), f"first item is {type(header).__name__}"
    kept: list[SubgroupObject] = []
    for obj in objects:
        assert isinstance(obj, SubgroupObject), f"later item is {type(obj).__name__}"
        kept.append(obj)
        if obj.status is not ObjectStatus.NORMAL:
            break
    again = run_stream(SubgroupStreamDecoder, [encode_subgroup_stream(header, kept)])
    assert again.error is None, f"re-encoded stream fails with code {again.error:#x}"
    assert again.items == tuple(normalize(x) for x in [header, *kept]), "round trip changed items"


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
