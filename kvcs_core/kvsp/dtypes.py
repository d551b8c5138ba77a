"""Element types of K/V sections and exact float32 conversions (pure Python).

Theory of operation
-------------------
Binding section 1 allows five descriptor ``dtype`` values; section 5 stores
every element little-endian, bfloat16 and float8 as their raw bit patterns.
Every one of these formats is a subset of IEEE binary32, so a section decodes
exactly to float32 values, held here as Python floats (binary64, which holds
every float32 exactly). :func:`to_float32` does that.

:func:`from_float32` is the other direction: the "cast to the descriptor
dtype" of the q8 decoder (binding section 6). It takes float32 values (every
input must be exactly representable as float32; the q8 decoder only produces
such values) and rounds each to the dtype the way an IEEE-754 conversion does,
which is also what numpy, torch and ml_dtypes do:

* round to nearest, ties to even, with subnormals;
* a finite value that rounds beyond the largest finite value becomes +-inf for
  float16, bfloat16 and float8_e5m2, and NaN for float8_e4m3fn (it has no
  infinity; its largest finite value is 448 and anything that rounds above it
  is NaN, the non-saturating conversion of torch and ml_dtypes);
* +-inf stays +-inf (NaN for float8_e4m3fn); the sign of zero is kept;
* a NaN stays a NaN with the same sign: float16 0x7E00, bfloat16 0x7FC0,
  float8_e5m2 0x7E, float8_e4m3fn 0x7F; a float32 NaN is what the C cast makes
  (the binding does not fix NaN payloads; the sign of a NaN made by
  arithmetic, such as ``0 * inf`` in the q8 decoder, is the CPU's).

float16 and float32 go through ``struct`` (C loops; ``struct``'s half-precision
packing rounds half to even); bfloat16 rounds the float32 bit pattern; the two
float8 formats use a 256-entry table and a binary search over it.
"""

from __future__ import annotations

import enum
import math
import struct
from bisect import bisect_left
from collections.abc import Sequence
from typing import Final

Buffer = bytes | bytearray | memoryview
"""The bytes-like inputs accepted by this package."""


