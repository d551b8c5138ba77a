"""``kvcs prefill`` and ``kvcs generate``: a local Hugging Face model's KV cache over MOQT.

Theory of operation
-------------------
``kvcs prefill URL --model DIR --prompt TEXT`` loads a transformers model directory
(no downloads: ``HF_HUB_OFFLINE`` is set), announces a publication of the prompt's
full blocks through the relay at ``URL``, and runs the prefill forward pass in a
worker thread with a hook per decoder layer
(:class:`kvcs.adapters.transformers_kv.PrefillTap`): each layer's K/V sections are
handed to the event loop the moment the layer has run (a thread-safe handoff:
``loop.call_soon_threadsafe`` on asyncio, ``trio.from_thread.run_sync`` on trio)
and published there with ``put_layer`` while the model computes the next layer.
It then serves the publication like ``kvcs publish``.

``kvcs generate URL --model DIR --prompt TEXT --max-new-tokens N`` retrieves the
cache of the prompt's tokens (from the tokens alone: the descriptor comes from the
model directory), and, as soon as the first layer is usable, runs ``generate()`` in
a worker thread with a :class:`~kvcs.adapters.transformers_kv.StreamedCache`: the
forward pass over the uncached tokens goes layer by layer as the cache arrives. It
prints the text and reports the time to first token against a cold ``generate()``
(full recompute), whether the tokens are the same, and the largest logit
difference. A cache that cannot be found or completed is recomputed (a warning).

Both commands follow the others' conventions (:mod:`.commands`): ``--json`` lines,
one-line errors with the documented statuses, the scope key and TLS options. torch
and transformers are imported only here, when one of these commands runs; without
them the command fails with status 2 naming ``pip install 'kvcs[transformers]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from kvcs.transports.quic import asyncio_binding
from kvcs_core.kvcs.consumer import ConsumerConfig, PublicationSelected, TrackSelection
from kvcs_core.kvcs.publisher import RAW_KV, PublisherError, TrackOffer
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor

from . import commands
from .common import (
    CliError,
    Exit,
    add_client_tls_options,
    add_key_options,
    add_ops_options,
    add_transport_options,
    format_namespace,
    load_tokens,
    scope_key,
)

log = logging.getLogger("kvcs.cli")

INSTALL_HINT = "pip install 'kvcs[transformers]'"
CODECS = ("raw", "q8")
Q8_OFFER = (TrackOffer("kv", "q8"),)


# --- options -------------------------------------------------------------------------------


def _model_options(p: argparse.ArgumentParser, *, role: str) -> None:
    p.add_argument("url", metavar="URL", help="moqt://host:port of the relay")
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="a local Hugging Face model directory (config.json, weights, tokenizer); required",
    )
    src = g.add_mutually_exclusive_group()  # one is required (checked by Loaded: one line)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt, tokenized with DIR's tokenizer")
    src.add_argument(
        "--tokens-file",
        type=Path,
        metavar="PATH",
        help="the prompt's token IDs (.npy, .json or whitespace-separated text)",
    )
    g.add_argument(
        "--model-id",
        default="local",
        metavar="ID",
        help="the model's name in the descriptor (default 'local')",
    )
    g.add_argument(
        "--revision",
        metavar="REV",
        help="the weights' revision in the descriptor (default: sha256 of DIR's config.json "
        "and weight files)",
    )
    g.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        default="auto",
        help="load the model (and its cache) in this dtype (default auto: as saved)",
    )
    g.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    g.add_argument(
        "--codec",
        choices=CODECS,
        default="raw",
        help="raw: k.raw/v.raw tracks (exact); q8: the joint kv.q8 track (lossy, about half "
        "the bytes); prefill publishes the tracks of this codec (default raw)",
    )
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=0 if role == "prefill" else 32,
        metavar="N",
        help="greedy-decode N tokens "
        + (
            "after publishing, from the producer's own cache (default 0: none)"
            if role == "prefill"
            else "(default 32)"
        ),
    )
    add_key_options(p, producer=role == "prefill")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_client_tls_options(p)
    add_transport_options(p)
    add_ops_options(p)


def add_prefill(sub: Any, each: dict[str, Any]) -> None:
    p = sub.add_parser(
        "prefill",
        help="run a local HF model on a prompt, publishing its KV cache per layer",
        **each,
    )
    _model_options(p, role="prefill")
    p.add_argument("--publication-id", metavar="HEX", help="16 octets (default: random)")
    p.add_argument(
        "--layer-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="sleep S seconds after each decoder layer (simulates a slower prefill)",
    )
    p.add_argument(
        "--wait-for-subscriber",
        type=float,
        metavar="S",
        help="before the prefill, wait up to S seconds until every data track is subscribed",
    )
    p.add_argument(
        "--serve-for",
        type=float,
        metavar="S",
        help="after publishing, serve S more seconds then exit (default: until interrupted)",
    )


def add_generate(sub: Any, each: dict[str, Any]) -> None:
    p = sub.add_parser(
        "generate",
        help="retrieve a prompt's KV cache and continue generation (HF model)",
        **each,
    )
    _model_options(p, role="generate")
    p.add_argument(
        "--no-recompute",
        dest="recompute",
        action="store_false",
        help="skip the cold generate() (full recompute) that the report compares with",
    )
    p.add_argument(
        "--fetch-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="give up waiting for the cache after S seconds and recompute (default 120)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a session that delivers nothing for S seconds is given up (default 10)",
    )
    p.add_argument(
        "--recovery-time",
        type=float,
        default=2.0,
        metavar="S",
        help="how long to try to recover missing objects (default 2)",
    )
    p.add_argument(
        "--after-retrieval",
        action="store_true",
        help="start generate() only once the whole cache is received and verified (the "
        "baseline without pipelining; default: as soon as the first layer is usable)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="add the per-layer events (arrived / taken / computed, ms after the start) "
        "to the report",
    )


# --- loading ---------------------------------------------------------------------------------


def _imports() -> tuple[ModuleType, ModuleType, ModuleType]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch  # optional: kvcs[transformers]
        import transformers  # type: ignore[import-not-found, unused-ignore]

        from kvcs.adapters import transformers_kv
    except ImportError as exc:
        raise CliError(
            f"this command needs torch and transformers ({exc.name or exc} is missing): "
            f"{INSTALL_HINT}",
            Exit.USAGE,
        ) from None
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call, unused-ignore]
    with contextlib.suppress(AttributeError):
        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call, unused-ignore]
    return torch, transformers, transformers_kv


class Loaded:
    """The model, its descriptor and the prompt's token IDs."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.model is None:
            raise CliError(
                "--model DIR is required (a local Hugging Face model directory)", Exit.USAGE
            )
        if args.prompt is None and args.tokens_file is None:
            raise CliError("give the prompt: --prompt TEXT or --tokens-file PATH", Exit.USAGE)
        self.torch, transformers, self.tk = _imports()
        self.transformers = transformers
        d: Path = args.model
        if not d.is_dir() or not (d / "config.json").is_file():
            raise CliError(f"--model: {d}: not a model directory (no config.json)", Exit.FILE)
        if args.block_tokens < 1:
            raise CliError("--block-tokens must be at least 1", Exit.USAGE)
        if args.max_new_tokens < 0:
            raise CliError("--max-new-tokens must not be negative", Exit.USAGE)
        dtype = "auto" if args.dtype == "auto" else getattr(self.torch, args.dtype)
        try:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                d, dtype=dtype, local_files_only=True
            )
            self.model.eval()
            self.tokenizer = None
            if args.prompt is not None:
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(
                    d, local_files_only=True
                )
            elif args.max_new_tokens:  # only to print the text: token IDs do without
                with contextlib.suppress(OSError, ValueError, KeyError):
                    self.tokenizer = transformers.AutoTokenizer.from_pretrained(
                        d, local_files_only=True
                    )
            revision = args.revision or self.tk.directory_revision(d)
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"--model: {d}: cannot load the model: {exc}", Exit.FILE) from None
        try:
            self.descriptor: dict[str, Any] = self.tk.model_descriptor(
                self.model.config,
                model_id=args.model_id,
                revision=revision,
                dtype=self.model.dtype,
                block_tokens=args.block_tokens,
            )
        except ValueError as exc:
            raise CliError(f"--model: {d}: {exc}", Exit.USAGE) from None
        self.cd = CompatibilityDescriptor(dict(self.descriptor))
        if args.tokens_file is not None:
            self.tokens = load_tokens(args.tokens_file)
        else:
            assert self.tokenizer is not None
            self.tokens = tuple(int(t) for t in self.tokenizer(args.prompt)["input_ids"])
        vocab = int(self.model.config.get_text_config(decoder=True).vocab_size)
        if any(not 0 <= t < vocab for t in self.tokens):
            raise CliError(
                f"a token ID is outside the model's vocabulary (0..{vocab - 1})", Exit.USAGE
            )
        self.ids = self.torch.tensor([self.tokens], dtype=self.torch.long)
        # one short untimed forward pass first: the first call of a process pays one-time
        # set-up costs (kernels, thread pools) that a serving model has long paid
        with self.torch.inference_mode():
            self.model(self.ids[:, : min(8, self.ids.shape[1])])

    def text(self, tokens: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


# --- threads and the handoff into the loop ----------------------------------------------------


def _is_asyncio(b: ModuleType) -> bool:
    return b is asyncio_binding


async def _in_thread(b: ModuleType, fn: Any) -> Any:
    if _is_asyncio(b):
        return await asyncio.to_thread(fn)
    import trio  # on trio only: an asyncio process never loads it

    return await trio.to_thread.run_sync(fn)


class _Handoff:
    """Items put from a worker thread (started by :func:`_in_thread`), got in the loop."""

    def __init__(self, b: ModuleType) -> None:
        self.asyncio = _is_asyncio(b)
        if self.asyncio:
            self.loop = asyncio.get_running_loop()
            self.queue: asyncio.Queue[Any] = asyncio.Queue()
        else:
            import trio

            self.send, self.recv = trio.open_memory_channel[Any](math.inf)

    def put(self, item: Any) -> None:
        if self.asyncio:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        else:
            import trio

            trio.from_thread.run_sync(self.send.send_nowait, item)

    async def get(self) -> Any:
        if self.asyncio:
            return await self.queue.get()
        return await self.recv.receive()


def _greedy(loaded: Loaded, cache: Any, n: int, stamp: list[float]) -> tuple[list[int], Any]:
    """``generate()`` greedily for ``n`` tokens: the new tokens and the logits of each step;
    ``stamp`` gets the time of the first new token."""
    from transformers.generation.streamers import (  # type: ignore[import-not-found, unused-ignore]
        BaseStreamer,
    )

    class FirstToken(BaseStreamer):  # type: ignore[misc, unused-ignore]
        calls = 0

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls == 2:  # the first put() is the prompt
                stamp.append(time.perf_counter())

        def end(self) -> None:
            return None

    kwargs = {} if cache is None else loaded.tk.cache_kwargs(loaded.model, cache)
    with loaded.torch.inference_mode():
        out = loaded.model.generate(
            loaded.ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            streamer=FirstToken(),
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=loaded.model.config.eos_token_id or 0,
            **kwargs,
        )
    new = [int(t) for t in out.sequences[0, loaded.ids.shape[1] :]]
    return new, loaded.torch.stack([x[0].float() for x in out.logits])


# --- kvcs prefill ----------------------------------------------------------------------------


async def prefill(b: ModuleType, args: argparse.Namespace) -> int:
    commands._stop_on_sigterm()
    loaded = Loaded(args)
    key = scope_key(args)
    signer = commands.load_signer(args)
    pub_id = commands.publication_id(args)
    cd = loaded.cd
    published = commands.tokens_to_publish(len(loaded.tokens), cd.block_tokens, "prefill")
    tk, torch = loaded.tk, loaded.torch
    async with commands._connect(b, args) as client:
        try:
            pub = await client.publish_cache(
                loaded.descriptor,
                key,
                loaded.tokens,
                publication_id=pub_id,
                signer=signer,
                offer=RAW_KV if args.codec == "raw" else Q8_OFFER,
            )
        except PublisherError as exc:
            raise CliError(f"cannot publish: {exc}", Exit.USAGE) from None
        ns = pub.publisher.namespace
        commands.report(
            args,
            event="publishing",
            namespace=format_namespace(ns),
            layers=cd.layers,
            tokens=published,
            codec=args.codec,
        )
        if args.wait_for_subscriber:
            await commands._wait_subscribed(b, client, pub, args.wait_for_subscriber)
        handoff = _Handoff(b)
        cache = loaded.transformers.DynamicCache(config=loaded.model.config)
        tap = tk.PrefillTap(
            loaded.model,
            cache,
            loaded.descriptor,
            lambda layer, s: handoff.put((layer, s)),
            tokens=published,
            pace=args.layer_interval,
        )
        t0 = time.perf_counter()
        timing: dict[str, float] = {}

        def forward() -> None:
            try:
                with tap, torch.inference_mode():
                    loaded.model(loaded.ids, **tk.cache_kwargs(loaded.model, cache), use_cache=True)
                timing["prefill"] = time.perf_counter() - t0
            finally:
                handoff.put(None)  # the end (also after an error: the loop stops waiting)

        sent: list[float] = []

        async def publish_layers() -> None:
            while (item := await handoff.get()) is not None:
                layer, sections = item
                await pub.put_layer(layer, sections.k, sections.v, timeout=args.timeout * 6)
                sent.append(time.perf_counter() - t0)

        await b.gather(lambda: _in_thread(b, forward), publish_layers)
        if len(sent) != cd.layers:
            raise CliError(f"the prefill published {len(sent)} of {cd.layers} layers", Exit.FAILED)
        await pub.finish()
        await pub.drained(timeout=None if args.serve_for is None else args.serve_for + 60)
        commands.report(
            args,
            event="published",
            namespace=format_namespace(ns),
            layers=cd.layers,
            tokens=published,
            bytes=pub.publisher.total_bytes,
            prefill_ms=round(timing["prefill"] * 1e3, 1),
            layers_ms=[round(x * 1e3, 1) for x in sent],
            hooks_ms=[round((t - t0) * 1e3, 1) for _, _, t in tap.events],
        )
        if args.max_new_tokens:
            own = tk.trimmed_cache(
                cache, loaded.model.config, tk.reusable_tokens(len(loaded.tokens), 1)
            )
            new, _ = await _in_thread(b, lambda: _greedy(loaded, own, args.max_new_tokens, []))
            commands.report(args, event="generated", new_tokens=new, text=loaded.text(new))
        if args.serve_for is None and not args.json:
            print("kvcs prefill: serving the publication until interrupted", flush=True)
        with contextlib.suppress(commands.Terminated):
            await commands._wait(b, args.serve_for, until=lambda: client.closed)
        if client.closed:
            raise CliError("the relay closed the connection", Exit.NETWORK)
    return Exit.OK


# --- kvcs generate ---------------------------------------------------------------------------


async def generate(b: ModuleType, args: argparse.Namespace) -> int:
    loaded = Loaded(args)
    tk = loaded.tk
    key = scope_key(args)
    keys = commands.load_producer_keys(args)
    cd = loaded.cd
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1", Exit.USAGE)
    wanted = tk.reusable_tokens(len(loaded.tokens), cd.block_tokens)
    if wanted == 0:
        raise CliError(
            f"the prompt has {len(loaded.tokens)} tokens: generate() reuses a cache of "
            f"input_ids[:, :-1], which needs at least {cd.block_tokens + 1} tokens for one "
            f"block of {cd.block_tokens}",
            Exit.USAGE,
        )
    from kvcs.adapters.torch_kv import TorchKvDestination

    dest = TorchKvDestination(cd, wanted)
    staging = tk.Q8Staging(cd, wanted) if args.codec == "q8" else None
    feed = tk.LayerFeed(dest, cd.layers, timeout=args.fetch_timeout)
    state: dict[str, Any] = {"prefix": 0, "fallback": None}
    stamp: list[float] = []
    async with commands._connect(b, args) as client:
        t0 = time.perf_counter()
        retrieval = client.retrieve_cache(
            loaded.descriptor,
            key,
            loaded.tokens[:wanted],
            destinations=staging.buffer if staging is not None else dest.buffer,
            tracks=TrackSelection(codec="q8", joint=True) if staging is not None else None,
            producer_keys=keys,
            require_authenticity=keys is not None,
            recovery_time_bound=args.recovery_time,
            config=ConsumerConfig(stall_timeout=args.stall_timeout),
        )
        layers = retrieval.layers(timeout=args.fetch_timeout).__aiter__()
        first: int | None = None
        with contextlib.suppress(StopAsyncIteration, TimeoutError):
            first = await layers.__anext__()
        first_ms = None if first is None else round((time.perf_counter() - t0) * 1e3, 1)
        selected = [e for e in retrieval.events if isinstance(e, PublicationSelected) and e.primary]
        if first is not None and selected:
            state["prefix"] = min(selected[0].blocks * cd.block_tokens, wanted)

        def deliver(layer: int) -> None:
            if staging is not None:
                tk.q8_layer_into(staging, layer, dest)
            feed.ready(layer)

        async def feed_layers() -> None:
            if first is None:
                return
            deliver(first)
            try:
                async for layer in layers:
                    deliver(layer)
            except TimeoutError:
                pass
            feed.fail("the retrieval ended without it")

        def run_generate() -> tuple[list[int], Any]:
            if state["prefix"]:
                cache = tk.StreamedCache(loaded.model.config, state["prefix"], feed)
                try:
                    with tk.ComputeTrace(loaded.model, feed):
                        return _greedy(loaded, cache, args.max_new_tokens, stamp)
                except tk.CacheUnavailable as exc:
                    state["fallback"] = str(exc)
                    stamp.clear()
            return _greedy(loaded, None, args.max_new_tokens, stamp)

        if args.after_retrieval:  # the baseline without pipelining: every layer first
            await feed_layers()
            new, logits = await _in_thread(b, run_generate)
        else:
            results: list[Any] = await b.gather(feed_layers, lambda: _in_thread(b, run_generate))
            new, logits = results[1]
        ttft = stamp[0] - t0 if stamp else None
        result = None
        with contextlib.suppress(TimeoutError):
            result = await retrieval.result(timeout=1.0, strict=False)
    cached = state["prefix"] if state["fallback"] is None else 0
    if not cached:
        why = state["fallback"] or "no usable publication of the prompt was found"
        log.warning("generate: no cache used (%s): the prompt was recomputed", why)
    extra: dict[str, Any] = {}
    if args.recompute:
        cold: list[float] = []
        t1 = time.perf_counter()
        cold_new, cold_logits = await _in_thread(
            b, lambda: _greedy(loaded, None, args.max_new_tokens, cold)
        )
        extra["ttft_recompute_ms"] = round((cold[0] - t1) * 1e3, 1) if cold else None
        extra["same_as_recompute"] = cold_new == new
        extra["matching_tokens"] = sum(x == y for x, y in zip(cold_new, new, strict=True))
        extra["matching_prefix"] = len(_prefix_equal(cold_new, new))
        extra["max_logit_diff"] = float((cold_logits - logits).abs().max())
    if args.trace:
        extra["events"] = [[w, layer, round((t - t0) * 1e3, 2)] for w, layer, t in feed.events]
    commands.report(
        args,
        event="generated",
        cached_tokens=cached,
        prompt_tokens=len(loaded.tokens),
        codec=args.codec,
        first_layer_ms=first_ms,
        ttft_ms=None if ttft is None else round(ttft * 1e3, 1),
        complete=bool(result is not None and result.complete),
        new_tokens=new,
        text=loaded.text(new),
        **extra,
    )
    if not args.json and (text := loaded.text(new)) is not None:
        print(text, flush=True)
    return Exit.OK


def _prefix_equal(a: list[int], b: list[int]) -> list[int]:
    """The common leading tokens of ``a`` and ``b`` (greedy decodes diverge for good once
    one token differs)."""
    out = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        out.append(x)
    return out
