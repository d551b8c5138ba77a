"""Shared state of the KVCS consumer: sessions, publications, requests, the object table.

Theory of operation
-------------------
The consumer (``consumer.py``) is split by concern into mixins over this core,
as ``MoqtSession`` is: ``_discovery.py`` finds publications and accepts their
manifests (profile 5.1, 3.6), ``_retrieval.py`` requests, verifies and places
data Objects and sends missing ones to other sources (profile 5.2 to 5.4), and
``_recovery.py`` checks late-listed digests, keeps the time bounds and ends the
retrieval (profile 3.6, 5.4). Methods one mixin needs from another are declared
here.

*What is needed.* The prompt has ``m`` full blocks (binding 3). A publication is
used for the first ``N`` of them: its discovery prefix (its Anchor Key is our
``K_(N-1)``), or what the KVSP index said when the application added it. The
needed Objects are every (component, layer, block) with the selected components
(``k`` and ``v``, or ``kv``), the selected layers and blocks ``0..N-1``.
:class:`ObjectTable` holds one state octet per needed Object, row by row (one
``bytearray`` per component and layer, so a range is scanned with C-level
``find``/``count``)::

    WANTED --verified--> READY (or HELD until a verified manifest lists its digest)
      |  \\                 |
      |   request failed /  | a later manifest lists another digest
      v   Object refused    v
     GAP <-----------------+
      |
      +--recovery time bound passed--> ABANDONED (reported in RecomputeNeeded)

A layer is ready when all its Objects are READY (profile 5.4). The retrieval
is complete when nothing is WANTED, GAP or HELD.

*Requests.* Every request the consumer makes is recorded under (session index,
Request ID); events for other requests are not the consumer's. A
:class:`DataRequest` is one SUBSCRIBE or FETCH of one data track of one
publication; while *active* it covers its layers and needed blocks, except the
Objects that it already failed to deliver (``failed``). An ended request stays
recorded until the session finishes it, so Objects still in flight on it are
used.
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import attrs

from kvcs_core.kvcs._consumer_events import (
    ConsumerConfig,
    ConsumerEvent,
    Destinations,
    TrackSelection,
)
from kvcs_core.kvcs._verify import Refusal
from kvcs_core.kvcs.manifest import Manifest, ManifestVersions
from kvcs_core.kvcs.names import Component, KvcsNamespace
from kvcs_core.kvcs.protection import Unopened, open_payload
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.secobj import SecureObjectKeyring, serialize_full_track_name
from kvcs_core.wire.names import FullTrackName, Location

if TYPE_CHECKING:
    from kvcs_core.kvcs.cose import VerificationKey
    from kvcs_core.kvcs.index import IndexNamespace
    from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
    from kvcs_core.moqt.session import MoqtSession


class Phase(enum.IntEnum):
    DISCOVERING = 1
    """Looking for a publication and its first acceptable manifest."""
    RETRIEVING = 2
    """Retrieving (and recovering) the needed Objects."""
    DONE = 3
    """RetrievalComplete was emitted; inputs are ignored."""


class PubState(enum.IntEnum):
    CANDIDATE = 1
    MANIFEST_PENDING = 2
    ACCEPTED = 3
    REJECTED = 4


class ObjState(enum.IntEnum):
    """State of one needed Object (see the module docstring)."""

    WANTED = 0
    GAP = 1
    HELD = 2
    READY = 3
    ABANDONED = 4


_MISSING = (ObjState.WANTED, ObjState.GAP)
_CODE = {s: bytes((s,)) for s in ObjState}
_STATES = tuple(ObjState)  # index -> member, faster than ObjState(value)
_WANTED, _GAP, _HELD, _READY = (int(s) for s in _STATES[:4])  # plain ints: per-Object paths


@attrs.define(eq=False)
class SessionSlot:
    """One attached session."""

    index: int
    session: MoqtSession
    closed: bool = False
    goaway: bool = False
    namespaces: dict[int, int] = attrs.field(factory=dict)
    """Prefix length in blocks -> Request ID of our SUBSCRIBE_NAMESPACE on it."""

    @property
    def usable(self) -> bool:
        """New requests may be sent on it."""
        s = self.session
        return not (self.closed or self.goaway or s.is_closed) and s.setup_complete


@attrs.define(eq=False)
class Publication:
    """What the consumer knows about one publication (profile 3.1 field 4)."""

    ns: KvcsNamespace
    prefix_blocks: int
    """Blocks of our prompt it covers: its discovery prefix, or what the index said."""
    order: int
    sessions: list[int] = attrs.field(factory=list)
    """Indices of the sessions it was announced on, in order."""
    any_session: bool = False
    """Added by the application: try every attached session."""
    state: PubState = PubState.CANDIDATE
    versions: ManifestVersions = attrs.field(factory=ManifestVersions)
    signed: bool = True
    """Which manifest track is tried: ``manifest.cose`` first (profile 5.2)."""
    manifest_req: ManifestRequest | None = None
    manifest_tried: set[int] = attrs.field(factory=set)
    manifest_deadline: float | None = None
    authenticated: bool = False
    problem: Refusal | None = None
    """The last refusal, reported if no session is left to try."""

    @property
    def id(self) -> bytes:
        return self.ns.publication_id

    @property
    def deterministic(self) -> bool:
        latest = self.versions.latest
        return latest is not None and latest.deterministic


@attrs.define(eq=False)
class NamespaceRequest:
    """Our SUBSCRIBE_NAMESPACE for one prefix length (profile 5.1)."""

    session: int
    request_id: int
    prefix_blocks: int


@attrs.define(eq=False)
class ManifestRequest:
    """Our SUBSCRIBE to a manifest track (profile 5.2)."""

    session: int
    request_id: int
    pub: Publication
    signed: bool


@attrs.define(eq=False)
class DataRequest:
    """Our SUBSCRIBE (live, profile 5.2) or FETCH (completed, profile 5.3) of one data track."""

    session: int
    request_id: int
    pub: Publication
    segment: int
    seg_blocks: int
    """Blocks of the whole segment (the manifest's ``blocks``)."""
    track: str
    ci: int
    """Index of the component in the selection."""
    component: Component
    first: int
    """Absolute index of the segment's first block (Object ID 0)."""
    n: int
    """Object IDs 0..n-1 are needed."""
    layers: range
    live: bool
    active: bool = True
    largest: Location | None = None
    """SUBSCRIBE_OK's Largest Object: the fill covers up to it, the subscription after it."""
    accepted: bool = False
    fill_done: bool = False
    end_of_track: bool = False
    last_fetch_loc: Location | None = None
    """Last Object seen on its fill or fetch stream (both ascending)."""
    failed: dict[int, set[int]] = attrs.field(factory=dict)
    """layer -> blocks it delivered refused, or reported missing: not covered any more."""
    expected: int = 0
    progress: int = 0
    no_retry: bool = False
    """It delivered an Object that failed verification, or reported a range it does not
    have: its session is not asked again for this track (it would serve the same)."""
    pinned: bool = False
    """Its segment's pin (see ``_retrieval``) is recorded; pins are never removed."""
    pins_ok: int = 0
    """How many of the consumer's pins are known not to forbid this request's data."""
    listed: tuple[Manifest, int, tuple[str, ...] | None] | None = None
    """Per-Object lookup cache: (manifest version, layer, the digests it lists for that
    Group of this track, if any)."""

    @property
    def end(self) -> int:
        return self.first + self.n

    @property
    def key(self) -> tuple[bytes, int, int]:
        return (self.pub.id, self.segment, self.ci)

    def covers(self, layer: int, block: int) -> bool:
        return (
            self.active
            and layer in self.layers
            and self.first <= block < self.first + self.n
            and block not in self.failed.get(layer, ())
        )

    def fail(self, layer: int, block: int) -> None:
        self.failed.setdefault(layer, set()).add(block)

    @property
    def fill_pending(self) -> bool:
        return self.live and self.accepted and self.largest is not None and not self.fill_done


@attrs.define(eq=False)
class IndexLookupRequest:
    """Our SUBSCRIBE_NAMESPACE of one KVSP index lookup (binding 9, ``_index_search``)."""

    session: int
    request_id: int
    length: int
    """The prefix length looked up: the prefix ends with our ``K_(length-1)``."""


@attrs.define(eq=False)
class RecordRequest:
    """Our SUBSCRIBE to one ``replica`` / ``replica.cose`` track (binding 9)."""

    session: int
    request_id: int
    length: int
    index_ns: IndexNamespace
    signed: bool


AnyRequest = NamespaceRequest | ManifestRequest | DataRequest | IndexLookupRequest | RecordRequest


class ObjectTable:
    """One state octet per needed Object (components x layers x blocks)."""

    def __init__(self, components: int, layers: range, blocks: int) -> None:
        self.components = components
        self.layers = layers
        self.blocks = blocks
        self._start = layers.start
        self._nl = len(layers)
        self._rows = [bytearray(blocks) for _ in range(components * self._nl)]
        self._ready = [0] * self._nl
        self._per_layer = components * blocks
        self._count = [0] * len(ObjState)
        self._count[ObjState.WANTED] = components * self._nl * blocks

    def row(self, ci: int, layer: int) -> bytearray:
        return self._rows[ci * self._nl + layer - self._start]

    def needs(self, layer: int, block: int) -> bool:
        return layer in self.layers and 0 <= block < self.blocks

    def get(self, ci: int, layer: int, block: int) -> ObjState:
        return _STATES[self._rows[ci * self._nl + layer - self._start][block]]

    def state(self, ci: int, layer: int, block: int) -> ObjState | None:
        """The state of one Object, or None when it is not needed (``needs`` is false)."""
        li = layer - self._start
        if not (0 <= li < self._nl and 0 <= block < self.blocks):
            return None
        return _STATES[self._rows[ci * self._nl + li][block]]

    def set(self, ci: int, layer: int, block: int, new: ObjState) -> bool:
        """Move one Object to ``new``; True when its layer just became ready."""
        li = layer - self._start
        row = self._rows[ci * self._nl + li]
        old = row[block]
        if old == new:
            return False
        row[block] = new
        self._count[old] -= 1
        self._count[new] += 1
        if old == _READY:
            self._ready[li] -= 1
        if new == _READY:
            self._ready[li] += 1
            return self._ready[li] == self._per_layer
        return False

    def count(self, state: ObjState) -> int:
        return self._count[state]

    @property
    def unsettled(self) -> int:
        c = self._count
        return c[_WANTED] + c[_GAP] + c[_HELD]

    def layer_ready(self, layer: int) -> bool:
        return layer in self.layers and self._ready[layer - self.layers.start] == self._per_layer

    def positions(
        self, ci: int, layer: int, start: int, end: int, states: tuple[ObjState, ...] = _MISSING
    ) -> list[int]:
        """Blocks in ``start..end-1`` of one row whose state is in ``states``, ascending."""
        row = self.row(ci, layer)
        out: list[int] = []
        for s in states:
            code = _CODE[s]
            i = row.find(code, start, end)
            while i >= 0:
                out.append(i)
                i = row.find(code, i + 1, end)
        if len(states) > 1:
            out.sort()
        return out

    def missing_in(self, ci: int, layers: range, start: int, end: int) -> int:
        """WANTED and GAP Objects of one component in a layer and block range."""
        total = 0
        for layer in layers:
            if layer in self.layers:
                row = self.row(ci, layer)
                total += row.count(_CODE[ObjState.WANTED], start, end)
                total += row.count(_CODE[ObjState.GAP], start, end)
        return total

    def each(self, state: ObjState) -> Iterator[tuple[int, int, int]]:
        """Every (component index, layer, block) in ``state``."""
        for ci in range(self.components):
            for layer in self.layers:
                for b in self.positions(ci, layer, 0, self.blocks, (state,)):
                    yield ci, layer, b


class ConsumerCore:
    """State shared by the consumer's mixins; see the module docstring."""

    def __init__(
        self,
        *,
        config: ConsumerConfig,
        selection: TrackSelection,
        descriptor: CompatibilityDescriptor,
        layers: range,
        scope_id: bytes,
        block_keys: tuple[bytes, ...],
        prefixes: tuple[int, ...],
        producer_keys: Mapping[bytes, VerificationKey] | None,
        require_authenticity: bool,
        recovery_time_bound: float,
        destinations: Destinations | None,
        codec_value: int,
        data_length: int,
        keyring: SecureObjectKeyring,
        require_encryption: bool,
    ) -> None:
        self.config = config
        self.selection = selection
        self.descriptor = descriptor
        self.layers = layers
        self.scope_id = scope_id
        self.compat_id = descriptor.compat_id
        self.block_keys = block_keys
        self.prefixes = prefixes
        self.producer_keys = producer_keys
        self.require_authenticity = require_authenticity
        self.recovery_time_bound = recovery_time_bound
        self.destinations = destinations
        self.codec_value = codec_value
        self.data_length = data_length
        self.block_tokens = descriptor.block_tokens
        self.components = selection.components
        self.keyring = keyring
        self.require_encryption = require_encryption
        self._ftns: dict[tuple[bytes, str], bytes] = {}
        """(publication, track) -> Serialized Full Track Name (Secure Objects key context)."""

        self._phase = Phase.DISCOVERING
        self._now = 0.0
        self._events: deque[ConsumerEvent] = deque()
        self._sessions: list[SessionSlot] = []
        self._slot_of: dict[int, SessionSlot] = {}
        self._pubs: dict[bytes, Publication] = {}
        self._primary: Publication | None = None
        self._reqs: dict[tuple[int, int], AnyRequest] = {}
        self._active: list[list[DataRequest]] = [[] for _ in self.components]
        self._tried: dict[tuple[bytes, int, int], set[int]] = {}
        self._untrusted: dict[tuple[bytes, int, int], set[int]] = {}
        """(publication, segment, component) -> sessions that delivered an Object of it that
        failed verification: never asked for it again (they would serve the same)."""
        self._pins: list[tuple[int, int, bytes]] = []
        """(first block, end block, publication) of every segment that supplied data."""
        self._table: ObjectTable | None = None
        self._views: dict[tuple[int, int, int], memoryview] = {}
        self._dest_views: dict[tuple[int, int], memoryview] = {}
        self._unlisted: dict[tuple[bytes, str, int], dict[int, tuple[int, int, bytes, int]]] = {}
        """(publication, track, layer) -> Object ID -> (component index, block, digest,
        session) of verified Objects whose digest no manifest version listed yet."""
        self._disc_pos = -1
        self._disc_deadline: float | None = None
        self._disc_progress = 0.0  # the direct prefix's start or last answer
        self._disc_unanswered: dict[tuple[int, int], float] = {}  # its requests -> sent at
        self._recovery_deadline: float | None = None
        self._last_progress = 0.0
        self._last_stall: float | None = None
        """When the last stall fired (``_last_progress`` still equals it: nothing since)."""
        self.excess_objects = 0
        """Objects received that were not needed (outside the ranges, or duplicates)."""

    # --- small helpers ---------------------------------------------------------------

    def _open_protected(
        self, pub: Publication, track: str, event: ev.ObjectReceived
    ) -> memoryview | Unopened:
        """The plaintext payload of a Normal Object (KVSP binding 8), or why it is refused."""
        if not event.properties and not self.require_encryption:
            return event.payload  # in clear, and allowed to be
        key = (pub.id, track)
        ftn = self._ftns.get(key)
        if ftn is None:
            name = FullTrackName(pub.ns.to_track_namespace(), track.encode("ascii"))
            ftn = self._ftns[key] = serialize_full_track_name(name)
        loc = event.location
        return open_payload(
            self.keyring,
            ftn,
            group_id=loc.group,
            object_id=loc.object,
            priority=event.publisher_priority,
            properties=event.properties,
            payload=event.payload,
            require=self.require_encryption,
        )

    def _emit(self, event: ConsumerEvent) -> None:
        self._events.append(event)

    def _advance(self, now: float) -> None:
        if now < self._now:
            raise LocalProtocolError(f"time went backwards: {now} < {self._now}")
        self._now = now

    @property
    def blocks(self) -> int | None:
        """Blocks retrieved (N), once a publication's manifest was accepted."""
        return None if self._table is None else self._table.blocks

    def _track_name(self, ci: int, segment: int) -> str:
        return f"{self.components[ci].token}.{self.selection.codec}.s{segment}"

    def _forget(self, session: int, request_id: int, now: float, *, cancel: bool) -> None:
        """Drop a request's record; with ``cancel``, cancel it on its session too."""
        self._reqs.pop((session, request_id), None)
        if cancel:
            slot = self._sessions[session]
            if not slot.closed and not slot.session.is_closed:
                with contextlib.suppress(LocalProtocolError):  # finished on its side
                    slot.session.cancel(request_id, now=now)

    def _hold(self, pub: Publication) -> bool:
        """Whether Objects of ``pub`` wait (HELD) until a manifest version lists their digest:
        always for a publication whose manifest a producer key verified (the Data Digest
        alone does not show that the producer made the Data), else as configured."""
        return pub.authenticated or self.config.hold_until_listed

    def _distrust(self, key: tuple[bytes, int, int], session: int) -> None:
        """``session`` delivered a refused Object of ``key``'s track: never ask it again."""
        self._tried.setdefault(key, set()).add(session)
        self._untrusted.setdefault(key, set()).add(session)

    def _usable_sessions(self, pub: Publication) -> Iterator[SessionSlot]:
        indices = range(len(self._sessions)) if pub.any_session else pub.sessions
        for i in indices:
            slot = self._sessions[i]
            if slot.usable:
                yield slot

    def _any_session_alive(self) -> bool:
        return any(not s.closed and not s.session.is_closed for s in self._sessions)

    # --- destinations ------------------------------------------------------------------

    def _check_destinations(self) -> None:
        """Take every destination buffer once (at construction): misuse surfaces there."""
        if self.destinations is not None:
            for layer in self.layers:
                for ci in range(len(self.components)):
                    self._dest_view(layer, ci, len(self.block_keys))

    def _dest_view(self, layer: int, ci: int, blocks: int) -> memoryview:
        view = self._dest_views.get((layer, ci))
        if view is not None:
            return view
        comp = self.components[ci]
        dest = self.destinations
        try:
            if isinstance(dest, Mapping):
                buf = dest[(layer, comp)]
            else:
                assert dest is not None
                buf = dest(layer, comp)
            view = memoryview(buf)
        except (KeyError, TypeError) as e:
            raise ValueError(f"no usable destination for layer {layer} {comp.name}: {e}") from None
        if view.readonly or not view.c_contiguous:
            raise ValueError(f"destination of layer {layer} {comp.name} is not writable")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        need = blocks * self.data_length
        if view.nbytes < need:
            raise ValueError(
                f"destination of layer {layer} {comp.name} has {view.nbytes} octets; "
                f"{blocks} blocks need {need}"
            )
        self._dest_views[(layer, ci)] = view
        return view

    # --- provided by the mixins ---------------------------------------------------------

    def _begin_retrieval(self, now: float) -> None:
        raise NotImplementedError

    def _reconcile(self, now: float) -> None:
        raise NotImplementedError

    def _recheck_unlisted(self, pub: Publication, now: float) -> None:
        raise NotImplementedError

    def _probe_alternative(self, now: float) -> None:
        raise NotImplementedError

    def _retry_pending_manifests(self, now: float) -> None:
        raise NotImplementedError

    def _finish(self, now: float, *, complete: bool) -> None:
        raise NotImplementedError

    def _check_done(self, now: float) -> None:
        raise NotImplementedError

    def _end_request(self, req: DataRequest, now: float, *, cancel: bool, forget: bool) -> None:
        raise NotImplementedError
