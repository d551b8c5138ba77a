"""Consumer mixin: finding the longest shared prefix through the KVSP index (binding 9).

Theory of operation
-------------------
Direct discovery (``_discovery``) finds a publication only when its Anchor Key is
one of our Block Keys, i.e. when its prompt is one of the prefixes we try. When
the first direct prefix (the whole prompt, ``m`` blocks) finds nothing within
``discovery_timeout``, and the index is on (:class:`IndexOptions`), the consumer
searches the index before it tries the shorter direct prefixes:

0. the shorter direct prefixes (``_discovery``) are all subscribed at once, beside
   the search; a publication they announce raises the search's floor (no lookup
   at or below its length), and no publication is chosen before the search ends;
1. :class:`~kvcs_core.kvcs.index.PrefixSearch` picks a prefix length ``j`` (a
   bitwise binary search over the multiples of the stride up to ``m``, which also
   finds publications that index every ``2^k``-th multiple; then at most one more
   lookup, at the block count a record named, when the prompt holds the whole of that
   publication);
2. *lookup*: SUBSCRIBE_NAMESPACE ``("kvcs-idx-1", Scope ID, Compatibility ID,
   K_(j-1))`` on every usable session; each NAMESPACE names one publication's
   index namespace, whose ``replica.cose`` (or, when authenticity is not required
   and ``replica.cose`` does not exist, ``replica``) track is subscribed with the
   manifest's pattern (Next Object and FILL_PARAMETERS{Relative Start 1});
3. the record is opened and checked (:func:`~kvcs_core.kvcs.index.open_record`):
   with authenticity required only signed records that a producer key verifies
   and whose ``block_key`` and ``block_index`` are our own count; a refused record
   is reported (:class:`IndexRecordDiscarded`) and ignored;
4. the lookup is *shared* as soon as one usable record arrives, *not shared* when
   none did within ``timeout`` of its last sign of progress: its start, or an
   answer (REQUEST_OK to a lookup, a NAMESPACE, SUBSCRIBE_OK to a record request),
   so a record on its way is awaited; and never while one of its requests is still
   unanswered, for up to ``answer_timeout`` after it was sent: ``timeout`` is how long
   to wait for a *match* once the relay has answered, not a bound on the round trip
   (a path slower than ``timeout``, or a loaded relay, would otherwise make every
   lookup "not shared"). Its requests are cancelled either way
   (:class:`IndexLookupDone`);
5. at the end (:class:`IndexSearchDone`) the publications named by the records of
   the longest shared prefix, then those of shorter ones, become candidates for
   that many blocks, exactly as ``add_publication`` would add them, beside those
   direct discovery found; the longest is chosen, its manifest is fetched and
   verified as usual and only blocks ``0..j-1`` are retrieved. A rejected one is
   replaced by the next longest; when none is left (and the direct prefixes had
   their ``discovery_timeout``), recomputation is reported.

Bounded: at most ``ceil(log2(c + 1)) + 1`` lookups for ``c`` candidate lengths, one
record request per announced publication per lookup (at most
``max_records_per_lookup``), every wait timed.
"""

from __future__ import annotations

import enum

import attrs

from kvcs_core.kvcs._consumer_core import (
    IndexLookupRequest,
    Phase,
    PubState,
    RecordRequest,
    SessionSlot,
)
from kvcs_core.kvcs._consumer_events import (
    IndexLookupDone,
    IndexRecordDiscarded,
    IndexRejectReason,
    IndexSearchDone,
)
from kvcs_core.kvcs._discovery import DiscoveryMixin
from kvcs_core.kvcs.index import (
    IndexNamespace,
    IndexRecord,
    IndexRecordRejected,
    PrefixSearch,
    index_prefix,
    open_record,
)
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, RequestErrorCode


