"""Elementwise ops of the CPU forward in C (``cpu_ops.c``), loaded with ctypes.

RMSNorm, rotary embedding (in place), SiLU- and GELU(tanh)-and-multiply, each one C call in
place of several small torch ops whose per-op overhead dominates at decode batch sizes; and the
sampler's draw from softmax(logits / temperature), which in torch made a fresh copy of every
step's logits (32 x 262,144 floats for Gemma 3: page faults, then four passes); and a step's
keys and values stored into their cache slots in the cache's form (``kv_scatter``).
Float32 CPU tensors only (ValueError otherwise); results match the torch versions
(``F.rms_norm``, ``trillm.engine.execution.rope.apply_rotary``, ``F.silu(g) * u``,
``F.gelu(g, approximate="tanh") * u``) up to rounding.
Built and cached by ``kernels.cpu_build``; the GIL is released during each call.
"""

from __future__ import annotations

import ctypes

import torch

from trillm.kernels import cpu_build, cpu_decode

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "trillm_rms_norm": [_P, _I64, _P, _P, _I64, _I64, _F, _INT],
    "trillm_rotary": [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _INT],
    "trillm_silu_mul": [_P, _I64, _P, _I64, _I64, _INT],
    "trillm_apply_bitmask": [_P, _I64, _P, _I64, _P, _I64, _I64],
    "trillm_gelu_tanh_mul": [_P, _I64, _P, _I64, _I64, _INT],
    "trillm_sample_rows": [_P, _I64, _I64, _I64, _P, _P, _P, _INT],
    "trillm_kv_scatter": [_P, _P, _I64, _I64, _I64, _P, _P, _P, _INT, _INT],
}
# Lets GCC call glibc's vector expf in silu_mul (errno is never read); not -ffast-math.
_EXTRA_FLAGS = ("-fno-math-errno",)
_F32, _CPU = torch.float32, torch.device("cpu")

_KERNEL = cpu_build.CKernel("cpu_ops", _SIGNATURES, None, _EXTRA_FLAGS)
_functions = _KERNEL.functions  # (rms_norm, rotary, silu_mul, apply_bitmask, gelu_tanh_mul, sample_rows, kv_scatter)
available = _KERNEL.available


def _threads(num_threads: int | None) -> int:
    return max(1, num_threads if num_threads is not None else torch.get_num_threads())


# The wrappers below avoid the slower torch calls (``x.device``, ``Tensor.view``,
# ``torch.empty`` with a tuple): at decode sizes they would cost as much as the work.


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.rms_norm(x, (N,), weight, eps)`` for x [..., N] (usually [T, N]), weight [N]; ``out``: a
    contiguous float32 [T, N] to write into (a wide step's buffer, reused by every layer)."""
    if x.dtype is not _F32 or weight.dtype is not _F32 or not (x.is_cpu and weight.is_cpu):
        raise ValueError("cpu_ops.rms_norm takes float32 CPU tensors only")
    N = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != N:
        raise ValueError(f"weight {tuple(weight.shape)} does not match rows of {N}")
    rows = x if x.dim() == 2 else x.reshape(-1, N)
    if not rows.is_contiguous():  # rows of a wider matrix need no copy, only unit column stride
        rows = rows if rows.stride()[1] == 1 else rows.contiguous()
    weight = weight.contiguous()
    T = rows.shape[0]
    if out is None:
        out = torch.empty(T, N, dtype=_F32, device=_CPU)  # not the defaults, which a caller may have changed
    elif out.dtype is not _F32 or out.shape != (T, N) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{T}, {N}]")
    if T and N:
        _functions()[0](
            rows.data_ptr(), rows.stride()[0], weight.data_ptr(), out.data_ptr(), T, N, eps, _threads(num_threads)
        )
    return out if x.dim() == 2 else out.view(x.shape)


def rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_threads: int | None = None) -> None:
    """``qk[:] = apply_rotary(qk, cos, sin)`` in place: qk [T, heads, D], cos/sin [T, R], R <= D
    (R < D: the first R values of each head rotated, the rest untouched: partial rotary).

    qk may be a view with any row and head strides (e.g. the Q and K columns of a
    fused QKV matrix), but each head's D values must be contiguous; columns outside
    the view are not touched. Rotate-half layout, D even; each half of a row is
    rotated with its own half of cos/sin, exactly as ``apply_rotary`` does.
    """
    if any(t.dtype is not _F32 or not t.is_cpu for t in (qk, cos, sin)):
        raise ValueError("cpu_ops.rotary_ takes float32 CPU tensors only")
    if qk.dim() != 3:
        raise ValueError(f"qk must be [T, heads, D], got {tuple(qk.shape)}")
    T, H, D = qk.shape
    R = cos.shape[-1]
    if R % 2 or R > D or cos.shape != (T, R) or sin.shape != (T, R):
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not match qk {tuple(qk.shape)}")
    row_stride, head_stride, column_stride = qk.stride()
    if column_stride != 1 and D > 1:
        raise ValueError("each head of qk must be contiguous (rotated in place, so it cannot be copied)")
    if (H > 1 and head_stride < D) or (T > 1 and row_stride < (H - 1) * head_stride + D):
        raise ValueError(f"qk's heads or rows overlap (strides {qk.stride()}); it is rotated in place")
    if T == 0 or H == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    _functions()[1](
        qk.data_ptr(), row_stride, head_stride, cos.data_ptr(), sin.data_ptr(), T, H, R, _threads(num_threads)
    )


