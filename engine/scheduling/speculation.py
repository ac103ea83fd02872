"""Speculation's scheduling side: which sequences carry proposed tokens into a step, and which.

A decode step reads every weight once whatever its rows; on a CPU (and a GPU at small batches)
several rows cost about what one does. So a sequence may carry k proposed tokens into a step, the
model scores all of them at once, and the sampler keeps the longest prefix it agrees with plus one
token of its own (``execution/verify.py``): greedy output is the output without speculation, and
sampled output keeps its distribution.

``ngram_proposer.NgramProposer`` is prompt lookup: the last tokens matched against the request's own prompt and
output (and a client's predicted output, first), the tokens after the longest recent match
proposed. Its state is the request's own, built from its tokens as they come, so it is never
stale across requests. ``suffix_cache.SuffixCache`` proposes what earlier requests wrote. With a
draft model (``execution/draft.py``) the proposals here are placeholders its guesses fill in.

``SpeculationControl`` decides per step and per sequence: a sequence whose proposals keep failing
backs off (exponentially, up to ``MAX_COOLDOWN`` tokens), and a step carries the proposed tokens
likeliest kept (by each sequence's per-token acceptance) only while the measured step times say the
extra rows cost less than the tokens they are expected to bring (a stalled step moves them only so
far, and a size turned down ``RECHECK`` times is measured again).
Pure and synchronous, as the scheduler is.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import TYPE_CHECKING

import attrs

from trillm.engine.scheduling.ngram_proposer import NgramProposer
from trillm.engine.scheduling.suffix_cache import SuffixCache
from trillm.engine.step import PENDING

if TYPE_CHECKING:
    from trillm.engine.scheduling.sequence import Sequence

MODES = ("off", "ngram", "suffix", "draft", "auto")
MAX_COOLDOWN = 32  # tokens a sequence whose proposals were all rejected decodes plainly, at most
EMA = 0.2  # weight of the newest measurement in the running averages
MARGIN = 1.03  # speculation must promise 3 % more tokens per second than a plain step
# A step measured at more than this times its running average moves it as if it took this times:
# a VM's pause (both of two servers stalled 0.1-1 s at the same instants, measured) once made a
# 9-row step's average look 10x too high, and speculation stayed off for the rest of the run.
OUTLIER = 2.0
RECHECK = 100  # steps declined in a row, after which one sequence's proposals measure again
PRIOR_EMA = 0.02  # the newest verification's weight in every request's acceptance (a new one's prior)
PRIOR_TRIALS = 2.0  # the tokens' worth of evidence a new sequence's prior counts for
PREDICTED = 0.8  # a new sequence's acceptance at least, with a client's predicted output


def _kept_chances(p: float, n: int) -> list[float]:
    """Each of ``n`` proposed tokens' chance to be kept: it and every one before it agreed with (p each)."""
    out, c = [], 1.0
    for _ in range(n):
        c *= p
        out.append(c)
    return out


@attrs.define
class SequenceSpeculation:
    """One sequence's proposer and how its proposals have fared."""

    proposer: NgramProposer
    known: int = 0  # of the sequence's tokens, how many the proposer has seen
    resume_at: int = 0  # it proposes again once it has this many known tokens (backing off)
    misses: int = 0  # verifications in a row that accepted nothing
    # a proposed token's chance to be kept where the ones before it were: hits over trials (each
    # kept token a hit, the token that stopped a verification a miss), both running sums
    acceptance: float = 0.6
    hits: float = 1.2
    trials: float = 2.0
    method: str = "ngram"  # where the proposal in flight came from: "ngram", "prediction" or "suffix"
    matched: bool = False  # whether it had a match when last looked at (``match_seen`` tokens known)
    match_seen: int = -1
    kept_match: float = 1.0  # running share of new tokens after which a match was still one
    proposed: int = 0
    accepted: int = 0
    prediction_accepted: int = 0


@attrs.define
class SpeculationStats:
    """Counters for ``/metrics`` (vLLM's ``spec_decode_*``)."""

    drafts: int = 0  # verifications run
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # proposed tokens the model agreed with
    emitted_tokens: int = 0  # tokens verifications produced (accepted + the model's own)


