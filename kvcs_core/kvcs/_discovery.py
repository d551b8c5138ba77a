"""Consumer mixin: discovering publications and accepting their manifests (profile 5.1, 3.6).

Theory of operation
-------------------
*Discovery* (profile 5.1). For the longest prefix it wants (all full blocks of
the prompt, ``m``), the consumer sends SUBSCRIBE_NAMESPACE for ``("kvcs-1",
Scope ID, Compatibility ID, K_(m-1))`` on every attached session; each NAMESPACE
names one publication. When nothing usable is announced within
``discovery_timeout`` it tries the next shorter prefix of its list (the Anchor
Key of a shorter prefix is an earlier Block Key); the earlier subscriptions
stay open, so a late announcement is still seen. The timeout counts from the
relay's answer to the prefix's SUBSCRIBE_NAMESPACE (REQUEST_OK or REQUEST_ERROR;
the announcements of publications it knows come with it), not from the request: a
request still unanswered is awaited up to ``discovery_answer_timeout`` (2 s) after
it was sent, as the index search's lookups are, so a round trip longer than the
timeout does not make the consumer skip the prefix that is published. The profile does not say which
shorter prefixes to try; the default list is ``m``, then the largest power of
two below ``m``, then halving, at most ``max_discovery_prefixes`` entries (so
discovery ends within that many timeouts); the application may pass its own
list (for instance the length of a known system prompt). A longer publication,
whose Anchor Key the consumer cannot compute, is found through the KVSP index
(``_index_search``, binding 9: after the whole prompt, before the shorter
prefixes) or added by the application (``add_publication``).

*Selection.* The publication with the longest prefix is chosen, earliest
announced first (:class:`PublicationSelected`). Others are kept, up to
``max_publications``, as alternatives for recovery (profile 5.4).

*Manifest* (profile 5.2, 3.6). SUBSCRIBE ``manifest.cose`` with Next Object and
FILL_PARAMETERS{Relative Start 1}: the fill carries the current version, the
subscription the later ones. REQUEST_ERROR DOES_NOT_EXIST means the publication
is unsigned: refused when authenticity is required (``UNSIGNED``), else the
consumer subscribes ``manifest``. A version that does not verify or parse may
be a relay's doing, so the next session that announced the publication is
tried; a version that verifies but does not fit (Compatibility ID, Block Keys,
tracks) rejects the publication. A version that arrives after the first one was
accepted and fails is dropped (:class:`ManifestDiscarded`) and the publication
stays. Each manifest attempt is bounded by ``manifest_timeout``.
"""

from __future__ import annotations

from kvcs_core.kvcs._consumer_core import (
    ConsumerCore,
    ManifestRequest,
    NamespaceRequest,
    Phase,
    Publication,
    PubState,
    SessionSlot,
)
from kvcs_core.kvcs._consumer_events import (
    ManifestAccepted,
    ManifestDiscarded,
    ManifestRejectReason,
    PublicationRejected,
    PublicationSelected,
    RecomputeNeeded,
    RecomputeReason,
)
from kvcs_core.kvcs._verify import Refusal, open_manifest, parse_and_check
from kvcs_core.kvcs.cose import DEFAULT_MAX_COSE_BYTES
from kvcs_core.kvcs.manifest import DEFAULT_MAX_MANIFEST_BYTES, VersionRejected, VersionRejectReason
from kvcs_core.kvcs.names import MANIFEST_COSE_TRACK, MANIFEST_TRACK, KvcsNamespace, content_prefix
from kvcs_core.kvcs.protection import ProtectionFailure, Unopened
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.wire import params as p
from kvcs_core.wire.codes import ObjectStatus, RequestErrorCode
from kvcs_core.wire.names import TrackNamespace

_RETRY_ELSEWHERE = (
    ManifestRejectReason.BAD_SIGNATURE,
    ManifestRejectReason.MALFORMED_MANIFEST,
    ManifestRejectReason.DECRYPTION_FAILED,
    ManifestRejectReason.NOT_PROTECTED,
)
"""Refusals a relay could have caused: ask the next session before giving up."""


def default_prefixes(blocks: int, limit: int) -> tuple[int, ...]:
    """``blocks``, the largest power of two below it, then halving; at most ``limit``."""
    out = [blocks]
    step = 1 << (blocks.bit_length() - 1)
    if step == blocks:
        step //= 2
    while step >= 1 and len(out) < limit:
        out.append(step)
        step //= 2
    return tuple(out)


