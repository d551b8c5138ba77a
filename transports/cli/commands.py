"""``kvcs relay``, ``kvcs publish``, ``kvcs fetch`` and ``kvcs ls``.

Each command is one coroutine written against a binding module
(:mod:`kvcs.transports.quic.asyncio_binding` or :mod:`kvcs.transports.quic.trio_binding`,
chosen by ``--loop``), so every command runs on either loop. Output for people
goes to stdout (and progress bars to stderr on a terminal); ``--json`` prints one
JSON object per line instead, for scripts: streamed ``progress`` lines while
``publish`` and ``fetch`` run (:mod:`.progress`), and from ``relay`` periodic
``stats`` lines and one ``connection_ended`` line per connection that ends.
``relay --metrics`` serves the same counters to Prometheus
(:mod:`kvcs.transports.quic.metrics`); ``--qlog-dir`` writes a qlog per QUIC
connection (:mod:`kvcs.transports.quic.qlog`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import logging
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import serialization

from kvcs.adapters.files import CacheFileError
from kvcs.transports.quic.api import CacheRetrieval, ConnectError
from kvcs.transports.quic.config import parse_hostport
from kvcs.transports.quic.metrics import (
    RelayMetrics,
    parse_metrics_address,
    relay_counters,
    stats_fields,
)
from kvcs.transports.quic.reconnect import DEFAULT_BACKOFF
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.kvcs.consumer import (
    ConsumerConfig,
    ManifestRejectReason,
    ObjectDiscarded,
    PublicationRejected,
    RetrievalComplete,
)
from kvcs_core.kvcs.names import KvcsNameError, KvcsNamespace
from kvcs_core.kvcs.publisher import AttachState, ManifestSigner, PublisherError
from kvcs_core.moqt import events as ev
from kvcs_core.relay.config import RelayConfig
from kvcs_core.secobj import LimitReached
from kvcs_core.wire.names import TrackNamespace

from . import index_options
from .common import (
    DEFAULT_KID,
    CliError,
    Exit,
    Prompt,
    cache_source,
    client_tls,
    client_token,
    encryption,
    fetch_prompt,
    format_namespace,
    full_blocks,
    json_line,
    kid,
    parse_namespace,
    qlog_dir,
    read_file,
    scope_key,
)
from .progress import Sample, TransferProgress, tick
from .token import relay_authorizer

if TYPE_CHECKING:
    from kvcs.adapters.numpy_kv import KvDestination

# numpy and the cache files are imported by publish and fetch, not here (common.py: `kvcs
# relay` never loads them)

log = logging.getLogger("kvcs.cli")


class Terminated(Exception):
    """SIGTERM arrived: the command stopped on request (exit status 0)."""


_STOP = [False]


def _stop_on_sigterm() -> None:
    """SIGTERM sets a flag that the command's wait loops poll; they then end cleanly.

    (Raising from the handler would interrupt the event loop at an arbitrary point.)
    """

    def handler(signum: int, frame: Any) -> None:
        _STOP[0] = True

    signal.signal(signal.SIGTERM, handler)


async def _wait(b: ModuleType, seconds: float | None, until: Any = None) -> None:
    """Sleep ``seconds`` (``None``: forever) in short steps; raise :class:`Terminated` on
    SIGTERM; return early when ``until()`` is true."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        if _STOP[0]:
            raise Terminated
        if until is not None and until():
            return
        step = 0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic()))
        await b.sleep(step)


# --- relay ---------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in units and not t[-1:].isdigit() else ""
    number = t[: len(t) - len(unit)]
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value


def relay_tls(args: argparse.Namespace) -> TlsConfig:
    if args.self_signed:
        if args.cert or args.key:
            raise CliError("give --self-signed or --cert/--key, not both", Exit.USAGE)
        directory = args.cert_dir
        if directory is None:  # a private temporary one, removed when the command exits
            directory = Path(tempfile.mkdtemp(prefix="kvcs-relay-"))
            atexit.register(shutil.rmtree, directory, True)
        try:
            return self_signed(directory)
        except OSError as exc:
            raise CliError(
                f"cannot write the certificate into {directory}: {exc.strerror or exc}", Exit.FILE
            ) from None
    if not args.cert:
        raise CliError("a relay needs --cert and --key, or --self-signed", Exit.USAGE)
    return TlsConfig(certfile=str(args.cert), keyfile=str(args.key or args.cert))


