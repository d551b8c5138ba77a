"""One typed error out of an exception group (trio's nurseries, any trio version).

Theory of operation
-------------------
trio 0.25 and later wrap every exception leaving a nursery in an
``ExceptionGroup`` (``strict_exception_groups=True``, the only behaviour from
then on); older trio raised a lone exception bare and several as a
``MultiError`` (a ``BaseExceptionGroup`` since trio 0.22). kvcs promises its
callers one typed error (:class:`~.api.ConnectError`, ``TimeoutError``,
``KeyboardInterrupt``, ...), so every nursery of the trio binding is wrapped in
:func:`single_errors`, and the command line applies the same to ``trio.run``.

Which exception is kept (:func:`sole`): the group is flattened; an interrupt
(``KeyboardInterrupt``, ``SystemExit``) wins, then the first leaf that is not a
cancellation, then the first leaf. The others are logged at debug level; a lone
leaf is simply re-raised, traceback intact.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger("kvcs.quic")


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions in ``exc``, nested groups flattened (``[exc]`` for a plain one)."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    out: list[BaseException] = []
    for e in exc.exceptions:
        out.extend(leaves(e))
    return out


def _cancelled(exc: BaseException) -> bool:
    return type(exc).__name__ == "Cancelled" and type(exc).__module__.startswith("trio")


def sole(exc: BaseException) -> BaseException:
    """The one exception a caller should see for ``exc`` (module docstring)."""
    found = leaves(exc)
    if not found:
        return exc
    for e in found:
        if isinstance(e, KeyboardInterrupt | SystemExit):
            return e
    for e in found:
        if not _cancelled(e):
            return e
    return found[0]


@contextlib.contextmanager
def single_errors() -> Iterator[None]:
    """Re-raise an exception group leaving the block as its :func:`sole` exception."""
    try:
        yield
    except BaseExceptionGroup as group:
        one = sole(group)
        for other in leaves(group):
            if other is not one:
                log.debug("also raised (not reported): %r", other)
        context = one.__context__
        try:
            raise one
        finally:
            one.__context__ = context
            del group, one
