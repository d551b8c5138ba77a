"""Consumer mixin: requesting, verifying and placing Objects (profile 5.2 to 5.4).

Theory of operation
-------------------
*Requests.* For every segment of a publication that overlaps the needed blocks
and every selected component, one data request covers the needed layers (from
the first layer that still misses an Object) and the segment's needed Object
IDs ``0..n-1``:

* a segment the manifest marks complete (or ``RetrievalMode.COMPLETED``): FETCH
  with LOCATION_FILTER Absolute Start, Group End (a, 0, b) and GROUP_ORDER
  Ascending (profile 5.3);
* otherwise: SUBSCRIBE with LOCATION_FILTER Next Object and FILL_PARAMETERS
  {Absolute Start (a, 0)}, the exactly-once pattern (profile 5.2; ``a`` is 0
  unless earlier layers are not needed or already verified).

When only the first ``n`` blocks of a segment are needed, an OBJECTID_FILTER
0..n-1 is added if the peer's MAX_FILTER_RANGES is non-zero (profile 5.3; the
consumer applies the same rule to live subscriptions, whose fill inherits it);
otherwise excess Objects are discarded quietly (counted in ``excess_objects``).

*Objects.* Every Object is verified (profile 3.5; see ``_verify``); a refused
one is reported (:class:`ObjectDiscarded`), never used, and is missing. A
duplicate, an Object outside the needed ranges, or one that would combine two
publications in a segment is ignored. Verified Data is copied once, from the
payload view into the destination buffer at ``block * data_length``, or the
view itself is kept. A layer is ready when all its Objects are (profile 5.4).

*Completion* of a request (profile 5.2, 5.3): End of Track on the subscription
(once the fill has ended), PUBLISH_DONE, REQUEST_ERROR, the session closing, or
the end of a FETCH stream. The fill's FIN also settles everything up to the
subscription's Largest Object (the fill carried all of it; this is the rule
"fill FIN and every listed Group received" for a consumer that subscribes after
production). A reset fill or subgroup stream, and an Unknown / Timed-Out /
Non-Existent range marker, make the Objects they cover missing at once. A
request with nothing left to deliver is cancelled.

*Recovery* (profile 5.4). Missing Objects become GAP. Requests go first to the
primary publication (its other sessions first: a session that failed is not
asked again for that track until one of its requests makes progress, and never
again after it delivered a refused Object or reported a range it lacks), then
to alternative publications whose manifests were accepted, verified one at a
time. Objects of two publications are never combined within a segment
(``_pin_ok``) unless both manifests say ``"deterministic": true``. The time
bounds and the end are in ``_recovery``.
"""

from __future__ import annotations

from kvcs_core.kvcs._consumer_core import (
    ConsumerCore,
    DataRequest,
    ObjectTable,
    ObjState,
    Phase,
    Publication,
    PubState,
    SessionSlot,
)
from kvcs_core.kvcs._consumer_events import (
    DiscardReason,
    LayerReady,
    ObjectDiscarded,
    RetrievalMode,
)
from kvcs_core.kvcs._verify import ObjectVerdict, check_object
from kvcs_core.kvcs.manifest import Manifest
from kvcs_core.kvcs.protection import ProtectionFailure, Unopened
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import GroupOrder, ObjectStatus, ParameterType
from kvcs_core.wire.names import Location

_MISSING = (ObjState.WANTED, ObjState.GAP)
_GAPS = (ObjState.GAP,)
_WANTED = (ObjState.WANTED,)
# looked up once (an enum member lookup costs more than a global): per-Object paths
_GAP, _HELD, _READY = ObjState.GAP, ObjState.HELD, ObjState.READY
_NORMAL = ObjectStatus.NORMAL
_PROTECTION_REASONS = {
    ProtectionFailure.DECRYPTION_FAILED: DiscardReason.DECRYPTION_FAILED,
    ProtectionFailure.UNKNOWN_KEY_ID: DiscardReason.UNKNOWN_KEY_ID,
    ProtectionFailure.NOT_PROTECTED: DiscardReason.NOT_PROTECTED,
}
_SUBSCRIPTION = ev.Delivery.SUBSCRIPTION


def _listed_group(
    manifest: Manifest, req: DataRequest, layer: int
) -> tuple[Manifest, int, tuple[str, ...] | None]:
    """The digests ``manifest`` lists for Group ``layer`` of a request's own track (None if
    none), looked up once per (manifest version, layer) and kept on the request
    (``req.listed``): Objects arrive layer by layer."""
    group = None
    if req.segment < len(manifest.segments):
        listed = manifest.segments[req.segment].object_digests
        groups = None if listed is None else listed.get(req.track)
        if groups is not None and layer < len(groups):
            group = groups[layer]
    req.listed = (manifest, layer, group)
    return req.listed


