"""The transformers adapter on a real (small, random, locally built) Llama: descriptors, the
cache argument's name, publishing during prefill, computing while the cache arrives, q8,
whole caches. No network, no downloads."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from hf_models import build_model_dir, prompt_text  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from kvcs.adapters import numpy_kv  # noqa: E402
from kvcs.adapters import transformers_kv as tk  # noqa: E402
from kvcs.adapters.torch_kv import TorchKvDestination, layer_sections  # noqa: E402
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor  # noqa: E402

B = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("llama") / "m")


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any, dict[str, Any]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    desc = tk.model_descriptor(
        model.config,
        model_id="test",
        revision=tk.directory_revision(model_dir),
        dtype=model.dtype,
        block_tokens=B,
    )
    return model, tok, desc


def _ids(tok: Any, n: int) -> Any:
    ids = tok(prompt_text(n), return_tensors="pt").input_ids
    assert ids.shape == (1, n)
    return ids


def _prefill(model: Any, ids: Any) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, **tk.cache_kwargs(model, cache), use_cache=True)
    return cache


# --- descriptors --------------------------------------------------------------------------


def test_descriptor_from_the_config(loaded: Any, model_dir: Path) -> None:
    model, _, desc = loaded
    assert desc["model"].startswith("test@sha256:")
    assert (desc["layers"], desc["kv_heads"], desc["head_dim"]) == (4, 2, 64)
    assert desc["dtype"] == "bfloat16" and desc["block_tokens"] == B
    extra = desc["extra"]
    assert extra["model_type"] == "llama"
    assert extra["rope_parameters"]["rope_theta"] == "10000.0"  # floats as strings
    CompatibilityDescriptor(desc)  # valid
    f16 = tk.model_descriptor(model.config, model_id="test", revision="r", dtype=torch.float16)
    assert f16["dtype"] == "float16"
    with pytest.raises(ValueError, match="no KVSP dtype"):
        tk.model_descriptor(model.config, model_id="t", revision="r", dtype=torch.int32)


def test_rope_scaling_changes_the_compatibility_id(tmp_path: Path, loaded: Any) -> None:
    model, _, _ = loaded
    scaled = build_model_dir(
        tmp_path / "scaled",
        rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    config = AutoModelForCausalLM.from_pretrained(scaled, local_files_only=True).config
    a = tk.model_descriptor(model.config, model_id="m", revision="r", dtype=torch.bfloat16)
    b = tk.model_descriptor(config, model_id="m", revision="r", dtype=torch.bfloat16)
    assert b["extra"]["rope_parameters"]["factor"] == "2.0"
    assert CompatibilityDescriptor(a).compat_id != CompatibilityDescriptor(b).compat_id


def test_revision_follows_the_weights_not_the_path(tmp_path: Path, model_dir: Path) -> None:
    copy = tmp_path / "elsewhere"
    shutil.copytree(model_dir, copy)
    assert tk.directory_revision(copy) == tk.directory_revision(model_dir)
    other = build_model_dir(tmp_path / "other", seed=1)
    assert tk.directory_revision(other) != tk.directory_revision(model_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a model directory"):
        tk.directory_revision(tmp_path / "empty")


# --- the API's sharp edges ------------------------------------------------------------------


def test_the_cache_goes_under_the_name_the_forward_takes(loaded: Any) -> None:
    model, tok, _ = loaded
    assert tk.cache_argument(model) == "cache"  # transformers >= 5.24

    class Older:  # the signature of a 5.x release before the rename
        def forward(self, input_ids: Any, past_key_values: Any = None) -> None: ...

    assert tk.cache_argument(Older()) == "past_key_values"
    # the cache is really used: the suffix alone, with the prefix's cache, gives the logits
    # of the whole prompt; without it (as when an unknown name is ignored) it does not
    ids = _ids(tok, 40)
    with torch.inference_mode():
        full = model(ids).logits[0, -1].float()
        cache = _prefill(model, ids[:, :32])
        used = model(ids[:, 32:], **tk.cache_kwargs(model, cache)).logits[0, -1].float()
        ignored = model(ids[:, 32:]).logits[0, -1].float()
    assert (used - full).abs().max() < 0.1 * full.abs().max()
    assert (ignored - full).abs().max() > 10 * (used - full).abs().max()
    assert cache.get_seq_length() == 40


def test_generate_reuses_a_cache_of_all_but_the_last_token(loaded: Any) -> None:
    assert [tk.reusable_tokens(n, B) for n in (16, 17, 32, 33, 70)] == [0, 16, 16, 32, 64]
    model, tok, _ = loaded
    ids = _ids(tok, 64)  # a whole number of blocks: 48 reusable tokens, not 64
    n = tk.reusable_tokens(64, B)
    cache = tk.trimmed_cache(_prefill(model, ids), model.config, n)
    assert cache.get_seq_length() == 48
    with torch.inference_mode():
        cold = model.generate(ids, max_new_tokens=8, do_sample=False)
        warm = model.generate(
            ids, max_new_tokens=8, do_sample=False, **tk.cache_kwargs(model, cache)
        )
    assert warm.tolist() == cold.tolist()


# --- producer: publishing during prefill ------------------------------------------------------


def test_each_layer_is_handed_over_as_soon_as_it_has_run(loaded: Any) -> None:
    model, tok, desc = loaded
    cd = CompatibilityDescriptor(desc)
    ids = _ids(tok, 70)
    cache = DynamicCache(config=model.config)
    seen: list[tuple[int, Any, list[bool]]] = []

    def sink(layer: int, sections: Any) -> None:
        # which layers have run when layer `layer` is handed over
        seen.append((layer, sections, [e.is_initialized for e in cache.layers]))

    with tk.PrefillTap(model, cache, desc, sink) as tap, torch.inference_mode():
        model(ids, **tk.cache_kwargs(model, cache), use_cache=True)
    assert [s[0] for s in seen] == [0, 1, 2, 3]
    for layer, _, ran in seen:  # layer l is out before layer l+1 has run
        assert ran == [i <= layer for i in range(4)]
    assert [e[1] for e in tap.events] == [0, 1, 2, 3]
    for layer, sections, _ in seen:  # the published bits are the final cache's, 4 blocks
        entry = cache.layers[layer]
        want = layer_sections(
            entry.keys[0, :, :64].contiguous(), entry.values[0, :, :64].contiguous(), cd
        )
        assert len(sections.k) == 4
        assert bytes(sections.k_data) == bytes(want.k_data)
        assert bytes(sections.v_data) == bytes(want.v_data)
    # the hooks are gone afterwards
    with torch.inference_mode():
        model(ids[:, :16])
    assert len(seen) == 4


def test_a_model_with_other_layer_counts_is_refused(loaded: Any) -> None:
    model, _, desc = loaded
    wrong = dict(desc, layers=5)
    with pytest.raises(ValueError, match="4 decoder layers"):
        tk.PrefillTap(model, DynamicCache(config=model.config), wrong, lambda *a: None)


# --- consumer: computing while the cache arrives ----------------------------------------------


def _destination(cd: CompatibilityDescriptor, cache: DynamicCache, n: int) -> TorchKvDestination:
    dest = TorchKvDestination(cd, n)
    for layer, entry in enumerate(cache.layers):
        s = layer_sections(
            entry.keys[0, :, :n].contiguous(), entry.values[0, :, :n].contiguous(), cd
        )
        dest.buffer(layer, "k")[:] = s.k_data
        dest.buffer(layer, "v")[:] = s.v_data
    return dest


def test_the_forward_pass_goes_layer_by_layer_as_the_cache_arrives(loaded: Any) -> None:
    model, tok, desc = loaded
    cd = CompatibilityDescriptor(desc)
    ids = _ids(tok, 70)
    n = tk.reusable_tokens(70, B)
    producer = _prefill(model, ids[:, :n])
    dest = _destination(cd, producer, n)
    feed = tk.LayerFeed(dest, 4, timeout=30)
    pace = 0.3

    def arrive() -> None:  # the layers arrive one by one, `pace` apart
        for layer in range(4):
            time.sleep(pace)
            feed.ready(layer)

    thread = threading.Thread(target=arrive)
    streamed = tk.StreamedCache(model.config, n, feed)
    assert streamed.get_seq_length() == n  # known before anything arrived
    thread.start()
    try:
        with tk.ComputeTrace(model, feed), torch.inference_mode():
            got = model(ids[:, n:], **tk.cache_kwargs(model, streamed)).logits
    finally:
        thread.join(10)
    with torch.inference_mode():
        want = model(
            ids[:, n:], **tk.cache_kwargs(model, tk.trimmed_cache(producer, model.config, n))
        ).logits
    assert torch.equal(got, want)
    at = {(w, layer): t for w, layer, t in feed.events}
    assert at[("computed", 0)] < at[("arrived", 3)]  # layer 0 ran before the last arrived
    for layer in range(4):
        assert at[("arrived", layer)] <= at[("taken", layer)] <= at[("computed", layer)]
    # the pass ends soon after the last layer: before another layer could have arrived
    assert at[("computed", 3)] - at[("arrived", 3)] < pace


def test_a_layer_that_will_not_arrive_stops_the_forward_pass(loaded: Any) -> None:
    model, tok, desc = loaded
    cd = CompatibilityDescriptor(desc)
    ids = _ids(tok, 40)
    dest = _destination(cd, _prefill(model, ids[:, :32]), 32)
    feed = tk.LayerFeed(dest, 4, timeout=30)
    feed.ready(0)
    feed.ready(1)
    feed.fail("objects missing")
    with (
        pytest.raises(tk.CacheUnavailable, match="layer 2 will not arrive: objects missing"),
        torch.inference_mode(),
    ):
        model(ids[:, 32:], **tk.cache_kwargs(model, tk.StreamedCache(model.config, 32, feed)))
    late = tk.LayerFeed(dest, 4, timeout=0.05)
    with pytest.raises(tk.CacheUnavailable, match="did not arrive within"):
        late.get(0, 32)


def test_a_whole_received_cache_is_a_ready_dynamic_cache(loaded: Any) -> None:
    model, tok, desc = loaded
    cd = CompatibilityDescriptor(desc)
    ids = _ids(tok, 50)
    producer = _prefill(model, ids[:, :48])
    dest = _destination(cd, producer, 48)
    for layer in range(4):
        dest.layer_ready(layer)
    cache = tk.dynamic_cache(dest, model.config, 48)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 48
    for a, b in zip(cache.layers, producer.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_q8_layers_decode_into_the_destination(loaded: Any) -> None:
    model, tok, desc = loaded
    cd = CompatibilityDescriptor(desc)
    producer = _prefill(model, _ids(tok, 32))
    staging = tk.Q8Staging(cd, 32)
    dest = TorchKvDestination(cd, 32)
    for layer, entry in enumerate(producer.layers):
        s = layer_sections(entry.keys[0].contiguous(), entry.values[0].contiguous(), cd)
        parts = [
            bytes(numpy_kv.q8_encode(sec, cd))
            for pair in zip(s.k, s.v, strict=True)
            for sec in pair
        ]
        staging.buffer(layer, "kv")[:] = b"".join(parts)
        tk.q8_layer_into(staging, layer, dest)
        dest.layer_ready(layer)
        want_k = b"".join(bytes(numpy_kv.q8_decode_section(p, cd)) for p in parts[0::2])
        assert bytes(dest.buffer(layer, "k")) == want_k
        k, _ = dest.layer(layer)
        err = (k.float() - entry.keys[0].float()).abs().max()
        assert 0 < err < 0.05 * entry.keys.float().abs().max()  # lossy, but close
    assert np.frombuffer(staging.data(0), np.uint8).any()
