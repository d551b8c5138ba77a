"""The public API keeps its types: ``mypy --strict`` on a user's program.

``tests/typecheck/user_program.py`` uses ``import kvcs`` as a user would (a relay,
a producer, a consumer, the errors). It must pass ``mypy --strict``: its
``assert_type`` lines pin what the API returns, and its deliberate mistakes carry
``type: ignore`` comments that ``--warn-unused-ignores`` (part of ``--strict``)
turns into errors once the API stops catching them. mypy runs in a subprocess
from an empty directory, finding kvcs through ``MYPYPATH`` (the repository root);
errors inside the library are silenced (``--follow-imports=silent``: only the
user's side is judged here, ``mypy kvcs_core kvcs`` judges the library). The
program also runs, so it is a working example and not only a typed one.

That the installed wheel carries ``py.typed`` (so that mypy reads an installed kvcs
at all) is checked by ``scripts/check_beside_adapterhub.sh``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "typecheck" / "user_program.py"


def _mypy(program: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--no-incremental",
            "--python-version",
            "3.11",
            "--config-file",
            os.devnull,
            str(program),
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def mypy_available() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")


def test_user_program_passes_mypy_strict(mypy_available: None, tmp_path: Path) -> None:
    done = _mypy(PROGRAM, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found in 1 source file" in done.stdout


def test_mypy_strict_sees_an_untyped_call(mypy_available: None, tmp_path: Path) -> None:
    """The check itself: the same program with a mistake left unmarked fails it."""
    broken = tmp_path / "broken_program.py"
    text = PROGRAM.read_text(encoding="utf-8")
    marked = 'kvcs.connect(relay.url, timeout="soon")  # type: ignore[arg-type]'
    assert marked in text
    broken.write_text(text.replace(marked, 'kvcs.connect(relay.url, timeout="soon")'))
    done = _mypy(broken, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'Argument "timeout" to "connect" has incompatible type "str"' in done.stdout


def test_user_program_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(PROGRAM)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "asyncio: complete=True blocks=2"
    assert [line.split(":")[0] for line in lines[1:-1]] == [
        "UrlError",
        "StackUnavailable",
        "TlsError",
        "ConnectError",
        "CacheFileError",
    ]
    assert lines[-1] == "trio: connected=True"
