"""Whether trillm can serve a GGUF file, decided from its header before any heavy work.

A file trillm cannot serve used to be dequantized whole into a float32 cache first (1.07 GB
for Gemma 3 270M) and only then refused with a traceback. Every refusal here is one line
naming the file and what is wrong: the architecture, a tensor's type (naming the tensor),
a missing tensor, or the memory the float32 conversion needs (until k-quants stay in their
blocks, issue 21).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from trillm.engine.execution.gguf_header import GGUFHeader
from trillm.engine.execution.native_memory import resident_file_bytes
from trillm.kernels.gguf_blocks import BLOCK_TYPES

# general.architecture values of the families ``shape.ModelShape`` serves (Mistral's GGUF files say "llama")
SERVED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "qwen2moe",
    "qwen3moe",
    "gpt-oss",
    "phi3",
)
# Tensor types read today: plain float32, and every type of the one table of blocks (the IQ types are not yet).
READ_TYPES = frozenset({"F32", *BLOCK_TYPES})
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
MIXTURE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# Each family's tensors beyond a Llama's, per layer
EXTRA_LAYER_TENSORS = {
    "qwen3": ("attn_q_norm", "attn_k_norm"),
    "qwen3moe": ("attn_q_norm", "attn_k_norm"),
    "qwen2moe": ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"),
    "gpt-oss": ("attn_sinks", "post_attention_norm"),
    "gemma3": ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"),
    "gemma2": ("post_attention_norm", "post_ffw_norm"),
}


class UnsupportedModel(ValueError):
    """A model file trillm cannot serve; the message is one line that says why."""


def type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def float32_bytes(header: GGUFHeader) -> int:
    """What the file's weights take dequantized to float32 (the conversion cache, and memory while converting)."""
    return sum(4 * math.prod(tensor.dims) for tensor in header.tensors)


def available_memory() -> int | None:
    """Bytes of memory this process can still take: MemAvailable of ``/proc/meminfo``, or less where
    a cgroup (a container) caps it lower (None where neither is known)."""
    free = meminfo("MemAvailable")
    limit = cgroup_memory_limit()
    try:
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free
    if limit is not None:
        room = max(0, limit - used)
        free = room if free is None else min(free, room)
    return free


def cgroup_memory_limit() -> int | None:
    """Bytes this process's cgroup (a container) may use; None where it sets no limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    return int(limit) if limit.isdigit() else None


def meminfo(key: str) -> int | None:
    """Bytes of ``key`` (MemAvailable, MemTotal) in ``/proc/meminfo``; None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_servable(header: GGUFHeader, available: int | None = None, native: bool = False) -> None:
    """Raise ``UnsupportedModel`` unless ``header``'s file can be served here: converted to float32
    first (the default model), or with ``native`` as it is, in its blocks (``gguf_model``).
    ``available``: bytes of memory free (default: this machine's MemAvailable)."""
    path = header.path
    arch = header.metadata.get("general.architecture")
    if arch not in SERVED_ARCHITECTURES:
        served = ", ".join(SERVED_ARCHITECTURES)
        raise UnsupportedModel(f"{path}: architecture {arch!r} is not served yet; trillm serves GGUF files of {served}")
    for tensor in header.tensors:
        name = type_name(tensor.type)
        if name not in READ_TYPES:
            raise UnsupportedModel(
                f"{path}: tensor {tensor.name} is {name}, which trillm does not read yet "
                f"(it reads {', '.join(sorted(READ_TYPES))})"
            )
    layers = header.metadata.get(f"{arch}.block_count")
    if not isinstance(layers, int) or layers < 1:
        raise UnsupportedModel(f"{path}: no {arch}.block_count in its metadata")
    present = {t.name for t in header.tensors}
    wanted = ["token_embd.weight", "output_norm.weight"]
    parts = LAYER_TENSORS + EXTRA_LAYER_TENSORS.get(arch, ())
    if arch == "gpt-oss":  # its MLP's input norm is post_attention_norm, not ffn_norm
        parts = tuple(p for p in parts if p != "ffn_norm")
    if arch == "phi3":  # gate and up in one matrix (ffn_up); Q, K and V in one too where attn_qkv is
        parts = tuple(p for p in parts if p != "ffn_gate")
        if "blk.0.attn_qkv.weight" in present:
            parts = tuple(p for p in parts if p not in ("attn_q", "attn_k", "attn_v")) + ("attn_qkv",)
    if header.metadata.get(f"{arch}.expert_count"):  # a mixture: a router and experts in place of the MLP
        dense = ("ffn_gate", "ffn_up", "ffn_down")
        parts = tuple(p for p in parts if p not in dense) + MIXTURE_TENSORS
    wanted += [f"blk.{i}.{part}.weight" for i in range(layers) for part in parts]
    missing = [name for name in wanted if name not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UnsupportedModel(f"{path}: tensor {missing[0]}{more} missing for a {layers}-layer {arch} model")
    need = header.file_size if native else float32_bytes(header)
    free = available_memory() if available is None else available
    if free is not None and native and need > free:
        # Mapped, the file's pages already in memory (another server on the same file) cost nothing
        # more; what the machine has in all still bounds it.
        total = meminfo("MemTotal")
        free = min(free + resident_file_bytes(path), total if total is not None else free)
    if free is not None and need > free:
        held = "in their blocks" if native else "dequantized to float32 (as the default model is converted)"
        raise UnsupportedModel(
            f"{path}: its weights {held} take {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB of memory is available"
        )


def check_decoded_fits(header: GGUFHeader, dtype_bytes: int, available: int | None = None) -> None:
    """Refuse (one line, before any tensor is decoded) a file whose weights decoded to a dense dtype of
    ``dtype_bytes`` bytes (``--weight-format dense``, bfloat16, a GPU, tensor-parallel ranks) would not
    fit in the memory available (``check_servable`` only knows the file's own size)."""
    need = sum(dtype_bytes * math.prod(tensor.dims) for tensor in header.tensors)
    free = available_memory() if available is None else available
    if free is not None and need > free:
        raise UnsupportedModel(
            f"{header.path}: its weights decoded to {8 * dtype_bytes}-bit floats take {need / 2**30:.1f} GiB; "
            f"{free / 2**30:.1f} GiB of memory is available (its blocks run on the CPU in float32)"
        )


def check_disk(header: GGUFHeader, target: Path) -> None:
    """Refuse (one line) a conversion whose float32 cache would not fit on ``target``'s disk."""
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    need = float32_bytes(header)
    if need > free:
        raise UnsupportedModel(
            f"{header.path}: its float32 conversion in {folder} takes {need / 2**30:.1f} GiB; "
            f"{free / 2**30:.1f} GiB of disk is free there (--cache-dir chooses another place)"
        )
