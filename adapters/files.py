"""What ``kvcs`` checks about a file before reading it, without numpy.

:func:`file_kind` (is it a regular file, and if not what is it), the error every cache
file problem becomes (:class:`CacheFileError`) and the size limits. They live apart
from :mod:`kvcs.adapters.cachefile` (which re-exports them) so that the commands that
never read a cache, ``kvcs relay`` first of all, check their files without importing
numpy.
"""

from __future__ import annotations

import stat
from pathlib import Path

MAX_CACHE_BYTES = 1 << 36
"""The largest cache file read (64 GiB), and the most octets ``k`` or ``v`` may declare."""
MAX_TOKENS = 1 << 24
"""The most tokens a cache file may declare (16 Mi)."""


class CacheFileError(ValueError):
    """A cache file is missing, unreadable or inconsistent."""


def file_kind(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file ("no such file", "a directory", "a
    FIFO", ...), else None. Only ``stat``: a FIFO is never opened (it would block)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"
