"""The call protocol every kvcs machine follows, and the one pure pump that drains it.

Theory of operation
-------------------
Every machine (``MoqtSession``, later the relay, the KVCS publisher and
consumer) has four kinds of method (ARCHITECTURE.md "The call protocol"):

1. getters, pure;
2. inputs: ``handle_transport_event(event, now)`` and ``handle_timer(now)``;
   they never raise because of what a peer sent;
3. local commands (``subscribe``, ``fetch``, ``close``, ...), which raise
   ``LocalProtocolError`` on misuse;
4. outputs, drained after every input or command, in this order:
   ``next_command()`` until ``None`` (transport commands: open, write, abort,
   datagram, close), then ``get_timer()``, then ``next_event()`` until ``None``.

Object data is *pulled*: ``poll_data(max_bytes)`` returns the next write the
send scheduler chooses (at most ``max_bytes`` of stream payload), so a
transport hands the core only as much as it can send and a slow link pushes
back on the producer instead of buffering (STYLE.md R9). ``next_command()``
carries the control plane, which is small and always goes first (d21 section
5.1.2: control streams before data).

Time is a float of seconds on any monotonic clock, passed in by the caller;
``handle_timer`` is idempotent, and ``now`` must never go backwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

import attrs

from kvcs_core.moqt.transport_io import SendDatagram, TransportCommand, TransportEvent, WriteStream

E_co = TypeVar("E_co", covariant=True)
E = TypeVar("E")


class Machine(Protocol[E_co]):
    """What a transport adapter drives."""

    def handle_transport_event(self, event: TransportEvent, now: float) -> None: ...

    def handle_timer(self, now: float) -> None: ...

    def next_command(self) -> TransportCommand | None: ...

    def get_timer(self) -> float | None: ...

    def next_event(self) -> E_co | None: ...

    def poll_data(self, max_bytes: int) -> WriteStream | SendDatagram | None: ...


@attrs.frozen
class Step(Generic[E]):
    """Everything a machine had to say after one input: in the order it must be applied."""

    commands: tuple[TransportCommand, ...]
    deadline: float | None
    events: tuple[E, ...]


def drain(machine: Machine[E]) -> Step[E]:
    """Drain a machine's outputs in the protocol order (commands, timer, events)."""
    commands: list[TransportCommand] = []
    while (cmd := machine.next_command()) is not None:
        commands.append(cmd)
    deadline = machine.get_timer()
    events: list[E] = []
    while (ev := machine.next_event()) is not None:
        events.append(ev)
    return Step(tuple(commands), deadline, tuple(events))


def iter_data(machine: Machine[object], budget: int) -> Iterator[WriteStream | SendDatagram]:
    """Pull object data until ``budget`` bytes are spent or the scheduler has nothing."""
    while budget > 0:
        item = machine.poll_data(budget)
        if item is None:
            return
        budget -= item.nbytes if isinstance(item, WriteStream) else sum(len(c) for c in item.chunks)
        yield item
