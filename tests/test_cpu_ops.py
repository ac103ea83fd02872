"""The C elementwise ops match their torch equivalents, including in-place rotary on a fused QKV view."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trillm.engine.execution.rope import apply_rotary, cos_sin_table
from trillm.kernels import cpu_ops

ROWS = (1, 7, 64)


def gathered_tables(T: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows at random positions, as the model gathers them."""
    cos, sin = cos_sin_table(D, 10000.0, None, 4096)
    positions = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(seed))
    return cos[positions], sin[positions]


def test_available():
    assert cpu_ops.available()


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("N", [576, 64, 100, 128])
def test_rms_norm(T: int, N: int):
    gen = torch.Generator().manual_seed(T * 1000 + N)
    x = torch.randn(T, N, generator=gen) * 3
    weight = torch.randn(N, generator=gen)
    want = F.rms_norm(x, (N,), weight, 1e-5)
    for threads in (1, 2):
        torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5, num_threads=threads), want, atol=1e-5, rtol=1e-5)


def test_rms_norm_strided_and_large():
    """Rows of a wider matrix, columns not contiguous (copied), and enough rows to run in parallel."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(300, 700, generator=gen)
    weight = torch.randn(576, generator=gen)
    for x in (wide[:, :576], wide[:, 1:577], wide.t().contiguous().t()[:, :576]):
        want = F.rms_norm(x, (576,), weight, 1e-6)
        torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6), want, atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 3, 576, generator=gen)  # leading dims, as F.rms_norm takes
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (576,), weight, 1e-6))


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("heads,D", [(12, 64), (4, 128), (3, 100)])
def test_rotary_contiguous(T: int, heads: int, D: int):
    gen = torch.Generator().manual_seed(T + D)
    x = torch.randn(T, heads, D, generator=gen)
    cos, sin = gathered_tables(T, D, seed=T)
    want = apply_rotary(x, cos, sin)
    for threads in (1, 2):
        got = x.clone()
        assert cpu_ops.rotary_(got, cos, sin, num_threads=threads) is None
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T", (*ROWS, 300))
@pytest.mark.parametrize("heads,kv_heads,D", [(9, 3, 64), (8, 2, 128)])
def test_rotary_in_place_on_fused_qkv(T: int, heads: int, kv_heads: int, D: int):
    """Q and K rotated in one call through a view of the fused projection; V untouched."""
    gen = torch.Generator().manual_seed(T)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=gen)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * D].view(T, heads + kv_heads, D)
    assert T == 1 or qk.stride() == ((heads + 2 * kv_heads) * D, D, 1)
    cos, sin = gathered_tables(T, D, seed=T + 1)
    want = apply_rotary(qk.clone(), cos, sin)
    cpu_ops.rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * D :], before[:, (heads + kv_heads) * D :])
    # Q and K separately, as views with different offsets, give the same
    separate = before.clone()
    q = separate[:, : heads * D].view(T, heads, D)
    k = separate[:, heads * D : (heads + kv_heads) * D].view(T, kv_heads, D)
    cpu_ops.rotary_(q, cos, sin)
    cpu_ops.rotary_(k, cos, sin)
    assert torch.equal(separate, qkv)


@pytest.mark.parametrize("T", (*ROWS, 300))
@pytest.mark.parametrize("I", [1536, 64, 100])
def test_silu_mul(T: int, I: int):
    gen = torch.Generator().manual_seed(T + I)
    gate_up = torch.randn(T, 2 * I, generator=gen) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow and zeros
    want = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    for threads in (1, 2):
        torch.testing.assert_close(cpu_ops.silu_mul(gate_up, num_threads=threads), want, atol=1e-6, rtol=1e-6)
    strided = torch.randn(T, 2 * I + 8, generator=gen)[:, : 2 * I]  # rows of a wider matrix
    torch.testing.assert_close(cpu_ops.silu_mul(strided), F.silu(strided[:, :I]) * strided[:, I:], atol=1e-6, rtol=1e-6)


def test_rejects_other_dtypes_and_shapes():
    x, w = torch.randn(3, 64), torch.ones(64)
    with pytest.raises(ValueError):
        cpu_ops.rms_norm(x.half(), w.half(), 1e-5)
    with pytest.raises(ValueError):
        cpu_ops.rms_norm(x, w.half(), 1e-5)
    with pytest.raises(ValueError):
        cpu_ops.rms_norm(x, torch.ones(63), 1e-5)
    qk, cos, sin = torch.randn(3, 2, 64), torch.randn(3, 64), torch.randn(3, 64)
    with pytest.raises(ValueError):
        cpu_ops.rotary_(qk.half(), cos.half(), sin.half())
    with pytest.raises(ValueError):
        cpu_ops.rotary_(qk, cos.half(), sin)
    with pytest.raises(ValueError):
        cpu_ops.rotary_(qk, cos[:2], sin[:2])
    with pytest.raises(ValueError):  # heads not contiguous: cannot rotate in place
        cpu_ops.rotary_(torch.randn(3, 2, 128)[..., ::2], cos, sin)
    with pytest.raises(ValueError):  # one row seen as several: in place would be wrong
        cpu_ops.rotary_(torch.randn(3, 64).unsqueeze(1).expand(3, 2, 64), cos, sin)
    with pytest.raises(ValueError):
        cpu_ops.silu_mul(torch.randn(3, 128).half())
    with pytest.raises(ValueError):
        cpu_ops.silu_mul(torch.randn(3, 127))


def test_norm_and_gated_activation_write_into_a_given_buffer():
    """A wide step's buffers, reused by every layer: the same values as fresh outputs, and wrong
    buffers refused."""
    x, w = torch.randn(70, 96), torch.rand(96) + 0.5
    out = torch.full((70, 96), float("nan"))
    assert cpu_ops.rms_norm(x, w, 1e-6, out=out) is out
    assert torch.equal(out, cpu_ops.rms_norm(x, w, 1e-6))
    gate_up = torch.randn(70, 200)
    gated = torch.full((70, 100), float("nan"))
    assert cpu_ops.gated_mul(gate_up, "gelu_tanh", out=gated) is gated
    assert torch.equal(gated, cpu_ops.gated_mul(gate_up, "gelu_tanh"))
    with pytest.raises(ValueError):
        cpu_ops.rms_norm(x, w, 1e-6, out=torch.empty(70, 95))
    with pytest.raises(ValueError):
        cpu_ops.gated_mul(gate_up, "silu", out=torch.empty(100, 70).t())  # not contiguous


def test_empty_rows():
    assert cpu_ops.rms_norm(torch.empty(0, 64), torch.ones(64), 1e-5).shape == (0, 64)
    cpu_ops.rotary_(torch.empty(0, 2, 64), torch.empty(0, 64), torch.empty(0, 64))
    assert cpu_ops.silu_mul(torch.empty(0, 128)).shape == (0, 64)


def test_unbuildable_gives_none_and_a_warning(monkeypatch, tmp_path, caplog):
    """Without a working compiler the loader reports None (callers fall back to torch)."""
    from trillm.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_ops._KERNEL, "_functions", None)
    monkeypatch.setattr(cpu_build, "_cache_root", [tmp_path])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level("WARNING", logger="trillm.kernels"):
        assert not cpu_ops.available()
        assert not cpu_ops.available()  # decided once per process
    assert [r.getMessage().startswith("CPU kernel cpu_ops unavailable") for r in caplog.records] == [True]
    with pytest.raises(RuntimeError):
        cpu_ops.silu_mul(torch.randn(2, 8))


def test_the_build_key_covers_the_shared_header(monkeypatch, tmp_path):
    """A change to cpu_common.h must rebuild every kernel, not reuse a stale library."""
    import shutil

    from trillm.kernels import cpu_build

    kernels = tmp_path / "kernels"
    shutil.copytree(cpu_build.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(cpu_build, "KERNELS_DIR", kernels)
    monkeypatch.setattr(cpu_build, "_cache_root", [tmp_path / "cache"])
    first = cpu_build._build("cpu_ops", ("-fno-math-errno",))
    assert cpu_build._build("cpu_ops", ("-fno-math-errno",)) == first  # unchanged: the same library
    with open(kernels / "cpu_common.h", "a") as header:
        header.write("/* changed */\n")
    assert cpu_build._build("cpu_ops", ("-fno-math-errno",)) != first


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
def test_apply_bitmask_matches_xgrammar(vocab: int):
    import xgrammar

    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=gen)
    bitmask[1] = 0  # nothing allowed
    bitmask[2] = -1  # everything allowed
    bitmask[3, : words // 2] = 0  # whole words of none, then mixed words
    logits = torch.randn(6, vocab, generator=gen)
    rows = [0, 1, 2, 3, 5]
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    cpu_ops.apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[4]).all()  # a row not listed is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_scatter_stores_the_fused_columns_as_the_decode_loop_does(dtype: torch.dtype):
    """K and V straight from a fused QKV product (a row stride wider than the heads) into shuffled
    slots, each value as ``cpu_decode.stored`` rounds it (nearest even, float16 saturating; NaN and
    infinities among them); a negative slot is skipped; nothing else in the caches changes."""
    from trillm.kernels import cpu_decode

    gen = torch.Generator().manual_seed(2)
    T, heads, kv_heads, D, page_size, pages = 37, 4, 2, 64, 8, 9
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=gen) * torch.logspace(-8, 5, T).unsqueeze(1)
    qkv[3, heads * D + 5] = float("inf")
    qkv[4, (heads + kv_heads) * D + 9] = float("nan")
    qkv[5, heads * D] = 7e4
    k = qkv[:, heads * D : (heads + kv_heads) * D].view(T, kv_heads, D)
    v = qkv[:, (heads + kv_heads) * D :].view(T, kv_heads, D)
    slots = torch.randperm(pages * page_size, generator=gen)[:T]
    slots[6] = -1
    k_cache = torch.randn(pages, page_size, kv_heads, D, generator=gen).to(dtype)
    v_cache = torch.randn(pages, page_size, kv_heads, D, generator=gen).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kept = slots >= 0
    for want, x in ((want_k, k), (want_v, v)):
        want.view(-1, kv_heads, D)[slots[kept]] = cpu_decode.stored(x[kept].contiguous(), dtype)
    assert cpu_ops.kv_scatter(k, v, slots, k_cache, v_cache)
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        bits = torch.int32 if dtype is torch.float32 else torch.int16
        assert torch.equal(got.view(bits), want.view(bits))
    if dtype is torch.float16:
        assert k_cache.view(-1, kv_heads, D)[slots[5], 0, 0].item() == 65504
        assert k_cache.view(-1, kv_heads, D)[slots[3], 0, 5].item() == 65504


def test_kv_scatter_declines_what_it_cannot_store():
    """Heads not side by side, a foreign dtype or 32-bit slots: False and nothing written (the
    caller's torch stores take them)."""
    k = torch.randn(4, 2, 8)
    cache = torch.zeros(2, 4, 2, 8, dtype=torch.float16)
    slots = torch.arange(4)
    assert not cpu_ops.kv_scatter(k.transpose(0, 1).contiguous().transpose(0, 1), k, slots, cache, cache.clone())
    assert not cpu_ops.kv_scatter(k.double(), k.double(), slots, cache, cache.clone())
    assert not cpu_ops.kv_scatter(k, k, slots.int(), cache, cache.clone())
    assert not cpu_ops.kv_scatter(k, k, slots, cache.to(torch.int16), cache.to(torch.int16))
    assert cache.eq(0).all()
