"""Consumer mixin: late digest checks, time bounds and the end (profile 3.6, 5.4).

Theory of operation
-------------------
*Late digests* (profile 3.6). During production a manifest version lists the
digests of the layers completed so far, so an Object may be verified before
its digest is listed (its own Data Digest is checked at once). Such Objects are
remembered; each later version of their publication is compared with them: a
listed digest that differs makes the Object missing again
(:class:`ObjectDiscarded` ``LISTED_DIGEST_MISMATCH``), the request that
delivered it no longer covers it and its session is never asked for that track
again, so recovery starts at once from another source. Objects of a publication
whose manifest a producer key verified are not usable (HELD) until a version
lists their digest, so a relay's self-consistent forgery (Data and Data Digest
both rewritten) is never reported usable; if the segment becomes complete
without listing it, it is refused (``NOT_LISTED``). With ``hold_until_listed``
the Objects of an unauthenticated publication are HELD too, and released when
the segment is complete without digests.

*Time bounds* (profile 5.4 "It does not wait indefinitely"). Two clocks:

* stall: when data requests are open (or Objects HELD) and nothing was verified
  (and no manifest version accepted) for ``stall_timeout``, every open data
  request is failed and cancelled, the manifest subscription moves to another
  session if there is one (HELD Objects then wait one more ``stall_timeout`` for
  its versions; otherwise, or on a second stall in a row, they become missing),
  and recovery starts;
* recovery: from the first missing Object on, ``recovery_time_bound`` runs; each
  recovered Object restarts it, so recovery that makes progress continues, and
  recovery that does not is bounded. When it passes, every missing Object is
  abandoned and listed (layers and blocks) in :class:`RecomputeNeeded`.

*The end.* When no needed Object is missing or held, :class:`RetrievalComplete`
says whether everything arrived, and every request of the consumer (data,
manifest and namespace subscriptions) is cancelled.
"""

from __future__ import annotations

from kvcs_core.kvcs._consumer_core import ConsumerCore, ObjState, Phase, Publication, PubState
from kvcs_core.kvcs._consumer_events import (
    DiscardReason,
    LayerReady,
    ObjectDiscarded,
    RecomputeNeeded,
    RecomputeReason,
    RetrievalComplete,
)


