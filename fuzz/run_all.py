"""Run every atheris harness for a few seconds and report executions and crashes.

    python3 fuzz/run_all.py --seconds 5 [--only control,params] [--jobs 2]

Each harness runs in its own process (``python3 fuzz/fuzz_<name>.py``) with
``-max_total_time=N -print_final_stats=1`` over a *temporary copy* of
``fuzz/corpus/<name>/``, so the committed seed corpus is never modified. Inputs
that crash a harness are written to ``fuzz/crashes/`` (git-ignored). Exits 1 if
any harness crashed or could not be run, 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
HARNESSES = (
    "control",
    "subgroup",
    "fetch",
    "datagram",
    "params",
    "session",
    "relay",
    "kvcs_payload",
    "kvcs_names",
    "kvcs_manifest",
    "cachefile",
)

_EXECS = re.compile(r"stat::number_of_executed_units:\s*(\d+)")
_DONE = re.compile(r"Done (\d+) runs in (\d+) second")


@dataclass
class Result:
    name: str
    returncode: int
    executions: int | None
    seconds: float
    corpus_in: int
    corpus_out: int
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.executions is not None


def run_one(name: str, seconds: int, max_len: int) -> Result:
    harness = FUZZ_DIR / f"fuzz_{name}.py"
    seeds = FUZZ_DIR / "corpus" / name
    crashes = FUZZ_DIR / "crashes"
    crashes.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"kvcs-fuzz-{name}-") as tmp:
        corpus = Path(tmp) / "corpus"
        if seeds.is_dir():
            shutil.copytree(seeds, corpus)
        else:
            corpus.mkdir()
        corpus_in = sum(1 for _ in corpus.iterdir())
        cmd = [
            sys.executable,
            str(harness),
            f"-max_total_time={seconds}",
            "-print_final_stats=1",
            f"-max_len={max_len}",
            "-timeout=10",
            "-rss_limit_mb=2048",
            f"-artifact_prefix={crashes}/{name}-",
            str(corpus),
        ]
        t0 = time.monotonic()
        try:
            # the harnesses import this checkout's packages, whatever is installed
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            proc = subprocess.run(
                cmd,
                env=env,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=seconds + 120,
                check=False,
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = -1
            output = f"harness did not stop within {seconds + 120}s\n{exc.stderr or ''}"
        elapsed = time.monotonic() - t0
        corpus_out = sum(1 for _ in corpus.iterdir())
    m = _EXECS.search(output) or _DONE.search(output)
    executions = int(m.group(1)) if m else None
    return Result(name, rc, executions, elapsed, corpus_in, corpus_out, output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="fuzzing time per harness")
    parser.add_argument("--only", default="", help="comma-separated harness names")
    parser.add_argument("--jobs", type=int, default=1, help="harnesses run at the same time")
    parser.add_argument("--max-len", type=int, default=4096, help="libFuzzer -max_len")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(HARNESSES)
    unknown = sorted(set(names) - set(HARNESSES))
    if unknown:
        parser.error(f"unknown harness(es): {', '.join(unknown)}; known: {', '.join(HARNESSES)}")
    if args.seconds < 1:
        parser.error("--seconds must be at least 1")

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda n: run_one(n, args.seconds, args.max_len), names))

    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"---- fuzz_{r.name}.py (exit {r.returncode}): last output ----")
        print("\n".join(r.output.splitlines()[-60:]))
    print(f"{'harness':<10} {'result':<7} {'executions':>11} {'exec/s':>8} {'corpus':>13}")
    for r in results:
        execs = "?" if r.executions is None else str(r.executions)
        rate = "?" if r.executions is None else f"{r.executions / max(r.seconds, 1e-9):.0f}"
        corpus = f"{r.corpus_in}->{r.corpus_out}"
        verdict = "OK" if r.ok else "CRASH" if r.returncode > 0 else "ERROR"
        print(f"{r.name:<10} {verdict:<7} {execs:>11} {rate:>8} {corpus:>13}")
    if failed:
        print(f"{len(failed)} harness(es) failed; crashing inputs are kept in {FUZZ_DIR}/crashes/")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
