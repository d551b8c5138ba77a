"""Cache files (``adapters.cachefile``): both formats round-trip; defects are one-line errors."""

from __future__ import annotations

import io
import json
import os
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from adapters.cachefile import (
    CacheFile,
    CacheFileError,
    check_out_path,
    llama_descriptor,
    load,
    save,
    synthetic,
)

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
    with pytest.raises(CacheFileError, match="not a readable npz"):
        load(tmp_path / "x.npz")


def test_shape_must_match_the_descriptor(tmp_path: Path) -> None:
    cache = synthetic(SMALL, 8, 1)
    wrong = CacheFile(cache.descriptor, cache.tokens[:4], cache.k, cache.v)
    with pytest.raises(CacheFileError, match="shape"):
        wrong.check()
    save(tmp_path / "w.npz", wrong)
    with pytest.raises(CacheFileError, match="shape"):
        load(tmp_path / "w.npz")


# --- untrusted files (issue 10 findings 9 and 10) -------------------------------------------


def _npz_with(path: Path, members: dict[str, bytes], *, deflate: bool = True) -> None:
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr)
    return buf.getvalue()


def _members(cache: CacheFile) -> dict[str, bytes]:
    return {
        "k.npy": _npy(cache.k),
        "v.npy": _npy(cache.v),
        "tokens.npy": _npy(np.asarray(cache.tokens, dtype=np.uint32)),
        "descriptor.npy": _npy(np.frombuffer(json.dumps(cache.descriptor).encode(), np.uint8)),
    }


def test_a_zip_bomb_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    """64 MiB of zeros deflate to about 64 kB: refused from the declared sizes, with far
    less memory than the member would inflate to."""
    cache = synthetic(SMALL, 8, 1)
    members = _members(cache)
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            if name != "k.npy":
                zf.writestr(name, data)
        with zf.open("k.npy", "w") as f:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                header, {"descr": "<u2", "fortran_order": False, "shape": (32 << 20,)}
            )
            f.write(header.getvalue())
            zeros = bytes(1 << 20)
            for _ in range(64):
                f.write(zeros)
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(CacheFileError, match="zip bomb") as info:
            load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "\n" not in str(info.value)
    assert peak < 16 << 20, peak


def test_declared_shapes_are_checked_before_the_data_is_read(tmp_path: Path) -> None:
    """A stored (uncompressed) k whose npy header claims another shape than the descriptor
    and tokens give: refused from the header."""
    cache = synthetic(SMALL, 8, 1)
    members = _members(cache)
    members["k.npy"] = _npy(np.zeros((2, 2, 9, 8), np.uint16))
    path = tmp_path / "shape.npz"
    _npz_with(path, members, deflate=False)
    with pytest.raises(CacheFileError, match=r"k has shape \(2, 2, 9, 8\).*need \(2, 2, 8, 8\)"):
        load(path)
    members = _members(cache)
    members["tokens.npy"] = members["tokens.npy"][:-4]  # the header claims 8, the data has 7
    _npz_with(path, members)
    with pytest.raises(CacheFileError, match="truncated"):
        load(path)


def test_a_text_file_is_not_an_npz(tmp_path: Path) -> None:
    path = tmp_path / "notes.npz"
    path.write_text("hello, these are not arrays\n")
    with pytest.raises(CacheFileError, match="not an npz file"):
        load(path)


def test_directories_fifos_and_devices_are_named(tmp_path: Path) -> None:
    with pytest.raises(CacheFileError, match="is a directory"):
        load(tmp_path)
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    with pytest.raises(CacheFileError, match="is a FIFO"):  # never opened: no blocking
        load(fifo)
    with pytest.raises(CacheFileError, match="is a character device"):
        load("/dev/zero")


def test_a_safetensors_dtype_must_match_the_descriptor(tmp_path: Path) -> None:
    cache = synthetic(SMALL, 8, 1)
    path = tmp_path / "c.safetensors"
    save(path, cache)
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = raw[8 : 8 + n].replace(b'"dtype": "BF16"', b'"dtype": "F16" ', 1)
    assert len(header) == n
    path.write_bytes(raw[:8] + header + raw[8 + n :])
    with pytest.raises(CacheFileError, match=r"k has dtype 'F16'; the descriptor's bfloat16"):
        load(path)
    header = raw[8 : 8 + n].replace(b'"dtype": "U32"', b'"dtype": "F32"', 1)
    assert len(header) == n
    path.write_bytes(raw[:8] + header + raw[8 + n :])
    with pytest.raises(CacheFileError, match="tokens has dtype 'F32'"):
        load(path)


def test_save_writes_exactly_the_named_file(tmp_path: Path) -> None:
    cache = synthetic(SMALL, 8, 1)
    save(tmp_path / "x.cache", cache)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.cache"]
    assert load(tmp_path / "x.cache").tokens == cache.tokens


def test_out_paths_are_checked_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="suffix"):
        check_out_path(tmp_path / "x.pt")
    with pytest.raises(CacheFileError, match="cannot write"):
        check_out_path(tmp_path / "missing-dir" / "x.npz")
    with pytest.raises(CacheFileError, match="is a directory"):
        (tmp_path / "d.npz").mkdir()
        check_out_path(tmp_path / "d.npz")
    assert check_out_path(tmp_path / "ok.npz") == tmp_path / "ok.npz"
    assert not (tmp_path / "ok.npz").exists()  # nothing created
