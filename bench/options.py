"""``trillm bench``'s flags: its own (the load, the sweeps, the baselines) beside every engine
setting, taken from the settings' declarations exactly as ``trillm serve`` takes them.

The server a run starts gets the engine's whole configuration as ``TRILLM_*`` variables
(``server_environment``), so bench and server read one configuration: flags, then the
environment, then the declared defaults. ``--tp``, ``--dp`` and ``--weight-format`` also take
a comma list (one server run per value), and ``--overlap on,off`` sweeps the overlap schedule.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trillm.engine import EngineConfig, Setting, add_arguments, settings_of

# Engine settings a run can sweep: the flag takes a comma list, one server per value.
SWEPT = ("tp", "dp", "weight_format")


def add_parser(sub: argparse._SubParsersAction) -> None:
    # "resolve": a swept setting's comma-list flag replaces the one ``add_arguments`` declared.
    p = sub.add_parser(
        "bench",
        help="benchmark serving against transformers generate",
        description="Benchmark serving against transformers generate. Every engine flag of `trillm serve` "
        "applies to the servers it starts (and may be given as its environment variable instead).",
        conflict_handler="resolve",
    )
    add_arguments(p, EngineConfig)
    swept = p.add_argument_group("engine settings swept (a comma list: one server run per value)")
    for s in settings_of(EngineConfig):
        if s.name in SWEPT:
            swept.add_argument(s.flag, dest=f"{s.name}_values", metavar="LIST", help=f"{s.help} [{s.env}]")
    swept.add_argument(
        "--overlap",
        default=None,
        help="comma-separated on/off: one server run each, with or without --disable-overlap-schedule",
    )
    own = p.add_argument_group("the load and what it is measured against")
    own.add_argument("--concurrency", default="1,32", help="comma-separated client counts")
    own.add_argument("--prompt-len", type=int, default=128)
    own.add_argument("--output-len", type=int, default=128)
    own.add_argument("--url", help="benchmark a running server instead of starting one")
    own.add_argument("--port", type=int, default=8123)
    own.add_argument("--no-baseline", action="store_true", help="skip transformers generate")
    own.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of one shared 'system prompt' put before every client's prompt",
    )
    own.add_argument(
        "--cancel-heavy",
        type=float,
        metavar="SECONDS",
        help="run the stop-and-retry workload for this long instead (uses the first --concurrency)",
    )
    own.add_argument(
        "--probe-len",
        type=int,
        default=None,
        help="prompt tokens of the newcomer sent once every client streams (default: --prompt-len)",
    )
    own.add_argument(
        "--structured",
        default="off",
        help="comma-separated off/on: one pass each per concurrency on the same server; on: every client "
        "asks for the same json_schema (reports the ratio to off, the mask cost per step, compile times)",
    )
    own.add_argument("--json-schema", type=Path, help="the schema for --structured on (default: a long records array)")
    own.add_argument("--plot", type=Path, help="write a PNG of tokens/s against concurrency here")
    own.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=URL[,pid=PID]",
        help="another OpenAI-compatible server (llama-server, vLLM) driven with the same load after trillm's runs; "
        "with pid, its resident memory is read too (repeatable)",
    )
    own.add_argument(
        "--llama-cpp",
        metavar="PYTHON",
        help="a Python with llama-cpp-python installed: adds llama.cpp's single stream on the Q4_1 GGUF",
    )


def swept_values(args: argparse.Namespace, config: EngineConfig, name: str) -> list[Any]:
    """The values a swept setting takes, each parsed as its declaration says; the configured one
    (flag-less: the environment's or the default) when not given."""
    (s,) = (s for s in settings_of(EngineConfig) if s.name == name)
    text = getattr(args, f"{name}_values")
    if text is None:
        return [getattr(config, name)]
    try:
        return [s.parse(item) for item in text.split(",")]
    except ValueError as exc:
        raise SystemExit(f"{s.flag} {text!r}: {exc}") from None


def server_environment(config: EngineConfig) -> dict[str, str]:
    """Every engine setting of ``config`` as the ``TRILLM_*`` variable ``trillm serve`` reads."""
    return {s.env: _text(s, getattr(config, s.name)) for s in settings_of(EngineConfig)}


def _text(s: Setting, value: Any) -> str:
    """The text ``Setting.parse`` reads back as ``value``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if s.many:
        return ",".join(str(v) for v in value)
    if s.scale != 1:
        scaled = value / s.scale
        return str(int(scaled)) if scaled == int(scaled) else repr(scaled)
    return str(value)
