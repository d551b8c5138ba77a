"""Regenerate the seed corpora in ``fuzz/corpus/<harness>/`` (deterministic).

    python3 fuzz/make_corpus.py [--vectors PATH] [--per-harness 30]

Seeds come from two places:

* the byte vectors of ``../shared/spec/moqt22-vectors.json`` (control frames,
  subgroup and fetch streams, datagrams, padding; the parameter blocks and
  Setup Options of the control vectors for the params harness);
* the hypothesis strategies of ``tests/strategies_control.py`` and
  ``tests/strategies_data.py`` (valid messages, parameter blocks, KVP lists,
  streams and datagrams), drawn with ``derandomize=True`` so the same code
  gives the same files.

Every seed is a harness input: two split-seed bytes (``fuzzlib.split_input``)
and then the body; the split point is put in the middle of the body. The
script replaces the ``*.bin`` files of each corpus directory and prints the
counts and total size (kept well under 1 MB). Needs the test extra
(hypothesis).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, TypeVar

FUZZ_DIR = Path(__file__).resolve().parent
ROOT = FUZZ_DIR.parent
sys.path.insert(0, str(ROOT / "tests"))  # the strategies live with the tests

import strategies_control as sc  # noqa: E402
import strategies_data as sd  # noqa: E402
from fuzzlib import with_split_seed  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcs_core.wire import params as P  # noqa: E402
from kvcs_core.wire.errors import NEED_MORE  # noqa: E402
from kvcs_core.wire.kvp import kvps_bytes  # noqa: E402
from kvcs_core.wire.messages import Setup, decode_message, encode_message  # noqa: E402
from kvcs_core.wire.objects import UniStreamKind, peek_uni_stream_type  # noqa: E402

HARNESSES = ("control", "subgroup", "fetch", "datagram", "params")
DEFAULT_VECTORS = ROOT.parent / "shared" / "spec" / "moqt22-vectors.json"
MAX_TOTAL_BYTES = 1 << 20

T = TypeVar("T")


def draw(strategy: st.SearchStrategy[T], n: int) -> list[T]:
    """``n`` examples of ``strategy``, the same ones on every run."""
    out: list[T] = []

    @settings(
        database=None,
        derandomize=True,
        max_examples=n,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(x: T) -> None:
        out.append(x)

    collect()
    return out[:n]


class Corpus:
    def __init__(self) -> None:
        self.files: dict[str, dict[str, bytes]] = {h: {} for h in HARNESSES}

    def add(self, harness: str, name: str, body: bytes) -> None:
        data = with_split_seed(body, len(body) // 2)
        mine = self.files[harness]
        if data not in mine.values():
            mine[name] = data

    def write(self) -> None:
        for harness, files in self.files.items():
            d = FUZZ_DIR / "corpus" / harness
            d.mkdir(parents=True, exist_ok=True)
            for old in d.glob("*.bin"):
                old.unlink()
            for name, data in files.items():
                (d / f"{name}.bin").write_bytes(data)


def from_vectors(corpus: Corpus, path: Path) -> None:
    vectors: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["vectors"]
    frames: list[bytes] = []
    for v in vectors:
        raw, name, kind = bytes.fromhex(v["hex"]), f"vector-{v['name']}", v["kind"]
        if kind == "control":
            corpus.add("control", name, raw)
            frames.append(raw)
            got = decode_message(raw)
            assert got is not NEED_MORE
            msg = got[0]
            block = getattr(msg, "params", None)
            if isinstance(block, P.Parameters):
                corpus.add("params", name, P.parameters_bytes(block))
            if isinstance(msg, Setup):
                corpus.add("params", f"{name}-options", kvps_bytes(msg.options()))
        elif kind == "data-stream":
            target = "fetch" if peek_uni_stream_type(raw) is UniStreamKind.FETCH else "subgroup"
            corpus.add(target, name, raw)
        elif kind == "datagram":
            corpus.add("datagram", name, raw)
        elif kind == "padding":
            cut = int(v["fields"]["split_at"])
            corpus.add("subgroup", f"{name}-stream", raw[:cut])
            corpus.add("datagram", f"{name}-datagram", raw[cut:])
    # A control stream carries several messages back to back.
    corpus.add("control", "vector-stream-all", b"".join(frames))


def from_strategies(corpus: Corpus, n: int) -> None:
    def add_all(harness: str, prefix: str, bodies: list[bytes]) -> None:
        for i, body in enumerate(bodies):
            digest = hashlib.sha256(body).hexdigest()[:8]
            corpus.add(harness, f"{prefix}-{i:03d}-{digest}", body)

    stream_of_messages = st.lists(sc.control_messages(), min_size=1, max_size=3).map(
        lambda ms: b"".join(encode_message(m) for m in ms)
    )
    add_all("control", "gen", draw(stream_of_messages, n))
    add_all("subgroup", "gen", [enc for _, enc in draw(sd.subgroup_streams(), n)])
    add_all("fetch", "gen", [enc for _, enc in draw(sd.fetch_streams(), n)])
    add_all("datagram", "gen", [enc for _, enc in draw(sd.datagrams(), n)])
    scopes = (P.SUBSCRIBE_PARAMS, P.FETCH_PARAMS, P.PUBLISH_PARAMS, P.REQUEST_UPDATE_ANY_PARAMS)
    per_scope = max(1, n // (len(scopes) + 1))
    for i, scope in enumerate(scopes):
        blocks = draw(sc.parameters(scope), per_scope)
        add_all("params", f"gen-scope{i}", [P.parameters_bytes(b) for b in blocks])
    add_all("params", "gen-kvps", [kvps_bytes(p) for p in draw(sc.kvps(), per_scope)])


def write_cat_token_seeds() -> None:
    """``fuzz/corpus/cat_token``: deterministic tokens and claims (``fuzz_cat_token.seeds``;
    raw inputs, no split seed, as that harness reads them)."""
    import fuzz_cat_token  # noqa: PLC0415 - imports the auth stack only when asked

    d = FUZZ_DIR / "corpus" / "cat_token"
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.bin"):
        old.unlink()
    bodies = fuzz_cat_token.seeds()
    for i, body in enumerate(bodies):
        (d / f"seed-{i:03d}-{hashlib.sha256(body).hexdigest()[:8]}.bin").write_bytes(body)
    print(f"fuzz/corpus/cat_token: {len(bodies)} files, {sum(map(len, bodies))} bytes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=Path, default=DEFAULT_VECTORS)
    parser.add_argument("--per-harness", type=int, default=30, help="generated seeds per harness")
    parser.add_argument(
        "--cat-token-only", action="store_true", help="write only fuzz/corpus/cat_token"
    )
    args = parser.parse_args(argv)
    if args.cat_token_only:
        write_cat_token_seeds()
        return 0
    if not args.vectors.is_file():
        parser.error(f"no vector file at {args.vectors}")
    corpus = Corpus()
    from_vectors(corpus, args.vectors)
    from_strategies(corpus, args.per_harness)
    total = sum(len(d) for files in corpus.files.values() for d in files.values())
    if total > MAX_TOTAL_BYTES:
        parser.error(f"corpus of {total} bytes exceeds {MAX_TOTAL_BYTES}; lower --per-harness")
    corpus.write()
    write_cat_token_seeds()
    for harness, files in corpus.files.items():
        size = sum(len(d) for d in files.values())
        print(f"fuzz/corpus/{harness}: {len(files)} files, {size} bytes")
    print(f"total: {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
