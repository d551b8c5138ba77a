"""The KVCS object payload: a 68-octet header, then the Data (profile section 3.5).

Theory of operation
-------------------
Every Object of a data track carries one payload::

    offset size field
         0    4 Magic          0x4B564F31 ("KVO1")
         4    1 Version        1
         5    1 Component      1 = k, 2 = v, 3 = kv
         6    2 Flags          reserved: sent as zero, ignored on receipt
         8    4 Layer          == Group ID
        12    4 Block Index    == Object ID (block index within the segment)
        16    8 Token Start    absolute position of the block's first token
        24    4 Token Count    == block_tokens of the Compatibility Descriptor
        28    2 Codec          KVSP codec registry value (binding 6)
        30    2 Reserved       sent as zero, ignored on receipt (like Flags)
        32    4 Data Length    octets of Data
        36   32 Data Digest    SHA-256 of Data
        68    n Data

All integers are big-endian (network order, as drawn).

*Sending* is scatter/gather: :func:`build_payload_parts` returns the 68 header
octets and a ``memoryview`` of the caller's Data, computing the digest over the
view; the two are written one after the other and never concatenated.
:func:`pack_header` is its per-Object step alone, for a sender that has
checked the field types once (the publisher, per layer).

*Receiving*: :func:`verify_object` performs every End Subscriber check that
profile 3.5 requires (MUST): Magic and Version as specified; Layer equals the
Group ID; Block Index equals the Object ID; header plus Data Length account for
the whole payload exactly (neither short nor long); the Data Digest matches the
Data. It adds the checks that the caller can supply context for (Component of
the track, Codec of the track's codec name, Token Count from the descriptor,
Token Start from the manifest's ``first_block``, the digest listed in the
manifest). It never raises on bad peer bytes: a failing object yields an
:class:`ObjectRejected` with an :class:`ObjectRejectReason` and the caller
discards it and treats it as missing; only a :class:`VerifiedObject` exposes
the Data, as a zero-copy ``memoryview`` slice of the payload buffer. Checks run
cheapest first; the SHA-256 over the Data runs last.

A Component value outside 1..3 is rejected (the field has no other meaning in
Version 1); whether a Codec value is *registered* is the KVSP registry's
question, asked by the caller through ``expected_codec``.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from typing import Any, Final

import attrs

from kvcs_core.kvcs.names import Component

MAGIC: Final = 0x4B564F31
"""``"KVO1"``."""
VERSION: Final = 1
HEADER_LEN: Final = 68
DIGEST_LEN: Final = 32
MAX_DATA_LENGTH: Final = 0xFFFF_FFFF
"""Data Length is a u32."""

_HEADER: Final = struct.Struct(">IBBHIIQIHHI32s")
# _HEADER.size == HEADER_LEN (68); tests check it.

_U16: Final = 0xFFFF
_U32: Final = 0xFFFF_FFFF
_U64: Final = 0xFFFF_FFFF_FFFF_FFFF

Buffer = bytes | bytearray | memoryview
"""What payload functions accept: any contiguous bytes-like object."""


class PayloadEncodeError(ValueError):
    """A header field that the 68-octet format cannot carry (local misuse)."""


def _uint(bits_max: int, what: str) -> Any:
    def check(_inst: Any, _attr: Any, value: int) -> None:
        if type(value) is not int and not isinstance(value, enum.IntEnum):
            raise PayloadEncodeError(f"{what} must be an int, not {type(value).__name__}")
        if not 0 <= value <= bits_max:
            raise PayloadEncodeError(f"{what} {value} is outside 0..{bits_max}")

    return check


def _check_digest(_inst: Any, _attr: Any, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != DIGEST_LEN:
        raise PayloadEncodeError(f"Data Digest must be {DIGEST_LEN} bytes")


def _to_component(value: Component | int) -> Component:
    try:
        return Component(value)
    except ValueError:
        raise PayloadEncodeError(f"Component {value!r} is not 1, 2 or 3") from None


@attrs.frozen
class ObjectHeader:
    """The 68-octet header of profile 3.5, decoded (Magic and Version implied)."""

    component: Component = attrs.field(converter=_to_component)
    layer: int = attrs.field(validator=_uint(_U32, "Layer"))
    block_index: int = attrs.field(validator=_uint(_U32, "Block Index"))
    token_start: int = attrs.field(validator=_uint(_U64, "Token Start"))
    token_count: int = attrs.field(validator=_uint(_U32, "Token Count"))
    codec: int = attrs.field(validator=_uint(_U16, "Codec"))
    data_length: int = attrs.field(validator=_uint(_U32, "Data Length"))
    data_digest: bytes = attrs.field(validator=_check_digest)
    flags: int = attrs.field(default=0, validator=_uint(_U16, "Flags"))
    reserved: int = attrs.field(default=0, validator=_uint(_U16, "Reserved"))

    @property
    def payload_length(self) -> int:
        """Header plus Data: the whole Object payload."""
        return HEADER_LEN + self.data_length

    def encode(self) -> bytes:
        """The 68 header octets (the Data is sent separately)."""
        return _HEADER.pack(
            MAGIC,
            VERSION,
            self.component,
            self.flags,
            self.layer,
            self.block_index,
            self.token_start,
            self.token_count,
            self.codec,
            self.reserved,
            self.data_length,
            self.data_digest,
        )


def encode_header(header: ObjectHeader) -> bytes:
    """The 68 header octets of ``header`` (same as :meth:`ObjectHeader.encode`)."""
    return header.encode()


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("payload buffers must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def data_digest(data: Buffer) -> bytes:
    """SHA-256 of ``data`` (the Data Digest field), without copying it."""
    return hashlib.sha256(_byte_view(data)).digest()


def build_payload_parts(
    *,
    component: Component,
    layer: int,
    block_index: int,
    token_start: int,
    token_count: int,
    codec: int,
    data: Buffer,
) -> tuple[bytes, memoryview]:
    """Header octets and a view of ``data``, to be written back to back.

    Computes Data Length and Data Digest from ``data``; Flags and Reserved are
    zero. ``data`` may be any C-contiguous buffer (a tensor's memory, say); it
    is viewed as bytes, never copied. Raises :class:`PayloadEncodeError` for a
    field out of range.
    """
    view = _byte_view(data)
    if len(view) > MAX_DATA_LENGTH:
        raise PayloadEncodeError(f"Data of {len(view)} octets exceeds the u32 Data Length")
    if int(component) not in _COMPONENTS:
        raise PayloadEncodeError(f"Component {component!r} is not 1, 2 or 3")
    fields = (layer, block_index, token_start, token_count, codec)
    if any(type(f) is not int for f in fields):  # bool and float are not header fields
        raise PayloadEncodeError(f"header fields must be ints, got {fields!r}")
    header = pack_header(component, layer, block_index, token_start, token_count, codec, view)
    return header, view


def pack_header(
    component: int,
    layer: int,
    block_index: int,
    token_start: int,
    token_count: int,
    codec: int,
    data: memoryview,
) -> bytes:
    """The 68 header octets of the Object whose Data is ``data`` (a byte view).

    The per-Object step of a sender that has already checked the field types:
    Data Length and the SHA-256 Data Digest come from ``data`` (hashed in place),
    Flags and Reserved are zero, and no header object is built. The fixed-width
    pack is the range check.

    Raises:
        PayloadEncodeError: a field that does not fit its slot.
    """
    try:
        return _HEADER.pack(
            MAGIC,
            VERSION,
            component,
            0,
            layer,
            block_index,
            token_start,
            token_count,
            codec,
            0,
            len(data),
            hashlib.sha256(data).digest(),
        )
    except struct.error as e:
        raise PayloadEncodeError(f"a header field is out of range: {e}") from None


# --- receiving ----------------------------------------------------------------


class ObjectRejectReason(enum.IntEnum):
    """Why an Object payload was discarded (profile 3.5: "treated as missing")."""

    TRUNCATED_HEADER = 1
    """Fewer than 68 octets."""
    BAD_MAGIC = 2
    BAD_VERSION = 3
    BAD_COMPONENT = 4
    """Component is not 1, 2 or 3."""
    LAYER_MISMATCH = 5
    """Layer is not the Group ID."""
    BLOCK_INDEX_MISMATCH = 6
    """Block Index is not the Object ID."""
    DATA_TRUNCATED = 7
    """The payload ends before 68 + Data Length octets."""
    TRAILING_OCTETS = 8
    """The payload goes on after 68 + Data Length octets."""
    COMPONENT_MISMATCH = 9
    """Component differs from the track's component."""
    CODEC_MISMATCH = 10
    """Codec differs from the value of the track's codec name."""
    TOKEN_COUNT_MISMATCH = 11
    """Token Count differs from the descriptor's ``block_tokens``."""
    TOKEN_START_MISMATCH = 12
    """Token Start differs from ``(first_block + Object ID) * block_tokens``."""
    LISTED_DIGEST_MISMATCH = 13
    """Data Digest differs from the digest the manifest lists for this Object."""
    DIGEST_MISMATCH = 14
    """SHA-256 of the Data differs from the Data Digest."""


@attrs.frozen
class ObjectRejected:
    """A payload that failed a check; never use any part of it."""

    reason: ObjectRejectReason
    detail: str
    header: ObjectHeader | None = attrs.field(default=None, eq=False, repr=False)
    """The decoded header when the failure came after decoding it (diagnostics only)."""


@attrs.frozen
class VerifiedObject:
    """A payload that passed every check.

    ``data`` is a ``memoryview`` slice of the buffer given to
    :func:`verify_object` (``data.obj`` is that buffer's underlying object): no
    copy was made. It stays valid as long as that buffer is not modified.
    """

    header: ObjectHeader
    data: memoryview = attrs.field(eq=False, repr=lambda v: f"<{len(v)} octets>")


def parse_header(payload: Buffer) -> ObjectHeader | ObjectRejected:
    """Decode and check the fixed part of a header: length >= 68, Magic, Version.

    Also rejects a Component outside 1..3. Does not look at the Data.
    """
    view = _byte_view(payload)
    if len(view) < HEADER_LEN:
        return ObjectRejected(
            ObjectRejectReason.TRUNCATED_HEADER,
            f"payload is {len(view)} octets, shorter than the {HEADER_LEN}-octet header",
        )
    (
        magic,
        version,
        component,
        flags,
        layer,
        block_index,
        token_start,
        token_count,
        codec,
        reserved,
        data_length,
        digest,
    ) = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        return ObjectRejected(ObjectRejectReason.BAD_MAGIC, f"Magic is {magic:#010x}")
    if version != VERSION:
        return ObjectRejected(ObjectRejectReason.BAD_VERSION, f"Version is {version}")
    comp = _COMPONENT_OF.get(component)
    if comp is None:
        return ObjectRejected(ObjectRejectReason.BAD_COMPONENT, f"Component is {component}")
    # Every field came out of its fixed-width slot, so the range validators cannot fail:
    # build the frozen header without them (this runs once per received Object).
    header = object.__new__(ObjectHeader)
    for name, value in (
        ("component", comp),
        ("layer", layer),
        ("block_index", block_index),
        ("token_start", token_start),
        ("token_count", token_count),
        ("codec", codec),
        ("data_length", data_length),
        ("data_digest", digest),
        ("flags", flags),
        ("reserved", reserved),
    ):
        object.__setattr__(header, name, value)
    return header


_COMPONENTS: Final = frozenset(int(c) for c in Component)
_COMPONENT_OF: Final[dict[int, Component]] = {int(c): c for c in Component}


def verify_object(
    payload: Buffer,
    *,
    group_id: int,
    object_id: int,
    expected_component: Component | None = None,
    expected_codec: int | None = None,
    expected_token_count: int | None = None,
    expected_token_start: int | None = None,
    listed_digest: bytes | None = None,
) -> VerifiedObject | ObjectRejected:
    """Every End Subscriber check of profile 3.5, plus the optional context checks.

    Args:
        payload: the Object payload as received (any C-contiguous buffer).
        group_id, object_id: the Object's Location; must equal Layer and Block
            Index.
        expected_component: the component of the track the Object came on.
        expected_codec: the registry value of the track's codec name.
        expected_token_count: ``block_tokens`` of the Compatibility Descriptor.
        expected_token_start: ``(first_block + object_id) * block_tokens``.
        listed_digest: the Data Digest the manifest lists for this Object.

    Returns:
        :class:`VerifiedObject` (``data`` is a zero-copy view), or
        :class:`ObjectRejected` with the first failing check. Never raises on
        bad payload bytes.
    """
    parsed = parse_header(payload)
    if isinstance(parsed, ObjectRejected):
        return parsed
    h = parsed

    def reject(reason: ObjectRejectReason, detail: str) -> ObjectRejected:
        return ObjectRejected(reason, detail, h)

    if h.layer != group_id:
        return reject(ObjectRejectReason.LAYER_MISMATCH, f"Layer {h.layer} but Group ID {group_id}")
    if h.block_index != object_id:
        return reject(
            ObjectRejectReason.BLOCK_INDEX_MISMATCH,
            f"Block Index {h.block_index} but Object ID {object_id}",
        )
    view = _byte_view(payload)
    if len(view) < h.payload_length:
        return reject(
            ObjectRejectReason.DATA_TRUNCATED,
            f"Data Length {h.data_length} but only {len(view) - HEADER_LEN} octets follow",
        )
    if len(view) > h.payload_length:
        return reject(
            ObjectRejectReason.TRAILING_OCTETS,
            f"{len(view) - h.payload_length} octets after the Data",
        )
    if expected_component is not None and h.component != expected_component:
        return reject(
            ObjectRejectReason.COMPONENT_MISMATCH,
            f"Component {h.component.name} on a {Component(expected_component).name} track",
        )
    if expected_codec is not None and h.codec != expected_codec:
        return reject(
            ObjectRejectReason.CODEC_MISMATCH,
            f"Codec {h.codec} but the track's is {expected_codec}",
        )
    if expected_token_count is not None and h.token_count != expected_token_count:
        return reject(
            ObjectRejectReason.TOKEN_COUNT_MISMATCH,
            f"Token Count {h.token_count}, expected {expected_token_count}",
        )
    if expected_token_start is not None and h.token_start != expected_token_start:
        return reject(
            ObjectRejectReason.TOKEN_START_MISMATCH,
            f"Token Start {h.token_start}, expected {expected_token_start}",
        )
    if listed_digest is not None and h.data_digest != listed_digest:
        return reject(
            ObjectRejectReason.LISTED_DIGEST_MISMATCH,
            "Data Digest differs from the digest listed in the manifest",
        )
    data = view[HEADER_LEN:]
    if hashlib.sha256(data).digest() != h.data_digest:
        return reject(
            ObjectRejectReason.DIGEST_MISMATCH, "SHA-256 of the Data is not the Data Digest"
        )
    return VerifiedObject(h, data)
