"""Every code point of MOQT draft-22 (ALPN ``moqt-22``), one IntEnum per registry.

Theory of operation
-------------------
MOQT reuses the same numbers in unrelated registries: 0x22 is the GROUP_ORDER
message parameter, the DEFAULT_PUBLISHER_GROUP_ORDER property and the
PUBLISH_STATE_NOTIFY message type; 0x32 is NEW_GROUP_REQUEST and the provisional
PADDING property. Following MOQT-22-WIRE.md section 11 "Ambiguities", item A29,
each registry gets its own enum here and no code is shared between them.

Values are those of draft-ietf-moq-transport-21 section 16 (IANA tables) with the
draft-22 changes listed in section 1.1 of the wire reference (SUBSCRIPTION_ENDED
and VERSION_NEGOTIATION_FAILED removed).
"""

from __future__ import annotations

import enum

ALPN = "moqt-22"
"""The ALPN token (and WebTransport protocol) for this draft (d21 section 6.2)."""

MAX_VI64 = (1 << 64) - 1


class MessageType(enum.IntEnum):
    """Control message types (d21 section 9, Table 5; unchanged at d22)."""

    REQUEST_UPDATE = 0x02
    SUBSCRIBE = 0x03
    SUBSCRIBE_OK = 0x04
    REQUEST_ERROR = 0x05
    PUBLISH_NAMESPACE = 0x06
    REQUEST_OK = 0x07
    NAMESPACE = 0x08
    PUBLISH_DONE = 0x0B
    TRACK_STATUS = 0x0D
    NAMESPACE_DONE = 0x0E
    PUBLISH_SKIPPED = 0x0F
    GOAWAY = 0x10
    FETCH = 0x16
    FETCH_OK = 0x18
    PUBLISH = 0x1D
    PUBLISH_STATE_NOTIFY = 0x22
    SUBSCRIBE_NAMESPACE = 0x50
    SUBSCRIBE_TRACKS = 0x51
    SETUP = 0x2F00


class SetupOption(enum.IntEnum):
    """Setup Options carried as a KVP list in SETUP (d21 section 9.1)."""

    PATH = 0x01
    AUTHORIZATION_TOKEN = 0x03
    MAX_AUTH_TOKEN_CACHE_SIZE = 0x04
    AUTHORITY = 0x05
    MAX_FILTER_RANGES = 0x06
    MOQT_IMPLEMENTATION = 0x07
    MAX_REQUEST_UPDATES = 0x08


class ParameterType(enum.IntEnum):
    """Message Parameters (d21 section 9.20; d22 encodings per the wire reference 5.1)."""

    OBJECT_DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    RENDEZVOUS_TIMEOUT = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    EXPIRES = 0x08
    LARGEST_OBJECT = 0x09
    FILL_TIMEOUT = 0x0A
    FORWARD = 0x10
    SUBSCRIBER_PRIORITY = 0x20
    LOCATION_FILTER = 0x21
    GROUP_ORDER = 0x22
    FILL_PARAMETERS = 0x23
    SUBGROUP_FILTER = 0x25
    OBJECTID_FILTER = 0x26
    PRIORITY_FILTER = 0x27
    OBJECT_PROPERTY_FILTER = 0x28
    TRACK_PROPERTY_FILTER = 0x29
    NEW_GROUP_REQUEST = 0x32
    TRACK_NAMESPACE_PREFIX = 0x34
    INCLUDE_PROPERTIES = 0x35


class PropertyType(enum.IntEnum):
    """Track and Object Properties (d21 sections 8.4, 10 and 16.8)."""

    OBJECT_DELIVERY_TIMEOUT = 0x02
    MAX_CACHE_DURATION = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    IMMUTABLE_PROPERTIES = 0x0B
    DEFAULT_PUBLISHER_PRIORITY = 0x0E
    DEFAULT_PUBLISHER_GROUP_ORDER = 0x22
    DYNAMIC_GROUPS = 0x30
    PRIOR_GROUP_ID_GAP = 0x3C
    PRIOR_OBJECT_ID_GAP = 0x3E


class LocationFilterType(enum.IntEnum):
    """Location Filter Type of the d22 typed LOCATION_FILTER (wire reference 5.4)."""

    NONE = 0x0
    RELATIVE_START = 0x1
    ABSOLUTE_START = 0x2
    ABSOLUTE_GROUP_END = 0x3
    ABSOLUTE_RANGE = 0x4
    NEXT_OBJECT = 0x5


class GroupOrder(enum.IntEnum):
    """GROUP_ORDER parameter and DEFAULT_PUBLISHER_GROUP_ORDER property values."""

    ASCENDING = 0x1
    DESCENDING = 0x2


