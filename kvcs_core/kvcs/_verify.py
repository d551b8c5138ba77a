"""Consumer-side verification of manifests and Objects (profile 3.5, 3.6 and 5.4).

Theory of operation
-------------------
Pure functions; the consumer machine decides what to do with the verdicts.

*Manifest* (profile 3.6, 5.2, 5.4), in order:

1. the envelope: a ``manifest.cose`` payload must verify with the producer key of
   its ``kid`` (:func:`kvcs_core.kvcs.cose.verify_manifest`). When producer
   authenticity is *not* required and no key is known for the ``kid`` (or no
   keys were given), the JSON inside is used unauthenticated, exactly as a plain
   ``manifest`` would be; a signature that a known key refuses is always
   refused (it is evidence of tampering). A plain ``manifest`` is only ever
   subscribed when authenticity is not required;
2. the JSON: :func:`kvcs_core.kvcs.manifest.parse_manifest` (strict);
3. the Compatibility ID of ``compat`` equals namespace field 2 (profile 3.6
   MUST);
4. for every segment that lies inside the blocks we need, and for which we hold
   every Block Key, ``block_keys_sha256`` equals the SHA-256 of our keys
   (binding 3) -- a segment that runs past the blocks we need is covered by the
   Anchor Key of discovery or by the KVSP index, not by this check;
5. every needed segment offers the selected tracks (profile 3.2).

*Object* (profile 3.5): :func:`check_object` applies
:func:`kvcs_core.kvcs.payload.verify_object` with every context check the
consumer can supply (component and codec of the track, Token Count from the
descriptor, Token Start from the manifest's ``first_block``, the listed digest
when the manifest lists it), then the Data Length the codec gives for the
descriptor (binding 5 and 6). Because every expected field is known, it first
tries the per-Object fast path: one length comparison, one unpack of the
header (Flags and Reserved skipped: ignored on receipt) compared field by field
with the expected values, then SHA-256 over the Data view, compared with the
header's Data Digest. It accepts exactly what the full check accepts; anything
it does not accept goes through the full check, which names the first failing
check (so a refused Object costs a second pass, an accepted one does not).
"""

from __future__ import annotations

import hashlib
import io
import struct
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import cbor2

from kvcs_core.kvcs._consumer_events import DiscardReason, ManifestRejectReason
from kvcs_core.kvcs.cose import (
    COSE_SIGN1_TAG,
    CoseRejectReason,
    ManifestRejected,
    VerificationKey,
    verify_manifest,
)
from kvcs_core.kvcs.manifest import Manifest, ManifestError, ManifestErrorReason, parse_manifest
from kvcs_core.kvcs.names import Component, KvcsNamespace
from kvcs_core.kvcs.payload import (
    HEADER_LEN,
    MAGIC,
    VERSION,
    ObjectRejected,
    ObjectRejectReason,
    verify_object,
)
from kvcs_core.kvsp.keys import block_keys_sha256

_MAX_CBOR_DEPTH = 16


@attrs.frozen
class Refusal:
    """Why a manifest version was refused."""

    reason: ManifestRejectReason
    detail: str


@attrs.frozen
class OpenedManifest:
    """A manifest JSON payload taken out of its envelope."""

    json: bytes
    authenticated: bool


def unverified_cose_payload(data: bytes | memoryview) -> bytes | None:
    """The payload of a COSE_Sign1 without checking its signature, or None if malformed.

    Used only when producer authenticity is not required and no key is known.
    """
    fp = io.BytesIO(bytes(data))
    try:
        item = cbor2.CBORDecoder(fp, max_depth=_MAX_CBOR_DEPTH).decode()
    except Exception:  # cbor2 is third-party: any failure on peer bytes is "malformed"
        return None
    if isinstance(item, cbor2.CBORTag):
        if item.tag != COSE_SIGN1_TAG:
            return None
        item = item.value
    if not isinstance(item, list | tuple) or len(item) != 4 or not isinstance(item[2], bytes):
        return None
    return item[2]


def open_manifest(
    payload: memoryview,
    *,
    signed: bool,
    keys: Mapping[bytes, VerificationKey] | None,
    require_authenticity: bool,
    max_size: int,
) -> OpenedManifest | Refusal:
    """Step 1 of the module docstring: the manifest JSON and whether it is authenticated."""
    if not signed:
        if require_authenticity:
            return Refusal(ManifestRejectReason.UNSIGNED, "an unsigned manifest is not acceptable")
        return OpenedManifest(bytes(payload), authenticated=False)
    if keys is None and not require_authenticity:
        raw = unverified_cose_payload(payload)
        if raw is None:
            return Refusal(ManifestRejectReason.BAD_SIGNATURE, "not a COSE_Sign1")
        return OpenedManifest(raw, authenticated=False)
    result = verify_manifest(payload, keys or {}, max_size=max_size)
    if isinstance(result, ManifestRejected):
        unknown = result.reason in (CoseRejectReason.UNKNOWN_KID, CoseRejectReason.MISSING_KID)
        if unknown and not require_authenticity:
            raw = unverified_cose_payload(payload)
            if raw is not None:
                return OpenedManifest(raw, authenticated=False)
        return Refusal(ManifestRejectReason.BAD_SIGNATURE, f"{result.reason.name}: {result.detail}")
    return OpenedManifest(result, authenticated=True)


