"""Speculative decoding's parts, without a model: the n-gram proposer, the verification's rule
(greedy: the longest agreeing prefix; sampling: the output distribution unchanged), and the
scheduler driving verifications with exact page accounting against a stand-in model whose right
answer is known at every position."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from trillm.engine.execution.backends.base import StepRows
from trillm.engine.execution.verify import verify
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.ngram_proposer import NgramProposer
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.speculation import MAX_COOLDOWN, RECHECK, SpeculationControl
from trillm.engine.scheduling.step_loop import StepLoop
from trillm.engine.scheduling.suffix_cache import SuffixCache
from trillm.engine.step import Batch, Sampled, SampleRow, Step, StepInputs, fill_pending

# -- the proposer ---------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    p = NgramProposer()
    p.extend([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6])
    assert p.has_match()
    assert p.propose(3) == ((7, 2, 3), False)  # "5 6" last seen before "7 2 3"
    p.extend([7])
    assert p.propose(4) == ((2, 3, 5, 6), False)  # the longest suffix, "5 6 7", wins over "6 7"
    assert p.propose(9)[0] == (2, 3, 5, 6, 7)  # not past the tokens known: "2 3 5 6 7" came once


def test_ngram_carries_a_short_period_on() -> None:
    """A loop of period 2 (``X , X , ``) is proposed k tokens at a time, not 2: the latest match
    of its last tokens is always one period back."""
    p = NgramProposer()
    p.extend([1, 2, 3, 7, 9, 7, 9, 7, 9])
    assert p.propose(5) == ((7, 9, 7, 9, 7), False)
    p.extend([4, 5, 6, 4, 5, 6, 4, 5])
    assert p.propose(7) == ((6, 4, 5, 6, 4, 5, 6), False)  # period 3, seen twice over
    p.extend([8])
    assert p.propose(3) == ((), False)  # "5 8" broke it: no pair "5 8" seen before


def test_ngram_without_a_match_proposes_nothing() -> None:
    p = NgramProposer()
    p.extend([1, 2, 3, 4])
    assert not p.has_match()
    assert p.propose(4) == ((), False)


def test_prediction_comes_first_and_opens_the_output() -> None:
    p = NgramProposer(prediction=(10, 11, 12, 13, 14), prompt_len=3)
    p.extend([1, 2, 3])
    assert p.propose(2) == ((10, 11), True)  # no output yet: the prediction's start
    p.extend([10, 99, 12])  # the model changed one token
    assert p.propose(4) == ((), False)
    p.extend([13])
    assert p.propose(4) == ((14,), True)  # back in step with the prediction after "12 13"


def test_rejected_proposals_back_off_and_recover() -> None:
    control = SpeculationControl("ngram", 4)
    spec = control.state((), 0)
    for misses in range(1, 9):
        control.record(spec, 4, 0, "ngram")
        assert spec.resume_at == spec.known + 1 + min(MAX_COOLDOWN, 2 ** (misses - 1))
    control.record(spec, 4, 3, "ngram")
    assert spec.misses == 0
    stats = control.stats["ngram"]
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens, stats.emitted_tokens) == (9, 36, 3, 12)


def test_suffix_cache_proposes_the_well_trodden_continuation_and_forgets_exactly() -> None:
    cache = SuffixCache(max_tokens=40, min_confidence=0.5)
    cache.learn([9, 1, 2], [3, 4, 5, 6])
    cache.learn([9, 1, 2], [3, 4, 5, 6])
    cache.learn([8, 1, 2], [3, 4, 7, 7])
    assert cache.propose([1, 2], 8) == (3, 4, 5, 6)  # after "3 4": 5 twice, 7 once (2/3 > 0.5)
    assert cache.propose([7, 1, 2, 3], 2) == (4, 5)
    assert cache.propose([5, 5], 4) == ()  # never seen
    assert cache.has_match([1, 2]) and not cache.has_match([6, 6])
    for i in range(6):  # 7 tokens each: the first three requests go, their counts with them
        cache.learn([20 + i, 21 + i], [30 + i, 31 + i, 32 + i, 33 + i, 34 + i])
    assert cache.size <= 40 and cache.propose([1, 2], 4) == ()
    cache.clear()
    assert not cache.counts and not cache.learned and cache.size == 0
    cache.learn([1], [2, 3, 4])
    while cache.learned:  # forgetting undoes learning exactly: nothing is left behind
        tokens, first = cache.learned.popleft()
        cache._count(tokens, first, -1)
    assert cache.counts == {}


def test_the_cost_model_speculates_only_where_the_rows_pay() -> None:
    control = SpeculationControl("auto", 4)
    assert control.worth(4, 8, 2.0)  # nothing measured: try it
    for rows, seconds, sequences in ((1, 0.010, 1), (4, 0.011, 1), (8, 0.012, 8), (16, 0.040, 16), (40, 0.100, 8)):
        control.observe_step(rows, seconds, sequences)
    assert control.worth(1, 3, 1.5)  # 4 rows cost 10 % more than 1, and bring 2.5 tokens instead of 1
    assert not control.worth(1, 3, 0.0)  # nothing expected back: the extra rows are pure cost
    assert not control.worth(8, 32, 4.0)  # compute-bound: 40 rows cost 8x what 8 do
    # a proposed row is priced by the sequences beside it, not by a plain step of as many rows:
    # 16 plain rows cost 0.040 s, 1 sequence's 15 proposed rows at 4 % of that each far less
    plain, per_row = control._row_costs(1) or (1.0, 1.0)
    assert control.worth(1, 15, 4.0) and plain + 15 * per_row < 0.020 < (control._cost(16) or 0.0)


def _decoding(prompt: list[int], control: SpeculationControl) -> Sequence:
    seq = Sequence(f"r{len(prompt)}", prompt, SamplingParams(max_tokens=500), 1000, frozenset())
    seq.admitted = True
    seq.num_computed = len(seq.prompt_ids) - 1
    control.known(seq)
    return seq


def test_proposals_are_cut_to_the_length_their_acceptance_pays_for() -> None:
    """Each proposed token is worth its chance of being kept (the sequence's per-token acceptance
    to the power of its place): a sequence whose proposals mostly hold carries all 8, one that
    keeps half of them a token or two, one that keeps nothing none; and with two sequences, the
    likelier one's tokens go first."""
    control = SpeculationControl("auto", 8)
    control.observe_step(1, 0.007)
    control.observe_step(2, 0.0085)
    control.observe_step(9, 0.007 + 0.0015 * 8, sequences=1)  # a proposed row costs a fifth of a step
    loop = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3
    seq = _decoding(loop, control)
    assert seq.spec is not None
    seq.spec.acceptance = 0.97
    assert control.proposals([seq]) == {id(seq): tuple(range(1, 9))}
    seq.spec.acceptance = 0.5
    assert len(control.proposals([seq])[id(seq)]) in (1, 2)
    seq.spec.acceptance = 0.05
    assert control.proposals([seq]) == {} and control.declined == 1
    other = _decoding([7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], control)
    assert other.spec is not None
    seq.spec.acceptance, other.spec.acceptance = 0.6, 0.97
    chosen = control.proposals([seq, other])
    assert len(chosen[id(other)]) > len(chosen.get(id(seq), ())) and chosen[id(other)][:3] == (9, 7, 8)


