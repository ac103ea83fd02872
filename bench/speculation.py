"""Speculative decoding's speed: each ``--speculative`` mode beside ``off``, on work it helps and work it cannot.

    python -m trillm.bench.speculation [--model M] [--modes off,auto,ngram] [--concurrency 1,8] [--rounds 3]
    python -m trillm.bench.speculation --server trillm-off=URL --server trillm-auto=URL --server llama-ngram=URL ...

Five workloads, greedy (so every mode emits the same tokens, and tokens/s compare; offline, each
turn's outputs are checked equal across the modes and the table says so): ``chat`` (open
questions: little to propose), ``repeat`` (lists and text asked back: prompt lookup finds the
answer in the prompt), ``edit`` (a code file to change, with the file itself as OpenAI's
predicted output), ``agent`` (a multi-turn conversation whose next turn repeats parts of earlier
ones: a plan of tool calls written again, changed) and ``rag`` (an answer quoted from retrieved
passages). Offline (the default): one engine per mode in this process. With ``--server``:
OpenAI-compatible servers driven over HTTP, streaming chat completions (any server: trillm, or a
peer such as ``llama-server --spec-type ngram-mod``), which adds the time to first token and the
inter-token latency. The modes (or servers) take turns request batch by request batch,
``--rounds`` times, and each one's tokens over its seconds in all turns is printed with its ratio
to the first one (this VM's timings move by 15-30 % from minute to minute: taking turns keeps that
out of the ratios). Each turn asks the next requests of the workload, round its list, so a turn
repeats a request an earlier one made (which the suffix cache knows token for token) only once the
list has gone round: with ``--rounds`` up to 3 at one stream (``edit`` and ``agent`` have 3,
``repeat`` and ``rag`` 4, ``chat`` 48; 32 streams of chat repeat 16 of theirs in the second turn).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import attrs
import trio

# a source file of ~350 tokens (SmolLM2's tokenizer): the edit workload asks for it back with one change
CODE = """import json
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1
    tags: list[str] = field(default_factory=list)


def load_items(path):
    with open(path) as f:
        rows = json.load(f)
    return [Item(**row) for row in rows]


def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def by_tag(items, tag):
    return [item for item in items if tag in item.tags]


def restock(items, amount):
    for item in items:
        if item.quantity < amount:
            item.quantity = amount
    return items


def summary(items):
    lines = []
    for item in sorted(items, key=lambda i: i.name):
        lines.append(f"{item.name}: {item.quantity} at {item.price:.2f}")
    return "\\n".join(lines)


if __name__ == "__main__":
    items = load_items("items.json")
    print(summary(items))
    print(total_price(items, 0.2))
"""

PASSAGES = (
    "[1] The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 metres tall and was "
    "the tallest man-made structure in the world until 1930.\n"
    "[2] The Statue of Liberty was a gift from France to the United States, dedicated on October 28, 1886. "
    "It was designed by Frederic Auguste Bartholdi, and its metal framework was built by Gustave Eiffel.\n"
    "[3] The Golden Gate Bridge opened in 1937. Its main span is 1,280 metres long, and it was the longest "
    "suspension bridge main span in the world until 1964."
)
PLAN = (
    '{"steps": [{"id": 1, "tool": "search", "query": "flights from Paris to Rome on May 3"}, '
    '{"id": 2, "tool": "search", "query": "hotels near the Colosseum for May 3 to May 6"}, '
    '{"id": 3, "tool": "book", "item": "cheapest direct flight"}]}'
)


def _agent(change: str) -> list[dict[str, str]]:
    """A few turns of an agent's work: the user asks again for the plan, changed."""
    return [
        {"role": "system", "content": "You are a travel agent. You answer with a JSON plan of tool calls."},
        {"role": "user", "content": "Plan my trip from Paris to Rome on May 3, three nights."},
        {"role": "assistant", "content": PLAN},
        {"role": "user", "content": f"Tool results: 12 flights, 40 hotels. Write the whole plan again, {change}."},
    ]


