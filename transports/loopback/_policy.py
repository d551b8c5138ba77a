"""Small value types of the loopback network: errors, chunking policies, log records."""

import random
from collections.abc import Iterator
from typing import ClassVar, NamedTuple

import attrs

from kvcs_core.moqt.transport_io import StreamRef, TransportEvent


class LoopbackError(AssertionError):
    """A machine broke the transport contract, or the network was misused.

    Subclass of ``AssertionError`` because it is always a bug in the code under
    test (writing after FIN, writing on a receive-only stream, ``poll_data``
    returning more than its budget, ...) and tests should fail loudly on it.
    """


class Livelock(LoopbackError):
    """The network cannot reach the caller's goal: nothing is pending, or steps run out."""


class LoopbackTimeout(LoopbackError):
    """More virtual time passed than the caller allowed (``max_time``)."""


class Sent(NamedTuple):
    """One write or datagram leaving an endpoint (see ``Endpoint.sent_log``)."""

    time: float
    """Virtual time its first byte left (bandwidth-paced data: its slot on the wire)."""
    stream: StreamRef | None
    """The *sender's* ref for the stream; ``None`` for a datagram."""
    nbytes: int
    pulled: bool
    """``True``: pulled by ``poll_data`` (counts against bandwidth); ``False``: a control
    command from ``next_command`` (free, see the module docstring)."""
    sender: str
    """Label of the sending endpoint, ``"<link>.client"`` or ``"<link>.server"``."""


class TraceRecord(NamedTuple):
    """One transport event handed to a machine (``Network(trace=True)``)."""

    time: float
    endpoint: str
    event: TransportEvent


@attrs.frozen
class Chunking:
    """How the bytes of a stream are cut into ``StreamData`` events at the receiver.

    Use the constants :attr:`WHOLE` (each ``WriteStream`` arrives as one event, its
    chunks joined) and :attr:`BYTEWISE` (one byte per event), or
    :meth:`random` (seeded random pieces of 1..``max_size`` bytes). A FIN rides on
    the last piece of the write that carried it; an empty write with FIN arrives as
    one empty ``StreamData(fin=True)``; an empty write without FIN is not delivered.
    """

    kind: str = "whole"
    seed: int | None = None
    max_size: int = 64

    WHOLE: ClassVar["Chunking"]
    BYTEWISE: ClassVar["Chunking"]

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("whole", "bytewise", "random"):
            raise ValueError(f"unknown chunking kind {self.kind!r}")
        if self.max_size < 1:
            raise ValueError("max_size must be at least 1")

    @classmethod
    def random(cls, seed: int | None = None, max_size: int = 64) -> "Chunking":
        """Seeded random splits of 1..``max_size`` bytes.

        With ``seed=None`` the seed is derived from the ``Network`` seed and the
        link's index, so a network is still reproducible as a whole.
        """
        return cls("random", seed, max_size)

    def splitter(self, default_seed: str, direction: int) -> "Splitter":
        """A stateful splitter for one direction (0: client->server, 1: back) of a link."""
        base = default_seed if self.seed is None else str(self.seed)
        return Splitter(self, f"{base}/{direction}")


Chunking.WHOLE = Chunking("whole")
Chunking.BYTEWISE = Chunking("bytewise")


class Splitter:
    """Cuts successive deliveries of one link direction; random state carries over."""

    __slots__ = ("_kind", "_max", "_rng")

    def __init__(self, chunking: Chunking, seed: str) -> None:
        self._kind = chunking.kind
        self._max = chunking.max_size
        # A str seed is hashed with SHA-512 by random.Random: stable across runs
        # and interpreters (unlike hash()), so splits are reproducible.
        self._rng = random.Random(seed) if chunking.kind == "random" else None

    @property
    def whole(self) -> bool:
        """Every write arrives in one piece (``Chunking.WHOLE``)."""
        return self._kind == "whole"

    def pieces(self, n: int) -> Iterator[tuple[int, int]]:
        """``(start, end)`` offsets covering ``0..n``; nothing for ``n == 0``."""
        if self._kind == "whole":
            if n:
                yield 0, n
            return
        if self._kind == "bytewise":
            for i in range(n):
                yield i, i + 1
            return
        assert self._rng is not None
        pos = 0
        while pos < n:
            end = min(n, pos + self._rng.randint(1, self._max))
            yield pos, end
            pos = end
