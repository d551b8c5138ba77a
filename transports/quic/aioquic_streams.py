"""aioquic with its quiet streams left out of every packet it builds.

Theory of operation
-------------------
aioquic 1.x builds each packet of application data (``_write_application``) by walking
*every* stream of the connection twice: once to raise its receive credit
(``_write_stream_limits`` for each of ``_streams.values()``) and once through the send
queue (``_streams_queue``: discard finished streams, write STOP_SENDING, RESET_STREAM
and STREAM frames), after which it rebuilds the queue as a new list. The cost of a
packet therefore grows with the streams that are open, not with the ones that have
something to do. MOQT keeps many streams open that are quiet: every request is a
bidirectional stream that lives as long as the request (RFC 9000 section 2, wire
reference section 1), and a publication's KVSP index keeps one PUBLISH_NAMESPACE open
per indexed block (binding 9). A producer of a 256 MiB, 128-block cache holds about 130
of them, and in ``bench_relay_pipeline`` those two walks took about 40% of its CPU.

:func:`quiet_streams_connection` derives from aioquic's ``QuicConnection`` a class whose
two walks see only streams that may have something to do; the frames written are the
ones aioquic would write, in the same order among the streams that have any:

* **The send queue** holds a stream while it has data or a FIN to (re)send, a
  RESET_STREAM or STOP_SENDING to (re)send, or is finished (so that aioquic discards it
  and, for a stream the peer opened, lets the peer open another). When aioquic stores
  its rebuilt queue, the streams with none of these are left out (*parked*). A parked
  stream is put back (*woken*), where aioquic's own queue would have it
  (:class:`SendQueue`), when the application writes, ends, resets or stops it
  (``_get_or_create_stream_for_send``, which every write and reset goes through, and
  ``stop_stream``), when any frame for it arrives (``_get_or_create_stream``, called for
  every received stream frame before it is applied), and when the fate of a frame of it
  is known (each stream's ``on_data_delivery``, ``on_reset_delivery`` and
  ``on_stop_sending_delivery``: a loss schedules a retransmission, an acknowledgement
  may finish the stream). A stream aioquic has discarded is never woken: the fate of a
  frame can be known after that (a probe's copy of the last frame, acknowledged or
  lost late).
* **The credit walk** visits a *watch* set: a stream joins it when it is created, when
  a frame for it arrives (received data is what moves its credit), when a
  MAX_STREAM_DATA frame of it is lost, and, for all streams, when a held input is
  released (:func:`~.stack._aioquic_hold_input`); the credit writer of
  :func:`~.stack._aioquic_credit_windows` takes it out (:meth:`StreamTable.quiet`) once
  it finds nothing to raise or send.

The class is used only where aioquic's ``QuicConnection`` has the layout this relies on
(:func:`layout_known`); elsewhere the plain class stays, as fast as aioquic makes it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_WALKED = frozenset({"_streams", "_streams_queue", "values", "_write_stream_limits"})
"""Names ``_write_application`` must use for the walks described in the module docstring."""
_OVERRIDDEN = (
    "_get_or_create_stream",
    "_get_or_create_stream_for_send",
    "_on_max_stream_data_delivery",
    "stop_stream",
)


def layout_known(connection_cls: type) -> bool:
    """Whether ``connection_cls`` walks its streams as aioquic 1.x does (module docstring)."""
    write = getattr(connection_cls, "_write_application", None)
    code = getattr(write, "__code__", None)
    if code is None or not set(code.co_names) >= _WALKED:
        return False
    return all(callable(getattr(connection_cls, name, None)) for name in _OVERRIDDEN)


def _parkable(stream: Any) -> bool:
    """Nothing for aioquic to write or discard on this stream now."""
    sender = stream.sender
    return bool(
        sender.buffer_is_empty
        and not sender.reset_pending
        and not stream.receiver.stop_pending
        and not stream.is_finished
    )


class SendQueue(list[Any]):
    """aioquic's ``_streams_queue`` without the parked streams, in aioquic's own order, into
    which a woken stream goes back at the place aioquic's queue would have it.

    aioquic appends a new stream at the end of its queue, moves each stream that sent in a
    packet to the end, and leaves the others where they are. So its queue is ordered by
    when each stream last went to the end: the *stamp* given here to every stream that is
    appended (``stamps``, kept by the connection across its successive queues, with
    ``clock`` counting). A stream keeps its stamp while it is parked, and a woken stream is
    inserted by it: a subgroup stream that ran out of data and is written again goes
    before the streams that sent meanwhile, as in aioquic."""

    def __init__(self, stamps: dict[int, int], clock: Iterator[int]) -> None:
        super().__init__()
        self.ids: set[int] = set()
        self.stamps = stamps
        self.clock = clock
        self._order: list[int] = []
        """The stamps of the streams queued, in queue order (ascending)."""

    def append(self, stream: Any) -> None:
        """A new stream, or one that just sent (aioquic's ``extend``): to the end."""
        stream_id = stream.stream_id
        if stream_id in self.ids:
            return
        stamp = self.stamps[stream_id] = next(self.clock)
        self.ids.add(stream_id)
        self._order.append(stamp)
        super().append(stream)

    def extend(self, streams: Iterable[Any]) -> None:
        for stream in streams:
            self.append(stream)

    def keep(self, stream: Any) -> None:
        """A stream of the queue aioquic rebuilt, taken in its order: its stamp stays."""
        self.ids.add(stream.stream_id)
        self._order.append(self.stamps[stream.stream_id])
        super().append(stream)

    def wake(self, stream: Any) -> None:
        """Queue ``stream`` again at its place (class docstring)."""
        stream_id = stream.stream_id
        if stream_id in self.ids:
            return
        stamp = self.stamps.get(stream_id)
        if stamp is None:
            self.append(stream)
            return
        at = bisect.bisect(self._order, stamp)
        self.ids.add(stream_id)
        self._order.insert(at, stamp)
        self.insert(at, stream)


class StreamTable(dict[int, Any]):
    """aioquic's ``_streams`` (stream ID to ``QuicStream``) whose ``values()`` is the watch
    set of the credit walk; every other use is the plain ``dict``."""

    def __init__(
        self, wake: Callable[[Any], None], acked: Any, streams: Iterable[tuple[int, Any]] = ()
    ) -> None:
        super().__init__()
        self._wake = wake
        self._acked = acked
        self.stamps: dict[int, int] = {}
        """Stream ID to its :class:`SendQueue` stamp, for every stream."""
        self.clock = itertools.count()
        """The stamps' counter."""
        self.watch: dict[int, Any] = {}
        """Streams the credit walk visits: may have credit to raise or to send again."""
        for stream_id, stream in streams:
            self[stream_id] = stream

    def __setitem__(self, stream_id: int, stream: Any) -> None:
        super().__setitem__(stream_id, stream)
        self.watch[stream_id] = stream
        self._observe(stream)

    def pop(self, stream_id: int, *default: Any) -> Any:
        self.watch.pop(stream_id, None)
        self.stamps.pop(stream_id, None)
        return super().pop(stream_id, *default)

    def values(self) -> Any:  # a snapshot: the walk may take streams out of the watch
        return list(self.watch.values())

    def rewatch(self, stream: Any) -> None:
        """``stream`` may have credit to raise or to send again (a frame arrived, or its
        MAX_STREAM_DATA was lost)."""
        if stream.stream_id in self:
            self.watch[stream.stream_id] = stream

    def quiet(self, stream: Any) -> None:
        """The credit walk found nothing to raise or send on ``stream``."""
        self.watch.pop(stream.stream_id, None)

    def watch_all(self) -> None:
        """Every stream may have credit to raise (a held input was released)."""
        self.watch = dict(self.items())

    def _observe(self, stream: Any) -> None:
        """Wake ``stream`` whenever the fate of one of its frames is known."""
        wake, acked = self._wake, self._acked
        sender, receiver = stream.sender, stream.receiver
        data_delivery = sender.on_data_delivery
        reset_delivery = sender.on_reset_delivery
        stop_delivery = receiver.on_stop_sending_delivery

        def on_data_delivery(delivery: Any, start: int, stop: int, fin: bool) -> None:
            data_delivery(delivery, start, stop, fin)
            if delivery != acked or sender.is_finished:
                wake(stream)

        def on_reset_delivery(delivery: Any) -> None:
            reset_delivery(delivery)
            wake(stream)

        def on_stop_sending_delivery(delivery: Any) -> None:
            stop_delivery(delivery)
            if delivery != acked:
                wake(stream)

        sender.on_data_delivery = on_data_delivery
        sender.on_reset_delivery = on_reset_delivery
        receiver.on_stop_sending_delivery = on_stop_sending_delivery


def quiet_streams_connection(connection_cls: type, acked: Any) -> type:
    """``connection_cls`` (aioquic's ``QuicConnection``) whose packets walk only the
    streams that may have something to do (module docstring); ``acked`` is aioquic's
    ``QuicDeliveryState.ACKED``."""
    base: Any = connection_cls

    class QuietStreamsConnection(base):  # type: ignore[misc]
        """aioquic's ``QuicConnection``, walking only streams with work (module docstring)."""

        def _kvcs_wake(self, stream: Any) -> None:
            # never a stream aioquic discarded (module docstring): queued again, it would
            # be discarded twice, its _streams.pop raising KeyError in datagrams_to_send
            if self._streams.get(stream.stream_id) is stream:
                self.__dict__["_kvcs_queue"].wake(stream)

        @property
        def _streams(self) -> StreamTable:
            table: StreamTable = self.__dict__["_kvcs_streams"]
            return table

        @_streams.setter
        def _streams(self, streams: dict[int, Any]) -> None:
            self.__dict__["_kvcs_streams"] = StreamTable(self._kvcs_wake, acked, streams.items())

        @property
        def _streams_queue(self) -> SendQueue:
            queue: SendQueue = self.__dict__["_kvcs_queue"]
            return queue

        @_streams_queue.setter
        def _streams_queue(self, queue: list[Any]) -> None:
            table = self._streams
            kept = SendQueue(table.stamps, table.clock)
            for stream in queue:  # in aioquic's order, the parked left out
                if not _parkable(stream):
                    kept.keep(stream)
            self.__dict__["_kvcs_queue"] = kept

        def _get_or_create_stream(self, frame_type: int, stream_id: int) -> Any:
            stream = super()._get_or_create_stream(frame_type, stream_id)
            self._streams.rewatch(stream)
            self._kvcs_wake(stream)
            return stream

        def _get_or_create_stream_for_send(self, stream_id: int) -> Any:
            # every write, end and reset of the application's takes its stream here first;
            # waking it before the write is the same, the queue is walked only by a packet
            stream = super()._get_or_create_stream_for_send(stream_id)
            self._kvcs_wake(stream)
            return stream

        def _on_max_stream_data_delivery(self, delivery: Any, stream: Any) -> None:
            super()._on_max_stream_data_delivery(delivery, stream)
            if delivery != acked:
                self._streams.rewatch(stream)

        def stop_stream(self, stream_id: int, error_code: int) -> None:
            super().stop_stream(stream_id, error_code)
            self._kvcs_wake(self._streams[stream_id])  # aioquic raised if it had none

    QuietStreamsConnection.__name__ = QuietStreamsConnection.__qualname__ = (
        f"QuietStreams{connection_cls.__name__}"
    )
    return QuietStreamsConnection
