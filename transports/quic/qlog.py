"""qlog files: one JSON qlog per QUIC connection, written by the stack's own logger.

Theory of operation
-------------------
aioquic and qh3 both record a connection's events (packets sent and received
with their frames, congestion and loss-recovery state, transport parameters,
the close) when their ``QuicConfiguration.quic_logger`` is set: the connection
opens a trace with ``start_trace(is_client, odcid)`` when it is created, appends
events while it lives, and hands the trace back with ``end_trace(trace)`` once
it has ended (after the closing or draining period, RFC 9000 section 10.2).
The events are the stack's qlog (draft-ietf-quic-qlog-main-schema /
quic-events, the version named in the stack's ``QLOG_VERSION``).

:func:`qlog_logger` builds such a logger on the stack's ``QuicLogger`` (its
traces kept in memory until they end) that writes each ended trace to
``<directory>/<ODCID hex>-<client|server>.qlog``: the JSON qlog container
(``qlog_format`` JSON, ``qlog_version``, one trace). The vantage point is in
the name because a client and a server of one process (a relay and its
upstream link, or the tests) log the same connection under the same Original
Destination Connection ID. Each file is written under a temporary name and
renamed, so a reader never sees half a file. A trace that cannot be written
(disk full, directory removed) is dropped with a warning; it never fails the
connection.

A connection's trace is held in memory until it ends (the stacks build it that
way), so qlog is for diagnosing, not for long transfers left running. When an
endpoint is closed (its driver's ``aclose``), the traces of connections that
have not ended yet (still closing or draining, or given up on) are written as
they are (:meth:`QuicEndpoint.flush_qlog <.endpoint.QuicEndpoint.flush_qlog>`), so
a process that exits right after its transfer still leaves its files. A
handshake the endpoint refuses over a connection limit is never a connection
of its own: :mod:`.endpoint` ends its trace at once, so it is written, not held.
picoquic (``stack="pquic"``) has its own qlog, which aiopquic does not expose:
:func:`qlog_logger` refuses that stack with :class:`QlogUnsupported`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("kvcs.quic")

QLOG_SUFFIX = ".qlog"


class QlogUnsupported(ValueError):
    """qlog was asked of a stack that cannot write it through kvcs (pquic)."""


def check_qlog_dir(directory: str | os.PathLike[str]) -> Path:
    """``directory``, created if missing; ``OSError`` when it cannot be used
    (not a directory, not writable)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{path}: not writable")
    return path


def qlog_logger(stack: str, directory: str | os.PathLike[str]) -> Any:
    """A ``quic_logger`` for ``stack`` (``"aioquic"`` or ``"qh3"``) that writes one qlog
    file per connection into ``directory`` (created if missing; module docstring)."""
    if stack == "pquic":
        raise QlogUnsupported("qlog is not supported on the pquic stack (use aioquic or qh3)")
    path = check_qlog_dir(directory)
    mod = importlib.import_module(f"{stack}.quic.logger")
    base: type = mod.QuicLogger
    version = str(mod.QLOG_VERSION)

    class _DirectoryLogger(base):  # type: ignore[misc]
        """The stack's in-memory logger; each ended trace goes to its own file."""

        directory = path

        def flush(self) -> int:
            """Write the traces of connections that have not ended yet (a process that
            stops before their closing or draining period is over); returns how many."""
            written = 0
            for trace in list(self._traces):
                self.end_trace(trace)
                written += 1
            return written

        def end_trace(self, trace: Any) -> None:
            try:
                _write_trace(path, version, trace.to_dict())
            except (OSError, TypeError, ValueError) as exc:
                log.warning("qlog: a trace was not written to %s: %s", path, exc)
            finally:
                if trace in self._traces:
                    self._traces.remove(trace)

    return _DirectoryLogger()


def _write_trace(directory: Path, version: str, trace: dict[str, Any]) -> Path:
    odcid = str(trace.get("common_fields", {}).get("ODCID", "unknown"))
    vantage = str(trace.get("vantage_point", {}).get("type", "unknown"))
    target = directory / f"{odcid}-{vantage}{QLOG_SUFFIX}"
    tmp = directory / f".{target.name}.part"
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(
                {"qlog_format": "JSON", "qlog_version": version, "traces": [trace]},
                f,
                separators=(",", ":"),
            )
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


__all__ = ["QLOG_SUFFIX", "QlogUnsupported", "check_qlog_dir", "qlog_logger"]
