"""One vLLM engine in its own process, for the connector's end-to-end tests and benchmark.

``python engine_proc.py --model DIR --tokens-file T.json [--role kv_producer|kv_consumer|
kv_both --relay URL --ca PEM --scope-key HEX --event-log PATH] [--max-tokens N]
[--dtype float32] [--serve] [--wait-go] [--ttft-runs K]``

Builds ``vllm.LLM`` (CPU: ``--dtype``, default float32; block size 32; eager; prefix
caching off unless ``--prefix-caching``, so that every cached token the scheduler
reports is an external one), generates greedily from the prompt's token IDs
(``--tokens-file``: a JSON list of token IDs, or a list of such lists for several
prompts, one after the other) and prints one JSON line per prompt: ``{"event":
"result", "index": i, "tokens": [...], "num_cached_tokens": n, "generate_s": s}``.

* ``--ttft-runs K``: then times, per prompt, K one-token generations (new requests:
  the time to first token, which with a consumer includes the lookup and the load)
  and prints ``{"event": "ttft", "index": i, "seconds": [...]}``.
* ``--serve``: stays up (a producer keeps offering its publications) until a line
  arrives on stdin or stdin closes, bounded by ``--serve-for`` seconds.
* ``--wait-go``: prints ``{"event": "ready"}`` once the engine is built and generates
  only after a line arrives on stdin.

Without ``--role`` the engine has no connector (the recompute baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def by_source(llm: Any) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_by_source`` counters so far (``local_compute``,
    ``local_cache_hit``, ``external_kv_transfer``): what the scheduler says each prompt
    token came from."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            source = str(m.labels.get("source"))
            out[source] = out.get(source, 0.0) + float(m.value)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens-file", required=True)
    p.add_argument("--role")
    p.add_argument("--relay")
    p.add_argument("--ca")
    p.add_argument("--scope-key", default="11" * 32)
    p.add_argument("--event-log")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--serve", action="store_true")
    p.add_argument("--wait-go", action="store_true")
    p.add_argument("--serve-for", type=float, default=300.0)
    p.add_argument("--ttft-runs", type=int, default=0)
    p.add_argument("--recovery-time", type=float, default=1.0)
    args = p.parse_args()

    from vllm import LLM, SamplingParams  # noqa: PLC0415 - after the environment is set

    kwargs: dict[str, object] = {}
    if args.role:
        extra = {
            "relay": args.relay,
            "scope_key": args.scope_key,
            "recovery_time": args.recovery_time,
        }
        if args.ca:
            extra["ca"] = args.ca
        if args.event_log:
            extra["event_log"] = args.event_log
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvcsConnector",
            "kv_connector_module_path": "kvcs.vllm",
            "kv_role": args.role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    with open(args.tokens_file) as f:
        loaded = json.load(f)
    prompts = loaded if loaded and isinstance(loaded[0], list) else [loaded]
    prompts = [[int(t) for t in p] for p in prompts]
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=512,
        block_size=32,
        enforce_eager=True,
        max_num_seqs=4,
        enable_prefix_caching=args.prefix_caching,
        gpu_memory_utilization=0.1,
        seed=0,
        disable_log_stats=False,  # for llm.get_metrics()
        **kwargs,
    )
    started = time.perf_counter() - t0
    if args.wait_go:  # start-ups of several engines overlap; their requests need not
        print(json.dumps({"event": "ready", "start_s": round(started, 2)}), flush=True)
        sys.stdin.readline()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, tokens in enumerate(prompts):
        t1 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        gen = time.perf_counter() - t1
        result = {
            "event": "result",
            "index": i,
            "tokens": list(out[0].outputs[0].token_ids),
            "num_cached_tokens": out[0].num_cached_tokens,
            "prompt_tokens": len(tokens),
            "start_s": round(started, 2),
            "generate_s": round(gen, 3),
            "prompt_tokens_by_source": by_source(llm),
        }
        print(json.dumps(result), flush=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, tokens in enumerate(prompts):
        if not args.ttft_runs:
            break
        seconds, cached = [], []
        for _ in range(args.ttft_runs):
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": tokens}], one, use_tqdm=False)
            seconds.append(round(time.perf_counter() - t, 4))
            cached.append(out[0].num_cached_tokens)
        print(
            json.dumps(
                {"event": "ttft", "index": i, "prompt_tokens": len(tokens), "seconds": seconds,
                 "num_cached_tokens": cached}
            ),
            flush=True,
        )  # fmt: skip
    if args.serve:
        deadline = time.monotonic() + args.serve_for
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sys.stdin], [], [], 0.5)
            if ready:
                break
    print(json.dumps({"event": "exit"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