async def relay(b: ModuleType, args: argparse.Namespace) -> int:
    _stop_on_sigterm()
    try:
        parse_hostport(args.listen)
    except ValueError as exc:
        raise CliError(str(exc), Exit.USAGE) from None
    metrics_at = None
    if args.metrics is not None:
        try:
            metrics_at = parse_metrics_address(args.metrics)
        except ValueError as exc:
            raise CliError(str(exc), Exit.USAGE) from None
    qlog = qlog_dir(args)
    tls = relay_tls(args)
    upstream_tls = TlsConfig(
        cafile=str(args.upstream_ca) if args.upstream_ca else None,
        verify=not args.upstream_insecure,
    )
    config = RelayConfig(
        cache_budget_bytes=args.cache_budget, authorizer=relay_authorizer(args)
    )
    try:
        async with b.serve_relay(
            args.listen,
            tls=tls,
            stack=args.stack,
            relay_config=config,
            upstream=args.upstream,
            upstream_tls=upstream_tls,
            max_datagram_size=args.datagram_size,
            idle_timeout=args.idle_timeout,
            qlog_dir=qlog,
            upstream_token=client_token(args),
        ) as server:
            metrics = None
            metrics_url = None
            if metrics_at is not None:
                metrics = RelayMetrics(relay_counters(server))
                try:
                    host, port = metrics.serve(*metrics_at)
                except OSError as exc:
                    raise CliError(
                        f"--metrics: cannot listen on {args.metrics}: {exc.strerror or exc}",
                        Exit.NETWORK,
                    ) from None
                metrics_url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
            try:
                _announce_relay(args, server, tls, metrics_url)
                await _run_relay(b, args, server, metrics)
            finally:
                if metrics is not None:
                    metrics.close()
    except ConnectError:
        raise  # the upstream relay (a ConnectError is an OSError too): mapped by common.run
    except OSError as exc:
        raise CliError(
            f"cannot listen on {args.listen}: {exc.strerror or exc}", Exit.NETWORK
        ) from None
    return Exit.OK


def _announce_relay(
    args: argparse.Namespace, server: Any, tls: TlsConfig, metrics_url: str | None
) -> None:
    where = f"moqt://{server.address[0]}:{server.address[1]}"
    wt_url: str | None = f"https://{server.address[0]}:{server.address[1]}/"
    if args.stack == "pquic":
        wt_url = None  # no WebTransport through kvcs on picoquic (.pquic_binding)
    if args.json:
        extra = {} if metrics_url is None else {"metrics_url": metrics_url}
        json_line(
            event="listening",
            url=where,
            webtransport_url=wt_url,
            ca=tls.cafile,
            stack=args.stack,
            **extra,
        )
        return
    print(
        f"kvcs relay: listening on {where}"
        + (f" and {wt_url} (WebTransport)" if wt_url else "")
        + " "
        f"({args.stack}, {args.loop}"
        + (f", self-signed; CA {tls.cafile}" if args.self_signed else "")
        + (f", upstream {args.upstream}" if args.upstream else "")
        + ")"
        + (f"; metrics at {metrics_url}" if metrics_url else ""),
        flush=True,
    )


RELAY_TICK = 0.25
"""Seconds between two looks of ``kvcs relay`` at its counters (metrics, ended connections)."""

RELAY_LOG_INTERVAL = 1.0
"""Seconds between two ``-v`` log lines of the relay's counts."""


