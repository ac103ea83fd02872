"""``trillm bench``: serving throughput, TTFT and inter-token latency against a same-run baseline.

It starts ``trillm serve`` in a subprocess (or uses ``--url``), drives N
concurrent streaming clients with fixed prompt/output lengths (``ignore_eos``),
then measures plain ``transformers`` ``generate`` on the same model and dtype
in this process (one request, and statically batched N), and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from trillm.bench.options import server_environment, swept_values
from trillm.bench.peers import Peer, parse_peer, resident_mib, served_model
from trillm.bench.report import RunResult, table
from trillm.bench.server_probe import server_step_bytes, wait_healthy, wait_weights_read


def _prompt(tokenizer: Any, n_tokens: int, rng: random.Random) -> str:
    """Text of exactly ``n_tokens`` tokens (checked by round trip), different for every client."""
    words = ["river", "stone", "cloud", "garden", "lamp", "window", "forest", "paper", "signal", "harbor"]
    text = ""
    while True:
        candidate = text + " " + rng.choice(words)
        if len(tokenizer(candidate)["input_ids"]) > n_tokens:
            return text
        text = candidate


async def sse_events(http: Any, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of one streamed request (``data: {...}`` lines, until ``[DONE]``)."""
    async with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def timed_stream(
    http: Any, path: str, body: dict[str, Any], text: Callable[[dict[str, Any]], Any], started: trio.Event | None = None
) -> tuple[float, list[float], int]:
    """One streaming request's (ttft, inter-token gaps, completion tokens); ``text`` gives a
    choice's new text (a completion's or a chat delta's). The gaps are per token: a chunk that
    carries several (speculation's kept runs: the running usage every chunk reports, which the
    body asks for, says how many) counts its gap once per token, split evenly. ``started`` is
    set once 5 chunks have come."""
    body = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    t0 = time.perf_counter()
    ttft, last, gaps, tokens, seen, counted = float("nan"), 0.0, [], 0, 0, 0
    async for event in sse_events(http, path, body):
        usage = event.get("usage") or {}
        if usage:
            tokens = usage["completion_tokens"]
        if event.get("choices") and text(event["choices"][0]):
            now = time.perf_counter()
            carried = max(1, tokens - counted) if usage else 1  # a server without running usage: one
            counted += carried
            if seen == 0:
                ttft = now - t0
            else:
                gaps.extend([(now - last) / carried] * carried)
            last, seen = now, seen + 1
            if seen == 5 and started is not None:
                started.set()
    return ttft, gaps, tokens or seen  # a server that reports no usage: one token per event


async def _stream_one(
    http: Any, model: str, prompt: str, max_tokens: int, started: trio.Event | None, extra: dict[str, Any]
) -> tuple[float, list[float], int]:
    """One streaming completion (``timed_stream``)."""
    body = {
        "model": model,
        "prompt": prompt,  # a completion: the same prompt tokens on every server, no chat template
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
        **extra,
    }
    return await timed_stream(http, "/v1/completions", body, lambda choice: choice.get("text"), started)


