"""Helpers shared by the fuzz harnesses (not a harness itself).

* :func:`split_input` takes the fuzzer-chosen split point from the input, the
  way ``atheris.FuzzedDataProvider`` does (``ConsumeUInt(2)`` reads the first two
  bytes, little-endian); without atheris installed it computes the very same
  thing, so a corpus file means the same to atheris and to the hypothesis smoke
  test.
* :func:`normalize` turns decoded items into plain comparable values
  (payload memoryviews become ``bytes``), so that "the same items" means the
  same bytes, however the decoder produced them.
* :func:`run_stream` feeds chunks to an incremental decoder and records the
  outcome: the items (normalized *when returned*, and checked again at the end
  so a payload view that changes after it was handed out is caught) and the
  error code, if any.
* :func:`assert_same_outcome` is the split-invariance check.
"""

from __future__ import annotations

import enum
import gc
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import attrs

from kvcs_core.wire.errors import CodecError

try:
    import atheris
except ImportError:  # the hypothesis smoke test runs without it
    atheris = None

SPLIT_SEED_BYTES = 2
"""Bytes at the start of every fuzz input that choose the split point."""

BYTEWISE_MAX = 96
"""Inputs up to this long are also fed one byte at a time."""


def instrument_package(*prefixes: str) -> int:
    """Add atheris coverage instrumentation to every loaded function under ``prefixes``.

    A prefix is a dotted module name: ``"kvcs_core"`` takes the whole core,
    ``"kvcs_core.relay"`` only the relay's modules. ``atheris.instrument_all()``
    does this for *every* loaded function, which takes many seconds per harness
    start; the code under test is only ours. Without prefixes: ``kvcs_core``.
    Returns the number of functions instrumented.
    """
    assert atheris is not None, "atheris is not installed"
    wanted = prefixes or ("kvcs_core",)
    count = 0
    for obj in gc.get_objects():
        if not isinstance(obj, types.FunctionType):
            continue
        module = getattr(obj, "__module__", None) or ""
        if module not in sys.modules or not _under(module, wanted):
            continue
        atheris.instrument_func(obj)
        count += 1
    return count


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def fuzz_main(check: Callable[[bytes], None], *, instrument: tuple[str, ...] = ()) -> None:
    """The atheris entry point of a harness: instrument ``instrument`` and fuzz ``check``.

    ``instrument`` names the packages whose coverage guides the fuzzer
    (:func:`instrument_package`; default: all of ``kvcs_core``). A harness whose
    inputs drive much code it does not target (the relay harness runs whole
    sessions) names only its target: uninstrumented code runs several times faster.
    """
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris (the fuzz extra)")
    n = instrument_package(*instrument)
    where = ", ".join(instrument or ("kvcs_core",))
    print(f"INFO: instrumented {n} functions of {where}", file=sys.stderr)
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()


def split_input(data: bytes) -> tuple[bytes, int]:
    """``(body, cut)``: the bytes to decode and a fuzzer-chosen cut in ``0..len(body)``."""
    if atheris is not None:
        fdp = atheris.FuzzedDataProvider(data)
        seed = fdp.ConsumeUInt(SPLIT_SEED_BYTES)
        body = fdp.ConsumeBytes(fdp.remaining_bytes())
    else:
        seed = int.from_bytes(data[:SPLIT_SEED_BYTES], "little")
        body = data[SPLIT_SEED_BYTES:]
    return body, seed % (len(body) + 1)


def with_split_seed(body: bytes, seed: int = 0) -> bytes:
    """A fuzz input that decodes ``body`` (what :func:`split_input` takes apart)."""
    return seed.to_bytes(SPLIT_SEED_BYTES, "little") + body


def normalize(value: Any) -> Any:
    """A plain, comparable, byte-exact copy of a decoded value.

    Bytes-like values become ``bytes``, enum members ``(class name, value)``,
    attrs instances ``(class name, ((field, value), ...))``, tuples and lists
    tuples, dicts and sets sorted tuples; anything else is kept as it is. The
    way to normalize is chosen once per type (:data:`_NORMALIZERS`): this runs
    for every item of every decode of every fuzz input, so it must be cheap.
    """
    try:
        f = _NORMALIZERS[type(value)]
    except KeyError:
        f = _NORMALIZERS[type(value)] = _normalizer_for(type(value))
    return f(value)


def _keep(value: Any) -> Any:
    return value


def _enum(value: Any) -> Any:
    return (type(value).__name__, value.value)


def _sequence(value: Any) -> Any:
    return tuple([normalize(v) for v in value])


