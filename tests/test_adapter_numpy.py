"""The numpy KV adapter (``adapters/numpy_kv.py``) against the pure KVSP reference.

* engine arrays -> sections -> destination buffers -> engine arrays is
  bit-identical for every descriptor dtype (bfloat16 as uint16, float8 as
  uint8; random bit patterns, NaNs included), both engine layouts, shapes and
  block ranges chosen by Hypothesis;
* every section equals, byte for byte, the section written out element by
  element from the binding section 5 text (``reference_section``), and the
  KVSP layer digest of ``kvcs_core.kvsp`` over it;
* zero-copy is asserted (``np.shares_memory``, ``memoryview.obj``) exactly
  where the module promises it, and a copy exactly where it documents one;
* q8 and the dtype conversions equal ``kvcs_core.kvsp`` (pure Python) byte for
  byte; NaN results, whose payload the binding does not fix, are compared as
  "NaN with the same sign";
* every misuse is a ``ValueError`` naming the fix (never a silent copy).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcs.adapters import numpy_kv as nk
from kvcs_core import kvsp
from kvcs_core.kvcs.names import Component
from kvcs_core.kvsp import (
    Codec,
    CompatibilityDescriptor,
    Dtype,
    SectionError,
    UnknownCodecError,
)

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def descriptor(
    heads: int, dim: int, block: int, dtype: Dtype | str = "float16", layers: int = 2
) -> CompatibilityDescriptor:
    return CompatibilityDescriptor.create(
        model="test/adapter@1",
        layers=layers,
        kv_heads=heads,
        head_dim=dim,
        dtype=dtype,
        block_tokens=block,
    )


def engine_shape(cd: CompatibilityDescriptor, tokens: int, layout: str) -> tuple[int, int, int]:
    if layout == "HND":
        return (cd.kv_heads, tokens, cd.head_dim)
    return (tokens, cd.kv_heads, cd.head_dim)


def random_layer(
    rng: np.random.Generator, cd: CompatibilityDescriptor, tokens: int, layout: str
) -> Any:
    """Random bit patterns (NaNs and infinities included) in the engine dtype."""
    shape = engine_shape(cd, tokens, layout)
    bits = rng.integers(0, 2 ** (8 * cd.itemsize), shape, dtype=np.uint64)
    return bits.astype(BITS[cd.itemsize]).view(nk.engine_dtype(cd.dtype))


def reference_section(arr: Any, block: int, cd: CompatibilityDescriptor, layout: str) -> bytes:
    """Binding section 5, element by element: [kv_heads, block_tokens, head_dim], C order."""
    flat = arr.tobytes()  # the engine array in its own C order
    size = cd.itemsize
    heads, block_tokens, dim = cd.section_shape
    tokens = arr.shape[1] if layout == "HND" else arr.shape[0]
    out = bytearray()
    for h in range(heads):
        for j in range(block_tokens):
            t = block * block_tokens + j
            for d in range(dim):
                index = (h * tokens + t) * dim + d if layout == "HND" else (t * heads + h) * dim + d
                out += flat[index * size : (index + 1) * size]
    return bytes(out)


def as_bits(arr: Any) -> Any:
    return np.ascontiguousarray(arr).view(BITS[arr.dtype.itemsize])


def shares(view: memoryview | Any, arr: Any) -> bool:
    other = np.frombuffer(view, np.uint8) if isinstance(view, memoryview) else view
    return bool(np.shares_memory(other, arr))


def section_view_expected(
    cd: CompatibilityDescriptor, tokens: int, blocks: int, layout: str
) -> bool:
    """Where the module promises views of the engine array (its docstring table)."""
    if cd.kv_heads == 1:
        return True
    if layout == "HND":
        return blocks == 1 and tokens == cd.block_tokens
    return cd.block_tokens == 1


cases = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(list(Dtype)),
        "heads": st.integers(1, 4),
        "dim": st.integers(1, 6),
        "block": st.integers(1, 4),
        "blocks": st.integers(1, 4),
        "tail": st.integers(0, 3),
        "layout": st.sampled_from(["HND", "NHD"]),
        "seed": st.integers(0, 2**32 - 1),
    }
)


# --------------------------------------------------------------------------- round trip


@FAST
@given(cases)
def test_round_trip_is_bit_identical_and_matches_the_reference(case: dict[str, Any]) -> None:
    cd = descriptor(case["heads"], case["dim"], case["block"], case["dtype"])
    layout = case["layout"]
    b, n = cd.block_tokens, case["blocks"]
    tokens = n * b + case["tail"] % b
    rng = np.random.default_rng(case["seed"])
    engine = [(random_layer(rng, cd, tokens, layout), random_layer(rng, cd, tokens, layout))]
    engine.append((random_layer(rng, cd, tokens, layout), random_layer(rng, cd, tokens, layout)))
    size = cd.section_size
    dest = nk.KvDestination(cd, n * b)
    promised_view = section_view_expected(cd, tokens, n, layout)

    for layer, (k, v) in enumerate(engine):
        ls = nk.layer_sections(k, v, cd, layout=layout)
        assert len(ls.k) == len(ls.v) == n and ls.first_block == 0
        assert ls.copied is not promised_view
        for i in range(n):
            want_k, want_v = (
                reference_section(k, i, cd, layout),
                reference_section(v, i, cd, layout),
            )
            assert bytes(ls.k[i]) == want_k and bytes(ls.v[i]) == want_v
            assert len(ls.k[i]) == size
            assert (
                kvsp.layer_digest(cd, ls.k[i], ls.v[i]) == hashlib.sha256(want_k + want_v).digest()
            )
            # one block at a time: the same bytes
            bk, bv = nk.block_sections(k, v, i, cd, layout=layout)
            assert bytes(bk) == want_k and bytes(bv) == want_v
            one_view = section_view_expected(cd, tokens, 1, layout)
            assert shares(bk, k) is one_view and shares(bv, v) is one_view
            # zero-copy where promised, one shared gather buffer otherwise
            assert shares(ls.k[i], k) is promised_view
            assert ls.k[i].obj is ls.k_data.obj and ls.v[i].obj is ls.v_data.obj
            assert not shares(ls.k[i], v)
        if not promised_view:
            assert not np.shares_memory(np.frombuffer(ls.k_data, np.uint8), k)

        # the consumer: layer 0 by writing into buffer() slices, layer 1 with write()
        if layer == 0:
            kbuf, vbuf = dest.buffer(layer, "k"), dest.buffer(layer, Component.V)
            assert len(kbuf) == n * size and not kbuf.readonly
            for i in range(n):
                kbuf[i * size : (i + 1) * size] = ls.k[i]
                vbuf[i * size : (i + 1) * size] = ls.v[i]
        else:
            for i in range(n):
                if i % 2:
                    dest.write(layer, Component.KV, i, bytes(ls.k[i]) + bytes(ls.v[i]))
                else:
                    dest.write(layer, "k", i, ls.k[i], Codec.RAW)
                    dest.write(layer, Component.V, i, ls.v[i])

        got_k, got_v = dest.as_engine_arrays(layer, layout=layout)
        cut = slice(0, n * b)
        want_k = k[:, cut, :] if layout == "HND" else k[cut]
        want_v = v[:, cut, :] if layout == "HND" else v[cut]
        assert got_k.shape == want_k.shape and got_k.dtype == nk.engine_dtype(cd.dtype)
        assert np.array_equal(as_bits(got_k), as_bits(want_k))
        assert np.array_equal(as_bits(got_v), as_bits(want_v))
        view = dest.engine_view_possible(layout)
        if layout == "HND":
            assert view is (cd.kv_heads == 1 or n == 1)
        else:
            assert view is (cd.kv_heads == 1 or b == 1)
        storage_k = np.frombuffer(dest.buffer(layer, "k"), np.uint8)
        assert bool(np.shares_memory(got_k, storage_k)) is view
        if not view:
            assert got_k.flags.c_contiguous
            out_k, out_v = np.zeros_like(k), np.zeros_like(v)
            ret = dest.as_engine_arrays(layer, layout=layout, out=(out_k, out_v))
            assert ret[0] is out_k and ret[1] is out_v
            assert np.array_equal(
                as_bits(want_k), as_bits(out_k[:, cut, :] if layout == "HND" else out_k[cut])
            )
        else:
            with pytest.raises(ValueError, match="no copy"):
                dest.as_engine_arrays(
                    layer, layout=layout, out=(np.empty_like(k), np.empty_like(v))
                )

        # paged view: always zero-copy, section order
        pk, pv = dest.as_paged_arrays(layer)
        assert pk.shape == (n, *cd.section_shape)
        assert np.shares_memory(pk, storage_k)
        for i in range(n):
            assert pk[i].tobytes() == bytes(ls.k[i]) and pv[i].tobytes() == bytes(ls.v[i])
            assert bytes(dest.section(layer, "v", i)) == bytes(ls.v[i])

        # the consumer's alternative: scatter into the engine array itself
        scattered = np.zeros_like(k)
        for i in range(n):
            nk.write_block(scattered, i, ls.k[i], cd, layout=layout)
        assert np.array_equal(
            as_bits(scattered[:, cut, :] if layout == "HND" else scattered[cut]), as_bits(want_k)
        )


@FAST
@given(cases, st.data())
def test_a_block_range_and_a_reused_out_buffer(case: dict[str, Any], data: st.DataObject) -> None:
    cd = descriptor(case["heads"], case["dim"], case["block"], case["dtype"])
    layout = case["layout"]
    n = case["blocks"]
    tokens = n * cd.block_tokens + case["tail"] % cd.block_tokens
    rng = np.random.default_rng(case["seed"])
    k, v = random_layer(rng, cd, tokens, layout), random_layer(rng, cd, tokens, layout)
    first = data.draw(st.integers(0, n - 1))
    count = data.draw(st.integers(1, n - first))
    bufs = (bytearray(count * cd.section_size), np.empty(count * cd.section_size, np.uint8))
    ls = nk.layer_sections(k, v, cd, first_block=first, blocks=count, layout=layout, out=bufs)
    assert ls.first_block == first and len(ls.k) == count
    for i in range(count):
        assert bytes(ls.k[i]) == reference_section(k, first + i, cd, layout)
        assert bytes(ls.v[i]) == reference_section(v, first + i, cd, layout)
    if ls.copied:  # the gather went into the caller's buffers, and nowhere else
        assert bytes(bufs[0]) == bytes(ls.k_data)
        assert np.shares_memory(np.frombuffer(ls.v_data, np.uint8), bufs[1])
    else:
        assert bufs[0] == bytearray(count * cd.section_size)  # untouched
    # block_sections with out: the copy lands in out
    ko, vo = bytearray(cd.section_size), bytearray(cd.section_size)
    bk, _ = nk.block_sections(k, v, first, cd, layout=layout, out=(ko, vo))
    if not shares(bk, k):
        assert bk.obj is not None and bytes(ko) == bytes(bk)
        assert np.shares_memory(np.frombuffer(bk, np.uint8), np.frombuffer(ko, np.uint8))


def test_zero_copy_cases_spelled_out() -> None:
    """The documented table, case by case, with memoryview.obj and np.shares_memory."""
    rng = np.random.default_rng(3)
    one_head = descriptor(1, 8, 4)
    k = random_layer(rng, one_head, 16, "HND")
    ks, _ = nk.block_sections(k, k, 2, one_head)
    assert isinstance(ks.obj, np.ndarray) and np.shares_memory(np.frombuffer(ks, np.uint8), k)
    ls = nk.layer_sections(k, k, one_head)
    assert not ls.copied and all(np.shares_memory(np.frombuffer(s, np.uint8), k) for s in ls.k)

    many = descriptor(8, 8, 4)
    k = random_layer(rng, many, 16, "HND")
    ks, _ = nk.block_sections(k, k, 1, many)  # 8 runs of 32 elements: a gather
    assert not np.shares_memory(np.frombuffer(ks, np.uint8), k)
    ls = nk.layer_sections(k, k, many)
    assert ls.copied and len({id(s.obj) for s in ls.k}) == 1  # one buffer for the layer
    one_block = random_layer(rng, many, 4, "HND")  # tokens == block_tokens
    ks, _ = nk.block_sections(one_block, one_block, 0, many)
    assert np.shares_memory(np.frombuffer(ks, np.uint8), one_block)

    # a whole cache [layers, H, T, D]: its layers are views, so the same rules hold
    cache = np.stack([random_layer(rng, one_head, 8, "HND") for _ in range(2)])
    layer1 = nk.cache_layer(cache, 1, one_head)
    assert np.shares_memory(layer1, cache) and layer1.flags.c_contiguous
    ks, _ = nk.block_sections(layer1, layer1, 1, one_head)
    assert np.shares_memory(np.frombuffer(ks, np.uint8), cache)

    # paged HND: always views
    pages = random_layer(rng, many, 12, "HND").reshape(3, *many.section_shape)
    pk, _ = nk.page_sections(pages, pages, 2, many)
    assert bytes(pk) == pages[2].tobytes() and np.shares_memory(np.frombuffer(pk, np.uint8), pages)

    # destination: paged always a view; HND [H, T, D] a view only with one head or one block
    dest = nk.KvDestination(many, 8)
    assert not dest.engine_view_possible("HND") and not dest.engine_view_possible("NHD")
    single = nk.KvDestination(many, 4)
    k_view, _ = single.as_engine_arrays(0)
    assert np.shares_memory(k_view, np.frombuffer(single.buffer(0, "k"), np.uint8))
    single.section(0, "k", 0)[:2] = b"\x00\x3c"  # 1.0 in float16, written after the view was taken
    assert k_view[0, 0, 0] == 1.0


def test_kvsp_vector_object_data_is_block_1_of_layer_1() -> None:
    """``kvsp-vectors.json``'s example Data (k, layer 1, block 1) placed and read back."""
    cd = descriptor(2, 4, 4, "float16")
    data = bytes(range(64))
    k = np.zeros((2, 8, 4), "<f2")
    nk.write_block(k, 1, data, cd)
    for h in range(2):
        for j in range(4):
            for d in range(4):
                offset = ((h * 4 + j) * 4 + d) * 2
                assert k[h, 4 + j, d].tobytes() == data[offset : offset + 2]
    assert not k[:, :4].any()
    assert bytes(nk.block_sections(k, k, 1, cd)[0]) == data
    dest = nk.KvDestination(cd, 8)
    dest.write(1, "k", 1, data)
    assert dest.as_engine_arrays(1)[0].tobytes() == k.tobytes()


