"""The dtype ``--dtype auto`` serves in, chosen for the step a server runs most: decode.

A decode step reads every projection weight once, so its cost is the bytes it reads.
On the CPU fast path in float32, projections that are exact GGUF blocks stay blocks
(Q4_1: 0.75 bytes a weight, Q8_0: 1.06) and run in the fused C decode loop; bfloat16
reads 2 bytes a weight and has neither. A matmul timing alone cannot see that: on a
CPU with AMX a batched bfloat16 matmul beats float32, and choosing by it once traded
the whole block path away (7x slower decode on the default model). So the choice is
made in two steps, and the start-up log says which and why:

1. where the float32 block path applies, probe the first layer's projections: if
   their blocks, or a bfloat16 / float16 checkpoint's rows kept as they are, read no
   more bytes than bfloat16 would, float32 (blocks, the fused C decode loop) wins;
2. else (dense weights: every decode step reads a matrix), time a decode-shaped
   matmul on the model's own widths in both dtypes; bfloat16 only when clearly
   faster (``BF16_MARGIN``): float32 is the exact reference and has the C kernels
   for norms, rotary and paged decode attention, so a tie goes to it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends import create_backend, resolve_backend
from trillm.engine.execution.backends.cpu import CpuBackend
from trillm.engine.execution.checkpoint_names import text_name
from trillm.engine.execution.gguf_header import GGUFHeader
from trillm.kernels import cpu_matmul
from trillm.kernels.block_weights import pack_exact

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BF16_MARGIN = 0.8  # bfloat16 must take at most this share of float32's time
_LAYER0 = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(f"mlp.{p}_proj" for p in ("gate", "up", "down"))


@attrs.frozen
class DtypeChoice:
    """The dtype to serve in, and the one line the start-up log gives for it."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return DTYPE_NAMES[self.dtype]


def matmul_seconds(rows: int, width: int, out: int, dtype: torch.dtype) -> float:
    """Best time of ``[rows, width] @ [width, out]`` in ``dtype`` on this CPU (the probe tests fake)."""
    x, w = torch.randn(rows, width).to(dtype), torch.randn(out, width).to(dtype)
    times = []
    for _ in range(8):
        t = time.perf_counter()
        for _ in range(10):
            torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t)
    return min(times[2:])


def block_weights_wanted(config: EngineConfig, possible: bool, gguf: bool = False) -> bool:
    """Whether to keep exact GGUF blocks, where a backend that can run them (``possible``) would.

    Random dummy weights never are blocks. ``auto`` takes them only where the block matmul
    has its SIMD paths, AVX-512 or AVX2 + FMA (``cpu_matmul.simd()``): its plain-C fallback
    is correct but slower than MKL on dense float32. A GGUF file read as it is (``gguf``) stays in
    its blocks wherever they run: decoded, it would take 2-7x the file's memory."""
    if not possible or config.weight_format == "dense" or config.load_format == "dummy":
        return False
    return config.weight_format == "blocks" or gguf or cpu_matmul.simd() != "plain"


def _block_path_applies(config: EngineConfig, device: torch.device, gguf: bool) -> bool:
    """Whether float32 would keep exact GGUF blocks (what loading decides in float32)."""
    possible = create_backend(config.kernels, device, torch.float32).supports_block_weights
    return block_weights_wanted(config, possible, gguf)


def first_layer_bytes(folder: Path, keep_half: bool = True) -> tuple[int, int] | None:
    """(bytes the first layer's projections take as exact blocks or float32, weights in them), or
    None where the checkpoint has none of them. Reads only those tensors (memory-mapped).
    ``keep_half``: a bfloat16 / float16 matrix counts its 2 bytes (one process keeps it as it is;
    a tensor-parallel rank's shard is converted)."""
    from safetensors import safe_open

    block_bytes = weights = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys = {text_name(key): key for key in f.keys()}
            for name in _LAYER0:
                key = keys.get(f"model.layers.0.{name}.weight")
                if key is None:
                    continue
                raw = f.get_tensor(key)
                packed = pack_exact(raw.float())
                # float32 keeps a bfloat16 / float16 checkpoint's rows as they are (``layers.half_rows``)
                width = 2 if keep_half and raw.dtype in (torch.bfloat16, torch.float16) else 4
                block_bytes += packed.nbytes if packed is not None else raw.numel() * width
                weights += raw.numel()
    return (block_bytes, weights) if weights else None


