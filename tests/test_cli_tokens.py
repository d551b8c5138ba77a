"""A prompt without its cache: ``--tokens-file`` and ``--descriptor`` of ``kvcs fetch``,
and ``kvcs descriptor CACHE`` that gives them from a cache file.

The formats (tokens: ``.npy``, ``.json``, whitespace-separated text; descriptor: JSON or a
cache file), their errors with the documented statuses (a file that cannot be read as
its format: 5; one that reads but holds no token IDs: 2; a prompt shorter than a
block: 2), all found before any connection is tried. The retrieval itself, over real
QUIC, is ``tests/quic/test_cli_tokens_only.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcs.adapters.cachefile import llama_descriptor, save, synthetic
from kvcs.transports.cli.common import CliError, Exit, load_descriptor, load_tokens, write_tokens

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE = "moqt://127.0.0.1:9"
"""No relay there: every error below is found before a connection is tried (else 3)."""


def kvcs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcs", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_error(r: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert re.match(r"kvcs( fetch)?: error: ", errors[0]), errors[0]  # (argparse names it)
    return errors[0]


# --- the tokens file ----------------------------------------------------------------------------

TOKENS = (0, 7, 128_000, 2**32 - 1, 42)


@pytest.mark.parametrize("dtype", ["<u4", "<i8", ">i4", "u2"])
def test_npy_tokens_of_any_integer_dtype(tmp_path: Path, dtype: str) -> None:
    path = tmp_path / "t.npy"
    values = [t for t in TOKENS if t < 2**15]
    np.save(path, np.asarray(values, dtype=dtype))
    assert load_tokens(path) == tuple(values)


def test_json_and_text_tokens(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(list(TOKENS)))
    assert load_tokens(tmp_path / "t.json") == TOKENS
    (tmp_path / "t.txt").write_text(" 0 7\n128000\t4294967295\r\n42\n")
    assert load_tokens(tmp_path / "t.txt") == TOKENS
    (tmp_path / "noext").write_text("1 2 3")
    assert load_tokens(tmp_path / "noext") == (1, 2, 3)
    (tmp_path / "empty.txt").write_text("")
    assert load_tokens(tmp_path / "empty.txt") == ()


@pytest.mark.parametrize("suffix", [".npy", ".json", ".txt"])
def test_written_tokens_read_back(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"tokens{suffix}"
    write_tokens(path, TOKENS)
    assert load_tokens(path) == TOKENS
    if suffix == ".npy":
        assert np.load(path).dtype == np.uint32


def _npy(tmp: Path, array: np.ndarray, name: str = "t.npy") -> Path:  # type: ignore[type-arg]
    path = tmp / name
    np.save(path, array)
    return path


@pytest.mark.parametrize(
    ("name", "content", "status", "expected"),
    [
        ("t.txt", "1 2 three", Exit.USAGE, "word 3 is not a token ID"),
        ("t.txt", "1 2.5", Exit.USAGE, "word 2 is not a token ID"),
        ("t.txt", "1 -2", Exit.USAGE, "word 2 is not a token ID"),
        ("t.txt", "1 4294967296", Exit.USAGE, "token 1 (4294967296) is outside 0..2**32-1"),
        ("t.txt", b"1 \xff", Exit.FILE, "not UTF-8 text"),
        ("t.json", "[1, 2,", Exit.FILE, "not a JSON file"),
        ("t.json", '{"tokens": [1]}', Exit.USAGE, "must hold a JSON array of integers"),
        ("t.json", '[1, "2"]', Exit.USAGE, 'item 1 is not an integer: "2"'),
        ("t.json", "[1, true]", Exit.USAGE, "item 1 is not an integer: true"),
        ("t.json", "[1, 2.0]", Exit.USAGE, "item 1 is not an integer: 2.0"),
        ("t.json", "[-1]", Exit.USAGE, "token 0 (-1) is outside"),
        ("t.npy", "1 2 3", Exit.FILE, "not an .npy file"),
        ("t.npy", b"\x93NUMPY\x01\x00garbage", Exit.FILE, "not a valid .npy file"),
    ],
)
def test_tokens_file_errors(
    tmp_path: Path, name: str, content: str | bytes, status: int, expected: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(CliError) as info:
        load_tokens(path)
    assert info.value.status == status, info.value
    assert expected in str(info.value), str(info.value)
    assert str(info.value).startswith(f"--tokens-file {path}: ")


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.zeros(4, np.float32), "must hold a 1-D integer array, not float32 of shape (4,)"),
        (np.zeros((2, 2), np.int32), "not int32 of shape (2, 2)"),
        (np.zeros(3, bool), "not bool"),
        (np.array([1, -1], np.int64), "token 1 (-1) is outside"),
    ],
)
def test_npy_that_holds_no_token_ids_is_a_usage_error(
    tmp_path: Path,
    array: np.ndarray,
    expected: str,  # type: ignore[type-arg]
) -> None:
    with pytest.raises(CliError) as info:
        load_tokens(_npy(tmp_path, array))
    assert info.value.status == Exit.USAGE and expected in str(info.value), str(info.value)


def test_npy_objects_are_never_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "t.npy"
    np.save(path, np.array([1, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(CliError) as info:
        load_tokens(path)
    assert info.value.status == Exit.FILE and "not a valid .npy file" in str(info.value)


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_a_tokens_file_that_is_no_file_exits_5(tmp_path: Path, what: str) -> None:
    path = tmp_path / "none.txt" if what == "missing" else tmp_path
    with pytest.raises(CliError) as info:
        load_tokens(path)
    assert info.value.status == Exit.FILE
    assert ("no such file" if what == "missing" else "a directory") in str(info.value)


# --- the descriptor file ------------------------------------------------------------------------


def test_descriptor_from_json_or_from_a_cache_file(tmp_path: Path) -> None:
    desc = llama_descriptor(layers=2, kv_heads=2, head_dim=8)
    (tmp_path / "d.json").write_text(json.dumps(desc))
    assert load_descriptor(tmp_path / "d.json", "--descriptor") == desc
    for suffix in (".npz", ".safetensors"):
        save(tmp_path / f"c{suffix}", synthetic(desc, tokens=16, seed=1))
        assert load_descriptor(tmp_path / f"c{suffix}", "--descriptor") == desc


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{", "not a JSON file"),
        ("[1]", "not a JSON object"),
        ('{"kvsp": 0, "model": "m"}', "not a compatibility descriptor"),
        (
            '{"kvsp": 0, "model": "m", "layers": 2, "kv_heads": 2, "head_dim": 8, '
            '"dtype": "bfloat16", "block_tokens": 1.5}',
            "floating-point",
        ),
    ],
)
def test_a_bad_descriptor_file_exits_5(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.raises(CliError) as info:
        load_descriptor(path, "--descriptor")
    assert info.value.status == Exit.FILE and expected in str(info.value), str(info.value)
    with pytest.raises(CliError) as info:
        load_descriptor(tmp_path / "missing.npz", "--descriptor")
    assert info.value.status == Exit.FILE and "no such file" in str(info.value)


# --- kvcs descriptor ------------------------------------------------------------------------------


def test_kvcs_descriptor_prints_what_fetch_reads(tmp_path: Path) -> None:
    cache = synthetic(llama_descriptor(layers=2, kv_heads=2, head_dim=8), tokens=40, seed=3)
    save(tmp_path / "c.safetensors", cache)
    r = kvcs("descriptor", str(tmp_path / "c.safetensors"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == cache.descriptor
    r = kvcs(
        "descriptor", str(tmp_path / "c.safetensors"),
        "--out", str(tmp_path / "d.json"), "--tokens-out", str(tmp_path / "t.npy"),
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert load_descriptor(tmp_path / "d.json", "--descriptor") == cache.descriptor
    assert load_tokens(tmp_path / "t.npy") == cache.tokens


def test_kvcs_descriptor_errors_exit_5(tmp_path: Path) -> None:
    r = kvcs("descriptor", str(tmp_path / "none.npz"))
    assert r.returncode == 5 and "no such file" in one_error(r)
    (tmp_path / "notes.npz").write_text("text")
    r = kvcs("descriptor", str(tmp_path / "notes.npz"))
    assert r.returncode == 5 and "not an npz file" in one_error(r)
    save(tmp_path / "c.npz", synthetic(llama_descriptor(layers=1, kv_heads=1, head_dim=4), 16))
    r = kvcs("descriptor", str(tmp_path / "c.npz"), "--out", str(tmp_path / "no" / "d.json"))
    assert r.returncode == 5 and "cannot write" in one_error(r)


# --- kvcs fetch: errors before any connection ---------------------------------------------------


@pytest.fixture
def prompt(tmp_path: Path) -> tuple[Path, Path]:
    desc = llama_descriptor(layers=2, kv_heads=2, head_dim=8)
    (tmp_path / "d.json").write_text(json.dumps(desc))
    (tmp_path / "t.txt").write_text(" ".join(str(i) for i in range(32)))
    return tmp_path / "t.txt", tmp_path / "d.json"


def test_fetch_tokens_only_argument_errors(tmp_path: Path, prompt: tuple[Path, Path]) -> None:
    tokens, desc = prompt
    cases: list[tuple[list[str], int, str]] = [
        (["--tokens-file", str(tokens)], 2, "--tokens-file needs --descriptor"),
        (["--descriptor", str(desc)], 2, "--descriptor goes with --tokens-file"),
        (["--tokens-file", str(tokens), "--file", "c.npz", "--descriptor", str(desc)], 2,
         "not allowed with argument"),
        (["--tokens-file", str(tmp_path / "none.txt"), "--descriptor", str(desc)], 5,
         "no such file"),
        (["--tokens-file", str(tokens), "--descriptor", str(tmp_path / "none.json")], 5,
         "no such file"),
    ]  # fmt: skip
    short = tmp_path / "short.json"
    short.write_text("[1, 2, 3, 4, 5, 6, 7, 8]")
    cases.append((["--tokens-file", str(short), "--descriptor", str(desc)], 2,
                  "the prompt has 8 tokens, fewer than one block of 16"))  # fmt: skip
    words = tmp_path / "words.txt"
    words.write_text("1 2 hello")
    cases.append((["--tokens-file", str(words), "--descriptor", str(desc)], 2,
                  "word 3 is not a token ID"))  # fmt: skip
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 3}')
    cases.append((["--tokens-file", str(tokens), "--descriptor", str(bad)], 5,
                  "not a compatibility descriptor"))  # fmt: skip
    for extra, status, expected in cases:
        r = kvcs("fetch", UNREACHABLE, "--timeout", "1", *extra)
        assert r.returncode == status, (extra, r.stderr)
        assert expected in one_error(r), (extra, r.stderr)


def test_fetch_tokens_only_tries_the_network_once_its_input_is_good(
    prompt: tuple[Path, Path],
) -> None:
    """The same arguments with good files get as far as connecting (status 3: no relay)."""
    tokens, desc = prompt
    r = kvcs("fetch", UNREACHABLE, "--timeout", "1", "--tokens-file", str(tokens),
             "--descriptor", str(desc))  # fmt: skip
    assert r.returncode == 3, r.stderr
    one_error(r)