async def _serving_run(
    url: str, model: str, prompts: list[str], output_len: int, probe_prompt: str, extra: dict[str, Any]
) -> RunResult:
    """Every client at once (each with ``extra`` in its body), plus one newcomer once all stream."""
    import httpx

    results: list[tuple[float, list[float], int]] = []
    probe: list[float] = []
    limits = httpx.Limits(max_connections=len(prompts) + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        all_started = [trio.Event() for _ in prompts]

        async def client(i: int) -> None:
            results.append(await _stream_one(http, model, prompts[i], output_len, all_started[i], extra))

        async def prober() -> None:
            for event in all_started:
                await event.wait()
            ttft, _, _ = await _stream_one(http, model, probe_prompt, 8, None, {})
            probe.append(ttft)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(client, i)
            if len(prompts) > 1:
                nursery.start_soon(prober)
        # The probe's own 8 tokens finish inside the window; count only the clients.
        seconds = time.perf_counter() - t0
    return RunResult(
        "trillm (HTTP, streaming)",
        len(prompts),
        sum(r[2] for r in results),
        seconds,
        tuple(r[0] for r in results),
        tuple(g for r in results for g in r[1]),
        probe[0] if probe else None,
    )


async def _stream_one_plain(url: str, model: str, prompt: str) -> None:
    """A warm-up request: the prompt, two tokens, nothing measured."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await _stream_one(http, model, prompt, 2, None, {})


def _baseline(
    model_dir: Any, dtype: Any, prompts_ids: list[list[int]], output_len: int, config: dict[str, Any] | None = None
) -> RunResult:
    """transformers ``generate``; with ``config`` (dummy weights) a randomly initialised model of that shape.
    ``model_dir``: what ``from_pretrained`` takes, (a folder, its keywords: ``gguf_file`` for a GGUF file)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        if config is not None:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype).eval()
        else:
            folder, extra = model_dir
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).eval()
    model = model.to(device)
    batch = torch.tensor(prompts_ids, device=device)
    kwargs = dict(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=True,
        temperature=0.8,
        pad_token_id=0,
        attention_mask=torch.ones_like(batch),
    )
    with torch.inference_mode():
        model.generate(batch[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm up
        t0 = time.perf_counter()
        out = model.generate(batch, **kwargs)
        seconds = time.perf_counter() - t0
    produced = (out.shape[1] - batch.shape[1]) * batch.shape[0]
    label = "transformers generate (static batch)" if len(prompts_ids) > 1 else "transformers generate"
    return RunResult(label, len(prompts_ids), produced, seconds)


def _peer_runs(
    peer: Peer,
    model: str,
    prompts: list[str],
    levels: list[int],
    output_len: int,
    step_bytes: int | None,
    warm_up: str,
) -> list[RunResult]:
    """The same load on another server (its own model name); the weight bytes per step are trillm's
    (the same file), for the bandwidth share."""
    wait_healthy(peer.url, None)
    name = served_model(peer.url, model)
    trio.run(partial(_stream_one_plain, peer.url, name, warm_up))
    rows = []
    for level in levels:
        result = trio.run(partial(_serving_run, peer.url, name, prompts[:level], output_len, prompts[-1], {}))
        label = f"{peer.name} (HTTP, streaming)"
        rows.append(attrs.evolve(result, label=label, step_bytes=step_bytes, rss_mib=resident_mib(peer.pid)))
        print(f"[bench] {label} c={level}: {rows[-1].tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def run_bench(args: argparse.Namespace) -> None:
    import torch

    from trillm.bench.extra import llama_cpp_single_stream, memory_bandwidth, plot
    from trillm.bench.structured import compile_report, load_schema, mask_counters, mask_report, response_format
    from trillm.engine import (
        DEFAULT_ALIAS,
        EngineConfig,
        ModelShape,
        choose_model_dtype,
        converted_default,
        default_gguf,
        from_env,
        gemms_in_bf16,
        gguf_file,
        load_tokenizer,
        overrides_from,
        resolve_model,
    )

    try:
        peers = [parse_peer(text) for text in args.peer]
    except ValueError as error:
        raise SystemExit(str(error)) from None
    given = overrides_from(args, EngineConfig)  # the engine flags given; the servers get these too
    base = from_env(EngineConfig, **given)  # as `trillm serve` reads them: flags, then TRILLM_*, then defaults
    dummy = base.load_format == "dummy"
    config_path = Path(base.model) / "config.json" if Path(base.model).is_dir() else Path(base.model)
    cache = base.cache_path
    memory = args.url is None  # a running server holds the model: only its metadata is read here
    try:  # a model that cannot be served here: its one line, as `trillm serve` says it
        model_dir = resolve_model(DEFAULT_ALIAS if dummy else base.model, cache, memory)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"trillm bench: {error}") from None
    # What transformers loads for the baseline: the GGUF file itself (the alias's as its conversion), or the folder.
    gguf = None if dummy else gguf_file(base.model, cache)
    baseline_source: Any = (model_dir, {})
    if base.model == DEFAULT_ALIAS and not dummy:
        baseline_source = (converted_default(cache), {})
    elif gguf is not None:
        baseline_source = (gguf.parent, {"gguf_file": gguf.name})
    # The tokenizer and config the servers use (a GGUF file's from its own keys: transformers
    # cannot build every family's tokenizer from a folder of its file).
    tokenizer, _, model_config = load_tokenizer(base, memory)
    levels = [int(c) for c in args.concurrency.split(",")]
    structured = args.structured.split(",")
    if not set(structured) <= {"on", "off"} or ("on" in structured and structured[0] != "off" and len(structured) > 1):
        raise SystemExit(f"--structured takes off, on or off,on, not {args.structured!r}")
    schema = load_schema(args.json_schema)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    formats = swept_values(args, base, "weight_format")
    # The engine's own choice (for the first server's weight format), so both sides use the same dtype.
    dtype = choose_model_dtype(attrs.evolve(base, weight_format=formats[0]), device, memory).dtype
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    rng = random.Random(0)
    shared = _prompt(tokenizer, args.shared_prefix_len, random.Random(1)) if args.shared_prefix_len else ""
    prompts = [shared + _prompt(tokenizer, args.prompt_len, rng) for _ in range(max(levels))]
    prompts.append(shared + _prompt(tokenizer, args.probe_len or args.prompt_len, rng))  # the newcomer
    # One request each server answers before it is measured, as long as the longest prompt but of other
    # words (no prefix-cache hit): first-request costs (vLLM warms up at start) stay out of every row.
    warm_up = _prompt(tokenizer, max(args.prompt_len, args.probe_len or 0), random.Random(7))
    print(
        f"[bench] model={base.model} dtype={dtype_name} prompt={args.shared_prefix_len}+{args.prompt_len} "
        f"output={args.output_len} prefix_cache={base.prefix_cache} "
        f"threads={torch.get_num_threads()} levels={levels}",
        file=sys.stderr,
        flush=True,
    )

    # A KV pool that holds every client's whole sequence: measure batching, not preemption.
    shape = ModelShape.from_config(model_config)
    per_token = shape.kv_bytes_per_token(dtype)
    tokens = (max(levels) + 1) * (args.shared_prefix_len + args.prompt_len + args.output_len + 32)
    kv_mb = max(512, int(1.2 * tokens * per_token / 2**20))
    rows: list[RunResult] = []
    overlap_text = args.overlap or ("on" if base.overlap_schedule else "off")
    overlaps = overlap_text.split(",")
    if not set(overlaps) <= {"on", "off"}:
        raise SystemExit(f"--overlap takes on, off or on,off, not {overlap_text!r}")
    tps, dps = swept_values(args, base, "tp"), swept_values(args, base, "dp")
    servers = (
        [(f, o, t, d) for f in formats for o in overlaps for t in tps for d in dps]
        if args.url is None
        else [(None, None, 1, 1)]
    )
    server_bytes: int | None = None
    for weight_format, overlap, tp, dp in servers:
        proc = None
        url = args.url
        if url is None:
            url = f"http://127.0.0.1:{args.port}"
            # Bench's own sizing (a seat and pages for every client) unless the flags said otherwise.
            sized = {"max_num_seqs": max(levels) + 1, "kv_cache_bytes": kv_mb * 2**20} | given
            run = dict(weight_format=weight_format, overlap_schedule=overlap == "on", tp=tp, dp=dp)
            # The dtype is pinned to the baseline's; the wide steps' GEMMs as `serve` with these flags would run them.
            gemm = "bfloat16" if gemms_in_bf16(base) else "float32"
            server = attrs.evolve(base, **{**sized, **run, "dtype": dtype_name, "gemm_dtype": gemm})
            proc = subprocess.Popen(
                [sys.executable, "-m", "trillm.api.cli", "serve", "--port", str(args.port)],
                env={**os.environ, **server_environment(server)},
            )
        try:
            wait_healthy(url, proc)
            if args.cancel_heavy:
                from trillm.bench.cancel import cancel_heavy

                report = trio.run(partial(cancel_heavy, url, base.model, prompts[: levels[0]], args.cancel_heavy))
                print(json.dumps(report, indent=1))
                return
            server_bytes = server_step_bytes(url)
            wait_weights_read(url)
            trio.run(partial(_stream_one_plain, url, base.model, warm_up))
            label = (
                "trillm (HTTP, streaming)"
                + (f", {weight_format} weights" if len(formats) > 1 else "")
                + (f", overlap {overlap}" if len(overlaps) > 1 else "")
                + (f", tp {tp}" if len(tps) > 1 or tp > 1 else "")
                + (f", dp {dp}" if len(dps) > 1 or dp > 1 else "")
            )
            for level in levels:
                for mode in structured:
                    extra = {"response_format": response_format(schema)} if mode == "on" else {}
                    name = label + (", json_schema" if mode == "on" else "")
                    before = mask_counters(url)
                    result = trio.run(
                        partial(_serving_run, url, base.model, prompts[:level], args.output_len, prompts[-1], extra)
                    )
                    # one process's memory: ranks and replicas (tp, dp > 1) are others, so none is shown then
                    rss = resident_mib(proc.pid if proc is not None and tp == 1 and dp == 1 else None)
                    result = attrs.evolve(result, label=name, step_bytes=server_bytes, rss_mib=rss)
                    print(f"[bench] {name} c={level}: {result.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
                    rows.append(result)
                    if mode == "on":
                        plain = next(r for r in reversed(rows) if r.label == label and r.concurrency == level)
                        print(mask_report(url, before, level, result, plain), file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)

    for peer in peers:
        rows += _peer_runs(peer, base.model, prompts, levels, args.output_len, server_bytes, warm_up)

    baselines: dict[int, RunResult] = {}
    if not args.no_baseline:
        for level in levels:
            ids = [tokenizer(p)["input_ids"][: args.prompt_len - 8] for p in prompts[:level]]
            width = min(len(i) for i in ids)
            result = _baseline(
                baseline_source, dtype, [i[:width] for i in ids], args.output_len, model_config if dummy else None
            )
            print(f"[bench] {result.label} c={level}: {result.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
            baselines[level] = result
            rows.append(result)
    if args.llama_cpp:
        gguf = default_gguf(cache)
        tokens, seconds = llama_cpp_single_stream(
            args.llama_cpp, gguf, prompts[0], args.output_len, torch.get_num_threads()
        )
        rows.append(RunResult("llama.cpp (llama-cpp-python, Q4_1 GGUF)", 1, tokens, seconds))
        print(f"[bench] llama.cpp c=1: {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    if "on" in structured:
        print(compile_report(tokenizer, model_dir, model_config, schema), file=sys.stderr, flush=True)
    bandwidth = memory_bandwidth(device)
    step_bytes = server_bytes or shape.dense_projection_bytes(dtype)  # the served model's, blocks and experts counted
    print(
        f"[bench] device={device} copy bandwidth {bandwidth / 1e9:.1f} GB/s; one decode step reads "
        f">= {step_bytes / 1e6:.0f} MB of weights",
        file=sys.stderr,
        flush=True,
    )
    print(table(rows, baselines, step_bytes, bandwidth))
    if args.plot:
        plot(
            rows,
            args.plot,
            f"{base.model if not dummy else config_path.name} ({dtype_name}, {device.type}, "
            f"{args.prompt_len} in / {args.output_len} out)",
        )
