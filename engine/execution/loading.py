"""Load a model for the engine: resolve weights, pick the dtype and the backend, read the
tokenizer and EOS ids. One process's part; starting tensor-parallel ranks is ``launch.py``'s."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends import Backend, CpuBackend, create_backend
from trillm.engine.execution.dtype_choice import (
    DtypeChoice,
    block_weights_wanted,
    choose_dtype,
    choose_kv_dtype,
    kv_dtype_asked,
)
from trillm.engine.execution.file_checks import check_gguf
from trillm.engine.execution.gguf_header import GGUFHeader
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.gguf_support import check_decoded_fits
from trillm.engine.execution.layers import kernel_paths
from trillm.engine.execution.memory_fit import check_folder_fits
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_source import DEFAULT_ALIAS, gguf_file, resolve_model
from trillm.engine.execution.parallel.group import SINGLE, TensorParallel
from trillm.engine.execution.parallel.topology import check_same_model
from trillm.engine.execution.shape import language_config
from trillm.kernels import amx_tiles, bf16_panels, cpu_build, cpu_matmul

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


GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def read_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer. ``AutoTokenizer`` first reads the model's config to choose a class,
    which imports transformers' model registry (~3 s of every start); a folder that names the
    generic class it would choose (a ``tokenizer.json`` with ``TokenizersBackend``, as converted
    GGUF files and most checkpoints have) is read by that class directly."""
    settings = folder / "tokenizer_config.json"
    named = json.loads(settings.read_text()).get("tokenizer_class") if settings.exists() else None
    if named in GENERIC_TOKENIZERS and (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def choose_model_dtype(config: EngineConfig, device: torch.device, memory: bool = True) -> DtypeChoice:
    """The dtype ``config`` serves its model in (``dtype_choice``); resolves the model first
    (``memory``: ``resolve_model``'s)."""
    cpu_build.use_cache_dir(config.cache_path)  # the probe may build the block kernels
    folder = model_folder(config, memory)
    source = _weights_source(config, folder)
    return choose_dtype(config, device, source, _model_config(config, folder, source))


def _gguf_header(config: EngineConfig) -> GGUFHeader | None:
    """The header of the GGUF file ``config.model`` names, whose weights are read from it as they are."""
    path = gguf_file(config.model, config.cache_path) if config.load_format != "dummy" else None
    return check_gguf(path) if path is not None else None


def _weights_source(config: EngineConfig, folder: Path) -> Path | GGUFHeader | None:
    """Where the weights are read from, for the dtype probe: a checkpoint folder, a GGUF file's
    header, or None for random dummy weights."""
    if config.load_format == "dummy":
        return None
    return _gguf_header(config) or folder


def _model_config(config: EngineConfig, folder: Path, source: Path | GGUFHeader | None) -> dict[str, Any]:
    """The model's config: a GGUF file's from its header (not the folder's copy of it, which older
    code may have written), else the config.json."""
    if isinstance(source, GGUFHeader):
        return gguf_config(source)
    return language_config(json.loads(_config_file(config, folder).read_text()))


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


def model_folder(config: EngineConfig, memory: bool = True) -> Path:
    file = _dummy_config_file(config)
    return file.parent if file else resolve_model(config.model, config.cache_path, memory)


def _config_file(config: EngineConfig, folder: Path) -> Path:
    return _dummy_config_file(config) or folder / "config.json"


def _tokenizer_folder(config: EngineConfig, folder: Path) -> Path:
    if config.tokenizer:
        return resolve_model(config.tokenizer, config.cache_path)
    has_tokenizer = any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    if config.load_format == "dummy" and not has_tokenizer:
        return resolve_model(DEFAULT_ALIAS, config.cache_path)  # any tokenizer will do for random weights
    return folder


def _tokenizer_and_eos(config: EngineConfig, folder: Path, model_config: dict[str, Any]) -> tuple[Any, frozenset[int]]:
    """The tokenizer the model is served with, and its EOS ids (from the config, the tokenizer
    and ``generation_config.json`` of the tokenizer's folder)."""
    tokenizer_folder = _tokenizer_folder(config, folder)
    tokenizer = read_tokenizer(tokenizer_folder)
    return tokenizer, eos_ids_of(tokenizer_folder, model_config, tokenizer)


def _use_block_weights(config: EngineConfig, backend: Backend, gguf: bool) -> bool:
    """Whether to look for exact GGUF blocks in the weights (``dtype_choice.block_weights_wanted``);
    refuses ``--weight-format blocks`` where ``backend`` cannot run them."""
    possible = backend.supports_block_weights
    if config.weight_format == "blocks" and not possible:
        raise ValueError("weight_format blocks runs on the CPU fast path in float32 with a C compiler only")
    if config.weight_format == "auto" and possible and cpu_matmul.simd() == "plain" and not gguf:
        log.info("neither AVX-512 nor AVX2: the projections stay dense float32 (--weight-format blocks forces blocks)")
    return block_weights_wanted(config, possible, gguf)


@attrs.frozen
class LoadPlan:
    """What is to be loaded, decided before any weight is read (and before other tensor-parallel
    ranks start, so that they load the same): the files, their config, the device and dtype."""

    config: EngineConfig
    folder: Path
    model_config: dict[str, Any]
    device: torch.device
    dtype: DtypeChoice
    gguf: GGUFHeader | None = None  # the weights are this GGUF file's, read as they are (``gguf_model``)


def plan_load(config: EngineConfig) -> LoadPlan:
    """Resolve ``config.model`` (downloading or converting it if needed) and choose the device
    and dtype (slow; call from a thread)."""
    # The forward pass runs in the runner's worker thread with all cores. A
    # second OpenMP team on the loading thread would halve its speed on small
    # machines, so the caller's thread stays single-threaded.
    torch.set_num_threads(1)
    cpu_build.use_cache_dir(config.cache_path)  # before anything asks whether a C kernel is available
    folder = model_folder(config)
    source = _weights_source(config, folder)
    model_config = _model_config(config, folder, source)
    device = choose_device(config)
    dtype_choice = choose_dtype(config, device, source, model_config)
    if config.dtype == "auto":  # a dtype asked for needs no reason
        log.info("dtype %s: %s", dtype_choice.name, dtype_choice.reason)
    kv_dtype_asked(config, device, dtype_choice.dtype)  # refused here, before any weight is read
    gguf = source if isinstance(source, GGUFHeader) else None
    return LoadPlan(config, folder, model_config, device, dtype_choice, gguf)


def gemms_in_bf16(config: EngineConfig) -> bool:
    """Whether a CPU model served in float32 runs its prefill GEMMs and attention in bfloat16
    (``--gemm-dtype``; ``kernels/bf16_panels``)."""
    if config.gemm_dtype != "auto":
        return config.gemm_dtype == "bfloat16"
    return config.dtype == "auto" and bf16_panels.amx_bf16()


def load_planned(plan: LoadPlan, tp: TensorParallel = SINGLE) -> tuple[DecoderModel, Any, frozenset[int]]:
    """Weights, tokenizer and EOS ids of ``plan``: the whole model, or with ``tp`` (a group already
    joined, ``launch.py``) this rank's shard, checked to be the same model on every rank. The
    backend is chosen here, from the one registry (``backends.create_backend``), and handed to
    the model."""
    config, folder, model_config, device = plan.config, plan.folder, plan.model_config, plan.device
    dtype = plan.dtype.dtype
    max_len = config.max_model_len or model_config.get("max_position_embeddings", 2048)
    backend = create_backend(config.kernels, device, dtype)
    if isinstance(backend, CpuBackend) and backend.c_kernels:
        backend.gemm_bf16 = gemms_in_bf16(config)
    blocks = _use_block_weights(config, backend, plan.gguf is not None)
    if config.load_format == "dummy":
        model = DecoderModel.dummy(model_config, dtype, max_len, device, backend=backend, tp=tp)
    elif plan.gguf is not None:
        if not blocks or tp.size > 1:  # decoded at load: the file's size said nothing of that
            check_decoded_fits(plan.gguf, max(4, dtype.itemsize))  # float32 first, then the dtype
        model = DecoderModel.from_gguf(
            plan.gguf,
            model_config,
            dtype,
            max_len,
            device,
            backend=backend,
            block_weights=blocks,
            tp=tp,
            activation_bits=config.activation_bits,
            prefault=config.prefault,
            huge_pages=config.huge_pages,
        )
    else:
        if not blocks:  # dense in the dtype served (block weights take less: they are not known yet)
            check_folder_fits(folder, dtype.itemsize)
        model = DecoderModel.load(
            folder, model_config, dtype, max_len, device, backend=backend, block_weights=blocks, tp=tp
        )
    if tp.size > 1:
        settings = json.dumps(model_config, sort_keys=True, default=str)
        check_same_model(f"{model.fingerprint}:{settings}:{dtype}:{model.num_block_weights}")
    if config.weight_format == "blocks" and model.num_block_weights < len(model.projections()):
        raise ValueError(
            f"weight_format blocks: only {model.num_block_weights} of {len(model.projections())} "
            f"projections of {config.model} are in blocks (exact Q4_1/Q8_0 blocks or a GGUF file's own)"
        )
    kv = choose_kv_dtype(config, model)
    model.kv_dtype = kv.dtype
    log.info("KV cache %s: %s", kv.name, kv.reason)
    tokenizer, eos_ids = _tokenizer_and_eos(config, folder, model_config)
    gemm_bf16 = isinstance(backend, CpuBackend) and backend.gemm_bf16
    tiles = gemm_bf16 and amx_tiles.available()  # the wide steps (and a half-precision checkpoint's) on AMX tiles
    if gemm_bf16:
        log.info(
            "prefill steps: GEMMs (from %d-%d rows by the weight's form) and attention (from %d rows) in "
            "bfloat16 (%s); decode steps %s%s",
            *(
                (min(amx_tiles.MIN_ROWS.values()), max(amx_tiles.MIN_ROWS.values()))
                if tiles
                else (min(bf16_panels.CROSSOVER.values()), max(bf16_panels.CROSSOVER.values()))
            ),
            bf16_panels.ROWS,
            "AMX-BF16 tiles over panels decoded in L2, attention on the tiles too"
            if tiles
            else "AMX-BF16 tiles through oneDNN"
            if bf16_panels.amx_bf16()
            else "no AMX-BF16 here: slower than float32",
            "of as many rows on the same tiles, fewer in float32" if tiles else "in float32",
            "" if config.gemm_dtype == "bfloat16" else " (--gemm-dtype float32 keeps them in float32)",
        )
    log.info(
        "loaded %s (%s, %s, %s kernels, %d of %d projections in blocks) from %s",
        config.model,
        dtype,
        device,
        backend.name,
        model.num_block_weights,
        len(model.projections()),
        plan.gguf.path if plan.gguf is not None else folder,  # the weights' file, not the tokenizer's folder
    )
    if plan.device.type == "cpu":
        roles = {"lm_head": [model.lm_head]}
        for role in ("qkv", "o_proj", "gate_up", "down"):
            weights = [w for layer in model.layers if (w := getattr(layer, role)) is not None]
            if weights:
                roles[role] = weights
        experts = [w for layer in model.layers if layer.moe is not None for w in layer.moe.projections()]
        if experts:
            roles["experts"] = experts
        for line in kernel_paths(roles, tiles):
            log.info("projections %s", line)
    return model, tokenizer, eos_ids


def load_model(config: EngineConfig) -> tuple[DecoderModel, Any, frozenset[int]]:
    """Weights, tokenizer and EOS ids for ``config.model`` in one process (slow; call from a
    thread). ``--tp`` > 1 starts ranks first: that is ``launch.launch``."""
    if config.tp > 1:
        raise ValueError("--tp > 1 is launched (trillm.engine.execution.launch.launch), not loaded in one process")
    return load_planned(plan_load(config))


def load_tokenizer(config: EngineConfig, memory: bool = True) -> tuple[Any, frozenset[int], dict[str, Any]]:
    """The tokenizer, EOS ids and ``config.json`` of ``config.model``, without its weights: what a
    front end of several replicas needs (each replica loads the model itself). ``memory``:
    ``resolve_model``'s (False for a client of a server that holds the model)."""
    folder = model_folder(config, memory)
    model_config = _model_config(config, folder, _weights_source(config, folder))  # a GGUF file's own
    return (*_tokenizer_and_eos(config, folder, model_config), model_config)