class TokenAliasType(enum.IntEnum):
    """Alias Type of an AUTHORIZATION_TOKEN value (d21 section 8.9)."""

    DELETE = 0x0
    REGISTER = 0x1
    USE_ALIAS = 0x2
    USE_VALUE = 0x3


class ObjectStatus(enum.IntEnum):
    """Object Status (d21 section 11.1.2). 0x1 and 0x2 existed only in old drafts."""

    NORMAL = 0x0
    END_OF_GROUP = 0x3
    END_OF_TRACK = 0x4


class EndOfRange(enum.IntEnum):
    """End-of-Range Serialization Flags on fetch streams (d21 section 11.4.1.2)."""

    NON_EXISTENT = 0x8C
    UNKNOWN = 0x10C
    TIMED_OUT = 0x20C


class UniStreamType(enum.IntEnum):
    """First vi64 of a unidirectional stream, other than SUBGROUP_HEADER flags (d21 6.4.1)."""

    FETCH_HEADER = 0x05
    CONTROL = 0x2F00
    PADDING = 0x132B3E28


PADDING_DATAGRAM_TYPE = 0x132B3E29
"""First vi64 of a padding datagram (d21 section 11.5)."""


class SessionErrorCode(enum.IntEnum):
    """Session termination codes (d21 section 12.2). 0x7 and 0x15 are unassigned."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    UNAUTHORIZED = 0x2
    PROTOCOL_VIOLATION = 0x3
    INVALID_REQUEST_ID = 0x4
    DUPLICATE_TRACK_ALIAS = 0x5
    KEY_VALUE_FORMATTING_ERROR = 0x6
    INVALID_PATH = 0x8
    MALFORMED_PATH = 0x9
    GOAWAY_TIMEOUT = 0x10
    CONTROL_MESSAGE_TIMEOUT = 0x11
    DATA_STREAM_TIMEOUT = 0x12
    AUTH_TOKEN_CACHE_OVERFLOW = 0x13
    DUPLICATE_AUTH_TOKEN_ALIAS = 0x14
    MALFORMED_AUTH_TOKEN = 0x16
    UNKNOWN_AUTH_TOKEN_ALIAS = 0x17
    EXPIRED_AUTH_TOKEN = 0x18
    INVALID_AUTHORITY = 0x19
    MALFORMED_AUTHORITY = 0x1A
    TOO_MANY_REQUEST_UPDATES = 0x1B


class RequestErrorCode(enum.IntEnum):
    """REQUEST_ERROR codes (d21 section 12.3)."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    MALFORMED_AUTH_TOKEN = 0x4
    EXPIRED_AUTH_TOKEN = 0x5
    GOING_AWAY = 0x6
    EXCESSIVE_LOAD = 0x9
    DOES_NOT_EXIST = 0x10
    INVALID_RANGE = 0x11
    MALFORMED_TRACK = 0x12
    UNINTERESTED = 0x20
    PREFIX_OVERLAP = 0x30
    NAMESPACE_TOO_LARGE = 0x31
    UNSUPPORTED_EXTENSION = 0x33
    REDIRECT = 0x34
    CONFLICTING_FILTERS = 0x35
    INVALID_FILTER = 0x36


class PublishDoneCode(enum.IntEnum):
    """PUBLISH_DONE status codes (d21 section 12.4). 0x3 SUBSCRIPTION_ENDED is gone."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    EXPIRED = 0x6
    UPDATE_FAILED = 0x8
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


class StreamResetCode(enum.IntEnum):
    """RESET_STREAM / STOP_SENDING codes for MOQT streams (d21 section 12.5)."""

    INTERNAL_ERROR = 0x0
    CANCELLED = 0x1
    DELIVERY_TIMEOUT = 0x2
    SESSION_CLOSED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    UNKNOWN_OBJECT_STATUS = 0x6
    EXPIRED_AUTH_TOKEN = 0x7
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


def is_grease(value: int) -> bool:
    """True for the reserved GREASE values ``0x7f * N + 0x9D`` of every registry."""
    return value >= 0x9D and (value - 0x9D) % 0x7F == 0


def code_or_int(enum_type: type[enum.IntEnum], value: int) -> int:
    """Return ``enum_type(value)`` when the value is known, else the plain int.

    Unknown error codes are legal on the wire (d21 section 13: treat as
    INTERNAL_ERROR of the context, never close because of one), so decoders
    keep them as ints instead of failing.
    """
    try:
        return enum_type(value)
    except ValueError:
        return value