def _mapping(value: Any) -> Any:
    return tuple(sorted((repr(k), normalize(v)) for k, v in value.items()))


def _set(value: Any) -> Any:
    return tuple(sorted(repr(normalize(v)) for v in value))


def _attrs_normalizer(cls: type) -> Callable[[Any], Any]:
    name = cls.__name__
    fields = tuple(a.name for a in attrs.fields(cls))

    def norm(value: Any) -> Any:
        return (name, tuple([(f, normalize(getattr(value, f))) for f in fields]))

    return norm


def _normalizer_for(cls: type) -> Callable[[Any], Any]:
    """How :func:`normalize` treats instances of ``cls`` (the checks in their old order)."""
    if cls in (int, str, bool, float, type(None)):
        return _keep
    if issubclass(cls, bytes | bytearray | memoryview):
        return bytes
    if issubclass(cls, enum.Enum):
        return _enum
    if attrs.has(cls):
        return _attrs_normalizer(cls)
    if issubclass(cls, tuple | list):
        return _sequence
    if issubclass(cls, dict):
        return _mapping
    if issubclass(cls, frozenset | set):
        return _set
    return _keep


_NORMALIZERS: dict[type, Callable[[Any], Any]] = {}
"""Per-type normalizers, filled by :func:`normalize` on first sight of a type."""


class StreamDecoder(Protocol):
    def feed(self, data: bytes) -> Sequence[Any]: ...
    def close(self) -> Any: ...


@dataclass(frozen=True)
class Outcome:
    """What a decoder made of one input: normalized items and the error code or None."""

    items: tuple[Any, ...]
    error: int | None
    raw: tuple[Any, ...] = ()

    def describe(self) -> str:
        err = "no error" if self.error is None else f"CodecError code {self.error:#x}"
        return f"{len(self.items)} items, {err}"


def run_stream(make: Callable[[], StreamDecoder], chunks: Iterable[bytes]) -> Outcome:
    """Feed ``chunks`` then FIN (``close()``); only :class:`CodecError` may escape the decoder."""
    dec = make()
    raw: list[Any] = []
    seen: list[Any] = []
    error: int | None = None
    try:
        for chunk in chunks:
            got = dec.feed(chunk)
            raw.extend(got)
            seen.extend(normalize(x) for x in got)
        extra = dec.close()
        if isinstance(extra, list | tuple):  # a close() that flushes final items
            raw.extend(extra)
            seen.extend(normalize(x) for x in extra)
    except CodecError as e:
        error = int(e.code)
        # A failed decoder stays failed: the same error again, never anything else.
        try:
            dec.close()
        except CodecError as again:
            assert int(again.code) == error, f"error changed after failure: {again!r} vs {e!r}"
        else:
            raise AssertionError(f"close() succeeded after {e!r}") from None
    later = tuple(normalize(x) for x in raw)
    assert later == tuple(seen), "an item changed after it was returned (payload view reused?)"
    return Outcome(tuple(seen), error, tuple(raw))


def chunkings(body: bytes, cut: int, *, bytewise: bool = True) -> list[tuple[str, list[bytes]]]:
    """The ways each input is fed: whole, split at ``cut``, and byte-at-a-time if short.

    ``bytewise=False`` leaves out the byte-at-a-time feed (a harness that runs it
    for only some of its decoder variants).
    """
    ways = [("whole", [body]), (f"split@{cut}", [body[:cut], body[cut:]])]
    if bytewise and len(body) <= BYTEWISE_MAX:
        ways.append(("bytewise", [body[i : i + 1] for i in range(len(body))]))
    return ways


def assert_same_outcome(results: Sequence[tuple[str, Outcome]]) -> None:
    """Every way of feeding must give the same items, or the same error.

    When the input is bad, a chunked run may have returned the items completed
    before the bad bytes while a whole-buffer run raised at once, so on error
    the item lists need only be prefixes of one another; the error code must
    be the same.
    """
    (name0, first), *rest = results
    for name, other in rest:
        if other.error != first.error:
            raise AssertionError(f"different errors: {_where(name0, first, name, other)}")
        if first.error is None:
            if other.items != first.items:
                raise AssertionError(f"different items: {_where(name0, first, name, other)}")
        else:
            n = min(len(first.items), len(other.items))
            if other.items[:n] != first.items[:n]:
                where = _where(name0, first, name, other)
                raise AssertionError(f"different items before the error: {where}")


def _where(name0: str, first: Outcome, name: str, other: Outcome) -> str:
    # built only when a check fails: the messages cost more than the comparisons
    return f"{name0} ({first.describe()}) vs {name} ({other.describe()})"
