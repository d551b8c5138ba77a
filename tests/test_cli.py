"""The ``kvcs`` command, run as a user runs it: a subprocess, exit status and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT.parent / "shared" / "spec" / "moqt22-vectors.json"
TIMEOUT = 120


def kvcs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcs", *args],
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
    [("frobnicate",), (), ("selfcheck", "--no-such-flag")],
)
def test_bad_arguments_give_one_line_error_and_exit_2(args: tuple[str, ...]) -> None:
    r = kvcs(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("kvcs: error: ")


# --- errors that say what happened (issue 10 finding 10) -------------------------------------

UNREACHABLE = "moqt://127.0.0.1:9"
"""No relay: a command that checks its arguments first fails before it would connect."""
SMALL = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8"]


def _one_error(r: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("kvcs: error: ")
    return errors[0]


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_selfcheck_with_a_missing_vector_file_exits_5(tmp_path: Path, what: str) -> None:
    path = tmp_path / "missing.json" if what == "missing" else tmp_path
    r = kvcs("selfcheck", "--vectors", str(path))
    assert r.returncode == 5, r.stderr
    line = _one_error(r)
    assert ("no such file" if what == "missing" else "a directory") in line


def test_publish_with_fewer_tokens_than_a_block_is_a_usage_error() -> None:
    r = kvcs("publish", UNREACHABLE, *SMALL, "--tokens", "8")
    assert r.returncode == 2, r.stderr
    assert "fewer than one block of 16" in _one_error(r)


def test_fetch_refuses_an_unknown_out_suffix_before_connecting(tmp_path: Path) -> None:
    r = kvcs("fetch", UNREACHABLE, *SMALL, "--out", str(tmp_path / "x.pt"))
    assert r.returncode == 2, r.stderr  # not 3: nothing was attempted
    assert "--out" in _one_error(r) and ".npz or .safetensors" in r.stderr
    assert not list(tmp_path.iterdir())


def test_fetch_finds_an_unwritable_out_before_connecting(tmp_path: Path) -> None:
    r = kvcs("fetch", UNREACHABLE, *SMALL, "--out", str(tmp_path / "no-dir" / "x.npz"))
    assert r.returncode == 5, r.stderr
    assert "cannot write" in _one_error(r)
    (tmp_path / "d.npz").mkdir()
    r = kvcs("fetch", UNREACHABLE, *SMALL, "--out", str(tmp_path / "d.npz"))
    assert r.returncode == 5, r.stderr
    assert "is a directory" in _one_error(r)


def test_a_text_file_given_as_npz_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "notes.npz"
    path.write_text("not arrays\n")
    r = kvcs("publish", UNREACHABLE, "--file", str(path))
    assert r.returncode == 5, r.stderr
    line = _one_error(r)
    assert "not an npz file" in line and "pickle" not in line


@pytest.mark.parametrize("what", ["directory", "fifo", "device"])
def test_files_that_are_not_regular_files_are_named(tmp_path: Path, what: str) -> None:
    """Said for what they are; a FIFO is never opened (no blocking), /dev/zero never read."""
    if what == "directory":
        path, expected = tmp_path, "a directory"
    elif what == "fifo":
        path, expected = tmp_path / "pipe.npz", "a FIFO"
        os.mkfifo(path)
    else:
        path, expected = Path("/dev/zero"), "a character device"
    for args in (["publish", UNREACHABLE, "--file", str(path)],
                 ["fetch", UNREACHABLE, "--file", str(path)],
                 ["publish", UNREACHABLE, *SMALL, "--scope-key-file", str(path)]):  # fmt: skip
        r = kvcs(*args)
        assert r.returncode == 5, (args, r.stderr)
        line = _one_error(r)
        assert expected in line and "no such file" not in line, line


def test_a_partial_last_block_is_reported_not_dropped_silently(tmp_path: Path) -> None:
    r = kvcs("publish", UNREACHABLE, *SMALL, "--tokens", "100", "--timeout", "1")
    assert r.returncode == 3, r.stderr  # no relay; the warning came before the connection
    assert "the last 4 of 100 tokens do not fill a block of 16" in r.stderr
    assert "96 tokens in 6 blocks" in r.stderr
