"""The ``kvcs`` command line.

Subcommands
-----------
``kvcs demo``
    The main job on an embedded default: a relay (``kvcs relay`` in a child
    process), a producer publishing a synthetic Llama-shaped cache layer by layer
    and several consumers (live, mid-production, late, partial prefix), all
    over real QUIC on 127.0.0.1; each cache is verified bit for bit and a table
    of the figures is printed (:mod:`.demo`).
``kvcs relay``
    A caching MOQT draft-22 relay: ``kvcs relay --listen 127.0.0.1:4443 --self-signed``.
``kvcs publish URL``
    Publish a cache (``--file`` or ``--synthetic``) through a relay.
``kvcs fetch URL``
    Retrieve the cache of a prompt (named by ``--file`` or the synthetic options),
    verify it, report, optionally write it (``--out``).
``kvcs fetch URL --tokens-file TOKENS --descriptor DESC``
    The same from the prompt's token IDs and the compatibility descriptor alone.
``kvcs prefill URL --model DIR --prompt TEXT``
    Run a local Hugging Face model on a prompt and publish its KV cache layer by layer
    while the prefill runs (:mod:`.model`; needs ``kvcs[transformers]``).
``kvcs generate URL --model DIR --prompt TEXT --max-new-tokens N``
    Retrieve the prompt's cache, generate while it arrives, print the text and the time
    to first token against full recompute (:mod:`.model`).
``kvcs ls URL``
    The namespaces announced under a prefix (default ``kvcs-1``).
``kvcs descriptor CACHE``
    A cache file's compatibility descriptor as JSON (``--tokens-out``: its tokens).
``kvcs token issue|inspect|keygen``
    Authorization tokens (CAT-4-MOQT) and issuer keys (:mod:`.token`); ``kvcs relay
    --auth-keys FILE`` enforces them.
``kvcs selfcheck``
    The codec against the MOQT byte vectors (:mod:`.selfcheck`).

Exit statuses (:class:`~.common.Exit`): 0 success, 1 the job failed (a cache
incomplete or different), 2 bad arguments, 3 network (unreachable, refused,
lost, address in use), 4 TLS (certificate or key), 5 files, 130 interrupted.
Every error is one line on stderr (``kvcs: error: ...``); ``-v`` adds debug
logging (the standard ``logging`` module, logger names ``kvcs.*``).

Every option may also come from ``KVCS_<OPTION>`` environment variables and a TOML
file (``--config``); the command line wins, then the environment, then the file
(:mod:`.config`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kvcs.adapters.files import file_kind
from kvcs_core.wire.codes import ALPN

from . import commands, config, demo, index_options, model, token
from .common import (
    CliError,
    Exit,
    add_cache_options,
    add_client_tls_options,
    add_encryption_options,
    add_ops_options,
    add_token_options,
    add_transport_options,
    descriptor_command,
    fail,
    quiet_broken_pipe,
    run,
)
from .selfcheck import SHARED_ENV, VECTOR_FILE, selfcheck


def _version() -> str:
    try:
        return metadata.version("kvcs")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcs",
        description="Stream LLM KV caches layer by layer over MOQT (draft-22).",
        epilog=config.HELP_EPILOG,
    )
    parser.add_argument(
        "--version", action="version", version=f"kvcs {_version()} (MOQT draft-22, ALPN {ALPN})"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more logging on stderr (-v info, -vv debug)",
    )
    config_help = (
        f"read options from this TOML file (default: ${config.CONFIG_ENV}, else none); "
        "the command line and KVCS_* variables win over it"
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help=config_help)
    # the common options are accepted after the subcommand too (kvcs relay -v ...)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="more logging on stderr (-v info, -vv debug)",
    )
    common.add_argument(
        "--config", type=Path, default=argparse.SUPPRESS, metavar="FILE", help=config_help
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # every subcommand: -v and --config after it too, and where its options may come from
    each: dict[str, Any] = {"parents": [common], "epilog": config.HELP_EPILOG}

    d = sub.add_parser("demo", help="relay + producer + consumers over QUIC on 127.0.0.1", **each)
    demo.add_options(d)
    add_transport_options(d)

    r = sub.add_parser("relay", help="run a caching MOQT relay", **each)
    r.add_argument(
        "--listen",
        default="127.0.0.1:4443",
        metavar="HOST:PORT",
        help="UDP address to listen on (default 127.0.0.1:4443; port 0: any)",
    )
    r.add_argument(
        "--self-signed",
        action="store_true",
        help="generate a certificate for localhost/127.0.0.1 (local use)",
    )
    r.add_argument("--cert", type=Path, metavar="PEM", help="certificate chain")
    r.add_argument("--key", type=Path, metavar="PEM", help="private key of the certificate")
    r.add_argument(
        "--cert-dir",
        type=Path,
        metavar="DIR",
        help="where --self-signed writes ca.pem, cert.pem, key.pem (default: a "
        "new temporary directory)",
    )
    r.add_argument("--upstream", metavar="URL", help="parent relay (moqt://host:port) for trees")
    r.add_argument("--upstream-ca", type=Path, metavar="PEM", help="CA to trust for --upstream")
    r.add_argument(
        "--upstream-insecure",
        action="store_true",
        help="do not verify the upstream relay's certificate",
    )
    r.add_argument(
        "--cache-budget",
        type=commands.parse_size,
        default=1 << 30,
        metavar="SIZE",
        help="bytes of objects to cache (default 1GiB; e.g. 512MiB)",
    )
    r.add_argument("--run-for", type=float, metavar="S", help="stop after S seconds")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    add_transport_options(r)
    add_ops_options(r, relay=True)
    token.add_relay_auth_options(r)
    add_token_options(r, upstream=True)

    p = sub.add_parser("publish", help="publish a KV cache through a relay", **each)
    p.add_argument("url", metavar="URL", help="moqt://host:port of the relay")
    add_cache_options(p, role="publish")
    p.add_argument("--publication-id", metavar="HEX", help="16 octets (default: random)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="declare the cache bit-reproducible (manifest 'deterministic')",
    )
    p.add_argument(
        "--layer-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="pause between layers (simulates prefill speed)",
    )
    p.add_argument(
        "--wait-for-subscriber",
        type=float,
        metavar="S",
        help="before the first layer, wait up to S seconds until every data track is "
        "subscribed (a live consumer, directly or through relays)",
    )
    p.add_argument(
        "--digest",
        action="store_true",
        help="with --json: add the SHA-256 of the published K/V sections ('digest')",
    )
    p.add_argument(
        "--preload",
        action="store_true",
        help="read (or make) every layer of the cache and compute --digest before "
        "connecting, so that the timing covers the transfer alone, as for an engine "
        "whose cache is already in memory (default: one layer at a time as it is sent)",
    )
    p.add_argument(
        "--serve-for",
        type=float,
        metavar="S",
        help="after publishing, serve S more seconds then exit (default: until interrupted)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_encryption_options(p, producer=True)
    index_options.add_publish_index_options(p)
    add_client_tls_options(p)
    add_transport_options(p)
    add_ops_options(p)

    f = sub.add_parser("fetch", help="retrieve, verify and report a KV cache", **each)
    f.add_argument("url", metavar="URL", help="moqt://host:port of the relay")
    add_cache_options(f, role="fetch")
    f.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="URL",
        help="another relay to use at the same time (recovery when one fails); repeatable",
    )
    f.add_argument(
        "--prompt-tokens",
        type=int,
        metavar="N",
        help="use only the first N tokens of the prompt (a shorter prompt)",
    )
    f.add_argument("--out", type=Path, metavar="PATH", help="write the cache (.npz/.safetensors)")
    f.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="do not compare with the source cache (--file or synthetic)",
    )
    f.add_argument(
        "--fetch-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="give up after S seconds (default 120)",
    )
    f.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a session that delivers nothing for S seconds is given up for another (default 10)",
    )
    f.add_argument(
        "--recovery-time",
        type=float,
        default=2.0,
        metavar="S",
        help="how long to try to recover missing objects (default 2)",
    )
    f.add_argument(
        "--digest",
        action="store_true",
        help="with --json: add the SHA-256 of the received K/V sections ('digest')",
    )
    f.add_argument("--json", action="store_true", help="machine-readable output")
    add_encryption_options(f, producer=False)
    index_options.add_fetch_index_options(f)
    add_client_tls_options(f)
    add_transport_options(f)
    add_ops_options(f)

    model.add_prefill(sub, each)
    model.add_generate(sub, each)

    ls = sub.add_parser("ls", help="list the namespaces announced under a prefix", **each)
    ls.add_argument("url", metavar="URL", help="moqt://host:port of the relay")
    ls.add_argument(
        "--prefix",
        default="kvcs-1",
        help="namespace prefix: fields joined by '/', a field 0x<hex> is binary (default kvcs-1)",
    )
    ls.add_argument(
        "--quiet",
        type=float,
        default=0.3,
        metavar="S",
        help="stop once no new namespace came for S seconds",
    )
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    index_options.add_ls_index_options(ls)
    add_client_tls_options(ls)
    add_transport_options(ls)

    desc = sub.add_parser(
        "descriptor",
        help="print the compatibility descriptor of a cache file (JSON)",
        **each,
    )
    desc.add_argument("cache", type=Path, metavar="CACHE", help=".npz or .safetensors cache file")
    desc.add_argument(
        "--out", type=Path, metavar="PATH", help="write the JSON to PATH instead of stdout"
    )
    desc.add_argument(
        "--tokens-out",
        type=Path,
        metavar="PATH",
        help="also write the cache's token IDs (.npy, .json, or text for any other name), "
        "as kvcs fetch --tokens-file reads them",
    )

    token.add_token_command(sub, each)

    check = sub.add_parser("selfcheck", help="encode and decode every MOQT byte vector", **each)
    check.add_argument(
        "--vectors",
        type=Path,
        metavar="FILE",
        help=f"the vector file (default: ${SHARED_ENV}/spec/{VECTOR_FILE},"
        f" else ../shared/spec/{VECTOR_FILE} beside the repository)",
    )
    check.add_argument(
        "--builtin-only", action="store_true", help="skip the vector file, run the built-in set"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:  # the command line, then KVCS_* variables, then the --config file, then defaults
        args, sources = config.parse_args(build_parser, argv, os.environ)
    except CliError as exc:
        return fail(str(exc), exc.status)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(
        level=level, format="kvcs: %(levelname)s: %(name)s: %(message)s", stream=sys.stderr
    )
    if args.verbose < 2:
        logging.getLogger("quic").setLevel(logging.ERROR)  # aioquic's per-packet chatter
    for key, where in sources.items():
        logging.getLogger("kvcs.cli").info("--%s from %s", key, where)
    try:
        with quiet_broken_pipe():
            if args.command == "descriptor":
                return descriptor_command(args)
            if args.command == "token":
                return token.token_command(args)
            if args.command == "selfcheck":
                if args.vectors is not None and (kind := file_kind(args.vectors)) is not None:
                    return fail(f"--vectors: {args.vectors}: {kind}", Exit.FILE)
                return selfcheck(args.vectors, builtin_only=args.builtin_only)
            job = {
                "relay": commands.relay,
                "publish": commands.publish,
                "fetch": commands.fetch,
                "ls": commands.ls,
                "prefill": model.prefill,
                "generate": model.generate,
                "demo": demo.demo,
            }[args.command]
            return run(args, lambda b: job(b, args))
    except CliError as exc:
        return fail(str(exc), exc.status)
    except KeyboardInterrupt:
        print("kvcs: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except commands.Terminated:
        return Exit.OK
