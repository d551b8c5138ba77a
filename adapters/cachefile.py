"""KV caches on disk: ``.npz`` and safetensors files that ``kvcs publish`` reads and ``kvcs fetch``
writes, plus the synthetic Llama-shaped cache the demo and the tests use.

A cache file holds what a publisher needs and a consumer produces:

* ``k`` and ``v``: engine arrays ``[layers, kv_heads, tokens, head_dim]`` (HND) of
  the descriptor's raw dtype (:func:`kvcs.adapters.numpy_kv.engine_dtype`: bfloat16 as
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

import contextlib
import io
import json
import math
import struct
import typing
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcs.adapters.files import MAX_CACHE_BYTES, MAX_TOKENS, CacheFileError, file_kind
from kvcs.adapters.numpy_kv import KvDestination, engine_dtype
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
_MAX_SMALL = 16 * 1024 * 1024
"""The most octets the ``descriptor`` member may declare."""
_MAX_RATIO = 256
"""A member may declare at most this many times its compressed size (plus 1 MiB): KV data
barely compresses, and a zip bomb is refused before anything is inflated."""
_NPY_HEADER_MAX = 64 * 1024
_CHUNK = 1 << 20
_SUFFIXES = (".npz", ".safetensors")


@attrs.frozen(eq=False)
class CacheFile:
    """A KV cache with its descriptor and tokens (engine layout HND)."""

    descriptor: dict[str, Any]
    tokens: tuple[int, ...]
    k: np.ndarray[Any, Any]
    v: np.ndarray[Any, Any]

    @property
    def cd(self) -> CompatibilityDescriptor:
        """The descriptor, parsed and checked (a new object on each access)."""
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


LayerPair: typing.TypeAlias = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]
"""``(k, v)`` of one layer: engine arrays ``[kv_heads, tokens, head_dim]`` (HND)."""


@attrs.frozen(eq=False)
class CacheLayers:
    """A KV cache whose K and V are read one layer at a time (engine layout HND).

    What ``kvcs publish`` and ``kvcs fetch`` use, so that a process never holds a
    cache file's K and V whole beside what it makes of them (the publisher's
    sections, the consumer's destination): :func:`open_layers` (a cache file),
    :func:`synthetic_layers` (the synthetic cache, the same bits as
    :func:`synthetic`) and :meth:`of` (arrays already in memory).
    """

    descriptor: dict[str, Any]
    tokens: tuple[int, ...]
    read_layers: typing.Callable[[], Iterator[LayerPair]] = attrs.field(repr=False)
    """A new iterator over ``(k, v)`` of layers 0..L-1: each a C-contiguous array of
    the raw dtype, new for every layer (the caller owns it; nothing reuses it), except
    for :meth:`of`, whose layers are views of its arrays."""

    @classmethod
    def of(cls, cache: CacheFile) -> CacheLayers:
        """The layers of a cache in memory (views of its arrays, no copy)."""
        return cls(cache.descriptor, cache.tokens, lambda: _layer_pairs(cache))

    @property
    def cd(self) -> CompatibilityDescriptor:
        """The descriptor, parsed and checked (a new object on each access)."""
        return CompatibilityDescriptor(dict(self.descriptor))

    def layers(self) -> Iterator[LayerPair]:
        """``(k, v)`` of each layer, in layer order (read as the iterator advances).

        Raises:
            CacheFileError: the file is unreadable or malformed (found while reading).
        """
        return self.read_layers()

    def check(self) -> None:
        """Read every layer once (one layer in memory at a time): a file whose data is
        truncated or corrupt (a bad CRC) is refused here, before any work.

        Raises:
            CacheFileError: as :meth:`layers`.
        """
        for _ in self.layers():
            pass

    def load(self) -> CacheFile:
        """The whole cache in memory (one copy of K and V, made here)."""
        cd = self.cd
        shape = (cd.layers, cd.kv_heads, len(self.tokens), cd.head_dim)
        k = np.empty(shape, engine_dtype(cd.dtype))
        v = np.empty(shape, engine_dtype(cd.dtype))
        for layer, (lk, lv) in enumerate(self.layers()):
            k[layer], v[layer] = lk, lv
        return CacheFile(dict(self.descriptor), self.tokens, k, v)


def same_bits(source: CacheFile | CacheLayers, dest: KvDestination, tokens: int) -> bool:
    """Whether ``dest`` holds exactly ``source``'s K and V bits for the first ``tokens``.

    Compared layer by layer in section order (views of both sides; ``source`` read one
    layer at a time when it is a :class:`CacheLayers`): no copy of the cache is made.
    ``tokens`` is a whole number of blocks, at most ``dest.tokens``.
    """
    cd = dest.descriptor
    blocks = tokens // cd.block_tokens
    for layer, (k, v) in enumerate(_layer_pairs(source)):
        dk, dv = dest.as_paged_arrays(layer)
        for src, got in ((k, dk), (v, dv)):
            if not np.array_equal(_paged(src, cd, blocks), got[:blocks]):
                return False
    return True


def _paged(layer: np.ndarray[Any, Any], cd: CompatibilityDescriptor, blocks: int) -> Any:
    """Blocks ``0..blocks-1`` of an HND layer as a ``[blocks, H, B, D]`` view (no copy)."""
    h, _, d = layer.shape
    b = cd.block_tokens
    return layer[:, : blocks * b].reshape(h, blocks, b, d).transpose(1, 0, 2, 3)


def _layer_pairs(source: CacheFile | CacheLayers) -> Iterator[LayerPair]:
    if isinstance(source, CacheLayers):
        return source.layers()
    return zip(source.k, source.v, strict=True)


def _check_file(path: Path, max_bytes: int) -> int:
    """``path`` is a regular file of at most ``max_bytes`` octets; its size.

    Raises:
        CacheFileError: missing, not a regular file, or too large (one line).
        OSError: from ``stat`` (the callers turn it into a CacheFileError).
    """
    kind = file_kind(path)
    if kind == "no such file":
        raise CacheFileError(f"no such file: {path}")
    if kind is not None:
        raise CacheFileError(f"{path} is {kind}, not a cache file")
    size = path.stat().st_size
    if size > max_bytes:
        raise CacheFileError(f"{path}: {size} octets, more than the limit of {max_bytes}")
    return size


def load(path: str | Path, *, max_bytes: int = MAX_CACHE_BYTES) -> CacheFile:
    """Read a ``.npz`` or ``.safetensors`` cache file (any other suffix is read as ``.npz``).

    Raises:
        CacheFileError: not a regular file (missing, a directory, a FIFO, a device),
            larger than ``max_bytes``, unreadable or malformed; one line.
    """
    path = Path(path)
    try:
        _check_file(path, max_bytes)
        if path.suffix != ".safetensors":
            # an .npz is inflated member by member straight from the file into its arrays:
            # the file's octets are never held whole beside the arrays (that was 2x the cache)
            with path.open("rb") as f:
                return _checked(lambda: _parse_npz(f, str(path)), str(path), npz=True)
        raw = path.read_bytes()  # the arrays are views of these octets (no second copy)
    except OSError as exc:
        raise CacheFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    return loads(raw, safetensors=True, name=str(path))


def open_layers(path: str | Path, *, max_bytes: int = MAX_CACHE_BYTES) -> CacheLayers:
    """A cache file's descriptor and tokens now, its K and V one layer at a time later.

    Reads and checks what :func:`load` checks before the data (the file's kind and
    size, the zip members' sizes or the safetensors header, the descriptor, the
    tokens, the shapes and dtypes of ``k`` and ``v``); the data itself is read by
    :meth:`CacheLayers.layers` (call :meth:`CacheLayers.check` to refuse a truncated
    or corrupt file before any work). Memory: one layer of K and V at a time; an
    ``.npz`` member is inflated straight into the layer's arrays in chunks of at
    most 1 MiB (through a bytes object of that chunk: the one transient copy).

    Raises:
        CacheFileError: as :func:`load`, for what is read here.
    """
    path = Path(path)
    name = str(path)
    try:
        size = _check_file(path, max_bytes)
        with path.open("rb") as f:
            if path.suffix == ".safetensors":
                return _guarded(lambda: _safetensors_layers(path, f, size), name, npz=False)
            return _guarded(lambda: _npz_layers(path, f), name, npz=True)
    except OSError as exc:
        raise CacheFileError(f"cannot read {path}: {exc.strerror or exc}") from None


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
    if safetensors:
        return _checked(lambda: _parse_safetensors(raw, name), name, npz=False)
    return _checked(lambda: _parse_npz(io.BytesIO(raw), name), name, npz=True)


_T = typing.TypeVar("_T")


def _guarded(parse: typing.Callable[[], _T], name: str, *, npz: bool) -> _T:
    """``parse()`` with every defect a :class:`CacheFileError`. (zipfile and numpy raise
    many kinds of exception on a malformed archive: for an ``.npz`` each becomes one line.)"""
    expected = Exception if npz else _PARSE_ERRORS
    try:
        return parse()
    except CacheFileError:
        raise
    except expected as exc:
        raise _unreadable(name, exc) from None


def _checked(parse: typing.Callable[[], CacheFile], name: str, *, npz: bool) -> CacheFile:
    cache = _guarded(parse, name, npz=npz)
    cache.check()
    return cache


_PARSE_ERRORS = (
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    OverflowError,
    struct.error,
    RecursionError,
)


def save(path: str | Path, cache: CacheFile) -> None:
    """Write ``cache`` to exactly ``path``: ``.safetensors`` by suffix, else ``.npz`` format
    (callers check the suffix with :func:`check_out_path`). Written layer by layer
    (:func:`save_layers`): nothing of the cache is copied whole."""
    save_layers(path, cache.descriptor, cache.tokens, cache.k, cache.v)


class LayerArrays(typing.Protocol):
    """What :func:`save_layers` writes of ``k`` or ``v``: a 4-D array, or anything with the
    ``shape`` and ``dtype`` of one whose ``[layer]`` is that layer's 3-D array."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    def __getitem__(self, layer: int, /) -> Any: ...


