"""Every Triton kernel against its plain-torch reference, on the same inputs.

Without a GPU they run under ``TRITON_INTERPRET=1`` (set in conftest) on the
CPU, in float32 and float16 (the interpreter cannot do bfloat16 arithmetic).
Shapes are small but cover several page sizes, ragged and multi-split
contexts, GQA ratios including a non-power-of-two group, and padding rows.
"""

from __future__ import annotations

import pytest
import torch

from trillm.engine.execution.rope import cos_sin_table
from trillm.kernels import reference, select_kernels

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON = select_kernels("triton", DEVICE)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16]


def _paged_cache(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen):
    shape = (num_pages, page_size, kv_heads, head_dim)
    return (
        torch.randn(shape, generator=gen).to(dtype).to(DEVICE),
        torch.randn(shape, generator=gen).to(dtype).to(DEVICE),
    )


def _tables(lengths: list[int], page_size: int, num_pages: int, gen) -> torch.Tensor:
    """Each sequence gets its own shuffled pages; rows padded with page 0."""
    order = torch.randperm(num_pages, generator=gen).tolist()
    width = max(-(-n // page_size) for n in lengths)
    rows = []
    for n in lengths:
        need = -(-n // page_size)
        rows.append(order[:need] + [0] * (width - need))
        order = order[need:]
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [4, 16])
def test_store_kv_writes_each_row_to_its_slot(dtype, page_size):
    gen = torch.Generator().manual_seed(page_size)
    caches = [_paged_cache(6, page_size, 2, 24, dtype, gen) for _ in range(2)]
    mine, theirs = caches[0], tuple(c.clone() for c in caches[0])
    k = torch.randn(5, 2, 24, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(5, 2, 24, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 6 * page_size - 1, 0, page_size + 1], device=DEVICE)
    TRITON.store_kv(k, v, *mine, slots)
    reference.store_kv(k, v, *theirs, slots)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    flat = mine[0].view(-1, 2, 24)
    assert torch.equal(flat[6 * page_size - 1], k[2]) and not torch.equal(mine[0], caches[1][0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "page_size,heads,kv_heads,head_dim",
    [(16, 4, 4, 32), (4, 8, 2, 16), (8, 6, 2, 24)],  # MHA, GQA 4:1, GQA 3:1 with a padded head_dim
)
def test_decode_attention_matches_reference(dtype, page_size, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * page_size)
    lengths = [1, 7, page_size, 300, 45]  # 300 spans several of the eight splits
    pages = sum(-(-n // page_size) for n in lengths) + 3
    k_cache, v_cache = _paged_cache(pages, page_size, kv_heads, head_dim, dtype, gen)
    tables = _tables(lengths, page_size, pages, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    expected = reference.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    _close(TRITON.decode_attention(q, k_cache, v_cache, tables, lens, scale), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,heads,kv_heads,head_dim", [(16, 4, 2, 32), (4, 3, 1, 16)])
def test_extend_attention_matches_reference(dtype, page_size, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(page_size + heads)
    # (cached prefix, new tokens): a fresh prompt, a chunk after a prefix, a one-token step, an empty slot
    shapes = [(0, 37), (50, 20), (29, 1), (5, 0)]
    lengths = [p + n for p, n in shapes]
    pages = sum(-(-n // page_size) for n in lengths) + 2
    k_cache, v_cache = _paged_cache(pages, page_size, kv_heads, head_dim, dtype, gen)
    tables = _tables(lengths, page_size, pages, gen)
    starts = torch.tensor(
        [0] + torch.tensor([n for _, n in shapes]).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE
    )
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    expected = reference.extend_attention(q, k_cache, v_cache, tables, starts, lens, scale)
    _close(TRITON.extend_attention(q, k_cache, v_cache, tables, starts, lens, scale), expected, dtype)


def test_extend_of_one_token_equals_decode():
    """The two attention references agree where their contracts overlap."""
    gen = torch.Generator().manual_seed(3)
    lengths = [9, 33]
    k_cache, v_cache = _paged_cache(8, 8, 2, 16, torch.float32, gen)
    tables = _tables(lengths, 8, 8, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    decode = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    _close(reference.extend_attention(q, k_cache, v_cache, tables, starts, lens, 0.25), decode, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(int(with_residual))
    x = torch.randn(7, 96, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(7, 96, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + torch.randn(96, generator=gen) / 4).to(dtype).to(DEVICE)
    out, summed = TRITON.add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_summed = reference.add_rms_norm(x, residual, weight, 1e-5)
    _close(out, expected_out, dtype)
    assert torch.equal(summed, expected_summed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    cos, sin = cos_sin_table(32, 10000.0, None, 512)
    cos, sin = cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)
    qkv = torch.randn(6, (4 + 2 + 2) * 32, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, : 4 * 32].view(6, 4, 32)  # strided views, as the model passes them
    k = qkv[:, 4 * 32 : 6 * 32].view(6, 2, 32)
    positions = torch.tensor([0, 1, 17, 300, 511, 2], device=DEVICE)
    for mine, theirs in zip(TRITON.rotary(q, k, positions, cos, sin), reference.rotary(q, k, positions, cos, sin)):
        _close(mine, theirs, dtype)


def _sampling_rows(vocab: int, gen: torch.Generator):
    """Rows exercising each parameter alone and together, ties and banned tokens."""
    logits = torch.randn(9, vocab, generator=gen) * 3
    logits[4, 100:110] = logits[4].max() + 1  # a ten-way tie at the top
    logits[5, ::3] = float("-inf")  # banned tokens
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.0, 1.3, 0.9, 1.0, 2.0])
    top_k = torch.tensor([-1, -1, 5, -1, 3, 50, 40, -1, 1], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 0.5, 0.9, 0.3, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.2, 0.0])
    return logits, temperature, top_k, top_p, min_p


@pytest.mark.parametrize("vocab", [1000, 2500])
def test_sampling_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    args = [a.to(DEVICE) for a in _sampling_rows(vocab, gen)]
    for _ in range(2):
        uniform = torch.rand(args[0].shape[0], generator=gen).to(DEVICE)
        mine = TRITON.sample_top_k_top_p(*args, uniform)
        assert mine.tolist() == reference.sample_top_k_top_p(*args, uniform).tolist()


def test_reference_sampling_keeps_only_allowed_tokens():
    """The reference's filters themselves: each row draws only from its allowed set."""
    gen = torch.Generator().manual_seed(11)
    logits, temperature, top_k, top_p, min_p = _sampling_rows(300, gen)
    drawn: list[set[int]] = [set() for _ in range(logits.shape[0])]
    for _ in range(200):
        tokens = reference.sample_top_k_top_p(logits, temperature, top_k, top_p, min_p, torch.rand(9, generator=gen))
        for row, token in enumerate(tokens.tolist()):
            drawn[row].add(token)
    assert drawn[0] == {int(logits[0].argmax())}
    assert drawn[8] == {int(logits[8].argmax())}  # top_k = 1
    assert drawn[2] <= set(logits[2].topk(5).indices.tolist()) and len(drawn[2]) > 1
    assert drawn[4] <= set(range(100, 110)) and len(drawn[4]) > 3  # the tie stays whole
    assert all(token % 3 for token in drawn[5])  # banned tokens never drawn
    probs = torch.softmax(logits[3], -1)
    ordered = probs.sort(descending=True)
    nucleus = ordered.indices[: int((ordered.values.cumsum(0) < 0.8).sum()) + 1].tolist()
    assert drawn[3] <= set(nucleus) and len(drawn[3]) > 3
    probs = torch.softmax(logits[7], -1)
    keep = (probs >= 0.2 * probs.max()).nonzero().flatten().tolist()
    assert drawn[7] <= set(keep) and len(drawn[7]) > 1


def test_select_kernels():
    """A set is named; ``auto`` is the engine's backend registry's one rule, not a second one here."""
    assert select_kernels("reference", DEVICE).name == "reference"
    for unknown in ("auto", "fast"):
        with pytest.raises(ValueError):
            select_kernels(unknown, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_matches_reference_and_each_expert(dtype):
    """A mixture's (token, expert) pairs sorted by expert and padded per expert: one launch gives
    each pair's row of x times its expert's matrix (and its routing weight), as the loop does."""
    from trillm.kernels.moe import grouped_matmul

    torch.manual_seed(0)
    tokens, k, experts, K, N = 9, 2, 5, 64, 40
    chosen = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    chosen[:, 0] = 1  # one expert with more than a block of pairs... and expert 4 maybe with none
    rows, blocks = reference.align(chosen, experts, 8)
    assert sorted(r for r in rows.tolist() if r >= 0) == list(range(tokens * k))
    assert blocks.numel() * 8 == rows.numel()
    x = torch.randn(tokens, K).to(dtype)
    w = torch.randn(experts, K, N).to(dtype)
    scale = torch.rand(tokens * k)
    want = torch.stack([(x[i // k].float() @ w[e].float()) * scale[i] for i, e in enumerate(chosen.flatten().tolist())])
    ref = reference.grouped_matmul(x, w, rows, blocks, tokens * k, a_row_div=k, scale=scale, block_m=8)
    got = grouped_matmul(x, w, rows, blocks, tokens * k, a_row_div=k, scale=scale, block_m=8)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ref.float(), want, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * 10, rtol=tol)
