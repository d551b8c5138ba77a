"""The KVSP codec registry: ``raw`` and ``q8``.

Theory of operation
-------------------
Implements ``KVSP-BINDING.md`` section 6 (v0). A codec has a 16-bit value
(the Codec field of the 68-octet Object header, profile section 3.5) and a
name (the codec part of a track name, ``[a-z0-9-]{1,32}``, profile section
3.2):

=======  ======  ================================  ===========================
value    name    Data of a ``k`` or ``v`` Object   Data of a ``kv`` Object
=======  ======  ================================  ===========================
0x0000   raw     the K or V section                K section then V section
0x0001   q8      the section quantized             quantized K then quantized V
=======  ======  ================================  ===========================

0x0002-0x7FFF are unassigned and 0x8000-0xFFFF private use; no private codec
is known here, so any value or name other than the two above raises
:class:`UnknownCodecError` (the profile discards that Object or track and
keeps the session).

``q8`` of a section of shape ``[H, B, D]`` (``R = H*B`` rows of ``D``
elements) is ``scales`` (``R`` float16, little-endian) followed by ``q``
(``R*D`` int8): ``2*R + R*D`` octets. For each row, following the binding and
fixing what it leaves open (each point is a choice of this implementation):

1. the elements are read exactly as float32 (every dtype is a subset);
2. a non-finite element (NaN, +-inf) cannot be quantized: :class:`SectionError`;
3. ``m = max |x|`` (exact in float32); ``scale = m / 127`` rounded to float32
   (float32 division, as a float32 implementation computes it);
4. if ``scale == 0`` (``m == 0``, or, only for float32 sections, ``m`` so
   small that ``m / 127`` underflows float32) the row is all zeros and its
   stored scale is 0;
5. otherwise ``q = clip(round_half_even(float32(x / scale)), -127, 127)``:
   the quotient is rounded to float32 before rounding to an integer, and the
   float32 ``scale`` of step 3 is used (not its float16 rounding);
6. the stored scale is ``scale`` rounded to float16 (nearest, ties to even); a
   scale beyond the float16 range (``m`` above about 8.3e6, only possible for
   float32 and bfloat16 sections) cannot be stored: :class:`SectionError`.

Decoding: ``x = float32(q) * float32(scale)`` with the stored float16 scale
(the product is exact: at most 19 significant bits), then cast to the
descriptor dtype by :func:`~kvcs_core.kvsp.dtypes.from_float32` (IEEE
round-to-nearest-even; a float16 result can overflow to inf when a row's max
is within 2**-11 of 65504). Decoding never fails on Data of the right size:
NaN or inf scales and ``q = -128`` from a peer decode by the same arithmetic.

Error bound (derived, not in the binding): with ``s`` the float32 scale and
``s16`` the stored one, every decoded element satisfies ``|x - x'| <= s/2 +
127*|s - s16| + half an ulp of the dtype at x'``, where ``|s - s16| <=
s * 2**-11`` when ``s16`` is a normal float16 and ``<= 2**-25`` when it is
subnormal; a row whose ``s16`` underflows to 0 decodes to zeros (``m`` below
about 3.8e-6).

Cost: q8 here is pure Python, a few C-level list passes per element: on one
core, a ``[8, 16, 128]`` section (16k elements) encodes in about 5-8 ms
(0.3-0.5 us per element) and decodes in about 1.5 ms (float16, float32), 4 ms
(bfloat16) or 7 ms (float8, whose cast is a binary search per element). A
128k-token, 32-layer cache has about 2**19 such sections: tens of minutes.
This is the reference, not the fast path: a vectorised implementation (the
numpy adapter) must produce the same bytes as :func:`q8_encode` and
:func:`q8_decode`, which take the dtype and the section shape explicitly for
that purpose (``tests/test_kvsp.py`` holds a numpy version of this text that
agrees byte for byte). ``raw`` is free: its Data is the section itself,
returned as a ``memoryview`` without copying.
"""

from __future__ import annotations

import enum
import math
import re
import struct
from array import array
from types import MappingProxyType
from typing import Final

import attrs

from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.kvsp.dtypes import ITEMSIZE, Buffer, Dtype, from_float32, round_float32, to_float32
from kvcs_core.kvsp.errors import SectionError, UnknownCodecError
from kvcs_core.kvsp.sections import check_section

MAX_CODEC_VALUE: Final = 0xFFFF
PRIVATE_USE_FIRST: Final = 0x8000
"""Codec values 0x8000-0xFFFF are private use (section 6)."""
Q8_MAX: Final = 127
"""Largest magnitude of a q8 quantized element."""
Q8_SCALE_SIZE: Final = 2
"""Octets per q8 scale (float16)."""

_CODEC_NAME: Final = re.compile(r"[a-z0-9-]{1,32}")


