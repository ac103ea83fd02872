"""Rotary position embeddings, including the rope-scaling variants of Llama configs."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs
import torch


def _unscaled(head_dim: int, theta: float) -> torch.Tensor:
    """The plain rotary frequencies, float64 (every scaling starts from these)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies, adjusted the way the config's rope_scaling says."""
    inv = _unscaled(head_dim, theta)
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "freq_factors":  # GGUF files of Llama 3.1+: llama.cpp's per-pair divisors (rope_freqs)
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.shape != inv.shape:
            raise ValueError(f"rope freq_factors hold {factors.numel()} values for {inv.numel()} frequencies")
        return (inv / factors).float()
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    if kind == "longrope":  # the short factors' frequencies; ``cos_sin_table`` switches past the original length
        return (inv / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def cos_sin_table(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_len, head_dim] cos and sin tables in the rotate-half layout (``head_dim``: the rotated
    part of a head, where only a part is rotated)."""
    return cos_sin_rows(head_dim, theta, scaling, 0, max_len)


def cos_sin_rows(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start:stop`` of ``cos_sin_table``'s tables (each row depends on its position alone)."""
    inv = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(start, stop, dtype=torch.float32)
    freqs = torch.outer(positions, inv)
    scale = 1.0
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if scaling and kind == "longrope":
        freqs, scale = _longrope(head_dim, theta, scaling, positions, freqs)
    elif scaling and kind == "yarn":
        scale = _yarn_attention_factor(scaling)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


@attrs.define(eq=False)
class RotaryTable:
    """One rotary base's cos and sin rows ([positions, head_dim]). On the CPU they are made ``BLOCK``
    positions at a time as steps first reach them: a 32K-context Gemma 3's two bases made 128 MiB of
    float32 tables at start, most rows never read. Elsewhere (kernels and CUDA graphs read the tables
    by address) all at once. Blocks start at multiples of ``BLOCK``, so a row's values never depend
    on which steps came first."""

    BLOCK: ClassVar[int] = 4096

    head_dim: int
    theta: float
    scaling: dict[str, Any] | None
    max_len: int
    dtype: torch.dtype
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def make(
        cls,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> RotaryTable:
        cos, sin = cos_sin_rows(head_dim, theta, scaling, 0, 0 if device.type == "cpu" else max_len)
        return cls(head_dim, theta, scaling, max_len, dtype, cos.to(device, dtype), sin.to(device, dtype))

    def reach(self, stop: int) -> None:
        """Make the rows before ``stop`` (whole blocks, never past ``max_len``)."""
        have = self.cos.shape[0]
        if stop <= have:
            return
        stop = min(self.max_len, -(-stop // self.BLOCK) * self.BLOCK)
        blocks = [
            cos_sin_rows(self.head_dim, self.theta, self.scaling, a, min(a + self.BLOCK, stop))
            for a in range(have, stop, self.BLOCK)
        ]
        device = self.cos.device
        self.cos = torch.cat([self.cos, *(c.to(device, self.dtype) for c, _ in blocks)])
        self.sin = torch.cat([self.sin, *(s.to(device, self.dtype) for _, s in blocks)])

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` (made first where no step reached them before)."""
        if positions.numel():
            self.reach(int(positions.max()) + 1)
        return self.cos[positions], self.sin[positions]

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of every position up to ``max_len``."""
        self.reach(self.max_len)
        return self.cos, self.sin


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss, DeepSeek): frequencies between interpolated (divided by ``factor``) and as
    they are, by a ramp over the dimensions between the ``beta_fast`` and ``beta_slow`` rotations
    of the original context."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left as it is
    return (inv / factor * (1 - kept) + inv * kept).float()


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN's scale of cos and sin: 0.1 ln(factor) + 1 unless the config says."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return get(mscale) / get(all_dims) if mscale and all_dims else get(1.0)


def _longrope(
    head_dim: int, theta: float, scaling: dict[str, Any], positions: torch.Tensor, short: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: positions past the original context rotate by the long factors' frequencies
    (per position, so cached K never changes; transformers switches a whole sequence once it is
    longer), and both tables are scaled by the attention factor (from the length ratio)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling.get("max_position_embeddings", original)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = (_unscaled(head_dim, theta) / torch.tensor(scaling["long_factor"], dtype=torch.float64)).float()
    far = positions >= original
    freqs = short.clone()
    freqs[far] = torch.outer(positions[far], long)
    return freqs, float(attention)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, R] already gathered at each row's position: the first R
    values of each head rotated (R < D: partial rotary, as Phi-4-mini), the rest as they are."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    half = rotary // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
