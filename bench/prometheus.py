"""Read the server's ``/metrics`` with prometheus_client's own text parser (one parser for the bench)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def scrape(text: str, prefix: str = "trillm:") -> dict[str, float]:
    """Each sample named ``prefix…`` as ``{name without prefix: value}`` (labels dropped: one model per server;
    with ``--dp``, the totals, not each replica's)."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(prefix) and not sample.labels.get("replica"):
                    values[sample.name[len(prefix) :]] = sample.value
    except ValueError:  # not Prometheus text: a peer without metrics (llama-server without --metrics)
        return {}
    return values