async def _run_relay(
    b: ModuleType, args: argparse.Namespace, server: Any, metrics: RelayMetrics | None
) -> None:
    """Serve until SIGTERM or ``--run-for``; every tick: refresh the metrics, report the
    connections that ended (``--json``), and now and then the counters (``stats`` lines
    with ``--json``, an INFO log line)."""
    clock = time.monotonic
    started = clock()
    next_log = started + RELAY_LOG_INTERVAL
    next_stats = started + args.stats_interval
    ended = _EndedConnections(server.driver.endpoint)
    while True:
        left = None if args.run_for is None else args.run_for - (clock() - started)
        if left is not None and left <= 0:
            break
        try:
            await _wait(b, RELAY_TICK if left is None else min(RELAY_TICK, left))
        except Terminated:
            break
        counters = relay_counters(server)
        if metrics is not None:
            metrics.update(counters)
        if args.json:
            for fields in ended.take():
                json_line(event="connection_ended", **fields)
        now = clock()
        if now >= next_log:
            next_log = now + RELAY_LOG_INTERVAL
            log.info(
                "relay: %d connections, %d tracks, cache %d bytes, %d objects; "
                "in %d objects (%d bytes), out %d objects (%d bytes)",
                counters.connections, counters.tracks, counters.cache_bytes,
                counters.cache_objects, counters.objects_in, counters.bytes_in,
                counters.objects_out, counters.bytes_out,
            )  # fmt: skip
        if args.json and now >= next_stats:
            next_stats = now + args.stats_interval
            json_line(event="stats", seconds=round(now - started, 3), **stats_fields(counters))
    if args.json:  # what ended in the last moments (our own close comes after this)
        for fields in ended.take():
            json_line(event="connection_ended", **fields)