def test_a_batch_size_never_measured_plain_runs_plain_before_any_probe() -> None:
    """Proposed rows are priced against a plain step of as many decodes: until one of that size has
    run, a step carries no proposals, so that it gets measured. Probing
    blind there put one sequence's proposals into every step of a 32-stream batch, none of them ever
    weighed, 10-20 % slower than plain steps."""
    control = SpeculationControl("auto", 8)
    control.observe_step(1, 0.007)  # one size measured: the cost of 3 is unknown
    loop = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3
    batch = [_decoding(loop + [i], control) for i in range(3)]
    for seq in batch:
        assert seq.spec is not None
        seq.spec.acceptance = 0.9
    assert control.proposals(batch) == {}
    control.observe_step(2, 0.008)
    control.observe_step(3, 0.009)  # now known: a probe (no proposed row is priced yet), then decisions
    assert len(control.proposals(batch)) == 1


def test_acceptance_counts_kept_tokens_against_the_ones_that_stopped_a_verification() -> None:
    control = SpeculationControl("auto", 8)
    spec = control.known(_decoding([1, 2, 3], control))
    start = spec.acceptance
    for _ in range(5):
        control.record(spec, 8, 8, "ngram")  # all kept: no miss at all
    assert spec.acceptance > 0.95
    for _ in range(20):
        control.record(spec, 4, 1, "ngram")  # one kept, then a miss: half
    assert abs(spec.acceptance - 0.5) < 0.05
    for _ in range(15):
        control.record(spec, 2, 0, "ngram")  # a miss at once, every time
    assert spec.acceptance < 0.1 < start


