"""Fuzz the control-message decoders: ``ControlStreamDecoder`` and ``decode_message``.

Invariant: any input yields items or CodecError; any other exception is a bug.

The input's first two bytes choose a split point (``FuzzedDataProvider``, see
``fuzzlib.split_input``); the rest is the bytes of one control (or request)
stream, ended by FIN. For those bytes:

* ``ControlStreamDecoder`` fed whole, split at the fuzzer-chosen point, and one
  byte at a time (short inputs) gives the same messages, or the same error
  code (split-invariance); a failed decoder keeps failing with that code;
* repeated ``decode_message`` over the buffer agrees with the stream decoder
  (``NEED_MORE`` at the end is the FIN-inside-a-message error);
* every decoded message re-encodes with ``encode_message`` to a frame that
  ``decode_message`` reads back, whole, as an equal message.
"""

from __future__ import annotations

from fuzzlib import (
    Outcome,
    assert_same_outcome,
    chunkings,
    fuzz_main,
    normalize,
    run_stream,
    split_input,
)

from kvcs_core.wire.codes import SessionErrorCode
from kvcs_core.wire.errors import NEED_MORE, CodecError
from kvcs_core.wire.messages import ControlStreamDecoder, decode_message, encode_message


def one_shot(body: bytes) -> Outcome:
    """What repeated ``decode_message`` makes of a whole stream."""
    view = memoryview(body)
    items = []
    pos = 0
    try:
        while pos < len(body):
            got = decode_message(view[pos:])
            if got is NEED_MORE:
                return Outcome(tuple(items), int(SessionErrorCode.PROTOCOL_VIOLATION))
            msg, used = got
            assert 0 < used <= len(body) - pos, f"decode_message used {used} bytes"
            items.append(normalize(msg))
            pos += used
    except CodecError as e:
        return Outcome(tuple(items), int(e.code))
    return Outcome(tuple(items), None)


def check(data: bytes) -> None:
    body, cut = split_input(data)
    results = [
        (name, run_stream(ControlStreamDecoder, chunks)) for name, chunks in chunkings(body, cut)
    ]
    results.append(("decode_message", one_shot(body)))
    assert_same_outcome(results)
    for msg in results[0][1].raw:
        frame = encode_message(msg)
        again = decode_message(frame)
        assert again is not NEED_MORE, f"re-encoded {type(msg).__name__} is incomplete"
        msg2, used = again
        assert used == len(frame), f"re-encoded {type(msg).__name__}: used {used} of {len(frame)}"
        assert normalize(msg2) == normalize(msg), f"{type(msg).__name__} changed in a round trip"


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
