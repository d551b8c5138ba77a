"""The KVSP index from the ``kvcs`` command (issue #15), every role its own process.

The issue, as a new user met it: with a live 256-token publication (16 blocks),
``kvcs fetch --prompt-tokens 128`` and ``--prompt-tokens 200`` answered "no
publication of this prompt was found". Now both receive the shared full blocks
(8 and 12), bit for bit, and the report says how many index lookups were made;
``--no-index`` is the old behaviour (status 1, that same message). ``kvcs ls
--index`` lists the index entries apart from the publications, and bad index
options are a one-line error with status 2.
"""

from __future__ import annotations

import math

from test_cli_processes import (
    START_TIMEOUT,
    Procs,
    json_lines,
    kvcs,
    one_error_line,
    procs,  # noqa: F401  (the fixture)
    read_event,
)

SCOPE_HEX = "5a" * 32
CACHE = [
    "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--tokens", "256",
    "--seed", "5", "--scope-key", SCOPE_HEX,
]  # fmt: skip
BLOCKS = 16


def test_prefixes_of_a_publication_are_found_through_the_index(procs: Procs) -> None:  # noqa: F811
    _, url, _ = procs.relay("relay")
    pub = procs.start("publisher", "publish", url, "-k", *CACHE, "--serve-for", "90", "--json")
    read_event(pub, "published", START_TIMEOUT * 3)
    for prompt in (128, 200):
        r = kvcs("fetch", url, "-k", *CACHE, "--prompt-tokens", str(prompt), "--json")
        assert r.returncode == 0, r.stderr
        done = [e for e in json_lines(r.stdout) if e["event"] == "done"][-1]
        shared = prompt // 16
        assert (done["complete"], done["bit_identical"], done["blocks"]) == (True, True, shared)
        assert done["bytes"] == 2 * 4 * shared * 2 * 16 * 64 * 2  # exactly the shared blocks
        assert 1 <= done["index_lookups"] <= math.ceil(math.log2(shared)) + 1, done
        assert done["index_shared_blocks"] == shared, done
    text = kvcs("fetch", url, "-k", *CACHE, "--prompt-tokens", "128")
    assert text.returncode == 0, text.stderr
    assert "index_lookups=" in text.stdout and "index_shared_blocks=8" in text.stdout, text.stdout
    old = kvcs("fetch", url, "-k", *CACHE, "--prompt-tokens", "128", "--no-index", "--json")
    assert old.returncode == 1, old.stderr
    assert "no publication of this prompt was found" in one_error_line(old.stderr)
    assert json_lines(old.stdout)[-1]["index_lookups"] == 0

    listing = kvcs("ls", url, "-k", "--index", "--json")
    assert listing.returncode == 0, listing.stderr
    lines = json_lines(listing.stdout)
    entries = [e for e in lines if e.get("kind") == "index"]
    publications = [e for e in lines if "kind" not in e]
    assert len(publications) == 1 and len(entries) == BLOCKS, lines
    assert {e["publication_id"] for e in entries} == {publications[0]["publication_id"]}
    assert lines[0] is publications[0]  # the publications first, then the index
    plain = kvcs("ls", url, "-k", "--json")
    assert len(json_lines(plain.stdout)) == 1, plain.stdout  # without --index: as before


def test_bad_index_options_are_one_line_status_2() -> None:
    url = "moqt://127.0.0.1:9"  # never reached: the options are refused first
    for args in (
        ["publish", url, "-k", *CACHE, "--index-stride", "-1"],
        ["fetch", url, "-k", *CACHE, "--index-stride", "0"],
        ["fetch", url, "-k", *CACHE, "--index-timeout", "0"],
        ["fetch", url, "-k", *CACHE, "--index-stride", "two"],
    ):
        r = kvcs(*args, timeout=30)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        one_error_line(r.stderr)
