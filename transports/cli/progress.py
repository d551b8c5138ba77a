"""Progress of a transfer for operators: ``progress`` JSON lines or a terminal bar.

Theory of operation
-------------------
``kvcs publish`` and ``kvcs fetch`` each feed one :class:`TransferProgress` with
samples (layers done, bytes so far) whenever something changed and from a
ticker (:func:`tick`) a few times a second; it decides what an operator sees:

* with ``--json``, a ``progress`` line on stdout (:func:`progress_fields`:
  ``layers_done``, ``layers_total``, ``bytes``, ``bytes_total``, ``mb_per_s``,
  ``seconds``, ``eta_s``, plus what the command adds) at most every
  ``interval`` seconds (default :data:`DEFAULT_INTERVAL`), and at once when a
  layer is done (each layer count is reported once), and a last one by
  :meth:`TransferProgress.finish`;
* otherwise, when stderr is a terminal, one line redrawn in place on stderr
  (:func:`bar_text`): the bar over layers, the layer count, bytes so far (of
  the total where known), the rate and the time left; nothing when stderr is
  not a terminal.

The rate is the mean over the whole transfer so far (``bytes / seconds``), and
the time left is ``(bytes_total - bytes) / rate`` where the total is known and
the rate positive (``null`` otherwise). The clock is passed in (the commands
give ``time.monotonic``), so the arithmetic is tested without sleeping.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import attrs

DEFAULT_INTERVAL = 0.25
"""Seconds between two ``progress`` lines (or bar redraws) at most, layer ends apart."""

BAR_WIDTH = 24


@attrs.frozen
class Sample:
    """One observation of a transfer."""

    layers_done: int
    bytes_done: int
    bytes_total: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    """Further ``(key, value)`` pairs of the command's ``progress`` line."""


def rate_and_eta(sample: Sample, seconds: float) -> tuple[float | None, float | None]:
    """Mean rate in bytes per second and seconds left (``None`` where unknown)."""
    if seconds <= 0:
        return None, None
    rate = sample.bytes_done / seconds
    if sample.bytes_total is None or rate <= 0:
        return rate, None
    return rate, max(0.0, (sample.bytes_total - sample.bytes_done) / rate)


