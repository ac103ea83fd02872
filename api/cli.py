"""``trillm`` command line: ``serve`` (embedded Hypercorn) and ``bench``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from functools import partial

import trio

from trillm.api.settings import config_from_env, env_documentation
from trillm.engine.config import DEVICES, KERNELS, LOAD_FORMATS, WEIGHT_FORMATS


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API",
                       epilog="Environment variables (flags win):\n" + env_documentation(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="alias (smollm2-135m-instruct), HF folder, or .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--page-size", type=int)
    p.add_argument("--num-pages", type=int)
    p.add_argument("--kv-cache-mb", type=float, help="memory for the KV pool (default 512)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--max-waiting", type=int, help="queued requests beyond this get 503 + Retry-After")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--served-model-name")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                   help="do not reuse KV pages between requests")
    p.add_argument("--request-timeout", type=float, help="seconds per generation request (default: none)")
    p.add_argument("--device", choices=list(DEVICES), help="auto: cuda when present, else cpu")
    p.add_argument("--kernels", choices=list(KERNELS),
                   help="auto: Triton on CUDA, the CPU fast path on CPUs; reference: plain torch (debugging)")
    p.add_argument("--load-format", choices=list(LOAD_FORMATS),
                   help="dummy: random weights for --model's config.json (a file or folder), for benchmarks")
    p.add_argument("--tokenizer", help="model alias or folder to read the tokenizer from (dummy models)")
    p.add_argument("--weight-format", choices=list(WEIGHT_FORMATS),
                   help="auto: weights that are exact GGUF Q4_1/Q8_0 blocks stay blocks on the CPU (same values, "
                        "about 5x fewer bytes per step); dense: float32 matrices")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="on GPUs, run decode steps without CUDA graphs (debugging)")
    p.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false", default=None,
                   help="schedule each step only after the one before returns (debugging)")


async def serve(app, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; then end open streams with a final chunk and exit.

    The engine is stopped before Hypercorn, so every stream gets its last
    chunk and ``[DONE]`` before the connections close.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = 5

    async def shutdown_trigger() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        print("[trillm] shutting down: ending open streams", file=sys.stderr, flush=True)
        await app.extensions["trillm_host"].stop()

    print(f"[trillm] serving {app.extensions['trillm_host'].engine.config.model_name} on http://{host}:{port}",
          file=sys.stderr, flush=True)
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trillm")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from trillm.bench.run import add_parser as add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    if args.command == "serve":
        from trillm.api.app import create_app

        config = config_from_env(
            model=args.model, dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
            kv_cache_bytes=int(args.kv_cache_mb * 1024 * 1024) if args.kv_cache_mb else None,
            max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens, max_waiting=args.max_waiting,
            max_model_len=args.max_model_len, served_model_name=args.served_model_name, prefix_cache=args.prefix_cache,
            device=args.device, kernels=args.kernels, load_format=args.load_format, tokenizer=args.tokenizer,
            weight_format=args.weight_format, enforce_eager=args.enforce_eager,
            overlap_schedule=args.overlap_schedule,
        )
        app = create_app(config=config, request_timeout=args.request_timeout or None)
        trio.run(partial(serve, app, args.host, args.port))
    elif args.command == "bench":
        from trillm.bench.run import run_bench

        run_bench(args)


if __name__ == "__main__":
    main()
