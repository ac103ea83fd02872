"""Load a model for the engine: resolve weights, pick the dtype, read tokenizer and EOS ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends import Backend, create_backend
from trillm.engine.execution.dtype_choice import DTYPE_NAMES, DtypeChoice, block_weights_wanted, choose_dtype
from trillm.engine.execution.llama import LlamaModel, LlamaShape
from trillm.engine.execution.model_source import DEFAULT_ALIAS, resolve_model
from trillm.engine.execution.parallel.group import SINGLE, TensorParallel
from trillm.engine.execution.parallel.sharding import partition
from trillm.engine.execution.parallel.workers import Topology, Workers, check_same_model, join_group, rank_device
from trillm.kernels import cpu_build, cpu_matmul

log = logging.getLogger("trillm.engine")


def eos_ids_of(folder: Path, config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    sources: list[Any] = [config.get("eos_token_id"), tokenizer.eos_token_id]
    gen = folder / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def choose_model_dtype(config: EngineConfig, device: torch.device) -> DtypeChoice:
    """The dtype ``config`` serves its model in (``dtype_choice``); resolves the model first."""
    cpu_build.use_cache_dir(config.cache_path)  # the probe may build the block kernels
    folder = _model_folder(config)
    model_config = json.loads(_config_file(config, folder).read_text())
    return choose_dtype(config, device, None if config.load_format == "dummy" else folder, model_config)


def choose_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    return torch.device(config.device)


def _dummy_config_file(config: EngineConfig) -> Path | None:
    """A dummy model needs only a config.json, which ``--model`` may name directly."""
    path = Path(config.model).expanduser()
    return path if config.load_format == "dummy" and path.is_file() and path.suffix == ".json" else None


def _model_folder(config: EngineConfig) -> Path:
    file = _dummy_config_file(config)
    return file.parent if file else resolve_model(config.model, config.cache_path)


def _config_file(config: EngineConfig, folder: Path) -> Path:
    return _dummy_config_file(config) or folder / "config.json"


def _tokenizer_folder(config: EngineConfig, folder: Path) -> Path:
    if config.tokenizer:
        return resolve_model(config.tokenizer, config.cache_path)
    has_tokenizer = any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    if config.load_format == "dummy" and not has_tokenizer:
        return resolve_model(DEFAULT_ALIAS, config.cache_path)  # any tokenizer will do for random weights
    return folder


def _use_block_weights(config: EngineConfig, backend: Backend) -> bool:
    """Whether to look for exact GGUF blocks in the weights (``dtype_choice.block_weights_wanted``);
    refuses ``--weight-format blocks`` where ``backend`` cannot run them."""
    possible = backend.supports_block_weights
    if config.weight_format == "blocks" and not possible:
        raise ValueError("weight_format blocks runs on the CPU fast path in float32 with a C compiler only")
    if config.weight_format == "auto" and possible and cpu_matmul.simd() == "plain":
        log.info("neither AVX-512 nor AVX2: the projections stay dense float32 (--weight-format blocks forces blocks)")
    return block_weights_wanted(config, possible)


def load_model(
    config: EngineConfig, topology: Topology | None = None, rank: int = 0
) -> tuple[LlamaModel, Any, frozenset[int]]:
    """Weights, tokenizer and EOS ids for ``config.model`` (slow; call from a thread).

    With ``--tp`` > 1, the shard of rank ``rank`` (0 unless a worker calls): rank 0 first
    spawns this machine's other ranks, then every rank joins the group, loads its part and
    checks that all loaded the same model."""
    from transformers import AutoTokenizer

    # The forward pass runs in the runner's worker thread with all cores. A
    # second OpenMP team on the loading thread would halve its speed on small
    # machines, so the caller's thread stays single-threaded.
    torch.set_num_threads(1)
    cpu_build.use_cache_dir(config.cache_path)  # before anything asks whether a C kernel is available
    folder = _model_folder(config)
    model_config = json.loads(_config_file(config, folder).read_text())
    device = choose_device(config)
    dtype_choice = choose_dtype(config, device, None if config.load_format == "dummy" else folder, model_config)
    dtype = dtype_choice.dtype
    if config.dtype == "auto":  # a dtype asked for needs no reason
        log.info("dtype %s: %s", dtype_choice.name, dtype_choice.reason)
    tp, workers = SINGLE, None
    if config.tp > 1:
        if topology is None:  # the serving rank: the others are started with the dtype it chose
            topology = Topology.of(config)
            config = attrs.evolve(config, dtype=DTYPE_NAMES[dtype], master_port=topology.master_port)
            workers = Workers(config, topology)
        device = rank_device(device, topology, rank)
        compute = join_group(topology, rank, device)
        shape = LlamaShape.from_config(model_config)
        tp = TensorParallel(partition(shape, topology.size, rank), compute, shape.vocab_size, workers)
    max_len = config.max_model_len or model_config.get("max_position_embeddings", 2048)
    backend = create_backend(config.kernels, device, dtype)
    blocks = _use_block_weights(config, backend)
    if config.load_format == "dummy":
        model = LlamaModel.dummy(model_config, dtype, max_len, device, backend, tp=tp)
    else:
        model = LlamaModel.load(folder, model_config, dtype, max_len, device, backend, blocks, tp)
    if tp.size > 1:
        settings = json.dumps(model_config, sort_keys=True, default=str)
        check_same_model(f"{model.fingerprint}:{settings}:{dtype}:{model.num_block_weights}")
    if config.weight_format == "blocks" and model.num_block_weights < len(model.projections()):
        raise ValueError(
            f"weight_format blocks: only {model.num_block_weights} of {len(model.projections())} "
            f"projections of {config.model} are exact Q4_1/Q8_0 blocks"
        )
    tokenizer_folder = _tokenizer_folder(config, folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    log.info(
        "loaded %s (%s, %s, %s kernels, %d of %d projections in blocks) from %s",
        config.model,
        dtype,
        device,
        backend.name,
        model.num_block_weights,
        len(model.projections()),
        folder,
    )
    return model, tokenizer, eos_ids_of(tokenizer_folder, model_config, tokenizer)


def load_tokenizer(config: EngineConfig) -> tuple[Any, frozenset[int], dict[str, Any]]:
    """The tokenizer, EOS ids and ``config.json`` of ``config.model``, without its weights: what a
    front end of several replicas needs (each replica loads the model itself)."""
    from transformers import AutoTokenizer

    folder = _model_folder(config)
    model_config = json.loads(_config_file(config, folder).read_text())
    tokenizer_folder = _tokenizer_folder(config, folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return tokenizer, eos_ids_of(tokenizer_folder, model_config, tokenizer), model_config
