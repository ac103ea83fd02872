"""``from trillm import LLM, SamplingParams``: the offline API over the same engine as the server.

One ``LLM`` serves the module (the model loads once); the tests that must close one
(or start ranks) build their own.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import trio

from trillm import LLM, CompletionOutput, RequestOutput, SamplingParams
from trillm.engine.errors import EngineNotRunning, RequestRejected
from trillm.engine.offline import engine_config
from trillm.engine.offline.loop import EngineLoop
from trillm.engine.offline.progress import Progress
from trillm.engine.structured import GrammarSpec

from tests.server import MODEL, QUESTION, client, in_thread, running_server

# As tests/helpers.make_engine sizes the server's engine, so greedy answers can be compared;
# a small waiting room, so that a call with more prompts is submitted in waves.
SETTINGS = dict(dtype="float32", num_pages=256, page_size=16, max_num_seqs=32, max_batch_tokens=256, max_waiting=4)
README = Path(__file__).resolve().parents[1] / "README.md"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(model=MODEL, **SETTINGS) as llm:
        yield llm


def idle(llm: LLM) -> bool:
    s = llm.stats()
    return s.num_open_requests == 0 and s.num_running == 0 and s.free_pages + s.evictable_pages == s.total_pages


def children() -> set[int]:
    """This process's child processes, less multiprocessing's own helper (it lives as long as Python)."""
    found = psutil.Process().children(recursive=True)
    return {p.pid for p in found if "resource_tracker" not in " ".join(p.cmdline())}


@pytest.mark.model
def test_results_come_in_prompt_order_with_a_params_list(llm):
    """Ten prompts (more than the waiting room of 4, so submitted in waves), each with its own
    params: the first asks for the most tokens, so it finishes last, yet comes back first."""
    prompts = [f"Count from {i}:" for i in range(10)]
    params = [SamplingParams(max_tokens=12 - i, temperature=0, ignore_eos=True) for i in range(10)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [12 - i for i in range(10)]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    tok = llm.get_tokenizer()
    assert [list(o.prompt_token_ids) for o in outs] == [tok(p)["input_ids"] for p in prompts]
    alone = llm.generate(prompts[3], params[3], use_tqdm=False)
    assert alone[0].outputs[0].text == outs[3].outputs[0].text  # batching changed nothing
    assert idle(llm)


@pytest.mark.model
def test_a_params_list_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])


@pytest.mark.model
def test_n_choices_sample_as_the_server_does(llm):
    """n = 3 with a seed: choice j samples with seed + j, so each equals the n = 1 call with that seed."""
    sampled = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate("Once upon a time", sampled, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    one_by_one = [
        llm.generate("Once upon a time", SamplingParams(seed=11 + j, temperature=1.0, max_tokens=6, ignore_eos=True))
        for j in range(3)
    ]
    assert [c.token_ids for c in out.outputs] == [o[0].outputs[0].token_ids for o in one_by_one]
    assert len({c.token_ids for c in out.outputs}) > 1  # the seeds differ, so do the samples


@pytest.mark.model
def test_token_id_prompts_equal_their_text(llm):
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "1, 2, 3,"]
    ids = [tok(t)["input_ids"] for t in texts]
    by_text = llm.generate(texts, GREEDY, use_tqdm=False)
    by_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in by_text]
    assert by_ids[0].prompt is None and list(by_ids[0].prompt_token_ids) == ids[0]
    (single,) = llm.generate(ids[1], GREEDY, use_tqdm=False)  # one list of ints is one prompt
    assert single.outputs[0].text == by_text[1].outputs[0].text


@pytest.mark.model
def test_a_bad_prompt_refuses_the_whole_call(llm):
    before = llm.stats().prompt_tokens_total
    with pytest.raises(RequestRejected, match="token ids must be in"):
        llm.generate([[1, 2, 3], [10**9]], GREEDY, use_tqdm=False)
    assert llm.stats().prompt_tokens_total == before  # nothing was submitted


@pytest.mark.model
def test_chat_one_conversation_and_a_list(llm):
    other = [{"role": "user", "content": "Name a colour."}]
    (one,) = llm.chat(QUESTION, GREEDY, use_tqdm=False)
    both = llm.chat([QUESTION, other], GREEDY, use_tqdm=False)
    assert len(both) == 2 and both[0].outputs[0].text == one.outputs[0].text
    assert both[1].outputs[0].text != one.outputs[0].text
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert one.prompt == text
    assert list(one.prompt_token_ids) == tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.model
def test_stop_strings_logprobs_and_a_grammar(llm):
    (stopped,) = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=16, temperature=0, stop=" 7"), use_tqdm=False)
    first = stopped.outputs[0]
    assert first.finish_reason == "stop" and "7" not in first.text and "6" in first.text
    (scored,) = llm.generate("1, 2, 3,", SamplingParams(max_tokens=5, temperature=0, logprobs=2), use_tqdm=False)
    lp = scored.outputs[0].logprobs
    assert lp is not None and [e.token_id for e in lp] == list(scored.outputs[0].token_ids)
    assert all(len(e.top) == 2 and e.logprob <= 0 for e in lp)
    choice = SamplingParams(max_tokens=8, temperature=0, grammar=GrammarSpec.choice(["yes", "no"]))
    (answer,) = llm.chat([{"role": "user", "content": "Is Paris in France?"}], choice, use_tqdm=False)
    assert answer.outputs[0].text in ("yes", "no") and answer.outputs[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    shaped = SamplingParams(max_tokens=40, temperature=0, response_format=fmt)
    (city,) = llm.chat(QUESTION, shaped, use_tqdm=False)
    assert set(json.loads(city.outputs[0].text)) == {"city"}


@pytest.mark.model
def test_ctrl_c_cancels_and_frees_every_page(llm):
    """A KeyboardInterrupt in the calling thread mid-generate: it propagates, every request is
    gone from the engine and every page free by then, and the LLM still answers."""
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    started = llm.stats().generation_tokens_total

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while llm.stats().generation_tokens_total < started + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.raise_signal(signal.SIGINT)

    # Python's own handler, as in a user's session: a pytest-xdist worker's may have been changed
    # by a test before this one (twice seen in full parallel runs; never alone), and SIGINT ignored
    # would let the generate run to its end.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Thread(target=interrupt)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Tell me a story.", "Write a poem.", "List fruits."], long, use_tqdm=False)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, inherited)
    print(f"SIGINT handler this test found: {inherited!r}")
    stats = llm.stats()
    assert stats.generation_tokens_total < started + 3 * 400  # it was cut short
    assert idle(llm), stats
    (after,) = llm.generate("1, 2, 3,", GREEDY, use_tqdm=False)
    assert after.outputs[0].finish_reason == "length"


@pytest.mark.model
async def test_greedy_text_equals_the_servers(llm, model_parts):
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=16, temperature=0)
    # LLM's calls block: from inside a Trio loop, they run in a thread, as any blocking call would.
    (completion,) = await in_thread(llm.generate, prompt, params, use_tqdm=False)
    (chat,) = await in_thread(llm.chat, QUESTION, params, use_tqdm=False)
    async with running_server(model_parts) as server:
        api = client(server)
        served = await in_thread(api.completions.create, model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        answer = await in_thread(
            api.chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=16, temperature=0
        )
    assert completion.outputs[0].text == served.choices[0].text
    assert completion.outputs[0].finish_reason == served.choices[0].finish_reason
    assert chat.outputs[0].text == answer.choices[0].message.content


def readme_example() -> str:
    """The README's offline example (a ``py`` block: the ``python`` ones run against a server)."""
    section = README.read_text().split("## Offline Python API", 1)[1]
    return re.search(r"```py\n(.*?)```", section, re.S).group(1)