class _EndedConnections:
    """The connections of an endpoint that ended since the last :meth:`take`."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.seen = endpoint.ended_total

    def take(self) -> list[dict[str, Any]]:
        total = self.endpoint.ended_total
        new = min(total - self.seen, len(self.endpoint.ended))
        self.seen = total
        pumps = list(self.endpoint.ended)[len(self.endpoint.ended) - new :] if new else []
        return [
            {
                "connection": pump.label,
                "peer": _peer(pump.peer),
                "ended_by": pump.ended_how,
                "reason": pump.close_reason,
                "upstream": bool(pump.quic.configuration.is_client),
            }
            for pump in pumps
        ]


def _peer(addr: Any) -> str | None:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return None if addr is None else str(addr)


# --- publish --------------------------------------------------------------------------------


def load_signer(args: argparse.Namespace) -> ManifestSigner | None:
    if args.sign_key is None:
        return None
    raw = read_file(args.sign_key)
    try:
        key = serialization.load_pem_private_key(raw, password=None)
        return ManifestSigner(key, kid(args).encode())  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise CliError(f"{args.sign_key}: not a usable private key ({exc})", Exit.FILE) from None


def publication_id(args: argparse.Namespace) -> bytes | None:
    """``--publication-id HEX`` (``None``: the publisher draws one)."""
    if not args.publication_id:
        return None
    try:
        return bytes.fromhex(args.publication_id)
    except ValueError:
        raise CliError("--publication-id: not hex", Exit.USAGE) from None


def tokens_to_publish(tokens: int, block_tokens: int, command: str) -> int:
    """The tokens a publisher publishes: its full blocks (a one-line error with none)."""
    if tokens < block_tokens:
        raise CliError(
            f"the prompt has {tokens} tokens, fewer than one block of "
            f"{block_tokens}: nothing to publish",
            Exit.USAGE,
        )
    return full_blocks(tokens, block_tokens, command)


async def publish(b: ModuleType, args: argparse.Namespace) -> int:
    _stop_on_sigterm()
    cache = cache_source(args)
    key = scope_key(args)
    signer = load_signer(args)
    pub_id = publication_id(args)
    secure = encryption(args)
    if secure.encrypt and pub_id is not None and not args.deterministic:
        log.warning(
            "--encrypt with --publication-id: never reuse a Publication ID for another "
            "production of other bits under the same --key-id (its objects would be "
            "encrypted under the same key and nonce)"
        )
    cd = cache.cd
    published = tokens_to_publish(len(cache.tokens), cd.block_tokens, "publish")
    index_stride = index_options.publish_index_stride(args)  # checked before connecting
    # --preload: every layer gathered now, before connecting (the publisher keeps every
    # layer's sections anyway: no more memory at the peak, only sooner)
    preloaded = list(_gathered(cache, cd, published // cd.block_tokens)) if args.preload else None
    early_digest = None
    if preloaded is not None and args.digest:
        early_digest = _digest(part for sections in preloaded for part in _kv(sections))
    async with _connect(b, args) as client:
        try:
            pub = await client.publish_cache(
                cache.descriptor,
                key,
                cache.tokens,
                publication_id=pub_id,
                signer=signer,
                deterministic=args.deterministic,
                encrypt=secure.encrypt,
                cipher_suite=secure.suite,
                key_id=secure.key_id,
                index_stride=index_stride,
            )
        except PublisherError as exc:
            raise CliError(f"cannot publish: {exc}", Exit.USAGE) from None
        blocks = len(pub.publisher.block_keys)
        ns = pub.publisher.namespace
        report(
            args,
            event="publishing",
            namespace=format_namespace(ns),
            layers=cd.layers,
            blocks=blocks,
            tokens=published,
        )
        if args.wait_for_subscriber:
            await _wait_subscribed(b, client, pub, args.wait_for_subscriber)
        t0 = time.monotonic()
        progress = TransferProgress("publishing", cd.layers, json_lines=args.json, emit=json_line)
        state = {"layers": 0, "bytes": 0, "layer_bytes": 0}
        done = [False]
        ended = [0.0]

        def sample() -> Sample:
            per_layer = state["layer_bytes"]
            return Sample(
                layers_done=state["layers"],
                bytes_done=state["bytes"],
                bytes_total=per_layer * cd.layers if per_layer else None,
                extra=(("sent", client.pump.bytes_pulled),),
            )

        def layers() -> Iterator[Any]:
            if preloaded is None:
                yield from _gathered(cache, cd, blocks)
                return
            while preloaded:  # each let go here once the publisher has it
                yield preloaded.pop(0)

        async def produce() -> None:
            try:
                for layer, sections in enumerate(layers()):
                    size = sum(memoryview(x).nbytes for x in _kv(sections))
                    try:
                        await pub.put_layer(layer, sections.k, sections.v, timeout=args.timeout * 6)
                    except LimitReached as exc:  # --encrypt: the key's AEAD limit (secobj)
                        raise CliError(
                            f"cannot publish layer {layer}: {exc}", Exit.FAILED
                        ) from None
                    del sections
                    state["layers"] = layer + 1
                    state["bytes"] += size
                    state["layer_bytes"] = state["layer_bytes"] or size
                    progress.update(sample())
                    if args.layer_interval:
                        await _wait(b, args.layer_interval)
                await pub.finish()
                await pub.drained(timeout=None if args.serve_for is None else args.serve_for + 60)
                ended[0] = time.monotonic()
            finally:
                done[0] = True

        await b.gather(produce, lambda: tick(b.sleep, progress, sample, lambda: done[0]))
        progress.finish(sample())
        nbytes = pub.publisher.total_bytes
        seconds = round(ended[0] - t0, 3)
        # the relay's answer to the announcement (within --timeout): a refusal (e.g.
        # UNAUTHORIZED, the token does not cover this scope) fails the command
        await _wait(
            b,
            args.timeout,
            until=lambda: (
                client.closed
                or pub.publisher.attach_state(client.session) is not AttachState.PENDING
            ),
        )
        refusal = pub.publisher.attach_refusal(client.session)
        if refusal is not None:
            code, why = refusal
            raise CliError(
                f"the relay refused the publication's PUBLISH_NAMESPACE: {why} (code {code:#x})",
                Exit.FAILED,
            )
        extra = {}
        if early_digest is not None:
            extra["digest"] = early_digest
        elif args.digest:
            # the layers are read once more (one at a time), after the timing
            extra["digest"] = _digest(
                part for sections in _gathered(cache, cd, blocks) for part in _kv(sections)
            )
        report(
            args,
            event="published",
            namespace=format_namespace(ns),
            layers=cd.layers,
            blocks=blocks,
            tokens=published,
            bytes=nbytes,
            seconds=seconds,
            sent=client.pump.bytes_pulled,
            **extra,
        )
        if args.serve_for is None and not args.json:
            print("kvcs publish: serving the publication until interrupted", flush=True)
        with contextlib.suppress(Terminated):
            await _wait(b, args.serve_for, until=lambda: client.closed)
        if client.closed:
            raise CliError("the relay closed the connection", Exit.NETWORK)
    return Exit.OK


async def _wait_subscribed(b: ModuleType, client: Any, pub: Any, seconds: float) -> None:
    """``--wait-for-subscriber``: until every data track of ``pub`` has had a SUBSCRIBE
    (or ``seconds`` passed, or the connection ended)."""
    data_tracks = {name.encode("ascii") for name in pub.publisher.track_names[1:]}
    subscribed: set[bytes] = set()

    def watch(pump: Any, e: Any, now: float) -> None:
        if isinstance(e, ev.SubscribeRequested):
            subscribed.add(e.track.name)

    client.app.watchers.append(watch)
    try:
        await _wait(b, seconds, until=lambda: data_tracks <= subscribed or client.closed)
    finally:
        client.app.watchers.remove(watch)


def _gathered(cache: Any, cd: Any, blocks: int) -> Iterator[Any]:
    """The source one layer at a time, each gathered once into section order (the
    publisher keeps the sections, by reference) and the layer read then let go; where
    the layout allows views (one KV head) the sections are views of that layer."""
    from kvcs.adapters.numpy_kv import layer_sections

    for k, v in cache.layers():
        sections = layer_sections(k, v, cd, blocks=blocks)
        del k, v
        yield sections


def _kv(sections: Any) -> list[Any]:
    """A layer's sections in the order ``--digest`` hashes them: every K, then every V."""
    return [*sections.k, *sections.v]


