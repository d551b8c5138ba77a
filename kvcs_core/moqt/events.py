"""What a session tells its application: a closed union of frozen events.

Theory of operation
-------------------
Every event is built complete at one point and never changes (STYLE.md R3).
Events name requests by Request ID (d21 section 6.4.2.1). Requests the *peer*
makes arrive as ``*Requested`` events that the application answers with a
local command (``accept_subscribe``, ``reject_request``, ...); answers to *our*
requests arrive as ``*Accepted`` / :class:`RequestFailed`.

Objects carry their payload as a ``memoryview`` (a view of the transport's
buffer where the object arrived in one piece, else of a buffer assembled once).
``delivery`` says how an object came: on a subgroup stream or datagram of a
subscription (``SUBSCRIPTION``), on a fill stream of a subscription (``FILL``,
d21 section 3.4), or on a FETCH response stream (``FETCH``). An object can be
delivered both ways when ranges overlap; exactly-once recipes avoid that.
"""

from __future__ import annotations

import enum

import attrs

from kvcs_core.wire.codes import EndOfRange, ObjectStatus
from kvcs_core.wire.kvp import KeyValuePairs
from kvcs_core.wire.messages import Redirect
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace
from kvcs_core.wire.params import Parameters


def _summarize(buf: memoryview) -> str:
    return f"<{buf.nbytes} bytes>"


class Initiator(enum.IntEnum):
    """Who ended the session."""

    LOCAL = 1
    PEER = 2
    TRANSPORT = 3


class Delivery(enum.IntEnum):
    """How an object reached us (d21 section 3.4: subscription- vs fill-delivered)."""

    SUBSCRIPTION = 1
    FILL = 2
    FETCH = 3


class RequestKind(enum.IntEnum):
    """The request a Request ID belongs to."""

    SUBSCRIBE = 1
    FETCH = 2
    TRACK_STATUS = 3
    PUBLISH_NAMESPACE = 4
    SUBSCRIBE_NAMESPACE = 5
    SUBSCRIBE_TRACKS = 6
    PUBLISH = 7
    REQUEST_UPDATE = 8


# --- session life cycle ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SetupCompleted:
    """Both SETUPs are exchanged; requests may flow."""

    peer_implementation: bytes | None
    peer_max_filter_ranges: int
    peer_max_request_updates: int


@attrs.frozen(kw_only=True)
class GoawayReceived:
    """The peer asks us to migrate (d21 section 9.2); ``request_id`` is None for the session."""

    new_session_uri: bytes
    timeout_ms: int
    request_id: int | None = None


@attrs.frozen(kw_only=True)
class SessionClosed:
    """The session is over; nothing else will be emitted."""

    code: int
    reason: str
    initiator: Initiator


# --- answers to our requests ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SubscribeAccepted:
    """SUBSCRIBE_OK: the subscription is established."""

    request_id: int
    track_alias: int
    largest: Location | None
    expires_ms: int | None
    track_properties: KeyValuePairs


@attrs.frozen(kw_only=True)
class FetchAccepted:
    """FETCH_OK: the range ends at ``end_location`` (inclusive)."""

    request_id: int
    end_of_track: bool
    end_location: Location
    track_properties: KeyValuePairs


@attrs.frozen(kw_only=True)
class RequestAccepted:
    """REQUEST_OK for a request (or a REQUEST_UPDATE: ``update_id`` set)."""

    request_id: int
    kind: RequestKind
    params: Parameters
    track_properties: KeyValuePairs = ()
    update_id: int | None = None


@attrs.frozen(kw_only=True)
class RequestFailed:
    """The request (or update) ended without success: REQUEST_ERROR, or a local cause."""

    request_id: int
    code: int
    reason: str
    retry_interval_ms: int | None = None
    """Minimum delay before retrying unchanged, in ms; None: do not retry as sent (d21 9.4.2)."""
    redirect: Redirect | None = None
    update_id: int | None = None


@attrs.frozen(kw_only=True)
class PublishDoneReceived:
    """PUBLISH_DONE: the subscription is over on the publisher's side."""

    request_id: int
    status: int
    stream_count: int
    reason: str


@attrs.frozen(kw_only=True)
class NamespaceAnnounced:
    """NAMESPACE on a SUBSCRIBE_NAMESPACE stream; ``namespace`` is prefix + suffix."""

    request_id: int
    namespace: TrackNamespace


@attrs.frozen(kw_only=True)
class NamespaceWithdrawn:
    """NAMESPACE_DONE on a SUBSCRIBE_NAMESPACE stream."""

    request_id: int
    namespace: TrackNamespace


