"""The C decode-attention kernel matches the plain-torch reference on paged, ragged, GQA inputs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from trillm.kernels import cpu_build, cpu_decode, reference

BUILDS = {"portable": ("-DTRILLM_PORTABLE",), "avx2": ("-march=haswell",)}


@pytest.fixture(params=["native", "avx2", "portable"])
def variant(request, monkeypatch):
    """The library as built for this CPU, for an AVX2 + FMA + F16C one (8 lanes a load and store;
    this CPU runs that code too), or its plain-C fallback (built with -DTRILLM_PORTABLE), which is
    what machines with neither run."""
    if request.param != "native":
        lib = ctypes.CDLL(str(cpu_build._build("cpu_decode", ("-fno-math-errno", *BUILDS[request.param]))))
        cpu_decode._KERNEL.declare(lib)
        monkeypatch.setattr(cpu_decode, "_library", lambda: lib)
    return request.param


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def kv_dtype(request) -> torch.dtype:
    """The cache's form (``--kv-cache-dtype``), widened as the kernel loads it."""
    return request.param


def paged_inputs(
    lens: list[int], heads: int, kv_heads: int, dim: int, page_size: int, seed: int = 0, kv_dtype=torch.float32
):
    """Random q and cache with each sequence's pages scattered through a shuffled pool; the cache in
    ``kv_dtype``, and a reference reads it widened back to float32 (the kernel must agree exactly so)."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens) + 1  # one spare column, never read
    num_pages = len(lens) * max_pages + 3
    q = torch.randn(len(lens), heads, dim, generator=gen)
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    pool = torch.randperm(num_pages, generator=gen)[: len(lens) * max_pages]
    tables = pool.view(len(lens), max_pages).to(torch.int32)
    for row, n in zip(tables, lens):
        row[-(-n // page_size) :] = -1  # padding past a sequence's pages is never read
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def test_available():
    assert cpu_decode.available()


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim",  # Gemma 3's 256 (the vector version in parts) and 144 (9 vectors: parts of 6 and 3)
    [(4, 4, 32), (8, 2, 32), (9, 3, 64), (6, 2, 128), (4, 2, 20), (4, 1, 256), (8, 2, 144), (2, 1, 256)],
)
def test_matches_reference(variant: str, kv_dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int):
    lens = [1, 7, page_size, page_size + 1, 300, 1, 129]
    q, k_cache, v_cache, tables, context_lens = paged_inputs(lens, heads, kv_heads, dim, page_size, 0, kv_dtype)
    scale = dim**-0.5
    want = reference.decode_attention(q, k_cache.float(), v_cache.float(), tables, context_lens, scale)
    for threads in (1, 2, 3):
        got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, context_lens, scale, num_threads=threads)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,page_size",
    [(9, 3, 64, 5), (16, 2, 16, 16), (9, 1, 16, 16), (16, 8, 32, 3), (6, 3, 48, 7)],  # G 8, G 9, 8 kv heads, D 48
)
@pytest.mark.parametrize("lens", [[35], [2000], [16, 17], [15, 33, 64, 31, 48, 1000, 2]])
def test_more_shapes_and_task_splits(
    variant: str, kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int, page_size: int, lens: list[int]
):
    """Pages that do not divide 16 tokens, fewer sequences than threads (a task per kv head
    then), more heads per kv head than the vector version takes, and long contexts."""
    q, k_cache, v_cache, tables, context_lens = paged_inputs(lens, heads, kv_heads, dim, page_size, len(lens), kv_dtype)
    scale = dim**-0.5
    want = reference.decode_attention(q, k_cache.float(), v_cache.float(), tables, context_lens, scale)
    for threads in (1, 2, 3):
        got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, context_lens, scale, num_threads=threads)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256), (8, 2, 32)])
def test_rows_reading_the_same_pages_give_their_lone_results(variant: str, kv_dtype: torch.dtype, heads, kv_heads, dim):
    """A verification's rows of one sequence (the same table, one more token each) are attended as a
    group, each chunk of the cache read once (and a 16-bit one widened once) for all of them: each
    row must still be what it is alone, bit for bit, so that speculation keeps greedy output. Rows
    of other sequences between them, a sequence sharing only a prefix's pages, 18 rows (past a
    group's 16) and an empty row are mixed in."""
    page = 16
    q, k_cache, v_cache, tables, _ = paged_inputs([300, 40, 300], heads, kv_heads, dim, page, 5, kv_dtype)
    forked = tables[0].clone()
    forked[-(-281 // page) - 1] = tables[2][0]  # the same pages as sequence 0 but its last
    rows = [(0, n) for n in range(283, 292)] + [(1, 40), (1, 0)] + [(0, n) for n in range(270, 288)] + [(2, 281)]
    table = torch.stack([forked if i == 2 else tables[i] for i, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    qs = torch.randn(len(rows), heads, dim, generator=torch.Generator().manual_seed(9))
    scale = dim**-0.5
    for threads in (1, 2, 3):
        together = cpu_decode.decode_attention(qs, k_cache, v_cache, table, lens, scale, num_threads=threads)
        for i in range(len(rows)):
            alone = cpu_decode.decode_attention(
                qs[i : i + 1], k_cache, v_cache, table[i : i + 1], lens[i : i + 1], scale
            )
            assert torch.equal(together[i], alone[0]), (threads, i)
    want = reference.decode_attention(qs, k_cache.float(), v_cache.float(), table, lens, scale)
    torch.testing.assert_close(together, want, atol=1e-5, rtol=1e-5)


def test_empty_context_gives_zeros_like_the_reference():
    q, k_cache, v_cache, tables, context_lens = paged_inputs([3, 0, 9], 4, 2, 16, 4, seed=3)
    want = reference.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_int64_tables_and_strided_q():
    """The engine passes int64 metadata and q sliced out of a fused qkv projection."""
    q, k_cache, v_cache, tables, context_lens = paged_inputs([5, 40, 33], 8, 2, 16, 4, seed=1)
    qkv = torch.randn(3, 8 + 2 * 2, 16)
    qkv[:, :8] = q
    strided = qkv[:, :8]
    assert not strided.is_contiguous()
    want = reference.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.25)
    got = cpu_decode.decode_attention(strided, k_cache, v_cache, tables.long(), context_lens.long(), 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [8, 32])
def test_large_scores_are_stable(variant: str, dim: int):
    """Scores far above exp's range still softmax correctly (the max is subtracted), and
    weights far under the largest one are negligible rather than denormal trouble."""
    q, k_cache, v_cache, tables, context_lens = paged_inputs([50, 3, 40], 4, 2, dim, 16, seed=2)
    q = q * 100
    want = reference.decode_attention(q, k_cache, v_cache, tables, context_lens, 1.0)
    got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, context_lens, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rejects_other_dtypes_and_bad_tables():
    q, k_cache, v_cache, tables, context_lens = paged_inputs([10], 4, 4, 8, 4)
    with pytest.raises(ValueError):
        cpu_decode.decode_attention(q.half(), k_cache.half(), v_cache.half(), tables, context_lens, 1.0)
    with pytest.raises(ValueError):
        cpu_decode.decode_attention(q.half(), k_cache, v_cache, tables, context_lens, 1.0)
    with pytest.raises(ValueError, match="float16 or bfloat16 cache"):  # a float64 cache, or K and V unlike
        cpu_decode.decode_attention(q, k_cache.double(), v_cache.double(), tables, context_lens, 1.0)
    with pytest.raises(ValueError, match="float16 or bfloat16 cache"):
        cpu_decode.decode_attention(q, k_cache.bfloat16(), v_cache, tables, context_lens, 1.0)
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError):
        cpu_decode.decode_attention(q, k_cache, v_cache, bad, context_lens, 1.0)
    with pytest.raises(ValueError):  # longer than the table can hold
        cpu_decode.decode_attention(q, k_cache, v_cache, tables, context_lens * 100, 1.0)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (6, 2, 128), (4, 2, 20)])
