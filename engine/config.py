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
    max_batch_tokens: int = 512  # per-step token budget (decode + prefill chunks)
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    served_model_name: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
