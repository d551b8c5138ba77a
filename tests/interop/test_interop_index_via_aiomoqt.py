"""The KVSP index (binding 9, issue #15) through the aiomoqt relay (written by nobody here).

Index namespaces are plain MOQT: our publisher (``kvcs publish``, a 1000-token cache
in 16-token blocks: 62 blocks, so 62 index namespaces besides the publication)
announces them to aiomoqt's interop relay; our consumers (``kvcs fetch``), whose
prompts are only prefixes of the published one, find the publication through the
index (SUBSCRIBE_NAMESPACE per lookup, then SUBSCRIBE ``replica``), receive exactly
the shared full blocks and compare them with the source bit for bit; the whole
prompt is still found directly, without a lookup.
"""

from __future__ import annotations

import math
from typing import Any

from interop_harness import proc_event, proc_exit, run

SCOPE_HEX = "5a" * 32
LAYERS, TOKENS, BLOCK, SEED = 2, 1000, 16, 9
CACHE = [
    "--layers", str(LAYERS), "--kv-heads", "2", "--head-dim", "64", "--tokens", str(TOKENS),
    "--block-tokens", str(BLOCK), "--seed", str(SEED), "--scope-key", SCOPE_HEX,
]  # fmt: skip


def test_partial_prompts_find_the_publication_through_the_index_on_aiomoqt(peers: Any) -> None:
    url = peers.aiomoqt_relay()

    async def scenario() -> None:
        pub = peers.kvcs("publish", "publish", url, "-k", *CACHE, "--serve-for", "60", "--json")
        await proc_event(pub, "published", 30)
        for prompt in (700, 128, TOKENS):
            fetch = peers.kvcs(
                f"fetch-{prompt}", "fetch", url, "-k", *CACHE, "--prompt-tokens", str(prompt),
                "--json", "--fetch-timeout", "30",
            )  # fmt: skip
            status = await proc_exit(fetch, 45)
            done = fetch.last("done")
            err = (peers.tmp / f"fetch-{prompt}.stderr").read_text(errors="replace")[-2000:]
            assert status == 0 and done is not None, (prompt, status, fetch.events[-2:], err)
            shared = prompt // BLOCK
            assert done["complete"] and done["bit_identical"], done
            assert done["blocks"] == shared, done
            if prompt == TOKENS:  # the whole prompt: found directly, no lookup
                assert done["index_lookups"] == 0 and done["index_shared_blocks"] is None, done
                continue
            assert 1 <= done["index_lookups"] <= math.ceil(math.log2(shared)) + 1, done
            assert done["index_shared_blocks"] == shared, done
        assert pub.p.poll() is None, "the publisher kept its session with the relay"

    run(scenario(), timeout=150)
