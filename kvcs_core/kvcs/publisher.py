"""``KvcsPublisher``: the Original Publisher of one KVCS publication (sans-I/O).

Theory of operation
-------------------
One instance per publication: one production of the KV cache of one token
prefix. It owns the Objects (one :class:`~kvcs_core.moqt.track_store.TrackStore`
per track) and serves them on any number of established
:class:`~kvcs_core.moqt.session.MoqtSession`\\ s: a relay upstream or a direct
consumer. It never performs I/O, reads a clock or draws randomness: the
Publication ID (entropy), the scope key, the producer key and ``now`` are
passed in. Its output goes through the sessions and the stores, so there is
nothing of its own to drain: after a command, drain the sessions as usual.
Commands take ``now`` like the session's do, because ending a track ends the
subscriptions that sessions serve (PUBLISH_DONE).

*Namespace* (profile 3.1, KVSP binding 2 to 4). ``("kvcs-1", Scope ID,
Compatibility ID, Anchor Key, Publication ID)``, where the Anchor Key is the
Block Key of the last full block of the prompt given at construction. Only
full blocks are published; a partial tail block never is (binding 3).

*Tracks* (profile 3.2). ``manifest`` (JSON) or, with a :class:`ManifestSigner`,
``manifest.cose`` (COSE_Sign1); and per segment ``n`` one data track per
:class:`TrackOffer`: ``k.raw.s<n>`` and ``v.raw.s<n>`` by default, optionally
``kv.q8.s<n>``.

*Production* (profile 3.3 to 3.5). :meth:`KvcsPublisher.put_layer` takes the K
and V sections of every full block of a segment for one layer, in layer order
0..L-1 (:class:`LayerOrderError` otherwise; a failing call publishes nothing).
In every data track, Group ``g`` = layer ``g`` holds Objects 0..n-1 (block index
within the segment) in Subgroup 0, in ascending order, with Publisher Priority
``floor(128 * g / L)``, followed by an End of Group Object at Object ID ``n``;
each track's Group is stored in one step (``TrackStore.append_group``, checked
once per Group). Sessions send after the call, in their scheduler's order, so
storing track by track rather than block by block changes nothing on the wire.
After Group L-1 comes the End of Track Object. Where it goes is not said by
the profile: Object ``n`` of Group L-1 already holds the End of Group, and
nothing may follow it in that Group (MOQT: an Object beyond End of Group makes
the track malformed), so End of Track is Object 0 of Group ``L`` with the
priority of layer L-1. Group ``L`` holds no layer: nothing in it is an Object
that exists, and a FETCH of the last layers reports End Of Track.

*Manifest* (profile 3.6). Version ``m`` is Object 0 of Group ``m`` with
Publisher Priority 0 (and nothing else: :meth:`KvcsPublisher.finish` puts End
of Track right after the last version, as Object 1 of its Group). Versions are
published when a segment is added (the first at construction), every
``manifest_interval`` (<= 8) completed layers, and when a segment becomes
complete. Every segment lists ``object_digests``:
per track, one list per completed Group, digests in Object order (67 octets
per Object and track, in every version: ``list_digests=False`` leaves them out
for caches whose manifest would outgrow a consumer's limit). The JSON is
deterministic; it is signed per version with the producer key when a signer
is given. Only the latest version is kept: publishing one evicts the one
before, so the store holds one manifest, and a late subscriber's fill
(RELATIVE_START 1) gets the latest.

*Protection* (KVSP binding 8, ``protection.py``). With ``protection``, every
Normal Object of every track, the manifest included, is stored encrypted
(MOQT Secure Objects, keys from the scope key, one suite and Key ID, carried
in each Object's IMMUTABLE_PROPERTIES); status Objects are not encrypted. A
layer is encrypted whole before anything of it is stored, so a key that
reaches its limit (``LimitReached``) publishes nothing of that layer.

*Segments* (profile 3.3). :meth:`KvcsPublisher.append_tokens` adds the tokens
of a later pass (chunked prefill): their full blocks (including the tail of
earlier tokens that they complete) become segment ``n`` with
``first_block`` continuing where segment ``n-1`` ended, Block Keys continuing
the chain, and tracks of their own. Tokens that do not complete a block wait
for the next call.

*Serving* (profile 5.1 to 5.3). :meth:`KvcsPublisher.attach` sends
PUBLISH_NAMESPACE on a session; from then on
:meth:`KvcsPublisher.handle_session_event` answers, for this namespace:
SUBSCRIBE, FETCH and TRACK_STATUS from the stores (an unknown track:
REQUEST_ERROR DOES_NOT_EXIST), and SUBSCRIBE_NAMESPACE whose prefix covers the
namespace (REQUEST_OK unless already given, then NAMESPACE with the suffix). It
returns ``False`` for every event that is not for this publication, so the
caller can offer it to another. Late subscribers need nothing special: the
stores keep everything, so a fill or a FETCH serves whatever was produced
before (the session computes the exactly-once split). When a data track ends,
its live subscriptions are ended with PUBLISH_DONE (TRACK_ENDED) once their
queued objects are sent; a subscription that arrives after the end is accepted
(its fill delivers the track) and ended the same way. :meth:`KvcsPublisher.finish`
ends the manifest track likewise once every segment is complete. Authorization
is the caller's: filter events before handing them over.

*Index* (binding 9, ``_index_serving``). With ``index_stride`` ``s`` (default 1; 0
turns it off) the publisher also announces the index namespaces and replica records of
every ``s``-th prefix length and of its last block (``s`` doubled until at most
``max_index_records`` records, 512 by default: ``index`` module docstring, "How many
records"), signed like the manifest (``replica.cose``) when it has a signer;
:meth:`KvcsPublisher.attach` announces them with the publication,
:meth:`KvcsPublisher.handle_session_event` serves them, and
:meth:`KvcsPublisher.withdraw` (or the end of the session) withdraws them with it.
Blocks added by :meth:`KvcsPublisher.append_tokens` are not indexed: the records name
the namespace, whose Anchor Key covers the blocks given at construction.

Memory and ownership: the publisher holds every data Object of the
publication for its whole life, which is what lets relays and late consumers
be served from it at any time (about ``layers * blocks * section_size`` per
raw track, plus 68 octets per Object, plus the latest manifest); dropping the
publisher (and the sessions' queues) frees it. The Data of ``k.raw`` and
``v.raw`` Objects are *references* to the caller's section buffers (no copy):
the caller owns them and must neither modify nor reuse them while the
publisher lives (a ``bytearray`` is pinned: resizing it raises
``BufferError``). Encoded Data (``q8``, and every ``kv`` Object) is owned by the
publisher.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from kvcs_core.kvcs._answering import answer_from_store
from kvcs_core.kvcs._index_serving import IndexAnnouncer
from kvcs_core.kvcs._production import (
    MAX_MANIFEST_INTERVAL,
    RAW_KV,
    RAW_KV_WITH_KV_Q8,
    LayerOrderError,
    ManifestSigner,
    OfferError,
    PublicationFinishedError,
    PublisherError,
    SectionMismatchError,
    SegmentError,
    SegmentState,
    TrackOffer,
    build_manifest,
    check_offer,
    encode_layer,
    layer_priority,
)
from kvcs_core.kvcs.index import DEFAULT_MAX_INDEX_RECORDS, effective_index_stride
from kvcs_core.kvcs.manifest import Manifest
from kvcs_core.kvcs.names import MANIFEST_COSE_TRACK, MANIFEST_TRACK, KvcsNamespace
from kvcs_core.kvcs.protection import ObjectProtection, PublicationSealer
from kvcs_core.kvsp import (
    CompatibilityDescriptor,
    block_keys,
    block_keys_sha256,
    chain_block_keys,
    pack_tokens,
    scope_id,
)
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire.codes import (
    GroupOrder,
    ObjectStatus,
    PropertyType,
    PublishDoneCode,
)
from kvcs_core.wire.kvp import KeyValuePair
from kvcs_core.wire.names import FullTrackName, TrackNamespace

__all__ = [
    "RAW_KV",
    "RAW_KV_WITH_KV_Q8",
    "AttachState",
    "KvcsPublisher",
    "LayerOrderError",
    "ManifestSigner",
    "OfferError",
    "PublicationFinishedError",
    "PublisherError",
    "SectionMismatchError",
    "SegmentError",
    "SegmentInfo",
    "TrackOffer",
]

MANIFEST_PRIORITY: Final = 0
"""Profile 3.4: the manifest track uses Publisher Priority 0."""
_ASCENDING: Final = KeyValuePair(PropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, GroupOrder.ASCENDING)


class AttachState(enum.IntEnum):
    """Where our PUBLISH_NAMESPACE stands on an attached session."""

    PENDING = 1
    ACCEPTED = 2
    REFUSED = 3


@attrs.frozen
class SegmentInfo:
    """A snapshot of one segment."""

    segment: int
    first_block: int
    """Absolute index of the segment's first block (profile 3.4)."""
    blocks: int
    token_start: int
    """Absolute position of the segment's first token."""
    tracks: tuple[str, ...]
    next_layer: int
    """The layer :meth:`KvcsPublisher.put_layer` expects next (``layers`` when complete)."""
    complete: bool


