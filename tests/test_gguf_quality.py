"""GGUF files of every kept type, written from SmolLM2's real weights, served as ``transformers`` reads them.

``bench/gguf_files`` requantizes the default model's file (its first layers), each matrix into the next type (k-quant
encoders of our own; rows of 576 values are not whole k-quant super-blocks, so as llama.cpp does
those fall back to Q5_0 / Q5_1 / Q8_0, and the 1,536-wide FFN-down matrices carry the k-quants).
``transformers`` loads the same file dequantized to float32 through ``gguf``'s decoders; our
model keeps it in its blocks.
Teacher-forced over a few hundred tokens of text, the next-token argmax must agree at >= 99 %
of positions and the true token's log-probability differ by <= 0.01 on average where the
activations are float32 (prefill: the same values, only the summation order differs), and where
they are int16 (decode steps); >= 95 % and <= 0.05, the issue's bar for a path that rounds, where a
prefill multiplies and attends in bfloat16 (``--gemm-dtype bfloat16``, ``kernels/bf16_panels``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trillm.bench.gguf_files import MIXED_CYCLE, requantize
from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.execution.model_source import fetch_default_gguf
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.kernels import cpu_gguf
from trillm.kernels.gguf_blocks import BY_ID

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.skipif(not cpu_gguf.available(), reason="C compiler")]

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Books, which had "
    "been copied by hand for centuries, could now be made in hundreds of identical copies, and within fifty "
    "years presses were at work in more than two hundred cities across Europe. The effects were felt far "
    "beyond the workshop: scholars could compare the same text in different places, errors were corrected "
    "in later editions rather than multiplied by each copyist, and ideas travelled faster than ever before. "
    "def mean(values):\n    return sum(values) / len(values)\n\nprint(mean([1, 2, 3, 4]))\n"
)


LAYERS = 8  # of SmolLM2's 30: 72 matrices cycle through every type, and both loads take a quarter of the time


def _all_logits(model: DecoderModel, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position of ``ids``, prefilled ``chunk`` tokens a step (below
    ``cpu_gguf.GEMM_ROWS`` a step runs the decode path: int16 activations)."""
    sched = Scheduler(PageAllocator(256), 4, 1, chunk)
    runner = ModelRunner(model, 256, 4)
    seq = Sequence("t", ids, SamplingParams(max_tokens=1, temperature=0), 4096, frozenset())
    sched.add(seq)
    parts = []
    while seq.num_computed < len(ids):
        batch = sched.schedule()
        inputs = runner.prepare(batch)
        rows = torch.arange(inputs.input_ids.numel())
        with torch.inference_mode():
            logits = model.forward(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta, rows)
        parts.append(logits)
        sched.complete(batch, [int(row.argmax()) for row in logits[inputs.logits_rows]])
    return torch.cat(parts)


def _agreement(mine: torch.Tensor, theirs: torch.Tensor, ids: list[int]) -> tuple[float, float]:
    """(next-token argmax agreement, mean |difference| of the true next token's log-probability)."""
    agree = (mine.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    target = torch.tensor(ids[1:])
    lp_mine = mine[:-1].log_softmax(-1).gather(1, target[:, None])
    lp_theirs = theirs[:-1].log_softmax(-1).gather(1, target[:, None])
    return agree, (lp_mine - lp_theirs).abs().mean().item()


def test_a_file_of_every_type_agrees_with_transformers_reading_it(tokenizer, tmp_path):
    """One file, each matrix the next type (``mixed``), so Q, K and V of one layer differ too."""
    path = tmp_path / "smollm2-mixed.gguf"
    requantize(fetch_default_gguf(EngineConfig().cache_path), path, "mixed", layers=LAYERS, vocabulary=False)
    header = read_header(path)
    kinds = {BY_ID[t.type].name for t in header.tensors if t.type in BY_ID}
    assert kinds == set(MIXED_CYCLE)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    config = gguf_config(header)
    ours = DecoderModel.from_gguf(header, config, torch.float32, 1024, backend=cpu, block_weights=True)
    assert ours.num_block_weights == len(ours.projections()) and len(ours.layers) == LAYERS
    assert ours.projection_bytes < 0.45 * ours.shape.dense_projection_bytes(torch.float32)
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 140
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    exact = _agreement(_all_logits(ours, ids, 4096), theirs, ids)  # float32 activations: the same values
    integer = _agreement(_all_logits(ours, ids, 4), theirs, ids)  # 4 rows a step: int16 activations
    ours.kv_dtype = torch.float16  # the default cache where the projections are blocks (--kv-cache-dtype)
    half = _agreement(_all_logits(ours, ids, 4), theirs, ids)
    ours.kv_dtype = torch.bfloat16
    brain = _agreement(_all_logits(ours, ids, 4), theirs, ids)
    ours.kv_dtype = torch.float32
    cpu.gemm_bf16 = True  # --gemm-dtype bfloat16: the panels' GEMMs and the attention round to bfloat16
    rounded = _agreement(_all_logits(ours, ids, 96), theirs, ids)  # 96 rows a step: from bf16_panels.ROWS on
    print(
        f"{sorted(kinds)}: float32 path {exact[0]:.4f} / {exact[1]:.5f}, int16 path {integer[0]:.4f} / "
        f"{integer[1]:.5f}, bfloat16 prefill {rounded[0]:.4f} / {rounded[1]:.5f}, float16 KV {half[0]:.4f} / "
        f"{half[1]:.5f}, bfloat16 KV {brain[0]:.4f} / {brain[1]:.5f}"
    )
    assert exact[0] >= 0.99 and exact[1] <= 0.01
    assert integer[0] >= 0.99 and integer[1] <= 0.01  # int8 activations: 98.0 % / 0.083 here
    assert rounded[0] >= 0.95 and rounded[1] <= 0.05  # the bar for a path that rounds
    assert half[0] >= 0.99 and half[1] <= 0.01  # the default cache: as close as float32's
    assert brain[0] >= 0.95 and brain[1] <= 0.05
