"""The torch adapter (``kvcs.adapters.torch_kv``) against the numpy adapter's bytes.

Every layout (HND, NHD, paged HND and NHD pages with a page table or a slot
mapping) and every descriptor dtype, both directions: sections made from torch
tensors must be the numpy adapter's sections bit for bit, and sections written
into a ``TorchKvDestination`` must read back as the source tensors bit for bit
(compared through integer views, so NaN patterns count too). Then a real
retrieval over QUIC on 127.0.0.1 into a ``TorchKvDestination``, published from
torch tensors. The CUDA tests run only where ``torch.cuda.is_available()``.

The module skips as a whole where torch is not installed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcs.adapters import numpy_kv as nk  # noqa: E402
from kvcs.adapters import torch_kv as tk  # noqa: E402
from kvcs.adapters.cachefile import llama_descriptor  # noqa: E402
from kvcs.transports.quic import asyncio_binding as b  # noqa: E402
from kvcs.transports.quic.tls import TlsConfig, self_signed  # noqa: E402
from kvcs_core.kvcs.names import Component  # noqa: E402
from kvcs_core.kvsp.codecs import Codec  # noqa: E402
from kvcs_core.kvsp.descriptor import CompatibilityDescriptor  # noqa: E402
from kvcs_core.kvsp.errors import SectionError  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
LAYOUTS = ["HND", "NHD"]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is false): the CUDA path runs on a GPU",
)


def cd_of(dtype: str, heads: int = 3, dim: int = 8, block: int = 4, layers: int = 2) -> Any:
    return CompatibilityDescriptor.create(
        model="t", layers=layers, kv_heads=heads, head_dim=dim, dtype=dtype, block_tokens=block
    )


def raw_layer(cd: Any, tokens: int, layout: str, seed: int) -> np.ndarray:
    """Random bit patterns (NaNs included) as one engine layer of the raw numpy dtype."""
    raw = nk.engine_dtype(cd.dtype)
    shape = (
        (cd.kv_heads, tokens, cd.head_dim)
        if layout == "HND"
        else (tokens, cd.kv_heads, cd.head_dim)
    )
    g = np.random.default_rng(seed)
    octets = g.integers(0, 256, size=int(np.prod(shape)) * raw.itemsize, dtype=np.uint8)
    return octets.view(raw).reshape(shape)


def as_torch(arr: np.ndarray, dtype: str) -> Any:
    """The same bits as a torch tensor of the real dtype (through an integer view)."""
    size = arr.dtype.itemsize
    ints = arr.view(np.uint8 if size == 1 else np.dtype(f"<i{size}"))
    return torch.from_numpy(np.ascontiguousarray(ints)).view(tk.torch_dtype(dtype))


def bits(t: Any) -> Any:
    return t.view(BITS[t.element_size()])


def same_bits(a: Any, b: Any) -> bool:
    return a.shape == b.shape and bool(torch.equal(bits(a.cpu()), bits(b.cpu())))


# --- publisher side: layer_sections ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("heads", "block", "tokens"), [(3, 4, 12), (1, 4, 12), (3, 1, 5), (3, 4, 4)]
)
def test_layer_sections_are_the_numpy_sections(
    dtype: str, layout: str, heads: int, block: int, tokens: int
) -> None:
    cd = cd_of(dtype, heads=heads, block=block)
    k_np, v_np = raw_layer(cd, tokens, layout, 1), raw_layer(cd, tokens, layout, 2)
    ref = nk.layer_sections(k_np, v_np, cd, layout=layout)
    k, v = as_torch(k_np, dtype), as_torch(v_np, dtype)
    got = tk.layer_sections(k, v, cd, layout=layout)
    assert got.copied == ref.copied
    assert bytes(got.k_data) == bytes(ref.k_data)
    assert bytes(got.v_data) == bytes(ref.v_data)
    assert [bytes(s) for s in got.k] == [bytes(s) for s in ref.k]
    assert [bytes(s) for s in got.v] == [bytes(s) for s in ref.v]
    if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):  # raw bits accepted, same result
        again = tk.layer_sections(bits(k), bits(v), cd, layout=layout)
        assert bytes(again.k_data) == bytes(ref.k_data)
    if not got.copied:  # zero-copy: the sections alias the engine tensor
        before = bytes(got.k_data)
        bits(k).view(-1)[0] ^= 1
        assert bytes(got.k_data) != before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_sections_block_range_and_out(layout: str) -> None:
    cd = cd_of("bfloat16")
    k_np, v_np = raw_layer(cd, 22, layout, 3), raw_layer(cd, 22, layout, 4)  # 5 full blocks
    ref = nk.layer_sections(k_np, v_np, cd, layout=layout, first_block=1, blocks=3)
    outs = (bytearray(3 * cd.section_size), torch.empty(3 * cd.section_size, dtype=torch.uint8))
    got = tk.layer_sections(
        as_torch(k_np, "bfloat16"),
        as_torch(v_np, "bfloat16"),
        cd,
        layout=layout,
        first_block=1,
        blocks=3,
        out=outs,
    )
    assert got.first_block == 1 and len(got.k) == 3
    assert bytes(got.k_data) == bytes(ref.k_data) == bytes(outs[0])
    assert bytes(got.v_data) == bytes(ref.v_data) == outs[1].numpy().tobytes()
    # the default block count: every remaining full block (the partial tail is left out)
    assert (
        len(
            tk.layer_sections(
                as_torch(k_np, "bfloat16"), as_torch(v_np, "bfloat16"), cd, layout=layout
            ).k
        )
        == 5
    )


def test_layer_sections_refuses_bad_input() -> None:
    cd = cd_of("float16")
    k = torch.zeros(3, 8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"not contiguous.*\.contiguous\(\)"):
        tk.layer_sections(k.transpose(0, 1), k.transpose(0, 1), cd, layout="NHD")
    with pytest.raises(ValueError, match=r"needs torch\.float16"):
        tk.layer_sections(k.float(), k.float(), cd)
    with pytest.raises(ValueError, match="kv_heads=3"):
        tk.layer_sections(k[:2], k[:2], cd)
    with pytest.raises(ValueError, match=r"torch\.Tensor"):
        tk.layer_sections(k.numpy(), k, cd)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens"):
        tk.layer_sections(k, k[:, :4].contiguous(), cd)
    with pytest.raises(ValueError, match="layout"):
        tk.layer_sections(k, k, cd, layout="XYZ")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not full blocks"):
        tk.layer_sections(k, k, cd, first_block=2)
    with pytest.raises(ValueError, match="octets"):
        tk.layer_sections(k, k, cd, out=(bytearray(3), bytearray(3)))
    with pytest.raises(ValueError, match="read-only"):
        tk.layer_sections(k, k, cd, out=(bytes(2 * cd.section_size),) * 2)
    grad = torch.zeros(3, 8, 8, requires_grad=True)
    s = tk.layer_sections(grad, grad, cd_of("float32"))  # detached, not refused
    assert bytes(s.k_data) == bytes(2 * cd_of("float32").section_size)


# --- paged caches ------------------------------------------------------------------------


def paged_from(
    layer_np: np.ndarray, cd: Any, page_size: int, page_layout: str, order: list[int], pages: int
) -> tuple[Any, list[int]]:
    """An HND engine layer scattered into a paged cache; (pages tensor, page table)."""
    heads, tokens, dim = layer_np.shape
    raw = np.zeros((pages, heads, page_size, dim), layer_np.dtype)
    table = order[: -(-tokens // page_size)]
    for t in range(tokens):
        raw[table[t // page_size], :, t % page_size] = layer_np[:, t]
    if page_layout == "NHD":
        raw = np.ascontiguousarray(raw.transpose(0, 2, 1, 3))
    return as_torch(raw, cd.dtype.value), table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_layout", LAYOUTS)
@pytest.mark.parametrize("heads", [1, 3])
def test_page_sections_are_the_numpy_sections(dtype: str, page_layout: str, heads: int) -> None:
    cd = cd_of(dtype, heads=heads)
    k_np, v_np = raw_layer(cd, 16, "HND", 5), raw_layer(cd, 16, "HND", 6)
    order = [5, 2, 7, 0, 1, 3, 4, 6]
    k_pages, table = paged_from(k_np, cd, 4, page_layout, order, 8)
    v_pages, _ = paged_from(v_np, cd, 4, page_layout, order, 8)
    for block, page in enumerate(table):
        k_sec, v_sec = tk.page_sections(k_pages, v_pages, page, cd, page_layout=page_layout)
        assert bytes(k_sec) == bytes(nk.section_of(k_np, block, cd))
        assert bytes(v_sec) == bytes(nk.section_of(v_np, block, cd))
    if page_layout == "HND":  # a page is a section as is: a view
        k_sec, _ = tk.page_sections(k_pages, v_pages, table[0], cd, page_layout="HND")
        bits(k_pages)[table[0]].view(-1)[0] ^= 1
        assert bytes(k_sec) != bytes(nk.section_of(k_np, 0, cd))
    with pytest.raises(ValueError, match="page 8 is not in"):
        tk.page_sections(k_pages, v_pages, 8, cd, page_layout=page_layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [4, 3, 8])
def test_paged_layer_sections_through_a_slot_mapping(
    dtype: str, page_layout: str, page_size: int
) -> None:
    cd = cd_of(dtype)
    tokens = 20  # 5 blocks of 4
    k_np, v_np = raw_layer(cd, tokens, "HND", 7), raw_layer(cd, tokens, "HND", 8)
    order = [9, 4, 0, 8, 2, 6, 1, 3, 5, 7]
    k_pages, table = paged_from(k_np, cd, page_size, page_layout, order, 10)
    v_pages, _ = paged_from(v_np, cd, page_size, page_layout, order, 10)
    slots = tk.slots_from_page_table(table, tokens, page_size)
    ref = nk.layer_sections(k_np, v_np, cd)
    got = tk.paged_layer_sections(k_pages, v_pages, slots, cd, page_layout=page_layout)
    assert bytes(got.k_data) == bytes(ref.k_data) and bytes(got.v_data) == bytes(ref.v_data)
    part = tk.paged_layer_sections(
        k_pages, v_pages, slots.tolist(), cd, page_layout=page_layout, first_block=2, blocks=2
    )
    assert bytes(part.k_data) == bytes(ref.k_data)[2 * cd.section_size : 4 * cd.section_size]
    bad = slots.clone()
    bad[3] = 10 * page_size
    with pytest.raises(ValueError, match="slot_mapping holds slots"):
        tk.paged_layer_sections(k_pages, v_pages, bad, cd, page_layout=page_layout)


def test_slots_from_page_table() -> None:
    assert tk.slots_from_page_table([3, 1], 6, 4).tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(ValueError, match="at least 2 pages"):
        tk.slots_from_page_table([3], 6, 4)
    with pytest.raises(ValueError, match="page_size"):
        tk.slots_from_page_table([3], 6, 0)


# --- consumer side: TorchKvDestination ---------------------------------------------------------


def filled(cd: Any, tokens: int, seed: int) -> tuple[Any, list[tuple[np.ndarray, np.ndarray]]]:
    """A CPU destination whose buffers hold numpy sections of random HND layers."""
    dest = tk.TorchKvDestination(cd, tokens)
    layers = []
    for layer in range(cd.layers):
        k_np, v_np = (
            raw_layer(cd, tokens, "HND", seed + 2 * layer),
            raw_layer(cd, tokens, "HND", seed + 2 * layer + 1),
        )
        s = nk.layer_sections(k_np, v_np, cd)
        dest.buffer(layer, "k")[:] = s.k_data
        dest.buffer(layer, "v")[:] = s.v_data
        dest.layer_ready(layer)
        layers.append((k_np, v_np))
    return dest, layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("heads", "block", "tokens"), [(3, 4, 12), (1, 4, 12), (3, 1, 5), (3, 4, 4)]
)
def test_destination_reads_back_the_source_bits(
    dtype: str, layout: str, heads: int, block: int, tokens: int
) -> None:
    cd = cd_of(dtype, heads=heads, block=block)
    dest, layers = filled(cd, tokens, 11)
    storage = dest._storage
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.numel()
    for layer, (k_np, v_np) in enumerate(layers):
        dest.wait_layer(layer)
        k, v = dest.layer(layer, layout)
        assert k.dtype == tk.torch_dtype(dtype) and k.device.type == "cpu"
        want_k, want_v = as_torch(k_np, dtype), as_torch(v_np, dtype)
        if layout == "NHD":
            want_k, want_v = want_k.permute(1, 0, 2), want_v.permute(1, 0, 2)
        assert same_bits(k, want_k) and same_bits(v, want_v)
        assert (lo <= k.data_ptr() < hi) == dest.view_possible(layout)  # a view, or one copy
        pk, _ = dest.paged(layer)  # always a view: [blocks, H, B, D]
        assert lo <= pk.data_ptr() < hi
        assert bytes(bits(pk).numpy().tobytes()) == bytes(nk.layer_sections(k_np, v_np, cd).k_data)


def test_destination_layer_into_out_and_the_write_path() -> None:
    cd = cd_of("bfloat16")
    dest, layers = filled(cd, 12, 21)
    out = (torch.empty(3, 16, 8, dtype=torch.bfloat16), torch.empty(3, 16, 8, dtype=torch.bfloat16))
    k, v = dest.layer(1, "HND", out=out)
    assert k is out[0] and v is out[1]
    assert same_bits(k[:, :12], as_torch(layers[1][0], "bfloat16"))
    one = tk.TorchKvDestination(cd_of("bfloat16", heads=1), 4)
    one.layer_ready(0)
    with pytest.raises(ValueError, match="no copy"):
        one.layer(0, out=out)
    # write(): per Object, K, V or KV, as KvDestination.write
    w = tk.TorchKvDestination(cd, 12)
    src = nk.layer_sections(*layers[0], cd)
    for block in range(3):
        if block == 0:
            w.write(0, "kv", block, bytes(src.k[block]) + bytes(src.v[block]))
        else:
            w.write(0, "k", block, src.k[block])
            w.write(0, "v", block, src.v[block])
    w.layer_ready(0)
    k, v = w.layer(0)
    assert same_bits(k, as_torch(layers[0][0], "bfloat16"))
    assert same_bits(v, as_torch(layers[0][1], "bfloat16"))
    with pytest.raises(SectionError, match="octets"):
        w.write(0, "k", 0, b"short")
    # q8 Data is decoded into place: the numpy KvDestination's bytes
    q = tk.TorchKvDestination(cd, 12)
    ref = nk.KvDestination(cd, 12)
    for block in range(3):
        for comp, sec in (("k", src.k[block]), ("v", src.v[block])):
            finite = np.nan_to_num(
                nk.to_float32(nk.section_array(sec, cd), cd.dtype), nan=0.0, posinf=0.0, neginf=0.0
            )
            data = nk.q8_encode(nk.from_float32(np.clip(finite, -1e6, 1e6), cd.dtype), cd)
            q.write(0, comp, block, data, Codec.Q8)
            ref.write(0, comp, block, data, Codec.Q8)
    assert bytes(q.buffer(0, "k")) == bytes(ref.buffer(0, "k"))
    assert bytes(q.buffer(0, "v")) == bytes(ref.buffer(0, "v"))
    with pytest.raises(SectionError, match="q8 Data"):
        q.write(0, "k", 0, src.k[0], Codec.Q8)
    with pytest.raises(ValueError, match="block 3"):
        w.write(0, "k", 3, src.k[0])


def test_destination_scatter_into_pages() -> None:
    cd = cd_of("float8_e4m3fn")
    dest, layers = filled(cd, 12, 31)
    for page_layout, page_size in (("NHD", 4), ("HND", 5)):
        k_want, _ = paged_from(layers[1][0], cd, page_size, page_layout, [2, 0, 3, 1], 4)
        v_want, table = paged_from(layers[1][1], cd, page_size, page_layout, [2, 0, 3, 1], 4)
        k_pages, v_pages = torch.zeros_like(k_want), torch.zeros_like(v_want)
        slots = tk.slots_from_page_table(table, 12, page_size)
        dest.scatter_into_pages(1, k_pages, v_pages, slots, page_layout=page_layout)
        assert same_bits(k_pages, k_want) and same_bits(v_pages, v_want)


def test_destination_misuse_is_a_clear_error() -> None:
    cd = cd_of("float16")
    with pytest.raises(ValueError, match="multiple of block_tokens"):
        tk.TorchKvDestination(cd, 6)
    with pytest.raises(ValueError, match="'cpu' or 'cuda"):
        tk.TorchKvDestination(cd, 8, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"cuda\.is_available"):
            tk.TorchKvDestination(cd, 8, device="cuda")
    dest = tk.TorchKvDestination(cd, 8)
    with pytest.raises(ValueError, match="call layer_ready"):
        dest.wait_layer(0)
    with pytest.raises(ValueError, match="call layer_ready"):
        dest.layer(0)
    assert not dest.is_ready(0)
    dest.layer_ready(0)
    assert dest.is_ready(0)
    with pytest.raises(ValueError, match="layer 2 is not in"):
        dest.buffer(2, "k")
    with pytest.raises(ValueError, match="component"):
        dest.buffer(0, "q")
    assert len(dest.buffer(0, "v")) == dest.layer_size == 2 * cd.section_size


def test_publisher_on_cpu() -> None:
    cd = cd_of("bfloat16")
    pub = tk.TorchLayerPublisher(cd, layout="NHD")
    sources = [(raw_layer(cd, 8, "NHD", s), raw_layer(cd, 8, "NHD", s + 1)) for s in (40, 42)]
    for layer, (k_np, v_np) in enumerate(sources):
        pub.submit(layer, as_torch(k_np, "bfloat16"), as_torch(v_np, "bfloat16"))
    with pytest.raises(ValueError, match="already pending"):
        pub.submit(1, as_torch(sources[1][0], "bfloat16"), as_torch(sources[1][1], "bfloat16"))
    ready = pub.ready()
    assert [layer for layer, _ in ready] == [0, 1] and pub.ready() == []
    for (_, s), (k_np, v_np) in zip(ready, sources, strict=True):
        assert bytes(s.k_data) == bytes(nk.layer_sections(k_np, v_np, cd, layout="NHD").k_data)
    with pytest.raises(ValueError, match="not pending"):
        pub.wait(0)


def test_import_kvcs_does_not_import_torch() -> None:
    code = (
        "import sys, kvcs, kvcs.adapters, kvcs.adapters.numpy_kv; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0


# --- a real retrieval over QUIC on 127.0.0.1 into a TorchKvDestination -----------------------

SCOPE_KEY = bytes(range(32))
WAIT = 20.0


async def _publish_and_retrieve(tmp: Any, dtype: str, layout: str, path: str) -> None:
    desc = llama_descriptor(layers=4, kv_heads=2, head_dim=64, dtype=dtype)
    cd = CompatibilityDescriptor(desc)
    tokens = 48  # 3 blocks of 16
    token_ids = list(range(1000, 1000 + tokens))
    src = [
        (
            as_torch(raw_layer(cd, tokens, layout, 100 + 2 * i), dtype),
            as_torch(raw_layer(cd, tokens, layout, 101 + 2 * i), dtype),
        )
        for i in range(cd.layers)
    ]
    tls = self_signed(tmp)
    trust = TlsConfig(cafile=tls.cafile)
    async with (
        b.serve_relay("127.0.0.1:0", tls=tls) as server,
        b.connect(server.url, tls=trust, timeout=WAIT) as producer,
    ):
        pub = await producer.publish_cache(desc, SCOPE_KEY, token_ids)
        for layer, (k, v) in enumerate(src):
            s = tk.layer_sections(k, v, cd, layout=layout)
            await pub.put_layer(layer, s.k, s.v, timeout=WAIT)
        await pub.finish()
        await pub.drained(timeout=WAIT)
        dest = tk.TorchKvDestination(cd, tokens)
        async with b.connect(server.url, tls=trust, timeout=WAIT) as consumer:
            r = consumer.retrieve_cache(
                desc,
                SCOPE_KEY,
                token_ids,
                destinations=dest.buffer if path == "buffer" else None,
                require_authenticity=False,
            )
            seen = []
            async for layer in r:
                if path == "write":  # the Objects' verified Data, one write() each
                    for block in range(dest.blocks):
                        for comp in (Component.K, Component.V):
                            data = r.consumer.data(layer, comp, block)
                            assert data is not None
                            dest.write(layer, comp, block, data)
                dest.layer_ready(layer)
                seen.append(layer)
                dest.wait_layer(layer)
                k, v = dest.layer(layer, layout)
                assert same_bits(k, src[layer][0]) and same_bits(v, src[layer][1]), layer
            result = await r.result(timeout=WAIT)
            assert result.complete
            assert sorted(seen) == list(range(cd.layers))


@pytest.mark.parametrize(
    ("dtype", "layout", "path"),
    [("bfloat16", "HND", "buffer"), ("float8_e5m2", "NHD", "buffer"), ("float16", "HND", "write")],
)
def test_retrieval_over_quic_into_a_torch_destination(
    tmp_path: Any, dtype: str, layout: str, path: str
) -> None:
    asyncio.run(asyncio.wait_for(_publish_and_retrieve(tmp_path, dtype, layout, path), 60))


# --- CUDA (skipped without a GPU) ----------------------------------------------------------------


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_layer_sections_are_the_numpy_sections(dtype: str, layout: str) -> None:
    cd = cd_of(dtype)
    k_np, v_np = raw_layer(cd, 12, layout, 51), raw_layer(cd, 12, layout, 52)
    ref = nk.layer_sections(k_np, v_np, cd, layout=layout)
    k, v = as_torch(k_np, dtype).cuda(), as_torch(v_np, dtype).cuda()
    got = tk.layer_sections(k, v, cd, layout=layout)
    assert bytes(got.k_data) == bytes(ref.k_data) and bytes(got.v_data) == bytes(ref.v_data)
    pub = tk.TorchLayerPublisher(cd, device="cuda", layout=layout, max_in_flight=1)
    pub.submit(0, k, v)
    pub.submit(1, v, k)
    s1 = pub.wait(1)
    s0 = pub.wait(0)
    assert bytes(s0.k_data) == bytes(ref.k_data) and bytes(s1.k_data) == bytes(ref.v_data)


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_destination_buffer_path(dtype: str) -> None:
    cd = cd_of(dtype, layers=3)
    dest = tk.TorchKvDestination(cd, 12, device="cuda")
    sources = []
    for layer in range(cd.layers):
        k_np, v_np = raw_layer(cd, 12, "HND", 60 + layer), raw_layer(cd, 12, "HND", 70 + layer)
        s = nk.layer_sections(k_np, v_np, cd)
        dest.buffer(layer, "k")[:] = s.k_data
        dest.buffer(layer, "v")[:] = s.v_data
        sources.append((k_np, v_np))
    for layer in (2, 0, 1):
        dest.layer_ready(layer)
        dest.wait_layer(layer)
        for layout in LAYOUTS:
            k, _ = dest.layer(layer, layout)
            assert k.device.type == "cuda" and k.dtype == tk.torch_dtype(dtype)
            want = as_torch(sources[layer][0], dtype)
            assert same_bits(k, want if layout == "HND" else want.permute(1, 0, 2))
    torch.cuda.synchronize()
    assert all(dest.is_ready(layer) for layer in range(cd.layers))


@CUDA
def test_cuda_destination_write_path_reuses_the_ring_only_after_each_copy() -> None:
    cd = cd_of("bfloat16", heads=4, dim=64, block=16, layers=4)
    tokens = 16 * 32
    dest = tk.TorchKvDestination(cd, tokens, device="cuda", ring_slots=2)
    sources = []
    for layer in range(cd.layers):
        k_np, v_np = (
            raw_layer(cd, tokens, "HND", 80 + layer),
            raw_layer(cd, tokens, "HND", 90 + layer),
        )
        s = nk.layer_sections(k_np, v_np, cd)
        for block in range(dest.blocks):
            dest.write(layer, "k", block, s.k[block])
            dest.write(layer, "v", block, s.v[block])
        dest.layer_ready(layer)
        sources.append((k_np, v_np))
    for layer, (k_np, v_np) in enumerate(sources):
        k, v = dest.layer(layer)
        assert same_bits(k, as_torch(k_np, "bfloat16")) and same_bits(v, as_torch(v_np, "bfloat16"))


@CUDA
def test_cuda_paged_gather_and_scatter() -> None:
    cd = cd_of("float16")
    k_np, v_np = raw_layer(cd, 12, "HND", 95), raw_layer(cd, 12, "HND", 96)
    k_pages, table = paged_from(k_np, cd, 4, "NHD", [2, 0, 3, 1], 4)
    v_pages, _ = paged_from(v_np, cd, 4, "NHD", [2, 0, 3, 1], 4)
    slots = tk.slots_from_page_table(table, 12, 4).cuda()
    got = tk.paged_layer_sections(k_pages.cuda(), v_pages.cuda(), slots, cd, page_layout="NHD")
    ref = nk.layer_sections(k_np, v_np, cd)
    assert bytes(got.k_data) == bytes(ref.k_data)
    dest = tk.TorchKvDestination(cd, 12, device="cuda")
    dest.buffer(0, "k")[:] = ref.k_data
    dest.buffer(0, "v")[:] = ref.v_data
    dest.layer_ready(0)
    k_out, v_out = torch.zeros_like(k_pages).cuda(), torch.zeros_like(v_pages).cuda()
    dest.scatter_into_pages(0, k_out, v_out, slots, page_layout="NHD")
    assert same_bits(k_out, k_pages) and same_bits(v_out, v_pages)