def test_a_new_request_starts_from_what_recent_requests_kept() -> None:
    """Open chat keeps little of what it proposes: after enough of it a new request expects little
    from its first proposals too (and with a predicted output, much)."""
    control = SpeculationControl("auto", 8)
    first = control.known(_decoding([1, 2, 3], control))
    assert first.acceptance == pytest.approx(0.6)
    for _ in range(100):
        control.record(first, 2, 0, "ngram")
    fresh = control.known(_decoding([4, 5, 6, 7], control))
    assert fresh.acceptance < 0.2
    predicted = control.state((9, 9, 9), 3)
    assert predicted.acceptance == pytest.approx(0.8)


def test_a_stalled_step_moves_the_cost_model_only_so_far_and_declined_sizes_are_measured_again() -> None:
    control = SpeculationControl("auto", 4)
    for _ in range(3):
        control.observe_step(1, 0.0065)
        control.observe_step(5, 0.012, sequences=1)
    assert control.worth(1, 4, 3.0)
    control.observe_step(5, 0.600, sequences=1)  # the machine paused during one verification
    assert control.row_seconds[1] < 0.002 and control.worth(1, 4, 3.0)

    # a sequence whose proposals the model turns down (nothing expected back) is still measured
    # once in RECHECK steps, and only then
    seq = Sequence("r0", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=50), 100, frozenset())
    seq.admitted = True
    seq.num_computed = len(seq.prompt_ids) - 1
    spec = control.known(seq)
    spec.acceptance, spec.proposed = 0.0, 10  # it has verified before, and kept nothing
    granted = []
    for _ in range(2 * RECHECK):
        granted.append(bool(control.proposals([seq])))
    assert granted.count(True) == 2 and granted[RECHECK - 1] and granted[-1]
    # overlapped, proposals are only asked for when ``wants`` lets the step in flight finish first
    seq.output_ids.append(3)
    seq.num_computed = seq.num_tokens - 1
    waits = [control.wants([seq]) for _ in range(RECHECK)]
    assert waits.count(True) == 1 and waits[-1]
    assert control.proposals([seq]) and control.declined == 0  # the one measured again
    waits = [control.wants([seq]) for _ in range(RECHECK)]
    spec.resume_at = spec.known + 1  # backing off: this step has nothing to propose after all
    assert waits[-1] and not control.proposals([seq]) and control.declined == 0  # so overlap comes back
    assert not control.wants([seq])


