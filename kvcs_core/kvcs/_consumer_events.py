"""What the KVCS consumer tells its application, and how it is configured.

Theory of operation
-------------------
:class:`~kvcs_core.kvcs.consumer.KvcsConsumer` reports through a closed union
of frozen, keyword-only attrs events (STYLE.md R3), drained with
``next_event()`` after every input or command, like every kvcs machine
(ARCHITECTURE.md "The call protocol"). In the order they normally appear:

* :class:`PublicationSelected`: a publication was chosen, as the primary source
  or as an alternative for recovery (profile 5.1, 5.4);
* :class:`ManifestAccepted`: a manifest version verified (profile 3.6, 5.4);
* :class:`LayerReady`: every needed Object of one layer, in every selected
  track, is verified; layers need not become ready in order (profile 5.4);
* :class:`RetrievalComplete`: nothing more will be retrieved.

and, for bad data and failures ("Errors, three tiers": KVCS-level bad data is
discarded and reported with a reason, nothing else is lost):

* :class:`ObjectDiscarded`: an Object failed a check of profile 3.5 (or a later
  manifest version lists another digest for it, or a signed manifest never lists
  it); it is never used and is treated as missing;
* :class:`PublicationRejected` / :class:`ManifestDiscarded`: a publication whose
  first manifest could not be accepted, or a later manifest version that was
  refused while the publication stays in use;
* :class:`RecomputeNeeded`: no publication was found, or missing Objects could
  not be recovered within the recovery time bound (profile 5.4: "It does not
  wait indefinitely").

:class:`ConsumerConfig` holds every bound the consumer applies (discovery and
manifest timeouts, the stall timeout, how many publications it tracks, how many
Objects a retrieval may need) with the reason for each default.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import TypeAlias

import attrs

from kvcs_core.kvcs.names import Component
from kvcs_core.kvcs.payload import ObjectRejectReason
from kvcs_core.wire.names import TrackNamespace

WritableBuffer: TypeAlias = bytearray | memoryview
"""A destination: anything ``memoryview`` accepts that is writable and C-contiguous
(a ``bytearray``, or ``memoryview(tensor)`` of a preallocated array)."""

Destinations: TypeAlias = (
    Callable[[int, Component], WritableBuffer] | Mapping[tuple[int, Component], WritableBuffer]
)
"""Where verified Data goes: a buffer per (layer, component), holding the Data of
block ``b`` at offset ``b * data_length`` (see ``KvcsConsumer``)."""


class RetrievalMode(enum.IntEnum):
    """How data tracks are requested."""

    AUTO = 0
    """FETCH segments the manifest marks complete (profile 5.3), SUBSCRIBE the others
    (profile 5.2)."""
    LIVE = 1
    """Always SUBSCRIBE Next Object + FILL_PARAMETERS (profile 5.2)."""
    COMPLETED = 2
    """Always FETCH (profile 5.3), even for a segment still being produced."""


class DiscardReason(enum.IntEnum):
    """Why an Object was discarded (it is treated as missing, profile 3.5)."""

    PAYLOAD_CHECK = 1
    """``payload.verify_object`` refused it; ``ObjectDiscarded.check`` says which check."""
    DATA_LENGTH = 2
    """Data Length is not what the track's codec gives for the descriptor (binding 5, 6)."""
    LISTED_DIGEST_MISMATCH = 3
    """A manifest version published after the Object was verified lists another digest."""
    NOT_LISTED = 4
    """The publication's manifest is signed (authenticated) and marks the Object's segment
    complete without listing its digest: the Object cannot be shown to be the producer's."""
    DECRYPTION_FAILED = 5
    """A protected Object did not decrypt (KVSP binding 8): tampered, moved to another
    Group, Object or track, another key or suite, or its key reached its AEAD limit."""
    UNKNOWN_KEY_ID = 6
    """A protected Object's Key ID has no key (or its IMMUTABLE_PROPERTIES are malformed)."""
    NOT_PROTECTED = 7
    """Encryption is required and the Object carries no Secure Object Key ID."""


