"""Stream data in runs (:mod:`kvcs.transports.quic.pump`, "Stream data in runs").

A scripted QUIC connection hands the pump its events as aioquic's event classes;
a recording session shows what the pump fed it. A run of ``StreamDataReceived``
events reaches the session as one ``StreamData`` per stream, its chunks joined
in order, streams in the order they first appeared; FIN is kept; any other event
ends the run first, so it keeps its place among them. Then over real QUIC
(aioquic and qh3): a cache goes through a relay bit for bit while every pump
feeds its session fewer ``StreamData`` events than its stack reported.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from test_quic_inprocess import _run, tls
from test_send_window import STACKS, _publish_with_window  # a cache through a relay

from kvcs.transports.quic.pump import SessionPump
from kvcs.transports.quic.stack import load_stack
from kvcs.transports.quic.tls import TlsConfig
from kvcs_core.moqt.transport_io import StreamAborted, StreamData, StreamOpened

__all__ = ["tls"]  # fixture


class _Connection:
    """A client-side QUIC connection that reports ``events``, one per ``next_event``."""

    def __init__(self, events: list[Any]) -> None:
        self.configuration = SimpleNamespace(is_client=True)
        self._events = list(events)

    def next_event(self) -> Any:
        return self._events.pop(0) if self._events else None


class _Recorder:
    """A session that records the transport events fed to it and answers nothing."""

    def __init__(self) -> None:
        self.fed: list[Any] = []

    def handle_transport_event(self, event: Any, now: float) -> None:
        self.fed.append(event)

    def next_command(self) -> None:
        return None

    def next_event(self) -> None:
        return None


def _pump(events: list[Any]) -> tuple[SessionPump, _Recorder]:
    stack = load_stack("aioquic")
    session = _Recorder()
    pump = SessionPump(stack, _Connection(events), session)  # type: ignore[arg-type]
    pump.handshake_complete = True
    return pump, session


def test_a_run_reaches_the_session_as_one_piece_per_stream() -> None:
    ev = load_stack("aioquic").events
    a, b, c = 3, 7, 11  # server-initiated unidirectional streams (a client's peer's)
    pump, session = _pump(
        [
            ev.StreamDataReceived(data=b"a1", end_stream=False, stream_id=a),
            ev.StreamDataReceived(data=b"b1", end_stream=False, stream_id=b),
            ev.StreamDataReceived(data=b"a2", end_stream=False, stream_id=a),
            ev.StreamDataReceived(data=b"a3", end_stream=True, stream_id=a),
            ev.StreamReset(error_code=5, stream_id=c),
            ev.StreamDataReceived(data=b"b2", end_stream=False, stream_id=b),
            ev.StreamDataReceived(data=b"", end_stream=True, stream_id=b),
        ]
    )
    pump._take_quic_events(0.0)
    got = [
        (type(e).__name__, e.stream.n, getattr(e, "data", None), getattr(e, "fin", None))
        for e in session.fed
    ]
    assert got == [
        ("StreamOpened", 0, None, None),
        ("StreamData", 0, b"a1a2a3", True),
        ("StreamOpened", 1, None, None),
        ("StreamData", 1, b"b1", False),
        ("StreamOpened", 2, None, None),  # the reset came before the rest of b
        ("StreamAborted", 2, None, None),
        ("StreamData", 1, b"b2", True),
    ]
    assert isinstance(session.fed[0], StreamOpened) and isinstance(session.fed[5], StreamAborted)


def test_a_single_event_is_passed_on_without_a_copy() -> None:
    ev = load_stack("aioquic").events
    chunk = b"x" * 1000
    pump, session = _pump([ev.StreamDataReceived(data=chunk, end_stream=False, stream_id=3)])
    pump._take_quic_events(0.0)
    data = [e for e in session.fed if isinstance(e, StreamData)]
    assert len(data) == 1 and data[0].data is chunk


@pytest.mark.parametrize("stack", STACKS)
def test_stream_data_is_fed_in_fewer_pieces_and_arrives_intact(
    stack: str, tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = {"reported": 0, "fed": 0}
    original_take = SessionPump._take_quic_events
    original_feed = SessionPump._feed

    def take(pump: SessionPump, now: float) -> None:
        quic = pump.quic
        data_type = pump.stack.events.StreamDataReceived
        next_event = quic.next_event

        def counting() -> Any:
            e = next_event()
            if isinstance(e, data_type):
                counts["reported"] += 1
            return e

        quic.next_event = counting
        try:
            original_take(pump, now)
        finally:
            del quic.next_event

    def feed(pump: SessionPump, event: Any, now: float) -> None:
        if isinstance(event, StreamData):
            counts["fed"] += 1
        original_feed(pump, event, now)

    monkeypatch.setattr(SessionPump, "_take_quic_events", take)
    monkeypatch.setattr(SessionPump, "_feed", feed)
    _run("asyncio", lambda: _publish_with_window(stack, tls, watched=[]), 90)
    assert counts["fed"] > 0
    assert counts["fed"] < counts["reported"], counts