def test_wants_discounts_a_match_that_the_next_token_breaks() -> None:
    """``wants`` decides a token ahead of the proposals it waits for: where each two-token match
    is gone after the next token (new prose), it learns to expect little; where matches hold (a
    repeated passage), it expects them."""
    control = SpeculationControl("auto", 8)
    seq = Sequence("r0", [5, 6, 9, 5, 6, 9, 4], SamplingParams(max_tokens=500), 1000, frozenset())
    seq.admitted = True

    def step(token: int) -> None:
        seq.output_ids.append(token)
        seq.num_computed = seq.num_tokens - 1
        control.wants([seq])

    for i in range(10):  # (5, 6) matches, then a token never seen breaks it
        for token in (5, 6, 100 + i):
            step(token)
    assert seq.spec is not None and seq.spec.kept_match < 0.2
    for token in (5, 6, 9) * 10:  # the prompt's passage again: every pair matches
        step(token)
    assert seq.spec.kept_match > 0.9


# -- verification ---------------------------------------------------------------------------


def _rows(params: SamplingParams, k: int, seed: int | None = None) -> list[SampleRow]:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return [SampleRow(params, generator) for _ in range(k + 1)]


def test_greedy_verification_keeps_the_agreeing_prefix_then_the_models_token() -> None:
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 1, 6, 2]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    kept, token, kept_lp, token_lp = verify(logits, _rows(greedy, 3), (3, 1, 4))
    assert (kept, token) == ((3, 1), 6)  # d3 = 4 disagrees with row 2's argmax 6
    assert [lp.token_id for lp in kept_lp if lp] == [3, 1] and token_lp is not None and token_lp.token_id == 6
    kept, token, _, _ = verify(logits, _rows(greedy, 3), (3, 1, 6))
    assert (kept, token) == ((3, 1, 6), 2)  # all kept: the last row's own token follows
    kept, token, _, _ = verify(logits, _rows(greedy, 3), (0, 1, 6))
    assert (kept, token) == ((), 3)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["plain", "truncated"],
)
def test_sampled_verification_keeps_the_distribution(params: SamplingParams) -> None:
    """The first emitted token is distributed as row 0's distribution whatever was proposed, and
    the second, given the first was the proposal, as row 1's: rejection sampling with a point mass."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    draft = (int(logits[0].argmax()), 2)  # a likely proposal, then any
    generator = torch.Generator().manual_seed(1)
    rows = [SampleRow(params, generator) for _ in range(3)]
    trials = 20_000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        kept, token, _, _ = verify(logits, rows, draft)
        emitted = (*kept, token)
        first[emitted[0]] += 1
        if emitted[0] == draft[0]:
            second[emitted[1]] += 1

    def target(row: int) -> torch.Tensor:
        scaled = logits[row] / params.temperature
        if params.top_k > 0 or params.top_p < 1:
            from trillm.engine.execution.sampler import truncate

            scaled = truncate(scaled.unsqueeze(0), [params])[0]
        return torch.softmax(scaled.double(), -1).float()

    for counts, row in ((first, 0), (second, 1)):
        n = counts.sum()
        p = target(row)
        sigma = (p * (1 - p) / n).sqrt()
        assert ((counts / n - p).abs() <= 5 * sigma + 1e-3).all(), (counts / n, p)
        assert counts[p == 0].sum() == 0  # a truncated-away token is never emitted


DRAWS = 8_000  # seeded: at 10 % hotter the test's p was 1e-24 with 10,000


def _chi_square_p(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float]) -> float:
    """Pearson's goodness of fit: the probability of a statistic this large if ``counts`` were
    drawn from ``expected`` (categories of probability 0 must have no counts)."""
    n = sum(counts.values())
    assert all(counts.get(k, 0) == 0 for k, q in expected.items() if q == 0)
    cells = [(counts.get(k, 0), n * q) for k, q in expected.items() if q > 0]
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5)], ids=["plain", "top-k"]
)
@pytest.mark.parametrize("draft", [(1, 3), (4, 0)], ids=["likely", "unlikely"])
def test_sampled_verification_passes_a_chi_square_test(params: SamplingParams, draft: tuple[int, int]) -> None:
    """The emitted run, binned as sampling without speculation would make it (the first token;
    after the first proposal, the pair), over ``DRAWS`` seeded draws on a vocabulary of 6: the same
    distribution by Pearson's test; and the test tells a distribution 10 % hotter apart."""
    torch.manual_seed(3)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    logits[0, 1] += 2.0  # draft (1, ...) likely, (4, ...) not
    generator = torch.Generator().manual_seed(7)
    rows = [SampleRow(params, generator) for _ in range(3)]
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(DRAWS):
        kept, token, _, _ = verify(logits, rows, draft)
        run = (*kept, token)
        key = run[:2] if run[0] == draft[0] else run[:1]
        counts[key] = counts.get(key, 0) + 1

    def expected(temperature: float) -> dict[tuple[int, ...], float]:
        def probs(row: int) -> torch.Tensor:
            scaled = logits[row] / temperature
            if params.top_k > 0:
                from trillm.engine.execution.sampler import truncate

                scaled = truncate(scaled.unsqueeze(0), [params])[0]
            return torch.softmax(scaled.double(), -1)

        p0, p1 = probs(0), probs(1)
        out = {(t,): float(p0[t]) for t in range(vocab) if t != draft[0]}
        out.update({(draft[0], t): float(p0[draft[0]] * p1[t]) for t in range(vocab)})
        return out

    same = _chi_square_p(counts, expected(params.temperature))
    hot = _chi_square_p(counts, expected(params.temperature * 1.1))
    assert same > 1e-3 and hot < 1e-6


