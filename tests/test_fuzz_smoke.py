"""The fuzz harnesses as a quick pytest smoke test (STYLE.md R14), no atheris needed.

Every harness in ``fuzz/`` exposes ``check(data: bytes)``, which raises
AssertionError when an invariant breaks and lets any unexpected exception
through. Here each ``check`` runs

* under hypothesis on arbitrary bytes and on mutated seed-corpus files, and
* on every committed corpus file;

plus tests of the harness machinery itself (a harness must notice a decoder
that raises something else than CodecError or that depends on chunking).
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcs_core.wire.errors import CodecError

ROOT = Path(__file__).resolve().parents[1]
FUZZ_DIR = ROOT / "fuzz"
CORPUS = FUZZ_DIR / "corpus"
NAMES = (
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

if str(FUZZ_DIR) not in sys.path:
    sys.path.insert(0, str(FUZZ_DIR))

fuzzlib = importlib.import_module("fuzzlib")
HARNESSES: dict[str, ModuleType] = {n: importlib.import_module(f"fuzz_{n}") for n in NAMES}


def _corpus_files(name: str) -> list[Path]:
    return sorted((CORPUS / name).glob("*.bin"))


ALL_CORPUS = [(n, p) for n in NAMES for p in _corpus_files(n)]


@st.composite
def mutated_seeds(draw: st.DrawFn, name: str) -> bytes:
    """A corpus file with a few bytes changed, inserted or cut off."""
    files = _corpus_files(name)
    data = bytearray(draw(st.sampled_from(files)).read_bytes()) if files else bytearray()
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(("set", "insert", "delete", "truncate")))
        at = draw(st.integers(0, len(data)))
        if op == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 3))]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


@pytest.mark.parametrize("name", NAMES)
def test_harness_on_arbitrary_bytes(name: str) -> None:
    check = HARNESSES[name].check

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=512))
    def run(data: bytes) -> None:
        check(data)

    run()


@pytest.mark.parametrize("name", NAMES)
def test_harness_on_mutated_corpus(name: str) -> None:
    check = HARNESSES[name].check

    @settings(max_examples=300, deadline=None)
    @given(mutated_seeds(name))
    def run(data: bytes) -> None:
        check(data)

    run()


@pytest.mark.parametrize(("name", "path"), ALL_CORPUS, ids=[f"{n}/{p.stem}" for n, p in ALL_CORPUS])
def test_harness_on_corpus_file(name: str, path: Path) -> None:
    HARNESSES[name].check(path.read_bytes())


def test_corpus_is_committed_and_small() -> None:
    total = 0
    for name in NAMES:
        files = _corpus_files(name)
        assert len(files) >= 10, f"fuzz/corpus/{name} has {len(files)} seeds: run make_corpus.py"
        total += sum(p.stat().st_size for p in files)
    assert total < 1 << 20, f"seed corpora total {total} bytes (limit 1 MiB)"


def test_split_input_matches_fuzzed_data_provider() -> None:
    atheris = pytest.importorskip("atheris")
    for data in (b"", b"\x01", b"\x01\x02", b"\x05\x00abc", bytes(range(40))):
        fdp = atheris.FuzzedDataProvider(data)
        seed = fdp.ConsumeUInt(fuzzlib.SPLIT_SEED_BYTES)
        body = fdp.ConsumeBytes(fdp.remaining_bytes())
        assert fuzzlib.split_input(data) == (body, seed % (len(body) + 1))
        saved = fuzzlib.atheris
        fuzzlib.atheris = None  # the pure fallback must agree
        try:
            assert fuzzlib.split_input(data) == (body, seed % (len(body) + 1))
        finally:
            fuzzlib.atheris = saved


def test_normalize_compares_payloads_by_bytes() -> None:
    a = memoryview(bytearray(b"xpayloadx"))[1:8]
    assert fuzzlib.normalize((a, [b"k"])) == fuzzlib.normalize((b"payload", (bytearray(b"k"),)))


class _RaisesOther:
    """A stand-in decoder that breaks the contract: an exception other than CodecError."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def feed(self, data: bytes) -> list[Any]:
        if data:
            raise IndexError("decoder bug")
        return []

    def close(self) -> None:
        pass


class _ChunkDependent(_RaisesOther):
    """A stand-in decoder whose items depend on how the bytes were chunked."""

    def feed(self, data: bytes) -> list[Any]:
        return [len(data)] if data else []