def gguf_first_layer_bytes(header: GGUFHeader) -> tuple[int, int] | None:
    """``first_layer_bytes`` of a GGUF file read as it is: its blocks' bytes, from the header."""
    block_bytes = weights = 0
    for tensor in header.tensors:
        if tensor.name.startswith("blk.0.") and len(tensor.dims) == 2:
            block_bytes += tensor.nbytes
            weights += math.prod(tensor.dims)
    return (block_bytes, weights) if weights else None


def choose_dtype(
    config: EngineConfig,
    device: torch.device,
    folder: Path | GGUFHeader | None,
    model_config: dict[str, Any],
    seconds: Callable[[int, int, int, torch.dtype], float] | None = None,
) -> DtypeChoice:
    """The dtype ``config.dtype`` names, or for ``auto`` the one a decode step runs fastest in.

    ``folder``: the checkpoint, or a GGUF file's header (None for random dummy weights). ``seconds``: the matmul
    timer, ``matmul_seconds`` by default (tests fake it to answer as an AMX machine would)."""
    if config.dtype != "auto":
        return DtypeChoice(torch.bfloat16 if config.dtype == "bfloat16" else torch.float32, "asked for")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto on CUDA")
    gguf = isinstance(folder, GGUFHeader)
    if folder is not None and _block_path_applies(config, device, gguf):
        probed = (
            gguf_first_layer_bytes(folder)
            if isinstance(folder, GGUFHeader)
            else first_layer_bytes(folder, keep_half=config.tp == 1)
        )
        if probed is not None and probed[0] <= 2 * probed[1]:
            block_bytes, weights = probed
            held = "the GGUF file's blocks" if gguf else "exact GGUF blocks or bfloat16/float16 rows"
            return DtypeChoice(
                torch.float32,
                f"auto: the projections are {held} "
                f"({block_bytes / weights:.2f} bytes a weight "
                "in layer 0, against 2 in bfloat16): float32 keeps them for the fused decode loop "
                "(--gemm-dtype multiplies wide steps in bfloat16 where this CPU has AMX)",
            )
    hidden = int(model_config.get("hidden_size", 576))
    inter = int(model_config.get("intermediate_size", 4 * hidden))
    timer = seconds or matmul_seconds
    bf16, f32 = (timer(1, hidden, inter, d) for d in (torch.bfloat16, torch.float32))
    faster = torch.bfloat16 if bf16 < BF16_MARGIN * f32 else torch.float32
    return DtypeChoice(
        faster,
        f"auto: dense weights; a decode-shaped matmul (1x{hidden} @ {hidden}x{inter}) takes "
        f"{bf16 * 1e5:.1f} us in bfloat16 against {f32 * 1e5:.1f} us in float32",
    )


def kv_dtype_asked(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``--kv-cache-dtype`` names (None for ``auto``), refused where the backend keeps the
    cache in the model's dtype (only the CPU path converts): checked when the load is planned."""
    if config.kv_cache_dtype == "auto":
        return None
    asked, kernels = KV_DTYPES[config.kv_cache_dtype], resolve_backend(config.kernels, device)
    if asked is not dtype and kernels != "cpu":
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype}: the {kernels} kernels keep "
            f"the KV cache in the model's dtype ({DTYPE_NAMES.get(dtype, dtype)}); only the CPU path converts it"
        )
    return asked


def choose_kv_dtype(config: EngineConfig, model: Any) -> DtypeChoice:
    """The KV cache's dtype for ``model`` as loaded (``--kv-cache-dtype``).

    A cached token costs its K/V in memory and, every decode step after, in bytes read: at 32
    streams of SmolLM2 the float32 cache was a quarter of a step's reads. 16 bits halve both.
    float16 by default, as llama.cpp's cache: 10 bits of mantissa, where bfloat16's 7 moved the
    default model's log-probabilities ten times as far (0.022 against 0.0023 at most, against
    transformers in float32); K/V past its range are saturated. Where the projections are GGUF
    blocks the weights are rounded far coarser than that already; a float32 checkpoint served
    dense keeps the float32 cache (the exact path). Only the CPU backend reads a cache unlike its
    activations; the others keep the model's dtype."""
    asked = kv_dtype_asked(config, model.device, model.dtype)
    if asked is not None:
        return DtypeChoice(asked, "asked for")
    if not isinstance(model.backend, CpuBackend) or model.dtype is not torch.float32:
        return DtypeChoice(model.dtype, "auto: the model's dtype")
    if not model.num_block_weights:
        return DtypeChoice(torch.float32, "auto: dense float32 weights keep a float32 cache (the exact path)")
    return DtypeChoice(
        torch.float16,
        f"auto: {model.num_block_weights} projections in blocks; a float16 cache takes half the memory and "
        "decode reads of float32 (--kv-cache-dtype float32 keeps float32)",
    )