class ManifestRejectReason(enum.IntEnum):
    """Why a manifest version, or a whole publication, was refused (profile 3.6, 5.2)."""

    UNSIGNED = 1
    """Only ``manifest`` exists and producer authenticity is required."""
    BAD_SIGNATURE = 2
    """``manifest.cose`` did not verify (bad signature, unknown kid, malformed COSE)."""
    MALFORMED_MANIFEST = 3
    """Not a valid manifest JSON (see ``detail``)."""
    COMPAT_MISMATCH = 4
    """The Compatibility ID of ``compat`` is not namespace field 2."""
    BLOCK_KEYS_MISMATCH = 5
    """A needed segment's ``block_keys_sha256`` is not the SHA-256 of our Block Keys."""
    MISSING_TRACKS = 6
    """A needed segment does not offer the selected tracks."""
    INCONSISTENT_VERSION = 7
    """The version contradicts an earlier one (``ManifestVersions``)."""
    NO_MANIFEST = 8
    """No manifest arrived (refused, or not within ``manifest_timeout``) on any session."""
    DECRYPTION_FAILED = 9
    """A protected manifest did not decrypt, or its Key ID has no key (KVSP binding 8)."""
    NOT_PROTECTED = 10
    """Encryption is required and the manifest carries no Secure Object Key ID."""


class RecomputeReason(enum.IntEnum):
    """Why recomputation is needed."""

    NO_PUBLICATION = 1
    """Discovery found no usable publication for any prefix tried (profile 5.1)."""
    RECOVERY_TIMEOUT = 2
    """Missing Objects were not recovered within the recovery time bound (profile 5.4)."""


