"""Embedding throughput: ``/v1/embeddings`` of OpenAI-compatible servers, side by side, on the same inputs.

    python -m trillm.bench.embeddings --server trillm=http://127.0.0.1:8000 --server llama=http://127.0.0.1:8080

Each round sends every server the same ``--inputs`` texts (sentences of a few dozen tokens) in
requests of ``--batch`` inputs, ``--concurrency`` requests at a time; the servers take turns
round by round (this VM's speed moves by 15-30 % from minute to minute), and the median round
of each is printed: inputs/s, prompt tokens/s and the median request latency. The vectors of
every server are compared with the first one's (cosine), so a server that pools differently
shows it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import httpx
import trio

WORDS = (
    "the river carried small boats past the old mill while children watched from the bridge and "
    "a baker opened his shop to sell warm bread to the travellers who had walked all night from "
    "the hills where the wind never stops and the stars look closer than anywhere else on earth"
).split()


def texts(count: int) -> list[str]:
    """Distinct inputs of 30-50 words (no two share a long prefix: nothing comes from a cache)."""
    out = []
    for i in range(count):
        n = 30 + i % 21
        out.append(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)) + f" ({i})")
    return out


def served_model(http: httpx.Client) -> str:
    return str(http.get("/v1/models").json()["data"][0]["id"])


async def one_round(url: str, model: str, items: list[str], batch: int, concurrency: int) -> dict[str, Any]:
    latencies: list[float] = []
    vectors: dict[int, list[float]] = {}
    tokens = 0
    limiter = trio.CapacityLimiter(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def send(start: int) -> None:
            nonlocal tokens
            async with limiter:
                began = time.perf_counter()
                reply = await http.post(
                    "/v1/embeddings",
                    json={"model": model, "input": items[start : start + batch], "encoding_format": "float"},
                )
                reply.raise_for_status()
                latencies.append(time.perf_counter() - began)
                body = reply.json()
                tokens += int(body.get("usage", {}).get("prompt_tokens", 0))
                for item in body["data"]:
                    vectors[start + item["index"]] = item["embedding"]

        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for start in range(0, len(items), batch):
                nursery.start_soon(send, start)
        seconds = time.perf_counter() - began
    return {"seconds": seconds, "tokens": tokens, "latency": statistics.median(latencies), "vectors": vectors}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="append", required=True, help="NAME=URL")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    servers = [tuple(s.split("=", 1)) for s in args.server]
    models = {name: served_model(httpx.Client(base_url=url, timeout=60)) for name, url in servers}
    items = texts(args.inputs)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in servers}
    for _ in range(args.rounds):
        for name, url in servers:
            rounds[name].append(trio.run(one_round, url, models[name], items, args.batch, args.concurrency))
    shape = f"{args.inputs} inputs, {args.batch} per request, {args.concurrency} requests at a time"
    print(f"{shape}; median of {args.rounds}")
    print("| server | inputs/s | prompt tokens/s | request latency (median) | cosine to the first |")
    print("|---|---:|---:|---:|---:|")
    first = rounds[servers[0][0]][0]["vectors"]
    for name, _ in servers:
        best = sorted(rounds[name], key=lambda r: r["seconds"])[len(rounds[name]) // 2]
        vectors = best["vectors"]
        cos = statistics.mean(cosine(first[i], vectors[i]) for i in first if i in vectors)
        print(
            f"| {name} | {args.inputs / best['seconds']:.1f} | {best['tokens'] / best['seconds']:.0f} | "
            f"{best['latency'] * 1000:.0f} ms | {cos:.4f} |"
        )


if __name__ == "__main__":
    main()
