"""Cache files (``adapters.cachefile``): both formats round-trip; defects are one-line errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from adapters.cachefile import CacheFile, CacheFileError, llama_descriptor, load, save, synthetic

SMALL = llama_descriptor(layers=2, kv_heads=2, head_dim=8, block_tokens=4)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    cache = synthetic(SMALL, 12, seed=5)
    path = tmp_path / f"c{suffix}"
    save(path, cache)
    got = load(path)
    assert got.descriptor == cache.descriptor and got.tokens == cache.tokens
    assert np.array_equal(got.k, cache.k) and np.array_equal(got.v, cache.v)


def test_synthetic_is_reproducible() -> None:
    a, b, c = synthetic(SMALL, 8, 1), synthetic(SMALL, 8, 1), synthetic(SMALL, 8, 2)
    assert a.tokens == b.tokens and np.array_equal(a.k, b.k)
    assert not np.array_equal(a.k, c.k)
    assert a.k.shape == (2, 2, 8, 8) and a.k.dtype == np.uint16


def _safetensors(header: object, data: bytes = b"") -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "too short"),
        (struct.pack("<Q", 1 << 40), "header length"),
        (_safetensors([1, 2]), "not a JSON object"),
        (_safetensors({"k": {}}), "kvcs_descriptor"),
        (_safetensors({"__metadata__": {"kvcs_descriptor": json.dumps(SMALL)}}), "no tensor"),
        (
            _safetensors(
                {
                    "__metadata__": {"kvcs_descriptor": json.dumps(SMALL)},
                    "k": {"dtype": "BF16", "shape": [2, 2, 4, 8], "data_offsets": [0, 999]},
                }
            ),
            "data_offsets",
        ),
    ],
)
def test_bad_safetensors_is_one_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CacheFileError, match=message):
        load(path)


def test_missing_and_garbage_npz(tmp_path: Path) -> None:
    with pytest.raises(CacheFileError, match="no such file"):
        load(tmp_path / "absent.npz")
    (tmp_path / "x.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(CacheFileError, match="cannot read"):
        load(tmp_path / "x.npz")


def test_shape_must_match_the_descriptor(tmp_path: Path) -> None:
    cache = synthetic(SMALL, 8, 1)
    wrong = CacheFile(cache.descriptor, cache.tokens[:4], cache.k, cache.v)
    with pytest.raises(CacheFileError, match="shape"):
        wrong.check()
    save(tmp_path / "w.npz", wrong)
    with pytest.raises(CacheFileError, match="shape"):
        load(tmp_path / "w.npz")
