"""``GET /metrics``: Prometheus text, read from the engine at scrape time (names like vLLM's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trillm.engine import Engine, EngineStats, ReplicaSet, weights_pending_bytes

# The loaded models, each with its engine, at scrape time (several behind one endpoint).
LoadedModels = Callable[[], list[tuple[str, Engine | ReplicaSet]]]


class EngineCollector:
    """Reads every loaded model's ``engine.stats()`` on every scrape, so the numbers are never stale
    copies; each series is labelled with its model (``model_name``)."""

    def __init__(self, models: LoadedModels) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        """One series per family and model; with ``--dp``, one per replica (label ``replica``) and
        the total (``replica=""``, which Prometheus reads as no label)."""
        loaded = self.models()
        dp = any(isinstance(engine, ReplicaSet) for _, engine in loaded)
        labels = ["model_name", "replica"] if dp else ["model_name"]
        series: list[tuple[list[str], EngineStats, int]] = []
        for model_name, engine in loaded:
            weight_bytes = engine.model.projection_bytes
            series.append(([model_name, ""] if dp else [model_name], engine.stats(), weight_bytes))
            if isinstance(engine, ReplicaSet):
                replicas = enumerate(engine.replica_stats())
                series += [([model_name, str(i)], s, weight_bytes) for i, s in replicas if s]
        for kind, family in ((GaugeMetricFamily, _gauges), (CounterMetricFamily, _counters)):
            by_name: dict[str, Metric] = {}
            for label_values, s, weight_bytes in series:
                for name, (doc, value) in family(s, weight_bytes).items():
                    if name not in by_name:
                        by_name[name] = kind(f"trillm:{name}", doc, labels=labels)
                    by_name[name].add_metric(label_values, value)  # type: ignore[attr-defined]
            yield from by_name.values()
        yield from _speculation([(values, s) for values, s, _ in series], labels)
        yield GaugeMetricFamily(
            "trillm:weights_pending_bytes",
            "Bytes of mapped GGUF weights this process still reads into memory in the background (0: done).",
            value=weights_pending_bytes(),
        )


def _speculation(series: list[tuple[list[str], EngineStats]], labels: list[str]) -> Iterator[Metric]:
    """Speculative decoding's counters per way of proposing (label ``method``: ``ngram``, ``prediction``),
    named as vLLM's ``spec_decode_*``, and the acceptance rate (accepted / proposed tokens)."""
    families = {
        "spec_decode_num_drafts": (CounterMetricFamily, "Verifications of proposed tokens.", "drafts"),
        "spec_decode_num_draft_tokens": (CounterMetricFamily, "Tokens proposed.", "draft_tokens"),
        "spec_decode_num_accepted_tokens": (CounterMetricFamily, "Proposed tokens the model kept.", "accepted_tokens"),
        "spec_decode_num_emitted_tokens": (
            CounterMetricFamily,
            "Tokens verifications produced (kept ones plus the model's own after them).",
            "emitted_tokens",
        ),
    }
    made = {name: kind(f"trillm:{name}", doc, labels=[*labels, "method"]) for name, (kind, doc, _) in families.items()}
    rate = GaugeMetricFamily(
        "trillm:spec_decode_draft_acceptance_rate", "Proposed tokens kept / proposed.", labels=[*labels, "method"]
    )
    for label_values, s in series:
        for counts in s.speculation:
            for name, (_, _, field) in families.items():
                made[name].add_metric([*label_values, counts.method], getattr(counts, field))
            rate.add_metric([*label_values, counts.method], counts.accepted_tokens / max(1, counts.draft_tokens))
    yield from made.values()
    yield rate


def _gauges(s: EngineStats, weight_bytes: int) -> dict[str, tuple[str, float]]:
    return {
        "num_requests_running": ("Requests in the running batch.", s.num_running),
        "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
        "kv_cache_free_pages": ("Free KV cache pages.", s.free_pages),
        "kv_cache_evictable_pages": ("Cached pages no request holds (reclaimed on demand).", s.evictable_pages),
        "kv_cache_total_pages": ("All KV cache pages.", s.total_pages),
        "kv_cache_usage_perc": (
            "Fraction of KV cache pages held by requests.",
            1 - (s.free_pages + s.evictable_pages) / max(1, s.total_pages),
        ),
        "model_weight_bytes_per_step": (
            "Bytes of projection weights each decode step reads (float32, or fewer where they stay in GGUF blocks).",
            weight_bytes,
        ),
    }