# --- objects ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ObjectReceived:
    """One object of a subscription, fill or fetch."""

    request_id: int
    delivery: Delivery
    location: Location
    subgroup_id: int | None
    publisher_priority: int
    status: ObjectStatus
    properties: KeyValuePairs
    payload: memoryview = attrs.field(repr=_summarize, eq=False)
    via_request_id: int
    """The Request ID naming the data stream: the SUBSCRIBE, FETCH or REQUEST_UPDATE."""

    @property
    def payload_bytes(self) -> bytes:
        return bytes(self.payload)

    @classmethod
    def trusted(
        cls,
        request_id: int,
        delivery: Delivery,
        location: Location,
        subgroup_id: int | None,
        publisher_priority: int,
        status: ObjectStatus,
        properties: KeyValuePairs,
        payload: memoryview,
        via_request_id: int,
    ) -> ObjectReceived:
        """Build from values a decoder produced (the per-Object receive path): the slots
        are filled directly."""
        e: ObjectReceived = object.__new__(cls)
        _OR_REQUEST_ID(e, request_id)
        _OR_DELIVERY(e, delivery)
        _OR_LOCATION(e, location)
        _OR_SUBGROUP_ID(e, subgroup_id)
        _OR_PRIORITY(e, publisher_priority)
        _OR_STATUS(e, status)
        _OR_PROPERTIES(e, properties)
        _OR_PAYLOAD(e, payload)
        _OR_VIA(e, via_request_id)
        return e


_OR_REQUEST_ID = ObjectReceived.__dict__["request_id"].__set__
_OR_DELIVERY = ObjectReceived.__dict__["delivery"].__set__
_OR_LOCATION = ObjectReceived.__dict__["location"].__set__
_OR_SUBGROUP_ID = ObjectReceived.__dict__["subgroup_id"].__set__
_OR_PRIORITY = ObjectReceived.__dict__["publisher_priority"].__set__
_OR_STATUS = ObjectReceived.__dict__["status"].__set__
_OR_PROPERTIES = ObjectReceived.__dict__["properties"].__set__
_OR_PAYLOAD = ObjectReceived.__dict__["payload"].__set__
_OR_VIA = ObjectReceived.__dict__["via_request_id"].__set__


@attrs.frozen(kw_only=True)
class RangeMarkerReceived:
    """An End-of-Range marker on a fetch or fill stream (d21 section 11.4.1.2)."""

    request_id: int
    kind: EndOfRange
    location: Location
    via_request_id: int


@attrs.frozen(kw_only=True)
class DataStreamEnded:
    """A data stream of ours-as-subscriber ended: FIN (``reset_code`` None) or reset."""

    request_id: int
    delivery: Delivery
    via_request_id: int
    group_id: int | None
    reset_code: int | None


# --- the peer's requests ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SubscribeRequested:
    """SUBSCRIBE from the peer: answer with accept_subscribe or reject_request."""

    request_id: int
    track: FullTrackName
    params: Parameters


@attrs.frozen(kw_only=True)
class FetchRequested:
    """FETCH from the peer: answer with accept_fetch or reject_request."""

    request_id: int
    track: FullTrackName
    params: Parameters


@attrs.frozen(kw_only=True)
class TrackStatusRequested:
    """TRACK_STATUS from the peer: answer with accept_track_status or reject_request."""

    request_id: int
    track: FullTrackName
    params: Parameters


@attrs.frozen(kw_only=True)
class PublishNamespaceRequested:
    """PUBLISH_NAMESPACE from the peer: answer with accept_request or reject_request."""

    request_id: int
    namespace: TrackNamespace
    params: Parameters


@attrs.frozen(kw_only=True)
class SubscribeNamespaceRequested:
    """SUBSCRIBE_NAMESPACE from the peer: accept_request, then send_namespace(...)."""

    request_id: int
    prefix: TrackNamespace
    params: Parameters


@attrs.frozen(kw_only=True)
class PublishRequested:
    """PUBLISH from the peer (d21 9.8): answer with accept_publish or reject_request.

    Objects may already be flowing (unless FORWARD is 0): they arrive as
    ObjectReceived events with this ``request_id``."""

    request_id: int
    track: FullTrackName
    track_alias: int
    params: Parameters
    track_properties: KeyValuePairs


@attrs.frozen(kw_only=True)
class SubscribeTracksRequested:
    """SUBSCRIBE_TRACKS from the peer (d21 9.18): accept_request, then publish(...) each
    matching track, or send_publish_skipped for one that will not be published."""

    request_id: int
    prefix: TrackNamespace
    params: Parameters


@attrs.frozen(kw_only=True)
class PublishSkippedReceived:
    """PUBLISH_SKIPPED on our SUBSCRIBE_TRACKS: this track will not be PUBLISHed to us."""

    request_id: int
    track: FullTrackName


@attrs.frozen(kw_only=True)
class RequestUpdated:
    """The peer updated one of its requests; the session already answered it when it
    could apply the update itself (subscription parameters, fills)."""

    request_id: int
    update_id: int
    params: Parameters


@attrs.frozen(kw_only=True)
class RequestCancelled:
    """The peer cancelled its request (stream reset / STOP_SENDING, d21 section 6.4.2.3)."""

    request_id: int
    code: int


SessionEvent = (
    SetupCompleted
    | GoawayReceived
    | SessionClosed
    | SubscribeAccepted
    | FetchAccepted
    | RequestAccepted
    | RequestFailed
    | PublishDoneReceived
    | NamespaceAnnounced
    | NamespaceWithdrawn
    | ObjectReceived
    | RangeMarkerReceived
    | DataStreamEnded
    | SubscribeRequested
    | FetchRequested
    | TrackStatusRequested
    | PublishNamespaceRequested
    | SubscribeNamespaceRequested
    | PublishRequested
    | SubscribeTracksRequested
    | PublishSkippedReceived
    | RequestUpdated
    | RequestCancelled
)
