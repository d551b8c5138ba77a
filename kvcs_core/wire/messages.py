"""MOQT draft-22 control messages: typed classes, framing, one-shot and stream decoders.

Theory of operation
-------------------
Every control message (MOQT-22-WIRE.md sections 3.4, 4.1 and 4.2) is framed as
``Message Type (vi64) | Message Length (u16) | Message Body``, on the control
stream and on every request stream alike. A deframer needs no per-type
knowledge, so decoding is two-staged:

1. Read the type; an unknown type (including the reserved 0x01, 0x20, 0x21,
   0x1E, 0x40, 0x41) is a PROTOCOL_VIOLATION as soon as the type vi64 is
   complete. Read the 16-bit Length and wait until the whole body is there
   (a strict prefix of a valid message is never an error: ``NEED_MORE``).
2. Copy the frame out (decoded messages own their bytes and never alias the
   caller's or the decoder's buffer) and parse the body against the layout of
   section 4.2. A body shorter than its layout, or with bytes left over, is PV;
   Track Properties (REQUEST_OK, SUBSCRIBE_OK, PUBLISH, FETCH_OK) and the Setup
   Options run to the end of the body, so they absorb the rest.

One frozen attrs class per message type (each with ``TYPE``); the parameters of
a message are checked against its scope (``params.py``) on decode (PV) and on
construction (EncodeError). REQUEST_OK and REQUEST_UPDATE are checked against
the union of their scopes; :func:`check_request_ok` and
:func:`check_request_update` apply the precise scope once the session knows
which request the message belongs to. Role-dependent rules (a client's GOAWAY
URI must be empty, PATH/AUTHORITY only from a native-QUIC client, a Redirect
Connect URI received by a server, ...) are the session's too.

SETUP (section 3.5) keeps its options typed; options not known (GREASE among
them) are kept, in order, in ``extra_options``. The Setup Option namespace is
separate from the Message Parameter one (Ambiguity A29). The option codec and
the Token structure are in ``setup.py``; the parameter scopes in ``scopes.py``.

CodecError offsets are offsets within the message frame (type byte = 0).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, ClassVar, Final, Self, TypeAlias, cast

import attrs

from kvcs_core.wire.codes import (
    MAX_VI64,
    MessageType,
    PublishDoneCode,
    RequestErrorCode,
    code_or_int,
)
from kvcs_core.wire.errors import NEED_MORE, CodecError, EncodeError, Incomplete, NeedMore
from kvcs_core.wire.filters import vi64_validator
from kvcs_core.wire.kvp import KeyValuePair, KeyValuePairs, encode_kvps, read_kvps
from kvcs_core.wire.names import (
    FullTrackName,
    Location,
    TrackNamespace,
    encode_location,
    encode_namespace,
    encode_track_name,
    read_location,
    read_namespace,
    read_track_name,
)
from kvcs_core.wire.params import (
    EMPTY_PARAMETERS,
    Parameter,
    Parameters,
    check_scope,
    encode_parameters,
    read_parameters,
)
from kvcs_core.wire.reader import read_length_prefixed, read_u8, read_u16, read_vi64
from kvcs_core.wire.scopes import (
    FETCH_OK_PARAMS,
    FETCH_PARAMS,
    NAMESPACE_REQUEST_PARAMS,
    PUBLISH_PARAMS,
    PUBLISH_STATE_NOTIFY_PARAMS,
    REQUEST_OK_ANY_PARAMS,
    REQUEST_OK_PARAMS_BY_REQUEST,
    REQUEST_UPDATE_ANY_PARAMS,
    RU_PARAMS_BY_REQUEST,
    RU_PUBLISH_REQUESTER_PARAMS,
    SUBSCRIBE_OK_PARAMS,
    SUBSCRIBE_PARAMS,
    SUBSCRIBE_TRACKS_PARAMS,
    TRACK_STATUS_PARAMS,
)

# AuthorizationToken is re-exported: Setup's __init__ (attrs makes it in this module) is
# annotated with it, so typing.get_type_hints(Setup.__init__) and the API reference
# resolve it here.
from kvcs_core.wire.setup import AuthorizationToken, SetupOptions
from kvcs_core.wire.varint import Buffer, encode_vi64

__all__ = [
    "MAX_FRAME_SIZE",
    "MAX_GOAWAY_URI",
    "MAX_MESSAGE_BODY",
    "MAX_REASON_PHRASE",
    "MESSAGE_CLASSES",
    "AuthorizationToken",
    "ControlMessage",
    "ControlMessageBase",
    "ControlStreamDecoder",
    "Fetch",
    "FetchOk",
    "FieldKind",
    "Goaway",
    "Namespace",
    "NamespaceDone",
    "Publish",
    "PublishDone",
    "PublishNamespace",
    "PublishSkipped",
    "PublishStateNotify",
    "Redirect",
    "RequestError",
    "RequestOk",
    "RequestUpdate",
    "Setup",
    "Subscribe",
    "SubscribeNamespace",
    "SubscribeOk",
    "SubscribeTracks",
    "TrackStatus",
    "check_request_ok",
    "check_request_update",
    "decode_message",
    "encode_message",
]

MAX_MESSAGE_BODY: Final = 0xFFFF
"""The 16-bit Message Length bounds every body (section 3.4)."""
MAX_FRAME_SIZE: Final = 9 + 2 + MAX_MESSAGE_BODY
"""Largest possible frame: 9-byte type, 2-byte length, 65535-byte body."""
MAX_REASON_PHRASE: Final = 1024
"""Reason Phrase limit (d21 section 8.5); longer is PV."""
MAX_GOAWAY_URI: Final = 8192
"""GOAWAY New Session URI limit (d21 section 9.2); longer is PV."""

# --- field helpers ---------------------------------------------------------------


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _as_ns(value: TrackNamespace | Iterable[bytes | str]) -> TrackNamespace:
    return value if isinstance(value, TrackNamespace) else TrackNamespace(tuple(value))


def _as_params(value: Parameters | Iterable[Parameter]) -> Parameters:
    return value if isinstance(value, Parameters) else Parameters(tuple(value))


def _as_kvps(value: Iterable[KeyValuePair]) -> KeyValuePairs:
    pairs = tuple(value)
    prev = 0
    for p in pairs:
        if not isinstance(p, KeyValuePair):
            raise EncodeError(f"{p!r} is not a KeyValuePair")
        if p.type < prev:
            raise EncodeError(f"KVP types must not decrease ({p.type:#x} after {prev:#x})")
        prev = p.type
    return pairs


def _reason_check(_inst: object, _a: attrs.Attribute[bytes], value: bytes) -> None:
    if len(value) > MAX_REASON_PHRASE:
        raise EncodeError(f"Reason Phrase of {len(value)} bytes exceeds 1024")


# --- base: table-driven layouts ------------------------------------------------------


class FieldKind(enum.Enum):
    """Field kinds of a message layout (section 4.2 notation)."""

    VI64 = "vi64"
    NS = "Track Namespace"
    NAME = "Track Name Length + Track Name (follows an NS)"
    PARAMS = "Params (scope: the class's SCOPE)"
    PROPS = "Track Properties (KVPs to the end of the body)"
    REASON = "Reason Phrase (<= 1024 bytes)"
    LOCATION = "Location"
    BOOL8 = "u8, 0 or 1"


class ControlMessageBase:
    """Common base of the control message classes (d21 section 9).

    A subclass lists its body in ``LAYOUT`` as ``(attribute, FieldKind)`` pairs, in
    wire order and in attrs field order; the generic :meth:`encode_body`,
    :meth:`decode_body` and construction checks (parameter scope ``SCOPE``,
    4096-byte full track name, bool fields) follow it. SETUP, GOAWAY and
    REQUEST_ERROR override the codec.
    """

    __slots__ = ()
    TYPE: ClassVar[MessageType]
    LAYOUT: ClassVar[tuple[tuple[str, FieldKind], ...]] = ()
    SCOPE: ClassVar[frozenset[int]] = frozenset()

    def __attrs_post_init__(self) -> None:
        ns: TrackNamespace | None = None
        for attr, kind in self.LAYOUT:
            v = getattr(self, attr)
            if kind is FieldKind.NS:
                ns = v
            elif kind is FieldKind.NAME:
                assert ns is not None
                FullTrackName(ns, v)  # raises EncodeError over 4096 bytes
            elif kind is FieldKind.PARAMS:
                for p in v:
                    if p.type not in self.SCOPE:
                        raise EncodeError(f"{self.TYPE.name} must not carry {p.type.name}")
            elif kind is FieldKind.BOOL8 and not isinstance(v, bool):
                raise EncodeError(f"{attr} must be a bool")

    def encode_body(self, out: bytearray) -> None:
        """Append the Message Body."""
        for attr, kind in self.LAYOUT:
            v = getattr(self, attr)
            if kind is FieldKind.VI64:
                out += encode_vi64(v)
            elif kind is FieldKind.NS:
                encode_namespace(v, out)
            elif kind is FieldKind.NAME or kind is FieldKind.REASON:
                out += encode_vi64(len(v))
                out += v
            elif kind is FieldKind.PARAMS:
                encode_parameters(v, out)
            elif kind is FieldKind.PROPS:
                encode_kvps(v, out)
            elif kind is FieldKind.LOCATION:
                encode_location(v, out)
            else:
                out.append(1 if v else 0)

    @classmethod
    def decode_body(cls, buf: bytes, pos: int) -> tuple[Self, int]:
        """Parse the body starting at ``pos`` of the frame ``buf`` (which ends with it).

        Raises Incomplete when the body is shorter than the layout.
        """
        values: list[Any] = []
        ns = TrackNamespace(())
        for _attr, kind in cls.LAYOUT:
            v: Any
            if kind is FieldKind.VI64:
                v, pos = read_vi64(buf, pos)
            elif kind is FieldKind.NS:
                ns, pos = read_namespace(buf, pos)
                v = ns
            elif kind is FieldKind.NAME:
                v, pos = read_track_name(buf, pos, ns)
            elif kind is FieldKind.PARAMS:
                v, pos = read_parameters(buf, pos, allowed=cls.SCOPE, context=cls.TYPE.name)
            elif kind is FieldKind.PROPS:
                v, pos = read_kvps(buf, pos, len(buf), what="Track Properties"), len(buf)
            elif kind is FieldKind.REASON:
                raw, pos = read_length_prefixed(
                    buf, pos, limit=MAX_REASON_PHRASE, what="Reason Phrase"
                )
                v = bytes(raw)
            elif kind is FieldKind.LOCATION:
                v, pos = read_location(buf, pos)
            else:
                b, p = read_u8(buf, pos)
                if b > 1:
                    raise CodecError(f"{cls.TYPE.name}: byte {b} is not 0 or 1", offset=pos)
                v, pos = b == 1, p
            values.append(v)
        return cls(*values), pos

    def to_bytes(self) -> bytes:
        """The whole frame (:func:`encode_message`)."""
        return encode_message(self)


# --- SETUP ---------------------------------------------------------------------------


@attrs.frozen
class Setup(SetupOptions, ControlMessageBase):
    """SETUP (d21 section 9.1): a count-less KVP list of Setup Options.

    ``None`` = option absent (its default applies). ``authorization_tokens`` may
    hold several REGISTER or USE_VALUE tokens (DELETE/USE_ALIAS in SETUP is PV).
    ``extra_options`` keeps unknown options (GREASE included) in wire order.
    Fields, checks and the body codec come from ``setup.SetupOptions``.
    """

    TYPE: ClassVar[MessageType] = MessageType.SETUP


# --- GOAWAY, REQUEST_OK, REQUEST_ERROR, REQUEST_UPDATE --------------------------------


def _uri_check(_inst: object, _a: attrs.Attribute[bytes], value: bytes) -> None:
    if len(value) > MAX_GOAWAY_URI:
        raise EncodeError(f"GOAWAY URI of {len(value)} bytes exceeds 8192")


@attrs.frozen
class Goaway(ControlMessageBase):
    """GOAWAY (d21 section 9.2): New Session URI (<= 8192 bytes; clients send b"") + Timeout."""

    TYPE: ClassVar[MessageType] = MessageType.GOAWAY
    new_session_uri: bytes = attrs.field(default=b"", converter=_as_bytes, validator=_uri_check)
    timeout_ms: int = attrs.field(default=0, validator=vi64_validator)

    def encode_body(self, out: bytearray) -> None:
        """Append URI Length, URI, Timeout."""
        out += encode_vi64(len(self.new_session_uri))
        out += self.new_session_uri
        out += encode_vi64(self.timeout_ms)

    @classmethod
    def decode_body(cls, buf: bytes, pos: int) -> tuple[Self, int]:
        """Parse URI and Timeout; a URI over 8192 bytes is PV."""
        uri, pos = read_length_prefixed(buf, pos, limit=MAX_GOAWAY_URI, what="GOAWAY URI")
        timeout, pos = read_vi64(buf, pos)
        return cls(bytes(uri), timeout), pos


@attrs.frozen
class RequestOk(ControlMessageBase):
    """REQUEST_OK (d21 section 9.3): Params + Track Properties.

    Named PUBLISH_OK, REQUEST_UPDATE_OK, TRACK_STATUS_OK, ... by what it answers;
    decoded with ``REQUEST_OK_ANY_PARAMS`` (see :func:`check_request_ok`).
    """

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_OK
    LAYOUT: ClassVar = (("params", FieldKind.PARAMS), ("track_properties", FieldKind.PROPS))
    SCOPE: ClassVar = REQUEST_OK_ANY_PARAMS
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)
    track_properties: KeyValuePairs = attrs.field(default=(), converter=_as_kvps)


@attrs.frozen
class Redirect:
    """The Redirect structure of REQUEST_ERROR code REDIRECT (d21 section 9.4.1).

    An empty ``connect_uri`` means the current session.
    """

    connect_uri: bytes = attrs.field(converter=_as_bytes)
    namespace: TrackNamespace = attrs.field(converter=_as_ns)
    track_name: bytes = attrs.field(default=b"", converter=_as_bytes)

    def __attrs_post_init__(self) -> None:
        FullTrackName(self.namespace, self.track_name)  # EncodeError over 4096 bytes

    def encode(self, out: bytearray) -> None:
        """Append Connect URI Length, Connect URI, Namespace, Track Name Length, Track Name."""
        out += encode_vi64(len(self.connect_uri))
        out += self.connect_uri
        encode_namespace(self.namespace, out)
        encode_track_name(self.track_name, out)

    @classmethod
    def read(cls, buf: Buffer, pos: int) -> tuple[Redirect, int]:
        """Read a Redirect at ``pos``."""
        uri, pos = read_length_prefixed(buf, pos, limit=MAX_MESSAGE_BODY, what="Connect URI")
        ns, pos = read_namespace(buf, pos)
        name, pos = read_track_name(buf, pos, ns)
        return cls(bytes(uri), ns, name), pos


def _to_request_error_code(value: int) -> int:
    if isinstance(value, bool) or not 0 <= value <= MAX_VI64:
        raise EncodeError(f"error code {value!r} is not a vi64")
    return code_or_int(RequestErrorCode, value)


@attrs.frozen
class RequestError(ControlMessageBase):
    """REQUEST_ERROR (d21 section 9.4): Error Code, Retry Interval, Reason, [Redirect].

    ``error_code`` is a RequestErrorCode, or a plain int for codes this module does
    not know (legal, d21 section 13). ``redirect`` is present iff the code is
    REDIRECT. ``retry_interval`` is the minimum delay in ms plus one (0 = don't).
    """

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_ERROR
    error_code: RequestErrorCode | int = attrs.field(converter=_to_request_error_code)
    retry_interval: int = attrs.field(default=0, validator=vi64_validator)
    reason: bytes = attrs.field(default=b"", converter=_as_bytes, validator=_reason_check)
    redirect: Redirect | None = None

    def __attrs_post_init__(self) -> None:
        if (self.error_code == RequestErrorCode.REDIRECT) != (self.redirect is not None):
            raise EncodeError("a Redirect goes with error code REDIRECT and only with it")

    def encode_body(self, out: bytearray) -> None:
        """Append the fields."""
        out += encode_vi64(self.error_code)
        out += encode_vi64(self.retry_interval)
        out += encode_vi64(len(self.reason))
        out += self.reason
        if self.redirect is not None:
            self.redirect.encode(out)

    @classmethod
    def decode_body(cls, buf: bytes, pos: int) -> tuple[Self, int]:
        """Parse the fields; a REDIRECT without its Redirect is a truncated body (PV)."""
        code, pos = read_vi64(buf, pos)
        retry, pos = read_vi64(buf, pos)
        reason, pos = read_length_prefixed(buf, pos, limit=MAX_REASON_PHRASE, what="Reason Phrase")
        redirect = None
        if code == RequestErrorCode.REDIRECT:
            # Ambiguity A11 (MOQT-22-WIRE.md section 11): the Redirect is mandatory;
            # a body that ends before it is truncated, i.e. PV (and never sent).
            redirect, pos = Redirect.read(buf, pos)
        return cls(code, retry, bytes(reason), redirect), pos


@attrs.frozen
class RequestUpdate(ControlMessageBase):
    """REQUEST_UPDATE (d21 section 9.5): its own Request ID + Params (sticky changes).

    Decoded with ``REQUEST_UPDATE_ANY_PARAMS`` (see :func:`check_request_update`).
    """

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_UPDATE
    LAYOUT: ClassVar = (("request_id", FieldKind.VI64), ("params", FieldKind.PARAMS))
    SCOPE: ClassVar = REQUEST_UPDATE_ANY_PARAMS
    request_id: int = attrs.field(validator=vi64_validator)
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)


# --- requests naming a track: SUBSCRIBE, FETCH, TRACK_STATUS; PUBLISH ------------------

_TRACK_REQUEST: Final = (
    ("request_id", FieldKind.VI64),
    ("namespace", FieldKind.NS),
    ("name", FieldKind.NAME),
    ("params", FieldKind.PARAMS),
)


@attrs.frozen
class _TrackRequest(ControlMessageBase):
    """Shared fields ``Request ID, Track Namespace, Track Name, Params``."""

    LAYOUT: ClassVar = _TRACK_REQUEST
    request_id: int = attrs.field(validator=vi64_validator)
    namespace: TrackNamespace = attrs.field(converter=_as_ns)
    name: bytes = attrs.field(converter=_as_bytes)
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)

    @property
    def track(self) -> FullTrackName:
        """The Full Track Name."""
        return FullTrackName(self.namespace, self.name)


@attrs.frozen
class Subscribe(_TrackRequest):
    """SUBSCRIBE (d21 section 9.6): Request ID, Namespace, Name, Params."""

    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE
    SCOPE: ClassVar = SUBSCRIBE_PARAMS


@attrs.frozen
class Fetch(_TrackRequest):
    """FETCH (d21 section 9.11): Request ID, Namespace, Name, Params."""

    TYPE: ClassVar[MessageType] = MessageType.FETCH
    SCOPE: ClassVar = FETCH_PARAMS


@attrs.frozen
class TrackStatus(_TrackRequest):
    """TRACK_STATUS (d21 section 9.13): the SUBSCRIBE layout; answered by TRACK_STATUS_OK."""

    TYPE: ClassVar[MessageType] = MessageType.TRACK_STATUS
    SCOPE: ClassVar = TRACK_STATUS_PARAMS


@attrs.frozen
class Publish(ControlMessageBase):
    """PUBLISH (d21 section 9.8): Request ID, Namespace, Name, Track Alias, Params, Props."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH
    LAYOUT: ClassVar = (
        *_TRACK_REQUEST[:3],
        ("track_alias", FieldKind.VI64),
        ("params", FieldKind.PARAMS),
        ("track_properties", FieldKind.PROPS),
    )
    SCOPE: ClassVar = PUBLISH_PARAMS
    request_id: int = attrs.field(validator=vi64_validator)
    namespace: TrackNamespace = attrs.field(converter=_as_ns)
    name: bytes = attrs.field(converter=_as_bytes)
    track_alias: int = attrs.field(validator=vi64_validator)
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)
    track_properties: KeyValuePairs = attrs.field(default=(), converter=_as_kvps)

    @property
    def track(self) -> FullTrackName:
        """The Full Track Name."""
        return FullTrackName(self.namespace, self.name)