# (a user's message, or a whole conversation; the predicted output, if any)
Item = tuple[str | list[dict[str, str]], str | None]
WORKLOADS: dict[str, list[Item]] = {
    # a question never asked before in the run: what earlier requests wrote is no help (suffix)
    "chat": [
        (f"{ask} {topic}.", None)
        for ask in ("Explain in simple terms", "Write a short paragraph about", "Give three facts about")
        for topic in (
            "how photosynthesis works",
            "the water cycle",
            "why the sky is blue",
            "how bees make honey",
            "the history of the bicycle",
            "how volcanoes form",
            "what a black hole is",
            "how vaccines train the immune system",
            "the life of a river otter",
            "how a compass works",
            "why leaves change colour in autumn",
            "how bread rises",
            "the first airplane flight",
            "how tides happen",
            "what makes a good night's sleep",
            "how glass is made",
        )
    ],
    "repeat": [
        ("Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape.", None),
        ("Copy this sentence five times: The quick brown fox jumps over the lazy dog.", None),
        ("Write the numbers from one to twenty in words, separated by commas.", None),
        ("Repeat after me twice: To be, or not to be, that is the question.", None),
    ],
    "edit": [
        (f"Here is my code:\n\n{CODE}\nRepeat the whole code with one change: {change}.", CODE)
        for change in (
            "rename the function cheapest to lowest_price",
            "the restock function should add amount to the quantity",
            "change the tax rate in the main block to 0.25",
        )
    ],
    "agent": [
        (_agent("with May 4 instead of May 3"), None),
        (_agent("adding a step 4 that books the hotel"), None),
        (_agent("unchanged"), None),
    ],
    "rag": [
        (f"Passages:\n{PASSAGES}\n\nQuote the passage that says {question}, word for word, then cite it.", None)
        for question in (
            "who built the frame of the Statue of Liberty",
            "how tall the Eiffel Tower is",
            "when the Golden Gate Bridge opened",
        )
    ],
}


MAX_TOKENS = {"edit": 512}  # the file again and a little more
OTHER_MAX_TOKENS = 160


def _items(workload: str, concurrency: int, turn: int) -> list[Item]:
    """The requests of one turn: each turn the next ones, round the list (the workloads are about
    what is in their prompts, not about a request asked again, whose reply the suffix cache
    would hold token for token)."""
    items = WORKLOADS[workload]
    return [items[(turn * concurrency + i) % len(items)] for i in range(concurrency)]


def _max_tokens(workload: str) -> int:
    return MAX_TOKENS.get(workload, OTHER_MAX_TOKENS)


def _messages(item: str | list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"role": "user", "content": item}] if isinstance(item, str) else item


@attrs.frozen
class Turn:
    """One batch of requests through one target: its wall time, tokens, and (over HTTP) each
    request's time to first token and gaps between streamed chunks."""

    seconds: float
    tokens: int
    ttfts: tuple[float, ...] = ()
    gaps: tuple[float, ...] = ()
    outputs: tuple[tuple[int, ...], ...] = ()  # offline: each request's tokens, for the greedy check


class OfflineTarget:
    """An engine in this process speculating ``mode``."""

    def __init__(self, model: str, mode: str, num_tokens: int) -> None:
        from trillm import LLM

        self.name = mode
        self.llm = LLM(model=model, speculative=mode, num_speculative_tokens=num_tokens)

    def run(self, workload: str, concurrency: int, turn: int) -> Turn:
        from trillm import SamplingParams

        tok = self.llm.get_tokenizer()
        requests = []
        for text, prediction in _items(workload, concurrency, turn):
            chat = _messages(text)
            ids = tok(
                tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )
            predicted = tuple(tok(prediction, add_special_tokens=False)["input_ids"]) if prediction else ()
            requests.append(
                (
                    ids["input_ids"],
                    SamplingParams(max_tokens=_max_tokens(workload), temperature=0, prediction=predicted),
                )
            )
        start = time.perf_counter()
        results = self.llm.generate([ids for ids, _ in requests], [p for _, p in requests], use_tqdm=False)
        outputs = tuple(tuple(r.outputs[0].token_ids) for r in results)
        return Turn(time.perf_counter() - start, sum(map(len, outputs)), outputs=outputs)

    def kept(self) -> tuple[int, int] | None:
        """(proposed, kept) tokens so far, over every method."""
        counts = self.llm.stats().speculation
        return sum(c.draft_tokens for c in counts), sum(c.accepted_tokens for c in counts)

    def close(self) -> None:
        self.llm.close()