def save_layers(
    path: str | Path,
    descriptor: Mapping[str, Any],
    tokens: Sequence[int],
    k: LayerArrays,
    v: LayerArrays,
) -> None:
    """Write a cache to exactly ``path`` (as :func:`save`), one layer of ``k`` and ``v``
    in memory at a time: ``k[layer]`` is asked for, written and dropped (a layer that
    is not C-contiguous is copied, that layer only). :func:`destination_layers` gives a
    consumer's :class:`~kvcs.adapters.numpy_kv.KvDestination` in this form.

    Raises:
        CacheFileError: the file cannot be written.
    """
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            _save_safetensors(path, dict(descriptor), tokens, k, v)
        else:
            _save_npz(path, dict(descriptor), tokens, k, v)
    except OSError as exc:
        raise CacheFileError(f"cannot write {path}: {exc.strerror or exc}") from None


def _write_layers(f: typing.IO[bytes], arrays: LayerArrays) -> None:
    shape = tuple(arrays.shape)
    for layer in range(shape[0]):
        arr = np.ascontiguousarray(arrays[layer], dtype=arrays.dtype)  # a view if it is one
        if arr.shape != shape[1:]:
            raise ValueError(f"layer {layer} has shape {arr.shape}, not {shape[1:]}")
        f.write(arr.reshape(-1).view(np.uint8).data)


