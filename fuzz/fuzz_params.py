"""Fuzz the Message Parameter reader (every scope) and the Key-Value-Pair reader.

Invariant: any input yields items or CodecError; any other exception is a bug.

The input's first two bytes choose a split point (``FuzzedDataProvider``, see
``fuzzlib.split_input``); the rest is decoded

* as a parameter block by ``read_parameters`` (and its exact-length wrapper
  ``decode_parameters``) with every scope set (every ``*_PARAMS`` frozenset of
  ``params.py`` / ``scopes.py``): ``read_parameters`` returns a block, or raises
  CodecError, or (internal, "need more") ``Incomplete``; the block read from a
  prefix cut at the fuzzer-chosen point is "need more" when the cut falls inside
  the block and the same block otherwise (a strict prefix is never an error);
  ``decode_parameters`` agrees with it; a decoded block re-encodes
  (``parameters_bytes``) to bytes that decode to the same block;
* as a KVP list by ``kvcs_core.wire.kvp.read_kvps`` over the whole input and
  over a view of it placed ``cut`` bytes into a larger buffer (same pairs or
  same error code); decoded pairs re-encode (``kvps_bytes``) to the same pairs.
"""

from __future__ import annotations

import contextlib
import importlib

from fuzzlib import fuzz_main, normalize, split_input

from kvcs_core.wire import params as P
from kvcs_core.wire.errors import CodecError, Incomplete
from kvcs_core.wire.kvp import kvps_bytes, read_kvps


def _scopes() -> dict[str, frozenset[int]]:
    names: dict[str, object] = dict(vars(P))
    with contextlib.suppress(ImportError):  # the scope table may have its own module
        names.update(vars(importlib.import_module("kvcs_core.wire.scopes")))
    by_value: dict[frozenset[int], str] = {}
    for name, value in sorted(names.items()):
        is_scope = name.endswith("_PARAMS") and name != "REPEATABLE_PARAMS"
        if is_scope and isinstance(value, frozenset):
            by_value.setdefault(value, name)  # equal sets decode alike: keep one name
    return {name: value for value, name in by_value.items()}


SCOPES = _scopes()
"""Every distinct scope set the params module defines, by (first) name."""

assert len(SCOPES) >= 8, f"expected the *_PARAMS scope sets, found {sorted(SCOPES)}"

JUNK = b"\xc0\x41\xff" * 4


def read(buf: bytes, scope: frozenset[int], name: str) -> tuple[object, int] | int | None:
    """``(normalized block, end)``, the CodecError code, or ``None`` for "need more"."""
    try:
        block, end = P.read_parameters(buf, 0, allowed=scope, context=name)
    except Incomplete:
        return None
    except CodecError as e:
        return int(e.code)
    assert 0 < end <= len(buf), f"{name}: end {end} outside 1..{len(buf)}"
    return normalize(block), end


def check_scope(body: bytes, cut: int, name: str, scope: frozenset[int]) -> None:
    whole = read(body, scope, name)
    try:
        exact = P.decode_parameters(body, allowed=scope, context=name)
    except CodecError as e:
        exact_result: object = int(e.code)
    else:
        exact_result = normalize(exact)
        assert isinstance(whole, tuple), f"{name}: decode_parameters ok, read_parameters {whole}"
        assert whole == (exact_result, len(body)), f"{name}: readers disagree"
        again = P.decode_parameters(P.parameters_bytes(exact), allowed=scope, context=name)
        assert normalize(again) == exact_result, f"{name}: round trip changed the block"
    if isinstance(whole, tuple):
        block, end = whole
        if end == len(body):
            assert exact_result == block, f"{name}: decode_parameters gives {exact_result}"
        prefix = read(body[:cut], scope, name)
        if cut < end:
            assert prefix is None, f"{name}: prefix of {cut}/{end} bytes gives {prefix}"
        else:
            assert prefix == whole, f"{name}: prefix of {cut} bytes gives {prefix}"


def kvps(buf: bytes | memoryview, start: int, end: int) -> object:
    try:
        return normalize(read_kvps(buf, start, end))
    except CodecError as e:
        return int(e.code)


def check_kvps(body: bytes, cut: int) -> None:
    plain = kvps(body, 0, len(body))
    framed = (JUNK * (cut // len(JUNK) + 1))[:cut] + body + JUNK
    placed = kvps(memoryview(framed), cut, cut + len(body))
    assert placed == plain, f"read_kvps at offset {cut}: {placed!r} != {plain!r}"
    if not isinstance(plain, int):
        pairs = read_kvps(body, 0, len(body))
        encoded = kvps_bytes(pairs)
        assert kvps(encoded, 0, len(encoded)) == plain, "KVP round trip changed the pairs"


def check(data: bytes) -> None:
    body, cut = split_input(data)
    for name, scope in SCOPES.items():
        check_scope(body, cut, name, scope)
    check_kvps(body, cut)


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
