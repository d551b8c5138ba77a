"""Cache files (``kvcs.adapters.cachefile``): both formats round-trip; defects are one-line
errors."""

from __future__ import annotations

import io
import json
import os
import struct
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcs.adapters.cachefile import (
    CacheFile,
    CacheFileError,
    CacheLayers,
    check_out_path,
    destination_layers,
    full_range_integers,
    llama_descriptor,
    load,
    open_layers,
    same_bits,
    save,
    save_layers,
    synthetic,
    synthetic_layers,
)
from kvcs.adapters.numpy_kv import KvDestination, layer_sections

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


# --- memory: a cache is held once (issue 11, "Memory") ----------------------------------------

MIB = 1 << 20
BIG = llama_descriptor(layers=16, kv_heads=8, head_dim=128, block_tokens=16)
"""16 layers x 8 heads x 128, bfloat16: 64 KiB of K+V per token."""


def _peak(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the peak of traced memory (numpy's arrays included) above the start."""
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak - base


@pytest.fixture(scope="module")
def big_cache() -> CacheFile:
    return synthetic(BIG, 256, seed=3)  # 16 MiB


def _nbytes(cache: CacheFile) -> int:
    return int(cache.k.nbytes + cache.v.nbytes)


def test_load_of_an_npz_holds_the_cache_once(tmp_path: Path, big_cache: CacheFile) -> None:
    """The arrays are inflated straight from the file: the file's octets are never held
    whole beside them (that was twice the cache)."""
    path = tmp_path / "c.npz"
    save(path, big_cache)
    got, peak = _peak(lambda: load(path))
    assert np.array_equal(got.k, big_cache.k) and np.array_equal(got.v, big_cache.v)
    assert peak < 1.1 * _nbytes(big_cache) + 2 * MIB, peak


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_save_writes_layer_by_layer(tmp_path: Path, big_cache: CacheFile, suffix: str) -> None:
    """Nothing of the cache is copied whole to write it (safetensors made a bytes copy of
    all of K, then of V)."""
    path = tmp_path / f"c{suffix}"
    _, peak = _peak(lambda: save(path, big_cache))
    assert peak < 4 * MIB, peak
    got = load(path)
    assert got.tokens == big_cache.tokens
    assert np.array_equal(got.k, big_cache.k) and np.array_equal(got.v, big_cache.v)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_open_layers_reads_one_layer_at_a_time(
    tmp_path: Path, big_cache: CacheFile, suffix: str
) -> None:
    path = tmp_path / f"c{suffix}"
    save(path, big_cache)
    source = open_layers(path)
    assert source.descriptor == big_cache.descriptor and source.tokens == big_cache.tokens
    layer_bytes = _nbytes(big_cache) // BIG["layers"]

    def walk() -> bool:
        same = True
        for layer, (k, v) in enumerate(source.layers()):
            same &= np.array_equal(k, big_cache.k[layer]) and np.array_equal(v, big_cache.v[layer])
            assert k.flags.c_contiguous and k.flags.writeable
        return same

    same, peak = _peak(walk)
    assert same
    assert peak < 3 * layer_bytes + 2 * MIB, (peak, layer_bytes)
    _, peak = _peak(source.check)
    assert peak < 3 * layer_bytes + 2 * MIB, (peak, layer_bytes)


def test_open_layers_refuses_what_load_refuses(tmp_path: Path) -> None:
    cache = synthetic(SMALL, 8, 1)
    with pytest.raises(CacheFileError, match="no such file"):
        open_layers(tmp_path / "absent.npz")
    save(tmp_path / "w.npz", CacheFile(cache.descriptor, cache.tokens[:4], cache.k, cache.v))
    with pytest.raises(CacheFileError, match="shape"):
        open_layers(tmp_path / "w.npz")
    save(
        tmp_path / "w.safetensors", CacheFile(cache.descriptor, cache.tokens[:4], cache.k, cache.v)
    )
    with pytest.raises(CacheFileError, match="shape"):
        open_layers(tmp_path / "w.safetensors")
    # a corrupt octet in the data: refused by check() (the member's CRC-32), as by load()
    big = synthetic(llama_descriptor(layers=4, kv_heads=2, head_dim=64), 256, 3)
    path = tmp_path / "crc.npz"
    save(path, big)
    raw = bytearray(path.read_bytes())
    at = raw.find(big.k[3].tobytes()[:64])
    raw[at + 5] ^= 1
    path.write_bytes(bytes(raw))
    source = open_layers(path)
    with pytest.raises(CacheFileError, match="CRC"):
        source.check()
    with pytest.raises(CacheFileError, match="CRC"):
        load(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("tokens", [12, 13, 3])
def test_synthetic_layers_are_synthetic_bits(dtype: str, tokens: int) -> None:
    desc = llama_descriptor(layers=3, kv_heads=2, head_dim=8, block_tokens=4, dtype=dtype)
    whole = synthetic(desc, tokens, 9)
    layers = synthetic_layers(desc, tokens, 9)
    assert layers.tokens == whole.tokens and layers.descriptor == whole.descriptor
    got = layers.load()
    assert np.array_equal(got.k.view(np.uint8), whole.k.view(np.uint8))
    assert np.array_equal(got.v.view(np.uint8), whole.v.view(np.uint8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize(("layers", "tokens"), [(3, 1), (4, 1), (3, 12), (4, 12), (2, 13)])
def test_synthetic_layers_jump_or_draw_to_v(dtype: str, layers: int, tokens: int) -> None:
    # V's generator reaches V's start by PCG64.advance when K is whole 64-bit outputs and
    # the token IDs left no half-used one (seed 9: 12 tokens leave none, 1 and 13 leave
    # one), else by drawing K; 3 layers of 4 bytes per token are not whole outputs.
    head_dim = 2 if dtype == "bfloat16" else 4
    desc = llama_descriptor(
        layers=layers, kv_heads=1, head_dim=head_dim, block_tokens=1, dtype=dtype
    )
    whole = synthetic(desc, tokens, 9)
    got = synthetic_layers(desc, tokens, 9).load()
    assert np.array_equal(got.k.view(np.uint8), whole.k.view(np.uint8))
    assert np.array_equal(got.v.view(np.uint8), whole.v.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("shape", [(2, 3, 16), (1, 1, 5), (3, 7), (0,)])
@pytest.mark.parametrize("half_used", [False, True])
def test_full_range_integers_are_numpys(
    dtype: Any, shape: tuple[int, ...], half_used: bool
) -> None:
    # the raw-output path (whole 64-bit outputs, none half used) and the fallback both
    # give numpy's own values, and the generator goes on to the same next draws
    want_gen, got_gen = np.random.default_rng(21), np.random.default_rng(21)
    if half_used:  # one 32-bit draw leaves half an output waiting
        want_gen.integers(0, 2**32, dtype=np.uint32)
        got_gen.integers(0, 2**32, dtype=np.uint32)
    dt = np.dtype(dtype)
    want = want_gen.integers(0, np.iinfo(dt).max + 1, size=shape, dtype=dt)
    got = full_range_integers(got_gen, shape, dt)
    assert got.dtype == dt and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.array_equal(got_gen.integers(0, 1000, size=9), want_gen.integers(0, 1000, size=9))
    assert np.array_equal(
        got_gen.integers(0, 2**32, size=3, dtype=np.uint32),
        want_gen.integers(0, 2**32, size=3, dtype=np.uint32),
    )


def test_synthetic_layers_hold_one_layer(big_cache: CacheFile) -> None:
    layers = synthetic_layers(BIG, 256, 3)
    layer_bytes = _nbytes(big_cache) // BIG["layers"]
    same, peak = _peak(
        lambda: all(
            np.array_equal(k, big_cache.k[i]) and np.array_equal(v, big_cache.v[i])
            for i, (k, v) in enumerate(layers.layers())
        )
    )
    assert same
    assert peak < 3 * layer_bytes + 2 * MIB, (peak, layer_bytes)


def test_a_destination_is_verified_and_written_without_a_second_copy(
    tmp_path: Path, big_cache: CacheFile
) -> None:
    """What ``kvcs fetch --out`` does with its destination: compared with the source
    (same_bits) and written (save_layers) one layer at a time; it stacked every layer
    into new arrays (two more copies of the cache) before."""
    cd = big_cache.cd
    tokens = 240  # a shorter prompt: 15 of the 16 blocks
    dest = KvDestination(cd, tokens)
    for layer in range(cd.layers):
        s = layer_sections(big_cache.k[layer], big_cache.v[layer], cd, blocks=tokens // 16)
        np.copyto(
            np.frombuffer(dest.buffer(layer, "k"), np.uint8), np.frombuffer(s.k_data, np.uint8)
        )
        np.copyto(
            np.frombuffer(dest.buffer(layer, "v"), np.uint8), np.frombuffer(s.v_data, np.uint8)
        )
    source = CacheLayers.of(big_cache)
    layer_bytes = _nbytes(big_cache) // cd.layers
    same, peak = _peak(lambda: same_bits(source, dest, tokens))
    assert same
    assert peak < 2 * layer_bytes + 2 * MIB, peak
    path = tmp_path / "out.npz"
    k, v = destination_layers(dest, tokens)
    _, peak = _peak(
        lambda: save_layers(path, big_cache.descriptor, big_cache.tokens[:tokens], k, v)
    )
    assert peak < 2 * layer_bytes + 2 * MIB, peak
    got = load(path)
    assert got.tokens == big_cache.tokens[:tokens]
    assert np.array_equal(got.k, big_cache.k[:, :, :tokens]) and np.array_equal(
        got.v, big_cache.v[:, :, :tokens]
    )
    changed = np.frombuffer(dest.buffer(cd.layers - 1, "v"), np.uint8)
    changed[-1] ^= 1
    assert not same_bits(source, dest, tokens)