# --------------------------------------------------------------------------- errors


def test_bad_inputs_are_value_errors_with_the_fix() -> None:
    cd = descriptor(2, 4, 2, "float16")
    k = np.zeros((2, 6, 4), "<f2")
    with pytest.raises(ValueError, match="ascontiguousarray"):
        nk.layer_sections(k[:, ::2], k[:, ::2], cd)
    with pytest.raises(ValueError, match="ascontiguousarray"):
        nk.block_sections(np.zeros((4, 6, 2), "<f2").transpose(2, 1, 0), k, 0, cd)
    with pytest.raises(ValueError, match="dtype float32"):
        nk.layer_sections(k.astype("<f4"), k, cd)
    with pytest.raises(ValueError, match="big-endian"):
        nk.layer_sections(k.astype(">f2"), k, cd)
    with pytest.raises(ValueError, match="kv_heads=2"):
        nk.layer_sections(np.zeros((3, 6, 4), "<f2"), k, cd)
    with pytest.raises(ValueError, match="cache_layer"):
        nk.layer_sections(k[None], k[None], cd)
    with pytest.raises(ValueError, match=r"numpy\.ndarray"):
        nk.layer_sections(k.tolist(), k, cd)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout"):
        nk.layer_sections(k, k, cd, layout="THD")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k_layer has 6 tokens, v_layer 4"):
        nk.layer_sections(k, k[:, :4].copy(), cd)
    with pytest.raises(ValueError, match="full blocks"):
        nk.block_sections(k, k, 3, cd)
    with pytest.raises(ValueError, match="full blocks"):
        nk.layer_sections(k, k, cd, first_block=1, blocks=3)
    with pytest.raises(ValueError, match="negative"):
        nk.layer_sections(k, k, cd, first_block=-1)
    with pytest.raises(ValueError, match="octets"):
        nk.block_sections(k, k, 0, cd, out=(bytearray(3), bytearray(32)))
    with pytest.raises(ValueError, match="read-only"):
        nk.block_sections(k, k, 0, cd, out=(bytes(32), bytes(32)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read-only"):
        frozen = k.copy()
        frozen.flags.writeable = False
        nk.write_block(frozen, 0, bytes(32), cd)
    with pytest.raises(SectionError):
        nk.write_block(k, 0, bytes(31), cd)

    raw_bits = descriptor(2, 4, 2, "bfloat16")
    with pytest.raises(ValueError, match=r"raw bits: \.view\(np\.uint16\)"):
        nk.layer_sections(k, k, raw_bits)
    assert nk.layer_sections(k.view(np.uint16), k.view(np.uint16), raw_bits).copied
    fp8 = descriptor(2, 4, 2, "float8_e5m2")
    with pytest.raises(ValueError, match=r"np\.uint8"):
        nk.layer_sections(k, k, fp8)

    with pytest.raises(ValueError, match="4-D"):
        nk.cache_layer(k, 0, cd)
    with pytest.raises(ValueError, match="layers"):
        nk.cache_layer(np.zeros((3, 2, 6, 4), "<f2"), 0, cd)
    with pytest.raises(ValueError, match="layer 2"):
        nk.cache_layer(np.zeros((2, 2, 6, 4), "<f2"), 2, cd)
    with pytest.raises(ValueError, match="page 3"):
        nk.page_sections(np.zeros((3, 2, 2, 4), "<f2"), np.zeros((3, 2, 2, 4), "<f2"), 3, cd)
    with pytest.raises(ValueError, match="pages are"):
        nk.page_sections(k, k, 0, cd)


def test_destination_errors() -> None:
    cd = descriptor(2, 4, 2, "float16")
    for tokens in (0, 1, 5):
        with pytest.raises(ValueError, match="multiple of block_tokens=2"):
            nk.KvDestination(cd, tokens)
    dest = nk.KvDestination(cd, 4)
    assert dest.blocks == 2 and dest.layer_size == 2 * cd.section_size
    with pytest.raises(ValueError, match="layer 2"):
        dest.buffer(2, "k")
    with pytest.raises(ValueError, match="component"):
        dest.buffer(0, "kv")
    with pytest.raises(ValueError, match="component"):
        dest.buffer(0, Component.KV)
    with pytest.raises(ValueError, match="block 2"):
        dest.section(0, "k", 2)
    with pytest.raises(UnknownCodecError):
        dest.write(0, "k", 0, bytes(cd.section_size), codec=0x8000)
    with pytest.raises(SectionError, match="raw Data"):
        dest.write(0, "k", 0, bytes(cd.section_size - 1))
    with pytest.raises(SectionError, match="q8 Data"):
        dest.write(0, "kv", 0, bytes(cd.section_size), codec=Codec.Q8)
    with pytest.raises(ValueError, match="C-contiguous"):
        dest.write(0, "k", 0, memoryview(bytes(2 * cd.section_size))[::2])
    bad_out = (np.zeros((2, 4, 4), "<f4"), np.zeros((2, 4, 4), "<f4"))
    with pytest.raises(ValueError, match="dtype float32"):
        dest.as_engine_arrays(0, out=bad_out)
    short = (np.zeros((2, 2, 4), "<f2"), np.zeros((2, 2, 4), "<f2"))
    with pytest.raises(ValueError, match="full blocks"):
        dest.as_engine_arrays(0, out=short)


# --------------------------------------------------------------------------- q8


def same_bits(got: bytes, want: bytes, dtype: Dtype) -> None:
    """Byte equality, except that a NaN need only be a NaN of the same sign there."""
    if got == want:
        return
    a = nk.to_float32(np.frombuffer(got, nk.engine_dtype(dtype)), dtype)
    b = nk.to_float32(np.frombuffer(want, nk.engine_dtype(dtype)), dtype)
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    assert np.array_equal(np.signbit(a[nan]), np.signbit(b[nan]))
    assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def finite_values(rng: np.random.Generator, count: int, dtype: Dtype, style: int) -> Any:
    """float32 values that are exact in ``dtype``, in several shapes of trouble."""
    x: Any
    if style == 0:  # plain, at a random magnitude
        x = rng.standard_normal(count) * 10.0 ** int(rng.integers(-6, 5))
    elif style == 1:  # halves: many ties in x / scale
        x = rng.integers(-6, 7, count) * 0.5
    elif style == 2:  # zeros, with a few survivors
        x = np.where(rng.random(count) < 0.8, 0.0, rng.standard_normal(count))
    else:  # tiny: subnormal scales, underflowing rows
        x = rng.standard_normal(count) * 1e-38 * float(rng.random())
    x32 = x.astype(np.float32)
    raw = nk.from_float32(x32, dtype)  # round to the dtype, then drop what is not finite
    back = nk.to_float32(raw, dtype)
    raw[~np.isfinite(back)] = 0
    return raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(list(Dtype)),
    heads=st.integers(1, 3),
    block=st.integers(1, 4),
    dim=st.integers(1, 16),
    blocks=st.integers(1, 3),
    style=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_q8_equals_the_pure_reference(
    dtype: Dtype, heads: int, block: int, dim: int, blocks: int, style: int, seed: int
) -> None:
    cd = descriptor(heads, dim, block, dtype)
    shape = cd.section_shape
    rng = np.random.default_rng(seed)
    raw = finite_values(rng, blocks * heads * block * dim, dtype, style)
    sections = [
        raw.tobytes()[i * cd.section_size : (i + 1) * cd.section_size] for i in range(blocks)
    ]
    try:
        want = [kvsp.q8_encode(s, dtype, shape) for s in sections]
    except SectionError:  # a float32/bfloat16 scale beyond float16: both refuse
        with pytest.raises(SectionError, match="beyond float16"):
            nk.q8_encode(raw, cd, blocks=blocks)
        return
    got = nk.q8_encode(raw, cd, blocks=blocks)
    assert bytes(got) == b"".join(want)
    assert bytes(nk.q8_encode(sections[0], cd)) == want[0]
    # decoding: the encoder's output and arbitrary bytes of the right size
    junk = rng.integers(0, 256, blocks * kvsp.q8_size(shape), dtype=np.uint8).tobytes()
    for blob in (bytes(got), junk):
        parts = [blob[i * len(want[0]) : (i + 1) * len(want[0])] for i in range(blocks)]
        ref = b"".join(kvsp.q8_decode(p, dtype, shape) for p in parts)
        same_bits(bytes(nk.q8_decode_section(blob, cd, blocks=blocks)), ref, dtype)
        ref32 = b"".join(kvsp.q8_decode(p, Dtype.FLOAT32, shape) for p in parts)
        floats = nk.q8_decode_blocks(blob, cd, blocks)
        assert floats.dtype == np.float32 and floats.shape == (blocks, *shape)
        same_bits(floats.tobytes(), ref32, Dtype.FLOAT32)
        assert nk.q8_decode(parts[0], cd).tobytes() == floats[0].tobytes()
        out = bytearray(blocks * cd.section_size)
        nk.q8_decode_section(blob, cd, blocks=blocks, out=out)
        same_bits(bytes(out), ref, dtype)
        # the consumer's destination decodes q8 Data into its section buffers
        dest = nk.KvDestination(cd, blocks * block)
        for i, part in enumerate(parts):
            dest.write(0, "v", i, part, Codec.Q8)
            dest.write(1, Component.KV, i, part + part, codec=1)
        same_bits(bytes(dest.buffer(0, "v")), ref, dtype)
        same_bits(bytes(dest.buffer(1, "k")), ref, dtype)
        same_bits(bytes(dest.buffer(1, "v")), ref, dtype)
        assert not any(dest.buffer(0, "k"))


def test_q8_edge_cases_match_the_reference() -> None:
    cd16 = descriptor(1, 4, 2, "float16")
    # the hand example of test_kvsp: ties to even, an all-zero row
    section = struct.pack("<8e", 2.5, -3.5, 1.5, 127.0, 0.0, -0.0, 0.0, 0.0)
    assert bytes(nk.q8_encode(section, cd16)).hex() == "003c0000" + "02fc027f" + "00000000"
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(SectionError, match=r"block 0 element \[0, 1, 0\]"):
            nk.q8_encode(struct.pack("<8e", 1, 2, 3, 4, bad, 0, 0, 0), cd16)
    cd32 = descriptor(1, 2, 2, "float32")
    with pytest.raises(SectionError, match="head 0, token 1 is beyond float16"):
        nk.q8_encode(struct.pack("<4f", 1.0, 0.0, 1e7, 0.0), cd32)
    top = struct.pack("<4f", 1.0, 0.0, 127 * 65504.0, 0.0)
    assert bytes(nk.q8_encode(top, cd32)) == kvsp.q8_encode(top, Dtype.FLOAT32, (1, 2, 2))
    tiny = struct.pack("<4f", struct.unpack("<f", b"\x01\x00\x00\x00")[0], 0.0, 0.0, 0.0)
    assert bytes(nk.q8_encode(tiny, cd32)) == bytes(8)
    with pytest.raises(SectionError, match="octets"):
        nk.q8_encode(bytes(7), cd16)
    with pytest.raises(SectionError, match="octets"):
        nk.q8_decode(bytes(7), cd16)
    with pytest.raises(ValueError, match="blocks"):
        nk.q8_decode_section(bytes(12), cd16, blocks=0)
    with pytest.raises(ValueError, match="dtype"):
        nk.q8_encode(np.zeros(8, "<f4"), cd16)
    # any bytes decode: inf and NaN scales, q = -128, overflow of the dtype
    for dtype in Dtype:
        cd = descriptor(1, 3, 1, dtype)
        for blob in (
            b"\x00\x3c\x80\x01\x00",
            b"\x00\x7c\xff\x01\x00",
            b"\x00\xfc\xff\x01\x00",
            b"\x01\x7d\x05\x00\xfb",
            b"\x01\xfe\x05\x00\xfb",
            b"\xff\x7b\x7f\x81\x00",
        ):
            want = kvsp.q8_decode(blob, dtype, (1, 1, 3))
            same_bits(bytes(nk.q8_decode_section(blob, cd)), want, dtype)
            want32 = kvsp.q8_decode(blob, Dtype.FLOAT32, (1, 1, 3))
            same_bits(nk.q8_decode(blob, cd).tobytes(), want32, Dtype.FLOAT32)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", list(Dtype))
def test_to_float32_on_every_code(dtype: Dtype) -> None:
    if dtype is Dtype.FLOAT32:
        bits = np.random.default_rng(1).integers(0, 2**32, 50_000, dtype=np.uint64)
        codes = bits.astype(np.uint32)
    else:
        codes = np.arange(2 ** (8 * dtype.itemsize), dtype=np.uint64).astype(BITS[dtype.itemsize])
    raw = codes.view(nk.engine_dtype(dtype))
    got = nk.to_float32(raw, dtype)
    want = np.array(kvsp.to_float32(dtype, raw.tobytes()), np.float64)
    assert got.dtype == np.float32
    with np.errstate(invalid="ignore"):  # signalling NaNs widen quietly
        assert np.array_equal(got.astype(np.float64), want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("dtype", list(Dtype))
def test_from_float32_matches_the_reference(dtype: Dtype) -> None:
    rng = np.random.default_rng(11)
    random_bits = rng.integers(0, 2**32, 40_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # every value of the 8- and 16-bit formats, and the midpoints between neighbours (ties)
    grid = np.concatenate(
        [
            nk.to_float32(np.arange(256, dtype=np.uint8), Dtype.FLOAT8_E4M3FN),
            nk.to_float32(np.arange(256, dtype=np.uint8), Dtype.FLOAT8_E5M2),
            nk.to_float32(np.arange(65536, dtype=np.uint16), Dtype.BFLOAT16)[::7],
            np.arange(65536, dtype=np.uint16).view("<f2").astype(np.float32)[::7],
        ]
    )
    finite = np.unique(grid[np.isfinite(grid)]).astype(np.float64)
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, 480.0, 57344.0, 61440.0, 65504.0,
         65519.0, 65520.0, 3.4e38, 1e-45, -1e-45],
        np.float32,
    )  # fmt: skip
    x = np.concatenate([random_bits, grid, mids, special]).astype(np.float32)
    if dtype is Dtype.FLOAT32:
        x = x[~np.isnan(x)]  # float32 NaNs pass through unchanged (payload included)
    got = nk.from_float32(x, dtype)
    assert got.dtype == nk.engine_dtype(dtype) and got.shape == x.shape
    with np.errstate(invalid="ignore"):
        wide = x.astype(np.float64)
    want = kvsp.from_float32(dtype, wide.tolist())
    same_bits(got.tobytes(), want, dtype)
    if dtype is not Dtype.FLOAT32:  # NaN encodings are the reference's exactly
        assert got.tobytes() == want
    with pytest.raises(ValueError, match="float32"):
        nk.from_float32(wide, dtype)
