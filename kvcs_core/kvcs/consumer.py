"""``KvcsConsumer``: the pure KVCS consumer machine (profile sections 5.1 to 5.4).

Theory of operation
-------------------
The consumer sits on one or more :class:`~kvcs_core.moqt.session.MoqtSession`
objects exactly as a session sits on its transport (STYLE.md R1): it owns no
transport, takes session events in and calls session commands. It follows the
call protocol of every kvcs machine (ARCHITECTURE.md):

* inputs: ``handle_session_event(session, event, now)`` (returns whether the
  event belonged to one of the consumer's requests; session-wide events such as
  ``SetupCompleted`` and ``SessionClosed`` are used but not consumed) and
  ``handle_timer(now)``; they never raise because of what a peer sent;
* local commands: ``attach(session, now=)``, ``add_publication(...)``; they
  raise ``LocalProtocolError`` on misuse;
* outputs, after every input or command: drain each session it commanded (the
  transport adapter does this anyway), then ``get_timer()`` and
  ``next_event()`` until ``None``.

Keys and the clock are passed in; nothing here does I/O. What happens, by
profile section (each step is described in the module that implements it):

1. **Identity** (binding 1-3): the Compatibility ID of the descriptor, the
   Scope ID of the scope key, and the Block Keys of the prompt's full blocks.
2. **Discovery** (5.1, ``_discovery``, ``_index_search``): SUBSCRIBE_NAMESPACE for
   the whole prompt, then a binary search of the KVSP index (binding 9) for the
   longest prefix shared with any publication, then shorter direct prefixes; the
   longest publication found is chosen.
3. **Manifest** (5.2, 3.6, ``_discovery`` and ``_verify``): ``manifest.cose``
   first, ``manifest`` only if that does not exist and authenticity is not
   required; signature, Compatibility ID, Block Keys and tracks are checked.
4. **Retrieval** (5.2, 5.3, ``_retrieval``): SUBSCRIBE with the exactly-once
   pattern while a segment is produced, FETCH of layers a..b once it is
   complete, with OBJECTID_FILTER where the peer allows it.
5. **Verification and recovery** (5.4, ``_retrieval``, ``_recovery``): every
   Object verified (a protected one, KVSP binding 8, is decrypted first with
   the key of its Key ID, ``protection``: a manifest or Object that does not
   open, or an unprotected one under ``require_encryption``, is refused like a
   corrupted one);
   :class:`LayerReady` per layer as soon as it is complete; missing Objects
   retried on another session or publication (never mixing non-deterministic
   publications in a segment), else :class:`RecomputeNeeded` once the recovery
   time bound passes.

Every buffer and wait is bounded (``ConsumerConfig``): the needed Objects are
sized at construction, publications tracked are capped, discovery tries a
bounded list of prefixes, manifest attempts, stalled requests and recovery
each have a timeout.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kvcs_core.kvcs._consumer_core import (
    AnyRequest,
    DataRequest,
    IndexLookupRequest,
    ManifestRequest,
    NamespaceRequest,
    ObjState,
    Phase,
    PubState,
    RecordRequest,
    SessionSlot,
)
from kvcs_core.kvcs._consumer_events import (
    ConsumerConfig,
    ConsumerEvent,
    Destinations,
    DiscardReason,
    IndexLookupDone,
    IndexRecordDiscarded,
    IndexRejectReason,
    IndexSearchDone,
    LayerReady,
    ManifestAccepted,
    ManifestDiscarded,
    ManifestRejectReason,
    ObjectDiscarded,
    PublicationRejected,
    PublicationSelected,
    RecomputeNeeded,
    RecomputeReason,
    RetrievalComplete,
    RetrievalMode,
    TrackSelection,
    WritableBuffer,
)
from kvcs_core.kvcs._discovery import default_prefixes
from kvcs_core.kvcs._index_search import IndexOptions, IndexSearchMixin
from kvcs_core.kvcs._recovery import RecoveryMixin
from kvcs_core.kvcs._retrieval import RetrievalMixin
from kvcs_core.kvcs.cose import VerificationKey
from kvcs_core.kvcs.manifest import Manifest
from kvcs_core.kvcs.names import Component, KvcsNameError, KvcsNamespace
from kvcs_core.kvsp.codecs import codec_from_name, encoded_size
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.kvsp.keys import block_keys as compute_block_keys
from kvcs_core.kvsp.keys import scope_id as compute_scope_id
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.secobj import DEFAULT_SUITE, CipherSuite, SecureObjectKeyring
from kvcs_core.wire.names import TrackNamespace

_OBJECT_RECEIVED = ev.ObjectReceived
_DONE = Phase.DONE

__all__ = [
    "ConsumerConfig",
    "ConsumerEvent",
    "Destinations",
    "DiscardReason",
    "IndexLookupDone",
    "IndexOptions",
    "IndexRecordDiscarded",
    "IndexRejectReason",
    "IndexSearchDone",
    "KvcsConsumer",
    "LayerReady",
    "ManifestAccepted",
    "ManifestDiscarded",
    "ManifestRejectReason",
    "ObjectDiscarded",
    "PublicationRejected",
    "PublicationSelected",
    "RecomputeNeeded",
    "RecomputeReason",
    "RetrievalComplete",
    "RetrievalMode",
    "TrackSelection",
    "WritableBuffer",
    "default_prefixes",
]


class KvcsConsumer(IndexSearchMixin, RetrievalMixin, RecoveryMixin):
    """Finds, retrieves and verifies one prompt's KV cache over MOQT sessions.

    Args:
        descriptor: the KVSP Compatibility Descriptor (a decoded JSON object).
        scope_key: the 32-octet scope key.
        tokens: the prompt's token IDs (u32); its full blocks are what can be reused.
        producer_keys: trusted producer verification keys by ``kid``, or None.
        require_authenticity: refuse manifests a producer key did not sign.
        tracks: the data tracks to retrieve (default: ``k`` and ``v`` of codec ``raw``).
        recovery_time_bound: seconds to try to recover missing Objects before
            reporting them in :class:`RecomputeNeeded` (profile 5.4: about the time
            recomputation would take).
        destinations: where verified Data goes: a callable ``(layer, component) ->
            buffer`` or a mapping ``{(layer, component): buffer}``, each taken
            once, here. The Data of block ``b`` (absolute index) is written at
            ``b * data_length``, so each buffer needs ``prompt_blocks *
            data_length`` writable, C-contiguous octets (``data_length``: the
            codec's size of a K or V section, twice that for ``kv``). Data is
            written as carried (codec-encoded; for ``raw`` the K or V section, or
            K then V for ``kv``): one copy from the wire. Without destinations,
            verified views of the payloads are kept (:meth:`data`).
        layers: the layers needed (default: all ``layers`` of the descriptor).
        prefix_lengths: prefix lengths (blocks) to discover, longest first
            (default: :func:`default_prefixes`).
        index: how to use the KVSP index (binding 9) when the whole prompt is not
            found directly: :class:`IndexOptions` (default: stride 1, 0.3 s per
            lookup after the relay's answer, up to 2 s for that answer); None: never
            (direct discovery only).
        config: bounds and policies.
        require_encryption: refuse Objects and manifests that are not protected
            (no Secure Object Key ID; KVSP binding 8). Protected ones are always
            decrypted, with keys derived from the scope key and their Key ID.
        cipher_suite: the Secure Objects cipher suite of protected publications
            (default ``AES_128_GCM_SHA256_128``; it is not carried on the wire).
        key_ids: accept only these Key IDs (``None``: any, derived on demand).

    Raises:
        ValueError: an invalid descriptor, scope key, token, codec name, layer
            range, prefix length or destination (missing, read-only or too
            small); a prompt without a full block; more needed
            Objects than ``config.max_objects``; ``require_authenticity`` without
            ``producer_keys``.
    """

    def __init__(
        self,
        descriptor: Mapping[str, Any],
        scope_key: bytes,
        tokens: Sequence[int],
        *,
        producer_keys: Mapping[bytes, VerificationKey] | None = None,
        require_authenticity: bool = True,
        tracks: TrackSelection | None = None,
        recovery_time_bound: float = 2.0,
        destinations: Destinations | None = None,
        layers: range | None = None,
        prefix_lengths: Sequence[int] | None = None,
        config: ConsumerConfig | None = None,
        require_encryption: bool = False,
        cipher_suite: CipherSuite | int = DEFAULT_SUITE,
        key_ids: Collection[int] | None = None,
        index: IndexOptions | None = IndexOptions(),  # noqa: B008 - frozen
    ) -> None:
        config = config or ConsumerConfig()
        if type(require_encryption) is not bool:
            raise ValueError("require_encryption must be a bool")
        selection = tracks or TrackSelection()
        cd = CompatibilityDescriptor(dict(descriptor))
        keys = compute_block_keys(scope_key, cd, tokens)
        if not keys:
            raise ValueError(f"the prompt has no full block of {cd.block_tokens} tokens")
        if require_authenticity and producer_keys is None:
            raise ValueError("require_authenticity needs producer_keys")
        if not recovery_time_bound > 0:
            raise ValueError("recovery_time_bound must be > 0")
        wanted = range(cd.layers) if layers is None else layers
        if wanted.step != 1 or not wanted or wanted.start < 0 or wanted.stop > cd.layers:
            raise ValueError(f"layers must be a non-empty range within 0..{cd.layers - 1}")
        codec = codec_from_name(selection.codec)
        data_length = encoded_size(codec, cd) * (2 if selection.joint else 1)
        objects = len(selection.components) * len(wanted) * len(keys)
        if objects > config.max_objects:
            raise ValueError(f"{objects} needed Objects exceed max_objects ({config.max_objects})")
        if prefix_lengths is None:
            prefixes = default_prefixes(len(keys), config.max_discovery_prefixes)
        else:
            prefixes = tuple(sorted(set(prefix_lengths), reverse=True))
            if not prefixes or prefixes[-1] < 1 or prefixes[0] > len(keys):
                raise ValueError(f"prefix lengths must be within 1..{len(keys)}")
        keyring = SecureObjectKeyring.from_scope_key(
            scope_key, cipher_suite, key_ids=None if key_ids is None else sorted(key_ids)
        )
        super().__init__(
            config=config,
            selection=selection,
            descriptor=cd,
            layers=wanted,
            scope_id=compute_scope_id(scope_key),
            block_keys=keys,
            prefixes=prefixes,
            producer_keys=producer_keys,
            require_authenticity=require_authenticity,
            recovery_time_bound=recovery_time_bound,
            destinations=destinations,
            codec_value=int(codec),
            data_length=data_length,
            keyring=keyring,
            require_encryption=require_encryption,
        )
        self._check_destinations()
        self._init_index(index)

    # --- getters -------------------------------------------------------------------------

    @property
    def prompt_blocks(self) -> int:
        """Full blocks of the prompt (the longest prefix that could be reused)."""
        return len(self.block_keys)

    @property
    def done(self) -> bool:
        """RetrievalComplete was emitted."""
        return self._phase is Phase.DONE

    @property
    def publication_id(self) -> bytes | None:
        """The primary publication, once one is selected."""
        return None if self._primary is None else self._primary.id

    @property
    def manifest(self) -> Manifest | None:
        """The latest accepted manifest version of the primary publication."""
        return None if self._primary is None else self._primary.versions.latest

    @property
    def missing_objects(self) -> int:
        """Needed Objects not verified yet (and not given up)."""
        table = self._table
        if table is None:
            return 0
        return table.count(ObjState.WANTED) + table.count(ObjState.GAP)

    @property
    def verified_objects(self) -> int:
        """Needed Objects verified and usable (READY); times ``data_length``: the octets of
        verified Data received."""
        table = self._table
        return 0 if table is None else table.count(ObjState.READY)

    def layer_ready(self, layer: int) -> bool:
        """Whether every needed Object of ``layer`` is verified."""
        return self._table is not None and self._table.layer_ready(layer)

    def data(self, layer: int, component: Component, block: int) -> memoryview | None:
        """The verified Data of one Object (absolute ``block``) when no destinations were
        given; None if it is not verified (yet). The view aliases the received payload."""
        try:
            ci = self.components.index(Component(component))
        except ValueError:
            raise LocalProtocolError(f"{component!r} is not a selected component") from None
        table = self._table
        if table is None or not table.needs(layer, block):
            return None
        if table.get(ci, layer, block) is not ObjState.READY:
            return None
        return self._views.get((ci, layer, block))

    def session_index(self, session: MoqtSession) -> int | None:
        """The index ``attach`` gave ``session`` (events name sessions by it)."""
        slot = self._slot_of.get(id(session))
        return None if slot is None or slot.session is not session else slot.index

    # --- commands --------------------------------------------------------------------------

    def attach(self, session: MoqtSession, *, now: float) -> int:
        """Use ``session`` for discovery and retrieval; returns its index.

        The session may still be setting up: the consumer starts on it at its
        ``SetupCompleted``. Drain the session afterwards.

        Raises:
            LocalProtocolError: already attached, or the retrieval is over.
        """
        self._advance(now)
        if self._phase is Phase.DONE:
            raise LocalProtocolError("the retrieval is over")
        if self.session_index(session) is not None:
            raise LocalProtocolError("session already attached")
        slot = SessionSlot(len(self._sessions), session)
        self._sessions.append(slot)
        self._slot_of[id(session)] = slot
        if session.setup_complete and not session.is_closed:
            self._on_session_ready(slot, now)
        return slot.index

    def add_publication(self, namespace: TrackNamespace, *, blocks: int, now: float) -> None:
        """Add a publication known from elsewhere (a KVSP index lookup, profile 5.1).

        ``blocks``: how many of our full blocks it holds (the index matched our Block
        Key ``K_(blocks-1)``). It is served by any attached session.

        Raises:
            LocalProtocolError: not a KVCS namespace of our scope and descriptor,
                ``blocks`` out of range, or the retrieval is over.
        """
        self._advance(now)
        if self._phase is Phase.DONE:
            raise LocalProtocolError("the retrieval is over")
        try:
            kns = KvcsNamespace.from_track_namespace(namespace)
        except KvcsNameError as e:
            raise LocalProtocolError(f"not a KVCS namespace: {e}") from None
        if kns.scope_id != self.scope_id or kns.compat_id != self.compat_id:
            raise LocalProtocolError("the namespace is of another scope or descriptor")
        if not 1 <= blocks <= self.prompt_blocks:
            raise LocalProtocolError(f"blocks must be in 1..{self.prompt_blocks}")
        self._add_known(kns, blocks, now)

    # --- inputs ----------------------------------------------------------------------------

    def handle_session_event(
        self, session: MoqtSession, event: ev.SessionEvent, now: float
    ) -> bool:
        """Feed one event of an attached session; True if it was for a request of ours."""
        slot = self._slot_of.get(id(session))
        if slot is None or slot.session is not session:
            return False
        self._advance(now)
        if type(event) is _OBJECT_RECEIVED:  # the per-Object path: straight to its request
            req = self._reqs.get((slot.index, event.request_id))
            if req is None:
                return False
            if self._phase is not _DONE:
                if type(req) is DataRequest:
                    self._on_data_object(slot, req, event, now)
                else:
                    self._on_request_event(slot, req, event, now)
            return True
        if isinstance(event, ev.SetupCompleted):
            if self._phase is not Phase.DONE:
                self._on_session_ready(slot, now)
            return False
        if isinstance(event, ev.SessionClosed):
            self._on_session_closed(slot, now)
            return False
        if isinstance(event, ev.GoawayReceived) and event.request_id is None:
            slot.goaway = True  # no new requests there (d21 9.2); running ones continue
            return False
        request_id: int | None = getattr(event, "request_id", None)
        if request_id is None:
            return False
        req = self._reqs.get((slot.index, request_id))
        if req is None:
            return False
        if self._phase is Phase.DONE:
            return True
        self._on_request_event(slot, req, event, now)
        return True

    def _on_request_event(
        self, slot: SessionSlot, req: AnyRequest, event: ev.SessionEvent, now: float
    ) -> None:
        if isinstance(req, IndexLookupRequest | RecordRequest):
            self._on_index_event(slot, req, event, now)
        elif isinstance(req, NamespaceRequest):
            self._on_namespace_event(slot, req, event, now)
        elif isinstance(req, ManifestRequest):
            self._on_manifest_event(slot, req, event, now)
        else:
            self._on_data_event(slot, req, event, now)

    def handle_timer(self, now: float) -> None:
        """Fire every deadline due at ``now``; early or repeated calls do nothing."""
        self._advance(now)
        if self._phase is Phase.DONE:
            return
        self._manifest_timers(now)
        if self._phase is Phase.DISCOVERING:
            self._index_timer(now)
            self._discovery_timer(now)
        stall = self._stall_deadline()
        if stall is not None and stall <= now:
            self._on_stall(now)
        deadline = self._recovery_deadline
        if self._phase is Phase.RETRIEVING and deadline is not None and deadline <= now:
            self._on_recovery_timeout(now)

    # --- outputs -----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest deadline, or None."""
        if self._phase is Phase.DONE:
            return None
        times = self._manifest_deadlines()
        if self._phase is Phase.DISCOVERING and self._disc_deadline is not None:
            times.append(self._disc_deadline)
        index_deadline = self._index_deadline()
        if self._phase is Phase.DISCOVERING and index_deadline is not None:
            times.append(index_deadline)
        stall = self._stall_deadline()
        if stall is not None:
            times.append(stall)
        if self._recovery_deadline is not None:
            times.append(self._recovery_deadline)
        return min(times, default=None)

    def next_event(self) -> ConsumerEvent | None:
        """The next event, or None."""
        return self._events.popleft() if self._events else None

    # --- internals ---------------------------------------------------------------------------

    def _on_session_closed(self, slot: SessionSlot, now: float) -> None:
        if slot.closed:
            return
        slot.closed = True
        slot.namespaces.clear()
        for pub in self._pubs.values():
            if slot.index in pub.sessions:
                pub.sessions.remove(slot.index)
        if self._phase is Phase.DONE:
            return
        mine = [(key, req) for key, req in self._reqs.items() if key[0] == slot.index]
        for key, req in mine:
            del self._reqs[key]
            if isinstance(req, ManifestRequest) and req.pub.manifest_req is req:
                req.pub.manifest_req = None
                req.pub.manifest_tried.add(slot.index)
            elif isinstance(req, DataRequest):
                self._end_request(req, now, cancel=False, forget=False)
        for pub in list(self._pubs.values()):
            if pub.state is PubState.MANIFEST_PENDING and pub.manifest_req is None:
                self._request_manifest(pub, now)
            elif pub.state is PubState.ACCEPTED and pub.manifest_req is None:
                self._resubscribe_manifest(pub, now)
        if self._phase is Phase.DISCOVERING and not self._any_session_alive():
            self._no_publication(now)
        else:
            self._reconcile(now)
