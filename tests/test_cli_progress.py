"""``transports/cli/progress.py``: what ``kvcs publish`` / ``kvcs fetch`` show while they run.

The clock is a list the test advances, so the rate limit, the rate and the time
left are checked without sleeping: ``progress`` JSON lines at most every
``interval`` seconds plus one per finished layer and one at the end, with
their keys; the terminal bar with bytes, rate and time left, only on a
terminal and never with ``--json``.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from kvcs.transports.cli.progress import (
    Sample,
    TransferProgress,
    bar_text,
    progress_fields,
    rate_and_eta,
    tick,
)

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _json_progress(clock: Clock, lines: list[dict[str, Any]], **kw: Any) -> TransferProgress:
    return TransferProgress(
        "fetching", 4, json_lines=True, emit=lambda **f: lines.append(f), clock=clock, **kw
    )


def test_rate_and_time_left() -> None:
    assert rate_and_eta(Sample(1, 2 * MB, 8 * MB), 2.0) == (MB, 6.0)
    assert rate_and_eta(Sample(1, 2 * MB, None), 2.0) == (MB, None)  # total unknown
    assert rate_and_eta(Sample(0, 0, 8 * MB), 1.0) == (0.0, None)  # nothing yet
    assert rate_and_eta(Sample(0, 0, 8 * MB), 0.0) == (None, None)


def test_progress_fields() -> None:
    fields = progress_fields(Sample(2, 3 * MB, 12 * MB, (("sent", 7),)), 8, 1.5)
    assert fields == {
        "layers_done": 2,
        "layers_total": 8,
        "bytes": 3 * MB,
        "bytes_total": 12 * MB,
        "mb_per_s": 2.0,
        "seconds": 1.5,
        "eta_s": 4.5,
        "sent": 7,
    }


def test_json_lines_are_rate_limited_but_every_layer_and_the_end_are_shown() -> None:
    clock = Clock()
    lines: list[dict[str, Any]] = []
    p = _json_progress(clock, lines, interval=0.25)
    assert p.update(Sample(0, 0, None))  # the first one
    clock.t += 0.1
    assert not p.update(Sample(0, 100, None))  # too soon, same layer
    clock.t += 0.1
    assert not p.update(Sample(0, 200, None))
    clock.t += 0.06
    assert p.update(Sample(0, 300, None))  # the interval passed
    assert p.update(Sample(1, 400, 1600))  # a layer finished: shown at once
    assert not p.update(Sample(1, 500, 1600))
    clock.t += 0.01
    assert p.update(Sample(2, 800, 1600))
    assert p.update(Sample(3, 1200, 1600))
    p.finish(Sample(4, 1600, 1600))
    p.finish(Sample(4, 1600, 1600))  # once only
    assert [line["bytes"] for line in lines] == [0, 300, 400, 800, 1200, 1600]
    assert all(line["event"] == "progress" for line in lines)
    assert lines[-1]["layers_done"] == 4 and lines[-1]["eta_s"] == 0.0
    assert lines[-1]["seconds"] == pytest.approx(0.27)
    assert not p.update(Sample(4, 1600, 1600))  # nothing after the end


def test_bar_shows_bytes_rate_and_time_left() -> None:
    text = bar_text("fetching", Sample(2, 4 * 1024 * 1024, 16 * 1024 * 1024), 8, 2.0)
    assert "2/8 layers" in text
    assert "4.0 MiB/16.0 MiB" in text
    assert "2.10 MB/s" in text  # 4 MiB in 2 s
    assert "0:06 left" in text
    assert "[######" in text and text.count("#") == 6  # a quarter of 24
    done = bar_text("fetching", Sample(8, 16 * 1024 * 1024, 16 * 1024 * 1024), 8, 75.0)
    assert "left" not in done and "1:15" in done  # the elapsed time at the end


def test_bar_on_a_terminal_only_and_never_with_json() -> None:
    clock = Clock()
    out = io.StringIO()
    bar = TransferProgress("publishing", 2, json_lines=False, stream=out, tty=True, clock=clock)
    bar.update(Sample(1, 1024, 2048))
    clock.t += 1
    bar.finish(Sample(2, 2048, 2048))
    text = out.getvalue()
    assert text.startswith("\rpublishing") and text.endswith("\n")
    assert "1/2 layers" in text and "2/2 layers" in text and "KiB" in text
    quiet = io.StringIO()
    off = TransferProgress("publishing", 2, json_lines=False, stream=quiet, tty=False)
    assert not off.update(Sample(1, 1, 2)) and not off.enabled
    off.finish()
    assert quiet.getvalue() == ""
    lines: list[dict[str, Any]] = []
    with_json = TransferProgress(
        "publishing", 2, json_lines=True, emit=lambda **f: lines.append(f), stream=quiet, tty=True
    )
    with_json.update(Sample(1, 1, 2))
    assert quiet.getvalue() == "" and len(lines) == 1  # JSON on stdout, nothing on stderr


def test_tick_samples_until_stopped() -> None:
    clock = Clock()
    lines: list[dict[str, Any]] = []
    p = _json_progress(clock, lines, interval=0.5)
    seen = [0]

    def sample() -> Sample:
        seen[0] += 1
        return Sample(0, seen[0] * 10, None)

    async def sleep(seconds: float) -> None:
        clock.t += seconds

    asyncio.run(tick(sleep, p, sample, lambda: seen[0] >= 5))
    assert seen[0] == 5
    assert [line["bytes"] for line in lines] == [10, 20, 30, 40, 50]
    silent = TransferProgress("x", 1, json_lines=False, tty=False)
    asyncio.run(tick(sleep, silent, sample, lambda: False))  # returns at once: nothing shown
