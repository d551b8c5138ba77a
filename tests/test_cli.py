"""The ``kvcs`` command, run as a user runs it: a subprocess, exit status and output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT.parent / "shared" / "spec" / "moqt22-vectors.json"
TIMEOUT = 120


def kvcs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "transports.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def _assert_all_passed(out: str) -> None:
    assert "selfcheck: all checks passed" in out
    assert "FAIL" not in out
    assert "built-in checks: 5 of 5 OK" in out


def test_selfcheck_reports_every_vector() -> None:
    r = kvcs("selfcheck")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    _assert_all_passed(r.stdout)
    if VECTORS.is_file():  # CI has ../shared beside the clone; say so if it is missing
        names = [v["name"] for v in json.loads(VECTORS.read_text(encoding="utf-8"))["vectors"]]
        assert f"vector checks: {len(names)} of {len(names)} OK" in r.stdout
        for name in names:
            assert f"OK      vectors   {name}" in r.stdout, name
    else:
        assert "not found" in r.stdout


def test_selfcheck_builtin_only() -> None:
    r = kvcs("selfcheck", "--builtin-only")
    assert r.returncode == 0, r.stdout + r.stderr
    _assert_all_passed(r.stdout)
    assert "vector checks" not in r.stdout


def test_selfcheck_reports_a_bad_vector(tmp_path: Path) -> None:
    bad = {"vectors": [{"name": "broken", "kind": "datagram", "hex": "10"}]}
    path = tmp_path / "v.json"
    path.write_text(json.dumps(bad), encoding="utf-8")
    r = kvcs("selfcheck", "--vectors", str(path))
    assert r.returncode == 1
    assert "FAIL    vectors   broken" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_version() -> None:
    r = kvcs("--version")
    assert r.returncode == 0
    assert r.stdout.startswith("kvcs ")


@pytest.mark.parametrize(
    "args",
    [("frobnicate",), (), ("selfcheck", "--no-such-flag"), ("selfcheck", "--vectors", "/no/file")],
)
def test_bad_arguments_give_one_line_error_and_exit_2(args: tuple[str, ...]) -> None:
    r = kvcs(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("kvcs: error: ")
