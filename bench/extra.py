"""Pieces of ``trillm bench`` beside the serving run: llama.cpp's single stream,
the memory-bandwidth probe, model sizes, and the throughput plot."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

# Runs inside the llama-cpp-python interpreter given by --llama-cpp (never our dependency).
_LLAMA_CPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
gguf, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, verbose=False)
eos = llm.token_eos()
llm.create_completion(prompt, max_tokens=4)  # warm up
t0 = time.perf_counter()
out = llm.create_completion(prompt, max_tokens=n, temperature=0.8, logit_bias={eos: -1e9})
seconds = time.perf_counter() - t0
print(json.dumps({"tokens": out["usage"]["completion_tokens"], "seconds": seconds}))
"""


def llama_cpp_single_stream(python: str, gguf: Path, prompt: str, output_len: int, threads: int) -> tuple[int, float]:
    """(tokens, seconds) of one llama.cpp completion, prompt processing included as for the others."""
    done = subprocess.run(
        [python, "-c", _LLAMA_CPP_SCRIPT, str(gguf), prompt, str(output_len), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return int(result["tokens"]), float(result["seconds"])


def memory_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes per second of a large copy (read + write) on ``device``: the ceiling decode is held to."""
    n = megabytes * 1024 * 1024 // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def plot(rows: list[Any], path: Path, title: str) -> None:
    """Output tokens/s against concurrency, one line per kind of run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        # One line for generate (single and static batch); each trillm run keeps its own.
        label = {
            "transformers": "transformers generate (static batch)",
            "llama.cpp": "llama.cpp (Q4_1 4-bit weights)",
        }.get(r.label.split(" ")[0], r.label)
        lines.setdefault(label, []).append((r.concurrency, r.tokens_per_s))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in lines.items():
        points.sort()
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    levels = sorted({r.concurrency for r in rows})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
