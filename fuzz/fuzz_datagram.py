"""Fuzz the datagram decoder, ``decode_datagram`` (OBJECT_DATAGRAM and padding).

Invariant: any input yields items or CodecError; any other exception is a bug.

A datagram is complete by definition, so there is no "need more" and nothing
to feed in pieces. The input's first two bytes (``FuzzedDataProvider``, see
``fuzzlib.split_input``) still choose a split point, used here to place the
datagram inside a larger buffer: the rest of the input is decoded

* as ``bytes``, as a ``bytearray`` and as a ``memoryview`` slice of a buffer
  with other bytes before and after it (``cut`` bytes before), which must all
  give the same datagram (payload compared byte for byte) or the same error
  code: the decoder must honour the view's bounds;
* and a datagram that decodes re-encodes (``encode_datagram``) to bytes that
  decode to the same datagram.
"""

from __future__ import annotations

from fuzzlib import Outcome, assert_same_outcome, fuzz_main, normalize, split_input

from kvcs_core.wire.errors import CodecError
from kvcs_core.wire.objects import decode_datagram, encode_datagram

JUNK = b"\x7f\x40\xff" * 4


def decode(buf: bytes | bytearray | memoryview) -> Outcome:
    try:
        d = decode_datagram(buf)
    except CodecError as e:
        return Outcome((), int(e.code))
    return Outcome((normalize(d),), None, (d,))


def check(data: bytes) -> None:
    body, cut = split_input(data)
    framed = (JUNK * (cut // len(JUNK) + 1))[:cut] + body + JUNK
    results = [
        ("bytes", decode(body)),
        ("bytearray", decode(bytearray(body))),
        (f"view@{cut}", decode(memoryview(framed)[cut : cut + len(body)])),
    ]
    assert_same_outcome(results)
    outcome = results[0][1]
    if outcome.error is None:
        (d,) = outcome.raw
        again = decode(encode_datagram(d))
        assert again.error is None, f"re-encoded datagram fails with code {again.error:#x}"
        assert again.items == outcome.items, "round trip changed the datagram"


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