def test_soft_capped_scores_match_the_reference(
    variant: str, kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int
):
    """Gemma 2's cap (each score s as cap * tanh(s / cap) before the softmax), windows or not, sinks or not."""
    q, k_cache, v_cache, tables, lens = paged_inputs([1, 9, 40, 300], heads, kv_heads, dim, 16, 3, kv_dtype)
    q = q * 3  # scores of several units: the cap bends them
    sinks = torch.randn(heads)
    wide = k_cache.float(), v_cache.float()
    for window, sink in ((0, None), (7, None), (0, sinks), (7, sinks)):
        want = reference.decode_attention(q, *wide, tables, lens, dim**-0.5, window, sink, 1.5)
        got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, window, sink, 1.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        plain = reference.decode_attention(q, *wide, tables, lens, dim**-0.5, window, sink)
        assert not torch.allclose(plain, want, atol=1e-3)  # the cap changes the result
    with pytest.raises(ValueError):
        cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, softcap=float("nan"))


def _awkward_values() -> torch.Tensor:
    """Values where conversions go wrong: float16's subnormals and its least normal, ties of both
    16-bit forms, its range's end and past it, infinities, NaN, signed zeros, and random scales."""
    gen = torch.Generator().manual_seed(5)
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 2**-24, 3 * 2**-25, 2**-14 - 2**-25])
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 7e4, 1e30, float("inf"), float("nan"), 0.0, -0.0, 6.1e-5, 5.96e-8])
    spread = torch.randn(4000, generator=gen) * torch.logspace(-9, 6, 4000)
    x = torch.cat([ties, edges, spread])
    return torch.cat([x, -x])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_stores_round_as_torch_does_and_float16_saturates(variant: str, dtype: torch.dtype):
    """The fused loop's stores (the portable build: integer arithmetic, no F16C) give the bits the
    Python path's stores give: torch's rounding to nearest even, float16 clamped to +-65504 first."""
    x = _awkward_values()
    want = (x.clamp(-65504, 65504) if dtype is torch.float16 else x).to(dtype)
    got = cpu_decode.stored(x, dtype)
    same = (got.view(torch.int16) == want.view(torch.int16)) if dtype is not torch.float32 else got == want
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert bool(same[~nan].all()), x[~nan][~same[~nan]][:8]
    if dtype is torch.float16:
        assert got.float()[x == float("inf")].eq(65504).all() and got.float()[x == 7e4].eq(65504).all()