@pytest.mark.model
def test_the_readme_example_runs_and_close_stops_everything():
    """The README's example as written (only the engine's sizes differ); its ``with`` closes the
    LLM: the engine, its thread and its pages are gone, and a closed LLM says so."""
    before = children()
    code = readme_example().replace(
        'LLM(model="smollm2-135m-instruct")', 'LLM(model="smollm2-135m-instruct", **SETTINGS)'
    )
    assert "**SETTINGS" in code
    namespace: dict = {"SETTINGS": SETTINGS}
    exec(compile(code, "README.md", "exec"), namespace)
    llm, outs, (reply,) = namespace["llm"], namespace["outs"], namespace["reply"]
    assert [o.prompt for o in outs] == ["The capital of France is", "1, 2, 3,"]
    assert isinstance(outs[0], RequestOutput) and isinstance(outs[0].outputs[0], CompletionOutput)
    assert outs[0].outputs[0].token_ids and reply.outputs[0].text
    assert llm.closed and not llm._engine.is_running
    allocator = llm._engine.allocator
    assert allocator.free_pages == allocator.num_pages  # the engine's stop flushed even the cache
    assert not llm._loop._thread.is_alive()
    assert children() <= before
    llm.close()  # idempotent
    with pytest.raises(EngineNotRunning, match="closed"):
        llm.generate("1, 2, 3,")
    with pytest.raises(EngineNotRunning, match="closed"):
        llm.stats()


