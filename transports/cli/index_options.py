"""The KVSP index options of ``kvcs publish`` and ``kvcs fetch`` (binding 9, issue #15).

Theory of operation
-------------------
``kvcs publish --index-stride S`` announces, besides the publication, the index
namespaces and replica records of every ``S``-th prefix length and the last block
(default 1: every block; 0: none), ``S`` doubled until at most 512 records remain
(:data:`~kvcs_core.kvcs.index.DEFAULT_MAX_INDEX_RECORDS`). ``kvcs fetch`` searches the
index when its whole prompt is not published (``--no-index``: never; ``--index-stride
S``: look up only multiples of ``S``, which finds publishers whose stride is ``S``
times a power of two; ``--index-timeout S``: how long one lookup waits for a record
once the relay has answered, :attr:`~kvcs_core.kvcs.consumer.IndexOptions.timeout`).
:func:`index_report` gives the fields ``kvcs fetch`` adds to its report: how many
lookups were made and how many blocks the index found shared. ``kvcs ls --index``
lists the index entries (``kvcs-idx-1`` namespaces) after the publications, as a
separate list.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvcs_core.kvcs.consumer import IndexOptions, IndexSearchDone, KvcsConsumer
from kvcs_core.kvcs.index import INDEX_NAMESPACE_TAG, IndexNamespace
from kvcs_core.kvcs.names import KVCS_NAMESPACE_TAG
from kvcs_core.wire.names import TrackNamespace

from .common import CliError, Exit, format_namespace, json_line

DEFAULT_INDEX_TIMEOUT = 0.3


def add_publish_index_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--index-stride",
        type=int,
        default=1,
        metavar="S",
        help="announce KVSP index records for every S-th prefix length and the last block "
        "(default 1: every block; 0: no index); S is doubled until at most 512 records "
        "remain (each is a request the relay counts)",
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
        help="look up only prefix lengths that are multiples of S blocks (finds publishers "
        "whose --index-stride, as doubled, is S times a power of two; default 1)",
    )
    f.add_argument(
        "--index-timeout",
        type=float,
        default=DEFAULT_INDEX_TIMEOUT,
        metavar="S",
        help="how long one index lookup waits for a record after its last progress (the "
        "relay's answer, an announcement; unanswered requests are awaited longer; default "
        f"{DEFAULT_INDEX_TIMEOUT:g})",
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


def add_ls_index_options(ls: argparse.ArgumentParser) -> None:
    ls.add_argument(
        "--index",
        action="store_true",
        help="also list the KVSP index entries (kvcs-idx-1 namespaces under the same scope "
        "and descriptor fields), apart from the publications",
    )


def index_listing_prefix(prefix: TrackNamespace) -> TrackNamespace:
    """The index prefix that goes with a ``kvcs ls --prefix``: ``kvcs-idx-1`` and the
    prefix's Scope ID / Compatibility ID fields when it is a ``kvcs-1`` prefix."""
    fields = prefix.fields
    rest = fields[1:3] if fields[:1] == (KVCS_NAMESPACE_TAG,) else ()
    return TrackNamespace((INDEX_NAMESPACE_TAG, *rest))


def describe_index_entries(
    args: argparse.Namespace, entries: list[TrackNamespace], prefix: TrackNamespace
) -> None:
    """One line per index entry: JSON with ``"kind": "index"``, or text after a heading."""
    if not args.json:
        print(f"index entries under {format_namespace(prefix)!r}:")
    for ns in entries:
        entry = IndexNamespace.try_parse(ns)
        fields: dict[str, Any] = {"kind": "index", "namespace": format_namespace(ns)}
        if entry is not None:
            fields.update(
                scope_id=entry.scope_id.hex(),
                compat_id=entry.compat_id.hex(),
                block_key=entry.block_key.hex(),
                publication_id=entry.publication_id.hex(),
            )
        if args.json:
            json_line(**fields)
        elif entry is not None:
            print(
                f"  block key {fields['block_key'][:16]}…  publication {fields['publication_id']}"
            )
        else:
            print(f"  {fields['namespace']}")
    if not args.json:
        print(f"{len(entries)} index entr{'y' if len(entries) == 1 else 'ies'}", file=sys.stderr)