# -- the scheduler driving verifications ------------------------------------------------------

VOCAB, EOS = 5, 0


def model_token(seq: Sequence, end: int) -> int:
    """The stand-in model: periodic for even request ids (proposals come true), hashed otherwise."""
    if int(seq.request_id[1:]) % 2 == 0:
        return 1 + (end % 3)
    return zlib.crc32(f"{seq.request_id}:{end}".encode()) % VOCAB


def true_token(seq: Sequence, position: int) -> int:
    return seq.prompt_ids[position] if position < len(seq.prompt_ids) else model_token(seq, position)


class Driver:
    """The engine's StepLoop over a speculating Scheduler; the worker verifies each proposal
    against the stand-in model and checks every K/V read is of the true prefix."""

    def __init__(self, rng: random.Random, depth: int, longest: int) -> None:
        self.page_size = rng.choice([1, 2, 4])
        self.allocator = PageAllocator(-(-longest // self.page_size) + rng.randint(0, 12))
        self.cache = PrefixCache(self.allocator, self.page_size) if rng.random() < 0.6 else None
        control = SpeculationControl(rng.choice(["ngram", "suffix"]), rng.randint(1, 5))
        self.scheduler = Scheduler(
            self.allocator, self.page_size, rng.randint(1, 5), rng.randint(8, 30), self.cache, speculation=control
        )
        self.loop: StepLoop[tuple[StepInputs, list[list[int]]]] = StepLoop(self.scheduler, self._prepare, depth)
        self.written: dict[tuple[int, int], tuple[int, ...]] = {}
        self.verified = 0
        self.last_sampled: list[int] | None = None

    def _prepare(self, batch: Batch) -> tuple[StepInputs, list[list[int]]]:
        step = StepRows()
        for index, chunk in enumerate(batch.chunks):
            step.add(index, chunk)
        return step.inputs(torch.empty(0), None), [list(c.seq.pages) for c in batch.chunks]  # type: ignore[arg-type]

    def execute(self, step: Step[tuple[StepInputs, list[list[int]]]]) -> Sampled:
        inputs, tables = step.inputs
        fill_pending(inputs, self.last_sampled)  # overlap: the inputs the step before samples
        ids = inputs.input_ids.tolist()
        ps, row = self.page_size, 0
        tokens, accepted = [], []
        for chunk, table in zip(step.batch.chunks, tables):
            seq = chunk.seq
            # positions up to the last known token hold the truth; the proposals are guesses
            known = chunk.end - len(chunk.draft)
            truth = [true_token(seq, p) for p in range(known)]
            assert ids[row : row + chunk.length - len(chunk.draft)] == truth[chunk.start :]
            assert ids[row + chunk.length - len(chunk.draft) : row + chunk.length] == list(chunk.draft)
            row += chunk.length
            for p in range(chunk.start):
                assert self.written[(table[p // ps], p % ps)] == tuple(truth[: p + 1]), "stale KV read"
            inputs_here = truth + list(chunk.draft)
            for p in range(chunk.start, chunk.end):
                self.written[(table[p // ps], p % ps)] = tuple(inputs_here[: p + 1])
            if not chunk.samples:
                continue
            kept: list[int] = []
            for d in chunk.draft:  # greedy verification against the stand-in
                if d != model_token(seq, known + len(kept)):
                    break
                kept.append(d)
            self.verified += len(kept)
            tokens.append(model_token(seq, known + len(kept)))
            accepted.append(tuple(kept))
        self.last_sampled = tokens
        return Sampled(tokens, [None] * len(tokens), accepted, [()] * len(tokens))

    def check_accounting(self) -> None:
        s = self.scheduler
        held = [p for q in [*s.running, *s.waiting] for p in q.pages]
        cached = set(self.cache._nodes) if self.cache is not None else set()
        assert self.allocator.free_pages + len(set(held) | cached) == self.allocator.num_pages
        for q in s.running:  # no page beyond what its tokens need (the proposals' are given back)
            if not q.verifying and q.num_computed:
                assert len(q.pages) <= -(-(q.num_tokens + 1) // self.page_size) + 1


def expected(seq: Sequence) -> tuple[list[int], str]:
    outputs: list[int] = []
    while True:
        token = model_token(seq, len(seq.prompt_ids) + len(outputs))
        outputs.append(token)
        if token == EOS and not seq.params.ignore_eos:
            return outputs, "stop"
        if len(outputs) >= (seq.params.max_tokens or 10**9) or len(seq.prompt_ids) + len(outputs) >= seq.max_len:
            return outputs, "length"


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", range(12))
def test_verifications_give_the_plain_output_and_free_every_page(seed: int, depth: int) -> None:
    rng = random.Random(seed)
    seqs = []
    for i in range(rng.randint(1, 8)):
        prompt = [1 + (j % 3) for j in range(rng.randint(1, 9))] + [rng.randint(1, VOCAB - 1) for _ in range(2)]
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5)
        max_len = min(rng.choice([10_000, len(prompt) + 12]), len(prompt) + (params.max_tokens or 0))  # as the engine
        seqs.append(Sequence(f"r{i}", prompt, params, max_len, frozenset({EOS}), arrival_time=i))
    d = Driver(rng, depth, max(s.max_len for s in seqs))
    pending = list(seqs)
    aborted = {rng.choice(seqs).request_id} if rng.random() < 0.5 else set()
    abort_at = rng.randint(0, 40)
    steps = 0
    while pending or d.loop.has_work:
        if pending and rng.random() < 0.5:
            d.scheduler.add(pending.pop(0))
        if steps == abort_at:
            for request_id in aborted:  # lands while a verification may be in flight
                d.scheduler.abort(request_id)
        d.loop.run_once(d.execute)
        d.check_accounting()
        steps += 1
        assert steps < 3_000, "the pipeline stalled"
    for seq in seqs:
        assert not seq.verifying and not seq.pages
        if seq.finish_reason == "abort":
            assert seq.request_id in aborted
            right, _ = expected(seq)
            assert seq.output_ids == right[: len(seq.output_ids)]
            continue
        assert (seq.output_ids, seq.finish_reason) == expected(seq), seq.request_id
    if d.cache is not None:
        d.cache.flush()
    assert d.allocator.free_pages == d.allocator.num_pages
    if any(int(s.request_id[1:]) % 2 == 0 and len(s.output_ids) >= 12 for s in seqs):
        assert d.verified > 0  # a periodic output is proposed right, and kept
