"""Issue 11, "20 consecutive runs of each configuration complete and bit-identical", small.

``benchmarks/bench_relay_pipeline.py --runs-consecutive 3`` over real QUIC on
127.0.0.1, every process a separate one (``kvcs relay``, ``kvcs publish``,
``kvcs fetch``), on a 2 MiB, 4-layer cache: a live consumer through one relay
with a paced producer, a live consumer through a two-relay tree, and a late
consumer (after the publication completed) through the tree. Every run must
complete with the published bits (``kvcs fetch --digest`` equal to ``kvcs
publish --digest``), with ``kvcs fetch``'s default stall and recovery
timeouts. No speed is asserted. Bounded: each wait of the benchmark by
``--timeout``, the whole by the subprocess timeout, and every child process by
its own time bound (``--run-for``, ``--serve-for``, ``--fetch-timeout``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_relay_pipeline.py"
CONFIGS = ("paced/live/relay", "unpaced/live/tree", "unpaced/late/tree")
RUNS = 3


def test_consecutive_runs_complete_bit_identical(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    cmd = [
        sys.executable, str(BENCH), "--mib", "2", "--layers", "4", "--stacks", "aioquic",
        "--configs", ",".join(CONFIGS), "--runs-consecutive", str(RUNS),
        "--timeout", "60", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    report = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert out.exists(), report
    runs = json.loads(out.read_text())
    assert sorted((r["config"], r["run"]) for r in runs) == sorted(
        (c, i) for c in CONFIGS for i in range(1, RUNS + 1)
    ), report
    bad = [
        f"{r['config']} run {r['run']}: {r.get('error')}\n{r.get('detail', '')[-800:]}"
        for r in runs
        if not (r.get("complete") and r["ok"])
    ]
    assert not bad, "\n".join(bad)
    for r in runs:
        assert len(r["digest"]) == 64
        assert r["digest"] == r["published_digest"]
        assert r["layers_ready"] == 4
    assert proc.returncode == 0, report


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "stack",
    [
        "aioquic",
        "qh3",
        pytest.param(
            "pquic",
            marks=pytest.mark.skipif(
                not _importable("aiopquic"),
                reason="aiopquic is not importable (wheels for Python >= 3.12 only)",
            ),
        ),
    ],
)
def test_raw_pipelines_carry_the_bytes(tmp_path: Path, stack: str) -> None:
    # the benchmark's reference ("vs raw"): sender -> forwarder(s) -> receiver of each
    # stack (pquic's through aiopquic's own asyncio API) must deliver the sender's bytes
    out = tmp_path / "raw.json"
    cmd = [
        sys.executable, str(BENCH), "--mib", "2", "--layers", "4", "--stacks", stack,
        "--configs", "unpaced/live/relay,unpaced/live/tree", "--no-aiomoqt",
        "--timeout", "60", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    report = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert out.exists(), report
    raw = {r["hops"]: r for r in json.loads(out.read_text()) if r["kind"] == "raw"}
    assert sorted(raw) == [1, 2], report
    for hops, r in raw.items():
        assert r["ok"] and r["error"] is None, f"{hops} hop(s): {r}\n{report}"
        assert r["rate"] > 0
