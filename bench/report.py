"""The numbers of ``trillm bench``: one result per run, and the table they print as."""

from __future__ import annotations

import attrs


@attrs.frozen
class RunResult:
    label: str
    concurrency: int
    output_tokens: int
    seconds: float
    ttft: tuple[float, ...] = ()
    itl: tuple[float, ...] = ()
    probe_ttft: float | None = None
    step_bytes: int | None = None  # weight bytes per decode step, as the server reports them
    rss_mib: float | None = None  # the server's resident memory after the run, where known

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def pct(values: tuple[float, ...], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(rows: list[RunResult], baselines: dict[int, RunResult], step_bytes: int, bandwidth: float) -> str:
    """``step_bytes / ITL p50`` over ``bandwidth``: how close decode runs to the memory-bandwidth limit
    (each run's own bytes where the server reported them, else float32 weights of ``step_bytes``)."""
    lines = [
        "| run | concurrency | output tok/s | vs baseline | TTFT p50 / p99 (s) | ITL p50 / p99 / max (ms) "
        "| TTFT of a newcomer (s) | decode: share of memory bandwidth | resident MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = baselines.get(r.concurrency)
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and base is not r else ""
        ttft = f"{pct(r.ttft, 0.5):.3f} / {pct(r.ttft, 0.99):.3f}" if r.ttft else ""
        itl = f"{pct(r.itl, 0.5) * 1e3:.1f} / {pct(r.itl, 0.99) * 1e3:.1f} / {max(r.itl) * 1e3:.0f}" if r.itl else ""
        probe = f"{r.probe_ttft:.3f}" if r.probe_ttft is not None else ""
        share = f"{(r.step_bytes or step_bytes) / pct(r.itl, 0.5) / bandwidth:.0%}" if r.itl else ""
        rss = f"{r.rss_mib:,.0f}" if r.rss_mib is not None else ""
        lines.append(
            f"| {r.label} | {r.concurrency} | {r.tokens_per_s:.1f} | {ratio} | {ttft} | {itl} | {probe} | {share} "
            f"| {rss} |"
        )
    return "\n".join(lines)
