"""KVCS production: what one publication offers, and how a layer becomes Objects.

Theory of operation
-------------------
The pure half of :class:`~kvcs_core.kvcs.publisher.KvcsPublisher`: no
sessions, no stores, only values. The publisher calls it to turn one layer of
K/V sections into Objects and the state of its segments into a manifest.

*Offer* (profile 3.2). A publication offers one set of data tracks per segment,
each a (component, codec) pair (:class:`TrackOffer`): by default ``k.raw`` and
``v.raw``; optionally a ``kv`` track with a compressing codec (``kv.q8``). A
consumer selects a ``k``/``v`` pair of one codec or one ``kv`` track, so
:func:`check_offer` refuses a ``k`` without the ``v`` of the same codec (and
the reverse): such a track could never be selected.

*Objects* (profile 3.3 to 3.5). :func:`encode_layer` checks and encodes a whole
layer before anything is published, so a failing call leaves nothing behind:
one K and one V section per full block of the segment, each exactly
``descriptor.section_size`` octets (KVSP binding 5). For every offered track
it returns one :class:`EncodedGroup`: per block the 68-octet header (Layer =
Group ID, Block Index = Object ID, Token Start = ``(first_block + Object ID) *
block_tokens``, Token Count = ``block_tokens``, the codec's registry value,
Data Length and the SHA-256 Data Digest, hashed once per Object straight over
the Data view) kept apart from the Data (scatter/gather, never ``header +
data``), and the digests in hex for the manifest. The header fields are
bounded once per layer (the layer, the largest Token Start, the Data Length),
so the per-Object step is the hash and one fixed-width pack. The Data of
``k.raw``/``v.raw`` is a view of the caller's section (no copy); a lossy codec
(``q8``, binding 6) makes new buffers, encoded once per section even when
several tracks need them; a ``kv`` Object is the encoded K section followed by
the encoded V section, joined into one new buffer because an Object payload is
one buffer (for ``kv.raw`` this is the one copy of the caller's data the
publisher makes).

*Manifest* (profile 3.6). :class:`SegmentState` records, per segment, the
digests of every completed Group of every track, in Object order; it becomes a
manifest :class:`~kvcs_core.kvcs.manifest.Segment` with ``object_digests`` (the
SHOULD of 3.6), which :func:`build_manifest` assembles into one deterministic
manifest version. :class:`ManifestSigner` wraps it in COSE_Sign1
(``manifest.cose``) with the producer key and ``kid``.

Errors are local misuse (:class:`PublisherError`, a
:class:`~kvcs_core.moqt.errors.LocalProtocolError`); those about the caller's
data are also ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from kvcs_core.kvcs.cose import SigningKey, sign_manifest
from kvcs_core.kvcs.manifest import Manifest, Segment
from kvcs_core.kvcs.names import Component, DataTrackName
from kvcs_core.kvcs.payload import (
    DIGEST_LEN,
    HEADER_LEN,
    MAX_DATA_LENGTH,
    ObjectHeader,
    pack_header,
)
from kvcs_core.kvsp import (
    Codec,
    CompatibilityDescriptor,
    KvspError,
    check_section,
    codec_from_name,
    codec_from_value,
    encode_section,
)
from kvcs_core.moqt.errors import LocalProtocolError

__all__ = [
    "MAX_MANIFEST_INTERVAL",
    "RAW_KV",
    "RAW_KV_WITH_KV_Q8",
    "EncodedGroup",
    "LayerOrderError",
    "ManifestSigner",
    "OfferError",
    "PublicationFinishedError",
    "PublisherError",
    "SectionMismatchError",
    "SegmentError",
    "SegmentState",
    "TrackOffer",
    "build_manifest",
    "check_offer",
    "encode_layer",
    "layer_priority",
]

MAX_MANIFEST_INTERVAL: Final = 8
"""Profile 3.6: a new manifest version at least every eight completed layers."""
PRIORITY_SPAN: Final = 128
"""Profile 3.4: Publisher Priority of Group g is ``floor(128 * g / L)``."""


# --- errors ---------------------------------------------------------------------------


class PublisherError(LocalProtocolError):
    """The publisher was used in a way the profile or its API forbids (nothing changed)."""


class LayerOrderError(PublisherError):
    """A layer put out of order: layers of a segment go 0, 1, ..., L-1, once each (3.3)."""


class SegmentError(PublisherError):
    """An unknown segment, or one in the wrong state for the call."""


class PublicationFinishedError(PublisherError):
    """The publication was finished: no segment may be added any more."""


class OfferError(PublisherError, ValueError):
    """A set of offered tracks that a consumer could not use (profile 3.2)."""


class SectionMismatchError(PublisherError, ValueError):
    """K/V sections that do not fit the descriptor or the segment (count, size, layout)."""


# --- the offer --------------------------------------------------------------------------


def _component(value: Component | int | str) -> Component:
    if isinstance(value, str):
        try:
            return Component.from_token(value)
        except ValueError as e:
            raise OfferError(str(e)) from None
    try:
        return Component(value)
    except ValueError:
        raise OfferError(f"component {value!r} is not 1 (k), 2 (v) or 3 (kv)") from None


def _codec(value: Codec | int | str) -> Codec:
    try:
        return codec_from_name(value) if isinstance(value, str) else codec_from_value(value)
    except KvspError as e:
        raise OfferError(str(e)) from None


@attrs.frozen
class TrackOffer:
    """One offered data track kind: a component and a KVSP codec (``"kv"``, ``"q8"`` work too)."""

    component: Component = attrs.field(converter=_component)
    codec: Codec = attrs.field(converter=_codec)

    def track_name(self, segment: int) -> str:
        """``<component>.<codec>.s<segment>`` (profile 3.2)."""
        return str(DataTrackName(self.component, self.codec.registry_name, segment))


RAW_KV: Final = (TrackOffer(Component.K, Codec.RAW), TrackOffer(Component.V, Codec.RAW))
"""The default offer: ``k.raw.s<n>`` and ``v.raw.s<n>``."""
RAW_KV_WITH_KV_Q8: Final = (*RAW_KV, TrackOffer(Component.KV, Codec.Q8))
"""``k.raw``, ``v.raw`` and a jointly encoded, quantized ``kv.q8`` track."""


def check_offer(offer: Sequence[TrackOffer]) -> tuple[TrackOffer, ...]:
    """The offer as a tuple, after checking that every track can be selected.

    Raises:
        OfferError: empty, a duplicate, or a ``k`` track without the ``v`` track
            of the same codec (or the reverse).
    """
    out = tuple(offer)
    if not out:
        raise OfferError("offer at least one track (a k/v pair or a kv track)")
    for item in out:
        if not isinstance(item, TrackOffer):
            raise OfferError(f"{item!r} is not a TrackOffer")
    if len(set(out)) != len(out):
        raise OfferError("a track is offered twice")
    kinds = {(o.component, o.codec) for o in out}
    for o in out:
        other = {Component.K: Component.V, Component.V: Component.K}.get(o.component)
        if other is not None and (other, o.codec) not in kinds:
            raise OfferError(
                f"{o.track_name(0)} without {TrackOffer(other, o.codec).track_name(0)}: "
                "a consumer selects a k/v pair of one codec (profile 3.2)"
            )
    return out


def layer_priority(layer: int, layers: int) -> int:
    """``floor(128 * g / L)`` (profile 3.4)."""
    return PRIORITY_SPAN * layer // layers


# --- signing ----------------------------------------------------------------------------


def _kid(value: bytes) -> bytes:
    if not isinstance(value, bytes) or not value:
        raise PublisherError("kid must be non-empty bytes")
    return value


@attrs.frozen
class ManifestSigner:
    """The producer key and its key identifier: the publication uses ``manifest.cose``.

    The algorithm follows from the key (P-256: ES256; Ed25519/Ed448: EdDSA).
    """

    key: SigningKey = attrs.field(repr=False)
    kid: bytes = attrs.field(converter=_kid)

    def sign(self, manifest_json: bytes) -> bytes:
        """A tagged COSE_Sign1 around ``manifest_json`` (profile 3.6)."""
        return sign_manifest(manifest_json, self.key, self.kid)


# --- segments ---------------------------------------------------------------------------


@attrs.frozen
class EncodedGroup:
    """The Objects of one layer on one track, in Object order, ready to store."""

    heads: list[bytes] = attrs.field(repr=False)
    """The 68 header octets of each Object."""
    datas: list[memoryview] = attrs.field(repr=lambda v: f"<{len(v)} Objects>", eq=False)
    """The Data of each Object."""
    digests_hex: tuple[str, ...] = attrs.field(repr=False)
    """The Data Digest of each Object, lowercase hex (for ``object_digests``)."""


@attrs.define(eq=False)
class SegmentState:
    """What the publisher knows of one segment (profile 3.3, 3.6)."""

    segment: int
    first_block: int
    blocks: int
    block_tokens: int
    layers: int
    block_keys_sha256: str
    offers: tuple[tuple[str, TrackOffer], ...]
    """``(track name, offer)`` in offer order."""
    digests: dict[str, list[tuple[str, ...]]] = attrs.field(factory=dict)
    """Per track, one tuple of hex Data Digests per completed Group."""
    next_layer: int = 0

    @property
    def complete(self) -> bool:
        """Every layer was put."""
        return self.next_layer == self.layers

    @property
    def track_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.offers)

    def token_start(self, object_id: int) -> int:
        """Token Start of an Object: ``(first_block + Object ID) * block_tokens`` (3.4)."""
        return (self.first_block + object_id) * self.block_tokens

    def record_layer(self, layer: int, encoded: Mapping[str, EncodedGroup]) -> None:
        """Note the digests of a completed layer (Group)."""
        assert layer == self.next_layer
        for name, _ in self.offers:
            self.digests.setdefault(name, []).append(encoded[name].digests_hex)
        self.next_layer += 1

    def to_manifest(self, *, list_digests: bool = True) -> Segment:
        """The manifest entry, with ``object_digests`` of the completed Groups if asked."""
        digests = (
            {name: tuple(self.digests.get(name, ())) for name in self.track_names}
            if list_digests
            else None
        )
        return Segment(
            segment=self.segment,
            first_block=self.first_block,
            blocks=self.blocks,
            block_keys_sha256=self.block_keys_sha256,
            tracks=self.track_names,
            complete=self.complete,
            object_digests=digests,
        )


def _sections(
    descriptor: CompatibilityDescriptor, blocks: Sequence[Any], what: str
) -> list[memoryview]:
    """Each section as a byte view (no copy), checked as ``check_section`` does."""
    size = descriptor.section_size
    out: list[memoryview] = []
    for index, block in enumerate(blocks):
        try:
            view = memoryview(block).cast("B")
        except (TypeError, ValueError) as e:  # not bytes-like, or not C-contiguous
            raise SectionMismatchError(f"{what} section of block {index}: {e}") from None
        if view.nbytes != size:
            try:  # the binding's own words for a wrong size
                check_section(descriptor, view, f"{what} section of block {index}")
            except KvspError as e:
                raise SectionMismatchError(str(e)) from None
        out.append(view)
    return out


def encode_layer(
    descriptor: CompatibilityDescriptor,
    segment: SegmentState,
    layer: int,
    k_blocks: Sequence[Any],
    v_blocks: Sequence[Any],
) -> dict[str, EncodedGroup]:
    """Every Object of ``layer`` for every offered track of ``segment``, by track name.

    ``k_blocks[i]`` and ``v_blocks[i]`` are the K and V sections (KVSP binding 5)
    of block ``first_block + i`` for this layer, as any C-contiguous bytes-like
    objects. Nothing is stored; the Data of raw ``k``/``v`` Objects are views of
    these buffers.

    Raises:
        SectionMismatchError: not one section per block of the segment, a
            section of the wrong size or layout, or one the codec cannot
            encode (q8: a non-finite element).
        PayloadEncodeError: a header field the 68-octet format cannot carry
            (a layer or Token Start too large); nothing is encoded then.
    """
    count = segment.blocks
    if len(k_blocks) != count or len(v_blocks) != count:
        raise SectionMismatchError(
            f"segment {segment.segment} has {count} blocks: got {len(k_blocks)} K and "
            f"{len(v_blocks)} V sections"
        )
    raw = (_sections(descriptor, k_blocks, "K"), _sections(descriptor, v_blocks, "V"))
    cache: dict[tuple[Codec, int], list[memoryview]] = {}

    def encoded(codec: Codec, which: int) -> list[memoryview]:
        if codec is Codec.RAW:
            return raw[which]  # raw Data is the section itself (checked above)
        key = (codec, which)
        if key not in cache:
            try:
                cache[key] = [encode_section(codec, descriptor, s) for s in raw[which]]
            except KvspError as e:
                raise SectionMismatchError(f"{codec.registry_name}: {e}") from None
        return cache[key]

    block_tokens = segment.block_tokens
    first_token = segment.token_start(0)
    out: dict[str, EncodedGroup] = {}
    for name, offer in segment.offers:
        if offer.component is Component.K:
            datas = encoded(offer.codec, 0)
        elif offer.component is Component.V:
            datas = encoded(offer.codec, 1)
        else:
            pairs = zip(encoded(offer.codec, 0), encoded(offer.codec, 1), strict=True)
            datas = [memoryview(b"".join(pair)) for pair in pairs]
        if not datas:
            out[name] = EncodedGroup([], [], ())
            continue
        # bound every header field once: the largest value of each is checked here, so the
        # per-Object pack below cannot fail (every Object of a track has one Data Length)
        length = datas[0].nbytes
        if any(d.nbytes != length for d in datas) or length > MAX_DATA_LENGTH:
            raise SectionMismatchError(f"{name}: Data Lengths differ or exceed the u32 field")
        ObjectHeader(
            component=offer.component,
            layer=layer,
            block_index=count - 1,
            token_start=segment.token_start(count - 1),
            token_count=block_tokens,
            codec=offer.codec,
            data_length=length,
            data_digest=bytes(32),
        )
        heads: list[bytes] = []
        digests: list[str] = []
        for object_id, data in enumerate(datas):
            head = pack_header(
                offer.component,
                layer,
                object_id,
                first_token + object_id * block_tokens,
                block_tokens,
                offer.codec,
                data,
            )
            heads.append(head)
            digests.append(head[HEADER_LEN - DIGEST_LEN :].hex())  # the Data Digest field
        out[name] = EncodedGroup(heads, datas, tuple(digests))
    return out


def build_manifest(
    descriptor: CompatibilityDescriptor,
    segments: Sequence[SegmentState],
    *,
    deterministic: bool,
    list_digests: bool = True,
) -> Manifest:
    """One manifest version (profile 3.6) describing ``segments`` as they stand."""
    return Manifest(
        compat=descriptor.to_json(),
        layers=descriptor.layers,
        block_tokens=descriptor.block_tokens,
        deterministic=deterministic,
        segments=[s.to_manifest(list_digests=list_digests) for s in segments],
    )
