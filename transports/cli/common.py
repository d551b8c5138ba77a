"""Shared pieces of the ``kvcs`` subcommands: options, exit codes, errors, loops, progress,
and what a command reads: a cache (``--file`` or synthetic), or a prompt alone (its token
IDs from ``--tokens-file`` and its compatibility descriptor from ``--descriptor``), which
:func:`descriptor_command` (``kvcs descriptor CACHE``) extracts from a cache file."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs

from kvcs.adapters.files import MAX_TOKENS, CacheFileError, file_kind
from kvcs.transports.quic import asyncio_binding
from kvcs.transports.quic.api import ConnectError
from kvcs.transports.quic.config import DEFAULT_IDLE_TIMEOUT, UrlError
from kvcs.transports.quic.groups import single_errors
from kvcs.transports.quic.qlog import check_qlog_dir
from kvcs.transports.quic.stack import DEFAULT_STACK, STACKS, StackUnavailable
from kvcs.transports.quic.tls import TlsConfig, TlsError
from kvcs_core.auth.cat import token_from_text
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.secobj import DEFAULT_SUITE, SUITE_NAMES, CipherSuite
from kvcs_core.wire.names import TrackNamespace

if TYPE_CHECKING:
    from kvcs.adapters.cachefile import CacheLayers

# numpy, the cache files and trio are imported where they are used, not here: ``kvcs
# relay`` holds no arrays and runs on asyncio unless told otherwise, and each of them
# costs an idle process 10-20 MiB and part of a second to start.

log = logging.getLogger("kvcs.cli")


class Exit:
    """Exit statuses that scripts can rely on."""

    OK = 0
    FAILED = 1
    """The job ran but did not succeed (a retrieval incomplete or not bit-identical)."""
    USAGE = 2
    """Bad arguments (argparse's own code)."""
    NETWORK = 3
    """Unreachable peer, refused or lost connection, bad URL, address in use."""
    TLS = 4
    """Certificate or key missing, unusable, or not trusted by the peer."""
    FILE = 5
    """A file to read is missing or malformed, or one to write cannot be."""
    INTERRUPTED = 130


class CliError(Exception):
    """A one-line error for the user, with its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


DEFAULT_KID = "producer"
"""The key ID used with --sign-key / --producer-key when --kid is not given."""

DEFAULT_SCOPE_KEY = bytes(32)
"""The scope key used when none is given: fine for demos, never for real tenants."""


# --- options ----------------------------------------------------------------------------


def add_transport_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport")
    g.add_argument(
        "--stack",
        choices=STACKS,
        default=DEFAULT_STACK,
        help=f"QUIC implementation (default {DEFAULT_STACK})",
    )
    g.add_argument(
        "--loop", choices=("asyncio", "trio"), default="asyncio", help="event loop to run on"
    )
    g.add_argument(
        "--datagram-size",
        type=int,
        metavar="BYTES",
        help="largest UDP payload QUIC may send (default: the stack's, 1200-1280)",
    )
    g.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help=f"QUIC idle timeout: a peer silent this long is gone (default "
        f"{DEFAULT_IDLE_TIMEOUT:g}; quiet sessions are kept alive with PINGs)",
    )


def add_ops_options(p: argparse.ArgumentParser, *, relay: bool = False) -> None:
    """What operators watch: ``--qlog-dir`` (every command that opens QUIC connections),
    ``--metrics`` and ``--stats-interval`` (relays)."""
    g = p.add_argument_group("observability")
    g.add_argument(
        "--qlog-dir",
        type=Path,
        metavar="DIR",
        help="write a qlog file per QUIC connection into DIR (created if missing) when the "
        "connection ends (aioquic and qh3)",
    )
    if not relay:
        return
    g.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 127.0.0.1:9464; "
        "port 0: any, named in --json's 'listening' line)",
    )
    g.add_argument(
        "--stats-interval",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="seconds between two 'stats' lines with --json (default 5)",
    )


def qlog_dir(args: argparse.Namespace) -> str | None:
    """``--qlog-dir``, checked before any connection: status 2 on pquic, 5 when the
    directory cannot be made or written."""
    directory = getattr(args, "qlog_dir", None)
    if directory is None:
        return None
    if args.stack == "pquic":
        raise CliError("--qlog-dir is not supported on the pquic stack (use aioquic or qh3)",
                       Exit.USAGE)  # fmt: skip
    try:
        check_qlog_dir(directory)
    except OSError as exc:
        raise CliError(f"--qlog-dir: {directory}: {exc.strerror or exc}", Exit.FILE) from None
    return str(directory)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def add_client_tls_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS")
    g.add_argument("--ca", type=Path, metavar="PEM", help="also trust this CA certificate")
    g.add_argument(
        "-k",
        "--insecure",
        action="store_true",
        help="do not verify the server certificate (local tests only)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for the connection (default 10)",
    )
    add_token_options(p)


def add_token_options(p: argparse.ArgumentParser, *, upstream: bool = False) -> None:
    """``--token TEXT`` / ``--token-file FILE``: the CAT this command presents in its
    CLIENT_SETUP (a relay: to its ``--upstream``). README "Authorization"."""
    g = p.add_argument_group("authorization")
    one = g.add_mutually_exclusive_group()
    whom = "the upstream relay" if upstream else "the relay"
    one.add_argument(
        "--token",
        metavar="TEXT",
        help=f"CAT authorization token (base64url, as 'kvcs token issue' prints it) for {whom}",
    )
    one.add_argument(
        "--token-file", type=Path, metavar="FILE", help="file holding the token text"
    )


def client_token(args: argparse.Namespace) -> bytes | None:
    """The token of ``--token`` / ``--token-file`` (status 2 if not base64url text)."""
    text = getattr(args, "token", None)
    what = "--token"
    path = getattr(args, "token_file", None)
    if path is not None:
        what = f"--token-file {path}"
        try:
            text = read_file(path).decode("ascii")
        except UnicodeDecodeError:
            raise CliError(f"{what}: not base64url text", Exit.USAGE) from None
    if text is None:
        return None
    try:
        return token_from_text(text)
    except ValueError as exc:
        raise CliError(f"{what}: {exc}", Exit.USAGE) from None


def add_cache_options(p: argparse.ArgumentParser, *, role: str) -> None:
    g = p.add_argument_group("cache")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--file",
        type=Path,
        metavar="PATH",
        help=".npz or .safetensors cache file (k, v, tokens, descriptor)"
        + (": its descriptor and tokens name the prompt to fetch" if role == "fetch" else ""),
    )
    src.add_argument(
        "--synthetic",
        action="store_true",
        help="a synthetic Llama-shaped cache (the default when no --file)",
    )
    if role == "fetch":
        src.add_argument(
            "--tokens-file",
            type=Path,
            metavar="PATH",
            help="the prompt's token IDs alone (.npy: a 1-D integer array; .json: a list "
            "of integers; any other name: integers separated by whitespace); with "
            "--descriptor, instead of a cache file (nothing to compare with)",
        )
        g.add_argument(
            "--descriptor",
            type=Path,
            metavar="PATH",
            help="with --tokens-file: the compatibility descriptor, a JSON file (as "
            "'kvcs descriptor CACHE' prints it) or a .npz/.safetensors cache file holding it",
        )
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--block-tokens", type=int, default=16)
    g.add_argument("--tokens", type=int, default=256, help="prompt length of the synthetic cache")
    g.add_argument("--seed", type=int, default=1, help="seed of the synthetic cache")
    add_key_options(p, producer=role == "publish")


def add_key_options(p: argparse.ArgumentParser, *, producer: bool) -> None:
    """The "keys" options: the scope key (``--scope-key`` / ``--scope-key-file``), and
    ``--sign-key`` for a producer or ``--producer-key`` for a consumer, with ``--kid``."""
    k = p.add_argument_group("keys")
    scope = k.add_mutually_exclusive_group()  # (one claims both in --config / KVCS_*)
    scope.add_argument(
        "--scope-key",
        metavar="HEX",
        help="32-octet scope key in hex (default: all zeros, for demos only)",
    )
    scope.add_argument(
        "--scope-key-file",
        type=Path,
        metavar="FILE",
        help="file holding the 32-octet scope key (raw or hex)",
    )
    if producer:
        k.add_argument(
            "--sign-key",
            type=Path,
            metavar="PEM",
            help="producer private key (Ed25519 or P-256): publish manifest.cose",
        )
    else:
        k.add_argument(
            "--producer-key",
            type=Path,
            metavar="PEM",
            help="trusted producer public key: require a signed manifest, and use an object "
            "only once a version of it lists the object's digest",
        )
    k.add_argument(
        "--kid",
        metavar="ID",
        help=f"key ID of the producer key (default {DEFAULT_KID!r})",
    )


def add_encryption_options(p: argparse.ArgumentParser, *, producer: bool) -> None:
    """The "encryption" options (MOQT Secure Objects, KVSP binding 8): ``--encrypt``,
    ``--key-id`` for a producer, ``--require-encryption`` for a consumer, and
    ``--cipher-suite`` for both. Keys come from the scope key."""
    e = p.add_argument_group("encryption (secure objects)")
    if producer:
        e.add_argument(
            "--encrypt",
            action="store_true",
            help="encrypt every object, the manifest included, with keys derived from the "
            "scope key: relays can neither read nor alter them",
        )
        e.add_argument(
            "--key-id",
            type=int,
            metavar="N",
            help="Secure Object Key ID, 0..2**64-1 (default 0; needs --encrypt)",
        )
    else:
        e.add_argument(
            "--require-encryption",
            action="store_true",
            help="refuse objects and manifests that are not encrypted",
        )
    e.add_argument(
        "--cipher-suite",
        choices=sorted(SUITE_NAMES),
        metavar="SUITE",
        help="aes128gcm (default), aes256gcm or aes128ctr-hmac"
        + ("; needs --encrypt" if producer else ": the suite of encrypted publications"),
    )


@attrs.frozen
class Encryption:
    """What the encryption options ask for."""

    encrypt: bool
    suite: CipherSuite
    key_id: int


def encryption(args: argparse.Namespace) -> Encryption:
    """The encryption options of ``publish``/``fetch`` (a usage error when inconsistent)."""
    encrypt = bool(getattr(args, "encrypt", False))
    key_id = getattr(args, "key_id", None)
    name = args.cipher_suite
    if hasattr(args, "encrypt") and not encrypt:
        given = [o for o, v in (("--key-id", key_id), ("--cipher-suite", name)) if v is not None]
        if given:
            verb = "need" if len(given) > 1 else "needs"
            raise CliError(f"{' and '.join(given)} {verb} --encrypt", Exit.USAGE)
    if key_id is not None and not 0 <= key_id < 2**64:
        raise CliError(f"--key-id must be 0..2**64-1, not {key_id}", Exit.USAGE)
    suite = DEFAULT_SUITE if name is None else SUITE_NAMES[name]
    return Encryption(encrypt, suite, 0 if key_id is None else key_id)


def scope_key(args: argparse.Namespace) -> bytes:
    if args.scope_key is not None and args.scope_key_file is not None:
        raise CliError("give --scope-key or --scope-key-file, not both", Exit.USAGE)
    if args.scope_key_file is not None:
        raw = read_file(args.scope_key_file)
        with contextlib.suppress(ValueError):
            raw = bytes.fromhex(raw.decode("ascii").strip())
        key = raw
    elif args.scope_key is not None:
        try:
            key = bytes.fromhex(args.scope_key)
        except ValueError:
            raise CliError("--scope-key: not hex", Exit.USAGE) from None
    else:
        log.warning("no scope key given: using the all-zero demo key")
        key = DEFAULT_SCOPE_KEY
    if len(key) != 32:
        raise CliError(f"the scope key must be 32 octets, not {len(key)}", Exit.USAGE)
    return key


def cache_source(args: argparse.Namespace) -> CacheLayers:
    """The cache of ``--file`` or the synthetic options: its descriptor and tokens, its K
    and V read one layer at a time (never held whole beside the publisher's sections or
    the consumer's destination). A file is read through once here, one layer in memory at
    a time, so that a truncated or corrupt one is refused before any transfer."""
    from kvcs.adapters.cachefile import llama_descriptor, open_layers, synthetic_layers

    if args.file is not None:
        try:
            source = open_layers(args.file)
            source.check()
            return source
        except CacheFileError as exc:
            raise CliError(str(exc), Exit.FILE) from None
    try:
        desc = llama_descriptor(
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=args.dtype,
            block_tokens=args.block_tokens,
        )
        return synthetic_layers(desc, args.tokens, args.seed)
    except ValueError as exc:
        raise CliError(f"bad synthetic cache shape: {exc}", Exit.USAGE) from None


# --- a prompt without its cache: --tokens-file and --descriptor ----------------------------


@attrs.frozen(eq=False)
class Prompt:
    """What ``kvcs fetch`` asks for: a descriptor and the prompt's token IDs, and the K
    and V to compare the result with when the input has them (``--file``, the synthetic
    options), ``None`` when it has not (``--tokens-file``)."""

    descriptor: dict[str, Any]
    tokens: tuple[int, ...]
    source: CacheLayers | None

    @property
    def cd(self) -> CompatibilityDescriptor:
        return CompatibilityDescriptor(dict(self.descriptor))


def fetch_prompt(args: argparse.Namespace) -> Prompt:
    """The prompt of ``kvcs fetch``: ``--tokens-file`` with ``--descriptor``, else
    :func:`cache_source`."""
    if args.tokens_file is None:
        if args.descriptor is not None:
            raise CliError(
                "--descriptor goes with --tokens-file (a cache file and the synthetic "
                "options carry their own)",
                Exit.USAGE,
            )
        source = cache_source(args)
        return Prompt(dict(source.descriptor), source.tokens, source)
    if args.descriptor is None:
        raise CliError(
            "--tokens-file needs --descriptor (the compatibility descriptor of the cache: "
            "a JSON file, or a cache file holding it)",
            Exit.USAGE,
        )
    descriptor = load_descriptor(args.descriptor, "--descriptor")
    tokens = load_tokens(args.tokens_file)
    log.info("--tokens-file: no K/V to compare the result with (bit_identical is null)")
    return Prompt(descriptor, tokens, None)


def load_descriptor(path: Path, what: str) -> dict[str, Any]:
    """A compatibility descriptor from a JSON file holding the object, or from a
    ``.npz`` / ``.safetensors`` cache file (its metadata: K and V are not read).

    Raises:
        CliError: status 5: missing, unreadable, not JSON, not a valid descriptor.
    """
    if path.suffix in (".npz", ".safetensors"):
        from kvcs.adapters.cachefile import open_layers

        try:
            return dict(open_layers(path).descriptor)
        except CacheFileError as exc:
            raise CliError(f"{what}: {exc}", Exit.FILE) from None
    raw = read_file(path)
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CliError(f"{what}: {path}: not a JSON file ({exc})"[:300], Exit.FILE) from None
    if not isinstance(value, dict):
        raise CliError(f"{what}: {path}: not a JSON object", Exit.FILE)
    try:
        CompatibilityDescriptor(value)
    except ValueError as exc:
        message = f"{what}: {path}: not a compatibility descriptor: {exc}"
        raise CliError(message, Exit.FILE) from None
    return value


_MAX_TOKENS_FILE = 16 * MAX_TOKENS
"""The largest tokens file read (256 MiB: room for :data:`MAX_TOKENS` in any format)."""
_DECIMAL = re.compile(r"[0-9]+")


def load_tokens(path: Path) -> tuple[int, ...]:
    """Token IDs from ``path``, by its suffix: ``.npy`` a 1-D integer array, ``.json`` an
    array of integers, anything else integers in decimal separated by whitespace.

    Raises:
        CliError: status 5 when the file cannot be read as its format (missing, not a
            regular file, larger than 256 MiB, not an ``.npy`` / JSON / UTF-8 text);
            status 2 when it reads but does not hold token IDs (not integers, not
            1-D, outside u32, more than :data:`MAX_TOKENS`).
    """
    what = f"--tokens-file {path}"
    kind = file_kind(path)
    if kind is not None:
        raise CliError(f"{what}: {kind}", Exit.FILE)
    try:
        if path.stat().st_size > _MAX_TOKENS_FILE:
            raise CliError(f"{what}: larger than {_MAX_TOKENS_FILE} octets", Exit.FILE)
        raw = path.read_bytes()
    except OSError as exc:
        raise CliError(f"{what}: cannot read it: {exc.strerror or exc}", Exit.FILE) from None
    values: list[Any]
    if path.suffix == ".npy":
        if not raw.startswith(b"\x93NUMPY"):
            raise CliError(f"{what}: not an .npy file", Exit.FILE)
        import numpy as np

        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as exc:  # numpy raises many kinds on a malformed file
            raise CliError(f"{what}: not a valid .npy file ({exc})"[:300], Exit.FILE) from None
        if array.ndim != 1 or array.dtype.kind not in "ui":
            raise CliError(
                f"{what}: must hold a 1-D integer array, not {array.dtype} of shape {array.shape}",
                Exit.USAGE,
            )
        values = array.tolist()
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CliError(f"{what}: not UTF-8 text", Exit.FILE) from None
        if path.suffix == ".json":
            try:
                values = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise CliError(f"{what}: not a JSON file ({exc})"[:300], Exit.FILE) from None
            if not isinstance(values, list):
                raise CliError(f"{what}: must hold a JSON array of integers", Exit.USAGE)
            for i, t in enumerate(values):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise CliError(
                        f"{what}: item {i} is not an integer: {json.dumps(t)[:40]}", Exit.USAGE
                    )
        else:
            words = text.split()
            for i, word in enumerate(words):
                if not _DECIMAL.fullmatch(word):
                    raise CliError(
                        f"{what}: word {i + 1} is not a token ID (a decimal integer): "
                        f"{word[:40]!r}",
                        Exit.USAGE,
                    )
            values = [int(w) for w in words]
    if len(values) > MAX_TOKENS:
        raise CliError(f"{what}: {len(values)} tokens, more than {MAX_TOKENS}", Exit.USAGE)
    for i, t in enumerate(values):
        if not 0 <= t < 1 << 32:
            raise CliError(f"{what}: token {i} ({t}) is outside 0..2**32-1", Exit.USAGE)
    return tuple(int(t) for t in values)


def write_tokens(path: Path, tokens: Sequence[int]) -> None:
    """Token IDs to ``path`` in the format :func:`load_tokens` reads by its suffix (``.npy``:
    ``uint32``).

    Raises:
        CliError: status 5: the file cannot be written.
    """
    try:
        if path.suffix == ".npy":
            import numpy as np

            with path.open("wb") as f:  # a file object: numpy would append .npy to a name
                np.save(f, np.asarray(tokens, dtype=np.uint32), allow_pickle=False)
        elif path.suffix == ".json":
            path.write_text(json.dumps(list(tokens)) + "\n", encoding="utf-8")
        else:
            path.write_text(" ".join(map(str, tokens)) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}", Exit.FILE) from None


def descriptor_command(args: argparse.Namespace) -> int:
    """``kvcs descriptor CACHE``: the cache file's descriptor as JSON (stdout or ``--out``),
    and with ``--tokens-out`` its token IDs: what a consumer's ``kvcs fetch --tokens-file
    --descriptor`` needs."""
    from kvcs.adapters.cachefile import open_layers

    try:
        cache = open_layers(args.cache)
    except CacheFileError as exc:
        raise CliError(str(exc), Exit.FILE) from None
    text = json.dumps(cache.descriptor, indent=2, sort_keys=True) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            args.out.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CliError(f"cannot write {args.out}: {exc.strerror or exc}", Exit.FILE) from None
    if args.tokens_out is not None:
        write_tokens(args.tokens_out, cache.tokens)
    return Exit.OK


_MAX_SMALL_FILE = 1 << 20
"""Keys, certificates and scope-key files are small: more than this is not one."""


def read_file(path: Path) -> bytes:
    """A small file (a key or a PEM): a one-line error (status 5) unless it is a readable
    regular file of at most 1 MiB; a FIFO or a device is never opened."""
    kind = file_kind(path)
    if kind is not None:
        raise CliError(f"cannot read {path}: {kind}", Exit.FILE)
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_SMALL_FILE + 1)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}", Exit.FILE) from None
    if len(data) > _MAX_SMALL_FILE:
        raise CliError(f"cannot read {path}: larger than {_MAX_SMALL_FILE} octets", Exit.FILE)
    return data


def kid(args: argparse.Namespace) -> str:
    return DEFAULT_KID if args.kid is None else str(args.kid)


def full_blocks(tokens: int, block_tokens: int, what: str) -> int:
    """Tokens in full blocks; a warning on stderr for a partial last block (its tokens are
    not published or fetched: KVSP covers full blocks only)."""
    usable = tokens // block_tokens * block_tokens
    if usable != tokens:
        log.warning(
            "%s: the last %d of %d tokens do not fill a block of %d and are left out "
            "(%d tokens in %d blocks)",
            what, tokens - usable, tokens, block_tokens, usable, usable // block_tokens,
        )  # fmt: skip
    return usable


def client_tls(args: argparse.Namespace) -> TlsConfig:
    if args.ca is not None and (kind := file_kind(args.ca)) is not None:
        raise CliError(f"--ca: {args.ca}: {kind}", Exit.FILE)
    return TlsConfig(cafile=str(args.ca) if args.ca else None, verify=not args.insecure)


def binding(args: argparse.Namespace) -> ModuleType:
    if args.loop == "trio":
        from kvcs.transports.quic import trio_binding

        return trio_binding
    return asyncio_binding


# --- running -------------------------------------------------------------------------------


def run(args: argparse.Namespace, main: Callable[[ModuleType], Awaitable[int]]) -> int:
    """Run ``main(binding)`` on the chosen loop; map failures to one line and a status."""
    b = binding(args)
    try:
        if args.loop == "trio":
            import trio

            with single_errors():  # trio >= 0.25 groups every error (kvcs.transports.quic.groups)
                return int(trio.run(main, b))
        return asyncio.run(main(b))  # type: ignore[arg-type]
    except CliError as exc:
        return fail(str(exc), exc.status)
    except (TlsError, StackUnavailable) as exc:
        return fail(str(exc), Exit.TLS if isinstance(exc, TlsError) else Exit.USAGE)
    except UrlError as exc:
        return fail(str(exc), Exit.USAGE)
    except ConnectError as exc:
        status = Exit.TLS if "certificate" in str(exc) else Exit.NETWORK
        return fail(str(exc), status)
    except OSError as exc:
        return fail(f"network error: {exc.strerror or exc}", Exit.NETWORK)
    except CacheFileError as exc:
        return fail(str(exc), Exit.FILE)


def fail(message: str, status: int) -> int:
    print(f"kvcs: error: {message}", file=sys.stderr)
    return status


def json_line(**fields: Any) -> None:
    print(json.dumps(fields, separators=(",", ":")), flush=True)


# --- progress ----------------------------------------------------------------------------------


class Progress:
    """A one-line text progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < self.total):
            return
        self._last = now
        width = 30
        filled = int(width * done / self.total)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r{self.label:<14} [{bar}] {done}/{self.total}")
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


@contextlib.contextmanager
def quiet_broken_pipe() -> Iterator[None]:
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# --- namespaces on the command line ---------------------------------------------------------


def parse_namespace(text: str) -> TrackNamespace:
    """``kvcs-1/0x0a1b...``: fields separated by ``/``; a field ``0x<hex>`` is binary."""
    fields: list[bytes] = []
    for part in text.split("/") if text else []:
        if part.startswith("0x"):
            try:
                fields.append(bytes.fromhex(part[2:]))
            except ValueError:
                raise CliError(f"not hex: {part!r}", Exit.USAGE) from None
        else:
            fields.append(part.encode())
    try:
        return TrackNamespace(tuple(fields))
    except ValueError as exc:
        raise CliError(f"bad namespace {text!r}: {exc}", Exit.USAGE) from None


def format_namespace(ns: TrackNamespace) -> str:
    """The inverse of :func:`parse_namespace`: printable ASCII fields as text, others hex."""
    out = []
    for f in ns.fields:
        printable = f and all(0x21 <= c < 0x7F and c != 0x2F for c in f) and not f.startswith(b"0x")
        out.append(f.decode("ascii") if printable else "0x" + f.hex())
    return "/".join(out)
