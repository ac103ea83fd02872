"""Structured outputs in ``trillm bench``: the schema every constrained client asks for, and
the grammar costs measured beside the serving run (compile cold and cached, mask per step)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trillm.bench.prometheus import scrape

# Long enough that ``--output-len`` tokens never complete it: every constrained stream
# generates exactly as many tokens as an unconstrained one, all of them under the mask.
RECORDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 24},
                    "kind": {"enum": ["river", "stone", "cloud", "garden", "lamp"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                },
                "required": ["id", "name", "kind", "score", "tags"],
            },
        }
    },
    "required": ["records"],
}


def load_schema(path: Path | None) -> dict[str, Any]:
    return RECORDS_SCHEMA if path is None else json.loads(path.read_text())


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def compile_report(tokenizer: Any, model_dir: Path, model_config: dict[str, Any], schema: dict[str, Any]) -> str:
    """Seconds to compile ``schema`` cold (after the vocabulary is read, a one-time cost per
    server) and to find it cached, with the engine's own compiler."""
    from trillm.engine import GrammarCompiler, GrammarSpec, ModelShape, eos_ids_of

    eos = eos_ids_of(model_dir, model_config, tokenizer)
    compiler = GrammarCompiler(tokenizer, ModelShape.from_config(model_config).vocab_size, eos)
    compiler.compile_now(GrammarSpec.json_object())
    spec = GrammarSpec.json_schema(schema)
    started = time.perf_counter()
    compiler.compile_now(spec)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile_now(spec)
    cached = time.perf_counter() - started
    return f"[bench] json_schema compile: {cold * 1e3:.1f} ms cold, {cached * 1e6:.0f} us cached"


def mask_counters(url: str) -> tuple[float, float]:
    """The server's (masked steps, mask seconds) so far."""
    import httpx

    values = scrape(httpx.get(url + "/metrics", timeout=10).text)
    return values.get("grammar_masked_steps_total", 0.0), values.get("grammar_mask_seconds_total", 0.0)


def mask_report(url: str, before: tuple[float, float], level: int, constrained: Any, plain: Any) -> str:
    """The constrained pass against the unconstrained one at the same concurrency, and what its masks cost."""
    steps, seconds = (now - then for now, then in zip(mask_counters(url), before))
    return (
        f"[bench] json_schema at c={level}: {constrained.tokens_per_s / plain.tokens_per_s:.2f}x the unconstrained "
        f"tok/s; masks {1e3 * seconds / max(steps, 1):.2f} ms per step ({int(steps)} steps)"
    )