class ServerTarget:
    """An OpenAI-compatible server, driven with streaming chat completions."""

    def __init__(self, name: str, url: str) -> None:
        from trillm.bench.peers import served_model

        self.name, self.url = name, url.rstrip("/")
        self.model = served_model(self.url, "default")

    def run(self, workload: str, concurrency: int, turn: int) -> Turn:
        return trio.run(self._run, workload, concurrency, turn)

    async def _run(self, workload: str, concurrency: int, turn: int) -> Turn:
        import httpx

        from trillm.bench.run import timed_stream

        items = _items(workload, concurrency, turn)
        results: list[tuple[float, list[float], int]] = []
        async with httpx.AsyncClient(base_url=self.url, timeout=600) as http:

            async def one(text: str | list[dict[str, str]], prediction: str | None) -> None:
                body: dict[str, Any] = {
                    "model": self.model,
                    "messages": _messages(text),
                    "max_tokens": _max_tokens(workload),
                    "temperature": 0,
                    "stream": True,
                }
                if prediction:
                    body["prediction"] = {"type": "content", "content": prediction}
                timed = await timed_stream(
                    http, "/v1/chat/completions", body, lambda choice: choice.get("delta", {}).get("content")
                )
                results.append(timed)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for text, prediction in items:
                    nursery.start_soon(one, text, prediction)
            seconds = time.perf_counter() - start
        return Turn(
            seconds, sum(r[2] for r in results), tuple(r[0] for r in results), tuple(g for r in results for g in r[1])
        )

    def kept(self) -> tuple[int, int] | None:
        return None

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="off,auto,ngram", help="offline: the engines' --speculative values")
    parser.add_argument("--server", action="append", default=[], help="NAME=URL of a server (instead of --modes)")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--workloads", default="chat,repeat,edit,agent,rag")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    args = parser.parse_args()
    targets: list[Any] = [ServerTarget(*spec.split("=", 1)) for spec in args.server] or [
        OfflineTarget(args.model, m, args.num_speculative_tokens) for m in args.modes.split(",")
    ]
    names = [t.name for t in targets]
    http = bool(args.server)
    print(f"tokens/s over {args.rounds} turns (ratio to {names[0]})" + ("; ITL p50 ms; TTFT p50 s" if http else ""))
    print(f"| workload | streams | {' | '.join(names)} |" + ("" if http else " proposed tokens kept | greedy equal |"))
    print(f"|---|---:|{'---:|' * len(names)}" + ("" if http else "---:|---|"))
    for workload in args.workloads.split(","):
        for concurrency in map(int, args.concurrency.split(",")):
            turns: dict[str, list[Turn]] = {n: [] for n in names}
            before = {t.name: t.kept() for t in targets}
            for turn in range(args.rounds):
                for target in targets:  # every target gets the same requests in a turn
                    turns[target.name].append(target.run(workload, concurrency, turn))
            # all turns' tokens over all their seconds: the turns are different requests (a median of
            # per-turn speeds picked between requests of 10 and 160 tokens)
            speeds = {n: sum(t.tokens for t in turns[n]) / sum(t.seconds for t in turns[n]) for n in names}
            cells = []
            for n in names:
                cell = f"{speeds[n]:.1f} ({speeds[n] / speeds[names[0]]:.2f}x)"
                if http:
                    gaps = [g for t in turns[n] for g in t.gaps]
                    ttfts = [x for t in turns[n] for x in t.ttfts]
                    cell += (
                        f"; {1000 * statistics.median(gaps or [0.0]):.1f} ms; {statistics.median(ttfts or [0.0]):.2f} s"
                    )
                cells.append(cell)
            line = f"| {workload} | {concurrency} | {' | '.join(cells)} |"
            if not http:
                rates = []
                for target in targets:
                    k, b = target.kept(), before[target.name]
                    if k and b and k[0] > b[0]:
                        rates.append(f"{target.name}: {(k[1] - b[1]) / (k[0] - b[0]):.0%}")
                same = all(t.outputs == turns[names[0]][i].outputs for n in names for i, t in enumerate(turns[n]))
                line += f" {', '.join(rates) or '-'} | {'yes' if same else 'NO'} |"
            print(line, flush=True)
    for target in targets:
        target.close()


if __name__ == "__main__":
    main()
