"""``GET /metrics``: Prometheus text, read from the engine at scrape time (names like vLLM's)."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.engine import Engine


class EngineCollector:
    """Reads ``engine.stats()`` on every scrape, so the numbers are never stale copies."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "kv_cache_free_pages": ("Free KV cache pages.", s.free_pages),
            "kv_cache_total_pages": ("All KV cache pages.", s.total_pages),
            "kv_cache_usage_perc": ("Fraction of KV cache pages in use.", 1 - s.free_pages / s.total_pages),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"trillm:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        counters = {
            "num_requests_aborted": ("Requests cancelled by their client or a deadline.", s.num_aborted),
            "num_preemptions": ("Running requests preempted for lack of pages.", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens admitted.", s.prompt_tokens_total),
            "generation_tokens": ("Tokens generated.", s.generation_tokens_total),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(f"trillm:{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c


def metrics_registry(engine: Engine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine, model_name))  # type: ignore[arg-type]
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