def _digest(parts: Any) -> str:
    """``--digest``: SHA-256 of the K/V sections in order (per layer: K, then V)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(memoryview(part).cast("B"))
    return h.hexdigest()


def _connect(b: ModuleType, args: argparse.Namespace) -> Any:
    """The session with ``args.url`` that every client command opens (a publisher's is
    reopened with backoff whenever it is lost, and its publication announced again)."""
    return b.connect(
        args.url,
        tls=client_tls(args),
        token=client_token(args),
        stack=args.stack,
        timeout=args.timeout,
        max_datagram_size=args.datagram_size,
        idle_timeout=args.idle_timeout,
        reconnect=DEFAULT_BACKOFF if args.command == "publish" else None,
        qlog_dir=qlog_dir(args),
    )


def report(args: argparse.Namespace, **fields: Any) -> None:
    if args.json:
        json_line(**fields)
        return
    event = fields.pop("event")
    text = ", ".join(f"{k}={v}" for k, v in fields.items())
    print(f"kvcs {args.command}: {event}: {text}", flush=True)


# --- fetch -------------------------------------------------------------------------------------


def load_producer_keys(args: argparse.Namespace) -> dict[bytes, Any] | None:
    if args.producer_key is None:
        return None
    raw = read_file(args.producer_key)
    try:
        key = serialization.load_pem_public_key(raw)
    except ValueError as exc:
        raise CliError(f"{args.producer_key}: not a public key ({exc})", Exit.FILE) from None
    return {kid(args).encode(): key}


async def fetch(b: ModuleType, args: argparse.Namespace) -> int:
    from kvcs.adapters.cachefile import check_out_path
    from kvcs.adapters.numpy_kv import KvDestination

    prompt = fetch_prompt(args)  # the prompt (and, for --verify, the expected bits if known)
    tokens = prompt.tokens if args.prompt_tokens is None else prompt.tokens[: args.prompt_tokens]
    key = scope_key(args)
    keys = load_producer_keys(args)
    secure = encryption(args)
    cd = prompt.cd
    if args.out is not None:  # before any transfer: a name we would not write exactly, or
        try:  # a place that cannot be written
            check_out_path(args.out)
        except CacheFileError as exc:  # (a ValueError too: first)
            raise CliError(f"--out: {exc}", Exit.FILE) from None
        except ValueError as exc:
            raise CliError(f"--out: {exc}", Exit.USAGE) from None
    if len(tokens) < cd.block_tokens:
        raise CliError(
            f"the prompt has {len(tokens)} tokens, fewer than one block of {cd.block_tokens}",
            Exit.USAGE,
        )
    usable = full_blocks(len(tokens), cd.block_tokens, "fetch")
    index = index_options.fetch_index_options(args)  # checked before connecting
    dest = KvDestination(cd, usable)
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(_connect(b, args))
        others = [
            await stack.enter_async_context(
                b.connect(
                    url,
                    tls=client_tls(args),
                    token=client_token(args),
                    timeout=args.timeout,
                    via=client,
                    idle_timeout=args.idle_timeout,
                )
            )
            for url in args.also
        ]
        t0 = time.monotonic()
        retrieval = client.retrieve_cache(
            prompt.descriptor,
            key,
            tokens,
            also=others,
            destinations=dest.buffer,
            producer_keys=keys,
            require_authenticity=keys is not None,
            recovery_time_bound=args.recovery_time,
            config=ConsumerConfig(stall_timeout=args.stall_timeout),
            require_encryption=args.require_encryption,
            cipher_suite=secure.suite,
            index=index,
        )
        outcome = await follow(b, retrieval, cd.layers, t0, args)
        result = outcome["result"]
        if not (result is not None and result.complete) and all(
            c.closed for c in (client, *others)
        ):  # not a missing publication: the relay went away (status 3, with its reason)
            raise ConnectError(
                f"connection to {client.target} closed: {client.pump.close_reason or 'lost'}"
            )
    return finish_fetch(args, prompt, dest, outcome)


async def follow(
    b: ModuleType,
    retrieval: CacheRetrieval,
    layers: int,
    t0: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Wait for the retrieval's end, with progress; the figures of the report."""
    progress = TransferProgress("fetching", layers, json_lines=args.json, emit=json_line, start=t0)
    consumer = retrieval.consumer
    state: dict[str, Any] = {"first": None, "seen": 0, "done": False, "result": None, "end": t0}

    def sample() -> Sample:
        verified = consumer.verified_objects
        needed = verified + consumer.missing_objects
        return Sample(
            layers_done=len(retrieval.ready),
            bytes_done=verified * consumer.data_length,
            bytes_total=needed * consumer.data_length if needed else None,
        )

    async def wait() -> None:
        try:  # --fetch-timeout bounds the whole retrieval
            async for _layer in retrieval.layers(timeout=args.fetch_timeout):
                if state["first"] is None:
                    state["first"] = time.monotonic() - t0
                progress.update(sample())
                state["seen"] = _warn_discarded(retrieval, state["seen"], args)
            state["result"] = await retrieval.result(
                timeout=max(0.0, args.fetch_timeout - (time.monotonic() - t0)), strict=False
            )
        except TimeoutError:
            state["result"] = None
        finally:
            state["end"] = time.monotonic()
            state["done"] = True

    await b.gather(wait, lambda: tick(b.sleep, progress, sample, lambda: bool(state["done"])))
    progress.finish(sample())
    result: RetrievalComplete | None = state["result"]
    first: float | None = state["first"]
    seen: int = state["seen"]
    _warn_discarded(retrieval, seen, args)
    for e in retrieval.events:
        log.debug("consumer event: %s", e)
    total = float(state["end"]) - t0  # the end of the retrieval, not of the ticker
    return {
        "result": result,
        "first": first,
        "total": total,
        "ready": list(retrieval.ready),
        "discarded": sum(1 for e in retrieval.events if isinstance(e, ObjectDiscarded)),
        "recompute": list(retrieval.recompute),
        "rejected": [e for e in retrieval.events if isinstance(e, PublicationRejected)],
        "verified": consumer.verified_objects,
        "verified_bytes": consumer.verified_objects * consumer.data_length,
        "missing": consumer.missing_objects,
        "stall_timeout": args.stall_timeout,
        "index": index_options.index_report(consumer, retrieval.events),
    }


