"""KV caches on disk: ``.npz`` and safetensors files that ``kvcs publish`` reads and ``kvcs fetch``
writes, plus the synthetic Llama-shaped cache the demo and the tests use.

A cache file holds what a publisher needs and a consumer produces:

* ``k`` and ``v``: engine arrays ``[layers, kv_heads, tokens, head_dim]`` (HND) of
  the descriptor's raw dtype (:func:`adapters.numpy_kv.engine_dtype`: bfloat16 as
  ``uint16`` bit patterns, float8 as ``uint8``);
* ``tokens``: the token IDs (u32) the cache was computed for;
* the KVSP Compatibility Descriptor (JSON).

``.npz``: arrays ``k``, ``v``, ``tokens`` and ``descriptor`` (the JSON as UTF-8
bytes in a ``uint8`` array). ``.safetensors``: tensors ``k``, ``v`` (``BF16``,
``F16``, ``F32``, ``F8_E4M3``/``F8_E5M2`` as stored) and ``tokens`` (``U32``),
the descriptor as the ``kvcs_descriptor`` metadata string; read and written
here directly (8-octet header length, JSON header, data), no extra package.

Every problem with a file is a :class:`CacheFileError` with a one-line message.
"""

from __future__ import annotations

import io
import json
import math
import stat
import struct
import typing
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from adapters.numpy_kv import KvDestination, engine_dtype
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

_SAFETENSORS_DTYPE = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_TOKEN_DTYPES: dict[str, np.dtype[Any]] = {
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
}
_MAX_HEADER = 16 * 1024 * 1024
MAX_CACHE_BYTES = 1 << 36
"""The largest cache file read (64 GiB), and the most octets ``k`` or ``v`` may declare."""
MAX_TOKENS = 1 << 24
"""The most tokens a cache file may declare (16 Mi)."""
_MAX_SMALL = 16 * 1024 * 1024
"""The most octets the ``descriptor`` member may declare."""
_MAX_RATIO = 256
"""A member may declare at most this many times its compressed size (plus 1 MiB): KV data
barely compresses, and a zip bomb is refused before anything is inflated."""
_NPY_HEADER_MAX = 64 * 1024
_CHUNK = 1 << 20
_SUFFIXES = (".npz", ".safetensors")


class CacheFileError(ValueError):
    """A cache file is missing, unreadable or inconsistent."""


@attrs.frozen(eq=False)
class CacheFile:
    """A KV cache with its descriptor and tokens (engine layout HND)."""

    descriptor: dict[str, Any]
    tokens: tuple[int, ...]
    k: np.ndarray[Any, Any]
    v: np.ndarray[Any, Any]

    @property
    def cd(self) -> CompatibilityDescriptor:
        return CompatibilityDescriptor(dict(self.descriptor))

    def check(self) -> None:
        """Raise :class:`CacheFileError` unless shapes and dtypes match the descriptor."""
        try:
            cd = self.cd
        except ValueError as exc:
            raise CacheFileError(f"bad descriptor: {exc}") from None
        want = (cd.layers, cd.kv_heads, len(self.tokens), cd.head_dim)
        dtype = engine_dtype(cd.dtype)
        for name, arr in (("k", self.k), ("v", self.v)):
            if arr.shape != want:
                raise CacheFileError(
                    f"{name} has shape {arr.shape}, the descriptor and "
                    f"{len(self.tokens)} tokens need {want}"
                )
            if arr.dtype != dtype:
                raise CacheFileError(f"{name} has dtype {arr.dtype}, {cd.dtype} needs {dtype}")
        if len(self.tokens) < cd.block_tokens:
            raise CacheFileError(f"{len(self.tokens)} tokens hold no full block")
        if any(not 0 <= t < 1 << 32 for t in self.tokens):
            raise CacheFileError("token IDs must be u32")


def same_bits(source: CacheFile, dest: KvDestination, tokens: int) -> bool:
    """Whether ``dest`` holds exactly ``source``'s K and V bits for the first ``tokens``."""
    for layer in range(source.cd.layers):
        k, v = dest.as_engine_arrays(layer)
        if not (
            np.array_equal(k[:, :tokens], source.k[layer, :, :tokens])
            and np.array_equal(v[:, :tokens], source.v[layer, :, :tokens])
        ):
            return False
    return True


