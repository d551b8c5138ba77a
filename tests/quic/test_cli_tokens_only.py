"""``kvcs fetch --tokens-file --descriptor``: a consumer that holds only the prompt's token
IDs and the compatibility descriptor retrieves the cache, over real QUIC on 127.0.0.1
with every role in its own process (helpers of ``test_cli_processes``).

``kvcs relay``, ``kvcs publish --file cache.npz``, ``kvcs descriptor cache.npz`` (the
descriptor JSON and the tokens a consumer is handed), then two consumers that have
never seen the cache file: one with tokens in JSON and the descriptor JSON, writing
``.npz``; one with tokens in ``.npy`` and the descriptor taken from a cache file,
writing ``.safetensors``. Each written file must hold exactly the publisher's K, V,
tokens and descriptor; ``bit_identical`` is null (nothing to compare with).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from test_cli_processes import (
    SCOPE_HEX,
    START_TIMEOUT,
    Procs,
    json_lines,
    kvcs,
    procs,  # noqa: F401  (the fixture)
    read_event,
)

from kvcs.adapters.cachefile import CacheFile, llama_descriptor, load, save, synthetic


def _same(got: CacheFile, want: CacheFile) -> None:
    assert got.descriptor == want.descriptor
    assert got.tokens == want.tokens
    for name in ("k", "v"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name  # bit for bit


def test_fetch_from_tokens_and_descriptor_alone(procs: Procs, tmp_path: Path) -> None:  # noqa: F811
    source = synthetic(llama_descriptor(layers=6, kv_heads=2, head_dim=64), tokens=64, seed=11)
    cache = tmp_path / "cache.npz"
    save(cache, source)
    # what the producer hands a consumer: the descriptor and the prompt's tokens
    r = kvcs(
        "descriptor", str(cache),
        "--out", str(tmp_path / "desc.json"), "--tokens-out", str(tmp_path / "tokens.json"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = kvcs("descriptor", str(cache), "--tokens-out", str(tmp_path / "tokens.npy"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == source.descriptor

    _, url, ca = procs.relay("relay")
    pub = procs.start(
        "publisher", "publish", url, "--ca", ca, "--file", str(cache),
        "--scope-key", SCOPE_HEX, "--serve-for", "60", "--json",
    )  # fmt: skip
    line = read_event(pub, "published", START_TIMEOUT)  # progress lines come before it
    assert line["blocks"] == 4, line
    cache.unlink()  # the consumers never see it (the second uses another file's descriptor)
    other = tmp_path / "other.safetensors"
    save(other, synthetic(source.descriptor, tokens=16, seed=99))  # same model, other K/V

    consumers = {
        "fetch-json": (["--tokens-file", str(tmp_path / "tokens.json"),
                        "--descriptor", str(tmp_path / "desc.json")], tmp_path / "got.npz"),
        "fetch-npy": (["--tokens-file", str(tmp_path / "tokens.npy"),
                       "--descriptor", str(other)], tmp_path / "got.safetensors"),
    }  # fmt: skip
    for name, (inputs, out) in consumers.items():
        proc = procs.start(
            name, "fetch", url, "--ca", ca, *inputs, "--scope-key", SCOPE_HEX,
            "--out", str(out), "--json", "--fetch-timeout", "45",
        )  # fmt: skip
        stdout = procs.finish(proc)
        err = procs.stderr(name)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{stdout}\n{err}"
        assert "Traceback" not in err, err
        done = [d for d in json_lines(stdout) if d.get("event") == "done"]
        assert len(done) == 1, stdout
        assert done[0]["complete"] is True and done[0]["blocks"] == 4, done[0]
        assert done[0]["tokens"] == 64 and done[0]["out"] == str(out), done[0]
        assert "bit_identical" in done[0] and done[0]["bit_identical"] is None, done[0]
        _same(load(out), source)
