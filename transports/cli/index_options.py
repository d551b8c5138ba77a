"""The KVSP index options of ``kvcs publish`` and ``kvcs fetch`` (binding 9, issue #15).

Theory of operation
-------------------
``kvcs publish --index-stride S`` announces, besides the publication, the index
namespaces and replica records of every ``S``-th prefix length and the last block
(default 1: every block; 0: none). ``kvcs fetch`` searches the index when its
whole prompt is not published (``--no-index``: never; ``--index-stride S``: look
up only multiples of ``S``, the stride the publishers use; ``--index-timeout S``:
how long one lookup waits). :func:`index_report` gives the fields ``kvcs fetch``
adds to its report: how many lookups were made and how many blocks the index
found shared.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvcs_core.kvcs.consumer import IndexOptions, IndexSearchDone, KvcsConsumer

from .common import CliError, Exit

DEFAULT_INDEX_TIMEOUT = 0.3


def add_publish_index_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--index-stride",
        type=int,
        default=1,
        metavar="S",
        help="announce KVSP index records for every S-th prefix length and the last block "
        "(default 1: every block; 0: no index)",
    )


def add_fetch_index_options(f: argparse.ArgumentParser) -> None:
    f.add_argument(
        "--no-index",
        dest="index",
        action="store_false",
        help="find only a publication of the whole prompt or of the direct shorter prefixes; "
        "never search the KVSP index",
    )
    f.add_argument(
        "--index-stride",
        type=int,
        default=1,
        metavar="S",
        help="look up only prefix lengths that are multiples of S blocks (the publishers' "
        "--index-stride; default 1)",
    )
    f.add_argument(
        "--index-timeout",
        type=float,
        default=DEFAULT_INDEX_TIMEOUT,
        metavar="S",
        help=f"how long one index lookup waits for a record (default {DEFAULT_INDEX_TIMEOUT:g})",
    )


def publish_index_stride(args: argparse.Namespace) -> int:
    """``--index-stride`` of ``kvcs publish``, checked (status 2 when negative)."""
    stride: int = args.index_stride
    if stride < 0:
        raise CliError("--index-stride must be >= 0 (0: no index)", Exit.USAGE)
    return stride


def fetch_index_options(args: argparse.Namespace) -> IndexOptions | None:
    """The consumer's :class:`IndexOptions` from the ``kvcs fetch`` options."""
    if not args.index:
        return None
    if args.index_stride < 1:
        raise CliError("--index-stride must be >= 1 for kvcs fetch", Exit.USAGE)
    if not args.index_timeout > 0:
        raise CliError("--index-timeout must be > 0", Exit.USAGE)
    return IndexOptions(stride=args.index_stride, timeout=args.index_timeout)


def index_report(consumer: KvcsConsumer, events: list[Any]) -> dict[str, Any]:
    """``index_lookups`` (0 when the index was not searched) and ``index_shared_blocks``
    (what the index found shared; null when it was not searched)."""
    searched = any(isinstance(e, IndexSearchDone) for e in events)
    return {
        "index_lookups": consumer.index_lookups,
        "index_shared_blocks": consumer.index_shared_blocks if searched else None,
    }
