"""``kvcs fetch`` failures that must say what happened (issue 10 finding 10), over real QUIC
on 127.0.0.1 with every role in its own process (helpers of ``test_cli_processes``).

* a signed publication and ``--producer-key``: a refused signature, a wrong ``--kid`` and
  no ``--kid`` each get their own one-line error (not "no publication was found");
* a 100-token prompt is published as 96 tokens with a warning and the count reported;
* a retrieval that cannot finish lists the layers and blocks to recompute, and its JSON
  reports the bytes actually received and verified;
* ``kvcs demo --json`` prints JSON lines only, with the snake_case keys of every command.
"""

from __future__ import annotations

import json
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_cli_processes import (
    CACHE,
    START_TIMEOUT,
    Procs,
    json_lines,
    kvcs,
    one_error_line,
    procs,  # noqa: F401  (the fixture)
    read_event,
    read_line,
)

PROMPT = [
    *CACHE[: CACHE.index("--tokens")],
    *CACHE[CACHE.index("--tokens") + 2 :],
    "--tokens",
    "100",
]
"""The small cache of ``test_cli_processes`` with a 100-token prompt (6 full blocks of 16)."""
SECTION = 2 * 16 * 64 * 2  # one K (or V) block: 2 heads x 16 tokens x 64 x bfloat16


def _keys(tmp: Path) -> tuple[Path, Path, Path]:
    """A producer's private and public key, and another public key."""
    sk = Ed25519PrivateKey.generate()
    paths = (tmp / "producer.pem", tmp / "producer.pub.pem", tmp / "other.pub.pem")
    paths[0].write_bytes(
        sk.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    for path, key in ((paths[1], sk), (paths[2], Ed25519PrivateKey.generate())):
        path.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    return paths


def test_signature_and_kid_problems_are_said_plainly(procs: Procs, tmp_path: Path) -> None:  # noqa: F811
    sign, good, other = _keys(tmp_path)
    _, url, _ = procs.relay("relay")
    pub = procs.start(
        "publisher", "publish", url, "-k", *PROMPT, "--sign-key", str(sign), "--kid", "alice",
        "--serve-for", "90", "--json",
    )  # fmt: skip
    first = json.loads(read_line(pub, START_TIMEOUT, "the publisher's first line"))
    assert first["event"] == "publishing" and first["tokens"] == 96, first
    assert first["blocks"] == 6, first
    published = read_event(pub, "published", START_TIMEOUT * 3)
    assert published["event"] == "published" and published["tokens"] == 96, published
    warned = procs.stderr("publisher")
    assert "the last 4 of 100 tokens do not fill a block of 16" in warned, warned

    cases = {
        "refused": (["--producer-key", str(other), "--kid", "alice"], "signature"),
        "wrong-kid": (["--producer-key", str(good), "--kid", "bob"],
                      "key ID 'alice', not --kid 'bob'"),
        "no-kid": (["--producer-key", str(good)], "no --kid was given"),
    }  # fmt: skip
    for name, (extra, said) in cases.items():
        proc = procs.start(
            name, "fetch", url, "-k", *PROMPT, "--json", "--fetch-timeout", "30", *extra
        )
        out = procs.finish(proc)
        assert proc.returncode == 1, (name, out, procs.stderr(name))
        line = one_error_line(procs.stderr(name))
        assert said in line, (name, line)
        assert "no publication of this prompt was found" not in line, line
        done = [d for d in json_lines(out) if d.get("event") == "done"]
        assert done and done[0]["bytes"] == 0 and done[0]["complete"] is False, done
    # the right key and kid: the whole cache, authenticated
    proc = procs.start(
        "right", "fetch", url, "-k", *PROMPT, "--json", "--fetch-timeout", "45",
        "--producer-key", str(good), "--kid", "alice",
    )  # fmt: skip
    out = procs.finish(proc)
    assert proc.returncode == 0, (out, procs.stderr("right"))
    done = next(d for d in json_lines(out) if d.get("event") == "done")
    assert done["tokens"] == 96 and done["bit_identical"] is True, done
    assert done["bytes"] == 2 * 6 * 6 * SECTION, done  # K and V, 6 layers, 6 blocks


def test_an_unfinished_retrieval_lists_what_to_recompute(procs: Procs) -> None:  # noqa: F811
    """The producer stops after layer 0 (a long pause): the consumer reports the missing
    layers and blocks, and the bytes it really has (1 layer, not 6)."""
    _, url, _ = procs.relay("relay")
    pub = procs.start(
        "publisher", "publish", url, "-k", *CACHE, "--layer-interval", "600",
        "--serve-for", "900", "--json",
    )  # fmt: skip
    assert json.loads(read_line(pub, START_TIMEOUT, "the first line"))["event"] == "publishing"
    proc = procs.start(
        "fetch", "fetch", url, "-k", *CACHE, "--json", "--fetch-timeout", "40",
        "--stall-timeout", "2", "--recovery-time", "1",
    )  # fmt: skip
    out = procs.finish(proc)
    assert proc.returncode == 1, (out, procs.stderr("fetch"))
    line = one_error_line(procs.stderr("fetch"))
    done = next(d for d in json_lines(out) if d.get("event") == "done")
    assert done["complete"] is False, done
    assert done["recompute_layers"] == [1, 2, 3, 4, 5], done  # layer 0 came before the pause
    assert done["recompute_blocks"] == [0, 1, 2, 3], done
    assert done["layers_ready"] == 1, done
    assert done["bytes"] == 2 * 1 * 4 * SECTION, done  # K and V of layer 0's 4 blocks
    assert "recompute layers 1-5 of blocks 0-3 (8 of 48 objects verified" in line, line


def test_demo_json_is_json_lines_only_with_snake_case_keys() -> None:
    r = kvcs("demo", "--tokens", "64", "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines]  # every stdout line is JSON
    consumers = [row for row in rows if row["event"] == "consumer"]
    names = sorted(row["consumer"] for row in consumers)
    assert names == ["half", "late", "live", "mid", "partial"]
    half = next(row for row in consumers if row["consumer"] == "half")
    assert half["bit_identical"] and half["blocks"] == "2/5" and half["index_lookups"] >= 1, half
    assert [row["event"] for row in rows].count("summary") == 1
    for row in rows:
        for key in row:
            assert key == key.lower() and " " not in key, key  # snake_case, as fetch's
    assert all("mb_per_s" in row for row in consumers)
    assert "kvcs demo: relay at" in r.stderr  # the text went to stderr
