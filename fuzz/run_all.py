"""Run every atheris harness for a few seconds and report executions and crashes.

    python3 fuzz/run_all.py --seconds 5 [--only control,params] [--jobs 2]

Each harness runs in its own process (``python3 fuzz/fuzz_<name>.py``) with
``-max_total_time=N -print_final_stats=1`` over a *temporary copy* of
``fuzz/corpus/<name>/``, so the committed seed corpus is never modified. Inputs
that crash a harness are written to ``fuzz/crashes/`` (git-ignored). Exits 1 if
any harness crashed or could not be run, 0 otherwise.

``fuzz/campaign`` reuses the runner (:func:`run_one`, :func:`run_many`) and the
harness list (:data:`HARNESSES`, one name per line: add a harness here and both
pick it up).
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
from collections.abc import Callable
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
    "secure_objects",
    "cat_token",
)

_EXECS = re.compile(r"stat::number_of_executed_units:\s*(\d+)")
_RATE = re.compile(r"stat::average_exec_per_sec:\s*(\d+)")
_DONE = re.compile(r"Done (\d+) runs in (\d+) second")
_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.MULTILINE)
"""A libFuzzer status line: ``#N  NEW|REDUCE|pulse|INITED|DONE  cov: C ft: F corp: K/size``."""


@dataclass
class Result:
    name: str
    returncode: int
    executions: int | None
    seconds: float
    corpus_in: int
    corpus_out: int
    output: str
    exec_per_s: int | None = None
    """libFuzzer's own average (fuzzing time only, no start-up); None if not printed."""
    cov: int | None = None
    """Coverage counters (``cov:``) at the last status line."""
    ft: int | None = None
    """Features (``ft:``) at the last status line."""
    crash_files: tuple[str, ...] = ()
    """Files this run added to ``fuzz/crashes/``."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.executions is not None

    @property
    def rate(self) -> float:
        """Executions per second: libFuzzer's average over the fuzzing time when it
        printed one (it prints 0 for runs under a second), else over the wall time
        (start-up included)."""
        if self.exec_per_s:
            return float(self.exec_per_s)
        return (self.executions or 0) / max(self.seconds, 1e-9)

    @property
    def verdict(self) -> str:
        """OK; CRASH (an input broke the harness); ERROR (it did not run, or hung)."""
        if self.ok:
            return "OK"
        if self.crash_files or (self.returncode > 0 and self.executions is not None):
            return "CRASH"
        return "ERROR"


def parse_output(output: str) -> dict[str, int | None]:
    """Executions, exec/s, cov and ft from a libFuzzer run's output (None when absent)."""
    m = _EXECS.search(output) or _DONE.search(output)
    rate = _RATE.search(output)
    status = _STATUS.findall(output)
    last = status[-1] if status else None
    executions = int(m.group(1)) if m else None
    if executions is None and last is not None:
        executions = int(last[0])  # a crash: the last status line is the best count
    return {
        "executions": executions,
        "exec_per_s": int(rate.group(1)) if rate else None,
        "cov": int(last[1]) if last else None,
        "ft": int(last[2]) if last else None,
    }


def run_one(
    name: str,
    seconds: int,
    max_len: int,
    runs: int | None = None,
    extra: tuple[str, ...] = (),
) -> Result:
    """Fuzz ``name`` for ``seconds`` (and at most ``runs`` executions) over a copy of its seeds."""
    harness = FUZZ_DIR / f"fuzz_{name}.py"
    seeds = FUZZ_DIR / "corpus" / name
    crashes = FUZZ_DIR / "crashes"
    crashes.mkdir(exist_ok=True)
    before = {p.name for p in crashes.iterdir()}
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
            *([f"-runs={runs}"] if runs is not None else []),
            *extra,
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
    stats = parse_output(output)
    new = tuple(sorted(p.name for p in crashes.iterdir() if p.name not in before))
    return Result(
        name,
        rc,
        stats["executions"],
        elapsed,
        corpus_in,
        corpus_out,
        output,
        exec_per_s=stats["exec_per_s"],
        cov=stats["cov"],
        ft=stats["ft"],
        crash_files=new,
    )


def run_many(names: list[str], jobs: int, run: Callable[[str], Result]) -> list[Result]:
    """``run`` for every name, ``jobs`` at a time, results in the order of ``names``."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(run, names))


def check_names(parser: argparse.ArgumentParser, only: str) -> list[str]:
    """The harnesses ``--only`` names (all of :data:`HARNESSES` when empty)."""
    names = [n for n in only.split(",") if n] or list(HARNESSES)
    unknown = sorted(set(names) - set(HARNESSES))
    if unknown:
        parser.error(f"unknown harness(es): {', '.join(unknown)}; known: {', '.join(HARNESSES)}")
    return names


def print_failures(results: list[Result]) -> None:
    """The last output lines of every harness that crashed or could not run."""
    for r in results:
        if not r.ok:
            print(f"---- fuzz_{r.name}.py (exit {r.returncode}): last output ----")
            print("\n".join(r.output.splitlines()[-60:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="fuzzing time per harness")
    parser.add_argument("--only", default="", help="comma-separated harness names")
    parser.add_argument("--jobs", type=int, default=1, help="harnesses run at the same time")
    parser.add_argument("--max-len", type=int, default=4096, help="libFuzzer -max_len")
    args = parser.parse_args(argv)
    names = check_names(parser, args.only)
    if args.seconds < 1:
        parser.error("--seconds must be at least 1")

    results = run_many(names, args.jobs, lambda n: run_one(n, args.seconds, args.max_len))
    failed = [r for r in results if not r.ok]
    print_failures(results)
    head = ("harness", "result", "executions", "exec/s", "cov", "corpus")
    print("{:<13} {:<7} {:>11} {:>8} {:>6} {:>9}".format(*head))
    for r in results:
        execs = "?" if r.executions is None else str(r.executions)
        rate = "?" if r.executions is None else f"{r.rate:.0f}"
        cov = "?" if r.cov is None else str(r.cov)
        corpus = f"{r.corpus_in}->{r.corpus_out}"
        print(f"{r.name:<13} {r.verdict:<7} {execs:>11} {rate:>8} {cov:>6} {corpus:>9}")
    if failed:
        print(f"{len(failed)} harness(es) failed; crashing inputs are kept in {FUZZ_DIR}/crashes/")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