# --- SUBSCRIBE_OK, PUBLISH_DONE, PUBLISH_STATE_NOTIFY, FETCH_OK ----------------------------


@attrs.frozen
class SubscribeOk(ControlMessageBase):
    """SUBSCRIBE_OK (d21 section 9.7): Track Alias, Params, Track Properties."""

    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE_OK
    LAYOUT: ClassVar = (
        ("track_alias", FieldKind.VI64),
        ("params", FieldKind.PARAMS),
        ("track_properties", FieldKind.PROPS),
    )
    SCOPE: ClassVar = SUBSCRIBE_OK_PARAMS
    track_alias: int = attrs.field(validator=vi64_validator)
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)
    track_properties: KeyValuePairs = attrs.field(default=(), converter=_as_kvps)


def _to_done_code(value: int) -> int:
    if isinstance(value, bool) or not 0 <= value <= MAX_VI64:
        raise EncodeError(f"status code {value!r} is not a vi64")
    return code_or_int(PublishDoneCode, value)


@attrs.frozen
class PublishDone(ControlMessageBase):
    """PUBLISH_DONE (d21 section 9.9): Status Code, Stream Count (2**64-1 = unknown), Reason.

    ``status_code`` is a PublishDoneCode, or a plain int for unknown codes.
    """

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_DONE
    LAYOUT: ClassVar = (
        ("status_code", FieldKind.VI64),
        ("stream_count", FieldKind.VI64),
        ("reason", FieldKind.REASON),
    )
    status_code: PublishDoneCode | int = attrs.field(converter=_to_done_code)
    stream_count: int = attrs.field(default=0, validator=vi64_validator)
    reason: bytes = attrs.field(default=b"", converter=_as_bytes, validator=_reason_check)