class RecoveryMixin(ConsumerCore):
    """Late digest checks, the stall and recovery clocks, and the end."""

    # --- later manifest versions ---------------------------------------------------------------

    def _recheck_unlisted(self, pub: Publication, now: float) -> None:
        """Compare Objects verified before their digest was listed with a new version."""
        table, manifest = self._table, pub.versions.latest
        if table is None or manifest is None:
            return
        for key in [k for k in self._unlisted if k[0] == pub.id]:
            _, track, layer = key
            seg = manifest.segment_of_track(track)
            if seg is None:
                continue
            groups = seg.completed_groups(track)
            listed_now = groups is not None and layer < groups
            if not listed_now and not seg.complete:
                continue
            for oid, (ci, block, digest, session) in self._unlisted.pop(key).items():
                state = table.get(ci, layer, block)
                if state not in (ObjState.HELD, ObjState.READY):
                    continue
                listed = manifest.digest_of(track, layer, oid) if listed_now else None
                if listed == digest or (listed is None and not pub.authenticated):
                    if state is ObjState.HELD and table.set(ci, layer, block, ObjState.READY):
                        self._emit(LayerReady(layer=layer))
                    continue
                version = pub.versions.latest_group
                reason, detail = (
                    (DiscardReason.LISTED_DIGEST_MISMATCH, f"manifest version {version} lists "
                     f"another digest (Data Digest {digest.hex()[:16]}...)")
                    if listed is not None
                    else (DiscardReason.NOT_LISTED, f"manifest version {version} marks the "
                          "segment complete without listing its digest")
                )  # fmt: skip
                self._emit(
                    ObjectDiscarded(
                        reason=reason,
                        check=None,
                        detail=detail,
                        publication_id=pub.id,
                        track=track,
                        layer=layer,
                        block=oid,
                        session=session,
                    )
                )
                self._views.pop((ci, layer, block), None)
                table.set(ci, layer, block, ObjState.GAP)
                self._distrust((pub.id, seg.segment, ci), session)  # it served this: never again
                for req in self._active[ci]:  # what it delivered was wrong: not covered now
                    if req.pub is pub and req.track == track and req.covers(layer, block):
                        req.fail(layer, block)
                        req.no_retry = True
                        self._tried.setdefault(req.key, set()).add(req.session)
        self._check_done(now)

    # --- timers -------------------------------------------------------------------------

    def _stall_deadline(self) -> float | None:
        table = self._table
        if self._phase is not Phase.RETRIEVING or table is None:
            return None
        if any(self._active) or table.count(ObjState.HELD):
            return self._last_progress + self.config.stall_timeout
        return None

    def _on_stall(self, now: float) -> None:
        """Nothing verified for ``stall_timeout``: fail every active request (bounded waits).

        A session that went silent (a relay killed without a close) is not asked again
        for the same objects while another session could be: its requests count as
        failed there even if they had delivered part of the cache before.
        """
        table = self._table
        assert table is not None
        for reqs in self._active:
            for req in list(reqs):
                if sum(1 for _ in self._usable_sessions(req.pub)) > 1:
                    req.no_retry = True
                self._end_request(req, now, cancel=True, forget=True)
        moved = [pub.id for pub in list(self._pubs.values()) if self._move_manifest(pub, now)]
        again = self._last_stall is not None and self._last_stall == self._last_progress
        for ci, layer, b in list(table.each(ObjState.HELD)):
            # a HELD Object waits for the manifest; it gets one more chance when the
            # manifest subscription moved, unless this stall follows one without progress
            if again or not moved:
                self._views.pop((ci, layer, b), None)
                table.set(ci, layer, b, ObjState.GAP)
        self._last_progress = self._last_stall = now
        self._reconcile(now)

    def _move_manifest(self, pub: Publication, now: float) -> bool:
        """A stall: the manifest subscription delivered no version either, so follow the
        manifest on another session if there is one (held Objects wait for its versions);
        whether it moved."""
        req = pub.manifest_req
        latest = pub.versions.latest
        if pub.state is not PubState.ACCEPTED or latest is None or latest.complete:
            return False
        others = [
            s.index for s in self._usable_sessions(pub) if req is None or s.index != req.session
        ]
        if not others:
            return False
        if req is not None:
            self._forget(req.session, req.request_id, now, cancel=True)
            pub.manifest_req = None
            pub.manifest_tried.add(req.session)
        if pub.manifest_tried.issuperset(others):  # each was tried once: try them again
            pub.manifest_tried.difference_update(others)
        self._retry_pending_manifests(now)
        return pub.manifest_req is not None

    def _on_recovery_timeout(self, now: float) -> None:
        table = self._table
        assert table is not None
        lost = list(table.each(ObjState.GAP))
        for ci, layer, b in lost:
            table.set(ci, layer, b, ObjState.ABANDONED)
        self._recovery_deadline = None
        if lost:
            self._emit(
                RecomputeNeeded(
                    reason=RecomputeReason.RECOVERY_TIMEOUT,
                    layers=tuple(sorted({layer for _, layer, _ in lost})),
                    blocks=tuple(sorted({b for _, _, b in lost})),
                )
            )
        for reqs in self._active:
            for req in list(reqs):
                if table.missing_in(req.ci, req.layers, req.first, req.end) == 0:
                    self._end_request(req, now, cancel=True, forget=True)
        self._reconcile(now)

    # --- the end ------------------------------------------------------------------------

    def _check_done(self, now: float) -> None:
        table = self._table
        if self._phase is Phase.RETRIEVING and table is not None and table.unsettled == 0:
            self._finish(now, complete=table.count(ObjState.ABANDONED) == 0)

    def _finish(self, now: float, *, complete: bool) -> None:
        """Emit RetrievalComplete and close every request of ours."""
        if self._phase is Phase.DONE:
            return
        self._phase = Phase.DONE
        for (session, rid), _req in list(self._reqs.items()):
            self._forget(session, rid, now, cancel=True)
        for reqs in self._active:
            for req in reqs:
                req.active = False
            reqs.clear()
        for pub in self._pubs.values():
            pub.manifest_req = None
            pub.manifest_deadline = None
        self._disc_deadline = None
        self._recovery_deadline = None
        table, primary = self._table, self._primary
        self._emit(
            RetrievalComplete(
                publication_id=primary.id if primary is not None and table is not None else None,
                blocks=0 if table is None else table.blocks,
                layers=self.layers,
                complete=complete,
            )
        )
