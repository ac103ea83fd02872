"""Prefill attention on AMX tiles over the paged cache (``kernels/flash_prefill``, ``cpu_flash.c``).

Checked against attention in float64 on the same float32 inputs: the kernel rounds Q, K, V and the
softmax weights to bfloat16 (as torch's bfloat16 flash kernel does), so each output is within a
bound of that rounding; causal rows at the right positions when part of the context was cached
before, pages in any order, grouped heads, sliding windows and attention sinks; and the CPU
backend's attention takes it for bfloat16 prefill spans and agrees with its torch path. Where the
CPU has no AMX tiles, ``handles`` is False and the torch path stays.
"""

from __future__ import annotations

import pytest
import torch

from trillm.engine.execution.backends.cpu_attention import CpuMetadata, PrefillSpan, paged_attention
from trillm.kernels import amx_tiles, flash_prefill

needs_tiles = pytest.mark.skipif(not flash_prefill.available(), reason="this CPU has no AMX-BF16 tiles")


def reference(q, k_cache, v_cache, pages, length, scale, window, sinks):
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[pages].reshape(-1, kv_heads, head_dim)[:length].double()
    v = v_cache[pages].reshape(-1, kv_heads, head_dim)[:length].double()
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    position = torch.arange(length - n, length)[:, None]
    key = torch.arange(length)[None]
    seen = key <= position
    if window:
        seen &= key > position - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(heads, 1, 1).expand(heads, n, 1)], -1)
        weights = torch.softmax(scores, -1)[..., :-1]
    else:
        weights = torch.softmax(scores, -1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


def test_it_runs_exactly_where_the_tiles_do():
    assert flash_prefill.available() == (amx_tiles.available() and flash_prefill._KERNEL.available())
    assert not flash_prefill.handles(64, 8, 2, 30.0, torch.float32)  # a soft cap: the torch path
    assert not flash_prefill.handles(80, 8, 2, 0.0, torch.float32)  # a head dim not a multiple of 32
    assert not flash_prefill.handles(64, 8, 2, 0.0, torch.float64)  # a cache no kernel reads
    for cache in (torch.float32, torch.float16, torch.bfloat16):
        assert flash_prefill.handles(64, 8, 2, 0.0, cache) == flash_prefill.available()


CASES = [  # rows, context, heads, kv heads, head dim, window, sinks
    (200, 200, 9, 3, 64, 0, False),  # a whole prompt, SmolLM2's heads
    (37, 100, 4, 2, 128, 0, False),  # a later chunk: 63 tokens cached before it
    (300, 700, 8, 8, 32, 64, True),  # a sliding window and gpt-oss's sinks
    (1, 50, 2, 1, 256, 0, False),  # one row, Gemma 3's head dim
    (130, 130, 6, 2, 64, 100, False),  # a window shorter than the prompt
]


@needs_tiles
@pytest.mark.parametrize("rows,length,heads,kv_heads,head_dim,window,with_sinks", CASES)
def test_each_row_attends_what_it_sees_within_bfloat16_rounding(
    rows, length, heads, kv_heads, head_dim, window, with_sinks
):
    torch.manual_seed(rows + length)
    page_size, used = 16, -(-length // 16)
    k_cache = torch.randn(used + 5, page_size, kv_heads, head_dim)
    v_cache = torch.randn(used + 5, page_size, kv_heads, head_dim)
    pages = torch.randperm(used + 5)[:used]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)  # q: a view into the fused projection
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    sinks = torch.randn(heads) if with_sinks else None
    out = torch.full((rows, heads, head_dim), float("nan"))
    scale = head_dim**-0.5
    flash_prefill.attend(q, k_cache, v_cache, pages, length, scale, window, sinks, out)
    exact = reference(q, k_cache, v_cache, pages, length, scale, window, sinks)
    # bfloat16 Q, K (scores off by ~2^-8 of |q||k| scale), P and V: a few hundredths at most on
    # unit-variance values, far less on average
    error = (out.double() - exact).abs()
    assert error.max() < 0.03 and error.mean() < 1.5e-3
    # a bfloat16 cache (--kv-cache-dtype) holds what the kernel rounds a float32 one to: the same output;
    # a float16 one gives what its values widened to a float32 cache give
    for half, widened in ((torch.bfloat16, out), (torch.float16, None)):
        k16, v16 = k_cache.to(half), v_cache.to(half)
        if widened is None:
            widened = torch.full_like(out, float("nan"))
            flash_prefill.attend(q, k16.float(), v16.float(), pages, length, scale, window, sinks, widened)
        got = torch.full_like(out, float("nan"))
        flash_prefill.attend(q, k16, v16, pages, length, scale, window, sinks, got)
        assert torch.equal(got, widened)


@needs_tiles
def test_the_backends_bfloat16_prefill_takes_it_and_agrees_with_the_torch_path(monkeypatch):
    """Two spans in one step (one with 40 tokens cached before it): the flash kernel's output and
    the torch path's (gather, pad, bfloat16 SDPA) agree to bfloat16 rounding."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, page_size = 6, 2, 64, 16
    k_cache = torch.zeros(20, page_size, kv_heads, head_dim)
    v_cache = torch.zeros(20, page_size, kv_heads, head_dim)
    first, second = torch.tensor([4, 2, 9]), torch.tensor([7, 1, 12, 3, 15, 0])  # 48 and 96 slots
    cached = 40
    k_cache.view(-1, kv_heads, head_dim)[(second[:3, None] * page_size + torch.arange(16)).flatten()[:cached]] = (
        torch.randn(cached, kv_heads, head_dim)
    )
    v_cache.view(-1, kv_heads, head_dim)[(second[:3, None] * page_size + torch.arange(16)).flatten()[:cached]] = (
        torch.randn(cached, kv_heads, head_dim)
    )
    n1, n2 = 45, 50
    slots1 = (first[:, None] * page_size + torch.arange(16)).flatten()[:n1]
    slots2 = (second[:, None] * page_size + torch.arange(16)).flatten()[cached : cached + n2]
    pos2 = torch.arange(cached, cached + n2)
    mask2 = torch.arange(cached + n2)[None] <= pos2[:, None]
    meta = CpuMetadata(
        slot_mapping=torch.cat([slots1, slots2]),
        decodes=(),
        prefills=(PrefillSpan(0, n1, first, n1, None), PrefillSpan(n1, n1 + n2, second, cached + n2, mask2)),
    )
    q = torch.randn(n1 + n2, heads, head_dim)
    k = torch.randn(n1 + n2, kv_heads, head_dim)
    v = torch.randn(n1 + n2, kv_heads, head_dim)
    caches = (k_cache.clone(), v_cache.clone())
    flash = paged_attention(q, k, v, *caches, meta, 0.125, prefill_dtype=torch.bfloat16)
    monkeypatch.setattr(flash_prefill, "handles", lambda *_: False)
    torch_path = paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, prefill_dtype=torch.bfloat16)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)  # both stored the step's K/V
    assert (flash - torch_path).abs().max() < 0.03 and (flash - torch_path).abs().mean() < 2e-3


@needs_tiles
def test_many_spans_in_one_call_are_each_span_alone():
    """Every span of a step in one call (one parallel region, the spans' blocks of rows handed out in
    turn) gives each span's rows bit for bit what that span alone gives: short and long spans, some
    with tokens cached before them, pages shared out of one pool."""
    torch.manual_seed(11)
    heads, kv_heads, head_dim, page_size = 6, 2, 64, 16
    shapes = [(3, 3), (40, 100), (128, 128), (1, 77), (70, 70), (33, 200)]  # (rows, context)
    pool = torch.randperm(64)
    k_cache = torch.randn(64, page_size, kv_heads, head_dim).half()
    v_cache = torch.randn(64, page_size, kv_heads, head_dim).half()
    spans, at, start = [], 0, 0
    for rows, length in shapes:
        used = -(-length // page_size)
        spans.append((start, start + rows, length, pool[at : at + used]))
        at, start = at + used, start + rows
    q = torch.randn(start, heads, head_dim)
    together = torch.full((start, heads, head_dim), float("nan"))
    table, pages = flash_prefill.span_table(spans)
    flash_prefill.attend_spans(q, k_cache, v_cache, table, pages, head_dim**-0.5, 0, None, together)
    for a, b, length, span_pages in spans:
        alone = torch.full((b - a, heads, head_dim), float("nan"))
        flash_prefill.attend(q[a:b], k_cache, v_cache, span_pages, length, head_dim**-0.5, 0, None, alone)
        assert torch.equal(together[a:b], alone)