@attrs.frozen
class PublishStateNotify(ControlMessageBase):
    """PUBLISH_STATE_NOTIFY (d21 section 9.10): Params (LARGEST_OBJECT, FORWARD, filter)."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_STATE_NOTIFY
    LAYOUT: ClassVar = (("params", FieldKind.PARAMS),)
    SCOPE: ClassVar = PUBLISH_STATE_NOTIFY_PARAMS
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)


@attrs.frozen
class FetchOk(ControlMessageBase):
    """FETCH_OK (d21 section 9.12): End Of Track (8), End Location (inclusive), Params, Props.

    No parameter is defined for FETCH_OK, so ``params`` is always empty. An End Of
    Track byte other than 0 or 1 is PV.
    """

    TYPE: ClassVar[MessageType] = MessageType.FETCH_OK
    LAYOUT: ClassVar = (
        ("end_of_track", FieldKind.BOOL8),
        ("end_location", FieldKind.LOCATION),
        ("params", FieldKind.PARAMS),
        ("track_properties", FieldKind.PROPS),
    )
    SCOPE: ClassVar = FETCH_OK_PARAMS
    end_of_track: bool
    end_location: Location
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)
    track_properties: KeyValuePairs = attrs.field(default=(), converter=_as_kvps)


# --- namespace requests and their notifications ------------------------------------------


@attrs.frozen
class PublishNamespace(ControlMessageBase):
    """PUBLISH_NAMESPACE (d21 section 9.14): Request ID, Namespace, Params."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_NAMESPACE
    LAYOUT: ClassVar = (
        ("request_id", FieldKind.VI64),
        ("namespace", FieldKind.NS),
        ("params", FieldKind.PARAMS),
    )
    SCOPE: ClassVar = NAMESPACE_REQUEST_PARAMS
    request_id: int = attrs.field(validator=vi64_validator)
    namespace: TrackNamespace = attrs.field(converter=_as_ns)
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)


