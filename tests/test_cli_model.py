"""``kvcs prefill`` and ``kvcs generate`` end to end: a real (small, random, locally built)
Llama, a ``kvcs relay`` process, and the two commands as processes over QUIC on 127.0.0.1."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import build_model_dir, prompt_text

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "KVCS_CONFIG": ""}
KVCS = [sys.executable, "-m", "kvcs"]
PROMPT = prompt_text(70)  # 64 tokens in 4 blocks are reused, 6 are computed
NEW = 16


class Proc:
    """A ``kvcs`` process whose stdout JSON lines are read with a deadline."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [*KVCS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.p.stderr or ()), daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout or ():
            self.lines.put(line)
        self.lines.put(None)

    def until(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            obj = json.loads(line)
            if obj.get("event") == event:
                return dict(obj)
        raise AssertionError(f"no {event!r} line; stderr: {''.join(self.err)[-2000:]}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)


@pytest.fixture(scope="module")
def relay() -> Iterator[tuple[str, str]]:
    r = Proc("relay", "--listen", "127.0.0.1:0", "--self-signed", "--json", "--run-for", "600")
    try:
        line = r.until("listening", 30)
        yield line["url"], line["ca"]
    finally:
        r.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch  # noqa: PLC0415  (after the importorskip)

    root = tmp_path_factory.mktemp("models")
    return {
        "bfloat16": build_model_dir(root / "bf16", dtype=torch.bfloat16),
        "float16": build_model_dir(root / "f16", dtype=torch.float16),
    }


def _generate(url: str, ca: str, model: Path, *extra: str) -> dict[str, Any]:
    r = subprocess.run(
        [
            *KVCS,
            "generate",
            url,
            "--model",
            str(model),
            "--prompt",
            PROMPT,
            "--ca",
            ca,
            "--max-new-tokens",
            str(NEW),
            "--json",
            "--fetch-timeout",
            "60",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    return next(x for x in lines if x["event"] == "generated")


def _prefill(url: str, ca: str, model: Path, scope: str, *extra: str) -> Proc:
    return Proc(
        "prefill",
        url,
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--ca",
        ca,
        "--json",
        "--scope-key",
        scope,
        "--serve-for",
        "90",
        *extra,
    )


@pytest.mark.parametrize(("dtype", "scope"), [("bfloat16", "11" * 32), ("float16", "22" * 32)])
def test_a_real_model_end_to_end_over_quic(
    relay: tuple[str, str], models: dict[str, Path], dtype: str, scope: str
) -> None:
    url, ca = relay
    producer = _prefill(url, ca, models[dtype], scope, "--max-new-tokens", str(NEW))
    try:
        published = producer.until("published")
        assert published["layers"] == 4 and published["tokens"] == 64
        assert len(published["hooks_ms"]) == 4
        own = producer.until("generated")["new_tokens"]  # the producer's own cache
        got = _generate(url, ca, models[dtype], "--scope-key", scope)
        whole = _generate(
            url,
            ca,
            models[dtype],
            "--scope-key",
            scope,
            "--after-retrieval",
            "--no-recompute",
            "--trace",
        )
    finally:
        producer.stop()
    assert got["cached_tokens"] == 64 and got["complete"] is True
    assert len(got["new_tokens"]) == NEW
    assert got["new_tokens"] == own  # the streamed cache gives the producer's decode
    assert got["same_as_recompute"] is True and got["matching_tokens"] == NEW  # and a cold one
    assert got["text"] == " ".join(f"w{t}" for t in own)
    assert got["ttft_ms"] > 0 and got["ttft_recompute_ms"] > 0
    # --after-retrieval: every layer is in before the forward pass takes the first one
    assert whole["new_tokens"] == own and whole["cached_tokens"] == 64
    at = {(w, layer): t for w, layer, t in whole["events"]}
    assert max(at[("arrived", n)] for n in range(4)) <= at[("taken", 0)]


def test_q8_is_lossy_and_reported(relay: tuple[str, str], models: dict[str, Path]) -> None:
    url, ca = relay
    scope = "33" * 32
    producer = _prefill(url, ca, models["bfloat16"], scope, "--codec", "q8")
    try:
        assert producer.until("published")["tokens"] == 64
        got = _generate(url, ca, models["bfloat16"], "--scope-key", scope, "--codec", "q8")
    finally:
        producer.stop()
    assert got["cached_tokens"] == 64 and got["complete"] is True and got["codec"] == "q8"
    assert 0 <= got["matching_tokens"] <= NEW and got["max_logit_diff"] > 0
    print(
        f"q8: {got['matching_tokens']}/{NEW} tokens match a cold generate (first "
        f"{got['matching_prefix']} in a row); largest logit difference "
        f"{got['max_logit_diff']:.4f}"
    )


def test_the_forward_pass_runs_while_layers_arrive(
    relay: tuple[str, str], models: dict[str, Path]
) -> None:
    url, ca = relay
    scope = "44" * 32
    pace = 1.0  # the producer's layers come this far apart
    producer = _prefill(
        url,
        ca,
        models["bfloat16"],
        scope,
        "--layer-interval",
        str(pace),
        "--wait-for-subscriber",
        "60",
    )
    try:
        producer.until("publishing")
        got = _generate(
            url, ca, models["bfloat16"], "--scope-key", scope, "--trace", "--no-recompute"
        )
    finally:
        producer.stop()
    assert got["cached_tokens"] == 64
    at = {(w, layer): t for w, layer, t in got["events"]}
    assert at[("computed", 0)] < at[("arrived", 3)]  # layer 0 ran before layer 3 arrived
    for layer in range(4):
        assert at[("arrived", layer)] <= at[("taken", layer)] <= at[("computed", layer)]
    # the pass over the uncached tokens ends within a pacing interval of the last arrival
    assert at[("computed", 3)] - at[("arrived", 3)] < pace * 1e3
    assert got["ttft_ms"] >= at[("arrived", 3)]


def test_a_cache_that_is_not_there_is_recomputed_with_a_warning(
    relay: tuple[str, str], models: dict[str, Path]
) -> None:
    url, ca = relay
    r = subprocess.run(
        [*KVCS, "generate", url, "--model", str(models["bfloat16"]), "--prompt", PROMPT,
         "--ca", ca, "--max-new-tokens", "4", "--json", "--no-recompute", "--fetch-timeout",
         "20", "--scope-key", "55" * 32],
        capture_output=True, text=True, env=ENV, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["cached_tokens"] == 0 and got["complete"] is False and len(got["new_tokens"]) == 4
    assert "no cache used" in r.stderr and "recomputed" in r.stderr


def _one_error(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    errors = [x for x in lines if x.startswith("kvcs: error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    return errors[0]


def test_bad_input_is_one_line_with_its_status(tmp_path: Path, models: dict[str, Path]) -> None:
    def kvcs(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*KVCS, *args], capture_output=True, text=True, env=ENV, check=False, timeout=60
        )

    url = "moqt://127.0.0.1:9"
    r = kvcs("generate", url, "--model", str(tmp_path / "nope"), "--prompt", "w5")
    assert r.returncode == 5 and "not a model directory" in _one_error(r)
    r = kvcs("generate", url, "--model", str(models["bfloat16"]), "--prompt", "w5 w6", "-k")
    assert r.returncode == 2 and "at least 17 tokens" in _one_error(r)
    r = kvcs("prefill", url, "--model", str(models["bfloat16"]), "--prompt", "w5", "-k")
    assert r.returncode == 2 and "fewer than one block" in _one_error(r)
    tokens = tmp_path / "t.json"
    tokens.write_text(json.dumps([5, 6, 99999] * 10))
    r = kvcs("prefill", url, "--model", str(models["bfloat16"]), "--tokens-file", str(tokens))
    assert r.returncode == 2 and "outside the model's vocabulary" in _one_error(r)
    r = kvcs("generate", url, "--model", str(models["bfloat16"]), "--max-new-tokens", "1")
    assert r.returncode == 2 and "--prompt" in _one_error(r)


def test_without_transformers_the_error_names_the_extra(models: dict[str, Path]) -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from kvcs.transports.cli import main\n"
        f"sys.exit(main(['generate', 'moqt://127.0.0.1:9', '--model', {str(models['bfloat16'])!r},"
        " '--prompt', 'w5']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
        timeout=60,
    )
    assert r.returncode == 2
    assert "pip install 'kvcs[transformers]'" in _one_error(r)
