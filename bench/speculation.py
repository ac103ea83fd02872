"""Speculative decoding's speed: each ``--speculative`` mode beside ``off``, on work it helps and work it cannot.

    python -m trillm.bench.speculation [--model M] [--modes off,auto,ngram] [--concurrency 1,8] [--rounds 5]

Three workloads, greedy (so every mode emits the same tokens, and tokens/s compare):
``chat`` (open questions: little to propose), ``repeat`` (lists and text asked back: prompt lookup
finds the answer in the prompt) and ``edit`` (a code file to change, with the file itself as
OpenAI's predicted output). One engine per mode, all in this process; the modes take turns
request by request, ``--rounds`` times, and the median of each is printed with its ratio to
``off`` (this VM's timings move by 15-30 % from minute to minute: taking turns keeps that out of
the ratios). Offline, no HTTP: the scheduler, the runner and the verification are what differ.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""

WORKLOADS: dict[str, list[tuple[str, str | None]]] = {
    "chat": [
        ("Tell me a short story about a dragon who learns to cook.", None),
        ("Explain how photosynthesis works in simple terms.", None),
        ("What are three good habits for learning a new language?", None),
        ("Describe the water cycle for a ten-year-old.", None),
    ],
    "repeat": [
        ("Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape.", None),
        ("Copy this sentence five times: The quick brown fox jumps over the lazy dog.", None),
        ("Write the numbers from one to twenty in words, separated by commas.", None),
        ("Repeat after me twice: To be, or not to be, that is the question.", None),
    ],
    "edit": [
        (f"Copy this code exactly, then stop:\n\n{CODE}", CODE),
        (
            f"Here is my code:\n\n{CODE}\nPlease repeat the code back to me with the variable subtotal renamed to net.",
            CODE,
        ),
        (f"Add a docstring to each function in this code and return the full code:\n\n```python\n{CODE}```", CODE),
    ],
}


def _requests(llm: Any, workload: str) -> list[tuple[list[int], Any]]:
    from trillm import SamplingParams

    tok = llm.get_tokenizer()
    out = []
    for text, prediction in WORKLOADS[workload]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        predicted = tuple(tok(prediction, add_special_tokens=False)["input_ids"]) if prediction else ()
        out.append((ids, SamplingParams(max_tokens=160, temperature=0, prediction=predicted)))
    return out


def _timed(llm: Any, batch: list[tuple[list[int], Any]]) -> tuple[float, int]:
    start = time.perf_counter()
    results = llm.generate([ids for ids, _ in batch], [p for _, p in batch], use_tqdm=False)
    return time.perf_counter() - start, sum(len(r.outputs[0].token_ids) for r in results)


def main() -> None:
    from trillm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="off,auto,ngram")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--workloads", default="chat,repeat,edit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()
    modes = args.modes.split(",")
    engines = {
        m: LLM(model=args.model, speculative=m, num_speculative_tokens=args.num_speculative_tokens) for m in modes
    }
    print(f"model {args.model}; tokens/s, median of {args.rounds} turns (ratio to off)")
    print(f"| workload | streams | {' | '.join(modes)} | proposed tokens kept |")
    print(f"|---|---:|{'---:|' * len(modes)}---:|")
    for workload in args.workloads.split(","):
        for concurrency in map(int, args.concurrency.split(",")):
            speeds: dict[str, list[float]] = {m: [] for m in modes}
            before = {m: _kept(engines[m]) for m in modes}
            for _ in range(args.rounds):
                for mode, llm in engines.items():
                    requests = _requests(llm, workload)
                    batch = [requests[i % len(requests)] for i in range(concurrency)]
                    seconds, tokens = _timed(llm, batch)
                    speeds[mode].append(tokens / seconds)
            base = statistics.median(speeds[modes[0]])
            cells = [f"{statistics.median(speeds[m]):.1f} ({statistics.median(speeds[m]) / base:.2f}x)" for m in modes]
            kept = [_kept(engines[m]) for m in modes]
            rates = [
                f"{m}: {(k[1] - b[1]) / max(1, k[0] - b[0]):.0%}"
                for m, k, b in zip(modes, kept, before.values())
                if k[0] > b[0]
            ]
            print(f"| {workload} | {concurrency} | {' | '.join(cells)} | {', '.join(rates) or '-'} |")
    for llm in engines.values():
        llm.close()


def _kept(llm: Any) -> tuple[int, int]:
    """(proposed, kept) tokens so far, over every method."""
    counts = llm.stats().speculation
    return sum(c.draft_tokens for c in counts), sum(c.accepted_tokens for c in counts)


if __name__ == "__main__":
    main()