def _counters(s: EngineStats, weight_bytes: int) -> dict[str, tuple[str, float]]:
    return {
        "num_requests_aborted": ("Requests cancelled by their client or a deadline.", s.num_aborted),
        "num_requests_stalled": (
            "Requests aborted because their client read nothing for the stall timeout.",
            s.num_stalled,
        ),
        "stream_outputs_merged": ("Outputs merged into one their client had not taken yet.", s.num_merged_outputs),
        "num_preemptions": ("Running requests preempted for lack of pages.", s.num_preemptions),
        "prompt_tokens": ("Prompt tokens admitted.", s.prompt_tokens_total),
        "generation_tokens": ("Tokens generated.", s.generation_tokens_total),
        "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
        "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        "grammar_compiles": ("Structured-output grammars compiled (cache misses).", s.grammar_compiles),
        "grammar_compile_seconds": ("Seconds spent compiling grammars.", s.grammar_compile_seconds),
        "grammar_cache_hits": ("Grammars found compiled in the cache.", s.grammar_cache_hits),
        "grammar_compile_timeouts": (
            "Grammar compiles killed at the time limit (each a 400).",
            s.grammar_compile_timeouts,
        ),
        "grammar_compiler_busy": (
            "Requests that found every grammar compile worker busy for the whole time limit (each a 503).",
            s.grammar_compiler_busy,
        ),
        "grammar_masked_steps": ("Steps with at least one grammar-constrained row.", s.grammar_masked_steps),
        "grammar_mask_seconds": (
            "Seconds the model-runner thread spent filling, applying and advancing grammar masks.",
            s.grammar_mask_seconds,
        ),
    }


_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


def priority_class(priority: int) -> str:
    """The ``priority`` label: the request's priority by sign, so the label has three values
    whatever integers clients send ("high" below 0, sooner; "low" above 0)."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


class RequestMetrics:
    """The request-timing families of one registry, shared by every model's observer (a family is
    registered once; each model is a ``model_name`` label)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"trillm:{name}", doc, ["model_name"], registry=registry, buckets=_LATENCY_BUCKETS)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled step.")

        # The same two timings again by priority class (``priority_class``), beside the totals above.
        def by_priority(name: str, doc: str) -> Histogram:
            doc += " by the request's priority class (high < 0, normal 0, low > 0)."
            labels = ["model_name", "priority"]
            return Histogram(f"trillm:{name}", doc, labels, registry=registry, buckets=_LATENCY_BUCKETS)

        self.queue_by_priority = by_priority(
            "request_queue_time_by_priority_seconds", "Arrival to first scheduled step,"
        )
        self.ttft_by_priority = by_priority("time_to_first_token_by_priority_seconds", "Arrival to first token,")
        self.success = Counter(
            "trillm:request_success",
            "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.embedded = Counter(
            "trillm:embedding_inputs", "Inputs embedded (/v1/embeddings).", ["model_name"], registry=registry
        )

    def observer(self, model_name: str) -> PrometheusObserver:
        return PrometheusObserver(self, model_name)


class PrometheusObserver:
    """One model's per-request timings as Prometheus histograms and counters."""

    def __init__(self, families: RequestMetrics, model_name: str) -> None:
        self._ttft = families.ttft.labels(model_name)
        self._itl = families.itl.labels(model_name)
        self._e2e = families.e2e.labels(model_name)
        self._queue = families.queue.labels(model_name)
        self._queue_by_priority = families.queue_by_priority
        self._ttft_by_priority = families.ttft_by_priority
        self._success = families.success
        self._embedded = families.embedded.labels(model_name)
        self._model_name = model_name

    def embedded(self, inputs: int) -> None:
        self._embedded.inc(inputs)

    def queue_time(self, seconds: float, priority: int = 0) -> None:
        self._queue.observe(seconds)
        self._queue_by_priority.labels(self._model_name, priority_class(priority)).observe(seconds)

    def first_token(self, seconds: float, priority: int = 0) -> None:
        self._ttft.observe(seconds)
        self._ttft_by_priority.labels(self._model_name, priority_class(priority)).observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self._e2e.observe(seconds)
        self._success.labels(self._model_name, reason).inc()


def metrics_registry(models: LoadedModels) -> tuple[CollectorRegistry, RequestMetrics]:
    """A registry of this app's own: every loaded engine's gauges and counters read at scrape
    time, and the request-timing families each model's observer reports into (passed to
    ``Engine.run``)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(models))
    return registry, RequestMetrics(registry)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