def file_kind(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file ("no such file", "a directory", "a
    FIFO", ...), else None. Only ``stat``: a FIFO is never opened (it would block)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def load(path: str | Path, *, max_bytes: int = MAX_CACHE_BYTES) -> CacheFile:
    """Read a ``.npz`` or ``.safetensors`` cache file (any other suffix is read as ``.npz``).

    Raises:
        CacheFileError: not a regular file (missing, a directory, a FIFO, a device),
            larger than ``max_bytes``, unreadable or malformed; one line.
    """
    path = Path(path)
    kind = file_kind(path)
    if kind == "no such file":
        raise CacheFileError(f"no such file: {path}")
    if kind is not None:
        raise CacheFileError(f"{path} is {kind}, not a cache file")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CacheFileError(f"{path}: {size} octets, more than the limit of {max_bytes}")
        raw = path.read_bytes()
    except OSError as exc:
        raise CacheFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    return loads(raw, safetensors=path.suffix == ".safetensors", name=str(path))


def check_out_path(path: str | Path) -> Path:
    """Refuse an output path that :func:`save` could not write exactly, before any work:
    a suffix other than ``.npz`` / ``.safetensors`` (``ValueError``), or a place that
    cannot be written (:class:`CacheFileError`). Creates nothing that was not there."""
    path = Path(path)
    if path.suffix not in _SUFFIXES:
        raise ValueError(f"{path}: the suffix must be .npz or .safetensors")
    kind = file_kind(path)
    if kind is not None and kind != "no such file":
        raise CacheFileError(f"cannot write {path}: it is {kind}")
    existed = kind is None
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise CacheFileError(f"cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()
    return path


def loads(raw: bytes, *, safetensors: bool, name: str = "<bytes>") -> CacheFile:
    """Parse a cache file's bytes; every defect is a :class:`CacheFileError`."""
    try:
        if safetensors:
            cache = _parse_safetensors(raw, name)
        else:
            try:
                cache = _parse_npz(raw, name)
            except CacheFileError:
                raise
            except Exception as exc:
                raise CacheFileError(
                    f"cannot read {name}: {type(exc).__name__}: {exc}"[:300]
                ) from None
    except CacheFileError:
        raise
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        OverflowError,
        struct.error,
        RecursionError,
    ) as exc:
        raise _unreadable(name, exc) from None
    cache.check()
    return cache


def save(path: str | Path, cache: CacheFile) -> None:
    """Write ``cache`` to exactly ``path``: ``.safetensors`` by suffix, else ``.npz`` format
    (callers check the suffix with :func:`check_out_path`)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            _save_safetensors(path, cache)
        else:
            with path.open("wb") as f:  # a file object: numpy would append ".npz" to a name
                np.savez(
                    f,
                    k=cache.k,
                    v=cache.v,
                    tokens=np.asarray(cache.tokens, dtype=np.uint32),
                    descriptor=np.frombuffer(json.dumps(cache.descriptor).encode(), np.uint8),
                )
    except OSError as exc:
        raise CacheFileError(f"cannot write {path}: {exc.strerror or exc}") from None


def _unreadable(name: str, exc: BaseException) -> CacheFileError:
    return CacheFileError(f"cannot read {name}: {type(exc).__name__}: {exc}"[:300])


def _parse_npz(raw: bytes, name: str) -> CacheFile:
    """An ``.npz`` read without trusting what it declares: the zip members' sizes and the
    npy headers are checked against the limits and against the descriptor and tokens
    before anything large is inflated, and inflating is bounded by them."""
    if raw[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise CacheFileError(f"{name} is not an npz file (not a zip archive)")
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as exc:
        raise CacheFileError(f"{name}: not a readable npz (zip) file: {exc}") from None
    with zf:
        members = {info.filename: info for info in zf.infolist()}
        missing = {"k", "v", "tokens", "descriptor"} - {n.removesuffix(".npy") for n in members}
        if missing:
            raise CacheFileError(f"{name}: missing arrays {sorted(missing)}")
        for info in members.values():
            if info.file_size > _MAX_RATIO * info.compress_size + _CHUNK:
                raise CacheFileError(
                    f"{name}: member {info.filename!r} declares {info.file_size} octets from "
                    f"{info.compress_size} compressed (a zip bomb?)"
                )
        small = _NPY_HEADER_MAX + _MAX_SMALL
        raw_desc = _npy(zf, members["descriptor.npy"], name, "descriptor", small, None)
        if raw_desc.dtype != np.uint8 or raw_desc.ndim != 1:
            raise CacheFileError(f"{name}: descriptor must be a 1-D uint8 array (JSON)")
        descriptor = _descriptor(json.loads(raw_desc.tobytes().decode()), name)
        limit = _NPY_HEADER_MAX + 8 * MAX_TOKENS
        tokens = _npy(zf, members["tokens.npy"], name, "tokens", limit, None)
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise CacheFileError(f"{name}: tokens must be a 1-D integer array")
        cd = CompatibilityDescriptor(dict(descriptor))
        shape = (cd.layers, cd.kv_heads, len(tokens), cd.head_dim)
        dtype = engine_dtype(cd.dtype)
        arrays = [
            _npy(zf, members[f"{key}.npy"], name, key, MAX_CACHE_BYTES, (shape, dtype))
            for key in ("k", "v")
        ]
        return CacheFile(descriptor, tuple(int(t) for t in tokens), arrays[0], arrays[1])


def _npy(
    zf: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    name: str,
    key: str,
    limit: int,
    expect: tuple[tuple[int, ...], np.dtype[Any]] | None,
) -> np.ndarray[Any, Any]:
    """One ``.npy`` member: its header read and checked first (``expect``: the shape and
    dtype it must have), then exactly the octets the header implies, read in chunks into
    the array (never more than the header implies, which is within ``limit``)."""
    if info.file_size > limit:
        raise CacheFileError(f"{name}: {key} declares {info.file_size} octets (limit {limit})")
    with zf.open(info) as f:
        stream = typing.cast(io.BufferedIOBase, f)  # a ZipExtFile
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"npy version {version}")
        except ValueError as exc:
            raise CacheFileError(f"{name}: {key} is not a valid npy array: {exc}"[:300]) from None
        if dtype.hasobject or dtype.itemsize == 0 or fortran:
            raise CacheFileError(f"{name}: {key} has an unsupported dtype or layout ({dtype})")
        if expect is not None:
            if tuple(shape) != expect[0]:
                raise CacheFileError(
                    f"{name}: {key} has shape {tuple(shape)}, the descriptor and tokens need "
                    f"{expect[0]}"
                )
            if dtype != expect[1]:
                raise CacheFileError(
                    f"{name}: {key} has dtype {dtype}, the descriptor needs {expect[1]}"
                )
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > info.file_size or nbytes > limit:
            raise CacheFileError(
                f"{name}: {key} declares shape {tuple(shape)} ({nbytes} octets) in a member "
                f"of {info.file_size}"
            )
        out = np.empty(shape, dtype=dtype)
        view = out.reshape(-1).view(np.uint8).data
        done = 0
        while done < nbytes:
            n = stream.readinto(view[done : min(nbytes, done + _CHUNK)])
            if not n:
                raise CacheFileError(f"{name}: {key} is truncated ({done} of {nbytes} octets)")
            done += n
        if f.read(1):
            raise CacheFileError(f"{name}: {key} has data after its {nbytes} octets")
    return out


def _descriptor(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CacheFileError(f"{name}: the descriptor is not a JSON object")
    try:
        CompatibilityDescriptor(dict(value))
    except (ValueError, TypeError) as exc:
        raise CacheFileError(f"{name}: bad descriptor: {exc}") from None
    return value


def _parse_safetensors(raw: bytes, name: str) -> CacheFile:
    if len(raw) < 8:
        raise CacheFileError(f"{name}: too short for safetensors")
    (n,) = struct.unpack_from("<Q", raw)
    if n > _MAX_HEADER or 8 + n > len(raw):
        raise CacheFileError(f"{name}: bad safetensors header length {n}")
    header = json.loads(raw[8 : 8 + n])
    if not isinstance(header, dict):
        raise CacheFileError(f"{name}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not isinstance(meta.get("kvcs_descriptor"), str):
        raise CacheFileError(f"{name}: no kvcs_descriptor in the safetensors metadata")
    descriptor = _descriptor(json.loads(meta["kvcs_descriptor"]), name)
    data = memoryview(raw)[8 + n :]
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for key in ("k", "v", "tokens"):
        info = header.get(key)
        if not isinstance(info, dict):
            raise CacheFileError(f"{name}: no tensor {key!r}")
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= len(data)
        ):
            raise CacheFileError(f"{name}: bad data_offsets of {key!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CacheFileError(f"{name}: bad shape of {key!r}")
        declared = info.get("dtype")
        dtype: np.dtype[Any] | None
        if key == "tokens":
            dtype = _TOKEN_DTYPES.get(declared) if isinstance(declared, str) else None
            if dtype is None:
                raise CacheFileError(
                    f"{name}: tokens has dtype {declared!r}; "
                    f"expected one of {sorted(_TOKEN_DTYPES)}"
                )
        else:
            want = _SAFETENSORS_DTYPE.get(str(descriptor.get("dtype")))
            if want is None:
                raise CacheFileError(
                    f"{name}: no safetensors dtype for {descriptor.get('dtype')!r}"
                )
            if declared != want:
                raise CacheFileError(
                    f"{name}: {key} has dtype {declared!r}; the descriptor's "
                    f"{descriptor.get('dtype')} is {want!r}"
                )
            dtype = engine_dtype(descriptor["dtype"])
        if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
            raise CacheFileError(
                f"{name}: {key!r} has {offsets[1] - offsets[0]} octets, "
                f"shape {shape} needs {math.prod(shape) * dtype.itemsize}"
            )
        arrays[key] = np.frombuffer(data[offsets[0] : offsets[1]], dtype=dtype).reshape(shape)
    if arrays["tokens"].ndim != 1:
        raise CacheFileError(f"{name}: tokens must be 1-D")
    tokens = tuple(int(t) for t in arrays["tokens"])
    return CacheFile(descriptor, tokens, arrays["k"], arrays["v"])


def _save_safetensors(path: Path, cache: CacheFile) -> None:
    tokens = np.asarray(cache.tokens, dtype="<u4")
    tensors = [
        ("k", cache.k, _SAFETENSORS_DTYPE[cache.descriptor["dtype"]]),
        ("v", cache.v, _SAFETENSORS_DTYPE[cache.descriptor["dtype"]]),
        ("tokens", tokens, "U32"),
    ]
    header: dict[str, Any] = {"__metadata__": {"kvcs_descriptor": json.dumps(cache.descriptor)}}
    offset = 0
    for name, arr, dt in tensors:
        header[name] = {
            "dtype": dt,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr, _ in tensors:
            f.write(np.ascontiguousarray(arr).tobytes())


# --- the synthetic cache ----------------------------------------------------------------


def llama_descriptor(
    *,
    layers: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    block_tokens: int = 16,
    model: str = "kvcs/synthetic-llama@1",
) -> dict[str, Any]:
    """A KVSP descriptor shaped like Llama-3-8B's KV cache (32 layers, 8 KV heads, 128)."""
    cd = CompatibilityDescriptor.create(
        model=model,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_tokens=block_tokens,
    )
    return dict(cd.to_json())


def synthetic(descriptor: Mapping[str, Any], tokens: int, seed: int = 1) -> CacheFile:
    """A reproducible cache: the same descriptor, token count and seed give the same bits.

    Token IDs and K/V bit patterns come from ``numpy.random.default_rng(seed)``
    (every bit pattern is allowed, NaNs included: caches are compared bitwise).
    """
    cd = CompatibilityDescriptor(dict(descriptor))
    rng = np.random.default_rng(seed)
    token_ids = tuple(int(t) for t in rng.integers(0, 128_000, size=tokens))
    dtype = engine_dtype(cd.dtype)
    shape = (cd.layers, cd.kv_heads, tokens, cd.head_dim)
    info = np.iinfo(dtype) if dtype.kind == "u" else None
    if info is not None:
        k = rng.integers(0, info.max + 1, size=shape, dtype=dtype)
        v = rng.integers(0, info.max + 1, size=shape, dtype=dtype)
    else:
        k = rng.standard_normal(size=shape).astype(dtype)
        v = rng.standard_normal(size=shape).astype(dtype)
    return CacheFile(dict(descriptor), token_ids, k, v)
