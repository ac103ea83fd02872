"""Tensor parallelism on the CPU over gloo: the partition, the sharded layers against the whole
ones on random weights (in two real ranks), and the engine at ``--tp 2`` against ``--tp 1``."""

from __future__ import annotations

import datetime
import os
import re
import signal

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.execution.layers import make_weight, project, project_add
from trillm.engine.execution.parallel.group import TensorParallel
from trillm.engine.execution.parallel.sharding import even_ranges, local_shape, partition, shard_weights
from trillm.engine.execution.parallel.topology import WorkerDied, check_same_model
from trillm.engine.execution.shape import ModelShape
from trillm.engine.processes import free_port
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.structured import GrammarSpec

from tests.helpers import outputs_by_prompt, wait_idle

SMOLLM2 = dict(num_heads=9, num_kv_heads=3, hidden_size=576, intermediate_size=1536, vocab_size=49152)


def _shape(**fields: int) -> ModelShape:
    base = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    return ModelShape(**(base | fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "heads", [dict(num_heads=8, num_kv_heads=2), dict(num_heads=9, num_kv_heads=3), dict(num_heads=8, num_kv_heads=8)]
)
def test_the_partition_covers_every_head_once_in_whole_groups(size, heads):
    shape = _shape(**heads)
    group = shape.num_heads // shape.num_kv_heads
    try:
        parts = [partition(shape, size, rank) for rank in range(size)]
    except ValueError as exc:  # only where a KV head's query heads cannot be shared evenly
        kv = shape.num_kv_heads
        assert kv < size and (size % kv or group % (size // kv)), exc
        return
    assert sorted(h for p in parts for h in p.heads) == list(range(shape.num_heads))
    for p in parts:  # every query head reads a KV head its rank holds
        assert all(h // group in p.kv_heads for h in p.heads), p
    assert [i for p in parts for i in p.intermediate] == list(range(shape.intermediate_size))
    assert [i for p in parts for i in p.vocab] == list(range(shape.vocab_size))


def test_smollm2_splits_at_tp_2_and_3_by_whole_groups():
    shape = _shape(**SMOLLM2)
    two = [partition(shape, 2, r) for r in range(2)]
    assert [(p.heads, p.kv_heads) for p in two] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    assert [len(p.intermediate) % 32 for p in two] == [0, 0]  # GGUF blocks stay whole
    assert [len(partition(shape, 3, r).heads) for r in range(3)] == [3, 3, 3]
    with pytest.raises(ValueError, match="cannot split"):
        partition(shape, 6, 0)  # 3 KV heads, 3 query heads each: not over 6 ranks


def test_even_ranges_align_and_end_at_n():
    assert even_ranges(100, 3, 32) == [range(0, 64), range(64, 96), range(96, 100)]
    assert even_ranges(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert even_ranges(40, 3, 32) == [range(0, 14), range(14, 27), range(27, 40)]  # too few blocks: units of one
    with pytest.raises(ValueError):
        even_ranges(2, 3)


def _rank_body(rank: int, size: int, port: int, failures: mp.Queue) -> None:
    """One rank: each sharded piece against the whole one, on the same random weights."""
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=60),
        )
        torch.manual_seed(0)  # the same weights and inputs on every rank
        shape = _shape(num_heads=9, num_kv_heads=3, intermediate_size=160)
        d, h = shape.head_dim, shape.hidden_size
        whole = {
            "model.embed_tokens.weight": torch.randn(shape.vocab_size, h),
            "lm_head.weight": torch.randn(shape.vocab_size, h),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(shape.num_heads * d, h),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(shape.num_kv_heads * d, h),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(h, shape.num_heads * d),
            "model.layers.0.mlp.gate_proj.weight": torch.randn(shape.intermediate_size, h),
            "model.layers.0.mlp.down_proj.weight": torch.randn(h, shape.intermediate_size),
        }
        part = partition(shape, size, rank)
        tp = TensorParallel(part, None, shape.vocab_size)
        mine = shard_weights(whole, shape, part)
        x = torch.randn(5, h)
        ids = torch.tensor([0, 7, 50, 51, 100])
        a = "model.layers.0.self_attn."
        # Column-parallel (Q, K, gate): this rank's output columns are the whole output's.
        for name, rows in ((a + "q_proj.weight", part.heads), (a + "k_proj.weight", part.kv_heads)):
            cols = slice(rows.start * d, rows.stop * d)
            torch.testing.assert_close(project(x, make_weight(mine[name], False)), (x @ whole[name].T)[:, cols])
        gate = "model.layers.0.mlp.gate_proj.weight"
        inter = slice(part.intermediate.start, part.intermediate.stop)
        torch.testing.assert_close(project(x, make_weight(mine[gate], False)), (x @ whole[gate].T)[:, inter])
        # Row-parallel (O, down): the partial products, all-reduced, plus the residual once.
        residual = torch.randn(5, h)
        for name, cols in (
            (a + "o_proj.weight", slice(part.heads.start * d, part.heads.stop * d)),
            ("model.layers.0.mlp.down_proj.weight", inter),
        ):
            full_in = torch.randn(5, whole[name].shape[1])
            got = project_add(residual.clone(), full_in[:, cols], make_weight(mine[name], False), tp.all_reduce)
            torch.testing.assert_close(got, residual + full_in @ whole[name].T, rtol=1e-5, atol=1e-4)
        # Vocabulary-parallel embedding and LM head.
        torch.testing.assert_close(
            tp.embed(mine["model.embed_tokens.weight"], ids), whole["model.embed_tokens.weight"][ids]
        )
        logits = tp.gather_vocab(project(x, make_weight(mine["lm_head.weight"], False)))
        torch.testing.assert_close(logits, x @ whole["lm_head.weight"].T, rtol=1e-5, atol=1e-4)
        assert local_shape(shape, part).num_heads == len(part.heads)
        # Every rank loaded the same model, or the start fails on every rank.
        check_same_model("same")
        try:
            check_same_model("same" if rank == 0 else "other")
        except RuntimeError as exc:
            assert "loaded a different model" in str(exc)
        else:
            raise AssertionError("a rank with another model was not refused")
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test, which fails with it
        failures.put(f"rank {rank}: {exc!r}")
        raise


@pytest.mark.slow  # rank processes
@pytest.mark.parametrize("size", [2])  # uneven groups (2 + 1) and vocabulary (51 + 50); 3 ranks: the partition
def test_sharded_layers_match_the_whole_ones_over_gloo(size):
    context = mp.get_context("spawn")
    failures = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank_body, args=(r, size, port, failures)) for r in range(size)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert failures.empty(), failures.get()
    assert [p.exitcode for p in ranks] == [0] * size


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3,",
    "Numbers: " + ", ".join(str(i) for i in range(150)),  # > max_batch_tokens: prefilled in chunks
]


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_tp_1s_greedy_tokens_frees_pages_and_fails_fast(model_parts, tokenizer):
    """The same prompts through ``--tp 2`` and ``--tp 1`` (overlap on, one prefilled in chunks): the
    same greedy tokens, logprobs within float tolerance; cancelled requests free every page on rank
    0's books; a rank that stops answering (SIGSTOP) stops the engine within ``--dist-timeout``."""
    settings = dict(dtype="float32", num_pages=128, page_size=16, max_num_seqs=8, max_batch_tokens=128)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    model_parts[0].kv_dtype = torch.float16  # the default cache, as both ranks of ``two`` choose it
    try:
        one = Engine(EngineConfig(**settings), *model_parts)
        async with trio.open_nursery() as nursery:
            await nursery.start(one.run)
            expected = await outputs_by_prompt(one, tokenizer, PROMPTS, params)
            nursery.cancel_scope.cancel()
    finally:
        model_parts[0].kv_dtype = torch.float32

    two = await trio.to_thread.run_sync(Engine.load, EngineConfig(**settings, tp=2, dist_timeout=3.0))
    workers = two.ranks
    assert workers is not None and two.model.kv_dtype is torch.float16
    assert len(workers.processes) == 1 and two.model.shape.num_heads == 6  # rank 0: two of the three groups
    with pytest.raises(ExceptionGroup) as failure:
        async with trio.open_nursery() as nursery:
            await nursery.start(two.run)
            got = await outputs_by_prompt(two, tokenizer, PROMPTS, params)
            for prompt in PROMPTS:
                mine, theirs = got[prompt], expected[prompt]
                assert [t for o in mine for t in o.token_ids] == [t for o in theirs for t in o.token_ids], prompt
                for a, b in zip([lp for o in mine for lp in o.logprobs], [lp for o in theirs for lp in o.logprobs]):
                    assert abs(a.logprob - b.logprob) < 1e-3
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]

            # A grammar and n = 2 (choices sharing one prompt): rank 0's alone, they work as at --tp 1.
            grammar = await two.compile_grammar(GrammarSpec("regex", "(yes|no), because [a-z ]{3,20}\\."))
            constrained = SamplingParams(max_tokens=30, temperature=0.8, seed=3, grammar=grammar)
            ids = tokenizer("Is the sky blue? Answer:")["input_ids"]
            _, mailbox = two.submit_many([(ids, constrained), (ids, attrs.evolve(constrained, seed=4))])
            texts = ["", ""]
            with mailbox:
                async for out in mailbox:
                    texts[out.index] += out.text
            assert all(re.fullmatch("(yes|no), because [a-z ]{3,20}\\.", t) for t in texts), texts

            # Cancelled mid-stream and while waiting: every page comes back.
            async def cancelled(prompt: str) -> None:
                with trio.move_on_after(0.3):
                    async with two.generate(tokenizer(prompt)["input_ids"], SamplingParams(max_tokens=400)) as out:
                        async for _ in out:
                            pass

            async with trio.open_nursery() as storm:
                for prompt in PROMPTS * 2:
                    storm.start_soon(cancelled, prompt)
            await wait_idle(two, timeout=30)
            assert two.stats().free_pages + two.stats().evictable_pages == two.stats().total_pages
            # A rank that hangs: the next step's collective times out and the engine stops.
            os.kill(workers.processes[0].pid, signal.SIGSTOP)
            started = trio.current_time()
            try:
                async with two.generate(tokenizer("Hello")["input_ids"], SamplingParams(max_tokens=50)) as out:
                    finals = [o.finish_reason async for o in out]
                assert finals[-1] == "abort"  # the open request ended, it did not hang
                await trio.sleep(30)  # the engine's failure cancels this
            finally:
                os.kill(workers.processes[0].pid, signal.SIGKILL)
    assert failure.group_contains(WorkerDied)
    assert trio.current_time() - started < 20
    assert not two.is_running
