"""The engine's public face: everything a caller needs, as ``from trillm.engine import ...``.

``api/``, ``bench/`` and the offline ``trillm.LLM`` import the engine only from here, so its
modules can move without their callers noticing; ``__all__`` is the list.

Each name is imported on first use (PEP 562), not when this package is: every engine module,
rank process and grammar worker runs this file on its way to ``trillm.engine.config`` and the
like, and the whole engine (torch, transformers, xgrammar) costs seconds they need not pay.
For the same reason, and to keep the import graph free of circles, modules inside the engine
never import ``trillm.engine`` itself. ``_HOMES`` and the ``TYPE_CHECKING`` imports name the
same homes (tests/test_public_face.py holds them equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Where each public name is declared: module (under trillm.engine) -> names.
_HOMES: dict[str, tuple[str, ...]] = {
    # Running an engine: one process, or data-parallel replicas behind one front.
    "engine": ("Engine",),
    "replicas.front": ("ReplicaSet",),
    "parking": ("ParkedModel",),  # an unloaded model's weights kept on the host (sleep mode)
    "config": ("EngineConfig",),
    "scheduling.telemetry": ("EngineObserver",),
    # What a request asks for and what it gets back.
    "sampling_params": ("SamplingParams", "MAX_PRIORITY", "SEED_MIN", "SEED_MAX", "choice_params"),
    "outputs": ("RequestOutput", "EngineStats", "TokenLogprobs", "ChoiceTotals"),
    "execution.sampler": ("LOGPROB_FLOOR",),
    "mailbox": ("OutputMailbox",),
    # Why a request or the engine says no.
    "errors": ("RequestRejected", "PromptTooLong", "EngineNotRunning", "EngineOverloaded"),
    # Structured outputs: the grammar a request asks for, and its compiler.
    "structured.spec": ("GrammarSpec", "GrammarError", "GrammarCompilerBusy", "ThinkingMode"),
    "structured.compiler": ("GrammarCompiler", "CompiledGrammar"),
    # Model files: where a model comes from, its shape, its dtype, loading it.
    "execution.model_source": ("DEFAULT_ALIAS", "resolve_model", "default_gguf", "gguf_file", "converted_default"),
    "execution.shape": ("ModelShape",),
    "execution.loading": ("load_model", "load_tokenizer", "choose_model_dtype", "eos_ids_of", "gemms_in_bf16"),
    "execution.pooling": ("Pooling", "pooling_for"),  # how embeddings are pooled
    "execution.device_memory": ("device_memory",),  # the ceiling of --models-memory's default
    "execution.prefault": ("weights_pending_bytes",),  # a GGUF file's bytes still read in the background
    # Settings declared once: flags, variables, --help and the README's table derive from them.
    "settings": ("Setting", "setting", "settings_of", "from_env", "add_arguments", "overrides_from", "markdown_table"),
    # Processes: another machine's tensor-parallel ranks (`trillm serve --node-rank N`), a free port.
    "execution.launch": ("serve_node",),
    "processes": ("free_port",),
    "execution.parallel.topology": ("Topology", "join_group"),
    "execution.parallel.channel": ("StepChannel",),
    # One step's inputs as the ranks receive them (bench/step_broadcast.py measures handing them over).
    "step": ("StepInputs",),
    "execution.backends.cpu_attention": ("CpuMetadata", "DecodeRows", "PrefillSpan"),
}

__all__ = [name for names in _HOMES.values() for name in names]

if TYPE_CHECKING:
    from trillm.engine.config import EngineConfig as EngineConfig
    from trillm.engine.engine import Engine as Engine
    from trillm.engine.errors import EngineNotRunning as EngineNotRunning
    from trillm.engine.errors import EngineOverloaded as EngineOverloaded
    from trillm.engine.errors import PromptTooLong as PromptTooLong
    from trillm.engine.errors import RequestRejected as RequestRejected
    from trillm.engine.execution.backends.cpu_attention import CpuMetadata as CpuMetadata
    from trillm.engine.execution.backends.cpu_attention import DecodeRows as DecodeRows
    from trillm.engine.execution.backends.cpu_attention import PrefillSpan as PrefillSpan
    from trillm.engine.execution.device_memory import device_memory as device_memory
    from trillm.engine.execution.launch import serve_node as serve_node
    from trillm.engine.execution.loading import choose_model_dtype as choose_model_dtype
    from trillm.engine.execution.loading import eos_ids_of as eos_ids_of
    from trillm.engine.execution.loading import gemms_in_bf16 as gemms_in_bf16
    from trillm.engine.execution.loading import load_model as load_model
    from trillm.engine.execution.loading import load_tokenizer as load_tokenizer
    from trillm.engine.execution.model_source import DEFAULT_ALIAS as DEFAULT_ALIAS
    from trillm.engine.execution.model_source import converted_default as converted_default
    from trillm.engine.execution.model_source import default_gguf as default_gguf
    from trillm.engine.execution.model_source import gguf_file as gguf_file
    from trillm.engine.execution.model_source import resolve_model as resolve_model
    from trillm.engine.execution.parallel.channel import StepChannel as StepChannel
    from trillm.engine.execution.parallel.topology import Topology as Topology
    from trillm.engine.execution.parallel.topology import join_group as join_group
    from trillm.engine.execution.pooling import Pooling as Pooling
    from trillm.engine.execution.pooling import pooling_for as pooling_for
    from trillm.engine.execution.prefault import weights_pending_bytes as weights_pending_bytes
    from trillm.engine.execution.sampler import LOGPROB_FLOOR as LOGPROB_FLOOR
    from trillm.engine.execution.shape import ModelShape as ModelShape
    from trillm.engine.mailbox import OutputMailbox as OutputMailbox
    from trillm.engine.outputs import ChoiceTotals as ChoiceTotals
    from trillm.engine.outputs import EngineStats as EngineStats
    from trillm.engine.outputs import RequestOutput as RequestOutput
    from trillm.engine.outputs import TokenLogprobs as TokenLogprobs
    from trillm.engine.parking import ParkedModel as ParkedModel
    from trillm.engine.processes import free_port as free_port
    from trillm.engine.replicas.front import ReplicaSet as ReplicaSet
    from trillm.engine.sampling_params import MAX_PRIORITY as MAX_PRIORITY
    from trillm.engine.sampling_params import SEED_MAX as SEED_MAX
    from trillm.engine.sampling_params import SEED_MIN as SEED_MIN
    from trillm.engine.sampling_params import SamplingParams as SamplingParams
    from trillm.engine.sampling_params import choice_params as choice_params
    from trillm.engine.scheduling.telemetry import EngineObserver as EngineObserver
    from trillm.engine.settings import Setting as Setting
    from trillm.engine.settings import add_arguments as add_arguments
    from trillm.engine.settings import from_env as from_env
    from trillm.engine.settings import markdown_table as markdown_table
    from trillm.engine.settings import overrides_from as overrides_from
    from trillm.engine.settings import setting as setting
    from trillm.engine.settings import settings_of as settings_of
    from trillm.engine.step import StepInputs as StepInputs
    from trillm.engine.structured.compiler import CompiledGrammar as CompiledGrammar
    from trillm.engine.structured.compiler import GrammarCompiler as GrammarCompiler
    from trillm.engine.structured.spec import GrammarCompilerBusy as GrammarCompilerBusy
    from trillm.engine.structured.spec import GrammarError as GrammarError
    from trillm.engine.structured.spec import GrammarSpec as GrammarSpec
    from trillm.engine.structured.spec import ThinkingMode as ThinkingMode

_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its home the first time it is asked for."""
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'trillm.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trillm.engine.{module}"), name)
    globals()[name] = value  # asked once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