class RetrievalMixin(ConsumerCore):
    """Data requests, verification and placement; see the module docstring."""

    # --- start ---------------------------------------------------------------------------

    def _begin_retrieval(self, now: float) -> None:
        primary = self._primary
        assert primary is not None  # called when the primary's manifest is accepted
        blocks = primary.prefix_blocks
        self._table = ObjectTable(len(self.components), self.layers, blocks)
        self._phase = Phase.RETRIEVING
        self._disc_deadline = None
        self._last_progress = now
        self._reconcile(now)

    # --- deciding what to request ------------------------------------------------------------

    def _reconcile(self, now: float) -> None:
        """Request every missing Object that no active request covers, from the best source."""
        table, primary = self._table, self._primary
        if self._phase is not Phase.RETRIEVING or table is None or primary is None:
            return
        self._serve_from(primary, _MISSING, now)
        self._mark_unserved(primary, table)
        alternatives = sorted(
            (
                pub
                for pub in self._pubs.values()
                if pub is not primary
                and pub.state is PubState.ACCEPTED
                and pub.prefix_blocks >= table.blocks
            ),
            key=lambda pub: (-pub.prefix_blocks, pub.order),
        )
        for pub in alternatives:
            self._serve_from(pub, _GAPS, now)
        if table.count(ObjState.GAP) and self._uncovered_gaps(table):
            self._probe_alternative(now)
        if self._phase is not Phase.RETRIEVING:
            return
        if table.count(ObjState.GAP) == 0:
            self._recovery_deadline = None
        elif self._recovery_deadline is None:
            self._recovery_deadline = now + self.recovery_time_bound
        self._check_done(now)

    def _serve_from(self, pub: Publication, states: tuple[ObjState, ...], now: float) -> None:
        table, manifest = self._table, pub.versions.latest
        if table is None or manifest is None:
            return
        for seg in manifest.segments:
            if seg.first_block >= table.blocks:
                break
            start, end = seg.first_block, min(seg.end_block, table.blocks)
            if not self._pin_ok(pub, seg.first_block, seg.end_block):
                continue
            for ci in range(len(self.components)):
                track = self._track_name(ci, seg.segment)
                if track not in seg.tracks or self._pick_session(pub, seg.segment, ci) is None:
                    continue
                first_layer = next(
                    (
                        layer
                        for layer in self.layers
                        if self._uncovered(ci, layer, start, end, states)
                    ),
                    None,
                )
                if first_layer is None:
                    continue
                mode = self.config.retrieval
                live = mode is RetrievalMode.LIVE or (
                    mode is RetrievalMode.AUTO and not seg.complete
                )
                while (slot := self._pick_session(pub, seg.segment, ci)) is not None:
                    if self._issue(
                        pub, slot, seg.segment, seg.blocks, ci, track, start, end - start,
                        range(first_layer, self.layers.stop), live, now,
                    ):  # fmt: skip
                        break

    def _uncovered(
        self, ci: int, layer: int, start: int, end: int, states: tuple[ObjState, ...]
    ) -> list[int]:
        """Blocks of one row in ``states`` that no active request covers, ascending.

        Cheap when a request covers the whole range: then only the blocks it
        failed (a few) are candidates, so reconciling costs no scan of the row.
        """
        table = self._table
        assert table is not None
        reqs = [
            r for r in self._active[ci] if layer in r.layers and r.first < end and start < r.end
        ]
        full = [r for r in reqs if r.first <= start and end <= r.end]
        if full and states == _WANTED:
            return []  # a failed block is never WANTED (failing makes it a GAP)
        if full:
            candidates = set(full[0].failed.get(layer, ()))
            for r in full[1:]:
                candidates &= r.failed.get(layer, set())
            if not candidates:
                return []
            found = sorted(
                b for b in candidates if start <= b < end and table.get(ci, layer, b) in states
            )
        else:
            found = table.positions(ci, layer, start, end, states)
        if not reqs:
            return found
        return [b for b in found if not any(r.covers(layer, b) for r in reqs)]

    def _uncovered_gaps(self, table: ObjectTable) -> bool:
        return any(
            self._uncovered(ci, layer, 0, table.blocks, _GAPS)
            for ci in range(len(self.components))
            for layer in self.layers
        )

    def _mark_unserved(self, primary: Publication, table: ObjectTable) -> None:
        """Wanted Objects the primary cannot serve now are missing (GAP), unless their
        segment is simply not listed yet by a manifest that is still growing."""
        manifest = primary.versions.latest
        assert manifest is not None
        end = table.blocks if manifest.complete else min(manifest.total_blocks, table.blocks)
        for ci in range(len(self.components)):
            for layer in self.layers:
                for b in self._uncovered(ci, layer, 0, end, _WANTED):
                    table.set(ci, layer, b, ObjState.GAP)

    def _may_recover(self, req: DataRequest) -> bool:
        """Whether any source might serve what ``req`` failed to deliver (else a refused
        Object needs no full reconcile: a stream of refusals stays linear)."""
        if self._pick_session(req.pub, req.segment, req.ci) is not None:
            return True
        table = self._table
        assert table is not None
        for pub in self._pubs.values():
            if pub is req.pub or pub.prefix_blocks < table.blocks:
                continue
            if pub.state is PubState.CANDIDATE:
                return True  # its manifest can be asked for
            if (
                pub.state is PubState.ACCEPTED
                and self._pin_ok(pub, req.first, req.first + req.seg_blocks)
                and any(True for _ in self._usable_sessions(pub))
            ):
                return True
        return False

    def _pick_session(self, pub: Publication, segment: int, ci: int) -> SessionSlot | None:
        key = (pub.id, segment, ci)
        tried = self._tried.get(key, set()) | self._untrusted.get(key, set())
        busy = {r.session for r in self._active[ci] if r.key == key}
        for slot in self._usable_sessions(pub):
            if slot.index not in tried and slot.index not in busy:
                return slot
        return None

    def _pin_ok(self, pub: Publication, first: int, end: int, since: int = 0) -> bool:
        """Profile 5.4: no two publications in one segment unless both are deterministic.

        ``since``: only pins from that index on are checked (the earlier ones were).
        """
        pins = self._pins
        for i in range(since, len(pins)):
            pf, pe, pid = pins[i]
            if pid == pub.id or pe <= first or end <= pf:
                continue
            other = self._pubs.get(pid)
            if other is None or not (pub.deterministic and other.deterministic):
                return False
        return True

    def _req_pin_ok(self, req: DataRequest) -> bool:
        """``_pin_ok`` for a request's segment, checking each pin once per request: pins are
        only ever added, and whether two publications may mix never changes (both
        manifests' ``deterministic`` is fixed across versions)."""
        count = len(self._pins)
        if req.pins_ok == count:
            return True
        if not self._pin_ok(req.pub, req.first, req.first + req.seg_blocks, req.pins_ok):
            return False
        req.pins_ok = count
        return True

    def _pin(self, pub: Publication, first: int, end: int) -> None:
        entry = (first, end, pub.id)
        if entry not in self._pins:
            self._pins.append(entry)

    def _issue(
        self,
        pub: Publication,
        slot: SessionSlot,
        segment: int,
        seg_blocks: int,
        ci: int,
        track: str,
        first: int,
        n: int,
        layers: range,
        live: bool,
        now: float,
    ) -> bool:
        """Send one data request; False (and the session marked tried) if it refused."""
        session = slot.session
        filters: list[p.Parameter] = []
        if n < seg_blocks and session.peer_max_filter_ranges > 0:
            filters.append(p.RangeFilter(ParameterType.OBJECTID_FILTER, 0, ranges=((0, n - 1),)))
        name = pub.ns.full_track_name(track)
        prio = self.config.data_priority
        try:
            if live:
                rid = session.subscribe(
                    name,
                    now=now,
                    location_filter=p.LocationFilter.next_object(),
                    fill=p.Parameters.of(p.LocationFilter.absolute_start(layers.start, 0)),
                    priority=prio,
                    range_filters=filters,
                )
            else:
                rid = session.fetch(
                    name,
                    now=now,
                    location_filter=p.LocationFilter.absolute_group_end(
                        layers.start, 0, layers.stop - 1
                    ),
                    group_order=GroupOrder.ASCENDING,
                    priority=prio,
                    range_filters=filters,
                )
        except LocalProtocolError:
            self._tried.setdefault((pub.id, segment, ci), set()).add(slot.index)
            return False
        req = DataRequest(
            session=slot.index,
            request_id=rid,
            pub=pub,
            segment=segment,
            seg_blocks=seg_blocks,
            track=track,
            ci=ci,
            component=self.components[ci],
            first=first,
            n=n,
            layers=layers,
            live=live,
        )
        assert self._table is not None
        req.expected = self._table.missing_in(ci, layers, first, first + n)
        self._reqs[(slot.index, rid)] = req
        self._active[ci].append(req)
        return True

    # --- events of data requests ---------------------------------------------------------------

    def _on_data_event(
        self, slot: SessionSlot, req: DataRequest, event: ev.SessionEvent, now: float
    ) -> None:
        if isinstance(event, ev.ObjectReceived):
            self._on_data_object(slot, req, event, now)
            return
        if isinstance(event, ev.SubscribeAccepted):
            req.accepted = True
            req.largest = event.largest
            if req.fill_done:  # the fill's FIN overtook SUBSCRIBE_OK
                self._after_fill(req, now)
        elif isinstance(event, ev.FetchAccepted):
            req.accepted = True
        elif isinstance(event, ev.RangeMarkerReceived):
            if self._fail_range(req, event.location, req.last_fetch_loc):
                req.no_retry = True  # it does not have them: ask someone else
            req.last_fetch_loc = event.location
        elif isinstance(event, ev.DataStreamEnded):
            self._on_stream_ended(req, event, now)
        elif isinstance(event, ev.RequestFailed | ev.PublishDoneReceived):
            self._end_request(req, now, cancel=False, forget=True)
        else:
            return
        self._reconcile(now)

    def _on_stream_ended(self, req: DataRequest, event: ev.DataStreamEnded, now: float) -> None:
        if event.delivery is ev.Delivery.FETCH:
            self._end_request(req, now, cancel=False, forget=True)
        elif event.delivery is ev.Delivery.FILL:
            req.fill_done = True
            if req.accepted:
                self._after_fill(req, now)
        elif event.reset_code is not None and event.group_id is not None:
            layer = event.group_id  # a subgroup stream reset: the rest of that layer is lost
            if layer in req.layers and self._table is not None:
                for b in self._table.positions(req.ci, layer, req.first, req.end):
                    loc = Location(layer, b - req.first)
                    if req.largest is None or loc > req.largest:
                        self._fail_object(req, layer, b)

    def _after_fill(self, req: DataRequest, now: float) -> None:
        """The fill ended and SUBSCRIBE_OK's Largest Object is known (profile 5.2)."""
        if req.largest is not None:
            self._fail_range(req, req.largest, None)  # the fill carried all of these
            if req.largest >= Location(req.layers.stop - 1, req.n - 1):
                self._end_request(req, now, cancel=True, forget=True)  # nothing comes live
                return
        if req.end_of_track:
            self._end_request(req, now, cancel=False, forget=False)

    def _fail_range(self, req: DataRequest, upto: Location, after: Location | None) -> bool:
        """Objects of ``req`` in (after, upto] that are still missing will not come on it.

        Returns whether there was any.
        """
        table = self._table
        if table is None:
            return False
        hit = False
        for layer in req.layers:
            if layer > upto.group:
                break
            if after is not None and layer < after.group:
                continue
            for b in table.positions(req.ci, layer, req.first, req.end):
                loc = Location(layer, b - req.first)
                if loc > upto:
                    break
                if after is None or loc > after:
                    self._fail_object(req, layer, b)
                    hit = True
        return hit

    def _fail_object(self, req: DataRequest, layer: int, block: int) -> None:
        req.fail(layer, block)
        assert self._table is not None
        if self._table.get(req.ci, layer, block) is ObjState.WANTED:
            self._table.set(req.ci, layer, block, ObjState.GAP)

    def _end_request(self, req: DataRequest, now: float, *, cancel: bool, forget: bool) -> None:
        """The request will deliver nothing more that counts: what it still misses is missing."""
        if req.active:
            req.active = False
            self._active[req.ci].remove(req)
            table = self._table
            if table is not None:
                others = self._active[req.ci]
                for layer in req.layers:
                    for b in table.positions(req.ci, layer, req.first, req.end, (ObjState.WANTED,)):
                        if not any(r.covers(layer, b) for r in others):
                            table.set(req.ci, layer, b, ObjState.GAP)
            if req.progress and not req.no_retry:
                self._tried.pop(req.key, None)  # it made progress: it may be asked again
            else:
                self._tried.setdefault(req.key, set()).add(req.session)
        if forget or cancel:
            self._forget(req.session, req.request_id, now, cancel=cancel)

    def _on_data_object(
        self, slot: SessionSlot, req: DataRequest, event: ev.ObjectReceived, now: float
    ) -> None:
        """The per-Object path: verify, copy once into place, update the table."""
        loc = event.location
        if event.delivery is not _SUBSCRIPTION:
            req.last_fetch_loc = loc
        if event.status is not _NORMAL:
            if event.status is ObjectStatus.END_OF_TRACK:
                req.end_of_track = True  # profile 5.2: complete, once the fill is done too
                if not req.fill_pending and req.active:
                    self._end_request(req, now, cancel=False, forget=False)
                    self._reconcile(now)
            return
        table = self._table
        layer, oid = loc.group, loc.object
        block = req.first + oid
        state = None if table is None or oid >= req.n else table.state(req.ci, layer, block)
        if (
            state not in _MISSING
            or table is None  # (for the type checker: state is None without a table)
            or not self._req_pin_ok(req)
        ):
            self.excess_objects += 1
            return
        manifest = req.pub.versions.latest
        assert manifest is not None
        cache = req.listed
        if cache is None or cache[0] is not manifest or cache[1] != layer:
            cache = _listed_group(manifest, req, layer)
        group = cache[2]  # the Data Digests this version lists for the Group, if any
        listed = None if group is None or oid >= len(group) else bytes.fromhex(group[oid])
        block_tokens = self.block_tokens
        data_length = self.data_length
        payload = self._open_protected(req.pub, req.track, event)
        if isinstance(payload, Unopened):
            refused = ObjectVerdict(_PROTECTION_REASONS[payload.failure], None, payload.detail)
            self._on_refused(slot, req, refused, layer, oid, block, now)
            return
        verdict = check_object(
            payload,
            layer=layer,
            object_id=oid,
            component=req.component,
            codec=self.codec_value,
            block_tokens=block_tokens,
            token_start=block * block_tokens,
            listed_digest=listed,
            data_length=data_length,
        )
        if isinstance(verdict, ObjectVerdict):
            self._on_refused(slot, req, verdict, layer, oid, block, now)
            return
        if listed is None and req.pub.authenticated and manifest.segments[req.segment].complete:
            # a signed manifest that will never list this Object's digest: it cannot be shown
            # to be the producer's (a relay may have rewritten it and its Data Digest)
            unlisted = ObjectVerdict(
                DiscardReason.NOT_LISTED,
                None,
                "the verified manifest marks the segment complete without listing its digest",
            )
            self._on_refused(slot, req, unlisted, layer, oid, block, now)
            return
        # verified: the one copy, straight from the payload into the destination
        data, digest = verdict
        if self.destinations is not None:
            dest = self._dest_views.get((layer, req.ci))
            if dest is None:
                dest = self._dest_view(layer, req.ci, table.blocks)
            offset = block * data_length
            dest[offset : offset + data_length] = data
        else:
            self._views[(req.ci, layer, block)] = data
        if not req.pinned:
            self._pin(req.pub, req.first, req.first + req.seg_blocks)
            req.pinned = True
        held = False
        if listed is None:
            final = manifest.segments[req.segment].complete  # its digests will never be listed
            held = self._hold(req.pub) and not final
            if not final:
                entries = self._unlisted.setdefault((req.pub.id, req.track, layer), {})
                entries[oid] = (req.ci, block, digest, slot.index)
        if table.set(req.ci, layer, block, _HELD if held else _READY):
            self._emit(LayerReady(layer=layer))
        req.progress += 1
        self._last_progress = now
        if state is _GAP:
            self._recovery_deadline = now + self.recovery_time_bound if table.count(_GAP) else None
        if (
            req.active
            and req.progress >= req.expected
            and table.missing_in(req.ci, req.layers, req.first, req.end) == 0
        ):
            self._end_request(req, now, cancel=True, forget=True)
        if not table.unsettled:
            self._check_done(now)

    def _on_refused(
        self,
        slot: SessionSlot,
        req: DataRequest,
        verdict: ObjectVerdict,
        layer: int,
        oid: int,
        block: int,
        now: float,
    ) -> None:
        """An Object failed verification: report it, never use it, it is missing."""
        self._emit(
            ObjectDiscarded(
                reason=verdict.reason,
                check=verdict.check,
                detail=verdict.detail,
                publication_id=req.pub.id,
                track=req.track,
                layer=layer,
                block=oid,
                session=slot.index,
            )
        )
        self._fail_object(req, layer, block)
        req.no_retry = True
        self._distrust(req.key, req.session)
        if self._may_recover(req):
            self._reconcile(now)
        elif self._recovery_deadline is None:
            self._recovery_deadline = now + self.recovery_time_bound
