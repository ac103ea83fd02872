"""The HTTP layer's settings, declared once beside the engine's (``trillm.engine.config``).

``trillm serve`` takes both as flags; ``hypercorn -k trio 'trillm.api.app:create_app()'``
takes both from ``TRILLM_*`` variables. The front door's (keys, per-key limits, CORS) are
applied by ``trillm.api.front_door``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from trillm.api.reasoning import REASONING_PARSERS
from trillm.api.tools.formats import PARSER_CHOICES
from trillm.engine import EngineConfig, from_env, markdown_table, setting


def _not_negative(_: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0")


def _positive(_: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be >= 1")


def _root_path(_: Any, attribute: attrs.Attribute, value: str) -> None:
    if value and not value.startswith("/"):
        raise ValueError(f"{attribute.name} must start with / (got {value!r})")


@attrs.frozen
class ServerConfig:
    """What the HTTP front door needs; the engine never sees it."""

    host: str = setting("127.0.0.1", "address `trillm serve` listens on (hypercorn takes `-b` instead)")
    port: int = setting(8000, "port `trillm serve` listens on")
    # How `trillm serve` runs Hypercorn (api/cli.py `hypercorn_config`; docs/deploy.md).
    backlog: int = setting(
        2048,
        "connections the kernel queues before `trillm serve` accepts them (capped by `net.core.somaxconn`)",
        validator=_positive,
    )
    keep_alive_timeout: float = setting(
        5.0,
        "seconds an idle connection stays open, before its first request and between requests; then it is closed",
        validator=_not_negative,
    )
    body_timeout: float | None = setting(
        60.0,
        "seconds a request's body may take to arrive; then 408 and the connection is closed; 0: none",
        validator=_not_negative,
    )
    ssl_certfile: str | None = setting(
        None, "TLS certificate (PEM) for `trillm serve`; with `--ssl-keyfile`, it serves https", doc_default="none"
    )
    ssl_keyfile: str | None = setting(None, "TLS private key (PEM) for `--ssl-certfile`", doc_default="none")
    http2: bool = setting(
        True, "offer HTTP/2 to TLS clients (ALPN `h2`); off: HTTP/1.1 only over TLS", flag="--no-http2"
    )
    root_path: str = setting(
        "",
        "path prefix the API is served under behind a proxy, e.g. `/llm` (ASGI `root_path`); paths are served "
        "with it or without it (a proxy that strips it)",
        doc_default="none",
        validator=_root_path,
    )
    access_log: str | None = setting(
        None, "write an access log line per request to this file, or `-` for stdout", doc_default="none"
    )
    served_model_name: str | None = setting(None, "the id clients must send as `model`", doc_default="the model string")
    extra_model: tuple[str, ...] = setting(
        (),
        "more models served beside `--model`, each `NAME=PATH` or `PATH` (its name then the path as given): "
        "`--model` given again means this; a request is served by the model its `model` names",
    )
    models_dir: str | None = setting(
        None,
        "serve every model in this folder too: each sub-folder with a config.json, each `.gguf` file, "
        "named by the folder or the file's stem",
    )
    max_loaded_models: int = setting(
        0,
        "most models loaded at once; loading one more unloads the least recently used idle one (never "
        "`--model`'s nor a pinned one); 0: no limit",
        validator=_not_negative,
    )
    model_ttl: float = setting(
        0,
        "unload a model idle this many seconds (never `--model`'s nor a pinned one); 0: never",
        validator=_not_negative,
    )
    models_memory: float | None = setting(
        None,
        "GiB all loaded models may take together (each its weights and KV pool, `--model`'s too); loading one "
        "that would pass it first unloads the least recently used idle ones (never `--model`'s nor a pinned "
        "one); 0: no budget",
        doc_default="90% of the memory of the device they run on",
        validator=_not_negative,
    )
    park_models: int | None = setting(
        None,
        "unloaded models kept parked in host memory (weights kept, KV pool freed: vLLM's sleep mode), woken "
        "without reading their files again; the least recently parked goes first; on a CPU their weights "
        "count toward `--models-memory`; 0: none",
        doc_default="2 on a GPU, 0 on a CPU (a GGUF file reopens through its memory map)",
        validator=_not_negative,
    )
    pin: tuple[str, ...] = setting(
        (), "models never unloaded by `--max-loaded-models`, `--models-memory` or `--model-ttl`"
    )
    preload: bool = setting(False, "load every model at start (else each on its first request)")
    request_timeout: float | None = setting(
        None,
        "seconds a generation request may take from arrival; then 504 (non-streaming) or a final chunk with "
        '`finish_reason: "length"` (streaming), and its pages are freed; 0: none',
        doc_default="none",
        validator=_not_negative,
    )
    shutdown_timeout: float = setting(
        30.0,
        "on SIGTERM/SIGINT, `trillm serve` stops admitting (503 `server_draining`, `/health` 503 `draining`) and "
        "lets running requests finish for up to this many seconds; then the rest end with a final chunk",
        validator=_not_negative,
    )

    tool_call_parser: str = setting(
        "auto",
        "how the model writes tool calls: `hermes` (`<tool_call>`, Qwen/Hermes), `llama3_json`, `mistral` "
        "(`[TOOL_CALLS]`), `harmony` (gpt-oss: a commentary message `to=functions.NAME`), or `generic` (tools "
        "described in the system prompt, replies in JSON; any model); `auto`: from the chat template",
        choices=PARSER_CHOICES,
    )
    rerank_prompt: str = setting(
        "auto",
        "how `/v1/rerank` and `/v1/score` ask the model whether a document answers a query: `qwen3-reranker` (the "
        "Qwen3-Reranker template: the score is P(yes) against P(no)), `yes-no` (our own question in the model's chat "
        "template, scored the same way; any model); `auto`: `qwen3-reranker` for a model whose name says reranker "
        "and whose tokenizer has `<|im_start|>`, else `yes-no`",
        choices=("auto", "qwen3-reranker", "yes-no"),
    )
    reasoning_parser: str | None = setting(
        None,
        "split chat replies into `reasoning_content` (the `<think>` part) and `content`: `deepseek_r1` (thinking "
        "until `</think>`, the opening tag optional), `qwen3` (thinking only when the reply opens with `<think>`) "
        "or `gpt_oss` (harmony channels: `analysis` is thinking, `final` and `commentary` the answer)",
        choices=REASONING_PARSERS,
        doc_default="none",
        validator=attrs.validators.optional(attrs.validators.in_(REASONING_PARSERS)),
    )
    default_max_tokens: int | None = setting(
        None,
        "caps the default length of a generation request that sets no `max_tokens`: chat otherwise generates "
        "until end-of-sequence or the context limit, completions 16 tokens; a client's own `max_tokens` is honoured",
        doc_default="none",
        validator=_positive,
    )
    sse_ping_interval: float | None = setting(
        10.0,
        "seconds without an event after which a stream sends an SSE comment (`: ping`), so that proxies "
        "with idle timeouts keep it open while it waits in the queue or prefills; 0: never",
        validator=_not_negative,
    )

    api_key: tuple[str, ...] = setting(
        (),
        "API keys clients must send as `Authorization: Bearer <key>` on `/v1/*` and the admin routes "
        "(only `/health`, `/version`, `/openapi.json` and `/metrics` stay open); none: the server is open",
        secret=True,
    )
    api_keys_file: str | None = setting(
        None, "a file of API keys, one a line (`#` starts a comment), added to `--api-key`'s"
    )
    metrics_require_key: bool = setting(False, "`/metrics` needs an API key too")
    max_concurrent_per_key: int | None = setting(
        None,
        "most generation requests one API key may have in flight (streams count until they end); one more gets "
        "429 `rate_limit_exceeded` with `Retry-After`; applies only when API keys are set",
        doc_default="none",
        validator=_positive,
    )
    allowed_origins: tuple[str, ...] = setting(
        (), "origins browsers may call from (CORS), e.g. `https://app.example.com` or `*`; none: no CORS headers"
    )
    allowed_methods: tuple[str, ...] = setting(("GET", "POST"), "methods CORS preflights may ask for")
    allowed_headers: tuple[str, ...] = setting(
        ("*",), "request headers CORS preflights may ask for; `*`: whatever the browser asks (`Authorization` too)"
    )

    def __attrs_post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both or neither")

    @property
    def timeout_seconds(self) -> float:
        """The request timeout as a number of seconds, ``inf`` for none."""
        return self.request_timeout or math.inf


def config_from_env(env: Mapping[str, str] | None = None, **overrides: object) -> EngineConfig:
    """The engine's settings from ``TRILLM_*``; ``overrides`` that are not None (flags) win."""
    return from_env(EngineConfig, env, **overrides)


def server_config_from_env(env: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
    """The HTTP layer's settings from ``TRILLM_*``; ``overrides`` that are not None (flags) win."""
    return from_env(ServerConfig, env, **overrides)


def settings_table() -> str:
    """The README's table of every setting (``python -m trillm.api.settings`` prints it)."""
    return markdown_table(EngineConfig, ServerConfig)


if __name__ == "__main__":
    print(settings_table())
