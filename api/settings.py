"""The HTTP layer's settings, declared once beside the engine's (``trillm.engine.config``).

``trillm serve`` takes both as flags; ``hypercorn -k trio 'trillm.api.app:create_app()'``
takes both from ``TRILLM_*`` variables. Later: API keys, CORS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from trillm.api.reasoning import REASONING_PARSERS
from trillm.api.tools.formats import PARSER_CHOICES
from trillm.engine.config import EngineConfig
from trillm.engine.settings import from_env, markdown_table, setting


def _not_negative(_: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0")


def _positive(_: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be >= 1")


@attrs.frozen
class ServerConfig:
    """What the HTTP front door needs; the engine never sees it."""

    host: str = setting("127.0.0.1", "address `trillm serve` listens on (hypercorn takes `-b` instead)")
    port: int = setting(8000, "port `trillm serve` listens on")
    served_model_name: str | None = setting(None, "the id clients must send as `model`", doc_default="the model string")
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
        "(`[TOOL_CALLS]`), or `generic` (tools described in the system prompt, replies in JSON; any model); "
        "`auto`: from the chat template",
        choices=PARSER_CHOICES,
    )
    reasoning_parser: str | None = setting(
        None,
        "split chat replies into `reasoning_content` (the `<think>` part) and `content`: `deepseek_r1` (thinking "
        "until `</think>`, the opening tag optional) or `qwen3` (thinking only when the reply opens with `<think>`)",
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