class Codec(enum.IntEnum):
    """The codecs of the KVSP registry (section 6); the value is the 16-bit Codec field."""

    RAW = 0x0000
    Q8 = 0x0001

    @property
    def registry_name(self) -> str:
        """The registry name, as used in track names (``raw``, ``q8``)."""
        return CODECS[self].name


@attrs.frozen
class CodecInfo:
    """One registry entry.

    Attributes:
        codec: the 16-bit value.
        name: the registry name (track-name syntax ``[a-z0-9-]{1,32}``).
        lossy: whether decoding gives back other values than were encoded.
    """

    codec: Codec
    name: str
    lossy: bool


CODECS: Final = MappingProxyType(
    {
        Codec.RAW: CodecInfo(Codec.RAW, "raw", lossy=False),
        Codec.Q8: CodecInfo(Codec.Q8, "q8", lossy=True),
    }
)
"""The registry, by value."""
_BY_NAME: Final = MappingProxyType({info.name: info.codec for info in CODECS.values()})


def is_codec_name(text: str) -> bool:
    """Whether ``text`` has the syntax of a codec name, ``[a-z0-9-]{1,32}`` (profile 3.2)."""
    return _CODEC_NAME.fullmatch(text) is not None


def codec_from_value(value: int) -> Codec:
    """The codec with this 16-bit value.

    Raises:
        UnknownCodecError: not 0..0xFFFF, unassigned, or private use.
    """
    if not 0 <= value <= MAX_CODEC_VALUE:
        raise UnknownCodecError(f"codec value {value} is not a 16-bit value")
    try:
        return Codec(value)
    except ValueError:
        kind = "private-use" if value >= PRIVATE_USE_FIRST else "unassigned"
        raise UnknownCodecError(f"codec value 0x{value:04x} is {kind}") from None


def codec_from_name(name: str) -> Codec:
    """The codec with this registry name (exact, case-sensitive).

    Raises:
        UnknownCodecError: malformed or not registered.
    """
    if not is_codec_name(name):
        raise UnknownCodecError(f"{name!r} is not a codec name ([a-z0-9-]{{1,32}})")
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownCodecError(f"codec {name!r} is not registered") from None


def q8_size(shape: tuple[int, int, int]) -> int:
    """Octets of the q8 encoding of a section of shape ``[H, B, D]``: ``2*H*B + H*B*D``."""
    heads, tokens, head_dim = shape
    rows = heads * tokens
    return rows * Q8_SCALE_SIZE + rows * head_dim


def _shape(shape: tuple[int, int, int]) -> tuple[int, int]:
    heads, tokens, head_dim = shape
    if heads < 1 or tokens < 1 or head_dim < 1:
        raise SectionError(f"section shape {shape} has an empty dimension")
    return heads * tokens, head_dim


def _position(index: int, shape: tuple[int, int, int]) -> str:
    _, tokens, head_dim = shape
    head, rest = divmod(index, tokens * head_dim)
    token, dim = divmod(rest, head_dim)
    return f"[{head}, {token}, {dim}]"


def _f16_overflows(value: float) -> bool:
    try:
        struct.pack("<e", value)
    except OverflowError:
        return True
    return False


def q8_encode(section: Buffer, dtype: Dtype, shape: tuple[int, int, int]) -> bytes:
    """Quantize one section with q8 (section 6; details in the module docstring).

    Args:
        section: ``H*B*D`` little-endian ``dtype`` elements in C order.
        dtype: the element type of ``section``.
        shape: ``(H, B, D)`` = ``(kv_heads, block_tokens, head_dim)``.

    Returns:
        ``scales`` (``H*B`` float16) then ``q`` (``H*B*D`` int8).

    Raises:
        SectionError: wrong size, a non-finite element, or a scale beyond
            float16.
    """
    rows, head_dim = _shape(shape)
    view = memoryview(section).cast("B")
    expected = rows * head_dim * ITEMSIZE[dtype]
    if len(view) != expected:
        raise SectionError(f"section is {len(view)} octets, not {expected} for {shape} {dtype}")
    values = to_float32(dtype, view)
    if not all(map(math.isfinite, values)):
        index = next(i for i, v in enumerate(values) if not math.isfinite(v))
        raise SectionError(
            f"element {_position(index, shape)} is {values[index]!r}: q8 encodes only finite values"
        )
    scales: list[float] = []
    quotients: list[float] = []
    zeros = [0.0] * head_dim
    for start in range(0, rows * head_dim, head_dim):
        row = values[start : start + head_dim]
        peak = max(map(abs, row))
        scale = round_float32(peak / Q8_MAX) if peak else 0.0
        scales.append(scale)
        if scale:
            quotients.extend([x / scale for x in row])
        else:
            quotients.extend(zeros)
    rounded = array("f", quotients).tolist()  # float32 quotient, then ties-to-even below
    q = [-Q8_MAX if v < -Q8_MAX else Q8_MAX if v > Q8_MAX else v for v in map(round, rounded)]
    try:
        scale_bytes = struct.pack(f"<{rows}e", *scales)
    except OverflowError:
        row_index = next(i for i, s in enumerate(scales) if _f16_overflows(s))
        raise SectionError(
            f"q8 scale {scales[row_index]!r} of head {row_index // shape[1]}, token "
            f"{row_index % shape[1]} is beyond float16 (row max above ~8.3e6)"
        ) from None
    return scale_bytes + array("b", q).tobytes()