def progress_fields(sample: Sample, layers_total: int, seconds: float) -> dict[str, Any]:
    """The keys of a ``progress`` JSON line (``event`` excluded)."""
    rate, eta = rate_and_eta(sample, seconds)
    return {
        "layers_done": sample.layers_done,
        "layers_total": layers_total,
        "bytes": sample.bytes_done,
        "bytes_total": sample.bytes_total,
        "mb_per_s": None if rate is None else round(rate / 1e6, 2),
        "seconds": round(seconds, 3),
        "eta_s": None if eta is None else round(eta, 1),
        **dict(sample.extra),
    }


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """``75`` -> ``1:15``; ``3725`` -> ``1:02:05``."""
    whole = round(s)
    h, rest = divmod(whole, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def bar_text(label: str, sample: Sample, layers_total: int, seconds: float) -> str:
    """The terminal line: ``fetching [#####.....] 3/32 layers  12.0 MiB/128.0 MiB  45.10
    MB/s  0:02 left``."""
    total = max(layers_total, 1)
    filled = min(BAR_WIDTH, int(BAR_WIDTH * sample.layers_done / total))
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    rate, eta = rate_and_eta(sample, seconds)
    amount = human_bytes(sample.bytes_done)
    if sample.bytes_total is not None:
        amount += f"/{human_bytes(sample.bytes_total)}"
    parts = [f"{label:<11} [{bar}] {sample.layers_done}/{layers_total} layers", amount]
    if rate is not None:
        parts.append(f"{rate / 1e6:.2f} MB/s")
    if eta is not None and sample.layers_done < layers_total:
        parts.append(f"{human_seconds(eta)} left")
    else:
        parts.append(human_seconds(seconds))
    return "  ".join(parts)


class TransferProgress:
    """What one transfer shows (module docstring).

    Args:
        label: the bar's label (``publishing``, ``fetching``).
        layers_total: layers of the transfer.
        json_lines: write ``progress`` lines with ``emit`` (``--json``) instead of a bar.
        emit: writes one JSON line (the command's ``json_line``).
        stream: where the bar goes (stderr); ``tty``: whether it is a terminal (default:
            ask the stream).
        clock: seconds, monotonic; ``start``: when the transfer began (default: now).
        interval: the least time between two lines or redraws, layer ends apart.
    """

    def __init__(
        self,
        label: str,
        layers_total: int,
        *,
        json_lines: bool,
        emit: Callable[..., None] | None = None,
        stream: TextIO | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        self.label = label
        self.layers_total = layers_total
        self.json_lines = json_lines
        self.emit = emit or _print_json
        self.stream = stream if stream is not None else sys.stderr
        self.bar = not json_lines and (self.stream.isatty() if tty is None else tty)
        self.clock = clock
        self.start = clock() if start is None else start
        self.interval = interval
        self.last: Sample | None = None
        self.lines = 0
        """``progress`` lines written (or bar redraws) so far."""
        self._shown_at: float | None = None
        self._shown_layers = -1
        self._finished = False

    @property
    def enabled(self) -> bool:
        return self.json_lines or self.bar

    def update(self, sample: Sample, *, force: bool = False) -> bool:
        """Note ``sample``; show it when due (module docstring). Whether it was shown."""
        self.last = sample
        if not self.enabled or self._finished:
            return False
        now = self.clock()
        new_layer = sample.layers_done > self._shown_layers
        due = self._shown_at is None or now - self._shown_at >= self.interval
        if not (force or new_layer or due):
            return False
        self._show(sample, now)
        return True

    def finish(self, sample: Sample | None = None) -> None:
        """Show the last sample once more (the end of the transfer) and end the bar line."""
        if self._finished:
            return
        sample = sample or self.last
        if sample is not None and self.enabled:
            self._show(sample, self.clock())
        if self.bar and self.lines:
            self.stream.write("\n")
            self.stream.flush()
        self._finished = True

    def _show(self, sample: Sample, now: float) -> None:
        seconds = max(0.0, now - self.start)
        self._shown_at = now
        self._shown_layers = sample.layers_done
        self.lines += 1
        if self.json_lines:
            self.emit(event="progress", **progress_fields(sample, self.layers_total, seconds))
            return
        text = bar_text(self.label, sample, self.layers_total, seconds)
        self.stream.write("\r" + text + "\x1b[K")  # erase what a longer line left
        self.stream.flush()


def _print_json(**fields: Any) -> None:
    print(json.dumps(fields, separators=(",", ":")), flush=True)


TICK_STEP = 0.05
"""The longest :func:`tick` sleeps at once: how late it notices that the transfer ended."""


async def tick(
    sleep: Callable[[float], Awaitable[None]],
    progress: TransferProgress,
    sample: Callable[[], Sample],
    stop: Callable[[], bool],
    clock: Callable[[], float] | None = None,
) -> None:
    """Offer ``progress`` a fresh sample every ``progress.interval`` seconds until
    ``stop()``, looking at ``stop()`` every :data:`TICK_STEP` seconds (so that whoever
    waits for both the transfer and this returns soon after the transfer ended);
    returns at once when nothing is shown."""
    if not progress.enabled:
        return
    now = clock or progress.clock
    step = min(TICK_STEP, progress.interval)
    next_at = now()
    while not stop():
        if now() >= next_at:
            progress.update(sample())
            next_at = now() + progress.interval
        await sleep(step)


__all__ = [
    "DEFAULT_INTERVAL",
    "TICK_STEP",
    "Sample",
    "TransferProgress",
    "bar_text",
    "progress_fields",
    "rate_and_eta",
    "tick",
]
