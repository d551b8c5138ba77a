"""Time to first token of a Hugging Face model with a KV cache streamed over MOQT (CPU).

Theory of operation
-------------------
For each model (random Llamas built locally, no downloads) the benchmark starts a
``kvcs relay``, then measures with the real commands as processes on 127.0.0.1:

* **completed cache**: ``kvcs prefill`` publishes the prompt's cache and serves it;
  then ``kvcs generate`` once unmeasured (so that the relay has the publication in its
  cache for every measured run), then three ways: streamed (``generate()`` starts at the first
  usable layer), ``--after-retrieval`` (starts once the whole cache is in), and the
  cold ``generate()`` that ``kvcs generate`` runs for comparison (full recompute).
  Times are from the start of the retrieval (after the model is loaded) to the first
  new token.
* **live**: ``kvcs generate`` subscribes while ``kvcs prefill`` (``--wait-for-subscriber``)
  is still to compute: the cache streams layer by layer from the producer's prefill
  into the consumer's forward pass; the time to first token then includes the
  producer's prefill, and is compared with the producer's own prefill time.

Usage: ``python benchmarks/bench_transformers_ttft.py [--large-layers 16 --large-hidden
2048 --large-tokens 2048] [--uncached N] [--skip-large]``. Needs ``kvcs[transformers]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from hf_models import build_model_dir, prompt_text  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "KVCS_CONFIG": ""}
KVCS = [sys.executable, "-m", "kvcs"]


def _lines(p: subprocess.Popen[str], event: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        obj = json.loads(line)
        if obj.get("event") == event:
            return dict(obj)
    raise RuntimeError(f"no {event!r} line from {p.args}")


def _generate(url: str, ca: str, model: Path, prompt: str, *extra: str) -> dict[str, Any]:
    r = subprocess.run(
        [*KVCS, "generate", url, "--model", str(model), "--prompt", prompt, "--ca", ca,
         "--max-new-tokens", "4", "--json", "--fetch-timeout", "900", *extra],
        capture_output=True, text=True, env=ENV, timeout=1800, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    return next(json.loads(x) for x in r.stdout.splitlines() if '"generated"' in x)


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def measure(
    name: str, model: Path, tokens: int, uncached: int, url: str, ca: str, scope: int
) -> None:
    # the cache covers `tokens` (full blocks); `uncached` more are computed by the consumer
    # (the producer's prompt is the shared prefix: its cache is found as the longest
    # published prefix of the consumer's longer prompt)
    prompt = prompt_text(tokens + uncached)
    shared = prompt if uncached == 1 else prompt_text(tokens)
    base = ["--model", str(model), "--prompt", shared, "--ca", ca, "--json"]
    key = ["--scope-key", f"{scope:02x}" * 32]
    producer = subprocess.Popen(
        [*KVCS, "prefill", url, *base, *key, "--serve-for", "1800"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )  # fmt: skip
    try:
        pub = _lines(producer, "published", 1800)
        # unmeasured: the first consumer makes the relay fetch the publication from the
        # producer; the measured ones below are all served from the relay's cache
        _generate(url, ca, model, prompt, *key, "--after-retrieval", "--no-recompute")
        streamed = _generate(url, ca, model, prompt, *key)
        whole = _generate(url, ca, model, prompt, *key, "--after-retrieval", "--no-recompute")
    finally:
        _stop(producer)
    key = ["--scope-key", f"{scope + 1:02x}" * 32]
    producer = subprocess.Popen(
        [*KVCS, "prefill", url, *base, *key, "--serve-for", "1800", "--wait-for-subscriber",
         "600"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )  # fmt: skip
    try:
        _lines(producer, "publishing", 600)
        live = _generate(url, ca, model, prompt, *key, "--no-recompute")
        live_pub = _lines(producer, "published", 1800)
    finally:
        _stop(producer)
    mb = pub["bytes"] / 1e6
    print(f"\n{name}: {tokens} cached + {uncached} uncached tokens, cache {mb:.1f} MB; "
          "producer prefill "
          f"{pub['prefill_ms']:.0f} ms")  # fmt: skip
    print(f"  completed cache, streamed into generate(): ttft {streamed['ttft_ms']:8.0f} ms "
          f"(first layer usable at {streamed['first_layer_ms']} ms)")  # fmt: skip
    print(f"  completed cache, after full retrieval:     ttft {whole['ttft_ms']:8.0f} ms")
    print(f"  full recompute (cold generate()):          ttft "
          f"{streamed['ttft_recompute_ms']:8.0f} ms; same tokens: "
          f"{streamed['same_as_recompute']}")  # fmt: skip
    print(f"  live (during the producer's prefill of {live_pub['prefill_ms']:.0f} ms): "
          f"ttft {live['ttft_ms']:.0f} ms from the consumer's start")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small-tokens", type=int, default=256)
    ap.add_argument("--large-layers", type=int, default=16)
    ap.add_argument("--large-hidden", type=int, default=2048)
    ap.add_argument("--large-tokens", type=int, default=2048)
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument(
        "--uncached",
        type=int,
        default=1,
        help="prompt tokens after the cached ones, computed by the consumer (default 1; "
        "above 1 the producer publishes the first tokens only, a shared prefix)",
    )
    args = ap.parse_args()
    import torch  # noqa: PLC0415  (after the path set-up)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        relay = subprocess.Popen(
            [*KVCS, "relay", "--listen", "127.0.0.1:0", "--self-signed", "--json",
             "--cache-budget", "4GiB"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
        )  # fmt: skip
        try:
            first = _lines(relay, "listening", 60)
            url, ca = first["url"], first["ca"]
            small = build_model_dir(root / "small", dtype=torch.bfloat16)
            measure("small Llama (4 layers, hidden 256, 2 KV heads)", small, args.small_tokens,
                    args.uncached, url, ca, 0x10)  # fmt: skip
            if not args.skip_large:
                t = time.perf_counter()
                heads = args.large_hidden // 128
                large = build_model_dir(
                    root / "large", layers=args.large_layers, hidden=args.large_hidden,
                    heads=heads, kv_heads=max(1, heads // 2), dtype=torch.bfloat16,
                )  # fmt: skip
                print(f"\n(large model built in {time.perf_counter() - t:.0f} s)")
                measure(
                    f"large Llama ({args.large_layers} layers, hidden {args.large_hidden}, "
                    f"{heads} heads, {max(1, heads // 2)} KV heads)",
                    large, args.large_tokens, args.uncached, url, ca, 0x20,
                )  # fmt: skip
        finally:
            _stop(relay)


if __name__ == "__main__":
    main()