@attrs.frozen
class _PrefixRequest(ControlMessageBase):
    """Shared fields ``Request ID, Track Namespace Prefix (0-32 fields), Params``."""

    LAYOUT: ClassVar = (
        ("request_id", FieldKind.VI64),
        ("prefix", FieldKind.NS),
        ("params", FieldKind.PARAMS),
    )
    request_id: int = attrs.field(validator=vi64_validator)
    prefix: TrackNamespace = attrs.field(converter=_as_ns)
    params: Parameters = attrs.field(default=EMPTY_PARAMETERS, converter=_as_params)


@attrs.frozen
class SubscribeNamespace(_PrefixRequest):
    """SUBSCRIBE_NAMESPACE (d21 section 9.15): Request ID, Prefix, Params."""

    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE_NAMESPACE
    SCOPE: ClassVar = NAMESPACE_REQUEST_PARAMS


@attrs.frozen
class SubscribeTracks(_PrefixRequest):
    """SUBSCRIBE_TRACKS (d21 section 9.18): Request ID, Prefix, Params (A10 scope)."""

    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE_TRACKS
    SCOPE: ClassVar = SUBSCRIBE_TRACKS_PARAMS


@attrs.frozen
class Namespace(ControlMessageBase):
    """NAMESPACE (d21 section 9.16): Track Namespace Suffix after the request's prefix."""

    TYPE: ClassVar[MessageType] = MessageType.NAMESPACE
    LAYOUT: ClassVar = (("suffix", FieldKind.NS),)
    suffix: TrackNamespace = attrs.field(converter=_as_ns)