def silu_mul(gate_up: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``F.silu(gate_up[:, :I]) * gate_up[:, I:]`` for gate_up [T, 2 * I]."""
    return _gated(gate_up, 2, num_threads)


def gelu_tanh_mul(gate_up: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``F.gelu(gate_up[:, :I], approximate="tanh") * gate_up[:, I:]`` (GeGLU) for gate_up [T, 2 * I]."""
    return _gated(gate_up, 4, num_threads)


GATED = ("silu", "gelu_tanh")  # the gated activations with a C kernel here


def gated_mul(
    gate_up: torch.Tensor, activation: str, num_threads: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The gated MLP's ``act(gate) * up`` for ``activation`` silu or gelu_tanh (``ModelShape.activation``);
    ``out``: a contiguous float32 [T, I] to write into."""
    return _gated(gate_up, 4 if activation == "gelu_tanh" else 2, num_threads, out)


def _gated(gate_up: torch.Tensor, which: int, num_threads: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    if gate_up.dtype is not _F32 or not gate_up.is_cpu:
        raise ValueError("cpu_ops' gated activations take float32 CPU tensors only")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got {tuple(gate_up.shape)}")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if not gate_up.is_contiguous() and gate_up.stride()[1] != 1:
        gate_up = gate_up.contiguous()
    if out is None:
        out = torch.empty(T, I, dtype=_F32, device=_CPU)
    elif out.dtype is not _F32 or out.shape != (T, I) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{T}, {I}]")
    if T and I:
        _functions()[which](gate_up.data_ptr(), gate_up.stride()[0], out.data_ptr(), T, I, _threads(num_threads))
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t]`` to -inf wherever bit ``t`` of ``bitmask[r]`` is 0, for each ``r`` in
    ``rows`` (xgrammar's bitmask layout: int32 words, bit k of word w is token 32w + k)."""
    if logits.dtype is not _F32 or bitmask.dtype is not torch.int32 or not (logits.is_cpu and bitmask.is_cpu):
        raise ValueError("cpu_ops.apply_bitmask takes float32 logits and int32 bitmasks on the CPU")
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.stride()[1] != 1 or bitmask.stride()[1] != 1:
        raise ValueError("logits and bitmask must be 2-D with unit column stride")
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    if rows and (min(rows) < 0 or max(rows) >= min(logits.shape[0], bitmask.shape[0])):
        raise ValueError("a row index is out of range")
    index = torch.tensor(rows, dtype=torch.int64)
    _functions()[3](
        logits.data_ptr(),
        logits.stride()[0],
        bitmask.data_ptr(),
        bitmask.stride()[0],
        index.data_ptr(),
        len(rows),
        vocab,
    )


def sample_rows(logits: torch.Tensor, temperatures: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``logits`` [R, V] from softmax(row / temperature), by inverting its CDF at
    ``uniforms`` [R] (float64 in [0, 1)): ``sampler.draw``'s method without a copy of the logits.
    Temperatures must be > 0. Returns int64 [R]."""
    if logits.dtype is not _F32 or not logits.is_cpu or logits.dim() != 2 or logits.stride()[1] != 1:
        raise ValueError("cpu_ops.sample_rows takes float32 CPU logits [R, V] with unit column stride")
    R, V = logits.shape
    if len(temperatures) != R or uniforms.shape != (R,) or uniforms.dtype is not torch.float64:
        raise ValueError(f"one temperature and one float64 uniform per row ({R})")
    if any(not t > 0 for t in temperatures):
        raise ValueError("temperatures must be > 0")
    temps = torch.tensor(temperatures, dtype=_F32)
    uniforms = uniforms.contiguous()
    out = torch.empty(R, dtype=torch.int64)
    if R and V:
        _functions()[5](
            logits.data_ptr(),
            logits.stride()[0],
            R,
            V,
            temps.data_ptr(),
            uniforms.data_ptr(),
            out.data_ptr(),
            _threads(None),
        )
        if bool((out < 0).any()):
            raise MemoryError("cpu_ops.sample_rows could not allocate its block sums")
    return out


def kv_scatter(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """``cache.view(-1, KVH, D)[slots] = k`` (and v) for k, v [T, KVH, D] float32 whose heads lie
    side by side in each row (the K and V columns of a fused QKV product: any row stride), stored
    as the cache's dtype holds them (``cpu_decode.stored``: nearest even, float16 saturating).
    False, nothing written, where the tensors are not of that kind: the caller stores in torch."""
    T, kv_heads, head_dim = k.shape
    width = kv_heads * head_dim
    form = cpu_decode.KV_FORMS.get(k_cache.dtype)
    if (
        form is None
        or v_cache.dtype is not k_cache.dtype
        or k.dtype is not _F32
        or v.dtype is not _F32
        or v.shape != k.shape
        or k.stride()[1:] != (head_dim, 1)
        or v.stride() != k.stride()
        or slots.dtype is not torch.int64
        or slots.shape != (T,)
        or not (k.is_cpu and k_cache.is_cpu and v_cache.is_cpu and slots.is_contiguous())
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.numel() % width
        or v_cache.shape != k_cache.shape
        or not available()
    ):
        return False
    if T:
        _functions()[6](
            k.data_ptr(),
            v.data_ptr(),
            k.stride()[0],
            T,
            width,
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            form,
            _threads(None),
        )
    return True