@attrs.frozen(kw_only=True)
class ConsumerConfig:
    """Bounds and policies of a consumer. Durations are seconds on the caller's clock."""

    discovery_timeout: float = 0.5
    """How long to wait for a NAMESPACE on one prefix, once the relay has answered its
    SUBSCRIBE_NAMESPACE (REQUEST_OK or REQUEST_ERROR), before trying the next shorter
    one (profile 5.1): an announcement of a publication the relay knows comes with or
    right after its answer. A request still unanswered is awaited up to
    ``discovery_answer_timeout`` after it was sent, so a path slower than this
    (a round trip over 0.5 s, a loaded relay) does not skip the prefix."""
    discovery_answer_timeout: float = 2.0
    """How long a prefix waits for the relay's answer to its SUBSCRIBE_NAMESPACE at
    most (see ``discovery_timeout``)."""
    max_discovery_prefixes: int = 8
    """Prefix lengths tried at most (the default list halves: m, the power of two
    below m, then halving), so discovery ends within this many timeouts."""
    manifest_timeout: float = 5.0
    """A subscribed manifest track that delivers no acceptable manifest this long is
    given up on that session (the fill of the current version needs one round trip)."""
    stall_timeout: float = 10.0
    """Data requests that deliver no new verified Object for this long are treated as
    failed (their missing Objects go to recovery), so a silent source cannot hold
    the consumer forever."""
    retrieval: RetrievalMode = RetrievalMode.AUTO
    """SUBSCRIBE or FETCH (profile 5.2 / 5.3)."""
    hold_until_listed: bool = False
    """Count an Object of an *unauthenticated* publication as usable only once a manifest
    version lists its digest (or the complete segment lists none). For a publication
    whose manifest a producer key verified (``require_authenticity``, or producer keys
    given and ``manifest.cose`` verified) this is always on, whatever is set here: an
    Object is usable only once a verified manifest version lists its Data Digest, so a
    relay that rewrites an Object together with its Data Digest is caught; one that the
    complete segment does not list is refused (``DiscardReason.NOT_LISTED``). The cost
    is latency: profile 3.6 lists digests only every few layers (a version at least
    every 8 completed layers and at completion), so during production LayerReady waits
    for the next version that lists the layer."""
    max_publications: int = 64
    """Publications tracked at once; further NAMESPACE announcements are ignored."""
    max_objects: int = 1 << 22
    """Objects (components x layers x blocks) one retrieval may need: each costs one
    state octet and, without destinations, one view. Larger prompts are refused at
    construction."""
    data_priority: int = 128
    """SUBSCRIBER_PRIORITY of data requests."""
    manifest_priority: int = 0
    """SUBSCRIBER_PRIORITY of manifest subscriptions (needed first)."""

    def __attrs_post_init__(self) -> None:
        for name in (
            "discovery_timeout",
            "discovery_answer_timeout",
            "manifest_timeout",
            "stall_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("max_discovery_prefixes", "max_publications", "max_objects"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("data_priority", "manifest_priority"):
            if not 0 <= getattr(self, name) <= 255:
                raise ValueError(f"{name} must be in 0..255")


@attrs.frozen
class TrackSelection:
    """Which data tracks to retrieve (profile 3.2): the ``k`` and ``v`` pair of one
    codec, or one ``kv`` track."""

    codec: str = "raw"
    """A KVSP codec name (binding 6)."""
    joint: bool = False
    """True: the ``kv.<codec>`` track; False: ``k.<codec>`` and ``v.<codec>``."""

    @property
    def components(self) -> tuple[Component, ...]:
        """The components retrieved: ``(KV,)`` for the joint track, else ``(K, V)``."""
        return (Component.KV,) if self.joint else (Component.K, Component.V)


# --- events ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PublicationSelected:
    """A publication is used: the primary source, or an alternative for recovery."""

    publication_id: bytes
    namespace: TrackNamespace
    blocks: int
    """The prefix it covers for us (blocks 0..blocks-1)."""
    primary: bool
    """False for an alternative chosen to recover missing Objects (profile 5.4)."""


@attrs.frozen(kw_only=True)
class PublicationRejected:
    """A publication was discarded before any of its data was used."""

    publication_id: bytes
    reason: ManifestRejectReason
    detail: str


@attrs.frozen(kw_only=True)
class ManifestAccepted:
    """A manifest version verified and was accepted (profile 3.6)."""

    publication_id: bytes
    version: int
    """Its Group ID on the manifest track."""
    authenticated: bool
    """True when a producer key verified it (``manifest.cose``)."""
    complete: bool
    """Every segment is complete."""


@attrs.frozen(kw_only=True)
class ManifestDiscarded:
    """A later manifest version was refused; the publication stays in use."""

    publication_id: bytes
    version: int
    reason: ManifestRejectReason
    detail: str


@attrs.frozen(kw_only=True)
class ObjectDiscarded:
    """An Object failed verification; it is never used and counts as missing."""

    reason: DiscardReason
    check: ObjectRejectReason | None
    """With ``PAYLOAD_CHECK``: the failing check of profile 3.5."""
    detail: str
    publication_id: bytes
    track: str
    layer: int
    """Group ID."""
    block: int
    """Object ID (block index within the segment)."""
    session: int
    """Index of the session it arrived on (as returned by ``attach``)."""


@attrs.frozen(kw_only=True)
class LayerReady:
    """Every needed Object of ``layer`` in every selected track is verified (profile 5.4);
    for an authenticated publication, each against a digest a verified manifest lists."""

    layer: int


@attrs.frozen(kw_only=True)
class RecomputeNeeded:
    """The application must recompute what is listed (profile 5.4)."""

    reason: RecomputeReason
    layers: tuple[int, ...]
    """Layers with at least one Object that will not arrive."""
    blocks: tuple[int, ...]
    """Absolute block indices with at least one Object that will not arrive."""


@attrs.frozen(kw_only=True)
class RetrievalComplete:
    """Nothing more will be retrieved; every request is closed."""

    publication_id: bytes | None
    """The primary publication, or None when none was found."""
    blocks: int
    """Blocks covered (0 when no publication was found)."""
    layers: range
    complete: bool
    """True when every needed Object was verified (no RecomputeNeeded was emitted)."""


class IndexRejectReason(enum.IntEnum):
    """Why an index record was not used."""

    TOO_LARGE = 1
    MALFORMED = 2
    """Not the JSON object of binding 9 (syntax, members, types, lengths)."""
    UNSIGNED = 3
    """A plain ``replica`` where authenticity is required."""
    BAD_SIGNATURE = 4
    """``replica.cose`` that no trusted producer key verifies."""
    WRONG_BLOCK = 5
    """``block_index`` or ``block_key`` is not the consumer's own for this lookup."""
    WRONG_NAMESPACE = 6
    """The index namespace and the record disagree, or the named publication is of
    another scope or descriptor, or holds fewer blocks than the record claims."""


@attrs.frozen(kw_only=True)
class IndexLookupDone:
    """One KVSP index lookup (binding 9): SUBSCRIBE_NAMESPACE on our ``K_(length-1)``."""

    length: int
    """The prefix length (blocks) looked up."""
    shared: bool
    """A usable replica record was found: some publication shares ``length`` blocks."""
    lookup: int
    """1 for the first lookup of the search, 2 for the next, ..."""


@attrs.frozen(kw_only=True)
class IndexRecordDiscarded:
    """A replica record that was not used, and why (binding 9)."""

    length: int
    publication_id: bytes
    reason: IndexRejectReason
    detail: str


@attrs.frozen(kw_only=True)
class IndexSearchDone:
    """The KVSP index search is over (binding 9)."""

    lookups: int
    shared_blocks: int
    """The longest prefix (blocks) a usable record was found for (0: none)."""
    publications: tuple[bytes, ...]
    """The publications the records of that prefix name (the candidates, in order)."""


ConsumerEvent: TypeAlias = (
    IndexLookupDone
    | IndexRecordDiscarded
    | IndexSearchDone
    | PublicationSelected
    | PublicationRejected
    | ManifestAccepted
    | ManifestDiscarded
    | ObjectDiscarded
    | LayerReady
    | RecomputeNeeded
    | RetrievalComplete
)
"""Every event a consumer emits."""