def test_harness_lets_unexpected_exceptions_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HARNESSES["subgroup"], "SubgroupStreamDecoder", _RaisesOther)
    with pytest.raises(IndexError):
        HARNESSES["subgroup"].check(b"\x00\x00\x10\x01\x02")

    def bad_datagram(_buf: Any) -> Any:
        raise KeyError("decoder bug")

    monkeypatch.setattr(HARNESSES["datagram"], "decode_datagram", bad_datagram)
    with pytest.raises(KeyError):
        HARNESSES["datagram"].check(b"\x00\x00\x00\x01\x02\x03")


def test_harness_catches_chunking_dependence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HARNESSES["control"], "ControlStreamDecoder", _ChunkDependent)
    with pytest.raises(AssertionError, match="different items"):
        HARNESSES["control"].check(b"\x02\x00" + b"\x10\x00\x00")


def test_harness_accepts_codec_errors() -> None:
    """A CodecError is an allowed outcome, not a failure of the harness."""
    with pytest.raises(CodecError):
        HARNESSES["datagram"].decode_datagram(b"\x10")  # reserved bit: PROTOCOL_VIOLATION
    HARNESSES["datagram"].check(b"\x00\x00\x10")


# --- the runner and the campaign's table (no fuzzing) ---------------------------------


def _campaign() -> ModuleType:
    loader = SourceFileLoader("fuzz_campaign", str(FUZZ_DIR / "campaign"))
    spec = spec_from_loader("fuzz_campaign", loader)
    assert spec is not None
    module = module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_runner_parses_libfuzzer_statistics() -> None:
    run_all = importlib.import_module("run_all")
    out = (
        "#2\tINITED cov: 10 ft: 11 corp: 2/9b exec/s: 0 rss: 40Mb\n"
        "#4096\tpulse  cov: 120 ft: 300 corp: 40/1Kb lim: 8 exec/s: 2048 rss: 60Mb\n"
        "#5000\tDONE   cov: 123 ft: 345 corp: 41/1Kb lim: 8 exec/s: 2500 rss: 60Mb\n"
        "Done 5000 runs in 2 second(s)\n"
        "stat::number_of_executed_units: 5000\nstat::average_exec_per_sec:     2500\n"
    )
    assert run_all.parse_output(out) == {
        "executions": 5000,
        "exec_per_s": 2500,
        "cov": 123,
        "ft": 345,
    }
    # a crash prints no final statistics: the last status line counts
    crashed = out.split("#5000", maxsplit=1)[0] + "==1== ERROR: libFuzzer: deadly signal\n"
    assert run_all.parse_output(crashed)["executions"] == 4096
    assert run_all.parse_output("Traceback ...\nImportError\n")["executions"] is None


def test_campaign_table_replaces_only_its_rows() -> None:
    campaign = _campaign()
    run_all = importlib.import_module("run_all")
    first, second = run_all.HARNESSES[0], run_all.HARNESSES[1]

    def result(name: str, execs: int, rc: int = 0) -> Any:
        return run_all.Result(name, rc, execs, 600.0, 10, 50, "", exec_per_s=1700, cov=300, ft=900)

    text = "# Fuzz\n\nintro\n\n" + campaign.BEGIN + "\n" + campaign.END + "\n\n## After\n"
    rows = {n: campaign.row(result(n, 1_000_000), 1_000_000, "2026-01-01") for n in (first, second)}
    once = campaign.update_readme(text, rows)
    assert once.count(f"| `{first}` | 1,000,000 | 1,700 | 300 | 900 | 10 → 50 | 0 |") == 1
    assert once.startswith("# Fuzz\n\nintro\n\n") and once.endswith("\n\n## After\n")
    # a rerun of one harness replaces its row and keeps the other one
    again = campaign.row(result(second, 400_000), 1_000_000, "2026-01-02")
    twice = campaign.update_readme(once, {second: again})
    assert f"| `{first}` | 1,000,000 |" in twice
    assert f"| `{second}` | 400,000 (time cap) |" in twice and "2026-01-01 |" in twice
    assert twice.count(f"| `{second}` |") == 1
    assert campaign.update_readme(twice, {}) == twice
    crashed = campaign.row(result(first, 77, rc=1), 1_000_000, "2026-01-03")
    assert "**CRASH**" in crashed