class Dtype(enum.StrEnum):
    """The ``dtype`` values of a Compatibility Descriptor (binding section 1)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def itemsize(self) -> int:
        """Octets per element."""
        return ITEMSIZE[self]


ITEMSIZE: Final[dict[Dtype, int]] = {
    Dtype.FLOAT32: 4,
    Dtype.FLOAT16: 2,
    Dtype.BFLOAT16: 2,
    Dtype.FLOAT8_E4M3FN: 1,
    Dtype.FLOAT8_E5M2: 1,
}

_NAN: Final = math.nan
_INF: Final = math.inf


def _fp8_table(exp_bits: int, man_bits: int, ieee_specials: bool) -> tuple[float, ...]:
    """The value of each of the 256 codes of an 8-bit float (sign, exponent, mantissa)."""
    bias = (1 << (exp_bits - 1)) - 1
    exp_max = (1 << exp_bits) - 1
    man_max = (1 << man_bits) - 1
    values: list[float] = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> man_bits) & exp_max
        man = code & man_max
        if exp == exp_max and ieee_specials:
            value = _INF if man == 0 else _NAN
        elif exp == exp_max and man == man_max:  # e4m3fn: S.1111.111 is NaN
            value = _NAN
        elif exp == 0:
            value = math.ldexp(man, 1 - bias - man_bits)
        else:
            value = math.ldexp(man + (1 << man_bits), exp - bias - man_bits)
        values.append(sign * value)
    return tuple(values)


_E4M3FN: Final = _fp8_table(4, 3, ieee_specials=False)
_E5M2: Final = _fp8_table(5, 2, ieee_specials=True)


class _Fp8Encoder:
    """Round-to-nearest-even encoder of one 8-bit float format.

    The positive codes ``0..max_code`` are in ascending value order, so code
    ``i`` is ``values[i]`` and its parity is the parity of its mantissa. One
    more entry, ``values[max_code + 1]`` (the next value the format would have
    with a wider exponent), decides ties at the top; rounding to it, or past
    it, is an overflow.
    """

    def __init__(self, table: tuple[float, ...], max_code: int, overflow: int, nan: int) -> None:
        top = table[max_code]
        below = table[max_code - 1]
        self.values: Final = (*table[: max_code + 1], top + (top - below))
        self.max_code: Final = max_code
        self.overflow: Final = overflow
        self.nan: Final = nan

    def encode(self, value: float) -> int:
        sign = 0x80 if math.copysign(1.0, value) < 0 else 0
        if math.isnan(value):
            return sign | self.nan
        a = abs(value)
        values = self.values
        i = bisect_left(values, a)
        if i >= len(values):
            return sign | self.overflow
        if values[i] != a and i > 0:
            lo, hi = values[i - 1], values[i]
            if a - lo < hi - a or (a - lo == hi - a and (i - 1) % 2 == 0):
                i -= 1
        if i > self.max_code:
            return sign | self.overflow
        return sign | i


_E4M3FN_ENC: Final = _Fp8Encoder(_E4M3FN, max_code=0x7E, overflow=0x7F, nan=0x7F)
_E5M2_ENC: Final = _Fp8Encoder(_E5M2, max_code=0x7B, overflow=0x7C, nan=0x7E)


def to_float32(dtype: Dtype, data: Buffer) -> list[float]:
    """Decode a little-endian array of ``dtype`` elements into float32 values.

    Exact: every element becomes the Python float of the same value (NaN and
    infinities included).

    Raises:
        ValueError: ``len(data)`` is not a multiple of the item size.
    """
    size = ITEMSIZE[dtype]
    if len(data) % size:
        raise ValueError(f"{len(data)} octets are not a whole number of {dtype} elements")
    n = len(data) // size
    if dtype is Dtype.FLOAT32:
        return list(struct.unpack(f"<{n}f", data))
    if dtype is Dtype.FLOAT16:
        return list(struct.unpack(f"<{n}e", data))
    if dtype is Dtype.BFLOAT16:
        halves = struct.unpack(f"<{n}H", data)
        return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *[h << 16 for h in halves])))
    table = _E4M3FN if dtype is Dtype.FLOAT8_E4M3FN else _E5M2
    return [table[b] for b in bytes(data)]


def _f16_one(value: float) -> bytes:
    try:
        return struct.pack("<e", value)
    except OverflowError:
        return b"\x00\xfc" if value < 0 else b"\x00\x7c"


def from_float32(dtype: Dtype, values: Sequence[float]) -> bytes:
    """Encode float32 values as a little-endian array of ``dtype`` elements.

    Each value must be a float32 value (exactly representable as float32;
    this is not checked): the conversion is then a single IEEE rounding.
    Rounding, overflow and NaN are as in the module docstring.
    """
    n = len(values)
    if dtype is Dtype.FLOAT32:
        return struct.pack(f"<{n}f", *values)
    if dtype is Dtype.FLOAT16:
        try:
            return struct.pack(f"<{n}e", *values)
        except OverflowError:
            return b"".join(_f16_one(v) for v in values)
    if dtype is Dtype.BFLOAT16:
        bits = struct.unpack(f"<{n}I", struct.pack(f"<{n}f", *values))
        out = [
            ((b >> 16) & 0x8000) | 0x7FC0
            if (b & 0x7FFFFFFF) > 0x7F800000
            else (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            for b in bits
        ]
        return struct.pack(f"<{n}H", *out)
    encoder = _E4M3FN_ENC if dtype is Dtype.FLOAT8_E4M3FN else _E5M2_ENC
    return bytes(encoder.encode(v) for v in values)


def round_float32(value: float) -> float:
    """Round a Python float to the nearest float32 (ties to even); must be in range."""
    result: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return result
