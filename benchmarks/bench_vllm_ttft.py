"""Time to first token of a vLLM consumer engine with the kvcs connector against recompute (CPU).

Theory of operation
-------------------
Real processes on 127.0.0.1, the tiny random Llama of the tests (built locally, no
downloads; ``--layers/--hidden`` for a larger one): a ``kvcs relay``; a producer engine
(``kv_producer``) that prefills each prompt once and keeps its publications up; then,
one after the other, a consumer engine (``kv_consumer``) and the same engine without a
connector (the recompute baseline). Each of the two times ``--runs`` one-token
generations of every prompt (prefix caching off: every request of the consumer does
the lookup and loads the prefix from the relay; every request of the baseline computes
the whole prompt) and the medians are printed side by side, from the same run. The
first run of each prompt is the engine's first request of that shape and is left out
of the median. Engines come from ``tests/vllm/engine_proc.py``.

Usage: ``python benchmarks/bench_vllm_ttft.py [--tokens 100,480] [--runs 6]
[--layers 4 --hidden 256]``. Needs the vLLM venv (``.venvs/vllm``, see README
"vLLM connector").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import torch  # noqa: E402
from hf_models import build_model_dir  # noqa: E402
from procs import Proc  # noqa: E402

ENGINE = ROOT / "tests" / "vllm" / "engine_proc.py"


def _engine(model: Path, tokens: Path, log: Path, extra: list[str]) -> Proc:
    return Proc(
        [sys.executable, str(ENGINE), "--model", str(model), "--tokens-file", str(tokens), *extra],
        log,
    )


def _all(p: Proc, name: str, count: int, timeout: float) -> list[dict[str, Any]]:
    """The first ``count`` events ``name`` of ``p``, in order."""
    deadline = time.monotonic() + timeout
    while True:
        p.wait_event(name, max(deadline - time.monotonic(), 0.1))
        found = [e for e in p.events if e.get("event") == name]
        if len(found) >= count:
            return found[:count]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(found)} of {count} {name!r} from {p.p.args!r}")
        time.sleep(0.2)
        p.poll()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="100,480", help="prompt lengths (default 100,480)")
    ap.add_argument("--runs", type=int, default=6, help="one-token requests per prompt")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = build_model_dir(tmp / "model", layers=args.layers, hidden=args.hidden)
    g = torch.Generator().manual_seed(11)
    prompts = [[int(t) for t in torch.randint(3, 1000, (n,), generator=g)] for n in lengths]
    tokens = tmp / "prompts.json"
    tokens.write_text(json.dumps(prompts))
    procs: list[Proc] = []
    try:
        relay = Proc(
            [sys.executable, "-m", "kvcs", "relay", "--listen", "127.0.0.1:0", "--self-signed",
             "--cert-dir", str(tmp / "tls"), "--json", "--stats-interval", "3600"],
            tmp / "relay.out",
        )  # fmt: skip
        procs.append(relay)
        up = relay.wait_event("listening", 60)
        conn = ["--relay", up["url"], "--ca", up["ca"], "--max-tokens", "1"]
        producer = _engine(
            model, tokens, tmp / "producer.out", ["--role", "kv_producer", *conn, "--serve"]
        )
        procs.append(producer)
        _all(producer, "result", len(prompts), 300)
        time.sleep(1.0)  # the last publication's layers are on their way to the relay
        rows: dict[str, list[dict[str, Any]]] = {}
        for name, extra in (
            ("connector", ["--role", "kv_consumer", *conn]),
            ("recompute", ["--max-tokens", "1"]),
        ):
            p = _engine(model, tokens, tmp / f"{name}.out", [*extra, "--ttft-runs", str(args.runs)])
            procs.append(p)
            rows[name] = _all(p, "ttft", len(prompts), 600)
            p.stop()
    finally:
        for p in reversed(procs):
            p.stop()
    print(
        f"model: {args.layers} layers, hidden {args.hidden} (random Llama, float32, CPU, "
        f"block 32); {args.runs} one-token requests per prompt, first left out"
    )
    print(f"{'prompt':>7} {'cached':>7} {'TTFT connector':>15} {'TTFT recompute':>15}")
    for i, n in enumerate(lengths):
        c, r = rows["connector"][i], rows["recompute"][i]
        mc = statistics.median(c["seconds"][1:] or c["seconds"]) * 1e3
        mr = statistics.median(r["seconds"][1:] or r["seconds"]) * 1e3
        cached = max(c["num_cached_tokens"])
        print(f"{n:>7} {cached:>7} {mc:>12.1f} ms {mr:>12.1f} ms")
        print(
            json.dumps(
                {"prompt_tokens": n, "cached_tokens": cached, "connector_s": c["seconds"],
                 "recompute_s": r["seconds"]}
            )
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
