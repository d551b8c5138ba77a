"""Publisher side of the KVSP index over MOQT (binding 9): announce and serve records.

Theory of operation
-------------------
:class:`IndexAnnouncer` belongs to one :class:`~kvcs_core.kvcs.publisher.KvcsPublisher`.
At construction it builds, for every indexed block ``i`` of the publication
(:func:`~kvcs_core.kvcs.index.index_block_indices`: every ``stride``-th prefix
length and the last block), the index namespace ``("kvcs-idx-1", Scope ID,
Compatibility ID, K_i, P)`` and a one-object track in it: ``replica`` (the record
JSON) or, when the publisher signs its manifest, ``replica.cose`` (the same
:class:`~kvcs_core.kvcs.publisher.ManifestSigner`, the same COSE_Sign1 rules).
The record is Object 0 of Group 0 (the only Group), so that a subscriber's fill
(Relative Start 1: the largest Group) and a FETCH both deliver it. A record never
changes, so no End of Track follows and the publisher does not end a
subscription: the subscriber cancels it once it has the record (a relay may keep
its own upstream subscription and serve later lookups from its cache).

Serving follows the publisher's own rules: :meth:`IndexAnnouncer.attach` sends
one PUBLISH_NAMESPACE per index namespace (each is a request of its own, so the
relay's per-session request limit, ``max_concurrent_peer_requests`` 1024 by
default, bounds how many blocks one session can index);
:meth:`IndexAnnouncer.handle_session_event` answers SUBSCRIBE / FETCH /
TRACK_STATUS in those namespaces from the stores (another track:
DOES_NOT_EXIST), and announces the covered namespaces on a SUBSCRIBE_NAMESPACE;
:meth:`IndexAnnouncer.withdraw` cancels the PUBLISH_NAMESPACEs (the namespaces
also go when the session ends). Memory: one record (about 400 octets, or 500
signed) and one small store per indexed block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Final

import attrs

from kvcs_core.kvcs._answering import answer_from_store
from kvcs_core.kvcs._production import ManifestSigner
from kvcs_core.kvcs.index import (
    IndexRecord,
    encode_record,
    index_block_indices,
)
from kvcs_core.kvcs.names import KvcsNamespace
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.errors import LocalProtocolError
from kvcs_core.moqt.requests import RequestState
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.moqt.track_store import TrackStore
from kvcs_core.wire.names import TrackNamespace

_RECORD_PRIORITY: Final = 0


@attrs.define(eq=False)
class _IndexAttachment:
    session: MoqtSession
    publish_ids: dict[int, TrackNamespace] = attrs.field(factory=dict)
    """Request ID of each PUBLISH_NAMESPACE -> the index namespace."""
    accepted: int = 0
    refused: int = 0
    served: set[int] = attrs.field(factory=set)
    """Requests of the peer we serve or announced on (to claim their later events)."""


class IndexAnnouncer:
    """The index namespaces and replica records of one publication (module docstring).

    Args:
        namespace: the publication's namespace.
        block_keys: its Block Keys ``K_0 .. K_(n-1)`` (``n``: its blocks).
        stride: index every ``stride``-th prefix length and the last block (>= 1).
        signer: sign the records (``replica.cose``); None: ``replica``.
        holder: optional ``"holder"`` member (an MOQT URI of a relay serving it).
    """

    def __init__(
        self,
        namespace: KvcsNamespace,
        block_keys: Sequence[bytes],
        *,
        stride: int,
        signer: ManifestSigner | None,
        holder: str | None = None,
    ) -> None:
        if not isinstance(stride, int) or stride < 1:
            raise ValueError("index stride must be an integer >= 1")
        blocks = len(block_keys)
        self.stride: Final = stride
        self.signed: Final = signer is not None
        self._stores: dict[TrackNamespace, TrackStore] = {}
        self.records: dict[int, IndexRecord] = {}
        for i in index_block_indices(blocks, stride):
            record = IndexRecord(
                namespace=namespace,
                blocks=blocks,
                block_index=i,
                block_key=bytes(block_keys[i]),
                holder=holder,
            )
            payload = encode_record(record)
            if signer is not None:
                payload = signer.sign(payload)
            track = record.index_namespace().track(self.signed)
            store = TrackStore(track, default_publisher_priority=_RECORD_PRIORITY)
            store.append(0, 0, payload, publisher_priority=_RECORD_PRIORITY)
            self._stores[track.namespace] = store
            self.records[i] = record
        self._attachments: dict[MoqtSession, _IndexAttachment] = {}

    # --- getters ---------------------------------------------------------------------------

    @property
    def namespaces(self) -> tuple[TrackNamespace, ...]:
        """Every index namespace, in block order."""
        return tuple(self._stores)

    @property
    def record_bytes(self) -> int:
        """Octets of every stored record (what a relay caches for this index)."""
        return sum(s.total_bytes for s in self._stores.values())

    def accepted(self, session: MoqtSession) -> int:
        """PUBLISH_NAMESPACEs of the index the peer accepted on ``session``."""
        att = self._attachments.get(session)
        return 0 if att is None else att.accepted

    # --- commands ----------------------------------------------------------------------------

    def attach(self, session: MoqtSession, *, now: float) -> None:
        """PUBLISH_NAMESPACE every index namespace on ``session``."""
        att = _IndexAttachment(session)
        self._attachments[session] = att
        for ns in self._stores:
            att.publish_ids[session.publish_namespace(ns, now=now)] = ns

    def withdraw(self, *, now: float) -> None:
        """Withdraw every index namespace on every session (cancel the PUBLISH_NAMESPACEs)."""
        for session, att in list(self._attachments.items()):
            if not session.is_closed:
                for rid in att.publish_ids:
                    with contextlib.suppress(LocalProtocolError):  # already finished
                        session.cancel(rid, now=now)
            del self._attachments[session]

    # --- inputs ------------------------------------------------------------------------------

    def handle_session_event(
        self, session: MoqtSession, event: ev.SessionEvent, now: float
    ) -> bool:
        """Answer ``event`` if it concerns the index; ``False`` if it does not."""
        att = self._attachments.get(session)
        if att is None:
            return False
        if isinstance(event, ev.SessionClosed):
            del self._attachments[session]
            return False
        if session.is_closed:
            return False
        if isinstance(event, ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested):
            store = self._stores.get(event.track.namespace)
            if store is None:
                return False
            self._serve(att, store, event, now)
            return True
        if isinstance(event, ev.SubscribeNamespaceRequested):
            covered = [ns for ns in self._stores if event.prefix.is_prefix_of(ns)]
            if not covered:
                return False
            self._announce(att, event.request_id, event.prefix, covered, now)
            return True
        if isinstance(event, ev.RequestAccepted | ev.RequestFailed):
            if event.request_id not in att.publish_ids or event.update_id is not None:
                return False
            if isinstance(event, ev.RequestAccepted):
                att.accepted += 1
            else:
                att.refused += 1
            return True
        if isinstance(event, ev.RequestCancelled | ev.RequestUpdated):
            return event.request_id in att.served
        return False

    # --- internals ---------------------------------------------------------------------------

    def _serve(
        self,
        att: _IndexAttachment,
        store: TrackStore,
        event: ev.SubscribeRequested | ev.FetchRequested | ev.TrackStatusRequested,
        now: float,
    ) -> None:
        held = store if event.track.name == store.name.name else None
        if answer_from_store(att.session, event, held, "no such track in this index", now):
            # the fill delivers the record; the subscription stays open (the subscriber
            # cancels it) and ends with PUBLISH_DONE only when the index is withdrawn
            att.served.add(event.request_id)

    def _announce(
        self,
        att: _IndexAttachment,
        request_id: int,
        prefix: TrackNamespace,
        covered: list[TrackNamespace],
        now: float,
    ) -> None:
        session = att.session
        rec = session.requests.get(request_id)
        if rec is None or rec.finished:
            return
        if rec.state is RequestState.PENDING:
            session.accept_request(request_id, now=now)
        att.served.add(request_id)
        for ns in covered:
            suffix = ns.suffix_after(prefix)
            if suffix.fields not in rec.announced:
                session.send_namespace(request_id, suffix, now=now)
