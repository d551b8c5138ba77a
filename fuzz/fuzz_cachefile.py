"""Fuzz the cache-file readers (``kvcs.adapters.cachefile.loads``): files are untrusted input.

Invariant: any bytes give a :class:`~kvcs.adapters.cachefile.CacheFile` that passes
``check()`` or a ``CacheFileError``; any other exception is a bug (``kvcs
publish --file`` would print a traceback). A file that loads also saves and
loads back to the same descriptor, tokens and bits.

Input format: byte 0 bit 0 picks the reader (1: safetensors, 0: npz); the
rest is the file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from fuzzlib import fuzz_main

from kvcs.adapters.cachefile import CacheFile, CacheFileError, loads, save


def check(data: bytes) -> None:
    safetensors = bool(data[0] & 1) if data else False
    try:
        cache = loads(data[1:], safetensors=safetensors)
    except CacheFileError as exc:
        assert str(exc), "an error without a message"
        return
    assert isinstance(cache, CacheFile)
    cache.check()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("c.safetensors" if safetensors else "c.npz")
        save(path, cache)
        again = loads(path.read_bytes(), safetensors=safetensors)
    assert again.descriptor == cache.descriptor and again.tokens == cache.tokens
    assert np.array_equal(again.k.view(np.uint8), np.ascontiguousarray(cache.k).view(np.uint8))
    assert np.array_equal(again.v.view(np.uint8), np.ascontiguousarray(cache.v).view(np.uint8))


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
