"""Fuzz the fetch/fill stream decoder, ``FetchStreamDecoder``, in both group orders.

Invariant: any input yields items or CodecError; any other exception is a bug.

The input's first two bytes choose a split point (``FuzzedDataProvider``, see
``fuzzlib.split_input``); the rest is one fetch stream, ended by FIN. For each
group order (Ascending, Descending; the order changes how Group ID deltas are
applied) and for those bytes:

* fed whole, split at the fuzzer-chosen point, and (short inputs, in the
  *picked* order: Ascending when the cut is even, Descending when odd) one
  byte at a time, the decoder gives the same items (payloads compared byte for
  byte) or the same error code; items never change after they were returned,
  and a failed decoder keeps failing;
* in the picked order, a decoder given the order through a callable (called
  with the Request ID) agrees with one given the fixed order, and so does
  ``DataStreamDecoder``;
* a stream that decodes cleanly and that ``FetchStreamWriter`` can write (it
  refuses items out of the group order, which the decoder passes through as
  sent) re-encodes to bytes that decode to the same items.
"""

from __future__ import annotations

from collections.abc import Callable

from fuzzlib import assert_same_outcome, chunkings, fuzz_main, run_stream, split_input

from kvcs_core.wire.codes import GroupOrder
from kvcs_core.wire.errors import EncodeError
from kvcs_core.wire.objects import (
    DataStreamDecoder,
    EndOfRangeMarker,
    FetchHeader,
    FetchObject,
    FetchStreamDecoder,
    encode_fetch_stream,
)

ORDERS = (GroupOrder.ASCENDING, GroupOrder.DESCENDING)


def _fixed(order: GroupOrder) -> Callable[[], FetchStreamDecoder]:
    return lambda: FetchStreamDecoder(order)


def _via_callable(order: GroupOrder) -> Callable[[], FetchStreamDecoder]:
    return lambda: FetchStreamDecoder(lambda _request_id: order)


def _via_data_stream(order: GroupOrder) -> Callable[[], DataStreamDecoder]:
    return lambda: DataStreamDecoder(fetch_group_order=order)


def check_order(body: bytes, cut: int, order: GroupOrder, *, picked: bool) -> None:
    ways = chunkings(body, cut, bytewise=picked)
    results = [(f"{order.name} {n}", run_stream(_fixed(order), c)) for n, c in ways]
    if picked:
        results.append((f"{order.name} callable", run_stream(_via_callable(order), ways[1][1])))
        if body[:1] == b"\x05":  # DataStreamDecoder classifies 0x05 as a fetch stream
            results.append(
                (f"{order.name} data-stream", run_stream(_via_data_stream(order), [body]))
            )
    assert_same_outcome(results)

    outcome = results[0][1]
    if outcome.error is not None or not outcome.raw:
        return
    header, *items = outcome.raw
    assert isinstance(header, FetchHeader), f"first item is {type(header).__name__}"
    for it in items:
        assert isinstance(it, FetchObject | EndOfRangeMarker), f"item {type(it).__name__}"
    try:
        encoded = encode_fetch_stream(header.request_id, order, items)
    except EncodeError:
        return  # out of order for the writer; the decoder reports IDs as sent
    again = run_stream(_fixed(order), [encoded])
    assert again.error is None, f"re-encoded stream fails with code {again.error:#x}"
    assert again.items == outcome.items, f"{order.name}: round trip changed items"


def check(data: bytes) -> None:
    body, cut = split_input(data)
    for order in ORDERS:
        # The byte-at-a-time feed, the callable and DataStreamDecoder run in the
        # order that the cut's parity picks (the fuzzer flips that bit as easily
        # as any other): they cost more than everything else together, and they
        # test what is the same in both orders (the state machine, how the order
        # is obtained); whole, split and the round trip run in both.
        check_order(body, cut, order, picked=order is ORDERS[cut & 1])


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
