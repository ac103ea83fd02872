"""Frozen configuration of one engine: what to load and how much to batch."""

from __future__ import annotations

import attrs

DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "cpu", "triton", "reference")
LOAD_FORMATS = ("auto", "dummy")
WEIGHT_FORMATS = ("auto", "dense", "blocks")


@attrs.frozen
class EngineConfig:
    """Everything the engine needs to start; built once by the CLI or the app.

    ``num_pages`` wins over ``kv_cache_bytes`` when both are given, so tests can
    ask for a tiny pool to exercise preemption.
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    page_size: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    num_pages: int | None = None
    kv_cache_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64
    max_waiting: int = 1024  # requests queued beyond this are refused (EngineOverloaded)
    max_batch_tokens: int = 512  # per-step token budget (decode + prefill chunks)
    max_model_len: int | None = None  # None: the model's own context length
    prefix_cache: bool = True  # reuse KV pages of earlier requests that share a prefix
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    served_model_name: str | None = None
    device: str = "auto"  # "auto" (cuda when present) | "cpu" | "cuda"
    kernels: str = "auto"  # "auto": Triton on CUDA, the CPU fast path on CPUs | "triton" | "reference" | "cpu"
    load_format: str = "auto"  # "auto": the model's weights | "dummy": random weights for its config.json
    tokenizer: str | None = None  # where to read the tokenizer when the model folder has none
    # "auto": projections that are exact GGUF blocks stay blocks on the CPU fast path |
    # "dense": float32 matrices always | "blocks": every projection in blocks, or an error
    weight_format: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps on GPUs
    # Schedule step N+1 while step N runs (its sampled tokens filled in by the worker);
    # False: one step at a time, for debugging
    overlap_schedule: bool = True

    def __attrs_post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        # Decodes take one token each from the budget; prefills need what is left.
        if self.max_batch_tokens <= self.max_num_seqs:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must exceed max_num_seqs ({self.max_num_seqs}), "
                "or running decodes could starve every prefill"
            )
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        for name, allowed in (("device", DEVICES), ("kernels", KERNELS), ("load_format", LOAD_FORMATS),
                              ("weight_format", WEIGHT_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
