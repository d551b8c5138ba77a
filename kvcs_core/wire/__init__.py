"""MOQT draft-22 (ALPN ``moqt-22``) wire codec: pure, exact, free of session logic.

Theory of operation
-------------------
The authority is ``../shared/spec/MOQT-22-WIRE.md`` (draft-21 text plus the
draft-22 deltas) and its byte vectors. Modules, bottom up:

* ``codes``     every code point, one IntEnum per registry (A29)
* ``errors``    :class:`CodecError` (carries the session error code), ``NEED_MORE``
* ``varint``    vi64 (d21 8.1); ``reader`` fixed-width and length-prefixed fields
* ``names``     Location, Track Namespace / Name and their text form (d21 8.2, 8.7, 8.8)
* ``kvp``       Key-Value-Pair lists: Setup Options and Properties (d21 8.3)
* ``filters``, ``params``, ``scopes``, ``setup``
                Message Parameters (d21 9.20; typed d22 LOCATION_FILTER, range
                filters, FILL_PARAMETERS) and where each may appear
* ``messages``  every control message, framing and the control-stream decoder (d21 9)
* ``subgroup``, ``fetch``, ``datagram``, ``objects``
                the data plane (d21 11): incremental stream decoders with
                zero-copy payloads, scatter/gather encoders, datagrams, padding

Every decoder raises only :class:`CodecError` on malformed input (the fuzz
harnesses in ``fuzz/`` hold it to that) and treats a strict prefix of valid
input as "need more".
"""

from kvcs_core.wire import codes, errors, kvp, messages, names, objects, params
from kvcs_core.wire.codes import ALPN
from kvcs_core.wire.errors import NEED_MORE, CodecError, EncodeError
from kvcs_core.wire.messages import ControlStreamDecoder, decode_message, encode_message
from kvcs_core.wire.names import FullTrackName, Location, TrackNamespace
from kvcs_core.wire.objects import DataStreamDecoder, decode_datagram, peek_uni_stream_type

__all__ = [
    "ALPN",
    "NEED_MORE",
    "CodecError",
    "ControlStreamDecoder",
    "DataStreamDecoder",
    "EncodeError",
    "FullTrackName",
    "Location",
    "TrackNamespace",
    "codes",
    "decode_datagram",
    "decode_message",
    "encode_message",
    "errors",
    "kvp",
    "messages",
    "names",
    "objects",
    "params",
    "peek_uni_stream_type",
]