@attrs.define(eq=False)
class _Attachment:
    session: MoqtSession
    publish_namespace_id: int
    state: AttachState = AttachState.PENDING
    refusal: tuple[int, str] | None = None
    subscriptions: dict[int, bytes] = attrs.field(factory=dict)
    """Live subscriptions we serve: Request ID -> Track Name."""
    namespace_requests: set[int] = attrs.field(factory=set)
    """The peer's SUBSCRIBE_NAMESPACE requests we announced ourselves on."""


class KvcsPublisher:
    """The Original Publisher of one KVCS publication (see the module docstring).

    Args:
        compat: the Compatibility Descriptor (decoded JSON object) or a
            validated :class:`~kvcs_core.kvsp.CompatibilityDescriptor`.
        scope_key: the 32-octet scope key (kept to chain the Block Keys of
            appended segments).
        tokens: the token IDs of the prompt (u32); segment 0 covers its full
            blocks, of which there must be at least one.
        publication_id: 16 random octets chosen by the caller for this
            production (profile 3.1).
        offer: the data tracks of every segment (default ``k.raw``/``v.raw``;
            :data:`RAW_KV_WITH_KV_Q8` adds ``kv.q8``).
        signer: producer key and ``kid``: publish ``manifest.cose``; ``None``:
            publish ``manifest``.
        deterministic: the manifest's ``"deterministic"``: true only if any
            publication of the same content fields has bit-identical Objects.
        manifest_interval: publish a manifest version after this many completed
            layers (1..8; profile 3.6 asks for at most 8).
        list_digests: list ``object_digests`` in the manifest (profile 3.6
            SHOULD). Turn off only for caches so large that the manifest would
            pass a consumer's size limit (67 octets per Object and track).
        protection: encrypt every Object (KVSP binding 8) with this cipher suite
            and Key ID; ``None``: Objects in clear.
        index_stride: announce KVSP index records (binding 9) for every
            ``index_stride``-th prefix length and the last block; 0: no index.
            Doubled as often as needed to stay within ``max_index_records``
            (``index.stride``: the one used).
        max_index_records: announce at most this many index records (default
            :data:`~kvcs_core.kvcs.index.DEFAULT_MAX_INDEX_RECORDS`, 512: each is a
            request a relay counts against its 1024 per session); None: no bound.
        index_holder: optional ``"holder"`` member of the records (an MOQT URI).

    Raises:
        KvspError: bad descriptor, scope key or token (a ``ValueError``).
        PublisherError: no full block, a bad Publication ID, offer or interval.
    """

    def __init__(
        self,
        compat: Mapping[str, Any] | CompatibilityDescriptor,
        scope_key: bytes,
        tokens: Sequence[int],
        publication_id: bytes,
        *,
        offer: Sequence[TrackOffer] = RAW_KV,
        signer: ManifestSigner | None = None,
        deterministic: bool = False,
        manifest_interval: int = MAX_MANIFEST_INTERVAL,
        list_digests: bool = True,
        protection: ObjectProtection | None = None,
        index_stride: int = 1,
        max_index_records: int | None = DEFAULT_MAX_INDEX_RECORDS,
        index_holder: str | None = None,
    ) -> None:
        cd = (
            compat
            if isinstance(compat, CompatibilityDescriptor)
            else CompatibilityDescriptor(compat)
        )
        if not isinstance(manifest_interval, int) or not (
            1 <= manifest_interval <= MAX_MANIFEST_INTERVAL
        ):
            raise PublisherError(f"manifest_interval must be 1..{MAX_MANIFEST_INTERVAL}")
        if type(deterministic) is not bool:
            raise PublisherError("deterministic must be a bool")
        self._offer = check_offer(offer)
        self._descriptor: Final = cd
        self._scope_key: Final = bytes(scope_key)
        self._tokens: list[int] = list(tokens)
        keys = block_keys(self._scope_key, cd, self._tokens)
        if not keys:
            raise PublisherError(
                f"{len(self._tokens)} tokens hold no full block of {cd.block_tokens}: "
                "nothing to publish and no Anchor Key"
            )
        if not isinstance(publication_id, bytes | bytearray) or len(publication_id) != 16:
            raise PublisherError("publication_id must be 16 octets")
        self._keys: list[bytes] = list(keys)
        self._kvcs_namespace: Final = KvcsNamespace(
            scope_id(self._scope_key), cd.compat_id, keys[-1], bytes(publication_id)
        )
        self._namespace: Final = self._kvcs_namespace.to_track_namespace()
        self._signer: Final = signer
        self._deterministic: Final = deterministic
        self._interval: Final = manifest_interval
        self._list_digests: Final = bool(list_digests)
        if protection is not None and not isinstance(protection, ObjectProtection):
            raise PublisherError("protection must be an ObjectProtection or None")
        self._sealer: Final = (
            None if protection is None else PublicationSealer(self._scope_key, protection)
        )
        manifest_name = MANIFEST_COSE_TRACK if signer is not None else MANIFEST_TRACK
        self._manifest_store: Final = TrackStore(
            FullTrackName(self._namespace, manifest_name.encode("ascii")),
            default_publisher_priority=MANIFEST_PRIORITY,
            track_properties=(
                KeyValuePair(PropertyType.DEFAULT_PUBLISHER_PRIORITY, MANIFEST_PRIORITY),
                _ASCENDING,
            ),
        )
        self._stores: dict[bytes, TrackStore] = {
            self._manifest_store.name.name: self._manifest_store
        }
        self._segments: list[SegmentState] = []
        self._manifest: Manifest  # set by every _publish_manifest, first below
        self._manifest_group = 0
        self._layers_since_manifest = 0
        self._finished = False
        self._attachments: dict[MoqtSession, _Attachment] = {}
        self._add_segment(len(keys))
        self._publish_manifest()
        if type(index_stride) is not int or index_stride < 0:
            raise PublisherError("index_stride must be an integer >= 0 (0: no index)")
        if max_index_records is not None and (
            type(max_index_records) is not int or max_index_records < 1
        ):
            raise PublisherError("max_index_records must be an integer >= 1 (None: no bound)")
        self._index: Final = (
            IndexAnnouncer(
                self._kvcs_namespace,
                keys,
                stride=effective_index_stride(len(keys), index_stride, max_index_records),
                signer=signer,
                holder=index_holder,
            )
            if index_stride
            else None
        )

    # ------------------------------------------------------------------ getters

    @property
    def protection(self) -> ObjectProtection | None:
        """How the Objects are protected (``None``: in clear)."""
        return None if self._sealer is None else self._sealer.protection

    @property
    def descriptor(self) -> CompatibilityDescriptor:
        return self._descriptor

    @property
    def namespace(self) -> TrackNamespace:
        """The five-field Track Namespace (profile 3.1)."""
        return self._namespace

    @property
    def kvcs_namespace(self) -> KvcsNamespace:
        """Fields 1 to 4 of the namespace."""
        return self._kvcs_namespace

    @property
    def block_keys(self) -> tuple[bytes, ...]:
        """Block Keys of every published block, segment after segment (binding 3)."""
        return tuple(self._keys)

    @property
    def anchor_key(self) -> bytes:
        """Namespace field 3: the Block Key of the last full block of the first prompt."""
        return self._kvcs_namespace.anchor_key

    @property
    def token_count(self) -> int:
        """Tokens given so far, a partial tail block included."""
        return len(self._tokens)

    @property
    def manifest_track(self) -> str:
        """``manifest`` or ``manifest.cose``."""
        return self._manifest_store.name.name.decode("ascii")

    @property
    def manifest(self) -> Manifest:
        """The latest manifest version."""
        return self._manifest

    @property
    def manifest_versions(self) -> int:
        """Versions published so far; the latest is Group ``manifest_versions - 1``."""
        return self._manifest_group

    @property
    def segments(self) -> tuple[SegmentInfo, ...]:
        """Every segment so far, in order (segment ``n`` is ``segments[n]``)."""
        return tuple(
            SegmentInfo(
                segment=s.segment,
                first_block=s.first_block,
                blocks=s.blocks,
                token_start=s.token_start(0),
                tracks=s.track_names,
                next_layer=s.next_layer,
                complete=s.complete,
            )
            for s in self._segments
        )

    @property
    def complete(self) -> bool:
        """Every segment has all its layers."""
        return all(s.complete for s in self._segments)

    @property
    def finished(self) -> bool:
        """:meth:`finish` was called."""
        return self._finished

    @property
    def track_names(self) -> tuple[str, ...]:
        """Every track: the manifest track first, then the data tracks by segment."""
        return tuple(name.decode("ascii") for name in self._stores)

    def store(self, track: str | bytes) -> TrackStore | None:
        """The store of one of our tracks (read it, never append to it), or ``None``."""
        return self._stores.get(track.encode("ascii") if isinstance(track, str) else track)

    @property
    def total_bytes(self) -> int:
        """Object payload octets held (headers included)."""
        return sum(s.total_bytes for s in self._stores.values())

    @property
    def index(self) -> IndexAnnouncer | None:
        """The KVSP index this publication announces (None: ``index_stride=0``)."""
        return self._index

    @property
    def sessions(self) -> tuple[MoqtSession, ...]:
        """The attached sessions that are still open."""
        return tuple(self._attachments)

    def attach_state(self, session: MoqtSession) -> AttachState | None:
        """Our PUBLISH_NAMESPACE on ``session``; ``None`` when not attached (or closed)."""
        att = self._attachments.get(session)
        return None if att is None else att.state

    def attach_refusal(self, session: MoqtSession) -> tuple[int, str] | None:
        """The REQUEST_ERROR code and reason our PUBLISH_NAMESPACE got, if it was refused."""
        att = self._attachments.get(session)
        return None if att is None else att.refusal

    # ------------------------------------------------------------------ production

    def put_layer(
        self,
        layer: int,
        k_blocks: Sequence[Any],
        v_blocks: Sequence[Any],
        *,
        segment: int = 0,
        now: float,
    ) -> None:
        """Publish one layer of one segment on every offered track (profile 3.3 to 3.5).

        Args:
            layer: the layer index; must be the segment's next layer.
            k_blocks, v_blocks: one K and one V section (KVSP binding 5) per
                full block of the segment, each any C-contiguous bytes-like
                object of ``descriptor.section_size`` octets. Raw Data is held by
                reference: do not modify these buffers afterwards.
            segment: the segment number.
            now: the clock, for the sessions whose subscriptions end with the
                track (after the last layer).

        Raises:
            SegmentError: no such segment.
            LayerOrderError: ``layer`` is not the next layer of the segment
                (or the segment is complete).
            SectionMismatchError: wrong number, size or layout of sections, or
                sections the codec cannot encode. Nothing is published then.
        """
        seg = self._segment(segment)
        if seg.complete:
            raise LayerOrderError(f"segment {segment} is complete: all {seg.layers} layers are put")
        if layer != seg.next_layer:
            raise LayerOrderError(
                f"layer {layer} of segment {segment} put out of order: layer "
                f"{seg.next_layer} is next (Group IDs increase with time, profile 3.3)"
            )
        encoded = encode_layer(self._descriptor, seg, layer, k_blocks, v_blocks)
        priority = layer_priority(layer, seg.layers)
        stores = [(self._stores[name.encode("ascii")], encoded[name]) for name in seg.track_names]
        sealer = self._sealer
        # encrypt every track's Group before storing any (a key at its limit stores nothing)
        sealed = (
            None
            if sealer is None
            else [
                sealer.seal_group(store.name, layer, priority, group.heads, group.datas)
                for store, group in stores
            ]
        )
        # one Group per track in one step (checked once per Group); sessions send after the
        # call, in their scheduler's order (not in the order the stores were filled)
        for i, (store, group) in enumerate(stores):
            if sealed is None or sealer is None:
                store.append_group(layer, group.datas, group.heads, publisher_priority=priority)
            else:
                store.append_group(
                    layer,
                    sealed[i],
                    None,
                    publisher_priority=priority,
                    properties=sealer.properties,
                )
        seg.record_layer(layer, encoded)
        self._layers_since_manifest += 1
        if seg.complete:
            for store, _ in stores:
                store.append(
                    seg.layers, 0, status=ObjectStatus.END_OF_TRACK, publisher_priority=priority
                )
            self._publish_manifest()
            self._end_subscriptions({store.name.name for store, _ in stores}, now)
        elif self._layers_since_manifest >= self._interval:
            self._publish_manifest()

    def append_tokens(self, new_token_ids: Iterable[int], *, now: float) -> int | None:
        """Add the tokens of a later pass; their new full blocks become a new segment.

        The new segment ``n`` starts at the block after the last published one
        (its ``first_block``), covers every block the tokens complete (a
        partial tail left from before included), has its own tracks and is
        announced in a new manifest version. Its layers are then put with
        ``put_layer(..., segment=n)``.

        Returns:
            The new segment's number, or ``None`` when no block was completed
            (the tokens are kept and count towards the next call).

        Raises:
            PublicationFinishedError: after :meth:`finish`.
            KvspError: a token outside u32 (nothing changes).
        """
        del now  # nothing here talks to a session; kept for the command convention
        if self._finished:
            raise PublicationFinishedError("the publication is finished: no new segment")
        new = list(new_token_ids)
        pack_tokens(new)  # validates (raises KvspError) before anything changes
        tokens = self._tokens + new
        block_tokens = self._descriptor.block_tokens
        tail = len(self._keys) * block_tokens
        keys = chain_block_keys(
            self._scope_key,
            self._descriptor.compat_id,
            block_tokens,
            pack_tokens(tokens[tail:]),
            previous_key=self._keys[-1],
        )
        self._tokens = tokens
        if not keys:
            return None
        self._keys.extend(keys)
        seg = self._add_segment(len(keys))
        self._publish_manifest()
        return seg.segment

    def finish(self, *, now: float) -> None:
        """End the publication: End of Track on the manifest track, no more segments.

        Live manifest subscriptions end with PUBLISH_DONE (TRACK_ENDED) after
        their queued objects. Calling it again does nothing.

        Raises:
            SegmentError: a segment is not complete yet.
        """
        if self._finished:
            return
        pending = [s.segment for s in self._segments if not s.complete]
        if pending:
            raise SegmentError(f"segments {pending} are not complete")
        self._finished = True
        # End of Track right after the last version, in its group (see _publish_manifest)
        self._manifest_store.append(
            self._manifest_group - 1,
            1,
            status=ObjectStatus.END_OF_TRACK,
            publisher_priority=MANIFEST_PRIORITY,
        )
        self._end_subscriptions({self._manifest_store.name.name}, now)

    # ------------------------------------------------------------------ serving

    def attach(self, session: MoqtSession, *, now: float) -> int:
        """Serve this publication on ``session``: PUBLISH_NAMESPACE, then answer its events.

        Also announces the namespace (NAMESPACE) on SUBSCRIBE_NAMESPACE requests
        of the peer that are already established and cover it. Feed every
        event of the session to :meth:`handle_session_event` from now on.

        Returns:
            The Request ID of the PUBLISH_NAMESPACE.

        Raises:
            PublisherError: ``session`` is already attached.
            LocalProtocolError: the session is not started or is closed.
        """
        if session in self._attachments:
            raise PublisherError("this session is already attached")
        rid = session.publish_namespace(self._namespace, now=now)
        att = _Attachment(session, rid)
        self._attachments[session] = att
        for rec in list(session.requests.values()):
            if (
                not rec.mine
                and rec.kind is ev.RequestKind.SUBSCRIBE_NAMESPACE
                and rec.state is RequestState.ESTABLISHED
                and rec.namespace is not None
                and rec.namespace.is_prefix_of(self._namespace)
            ):
                self._announce(att, rec.request_id, rec.namespace, now)
        if self._index is not None:
            self._index.attach(session, now=now)
        return rid

    def withdraw(self, *, now: float) -> None:
        """Withdraw the publication's namespace and its index namespaces on every session
        (cancel the PUBLISH_NAMESPACEs); the stores stay (a later :meth:`attach` works)."""
        if self._index is not None:
            self._index.withdraw(now=now)
        for session, att in list(self._attachments.items()):
            if not session.is_closed:
                with contextlib.suppress(LocalProtocolError):  # already finished
                    session.cancel(att.publish_namespace_id, now=now)
            del self._attachments[session]

    def handle_session_event(
        self, session: MoqtSession, event: ev.SessionEvent, now: float
    ) -> bool:
        """Answer ``event`` if it is for this publication; ``False`` if it is not.

        ``True``: the event concerned this publication and is handled (SUBSCRIBE,
        FETCH, TRACK_STATUS of our namespace; a SUBSCRIBE_NAMESPACE covering it;
        answers to our PUBLISH_NAMESPACE; cancellations and updates of requests
        we serve). A SUBSCRIBE_NAMESPACE can cover several publications: offer
        it to each; the first accepts it, every one announces itself.
        ``SessionClosed`` detaches the session and returns ``False`` (it
        concerns everyone). Never raises because of what the peer sent.
        """
        if self._index is not None and self._index.handle_session_event(session, event, now):
            if isinstance(event, ev.SubscribeNamespaceRequested):
                self._announce_if_covered(session, event, now)
            return True
        att = self._attachments.get(session)
        if att is None:
            return False
        if isinstance(event, ev.SessionClosed):
            del self._attachments[session]
            return False
        if session.is_closed:
            return False
        if isinstance(event, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
            if event.track.namespace != self._namespace:
                return False
            self._serve(att, event, now)
            return True
        if isinstance(event, ev.SubscribeNamespaceRequested):
            if not event.prefix.is_prefix_of(self._namespace):
                return False
            self._announce(att, event.request_id, event.prefix, now)
            return True
        if isinstance(event, ev.RequestAccepted | ev.RequestFailed):
            if event.request_id != att.publish_namespace_id or event.update_id is not None:
                return False
            if isinstance(event, ev.RequestAccepted):
                att.state = AttachState.ACCEPTED
            else:
                att.state = AttachState.REFUSED
                att.refusal = (event.code, event.reason)
            return True
        if isinstance(event, ev.RequestCancelled):
            served = att.subscriptions.pop(event.request_id, None) is not None
            return served or event.request_id in att.namespace_requests
        if isinstance(event, ev.RequestUpdated):
            return (
                event.request_id in att.subscriptions or event.request_id in att.namespace_requests
            )
        return False

    # ------------------------------------------------------------------ internals

    def _segment(self, segment: int) -> SegmentState:
        if not isinstance(segment, int) or not 0 <= segment < len(self._segments):
            raise SegmentError(f"no segment {segment!r} (have {len(self._segments)})")
        return self._segments[segment]

    def _add_segment(self, blocks: int) -> SegmentState:
        index = len(self._segments)
        first = self._segments[-1].first_block + self._segments[-1].blocks if index else 0
        seg = SegmentState(
            segment=index,
            first_block=first,
            blocks=blocks,
            block_tokens=self._descriptor.block_tokens,
            layers=self._descriptor.layers,
            block_keys_sha256=block_keys_sha256(self._keys, first, blocks),
            offers=tuple((o.track_name(index), o) for o in self._offer),
        )
        for name in seg.track_names:
            raw = name.encode("ascii")
            self._stores[raw] = TrackStore(
                FullTrackName(self._namespace, raw), track_properties=(_ASCENDING,)
            )
        self._segments.append(seg)
        return seg

    def _publish_manifest(self) -> None:
        manifest = build_manifest(
            self._descriptor,
            self._segments,
            deterministic=self._deterministic,
            list_digests=self._list_digests,
        )
        payload = manifest.encode()
        if self._signer is not None:
            payload = self._signer.sign(payload)
        group = self._manifest_group
        store = self._manifest_store
        # Object 0 only: End of Track must be able to follow the *last* version in its own
        # group, so that a late subscriber's fill (RELATIVE_START 1 = the largest group,
        # profile 5.2) still finds that version; a version's stream is FIN'd when the next
        # version's group starts.
        if self._sealer is None:
            store.append(group, 0, payload, publisher_priority=MANIFEST_PRIORITY)
        else:
            sealed = self._sealer.seal(store.name, group, 0, MANIFEST_PRIORITY, (payload,))
            store.append(
                group,
                0,
                sealed,
                publisher_priority=MANIFEST_PRIORITY,
                properties=self._sealer.properties,
            )
        if group:
            # superseded: only the latest version is served to late joiners (queued copies
            # still go out); an evicted version is "unknown", not "does not exist"
            store.evict_group(group - 1)
        self._manifest = manifest
        self._manifest_group = group + 1
        self._layers_since_manifest = 0

    def _serve(
        self,
        att: _Attachment,
        event: ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested,
        now: float,
    ) -> None:
        session, rid = att.session, event.request_id
        store = self._stores.get(event.track.name)
        if answer_from_store(session, event, store, "no such track in this publication", now):
            assert store is not None
            if store.end_of_track is not None:
                # the track is over: the fill (if asked for) delivers it, then PUBLISH_DONE
                session.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=now)
            else:
                att.subscriptions[rid] = store.name.name

    def _announce(
        self, att: _Attachment, request_id: int, prefix: TrackNamespace, now: float
    ) -> None:
        session = att.session
        rec = session.requests.get(request_id)
        if rec is None or rec.finished:
            return
        if rec.state is RequestState.PENDING:
            session.accept_request(request_id, now=now)
        if request_id in att.namespace_requests:
            return
        suffix = self._namespace.suffix_after(prefix)
        if suffix.fields in rec.announced:
            return
        session.send_namespace(request_id, suffix, now=now)
        att.namespace_requests.add(request_id)

    def _announce_if_covered(
        self, session: MoqtSession, event: ev.SubscribeNamespaceRequested, now: float
    ) -> None:
        att = self._attachments.get(session)
        if att is not None and event.prefix.is_prefix_of(self._namespace):
            self._announce(att, event.request_id, event.prefix, now)

    def _end_subscriptions(self, tracks: set[bytes], now: float) -> None:
        """PUBLISH_DONE (TRACK_ENDED) for every live subscription to ``tracks``."""
        for session, att in list(self._attachments.items()):
            if session.is_closed:
                del self._attachments[session]
                continue
            for rid, name in list(att.subscriptions.items()):
                if name not in tracks:
                    continue
                del att.subscriptions[rid]
                rec = session.requests.get(rid)
                if rec is None or rec.state is not RequestState.ESTABLISHED or rec.local_fin:
                    continue  # cancelled, or already ended by the session (too far behind)
                session.end_subscription(rid, PublishDoneCode.TRACK_ENDED, now=now)