def _save_npz(
    path: Path, descriptor: dict[str, Any], tokens: Sequence[int], k: LayerArrays, v: LayerArrays
) -> None:
    """What ``numpy.savez`` writes (stored, ZIP64 members ``k.npy``, ``v.npy``,
    ``tokens.npy``, ``descriptor.npy``; npy format 1.0), written layer by layer."""
    small: dict[str, np.ndarray[Any, Any]] = {
        "tokens": np.asarray(tokens, dtype=np.uint32),
        "descriptor": np.frombuffer(json.dumps(descriptor).encode(), np.uint8),
    }
    # a file object: numpy would append ".npz" to a name
    with path.open("wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, arrays in (("k", k), ("v", v)):
            with zf.open(f"{key}.npy", "w", force_zip64=True) as m:
                np.lib.format.write_array_header_1_0(
                    m,
                    {
                        "descr": np.lib.format.dtype_to_descr(np.dtype(arrays.dtype)),
                        "fortran_order": False,
                        "shape": tuple(arrays.shape),
                    },
                )
                _write_layers(m, arrays)
        for key, arr in small.items():
            with zf.open(f"{key}.npy", "w", force_zip64=True) as m:
                np.lib.format.write_array(m, arr)


def _unreadable(name: str, exc: BaseException) -> CacheFileError:
    return CacheFileError(f"cannot read {name}: {type(exc).__name__}: {exc}"[:300])


def _open_zip(f: typing.IO[bytes], name: str) -> zipfile.ZipFile:
    magic = f.read(4)
    f.seek(0)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise CacheFileError(f"{name} is not an npz file (not a zip archive)")
    try:
        return zipfile.ZipFile(f)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as exc:
        raise CacheFileError(f"{name}: not a readable npz (zip) file: {exc}") from None


def _npz_meta(
    zf: zipfile.ZipFile, name: str
) -> tuple[dict[str, Any], tuple[int, ...], dict[str, zipfile.ZipInfo], tuple[int, ...]]:
    """An ``.npz``'s descriptor, tokens, members and the shape ``k`` and ``v`` must have,
    read without trusting what it declares: the members' sizes are checked against the
    limits (a zip bomb is refused before anything is inflated), and only the small
    members are read."""
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
    return descriptor, tuple(int(t) for t in tokens), members, shape


def _parse_npz(f: typing.IO[bytes], name: str) -> CacheFile:
    """A whole ``.npz`` (see :func:`_npz_meta`); ``k`` and ``v`` are inflated in chunks
    straight into their arrays, their npy headers checked against the descriptor and
    tokens first, and inflating bounded by them."""
    with _open_zip(f, name) as zf:
        descriptor, tokens, members, shape = _npz_meta(zf, name)
        dtype = engine_dtype(descriptor["dtype"])
        arrays = [
            _npy(zf, members[f"{key}.npy"], name, key, MAX_CACHE_BYTES, (shape, dtype))
            for key in ("k", "v")
        ]
        return CacheFile(descriptor, tokens, arrays[0], arrays[1])


def _npy_header(
    f: typing.IO[bytes],
    info: zipfile.ZipInfo,
    name: str,
    key: str,
    limit: int,
    expect: tuple[tuple[int, ...], np.dtype[Any]] | None,
) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """The header of an ``.npy`` member open as ``f``, checked (``expect``: the shape and
    dtype it must have): its shape, dtype and the octets of its data (within ``limit``
    and the member's size)."""
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
    return tuple(shape), dtype, nbytes


def _read_into(
    f: typing.IO[bytes], out: np.ndarray[Any, Any], name: str, key: str, done: int, total: int
) -> None:
    """Fill ``out`` (C-contiguous) from ``f`` in chunks of at most 1 MiB: no more than its
    size is read, and a short file is a :class:`CacheFileError` (``done`` of ``total``:
    where this piece starts in the array, for the message)."""
    view = out.reshape(-1).view(np.uint8).data
    nbytes = len(view)
    stream = typing.cast(io.BufferedIOBase, f)
    got = 0
    while got < nbytes:
        n = stream.readinto(view[got : min(nbytes, got + _CHUNK)])
        if not n:
            raise CacheFileError(f"{name}: {key} is truncated ({done + got} of {total} octets)")
        got += n


def _npy(
    zf: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    name: str,
    key: str,
    limit: int,
    expect: tuple[tuple[int, ...], np.dtype[Any]] | None,
) -> np.ndarray[Any, Any]:
    """One ``.npy`` member: its header read and checked first (:func:`_npy_header`), then
    exactly the octets the header implies, read in chunks into the array (never more than
    the header implies, which is within ``limit``)."""
    if info.file_size > limit:
        raise CacheFileError(f"{name}: {key} declares {info.file_size} octets (limit {limit})")
    with zf.open(info) as f:
        shape, dtype, nbytes = _npy_header(f, info, name, key, limit, expect)
        out = np.empty(shape, dtype=dtype)
        _read_into(f, out, name, key, 0, nbytes)
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


_Tensor: typing.TypeAlias = tuple[int, int, list[int], np.dtype[Any]]
"""Where a safetensors tensor's data is (start and end offsets), its shape and dtype."""


def _safetensors_header_length(prefix: bytes, size: int, name: str) -> int:
    """The header length from a file's first 8 octets (of ``size`` in all)."""
    if size < 8 or len(prefix) < 8:
        raise CacheFileError(f"{name}: too short for safetensors")
    (n,) = struct.unpack_from("<Q", prefix)
    if n > _MAX_HEADER or 8 + n > size:
        raise CacheFileError(f"{name}: bad safetensors header length {n}")
    return int(n)


def _safetensors_layout(
    header_json: bytes, data_len: int, name: str
) -> tuple[dict[str, Any], dict[str, _Tensor]]:
    """The descriptor and the tensors ``k``, ``v`` and ``tokens`` a safetensors header
    declares, each checked against the ``data_len`` octets of data after it."""
    header = json.loads(header_json)
    if not isinstance(header, dict):
        raise CacheFileError(f"{name}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not isinstance(meta.get("kvcs_descriptor"), str):
        raise CacheFileError(f"{name}: no kvcs_descriptor in the safetensors metadata")
    descriptor = _descriptor(json.loads(meta["kvcs_descriptor"]), name)
    tensors: dict[str, _Tensor] = {}
    for key in ("k", "v", "tokens"):
        info = header.get(key)
        if not isinstance(info, dict):
            raise CacheFileError(f"{name}: no tensor {key!r}")
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
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
        tensors[key] = (offsets[0], offsets[1], shape, dtype)
    return descriptor, tensors


def _parse_safetensors(raw: bytes, name: str) -> CacheFile:
    n = _safetensors_header_length(raw[:8], len(raw), name)
    descriptor, tensors = _safetensors_layout(raw[8 : 8 + n], len(raw) - 8 - n, name)
    data = memoryview(raw)[8 + n :]
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for key, (start, end, shape, dtype) in tensors.items():
        arrays[key] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
    if arrays["tokens"].ndim != 1:
        raise CacheFileError(f"{name}: tokens must be 1-D")
    tokens = tuple(int(t) for t in arrays["tokens"])
    return CacheFile(descriptor, tokens, arrays["k"], arrays["v"])


def _check_meta(
    descriptor: dict[str, Any], tokens: tuple[int, ...], shapes: Sequence[Any], dtype: np.dtype[Any]
) -> None:
    """What :meth:`CacheFile.check` checks, from the shapes and dtype alone (the arrays
    checked are zero-size broadcast views: nothing is allocated)."""
    k, v = (np.broadcast_to(np.zeros((), dtype), tuple(shape)) for shape in shapes)
    CacheFile(descriptor, tokens, k, v).check()


def _npz_layers(path: Path, f: typing.IO[bytes]) -> CacheLayers:
    name = str(path)
    with _open_zip(f, name) as zf:
        descriptor, tokens, members, shape = _npz_meta(zf, name)
        dtype = engine_dtype(descriptor["dtype"])
        for key in ("k", "v"):
            info = members[f"{key}.npy"]
            if info.file_size > MAX_CACHE_BYTES:
                raise CacheFileError(
                    f"{name}: {key} declares {info.file_size} octets (limit {MAX_CACHE_BYTES})"
                )
            with zf.open(info) as m:
                _npy_header(m, info, name, key, MAX_CACHE_BYTES, (shape, dtype))
    _check_meta(descriptor, tokens, (shape, shape), dtype)

    def read() -> Iterator[LayerPair]:
        """Both members open at once (zipfile allows it), each read front to back."""
        with path.open("rb") as g, _open_zip(g, name) as z, contextlib.ExitStack() as stack:
            streams = []
            for key in ("k", "v"):
                info = z.getinfo(f"{key}.npy")
                m = stack.enter_context(z.open(info))
                _, _, nbytes = _npy_header(m, info, name, key, MAX_CACHE_BYTES, (shape, dtype))
                streams.append((key, m, nbytes))
            per_layer = math.prod(shape[1:]) * dtype.itemsize

            def one(i: int, layer: int) -> np.ndarray[Any, Any]:
                key, m, nbytes = streams[i]
                out = np.empty(shape[1:], dtype)
                _read_into(m, out, name, key, layer * per_layer, nbytes)
                return out

            for layer in range(shape[0]):  # (no local keeps a layer while suspended)
                yield one(0, layer), one(1, layer)
            for key, m, nbytes in streams:
                if m.read(1):  # also where zipfile checks the member's CRC-32
                    raise CacheFileError(f"{name}: {key} has data after its {nbytes} octets")

    return CacheLayers(descriptor, tokens, lambda: _guarded_iter(read(), name, npz=True))


def _safetensors_layers(path: Path, f: typing.IO[bytes], size: int) -> CacheLayers:
    name = str(path)
    n = _safetensors_header_length(f.read(8), size, name)
    header = f.read(n)
    if len(header) != n:
        raise CacheFileError(f"{name}: bad safetensors header length {n}")
    base = 8 + n
    descriptor, tensors = _safetensors_layout(header, size - base, name)
    start, end, tshape, tdtype = tensors["tokens"]
    if len(tshape) != 1:
        raise CacheFileError(f"{name}: tokens must be 1-D")
    f.seek(base + start)
    raw_tokens = np.empty(tshape, tdtype)
    _read_into(f, raw_tokens, name, "tokens", 0, end - start)
    tokens = tuple(int(t) for t in raw_tokens)
    dtype = engine_dtype(descriptor["dtype"])
    _check_meta(descriptor, tokens, (tensors["k"][2], tensors["v"][2]), dtype)
    shape = tensors["k"][2]

    def read() -> Iterator[LayerPair]:
        per_layer = math.prod(shape[1:]) * dtype.itemsize
        total = per_layer * shape[0]
        with path.open("rb") as g:

            def one(key: str, layer: int) -> np.ndarray[Any, Any]:
                g.seek(base + tensors[key][0] + layer * per_layer)
                out = np.empty(shape[1:], dtype)
                _read_into(g, out, name, key, layer * per_layer, total)
                return out

            for layer in range(shape[0]):  # (no local keeps a layer while suspended)
                yield one("k", layer), one("v", layer)

    return CacheLayers(descriptor, tokens, lambda: _guarded_iter(read(), name, npz=False))


def _guarded_iter(it: Iterator[LayerPair], name: str, *, npz: bool) -> Iterator[LayerPair]:
    """``it`` with every defect met while reading a :class:`CacheFileError` (one line); an
    OSError of the file too."""
    expected = Exception if npz else (*_PARSE_ERRORS, OSError)
    while True:
        try:
            box = [next(it)]
        except StopIteration:
            return
        except CacheFileError:
            raise
        except OSError as exc:
            raise CacheFileError(f"cannot read {name}: {exc.strerror or exc}") from None
        except expected as exc:
            raise _unreadable(name, exc) from None
        yield box.pop()  # no local keeps the layer while suspended: the caller owns it


def _save_safetensors(
    path: Path, descriptor: dict[str, Any], tokens: Sequence[int], k: LayerArrays, v: LayerArrays
) -> None:
    raw_tokens = np.asarray(tokens, dtype="<u4")
    dt = _SAFETENSORS_DTYPE[descriptor["dtype"]]
    tensors: list[tuple[str, Any, str]] = [
        ("k", k, dt),
        ("v", v, dt),
        ("tokens", raw_tokens, "U32"),
    ]
    header: dict[str, Any] = {"__metadata__": {"kvcs_descriptor": json.dumps(descriptor)}}
    offset = 0
    for name, arr, dtn in tensors:
        nbytes = math.prod(arr.shape) * np.dtype(arr.dtype).itemsize
        header[name] = {
            "dtype": dtn,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        _write_layers(f, k)
        _write_layers(f, v)
        f.write(raw_tokens.tobytes())


@attrs.frozen(eq=False)
class _DestinationLayers:
    dest: KvDestination
    component: int
    tokens: int

    @property
    def shape(self) -> tuple[int, ...]:
        cd = self.dest.descriptor
        return (cd.layers, cd.kv_heads, self.tokens, cd.head_dim)

    @property
    def dtype(self) -> np.dtype[Any]:
        return engine_dtype(self.dest.descriptor.dtype)

    def __getitem__(self, layer: int) -> np.ndarray[Any, Any]:
        cd = self.dest.descriptor
        paged = self.dest.as_paged_arrays(layer)[self.component][: self.tokens // cd.block_tokens]
        # section order [blocks, H, B, D] -> HND [H, tokens, D]: one copy of this layer
        out: np.ndarray[Any, Any] = paged.transpose(1, 0, 2, 3).reshape(
            cd.kv_heads, self.tokens, cd.head_dim
        )
        return out


def destination_layers(dest: KvDestination, tokens: int) -> tuple[LayerArrays, LayerArrays]:
    """``(k, v)`` of a consumer's destination for :func:`save_layers`: the first ``tokens``
    (whole blocks) of each layer in engine layout, made one layer at a time when it is
    written (a copy of that layer where section order is not HND, else a view)."""
    return _DestinationLayers(dest, 0, tokens), _DestinationLayers(dest, 1, tokens)


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


def full_range_integers(
    gen: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> np.ndarray[Any, Any]:
    """``gen.integers(0, max + 1, size=shape, dtype=dtype)`` for an unsigned ``dtype``: the
    same values, and the generator goes on as it would have; about 7x faster where it can be.

    Over an unsigned type's whole range numpy's bounded integers reject nothing: they
    cut 32-bit draws (64-bit for 8-byte types) into pieces, low bits first, and a PCG64
    cuts its 64-bit outputs into 32-bit draws low half first. So the values are the bit
    generator's raw outputs read as little-endian ``dtype``, whenever the array is a whole
    number of 64-bit outputs and no half-used output waits in the generator; those
    are taken with ``random_raw``. Anything else (another bit generator, a size that ends
    mid-output, a waiting half) is drawn by ``integers``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    bits = gen.bit_generator
    if (
        dtype.kind != "u"
        or nbytes % 8
        or not isinstance(bits, np.random.PCG64)
        or bits.state["has_uint32"]
    ):
        # annotated: numpy 2.5's stubs type integers() with a dtype argument as Any
        drawn: np.ndarray = gen.integers(0, np.iinfo(dtype).max + 1, size=shape, dtype=dtype)
        return drawn
    raw = bits.random_raw(nbytes // 8)
    return raw.view(dtype.newbyteorder("<")).astype(dtype, copy=False).reshape(shape)


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
    if dtype.kind == "u":
        k = full_range_integers(rng, shape, dtype)
        v = full_range_integers(rng, shape, dtype)
    else:
        k = rng.standard_normal(size=shape).astype(dtype)
        v = rng.standard_normal(size=shape).astype(dtype)
    return CacheFile(dict(descriptor), token_ids, k, v)


def synthetic_layers(descriptor: Mapping[str, Any], tokens: int, seed: int = 1) -> CacheLayers:
    """:func:`synthetic`'s cache, made one layer at a time: the same bits, never the whole
    K and V in memory at once (one layer of each per step).

    :func:`synthetic` draws the token IDs, then all of K, then all of V from one
    generator; drawing K (or V) layer by layer gives the same values as drawing it
    whole, because numpy's bounded integers and normals draw layer-sized pieces of the
    same stream (an integer piece must hold whole 32-bit draws: where a layer's element
    count does not, the whole cache is made with :func:`synthetic` instead). The
    generator of V starts where K's ends. For integer dtypes drawn over their full
    range (the usual case: bfloat16 and friends are carried as unsigned integers)
    nothing is rejected, so K takes exactly ``K's bytes / 8`` 64-bit outputs and V's
    generator jumps there with ``PCG64.advance`` when that is a whole number and the
    token IDs left no half-used output behind; otherwise
    (normals, which reject) K is drawn once, unused, to reach V's start (CPU, not
    memory).
    """
    cd = CompatibilityDescriptor(dict(descriptor))
    rng = np.random.default_rng(seed)
    token_ids = tuple(int(t) for t in rng.integers(0, 128_000, size=tokens))
    dtype = engine_dtype(cd.dtype)
    shape = (cd.kv_heads, tokens, cd.head_dim)
    if dtype.kind == "u" and math.prod(shape) * dtype.itemsize % 4:
        return CacheLayers.of(synthetic(descriptor, tokens, seed))
    state = rng.bit_generator.state  # (a PCG64's: default_rng's bit generator)
    # whole 32-bit draws, none left over from the token IDs: K's draws are whole 64-bit
    # outputs that V's generator can jump over (below)
    jump = dtype.kind == "u" and dtype.itemsize <= 4 and not state["has_uint32"]

    def draw(gen: np.random.Generator) -> np.ndarray[Any, Any]:
        if dtype.kind == "u":
            return full_range_integers(gen, shape, dtype)
        return gen.standard_normal(size=shape).astype(dtype)

    def read() -> Iterator[LayerPair]:
        gens = []
        for _ in range(2):
            bits = np.random.PCG64()
            bits.state = state  # type: ignore[assignment]
            gens.append(np.random.Generator(bits))
        gk, gv = gens
        k_bytes = cd.layers * math.prod(shape) * dtype.itemsize
        if jump and k_bytes % 8 == 0:
            gv.bit_generator.advance(k_bytes // 8)  # type: ignore[attr-defined]
        else:
            for _ in range(cd.layers):
                draw(gv)  # K, unused: V's draws start after K's
        for _ in range(cd.layers):
            yield draw(gk), draw(gv)

    return CacheLayers(dict(descriptor), token_ids, read)
