"""The CPU backend's metadata and its attention over the paged KV cache, in plain torch.

The cache of one layer is [num_pages, page_size, kv_heads, head_dim]; a token
at position p of a sequence lives in slot ``pages[p // page_size] * page_size
+ p % page_size``. Contexts are gathered a whole page at a time (contiguous
blocks are far cheaper to gather than single rows), then masked to their
length. Decode rows are attended together with a padded page table; prefill
chunks one sequence at a time with a causal mask shifted by what is cached.
In float32, decode rows go instead to a small C kernel (``kernels/cpu_decode.c``)
that reads the pages in place: no gather, each K/V row read once per kv head
(2.3-3x faster than gather + SDPA, measured). The cache may be float16 or bfloat16 under
float32 activations (``--kv-cache-dtype``): K/V are rounded as they are stored and widened as read.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trillm.kernels import cpu_decode, cpu_ops, flash_prefill


@attrs.frozen
class PrefillSpan:
    """One sequence's chunk: rows [start, end) of the batch, attending its first ``context_len`` tokens."""

    start: int
    end: int
    context_pages: torch.Tensor  # [P] page indices covering the context
    context_len: int
    causal_mask: torch.Tensor | None  # [n, context_len] bool; None: plain causal (nothing cached before)

    def window_mask(self, window: int) -> torch.Tensor | None:
        """The causal mask less the keys before each row's last ``window`` positions (0, or a
        window wider than the context: the causal mask as it is)."""
        if window <= 0 or self.context_len <= window:
            return self.causal_mask
        rows = torch.arange(self.context_len - (self.end - self.start), self.context_len).unsqueeze(1)
        keys = torch.arange(self.context_len).unsqueeze(0)
        return (keys <= rows) & (keys > rows - window)


@attrs.frozen
class DecodeGroup:
    """Single-token decode rows of similar context length, attended together."""

    rows: torch.Tensor  # [Bd] batch rows
    pages: torch.Tensor  # [Bd, Pmax] page table per row (padded with page 0)
    mask: torch.Tensor  # [Bd, 1, 1, Pmax * page_size] True where a slot holds context
    context_lens: torch.Tensor  # [Bd] int64

    def window_mask(self, window: int) -> torch.Tensor:
        """``mask`` less each row's slots before its last ``window`` tokens (0: the whole mask)."""
        if window <= 0:
            return self.mask
        slots = torch.arange(self.mask.shape[-1])
        return self.mask & (slots >= (self.context_lens - window).view(-1, 1, 1, 1))


@attrs.frozen
class DecodeRows:
    """All single-token decode rows, for the C kernel that reads pages in place."""

    rows: torch.Tensor | None  # [Bd] batch rows; None: every row, in order (a decode-only step)
    block_tables: torch.Tensor  # [Bd, Pmax] int32
    context_lens: torch.Tensor  # [Bd] int32
    # a decode-only step carrying proposed tokens: its sequences, by which its kernels are picked
    # (each row then computed as its sequence's plain step computes it); else None
    kernel_rows: int | None = None


@attrs.frozen
class CpuMetadata:
    """How the rows of one flattened batch map onto the paged cache. Decode rows come
    either as ``decode_rows`` (the C kernel) or as ``decodes`` (gather + SDPA)."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSpan, ...]
    decode_rows: DecodeRows | None = None
    # the prefill spans as the AMX flash kernel reads them (``flash_prefill.span_table``), made once a step
    span_table: tuple[torch.Tensor, torch.Tensor] | None = attrs.field(
        default=attrs.Factory(lambda self: _span_table(self.prefills), takes_self=True), eq=False
    )

    def to(self, device: torch.device) -> CpuMetadata:
        """Already where it is read: the CPU backend runs on the CPU."""
        return self


def _span_table(prefills: tuple[PrefillSpan, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not prefills or not flash_prefill.available():
        return None
    return flash_prefill.span_table([(p.start, p.end, p.context_len, p.context_pages) for p in prefills])


F16_MAX = 65504.0  # float16's largest: a float16 cache saturates there, as the C loop's stores do


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` holds it."""
    if dtype is torch.float16 and x.dtype is not torch.float16:
        return x.clamp(-F16_MAX, F16_MAX).to(dtype)
    return x.to(dtype)