class DiscoveryMixin(ConsumerCore):
    """Discovery, publication choice and manifests; see the module docstring."""

    # --- discovery ---------------------------------------------------------------------

    def _on_session_ready(self, slot: SessionSlot, now: float) -> None:
        self._index_session_ready(slot, now)
        if self._phase is Phase.DISCOVERING:
            if self._disc_pos < 0:
                self._advance_discovery(now)
            else:
                self._send_namespace(slot, self.prefixes[self._disc_pos], now)
            self._retry_pending_manifests(now)
        elif self._phase is Phase.RETRIEVING and self._table is not None:
            self._send_namespace(slot, self._table.blocks, now)
            self._retry_pending_manifests(now)
            self._reconcile(now)

    def _advance_discovery(self, now: float) -> None:
        if self._index_takes_over(now):
            return
        self._disc_pos += 1
        if self._disc_pos >= len(self.prefixes):
            self._disc_deadline = None
            self._no_publication(now)
            return
        prefix = self.prefixes[self._disc_pos]
        self._disc_progress = now
        self._disc_unanswered = {}
        self._disc_deadline = now + self.config.discovery_timeout
        for slot in self._sessions:
            if slot.usable:
                self._send_namespace(slot, prefix, now)

    def _send_namespace(self, slot: SessionSlot, prefix_blocks: int, now: float) -> None:
        if prefix_blocks in slot.namespaces or not slot.usable:
            return
        ns = content_prefix(self.scope_id, self.compat_id, self.block_keys[prefix_blocks - 1])
        try:
            rid = slot.session.subscribe_namespace(ns, now=now)
        except LocalProtocolError:
            return  # e.g. the peer sent GOAWAY meanwhile: this session is not asked
        slot.namespaces[prefix_blocks] = rid
        self._reqs[(slot.index, rid)] = NamespaceRequest(slot.index, rid, prefix_blocks)
        if self._waits_on(prefix_blocks):
            self._disc_unanswered[(slot.index, rid)] = now
            self._set_disc_deadline()

    # --- the wait of the prefix being tried ---------------------------------------------------

    def _waits_on(self, prefix_blocks: int) -> bool:
        """Whether ``prefix_blocks`` is the direct prefix whose wait is running."""
        return (
            self._phase is Phase.DISCOVERING
            and self._disc_deadline is not None
            and 0 <= self._disc_pos < len(self.prefixes)
            and self.prefixes[self._disc_pos] == prefix_blocks
        )

    def _set_disc_deadline(self) -> None:
        """``discovery_timeout`` after the last answer to the prefix's requests (or its
        start), and never before an unanswered one had ``discovery_answer_timeout``."""
        deadline = self._disc_progress + self.config.discovery_timeout
        if self._disc_unanswered:
            sent = max(self._disc_unanswered.values())
            deadline = max(deadline, sent + self.config.discovery_answer_timeout)
        self._disc_deadline = deadline

    def _disc_answered(self, key: tuple[int, int], req: NamespaceRequest, now: float) -> None:
        if self._disc_unanswered.pop(key, None) is not None and self._waits_on(req.prefix_blocks):
            self._disc_progress = max(self._disc_progress, now)
            self._set_disc_deadline()

    # --- hooks of the index search (``_index_search``) -------------------------------------

    def _index_takes_over(self, now: float) -> bool:
        """True when the index search runs instead of the next direct prefix."""
        return False

    def _index_session_ready(self, slot: SessionSlot, now: float) -> None:
        """A session became usable (the index search may ask it too)."""

    def _index_holds_selection(self, now: float) -> bool:
        """True while the index search runs: the longest publication is chosen at its end."""
        return False

    def _discovery_timer(self, now: float) -> None:
        if self._disc_deadline is None or self._disc_deadline > now:
            return
        self._disc_deadline = None
        if not self._waiting_for_candidate():
            self._advance_discovery(now)
        # else: a manifest is pending; its acceptance or rejection decides

    def _waiting_for_candidate(self) -> bool:
        return any(
            pub.state in (PubState.CANDIDATE, PubState.MANIFEST_PENDING)
            for pub in self._pubs.values()
        )

    def _no_publication(self, now: float) -> None:
        if self._phase is not Phase.DISCOVERING:
            return
        self._emit(
            RecomputeNeeded(
                reason=RecomputeReason.NO_PUBLICATION,
                layers=tuple(self.layers),
                blocks=tuple(range(len(self.block_keys))),
            )
        )
        self._finish(now, complete=False)

    # --- announcements -------------------------------------------------------------------

    def _on_namespace_event(
        self, slot: SessionSlot, req: NamespaceRequest, event: ev.SessionEvent, now: float
    ) -> None:
        if isinstance(event, ev.NamespaceAnnounced):
            self._on_announced(slot, req, event.namespace, now)
        elif isinstance(event, ev.RequestAccepted):
            self._disc_answered((slot.index, req.request_id), req, now)
        elif isinstance(event, ev.NamespaceWithdrawn):
            kns = KvcsNamespace.try_parse(event.namespace)
            pub = None if kns is None else self._pubs.get(kns.publication_id)
            if pub is not None and slot.index in pub.sessions:
                pub.sessions.remove(slot.index)
        elif isinstance(event, ev.RequestFailed):
            self._reqs.pop((slot.index, req.request_id), None)
            self._disc_answered((slot.index, req.request_id), req, now)

    def _on_announced(
        self, slot: SessionSlot, req: NamespaceRequest, namespace: TrackNamespace, now: float
    ) -> None:
        kns = KvcsNamespace.try_parse(namespace)
        if (
            kns is None
            or kns.scope_id != self.scope_id
            or kns.compat_id != self.compat_id
            or kns.anchor_key != self.block_keys[req.prefix_blocks - 1]
        ):
            return  # not a KVCS namespace of our prefix (binding 4): ignored
        pub = self._pubs.get(kns.publication_id)
        if pub is None:
            if len(self._pubs) >= self.config.max_publications:
                return
            pub = Publication(kns, req.prefix_blocks, order=len(self._pubs))
            self._pubs[kns.publication_id] = pub
        if slot.index not in pub.sessions:
            pub.sessions.append(slot.index)
        if self._phase is Phase.DISCOVERING:
            self._select_primary(now)
        elif self._phase is Phase.RETRIEVING:
            if pub.state is PubState.ACCEPTED and pub.manifest_req is None:
                self._resubscribe_manifest(pub, now)  # a new session to follow it on
            self._reconcile(now)

    def _add_known(self, kns: KvcsNamespace, blocks: int, now: float) -> None:
        pub = self._pubs.get(kns.publication_id)
        if pub is None:
            if len(self._pubs) >= self.config.max_publications:
                raise LocalProtocolError(
                    f"already {self.config.max_publications} publications (max_publications)"
                )
            pub = Publication(kns, blocks, order=len(self._pubs), any_session=True)
            self._pubs[kns.publication_id] = pub
        else:
            pub.any_session = True
            if pub.state is PubState.CANDIDATE:
                pub.prefix_blocks = max(pub.prefix_blocks, blocks)
        if self._phase is Phase.DISCOVERING:
            self._select_primary(now)
        elif self._phase is Phase.RETRIEVING:
            self._reconcile(now)

    # --- choosing publications -------------------------------------------------------------

    def _best_candidate(self, min_blocks: int) -> Publication | None:
        cands = [
            pub
            for pub in self._pubs.values()
            if pub.state is PubState.CANDIDATE and pub.prefix_blocks >= min_blocks
        ]
        return max(cands, key=lambda pub: (pub.prefix_blocks, -pub.order), default=None)

    def _select_primary(self, now: float) -> None:
        if self._phase is not Phase.DISCOVERING or self._index_holds_selection(now):
            return
        if self._primary is not None and self._primary.state is PubState.MANIFEST_PENDING:
            return
        best = self._best_candidate(1)
        if best is None:
            if self._disc_pos >= 0 and self._disc_deadline is None:
                self._advance_discovery(now)  # this prefix's time is over
            return
        self._primary = best
        self._emit(
            PublicationSelected(
                publication_id=best.id,
                namespace=best.ns.to_track_namespace(),
                blocks=best.prefix_blocks,
                primary=True,
            )
        )
        self._request_manifest(best, now)

    def _probe_alternative(self, now: float) -> None:
        """Start verifying the next alternative publication (profile 5.4), one at a time."""
        if self._table is None or any(
            pub.state is PubState.MANIFEST_PENDING for pub in self._pubs.values()
        ):
            return
        best = self._best_candidate(self._table.blocks)
        if best is None:
            return
        self._emit(
            PublicationSelected(
                publication_id=best.id,
                namespace=best.ns.to_track_namespace(),
                blocks=self._table.blocks,
                primary=False,
            )
        )
        self._request_manifest(best, now)

    # --- manifests ---------------------------------------------------------------------------

    def _request_manifest(self, pub: Publication, now: float) -> None:
        pub.state = PubState.MANIFEST_PENDING
        if self._subscribe_manifest(pub, now):
            return
        candidates = range(len(self._sessions)) if pub.any_session else pub.sessions
        if any(
            not s.closed and not s.session.is_closed and not s.session.setup_complete
            for s in (self._sessions[i] for i in candidates)
        ):
            if pub.manifest_deadline is None:  # wait for a session still setting up
                pub.manifest_deadline = now + self.config.manifest_timeout
            return
        problem = pub.problem or Refusal(
            ManifestRejectReason.NO_MANIFEST, "no session left to ask for the manifest"
        )
        self._reject(pub, problem, now)

    def _subscribe_manifest(self, pub: Publication, now: float) -> bool:
        """SUBSCRIBE the manifest track on the next untried session; False if none."""
        for slot in self._usable_sessions(pub):
            if slot.index in pub.manifest_tried:
                continue
            name = MANIFEST_COSE_TRACK if pub.signed else MANIFEST_TRACK
            try:
                rid = slot.session.subscribe(
                    pub.ns.full_track_name(name),
                    now=now,
                    location_filter=p.LocationFilter.next_object(),
                    fill=p.Parameters.of(p.LocationFilter.relative_start(1)),
                    priority=self.config.manifest_priority,
                )
            except LocalProtocolError:
                pub.manifest_tried.add(slot.index)
                continue
            req = ManifestRequest(slot.index, rid, pub, pub.signed)
            pub.manifest_req = req
            self._reqs[(slot.index, rid)] = req
            if pub.state is PubState.MANIFEST_PENDING:
                pub.manifest_deadline = now + self.config.manifest_timeout
            return True
        return False

    def _retry_pending_manifests(self, now: float) -> None:
        for pub in list(self._pubs.values()):
            if pub.state is PubState.MANIFEST_PENDING and pub.manifest_req is None:
                self._request_manifest(pub, now)
            elif pub.state is PubState.ACCEPTED and pub.manifest_req is None:
                self._resubscribe_manifest(pub, now)

    def _resubscribe_manifest(self, pub: Publication, now: float) -> None:
        """Keep following later versions of an accepted, still incomplete manifest."""
        latest = pub.versions.latest
        if self._phase is Phase.RETRIEVING and latest is not None and not latest.complete:
            self._subscribe_manifest(pub, now)

    def _manifest_source_failed(self, pub: Publication, now: float, problem: Refusal) -> None:
        req = pub.manifest_req
        if req is not None:
            pub.manifest_tried.add(req.session)
            self._forget(req.session, req.request_id, now, cancel=True)
            pub.manifest_req = None
        if pub.state is PubState.ACCEPTED:
            self._resubscribe_manifest(pub, now)
            return
        pub.problem = problem
        self._request_manifest(pub, now)

    def _manifest_timers(self, now: float) -> None:
        for pub in list(self._pubs.values()):
            if (
                pub.state is PubState.MANIFEST_PENDING
                and pub.manifest_deadline is not None
                and pub.manifest_deadline <= now
            ):
                pub.manifest_deadline = None
                problem = Refusal(
                    ManifestRejectReason.NO_MANIFEST,
                    f"no acceptable manifest within {self.config.manifest_timeout} s",
                )
                if pub.manifest_req is None:
                    self._reject(pub, pub.problem or problem, now)
                else:
                    self._manifest_source_failed(pub, now, problem)

    def _manifest_deadlines(self) -> list[float]:
        return [
            pub.manifest_deadline
            for pub in self._pubs.values()
            if pub.state is PubState.MANIFEST_PENDING and pub.manifest_deadline is not None
        ]

    def _on_manifest_event(
        self, slot: SessionSlot, req: ManifestRequest, event: ev.SessionEvent, now: float
    ) -> None:
        pub = req.pub
        if isinstance(event, ev.ObjectReceived):
            self._on_manifest_object(pub, req, event, now)
        elif isinstance(event, ev.RequestFailed):
            self._reqs.pop((slot.index, req.request_id), None)
            if pub.manifest_req is req:
                pub.manifest_req = None
            if pub.state is PubState.REJECTED:
                return
            if req.signed and event.code == RequestErrorCode.DOES_NOT_EXIST:
                if self.require_authenticity:
                    self._reject(
                        pub,
                        Refusal(ManifestRejectReason.UNSIGNED, "manifest.cose does not exist"),
                        now,
                    )
                    return
                pub.signed = False  # profile 5.2: only then try "manifest"
                if pub.state is PubState.MANIFEST_PENDING:
                    self._request_manifest(pub, now)
                return
            pub.manifest_tried.add(slot.index)
            problem = Refusal(ManifestRejectReason.NO_MANIFEST, f"refused: {event.reason}")
            if pub.state is PubState.ACCEPTED:
                self._resubscribe_manifest(pub, now)
            else:
                pub.problem = problem
                self._request_manifest(pub, now)
        elif isinstance(event, ev.PublishDoneReceived):
            self._reqs.pop((slot.index, req.request_id), None)
            if pub.manifest_req is req:
                pub.manifest_req = None
                if pub.state is PubState.MANIFEST_PENDING:
                    pub.manifest_tried.add(slot.index)
                    self._request_manifest(pub, now)
                elif pub.state is PubState.ACCEPTED:  # ended before the manifest is complete:
                    pub.manifest_tried.add(slot.index)  # follow it elsewhere (held Objects)
                    self._resubscribe_manifest(pub, now)

    def _on_manifest_object(
        self, pub: Publication, req: ManifestRequest, event: ev.ObjectReceived, now: float
    ) -> None:
        if event.status is not ObjectStatus.NORMAL or event.location.object != 0:
            return  # End of Group / End of Track, or not a version (profile 3.6: Object 0)
        if pub.state is PubState.REJECTED or pub.manifest_req is not req:
            return
        version = event.location.group
        latest = pub.versions.latest_group
        if latest is not None and version <= latest:
            return  # the fill and the subscription may both carry a version
        payload = self._open_protected(
            pub, MANIFEST_COSE_TRACK if req.signed else MANIFEST_TRACK, event
        )
        if isinstance(payload, Unopened):
            reason = (
                ManifestRejectReason.NOT_PROTECTED
                if payload.failure is ProtectionFailure.NOT_PROTECTED
                else ManifestRejectReason.DECRYPTION_FAILED
            )
            self._manifest_refused(pub, version, Refusal(reason, payload.detail), now)
            return
        opened = open_manifest(
            payload,
            signed=req.signed,
            keys=self.producer_keys,
            require_authenticity=self.require_authenticity,
            max_size=DEFAULT_MAX_COSE_BYTES,
        )
        if isinstance(opened, Refusal):
            self._manifest_refused(pub, version, opened, now)
            return
        blocks = pub.prefix_blocks if self._table is None else self._table.blocks
        checked = parse_and_check(
            opened.json,
            namespace=pub.ns,
            block_keys=self.block_keys,
            blocks=blocks,
            track_names=[c.token for c in self.components],
            codec=self.selection.codec,
            max_size=DEFAULT_MAX_MANIFEST_BYTES,
        )
        if isinstance(checked, Refusal):
            self._manifest_refused(pub, version, checked, now)
            return
        offered = pub.versions.offer(version, checked)
        if isinstance(offered, VersionRejected):
            if offered.reason is VersionRejectReason.INCONSISTENT:
                refusal = Refusal(ManifestRejectReason.INCONSISTENT_VERSION, offered.detail)
                self._manifest_refused(pub, version, refusal, now)
            return
        first = pub.state is not PubState.ACCEPTED
        pub.state = PubState.ACCEPTED
        pub.manifest_deadline = None
        pub.authenticated = opened.authenticated
        self._last_progress = now
        self._emit(
            ManifestAccepted(
                publication_id=pub.id,
                version=version,
                authenticated=opened.authenticated,
                complete=checked.complete,
            )
        )
        if first and pub is self._primary and self._phase is Phase.DISCOVERING:
            self._begin_retrieval(now)
        elif self._phase is Phase.RETRIEVING:
            self._recheck_unlisted(pub, now)
            self._reconcile(now)

    def _manifest_refused(
        self, pub: Publication, version: int, refusal: Refusal, now: float
    ) -> None:
        if pub.state is PubState.ACCEPTED:
            self._emit(
                ManifestDiscarded(
                    publication_id=pub.id,
                    version=version,
                    reason=refusal.reason,
                    detail=refusal.detail,
                )
            )
        elif refusal.reason in _RETRY_ELSEWHERE:
            self._manifest_source_failed(pub, now, refusal)
        else:
            self._reject(pub, refusal, now)

    def _reject(self, pub: Publication, refusal: Refusal, now: float) -> None:
        if pub.state is PubState.REJECTED:
            return
        pub.state = PubState.REJECTED
        pub.manifest_deadline = None
        req = pub.manifest_req
        if req is not None:
            self._forget(req.session, req.request_id, now, cancel=True)
            pub.manifest_req = None
        self._emit(
            PublicationRejected(publication_id=pub.id, reason=refusal.reason, detail=refusal.detail)
        )
        if self._phase is Phase.DISCOVERING and pub is self._primary:
            self._primary = None
            self._select_primary(now)
        elif self._phase is Phase.RETRIEVING:
            self._reconcile(now)