def parse_and_check(
    data: bytes,
    *,
    namespace: KvcsNamespace,
    block_keys: Sequence[bytes],
    blocks: int,
    track_names: Sequence[str],
    codec: str,
    max_size: int,
) -> Manifest | Refusal:
    """Steps 2 to 5 of the module docstring.

    Args:
        data: the manifest JSON.
        namespace: the publication's namespace (field 2 is checked).
        block_keys: our Block Keys (``block_keys[i]`` is K_i).
        blocks: how many blocks we need from this publication (0..blocks-1).
        track_names: the selected component tokens (``"k"``, ``"v"`` / ``"kv"``).
        codec: the selected codec name.
        max_size: parse limit.
    """
    try:
        manifest = parse_manifest(data, max_size=max_size)
        manifest.check_compat_id(namespace)
    except ManifestError as e:
        if e.reason in (ManifestErrorReason.COMPAT_ID_MISMATCH, ManifestErrorReason.BAD_COMPAT):
            return Refusal(ManifestRejectReason.COMPAT_MISMATCH, str(e))
        return Refusal(ManifestRejectReason.MALFORMED_MANIFEST, str(e))
    refusal = check_segments(
        manifest, block_keys=block_keys, blocks=blocks, track_names=track_names, codec=codec
    )
    return manifest if refusal is None else refusal


def check_segments(
    manifest: Manifest,
    *,
    block_keys: Sequence[bytes],
    blocks: int,
    track_names: Sequence[str],
    codec: str,
) -> Refusal | None:
    """Steps 4 and 5 for every segment that overlaps blocks 0..blocks-1."""
    for seg in manifest.segments:
        if seg.first_block >= blocks:
            break
        if seg.end_block <= blocks and seg.end_block <= len(block_keys):
            ours = block_keys_sha256(block_keys, seg.first_block, seg.blocks)
            if ours != seg.block_keys_sha256:
                return Refusal(
                    ManifestRejectReason.BLOCK_KEYS_MISMATCH,
                    f"segment {seg.segment} covers other tokens than ours",
                )
        for token in track_names:
            name = f"{token}.{codec}.s{seg.segment}"
            if name not in seg.tracks:
                return Refusal(
                    ManifestRejectReason.MISSING_TRACKS,
                    f"segment {seg.segment} does not offer {name!r}",
                )
    return None


@attrs.frozen
class ObjectVerdict:
    """Why an Object was refused."""

    reason: DiscardReason
    check: ObjectRejectReason | None
    detail: str


_EXPECTED: Final = struct.Struct(">IBB2xIIQIH2xI32s")
"""The 68-octet header without Flags and Reserved (``payload._HEADER`` minus two fields);
``_EXPECTED.size == HEADER_LEN`` (tests check it)."""


def check_object(
    payload: memoryview,
    *,
    layer: int,
    object_id: int,
    component: Component,
    codec: int,
    block_tokens: int,
    token_start: int,
    listed_digest: bytes | None,
    data_length: int,
) -> tuple[memoryview, bytes] | ObjectVerdict:
    """Every check of profile 3.5 plus the codec's Data Length; never raises on bad bytes.

    Returns:
        ``(data, digest)`` when every check passed: ``data`` is the Data as a
        zero-copy view of ``payload`` and ``digest`` the Data Digest (SHA-256
        of ``data``); else the verdict of the first failing check.
    """
    if (
        len(payload) == HEADER_LEN + data_length
        and payload.format == "B"
        and payload.ndim == 1
        and payload.c_contiguous
    ):
        magic, version, comp, lay, block, start, count, cdc, length, digest = _EXPECTED.unpack_from(
            payload
        )
        if (
            magic == MAGIC
            and version == VERSION
            and comp == component
            and lay == layer
            and block == object_id
            and start == token_start
            and count == block_tokens
            and cdc == codec
            and length == data_length
            and (listed_digest is None or digest == listed_digest)
        ):
            data = payload[HEADER_LEN:]
            if hashlib.sha256(data).digest() == digest:
                return data, digest
    return _full_check(
        payload,
        layer=layer,
        object_id=object_id,
        component=component,
        codec=codec,
        block_tokens=block_tokens,
        token_start=token_start,
        listed_digest=listed_digest,
        data_length=data_length,
    )


def _full_check(
    payload: memoryview,
    *,
    layer: int,
    object_id: int,
    component: Component,
    codec: int,
    block_tokens: int,
    token_start: int,
    listed_digest: bytes | None,
    data_length: int,
) -> tuple[memoryview, bytes] | ObjectVerdict:
    """:func:`check_object` the long way: every check in order, the first failure named."""
    result = verify_object(
        payload,
        group_id=layer,
        object_id=object_id,
        expected_component=component,
        expected_codec=codec,
        expected_token_count=block_tokens,
        expected_token_start=token_start,
        listed_digest=listed_digest,
    )
    if isinstance(result, ObjectRejected):
        return ObjectVerdict(DiscardReason.PAYLOAD_CHECK, result.reason, result.detail)
    if len(result.data) != data_length:
        return ObjectVerdict(
            DiscardReason.DATA_LENGTH,
            None,
            f"Data is {len(result.data)} octets; the codec gives {data_length}",
        )
    return result.data, result.header.data_digest