class SpeculationControl:
    """Which sequences propose, and how many tokens, in the step being built."""

    def __init__(self, mode: str, num_tokens: int, overlap: bool = True, draft_model: bool = False) -> None:
        """``draft_model``: a draft model proposes (mode ``draft``, or ``auto`` with one); the
        proposals here are then placeholders the runner fills in (``execution/draft.py``)."""
        if mode not in MODES:
            raise ValueError(f"speculative must be one of {', '.join(MODES)}, not {mode!r}")
        if num_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.mode = mode
        self.num_tokens = num_tokens
        # by method: "ngram" (prompt lookup over the request's tokens), "prediction" (its predicted
        # output), "suffix" (what earlier requests generated)
        self.stats: dict[str, SpeculationStats] = {}
        self.drafted = draft_model and mode in ("draft", "auto")
        self.suffix = SuffixCache() if mode in ("suffix", "auto") and not self.drafted else None
        # plain decode steps' seconds by rows (running averages), and a proposed row's seconds by the
        # sequences of the step carrying it: what speculation's rows cost
        self.step_seconds: dict[int, float] = {}
        self.row_seconds: dict[int, float] = {}
        self._sizes: list[int] = []  # step_seconds' keys, sorted
        self._slope: float | None = None  # of step_seconds' least-squares line, once computed
        self.host_seconds = 0.0  # the scheduler's own work per step (running average)
        self.declined = 0  # steps in a row whose proposals the cost model turned down
        # every request's proposals, as SequenceSpeculation's hits and trials: a new request's prior
        self.hits, self.trials = 0.6 * PRIOR_TRIALS, PRIOR_TRIALS
        self.overlap = overlap  # plain steps overlap the scheduler's work with the forward

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def adaptive(self) -> bool:
        """``auto``: a step speculates only where the cost model says it pays (``worth``)."""
        return self.mode == "auto"

    def observe_step(self, rows: int, seconds: float, sequences: int | None = None) -> None:
        """A decode step (every chunk a decode or a verification) of ``sequences`` sequences and
        ``rows`` rows took ``seconds``: a plain step (``sequences`` None or ``rows``) moves the
        plain steps' table, one with proposed rows the cost of a proposed row at that many
        sequences (their rows run on the kernels the plain step picks: ``DecodeRows.kernel_rows``,
        so a proposed row's cost is its sequences', not a plain step's of as many rows)."""
        if sequences is None or sequences == rows:
            old = self.step_seconds.get(rows)
            if old is not None:
                seconds = min(seconds, OUTLIER * old)
            else:
                bisect.insort(self._sizes, rows)
            self.step_seconds[rows] = seconds if old is None else old + EMA * (seconds - old)
            self._slope = None
            return
        plain = self._cost(sequences)
        if plain is None:
            return  # nothing to tell the proposed rows' share by yet
        per_row = max(0.0, seconds - plain) / (rows - sequences)
        old = self.row_seconds.get(sequences)
        if old is not None:
            per_row = min(per_row, OUTLIER * old)
        self.row_seconds[sequences] = per_row if old is None else old + EMA * (per_row - old)

    def observe_host(self, seconds: float) -> None:
        """The scheduler's own work for one step (schedule, prepare, settle, route) took
        ``seconds``: overlap hides it behind the forward, a speculating step (which waits for the
        one before) pays it."""
        self.host_seconds += EMA * (seconds - self.host_seconds)

    def _cost(self, rows: int) -> float | None:
        """Estimated forward seconds of a decode step of ``rows`` rows: measured, else linear
        between the nearest measured sizes, else from the nearest one along the least-squares
        slope of them all (adjacent sizes' times are too noisy for a slope). None below every
        measured size, or with fewer than two: unknown."""
        table, sizes = self.step_seconds, self._sizes
        if rows in table:
            return table[rows]
        i = bisect.bisect_left(sizes, rows)
        if i == 0 or len(sizes) < 2:
            return None
        if i < len(sizes):
            lo, hi = sizes[i - 1], sizes[i]
            return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
        if self._slope is None:
            mean_r = sum(sizes) / len(sizes)
            mean_s = sum(table.values()) / len(sizes)
            covariance = sum((r - mean_r) * (table[r] - mean_s) for r in sizes)
            self._slope = max(0.0, covariance / sum((r - mean_r) ** 2 for r in sizes))
        return table[sizes[-1]] + self._slope * (rows - sizes[-1])

    def _row_costs(self, rows: int) -> tuple[float, float] | None:
        """Estimated forward seconds of a plain step of ``rows`` decodes, and of each proposed row
        such a step carries (measured at those sequences, else at the nearest sequences measured).
        None: either unknown."""
        plain = self._cost(rows)
        if plain is None or not self.row_seconds:
            return None
        per_row = self.row_seconds.get(rows)
        if per_row is None:
            per_row = self.row_seconds[min(self.row_seconds, key=lambda s: (abs(s - rows), s))]
        return plain, per_row

    def _decide(self, rows: int, chances: dict[int, list[float]]) -> Counter[int] | None:
        """How many of each sequence's proposed tokens (``chances``: each one's chance to be kept,
        by key) a step of ``rows`` decodes should carry: the tokens likeliest kept first, for as
        long as the step's expected tokens per second rise (each row costs the same and each token
        brings less than the one before, so the first fall is past the best), if those then pay
        (``worth``); empty if they do not, None if the costs are not measured yet. A sequence's
        tokens are taken from its first, as its chances never rise."""
        costs = self._row_costs(rows)
        if costs is None:
            return None
        plain, per_row = costs
        order = sorted(((c, key) for key, cs in chances.items() for c in cs), key=lambda t: -t[0])
        best_n, best_rate, best_expected, expected = 0, 0.0, 0.0, 0.0
        for n, (c, _) in enumerate(order, 1):
            expected += c
            rate = (rows + expected) / (plain + n * per_row + self.host_seconds)
            if rate <= best_rate:
                break
            best_n, best_rate, best_expected = n, rate, expected
        if not best_n or not self._pays(rows, best_n, best_expected, costs):
            return Counter()
        return Counter(key for _, key in order[:best_n])

    def worth(self, rows: int, extra: int, expected: float) -> bool:
        """Whether a step of ``rows`` decodes plus ``extra`` proposed rows, expected to bring
        ``expected`` more tokens, beats the plain step in tokens per second: the plain one
        overlapped with the scheduler's work (``overlap``), the speculating one after it."""
        costs = self._row_costs(rows)
        return costs is None or self._pays(rows, extra, expected, costs)  # not measured yet: try it, and measure

    def _pays(self, rows: int, extra: int, expected: float, costs: tuple[float, float]) -> bool:
        """``worth`` with the step's costs (``_row_costs``) at hand."""
        plain, per_row = costs
        host = self.host_seconds
        plain_step = max(plain, host) if self.overlap else plain + host
        return (rows + expected) / (plain + extra * per_row + host) > MARGIN * rows / plain_step

    def state(self, prediction: tuple[int, ...], prompt_len: int) -> SequenceSpeculation:
        """A new sequence's proposer, its acceptance starting from what recent requests' proposals
        kept (worth ``PRIOR_TRIALS`` tokens: open chat keeps a tenth, and a fresh request there should
        not pay for two failed verifications to learn it), or ``PREDICTED`` with a client's predicted
        output (the client says what the output will be)."""
        p = self.hits / self.trials
        if prediction:
            p = max(p, PREDICTED)
        return SequenceSpeculation(
            NgramProposer(prediction, prompt_len), acceptance=p, hits=p * PRIOR_TRIALS, trials=PRIOR_TRIALS
        )

    # -- over the scheduler's running sequences ------------------------------------------------

    @staticmethod
    def may_speculate(seq: Sequence) -> bool:
        """Whether ``seq`` may carry proposals at all: it opted in, it decodes, and it is past
        ``min_tokens`` (a grammar is no obstacle: the verification masks each row after the
        proposals before it)."""
        p = seq.params
        return (
            p.speculative
            and p.thinking_budget is None  # its forced tokens are decided as the runner samples
            and seq.admitted
            and len(seq.output_ids) >= p.min_tokens
            and seq.num_tokens - seq.num_computed <= 1
        )

    def known(self, seq: Sequence) -> SequenceSpeculation:
        """Its proposer, told every token known now."""
        if seq.spec is None:
            seq.spec = self.state(seq.params.prediction, len(seq.prompt_ids))
        spec: SequenceSpeculation = seq.spec
        known = len(seq.prompt_ids) + seq.num_known_outputs
        if known > spec.known:
            spec.proposer.extend(seq.token_ids(spec.known, known))
            spec.known = known
        return spec

    def proposals(self, running: list[Sequence]) -> dict[int, tuple[int, ...]]:
        """Proposed tokens per running decode (by ``id``), if the step they make is worth it.
        Call with every token known (no step in flight)."""
        decodes = [seq for seq in running if seq.num_pending == 1 and not seq.verifying]
        proposals: dict[int, tuple[int, ...]] = {}
        chance: dict[int, float] = {}  # by key: each proposed token's chance to be kept
        for seq in decodes:
            if not self.may_speculate(seq):
                continue
            spec = self.known(seq)
            if spec.known < spec.resume_at:
                continue
            room = min(self.num_tokens, seq.max_len - seq.num_tokens - 1)
            if room <= 0:
                continue
            if self.drafted:  # the draft model's guesses, made by the runner just before the step
                proposals[id(seq)] = (PENDING,) * room
                chance[id(seq)] = spec.acceptance
                spec.method = "draft"
                continue
            proposed, from_prediction = spec.proposer.propose(room)
            spec.method = "prediction" if from_prediction else "ngram"
            if not proposed and self._may_use_suffix(seq):
                assert self.suffix is not None
                proposed, spec.method = self.suffix.propose(spec.proposer.tokens, room), "suffix"
            if proposed:
                proposals[id(seq)] = proposed
                chance[id(seq)] = spec.acceptance
        if not proposals or not self.adaptive:
            if self.declined >= RECHECK:  # the step ``wants`` waited for had nothing to measure
                self.declined = 0
            return proposals
        counts = self._decide(len(decodes), {key: _kept_chances(chance[key], len(p)) for key, p in proposals.items()})
        if counts is not None:
            if counts:
                self.declined = 0
                return {key: proposals[key][:n] for key, n in counts.items()}
            self.declined += 1
            if self.declined < RECHECK:
                return {}
            self.declined = 0  # estimates are only renewed by steps that run: renew one now
        elif self._cost(len(decodes)) is None:
            # a plain step of this many decodes first: what proposed rows cost is measured against it
            # (probed blind, every step of a 32-stream batch carried a probe and none was ever weighed)
            return {}
        # not measured yet (or due again): one sequence's proposals probe what a few more rows cost
        # (a whole batch's, tried blind at 32 streams, made the first seconds of a run 25 % slower)
        first = next(iter(proposals))
        return {first: proposals[first]}

    def wants(self, running: list[Sequence]) -> bool:
        """Whether the next step should wait for the one in flight (giving up overlap for a step)
        so that its decodes can carry proposals: some sequence is verifying, or has a match to
        propose from now and (``auto``) the rows it would add are expected to pay."""
        chances: dict[int, list[float]] = {}
        for seq in running:
            if seq.verifying:
                return True
            if self.may_speculate(seq) and seq.output_ids:
                spec = self.known(seq)
                if self._still_matches(seq, spec) and spec.known >= spec.resume_at:
                    chances[id(seq)] = [spec.kept_match * c for c in _kept_chances(spec.acceptance, self.num_tokens)]
        if not chances:
            return False
        counts = self._decide(len(running), chances) if self.adaptive else None
        if counts is None and self.adaptive and self._cost(len(running)) is None:
            return False  # a plain step of this size first (``proposals``)
        if counts is None or counts:  # not adaptive, not measured yet, or worth it
            return True
        # turned down: estimates are only renewed by steps that run, so now and then one does
        self.declined += 1
        return self.declined >= RECHECK

    def _still_matches(self, seq: Sequence, spec: SequenceSpeculation) -> bool:
        """Whether ``seq`` has a match now; and, once per new token, how often a match one token
        ago is still one (``kept_match``). ``wants`` looks one token ahead of the proposals it
        waits for: in new prose a two-token match is mostly gone after the next token (three
        waits in four found nothing to propose, each giving up overlap for nothing); in a
        repeated passage it stays."""
        if spec.known == spec.match_seen:
            return spec.matched
        matched = self._has_match(seq, spec)
        if spec.matched:
            spec.kept_match += EMA * (matched - spec.kept_match)
        spec.matched, spec.match_seen = matched, spec.known
        return matched

    def _may_use_suffix(self, seq: Sequence) -> bool:
        """Whether other requests' outputs may be proposed to ``seq``: not to a seeded sampled
        request, whose draws must repeat with its seed (they follow what is proposed)."""
        p = seq.params
        return self.suffix is not None and (p.greedy or p.seed is None)

    def _has_match(self, seq: Sequence, spec: SequenceSpeculation) -> bool:
        if self.drafted or spec.proposer.has_match():
            return True
        return self._may_use_suffix(seq) and self.suffix is not None and self.suffix.has_match(spec.proposer.tokens)

    def learn(self, seq: Sequence) -> None:
        """A sequence ended: its output joins what later requests may be proposed (``suffix``)."""
        if self.suffix is not None:
            self.suffix.learn(seq.prompt_ids, seq.output_ids[: seq.num_known_outputs])

    def clear(self) -> None:
        """``/flush_cache``: forget what earlier requests generated."""
        if self.suffix is not None:
            self.suffix.clear()

    def record(self, spec: SequenceSpeculation, proposed: int, accepted: int, method: str) -> None:
        """A verification of ``proposed`` tokens accepted ``accepted`` of them."""
        spec.proposed += proposed
        spec.accepted += accepted
        if method == "prediction":
            spec.prediction_accepted += accepted
        spec.hits = (1 - EMA) * spec.hits + accepted
        spec.trials = (1 - EMA) * spec.trials + accepted + (accepted < proposed)
        spec.acceptance = spec.hits / spec.trials
        self.hits = (1 - PRIOR_EMA) * self.hits + accepted
        self.trials = (1 - PRIOR_EMA) * self.trials + accepted + (accepted < proposed)
        if accepted:
            spec.misses = 0
        else:
            spec.misses += 1
            # the verification's own token is known once it settles: back off from there
            spec.resume_at = spec.known + 1 + min(MAX_COOLDOWN, 1 << (spec.misses - 1))
        s = self.stats.setdefault(method, SpeculationStats())
        s.drafts += 1
        s.draft_tokens += proposed
        s.accepted_tokens += accepted
        s.emitted_tokens += accepted + 1
