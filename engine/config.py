"""Frozen configuration of one engine: what to load and how much to batch."""

from __future__ import annotations

import attrs


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
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