@pytest.mark.model
@pytest.mark.slow
def test_close_stops_the_tensor_parallel_ranks():
    """``tp=2``: the second rank is a process of this LLM's; close() ends it (~40 s here). Its
    verifications (speculation on) give the greedy output of one process without speculation."""
    repeat = [{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue, red, green, blue."}]
    params = SamplingParams(max_tokens=40, temperature=0)
    with LLM(model=MODEL, **{**SETTINGS, "speculative": "off"}) as alone:
        (expected,) = alone.chat(repeat, params, use_tqdm=False)
    before = children()
    with LLM(model=MODEL, **{**SETTINGS, "tp": 2, "speculative": "ngram"}) as llm:
        assert len(children() - before) >= 1  # rank 1
        (out,) = llm.generate("The capital of France is", GREEDY, use_tqdm=False)
        assert out.outputs[0].text
        (spoken,) = llm.chat(repeat, params, use_tqdm=False)
        assert spoken.outputs[0].token_ids == expected.outputs[0].token_ids
        assert llm.stats().speculation[0].accepted_tokens > 0
    assert children() <= before


# -- no model needed ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0), "top_p"),
        (dict(n=0), "n"),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(response_format={"type": "json_object"}, grammar=GrammarSpec.regex("a+")), "not both"),
    ],
)
def test_bad_sampling_params_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_spell_fields_as_the_http_api():
    p = SamplingParams(stop="END", logit_bias={5: 1.5}, seed=3, n=2, response_format={"type": "json_object"})
    assert p.stop == ("END",) and p.logit_bias == ((5, 1.5),)
    assert [c.seed for c in p.choices()] == [3, 4]
    assert p.grammar_spec() == GrammarSpec.json_object()
    assert SamplingParams(stop=["a", ""]).stop == ("a",)  # empty stop strings dropped, as the server does


def test_settings_as_keywords():
    config = engine_config(model=MODEL, kv_cache_mb=64, dtype="float32", tp=2)
    assert config.kv_cache_bytes == 64 * 1024 * 1024 and config.dtype == "float32" and config.tp == 2
    with pytest.raises(TypeError, match="no setting 'kv_cache'"):
        engine_config(kv_cache=1)
    with pytest.raises(TypeError, match="second time"):
        engine_config(kv_cache_mb=1, kv_cache_bytes=2)


def test_the_progress_bar_shows_on_a_terminal_only(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not Progress(3, True).shown
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with Progress(3, True) as bar:
        assert bar.shown
    assert not Progress(3, False).shown


class _Runs:
    """A stand-in for ``Engine.run`` (the loop's only use of it): starts, then fails when told."""

    def __init__(self, fail_at_start: bool = False) -> None:
        self.fail_at_start = fail_at_start
        self.fail = threading.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.fail_at_start:
            raise OSError("no model here")
        task_status.started()
        while not self.fail.is_set():
            await trio.sleep(0.01)
        raise OSError("a rank died")


def test_the_engine_loop_says_why_the_engine_stopped():
    with pytest.raises(EngineNotRunning, match="failed to start: OSError"):
        EngineLoop(_Runs(fail_at_start=True))
    engine = _Runs()
    loop = EngineLoop(engine)
    assert loop.call(lambda: 42) == 42
    engine.fail.set()
    loop._thread.join(5)
    assert not loop.running
    with pytest.raises(EngineNotRunning, match="has stopped: OSError"):
        loop.call(lambda: 42)
    loop.stop()
    loop.stop()  # idempotent
    with pytest.raises(EngineNotRunning, match="closed"):
        loop.call(lambda: 42)


@pytest.mark.model
def test_embed_gives_the_servers_vectors_over_the_same_engine(llm, model_dir):
    """``LLM.embed``: the mean of the final-normed hidden states, normalized (the default model
    names no pooling), as transformers computes them; pages back afterwards."""
    import torch
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = ["the cat sat on the mat", "a cat was sitting on a mat", "stock prices fell sharply"]
    vectors = llm.embed(texts, use_tqdm=False)
    for text, vector in zip(texts, vectors):
        with torch.inference_mode():
            h = hf(torch.tensor([llm.tokenizer(text)["input_ids"]])).last_hidden_state[0].mean(0)
        want = torch.nn.functional.normalize(h, dim=0)
        # The default float16 KV cache rounds K/V (1.2e-4 at most here; a float32 cache: within 1e-5).
        torch.testing.assert_close(torch.tensor(vector), want, atol=4e-4, rtol=1e-3)
        assert float(torch.tensor(vector) @ want) > 1 - 1e-6
    cat, mat, stocks = (torch.tensor(v) for v in vectors)
    assert float(cat @ mat) > float(cat @ stocks) + 0.1
    assert idle(llm)
