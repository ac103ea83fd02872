"""Decode speed of one model through the offline API: one stream, then N at once, and resident memory.

    python -m trillm.bench.offline_speed MODEL [--streams 16] [--tokens 128] [--weight-format auto]

No HTTP (``trillm bench`` measures the server, TTFT and inter-token latency beside the peers):
this compares weight formats and files quickly, e.g. a GGUF file in its blocks against the same
file decoded to dense float32. Tokens/s counts generated tokens (``ignore_eos``) over wall time.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from trillm.bench.peers import resident_mib


def main() -> None:
    from trillm import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with LLM(model=args.model, dtype=args.dtype, weight_format=args.weight_format) as llm:
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        llm.generate("Write a story about a dragon.", params, use_tqdm=False)
        one = args.tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate([f"Story number {i}:" for i in range(args.streams)], params, use_tqdm=False)
        many = args.streams * args.tokens / (time.perf_counter() - start)
        print(
            f"{Path(args.model).name} ({args.weight_format}): 1 stream {one:.1f} tok/s, "
            f"{args.streams} streams {many:.1f} tok/s, RSS {resident_mib(os.getpid()) or 0:.0f} MiB"
        )


if __name__ == "__main__":
    main()