@attrs.frozen
class NamespaceDone(ControlMessageBase):
    """NAMESPACE_DONE (d21 section 9.17): Track Namespace Suffix no longer published."""

    TYPE: ClassVar[MessageType] = MessageType.NAMESPACE_DONE
    LAYOUT: ClassVar = (("suffix", FieldKind.NS),)
    suffix: TrackNamespace = attrs.field(converter=_as_ns)


@attrs.frozen
class PublishSkipped(ControlMessageBase):
    """PUBLISH_SKIPPED (d21 section 9.19): Namespace Suffix + Track Name not to be PUBLISHed."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_SKIPPED
    LAYOUT: ClassVar = (("suffix", FieldKind.NS), ("name", FieldKind.NAME))
    suffix: TrackNamespace = attrs.field(converter=_as_ns)
    name: bytes = attrs.field(converter=_as_bytes)


# --- registry, framing, decoders ------------------------------------------------------

ControlMessage: TypeAlias = (
    Setup
    | Goaway
    | RequestOk
    | RequestError
    | RequestUpdate
    | Subscribe
    | SubscribeOk
    | Publish
    | PublishDone
    | PublishStateNotify
    | Fetch
    | FetchOk
    | TrackStatus
    | PublishNamespace
    | SubscribeNamespace
    | Namespace
    | NamespaceDone
    | SubscribeTracks
    | PublishSkipped
)
"""Any control message class."""

MESSAGE_CLASSES: Final[dict[MessageType, type[ControlMessageBase]]] = {
    c.TYPE: c
    for c in (
        Setup, Goaway, RequestOk, RequestError, RequestUpdate, Subscribe, SubscribeOk,
        Publish, PublishDone, PublishStateNotify, Fetch, FetchOk, TrackStatus,
        PublishNamespace, SubscribeNamespace, Namespace, NamespaceDone, SubscribeTracks,
        PublishSkipped,
    )
}  # fmt: skip
"""Message type -> class, for every message of section 4.1."""
_BY_CODE: Final[dict[int, type[ControlMessageBase]]] = {
    int(k): v for k, v in MESSAGE_CLASSES.items()
}


def encode_message(msg: ControlMessageBase) -> bytes:
    """``Type (vi64) | Length (u16) | Body``; a body over 65535 bytes is an EncodeError."""
    body = bytearray()
    msg.encode_body(body)
    if len(body) > MAX_MESSAGE_BODY:
        raise EncodeError(f"{msg.TYPE.name} body of {len(body)} bytes exceeds 65535")
    return encode_vi64(msg.TYPE) + len(body).to_bytes(2, "big") + body


def _read_header(buf: Buffer, pos: int) -> tuple[type[ControlMessageBase], int, int] | NeedMore:
    """(class, header length, body length) of the frame at ``pos``, or NEED_MORE."""
    try:
        t, p = read_vi64(buf, pos)
    except Incomplete:
        return NEED_MORE
    cls = _BY_CODE.get(t)
    if cls is None:
        # Ambiguity A19: unknown (or reserved) message type -> PV, at once.
        raise CodecError(f"unknown control message type {t:#x}", offset=0)
    try:
        length, p = read_u16(buf, p)
    except Incomplete:
        return NEED_MORE
    return cls, p - pos, length


def _parse_frame(cls: type[ControlMessageBase], frame: bytes, body_start: int) -> ControlMessage:
    name = cls.TYPE.name
    try:
        msg, pos = cls.decode_body(frame, body_start)
    except Incomplete:
        raise CodecError(f"{name}: message body truncated", offset=len(frame)) from None
    except EncodeError as e:  # safety net: only CodecError may leave a decoder
        raise CodecError(f"{name}: {e}", offset=body_start) from None
    if pos != len(frame):
        raise CodecError(f"{name}: {len(frame) - pos} bytes after the message", offset=pos)
    return cast("ControlMessage", msg)  # every registered class is in the union


def decode_message(buf: Buffer) -> tuple[ControlMessage, int] | NeedMore:
    """Decode the message at the start of ``buf``: ``(message, bytes used)`` or NEED_MORE.

    Raises CodecError (PROTOCOL_VIOLATION unless stated) for malformed input.
    """
    hdr = _read_header(buf, 0)
    if hdr is NEED_MORE:
        return NEED_MORE
    cls, hlen, blen = hdr
    total = hlen + blen
    if len(buf) < total:
        return NEED_MORE
    return _parse_frame(cls, bytes(buf[:total]), hlen), total


class ControlStreamDecoder:
    """Incremental decoder for a control or request stream.

    ``feed`` returns the messages completed so far and keeps the rest (at most
    one partial frame, so the buffer stays under ``11 + max_message_size``
    bytes between calls). ``max_message_size`` is a local limit on the body
    Length (default: any legal body); a larger Length raises CodecError(PV).
    After a CodecError the decoder is dead: every later call raises it again.
    """

    def __init__(self, max_message_size: int = MAX_MESSAGE_BODY) -> None:
        self._buf = bytearray()
        self._max = max_message_size
        self._error: CodecError | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete message held back."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[ControlMessage]:
        """Append ``data``; return every message now complete, in order."""
        if self._error is not None:
            raise self._error
        buf = self._buf
        buf += data
        out: list[ControlMessage] = []
        pos = 0
        try:
            while pos < len(buf):
                hdr = _read_header(buf, pos)
                if hdr is NEED_MORE:
                    break
                cls, hlen, blen = hdr
                if blen > self._max:
                    raise CodecError(
                        f"{cls.TYPE.name} Length {blen} exceeds the local limit {self._max}",
                        offset=hlen - 2,
                    )
                total = hlen + blen
                if len(buf) - pos < total:
                    break
                out.append(_parse_frame(cls, bytes(buf[pos : pos + total]), hlen))
                pos += total
        except CodecError as e:
            self._error = e
            raise
        finally:
            del buf[:pos]
        return out

    def close(self) -> None:
        """The stream ended (FIN): a partial message pending is PV (Ambiguity A19)."""
        if self._error is not None:
            raise self._error
        if self._buf:
            self._error = CodecError(
                f"stream ended inside a control message ({len(self._buf)} bytes pending)"
            )
            raise self._error


# --- session-side scope checks -----------------------------------------------------------

_OK_WITHOUT_PROPERTIES: Final = frozenset(
    {
        MessageType.PUBLISH,
        MessageType.REQUEST_UPDATE,
        MessageType.SUBSCRIBE_NAMESPACE,
        MessageType.PUBLISH_NAMESPACE,
    }
)


def check_request_ok(msg: RequestOk, answers: MessageType) -> None:
    """PV unless ``msg`` fits the request (or REQUEST_UPDATE) it ``answers``.

    Checks the parameter scope (A8: EXPIRES accepted in TRACK_STATUS_OK) and that
    Track Properties are empty where d21 section 9.3 requires it (A26: not
    enforced for SUBSCRIBE_TRACKS_OK).
    """
    allowed = REQUEST_OK_PARAMS_BY_REQUEST.get(answers)
    if allowed is None:
        raise CodecError(f"REQUEST_OK cannot answer {answers.name}")
    check_scope(msg.params, allowed, f"REQUEST_OK answering {answers.name}")
    if msg.track_properties and answers in _OK_WITHOUT_PROPERTIES:
        raise CodecError(f"REQUEST_OK answering {answers.name} carries Track Properties")


def check_request_update(
    msg: RequestUpdate, request: MessageType, *, from_publisher: bool = False
) -> None:
    """PV unless ``msg`` fits the request it updates.

    ``from_publisher``: the REQUEST_UPDATE came from the sender of a PUBLISH
    (Ambiguity A23: accepted, token only). TRACK_STATUS cannot be updated.
    """
    if from_publisher and request == MessageType.PUBLISH:
        allowed: frozenset[int] | None = RU_PUBLISH_REQUESTER_PARAMS
    else:
        allowed = RU_PARAMS_BY_REQUEST.get(request)
    if allowed is None:
        raise CodecError(f"REQUEST_UPDATE is not allowed on {request.name}")
    check_scope(msg.params, allowed, f"REQUEST_UPDATE on {request.name}")