_MAX_DISCARD_WARNINGS = 20


def _warn_discarded(retrieval: CacheRetrieval, seen: int, args: argparse.Namespace) -> int:
    """A warning on stderr for each Object discarded since event ``seen`` (at most 20 in
    all); returns how many events were looked at."""
    events = retrieval.events
    sources = [args.url, *args.also]
    warned = sum(1 for e in events[:seen] if isinstance(e, ObjectDiscarded))
    for e in events[seen:]:
        if isinstance(e, ObjectDiscarded):
            warned += 1
            if warned > _MAX_DISCARD_WARNINGS:
                continue
            why = e.reason.name + (f"/{e.check.name}" if e.check is not None else "")
            where = sources[e.session] if e.session < len(sources) else f"session {e.session}"
            log.warning(
                "discarded %s layer %d block %d from %s: %s: %s",
                e.track, e.layer, e.block, where, why, e.detail,
            )  # fmt: skip
    return len(events)


def finish_fetch(
    args: argparse.Namespace, prompt: Prompt, dest: KvDestination, outcome: dict[str, Any]
) -> int:
    from kvcs.adapters.cachefile import destination_layers, same_bits, save_layers

    result: RetrievalComplete | None = outcome["result"]
    cd = prompt.cd
    blocks = result.blocks if result is not None else 0
    tokens = blocks * cd.block_tokens
    complete = bool(result and result.complete and blocks > 0)
    identical: bool | None = None  # (None: not compared; --tokens-file has no K/V to compare)
    if complete and args.verify and prompt.source is not None:  # read a layer at a time
        identical = same_bits(prompt.source, dest, tokens)
    if complete and args.out is not None:  # written layer by layer from dest
        try:
            k, v = destination_layers(dest, tokens)
            save_layers(args.out, prompt.descriptor, prompt.tokens[:tokens], k, v)
        except CacheFileError as exc:
            raise CliError(str(exc), Exit.FILE) from None
    total = outcome["total"]
    extra = {}
    if args.digest:
        extra["digest"] = (
            _digest(dest.buffer(layer, comp) for layer in range(cd.layers) for comp in ("k", "v"))
            if complete
            else None
        )
    nbytes = outcome["verified_bytes"]  # what was received and verified, not what was asked
    recompute_layers = sorted({x for e in outcome["recompute"] for x in e.layers})
    recompute_blocks = sorted({x for e in outcome["recompute"] for x in e.blocks})
    report(
        args,
        event="done",
        complete=complete,
        blocks=blocks,
        tokens=tokens,
        layers_ready=len(outcome["ready"]),
        bytes=nbytes,
        first_layer_ms=None if outcome["first"] is None else round(outcome["first"] * 1e3, 1),
        seconds=round(total, 3),
        mb_per_s=round(nbytes / total / 1e6, 2) if total else None,
        discarded=outcome["discarded"],
        recompute_layers=recompute_layers,
        recompute_blocks=recompute_blocks,
        bit_identical=identical,
        out=str(args.out) if args.out and complete else None,
        **outcome.get("index", {}),
        **extra,
    )
    if result is None:
        return fail_line(
            f"the retrieval did not finish within --fetch-timeout {args.fetch_timeout:g} s "
            f"({outcome['missing']} objects still missing)",
            Exit.FAILED,
        )
    if blocks == 0:
        return fail_line(why_not_found(args, outcome["rejected"]), Exit.FAILED)
    if not complete:
        needed = 2 * cd.layers * blocks
        return fail_line(
            f"objects are missing: recompute layers {_spans(recompute_layers)} of blocks "
            f"{_spans(recompute_blocks)} ({outcome['verified']} of {needed} objects verified; "
            f"the sources stopped delivering the rest, and none had them within "
            f"--recovery-time {args.recovery_time:g} s)",
            Exit.FAILED,
        )
    if identical is False:
        return fail_line("the received cache differs from the source", Exit.FAILED)
    return Exit.OK


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    if not values:
        return "(none)"
    out: list[str] = []
    start = prev = values[0]
    for x in [*values[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def why_not_found(args: argparse.Namespace, rejected: list[PublicationRejected]) -> str:
    """What happened when no publication was used: the refusal, said plainly."""
    if not rejected:
        return "no publication of this prompt was found"
    e = rejected[-1]
    detail = e.detail
    if e.reason is ManifestRejectReason.NOT_PROTECTED:
        return (
            "a publication was found, but it is not encrypted and --require-encryption refuses it"
        )
    if e.reason is ManifestRejectReason.DECRYPTION_FAILED:
        return (
            "a publication was found, but its manifest did not decrypt (another scope key "
            f"or --cipher-suite than the publisher's, or tampered in transit): {detail}"
        )
    if e.reason is ManifestRejectReason.UNSIGNED:
        return (
            "a publication was found, but its manifest is not signed and --producer-key "
            "requires a signed one"
        )
    if e.reason is ManifestRejectReason.BAD_SIGNATURE:
        if detail.startswith(("UNKNOWN_KID", "MISSING_KID")):
            signed_by = _kid_of(detail)
            if args.kid is None:
                return (
                    f"a publication was found, but its manifest is signed with key ID "
                    f"{signed_by} and no --kid was given (--producer-key is used as key ID "
                    f"{DEFAULT_KID!r}); give --kid with the producer's key ID"
                )
            return (
                f"a publication was found, but its manifest is signed with key ID {signed_by}, "
                f"not --kid {args.kid!r}"
            )
        return (
            f"a publication was found, but the signature of its manifest was refused by "
            f"--producer-key (key ID {kid(args)!r}): {detail}"
        )
    return f"a publication was found, but it was refused: {e.reason.name}: {detail}"


def _kid_of(detail: str) -> str:
    """The key ID named in a COSE refusal (``UNKNOWN_KID: no producer key <hex>``)."""
    if detail.startswith("MISSING_KID"):
        return "(none: the signature has no kid)"
    hexed = detail.rsplit(" ", 1)[-1]
    try:
        raw = bytes.fromhex(hexed)
    except ValueError:
        return "(unknown)"
    text = raw.decode("utf-8", "replace")
    return repr(text) if text.isprintable() else f"0x{hexed}"


def fail_line(message: str, status: int) -> int:
    print(f"kvcs: error: {message}", file=sys.stderr)
    return status


# --- ls -------------------------------------------------------------------------------------------


async def ls(b: ModuleType, args: argparse.Namespace) -> int:
    prefix = parse_namespace(args.prefix)
    index_prefix = index_options.index_listing_prefix(prefix) if args.index else None
    async with _connect(b, args) as client:
        found = await client.discover(prefix, quiet=args.quiet, timeout=args.timeout)
        entries = (
            []
            if index_prefix is None
            else await client.discover(index_prefix, quiet=args.quiet, timeout=args.timeout)
        )
    for ns in found:
        describe(args, ns)
    if not args.json:
        print(f"{len(found)} namespace(s) under {args.prefix!r}", file=sys.stderr)
    if index_prefix is not None:
        index_options.describe_index_entries(args, entries, index_prefix)
    return Exit.OK


def describe(args: argparse.Namespace, ns: TrackNamespace) -> None:
    fields: dict[str, Any] = {"namespace": format_namespace(ns)}
    try:
        k = KvcsNamespace.from_track_namespace(ns)
        fields.update(
            scope_id=k.scope_id.hex(),
            compat_id=k.compat_id.hex(),
            anchor_key=k.anchor_key.hex(),
            publication_id=k.publication_id.hex(),
        )
    except (KvcsNameError, ValueError):
        pass
    if args.json:
        json_line(**fields)
    else:
        extra = (
            ""
            if len(fields) == 1
            else (
                f"  (scope {fields['scope_id'][:12]}…, compat {fields['compat_id'][:12]}…, "
                f"publication {fields['publication_id']})"
            )
        )
        print(f"{fields['namespace']}{extra}")