def _gather(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, P] or [P] pages -> [B, P * page_size, KVH, D] or [P * page_size, KVH, D], in ``dtype``
    (the activations', where a 16-bit cache serves float32 ones).

    ``index_select`` over whole pages copies contiguous blocks; it is several
    times faster on CPUs than advanced indexing with the same result.
    """
    blocks = cache.index_select(0, pages.flatten())  # [B * P, page_size, KVH, D]
    return blocks.view(*pages.shape[:-1], -1, *cache.shape[2:]).to(dtype)


def _attention(
    q: torch.Tensor,  # [B, H, n, D]
    k: torch.Tensor,  # [B, KVH, L, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # True where a key is seen; None: causal with nothing cached before
    scale: float,
    gqa: bool,
    sinks: torch.Tensor | None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """SDPA; with sinks or a soft cap (which it has no room for), the same softmax written out:
    one more logit per head in each denominator, each score s capped as softcap * tanh(s / softcap)."""
    if sinks is None and not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, n, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, KVH, D]
    v_cache: torch.Tensor,
    meta: CpuMetadata,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    prefill_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend every row to its context (with ``window``
    > 0, each row only its last ``window`` tokens: a sliding-window layer; ``sinks`` [H], gpt-oss's
    logit per head in each softmax's denominator; ``softcap`` > 0, Gemma 2's cap of the scores;
    ``prefill_dtype``: the prefill spans attend in it, bfloat16 for AMX tiles, the cache unchanged;
    ``out``: a [T, H, D] tensor to write into, else a fresh one)."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    if not cpu_ops.kv_scatter(k, v, meta.slot_mapping, k_cache, v_cache):
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, _stored(k, k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, _stored(v, v_cache.dtype))
    gqa = q.shape[1] != kv_heads
    d = meta.decode_rows
    if d is not None and d.rows is None:  # a decode-only step: no row shuffling (1/3 of it at one row)
        return cpu_decode.decode_attention(
            q, k_cache, v_cache, d.block_tables, d.context_lens, scale, window, sinks, softcap
        )
    out = torch.empty_like(q) if out is None else out

    if d is not None and d.rows is not None:
        od = cpu_decode.decode_attention(
            q.index_select(0, d.rows), k_cache, v_cache, d.block_tables, d.context_lens, scale, window, sinks, softcap
        )
        out.index_copy_(0, d.rows, od)

    for group in meta.decodes:
        qd = q.index_select(0, group.rows).unsqueeze(2)  # [Bd, H, 1, D]
        kd = _gather(k_cache, group.pages, q.dtype).transpose(1, 2)  # [Bd, KVH, L, D]
        vd = _gather(v_cache, group.pages, q.dtype).transpose(1, 2)
        od = _attention(qd, kd, vd, group.window_mask(window), scale, gqa, sinks, softcap)
        out.index_copy_(0, group.rows, od.squeeze(2))

    if (  # every span at once on AMX tiles, reading the pages in place (a table only where the kernel runs)
        meta.span_table is not None
        and prefill_dtype is torch.bfloat16
        and flash_prefill.handles(q.shape[2], q.shape[1], kv_heads, softcap, k_cache.dtype)
    ):
        flash_prefill.attend_spans(q, k_cache, v_cache, *meta.span_table, scale, window, sinks, out)
        return out
    for span in meta.prefills:
        if prefill_dtype is not None:
            op = _padded_attention(q, k_cache, v_cache, span, window, prefill_dtype, scale, gqa, sinks, softcap)
            out[span.start : span.end] = op
            continue
        qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kp = _gather(k_cache, span.context_pages, q.dtype)[: span.context_len].transpose(0, 1).unsqueeze(0)
        vp = _gather(v_cache, span.context_pages, q.dtype)[: span.context_len].transpose(0, 1).unsqueeze(0)
        op = _attention(qp, kp, vp, span.window_mask(window), scale, gqa, sinks, softcap)
        out[span.start : span.end] = op.squeeze(0).transpose(0, 1)
    return out


PAD = 64  # a low-precision prefill's keys are padded to a multiple of this, its rows to a power of two (at least this)


def _padded_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    window: int,
    dtype: torch.dtype,
    scale: float,
    gqa: bool,
    sinks: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    """One prefill span attended in ``dtype`` (bfloat16: AMX tiles), its rows and keys padded (``PAD``)
    and masked: torch's flash kernel builds and keeps a oneDNN kernel for each leftover size, and
    unpadded, every new prompt length added some (resident memory rising for many rounds of the
    memory soak). Returns [n, H, D] in q's dtype."""
    n, length = span.end - span.start, span.context_len
    mask = span.window_mask(window)
    rows = max(PAD, 1 << (n - 1).bit_length())
    # Nothing cached and no window: rows and keys padded alike keep the plain causal mask, which the
    # flash kernel skips whole blocks under (half the work of an explicit mask at 2,000 tokens).
    keys = rows if mask is None else -(-length // PAD) * PAD
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    qp = torch.zeros(1, heads, rows, head_dim, dtype=dtype)
    qp[0, :, :n] = q[span.start : span.end].transpose(0, 1)
    kv = []
    for cache in (k_cache, v_cache):
        gathered = _gather(cache, span.context_pages, dtype)[:length]
        padded = torch.zeros(1, kv_heads, keys, head_dim, dtype=dtype)
        padded[0, :, :length] = gathered.transpose(0, 1)
        kv.append(padded)
    full = None
    if mask is not None:
        full = torch.zeros(rows, keys, dtype=torch.bool)
        full[:n, :length] = mask
        full[n:, 0] = True  # a padding row sees one key: no row of the softmax is all -inf
    op = _attention(qp, kv[0], kv[1], full, scale, gqa, sinks, softcap)
    return op[0, :, :n].transpose(0, 1).to(q.dtype)