@attrs.frozen(kw_only=True)
class IndexOptions:
    """How the consumer uses the KVSP index (binding 9)."""

    stride: int = 1
    """Look up only prefix lengths that are multiples of this (the publishers' stride)."""
    timeout: float = 0.3
    """Seconds one lookup waits for a usable record after its last progress (its start,
    an answer to one of its requests, an announcement: module docstring, step 4)."""
    answer_timeout: float = 2.0
    """Seconds a lookup waits for the answer to each of its requests (REQUEST_OK,
    SUBSCRIBE_OK, an error) before ``timeout`` alone applies (module docstring, step 4)."""
    max_records_per_lookup: int = 16
    """Announced publications whose record is requested in one lookup, at most."""

    def __attrs_post_init__(self) -> None:
        if type(self.stride) is not int or self.stride < 1:
            raise ValueError("index stride must be an integer >= 1")
        if not self.timeout > 0:
            raise ValueError("index timeout must be > 0")
        if not self.answer_timeout > 0:
            raise ValueError("index answer_timeout must be > 0")
        if self.max_records_per_lookup < 1:
            raise ValueError("max_records_per_lookup must be >= 1")


class IndexPhase(enum.IntEnum):
    IDLE = 1
    RUNNING = 2
    DONE = 3


class IndexSearchMixin(DiscoveryMixin):
    """Direct discovery plus the index search; see the module docstring."""

    _index_opts: IndexOptions | None
    _index_phase: IndexPhase
    _isearch: PrefixSearch | None
    _probe: int | None
    _probe_deadline: float | None
    _probe_progress: float
    _probe_unanswered: dict[tuple[int, int], float]
    _probe_seen: set[tuple[int, bytes]]
    _probe_records: int
    _found: dict[int, list[IndexRecord]]
    _index_discarded: list[IndexRecordDiscarded]
    _index_started: float

    def _init_index(self, options: IndexOptions | None) -> None:
        self._index_opts = options
        self._index_phase = IndexPhase.IDLE
        self._isearch = None
        self._probe = None
        self._probe_deadline = None
        self._probe_progress = 0.0
        self._probe_unanswered = {}
        self._probe_seen = set()
        self._probe_records = 0
        self._found = {}
        self._index_discarded = []
        self._index_started = 0.0

    # --- getters ----------------------------------------------------------------------------

    @property
    def index_lookups(self) -> int:
        """KVSP index lookups made so far (SUBSCRIBE_NAMESPACE rounds, not sessions)."""
        return 0 if self._isearch is None else self._isearch.lookups

    @property
    def index_shared_blocks(self) -> int:
        """The longest prefix (blocks) the index search found shared (0: none or not run)."""
        return 0 if self._isearch is None else self._isearch.found

    @property
    def index_searched(self) -> bool:
        """The index search ran (direct discovery of the whole prompt found nothing)."""
        return self._index_phase is not IndexPhase.IDLE

    # --- control ----------------------------------------------------------------------------

    def _index_takes_over(self, now: float) -> bool:
        """Called where direct discovery would try its next prefix: True when the index
        search runs (or just started) instead."""
        if self._index_phase is IndexPhase.RUNNING:
            return True
        if self._index_phase is IndexPhase.DONE or self._index_opts is None:
            return False
        if self._disc_pos < 0:
            return False  # the whole prompt is tried directly first
        self._index_phase = IndexPhase.RUNNING
        self._index_started = now
        self._disc_deadline = None
        # the shorter direct prefixes are asked now, all at once, beside the search; the
        # longest publication of either kind is chosen when the search ends
        for prefix in self.prefixes[self._disc_pos + 1 :]:
            for slot in self._sessions:
                self._send_namespace(slot, prefix, now)
        self._disc_pos = len(self.prefixes) - 1
        stride = self._index_opts.stride
        if stride > len(self.block_keys):
            self._end_search(now)  # no multiple of the stride to look up
            return True
        self._isearch = PrefixSearch(len(self.block_keys), stride)
        self._next_probe(now)
        return True

    def _next_probe(self, now: float) -> None:
        search = self._isearch
        assert search is not None and self._index_opts is not None
        direct = [p.prefix_blocks for p in self._pubs.values() if p.state is PubState.CANDIDATE]
        search.raise_floor(max(direct, default=0))
        length = search.next_probe
        if length is None:
            # one more lookup at the block count of a publication found, whose last
            # block is always indexed (index module docstring: a prompt extending the
            # whole publication is found exactly, whatever its stride)
            counts = (r.blocks for r in self._found.get(search.found, ()))
            if search.extend(max((b for b in counts if b <= search.prompt_blocks), default=0)):
                length = search.next_probe
        if length is None:
            self._end_search(now)
            return
        self._probe = length
        self._probe_seen = set()
        self._probe_records = 0
        self._probe_unanswered = {}
        self._probe_progress = now
        self._probe_deadline = now + self._index_opts.timeout
        asked = False
        for slot in self._sessions:
            asked = self._send_lookup(slot, length, now) or asked
        if not asked and not any(
            not s.closed and not s.session.is_closed and not s.session.setup_complete
            for s in self._sessions
        ):
            self._conclude_probe(now, shared=False)  # no session to ask: nothing found

    def _send_lookup(self, slot: SessionSlot, length: int, now: float) -> bool:
        if not slot.usable:
            return False
        prefix = index_prefix(self.scope_id, self.compat_id, self.block_keys[length - 1])
        try:
            rid = slot.session.subscribe_namespace(prefix, now=now)
        except LocalProtocolError:
            return False
        self._reqs[(slot.index, rid)] = IndexLookupRequest(slot.index, rid, length)
        self._await_answer((slot.index, rid), now)
        return True

    def _index_session_ready(self, slot: SessionSlot, now: float) -> None:
        if self._index_phase is IndexPhase.RUNNING and self._probe is not None:
            self._send_lookup(slot, self._probe, now)

    def _conclude_probe(self, now: float, *, shared: bool) -> None:
        search = self._isearch
        length = self._probe
        if search is None or length is None:
            return
        self._probe = None
        self._probe_deadline = None
        self._probe_unanswered = {}
        for key, req in list(self._reqs.items()):
            if isinstance(req, IndexLookupRequest | RecordRequest) and req.length == length:
                self._forget(key[0], key[1], now, cancel=True)
        search.answer(length, shared)
        self._emit(IndexLookupDone(length=length, shared=shared, lookup=search.lookups))
        self._next_probe(now)

    def _await_answer(self, key: tuple[int, int], now: float) -> None:
        """A request of the current lookup was sent: the lookup waits for its answer."""
        self._probe_unanswered[key] = now
        self._set_probe_deadline()

    def _probe_progressed(self, key: tuple[int, int], now: float) -> None:
        """An answer or an announcement for the current lookup (module docstring, step 4)."""
        self._probe_unanswered.pop(key, None)
        self._probe_progress = max(self._probe_progress, now)
        self._set_probe_deadline()

    def _set_probe_deadline(self) -> None:
        opts = self._index_opts
        assert opts is not None
        deadline = self._probe_progress + opts.timeout
        if self._probe_unanswered:
            deadline = max(deadline, max(self._probe_unanswered.values()) + opts.answer_timeout)
        self._probe_deadline = deadline

    def _end_search(self, now: float) -> None:
        self._index_phase = IndexPhase.DONE
        self._probe = None
        self._probe_deadline = None
        self._probe_unanswered = {}
        found = 0 if self._isearch is None else self._isearch.found
        order: list[IndexRecord] = []
        for length in sorted(self._found, reverse=True):
            order.extend(r for r in self._found[length] if r.block_index + 1 == length)
        self._emit(
            IndexSearchDone(
                lookups=self.index_lookups,
                shared_blocks=found,
                publications=tuple(dict.fromkeys(r.namespace.publication_id for r in order)),
            )
        )
        if self._phase is not Phase.DISCOVERING:
            return
        for record in order:
            try:
                self._add_known(record.namespace, record.block_index + 1, now)
            except LocalProtocolError:
                break  # max_publications reached
            if self._phase is not Phase.DISCOVERING:
                return
        if self._primary is None:
            # nothing usable yet: the direct prefixes asked at the start get their
            # discovery_timeout, then discovery is over
            wait_until = self._index_started + self.config.discovery_timeout
            self._disc_deadline = wait_until if wait_until > now else None
            self._select_primary(now)

    # --- timers -----------------------------------------------------------------------------

    def _index_timer(self, now: float) -> None:
        if (
            self._index_phase is IndexPhase.RUNNING
            and self._probe_deadline is not None
            and self._probe_deadline <= now
        ):
            self._conclude_probe(now, shared=False)

    def _index_holds_selection(self, now: float) -> bool:
        return self._index_phase is IndexPhase.RUNNING

    def _index_deadline(self) -> float | None:
        return self._probe_deadline if self._index_phase is IndexPhase.RUNNING else None

    # --- events -----------------------------------------------------------------------------

    def _on_index_event(
        self,
        slot: SessionSlot,
        req: IndexLookupRequest | RecordRequest,
        event: ev.SessionEvent,
        now: float,
    ) -> None:
        if req.length != self._probe:
            return  # a late answer to a lookup that is over
        key = (slot.index, req.request_id)
        if isinstance(req, IndexLookupRequest):
            if isinstance(event, ev.NamespaceAnnounced):
                self._probe_progressed(key, now)
                self._on_index_announced(slot, req, event, now)
            elif isinstance(event, ev.RequestAccepted):
                self._probe_progressed(key, now)
            elif isinstance(event, ev.RequestFailed):
                self._reqs.pop(key, None)
                self._probe_progressed(key, now)
            return
        if isinstance(event, ev.SubscribeAccepted):
            self._probe_progressed(key, now)
        elif isinstance(event, ev.ObjectReceived):
            self._probe_progressed(key, now)
            self._on_record(slot, req, event, now)
        elif isinstance(event, ev.RequestFailed):
            self._reqs.pop(key, None)
            self._probe_progressed(key, now)
            if req.signed and event.code == RequestErrorCode.DOES_NOT_EXIST:
                if self.require_authenticity:
                    self._discard_record(
                        req,
                        IndexRecordRejected(
                            IndexRejectReason.UNSIGNED, "replica.cose does not exist"
                        ),
                    )
                else:
                    self._subscribe_record(slot, req.index_ns, req.length, now, signed=False)

    def _on_index_announced(
        self, slot: SessionSlot, req: IndexLookupRequest, event: ev.NamespaceAnnounced, now: float
    ) -> None:
        ins = IndexNamespace.try_parse(event.namespace)
        if (
            ins is None
            or ins.scope_id != self.scope_id
            or ins.compat_id != self.compat_id
            or ins.block_key != self.block_keys[req.length - 1]
        ):
            return  # not an index namespace of this lookup: ignored (binding 4)
        opts = self._index_opts
        assert opts is not None
        seen = (slot.index, ins.publication_id)  # one record request per session and publication
        if seen in self._probe_seen or self._probe_records >= (
            opts.max_records_per_lookup
        ):
            return
        if self._subscribe_record(slot, ins, req.length, now, signed=True):
            self._probe_seen.add(seen)
            self._probe_records += 1

    def _subscribe_record(
        self, slot: SessionSlot, ins: IndexNamespace, length: int, now: float, *, signed: bool
    ) -> bool:
        if not slot.usable:
            return False
        try:
            rid = slot.session.subscribe(
                ins.track(signed),
                now=now,
                location_filter=p.LocationFilter.next_object(),
                fill=p.Parameters.of(p.LocationFilter.relative_start(1)),
                priority=self.config.manifest_priority,
            )
        except LocalProtocolError:
            return False
        self._reqs[(slot.index, rid)] = RecordRequest(slot.index, rid, length, ins, signed)
        self._await_answer((slot.index, rid), now)
        return True

    def _on_record(
        self, slot: SessionSlot, req: RecordRequest, event: ev.ObjectReceived, now: float
    ) -> None:
        if event.status is not ObjectStatus.NORMAL or event.location.group != 0:
            return
        if event.location.object != 0:
            return
        self._forget(slot.index, req.request_id, now, cancel=True)
        opened = open_record(
            event.payload,
            signed=req.signed,
            index_ns=req.index_ns,
            block_key=self.block_keys[req.length - 1],
            block_index=req.length - 1,
            keys=self.producer_keys,
            require_authenticity=self.require_authenticity,
        )
        if isinstance(opened, IndexRecordRejected):
            self._discard_record(req, opened)
            return
        self._found.setdefault(req.length, []).append(opened.record)
        self._conclude_probe(now, shared=True)

    def _discard_record(self, req: RecordRequest, rejected: IndexRecordRejected) -> None:
        event = IndexRecordDiscarded(
            length=req.length,
            publication_id=req.index_ns.publication_id,
            reason=rejected.reason,
            detail=rejected.detail,
        )
        self._index_discarded.append(event)
        self._emit(event)
