"""Engine configuration from ``TRILLM_*`` environment variables (for ``hypercorn -k trio``)."""

from __future__ import annotations

import math
import os
from typing import Mapping

from trillm.engine.config import EngineConfig

# environment variable -> (EngineConfig field, parser)
_ENV = {
    "TRILLM_MODEL": ("model", str),
    "TRILLM_DTYPE": ("dtype", str),
    "TRILLM_PAGE_SIZE": ("page_size", int),
    "TRILLM_NUM_PAGES": ("num_pages", int),
    "TRILLM_KV_CACHE_MB": ("kv_cache_bytes", lambda v: int(float(v) * 1024 * 1024)),
    "TRILLM_MAX_NUM_SEQS": ("max_num_seqs", int),
    "TRILLM_MAX_WAITING": ("max_waiting", int),
    "TRILLM_MAX_BATCH_TOKENS": ("max_batch_tokens", int),
    "TRILLM_MAX_MODEL_LEN": ("max_model_len", int),
    "TRILLM_NUM_THREADS": ("num_threads", int),
    "TRILLM_SERVED_MODEL_NAME": ("served_model_name", str),
    "TRILLM_DEVICE": ("device", str),
    "TRILLM_KERNELS": ("kernels", str),
    "TRILLM_LOAD_FORMAT": ("load_format", str),
    "TRILLM_WEIGHT_FORMAT": ("weight_format", str),
    "TRILLM_TOKENIZER": ("tokenizer", str),
    "TRILLM_PREFIX_CACHE": ("prefix_cache", lambda v: v.strip().lower() not in ("0", "false", "no", "off")),
    "TRILLM_ENFORCE_EAGER": ("enforce_eager", lambda v: v.strip().lower() in ("1", "true", "yes", "on")),
    "TRILLM_OVERLAP_SCHEDULE": ("overlap_schedule", lambda v: v.strip().lower() not in ("0", "false", "no", "off")),
}


def config_from_env(env: Mapping[str, str] | None = None, **overrides: object) -> EngineConfig:
    """Build the engine config; explicit ``overrides`` (e.g. CLI flags) win over the environment."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for name, (field, parse) in _ENV.items():
        if env.get(name):
            try:
                values[field] = parse(env[name])
            except ValueError as exc:
                raise SystemExit(f"{name}={env[name]!r} is not valid: {exc}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return EngineConfig(**values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"invalid trillm configuration: {exc}") from None


def env_documentation() -> str:
    lines = [f"  {name:<26} {field}" for name, (field, _) in _ENV.items()]
    return "\n".join([*lines, f"  {'TRILLM_REQUEST_TIMEOUT':<26} seconds per generation request (0: none)"])


def request_timeout_from_env(env: Mapping[str, str] | None = None) -> float:
    """``TRILLM_REQUEST_TIMEOUT`` in seconds; unset or 0 means no limit (infinity)."""
    env = os.environ if env is None else env
    raw = env.get("TRILLM_REQUEST_TIMEOUT", "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise SystemExit(f"TRILLM_REQUEST_TIMEOUT={raw!r} is not a number of seconds") from None
    if value < 0:
        raise SystemExit("TRILLM_REQUEST_TIMEOUT must be >= 0")
    return value or math.inf