def q8_decode(data: Buffer, dtype: Dtype, shape: tuple[int, int, int]) -> bytes:
    """Dequantize q8 Data back to a section of ``dtype`` elements (section 6).

    Returns:
        ``H*B*D`` little-endian ``dtype`` elements in C order.

    Raises:
        SectionError: ``data`` is not ``q8_size(shape)`` octets (any content
            of the right size decodes).
    """
    rows, head_dim = _shape(shape)
    view = memoryview(data).cast("B")
    if len(view) != q8_size(shape):
        raise SectionError(f"q8 Data is {len(view)} octets, not {q8_size(shape)} for {shape}")
    split = rows * Q8_SCALE_SIZE
    scales = struct.unpack(f"<{rows}e", view[:split])
    q = view[split:].cast("b").tolist()
    values: list[float] = []
    for row, scale in enumerate(scales):
        start = row * head_dim
        values.extend([v * scale for v in q[start : start + head_dim]])
    return from_float32(dtype, values)


def encoded_size(codec: Codec | int, descriptor: CompatibilityDescriptor) -> int:
    """Octets of the Data of a ``k`` or ``v`` Object (twice this for ``kv``).

    Raises:
        UnknownCodecError: ``codec`` is not in the registry.
    """
    if codec_from_value(codec) is Codec.RAW:
        return descriptor.section_size
    return q8_size(descriptor.section_shape)


def encode_section(
    codec: Codec | int, descriptor: CompatibilityDescriptor, section: Buffer
) -> memoryview:
    """The Data of a ``k`` or ``v`` Object: ``section`` encoded with ``codec``.

    ``raw`` returns a view of ``section`` itself (no copy).

    Raises:
        UnknownCodecError: ``codec`` is not in the registry.
        SectionError: wrong size, or (q8) a section that cannot be encoded.
    """
    codec = codec_from_value(codec)
    view = check_section(descriptor, section)
    if codec is Codec.RAW:
        return view
    return memoryview(q8_encode(view, descriptor.dtype, descriptor.section_shape))


def decode_section(
    codec: Codec | int, descriptor: CompatibilityDescriptor, data: Buffer
) -> memoryview:
    """The K or V section carried by the Data of a ``k`` or ``v`` Object.

    ``raw`` returns a view of ``data`` itself (no copy).

    Raises:
        UnknownCodecError: ``codec`` is not in the registry.
        SectionError: ``data`` is not ``encoded_size(codec, descriptor)`` octets.
    """
    codec = codec_from_value(codec)
    view = memoryview(data).cast("B")
    if len(view) != encoded_size(codec, descriptor):
        raise SectionError(
            f"{CODECS[codec].name} Data is {len(view)} octets, "
            f"not {encoded_size(codec, descriptor)}"
        )
    if codec is Codec.RAW:
        return view
    return memoryview(q8_decode(view, descriptor.dtype, descriptor.section_shape))


def encode_kv(
    codec: Codec | int, descriptor: CompatibilityDescriptor, k_section: Buffer, v_section: Buffer
) -> tuple[memoryview, memoryview]:
    """The Data of a ``kv`` Object, as two pieces to send back to back (encoded K, encoded V).

    Scatter/gather: for ``raw`` the pieces are views of the sections.
    """
    return (
        encode_section(codec, descriptor, k_section),
        encode_section(codec, descriptor, v_section),
    )


def decode_kv(
    codec: Codec | int, descriptor: CompatibilityDescriptor, data: Buffer
) -> tuple[memoryview, memoryview]:
    """The K and V sections carried by the Data of a ``kv`` Object.

    Raises:
        UnknownCodecError: ``codec`` is not in the registry.
        SectionError: ``data`` is not twice ``encoded_size(codec, descriptor)``.
    """
    codec = codec_from_value(codec)
    view = memoryview(data).cast("B")
    half = encoded_size(codec, descriptor)
    if len(view) != 2 * half:
        raise SectionError(f"{CODECS[codec].name} kv Data is {len(view)} octets, not {2 * half}")
    return (
        decode_section(codec, descriptor, view[:half]),
        decode_section(codec, descriptor, view[half:]),
    )
