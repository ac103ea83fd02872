"""Scheduling policy: which tokens of which sequences run in the next step.

Pure and synchronous (no Trio, no tensors) so every rule is unit-tested by
calling methods. The scheduler actor in ``engine.actors`` only moves messages
and calls into this class.

Longer than our ~400-line guide, as one idea: admission, growth, preemption and the settling
of returned steps (verifications included) all move the same pages and counters, and the
invariants between them (no page leaked or shared wrongly, ``num_settled <= num_computed``) are
checked in one place. Which tokens to propose lives in ``speculation.py``.
"""

from __future__ import annotations

from collections import deque

import attrs

from trillm.engine.scheduling.kv_pages import DROPPED_PAGE, PageAllocator, pages_needed
from trillm.engine.scheduling.policy import SchedulingPolicy
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.speculation import SpeculationControl
from trillm.engine.step import PENDING, Batch, ScheduledChunk


@attrs.define
class _Draft:
    """The step being built: its chunks, the token budget left, and the best rank preempted in it."""

    budget: int
    chunks: list[ScheduledChunk[Sequence]] = attrs.field(factory=list)
    floor: tuple[float, float] | None = None

    def add(self, chunk: ScheduledChunk[Sequence]) -> None:
        self.chunks.append(chunk)
        self.budget -= chunk.length

    def holds(self, seq: Sequence) -> bool:
        return any(c.seq is seq for c in self.chunks)

    def drop(self, seq: Sequence) -> None:
        """A sequence preempted after it was scheduled in this step: its chunk and tokens go."""
        for i, chunk in enumerate(self.chunks):
            if chunk.seq is seq:
                del self.chunks[i]
                self.budget += chunk.length
                return


# A prompt-logprobs prefill's rows per step: each row's logits are kept, rows x vocabulary floats
# (512 x 262,144 is 512 MiB), where other prefills take the whole ``max_batch_tokens``.
PROMPT_LOGPROB_ROWS = 512


def _chunk_length(seq: Sequence, budget: int) -> int:
    length = min(seq.num_pending, budget)
    return min(length, PROMPT_LOGPROB_ROWS) if seq.params.prompt_logprobs is not None else length


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recompute.

    Each step: every running sequence gets its next tokens (decodes first, one
    token each), then waiting sequences are admitted in the policy's order
    (``policy.py``: arrival, or priority then arrival) while the token budget,
    the sequence limit and the free pages allow. A running sequence that cannot
    grow preempts the newest (fcfs) or lowest-ranked (priority) running one
    instead of failing; under priority a waiting sequence short of pages or of a
    seat also displaces a running one it outranks.

    A step is ``schedule``d, then ``launch``ed (its sequences advance, with a
    ``PENDING`` token for each sample), then ``resolve``d with the sampled
    tokens. Between launch and resolve the next step may be scheduled: that is
    how the engine prepares step N+1 while step N runs. ``complete`` is launch
    and resolve at once.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        prefix_cache: PrefixCache | None = None,
        policy: SchedulingPolicy | None = None,
        window: int = 0,
        speculation: SpeculationControl | None = None,
    ) -> None:
        """``window`` > 0: every layer attends only its last ``window`` tokens (``ModelShape.
        attention_span``), so a sequence's pages wholly before its next query's window go back
        to the pool as it advances (``_drop_passed_pages``). ``speculation``: decodes may carry
        proposed tokens (``speculation.py``) when ``schedule`` is asked to speculate."""
        self.allocator = allocator
        self.speculation = speculation if speculation is not None and speculation.enabled else None
        self.window = window
        self.policy = policy or SchedulingPolicy()
        self.prefix_cache = prefix_cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- admission and removal -------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if pages_needed(min(seq.max_len, seq.num_tokens + 1), self.page_size) > self.allocator.num_pages:
            raise ValueError("sequence can never fit in the KV cache")
        self.policy.enqueue(self.waiting, seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Cut a sequence short: remove it wherever it is, free its pages, and finish it
        "abort"; idempotent. Its steps in flight are ignored when they resolve."""
        seq = self._find(request_id)
        if seq is not None:
            self._remove(seq)
            seq.finish_reason = seq.finish_reason or "abort"
        return seq

    def release_finished(self, request_id: str) -> Sequence | None:
        """Free the pages of a sequence finished outside the scheduler (a stop string found in
        its text), keeping its finish reason; a no-op for one the scheduler already retired."""
        seq = self._find(request_id)
        if seq is not None:
            assert seq.is_finished, "only a finished sequence is released; cut one short with abort"
            self._remove(seq)
        return seq

    def _find(self, request_id: str) -> Sequence | None:
        return next(
            (seq for queue in (self.waiting, self.running) for seq in queue if seq.request_id == request_id), None
        )

    def _remove(self, seq: Sequence) -> None:
        """Out of its queue, pages freed, tokens still in flight forgotten."""
        (self.running if seq in self.running else self.waiting).remove(seq)
        self._release(seq)
        seq.drop_pending()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------

    def schedule(self, speculate: bool = False) -> Batch[Sequence]:
        """The next step. ``speculate`` (no step in flight, so every token is known): decodes
        may carry proposed tokens, where ``speculation`` finds some and judges them worth it."""
        draft = _Draft(self.max_batch_tokens)
        rank = self.policy.rank
        by_priority = self.policy.by_priority
        proposals = self.speculation.proposals(self.running) if speculate and self.speculation is not None else {}
        # Decodes first (one token each), then running prefills: oldest first (fcfs) or by rank.
        order = sorted(self.running, key=lambda s: (s.num_pending != 1, rank(s) if by_priority else 0.0))
        for seq in order:
            if draft.budget <= 0:
                break
            if seq not in self.running:
                continue  # preempted while making room for another
            if seq.awaits_last_token or seq.verifying:
                continue  # it ends, or learns its next tokens, when the step in flight returns
            self._drop_passed_pages(seq)
            proposed = proposals.get(id(seq), ())[: max(0, draft.budget - 1)]
            length = _chunk_length(seq, draft.budget) + len(proposed)
            if not self._grow(seq, seq.num_computed + length, draft):
                continue  # it preempted itself
            if proposed:
                chunk = ScheduledChunk(seq, seq.num_computed, length, True, seq.num_preemptions, proposed)
            else:
                chunk = ScheduledChunk.next_for(seq, length)
            draft.add(chunk)
        while draft.budget > 0 and self.waiting:
            seq = self.waiting[0]
            if seq.awaits_last_token or seq.verifying:
                break  # preempted while its last tokens are in flight: it goes on when they return
            if draft.floor is not None and rank(seq) >= draft.floor:
                break  # preempted this step (or behind one that was): admitting it would undo that
            full = len(self.running) >= self.max_num_seqs
            if full and not self._can_displace(seq):
                break
            if seq.leader is not None and not self._follow(seq):
                break  # its leader is still prefilling the shared prompt
            if full:
                self._displace(seq, draft)
            self._reuse_cached_prefix(seq)
            self._drop_passed_pages(seq)  # a long cached prefix: its first pages may be past the window
            length = _chunk_length(seq, draft.budget)
            need = pages_needed(seq.num_computed + length, self.page_size) - len(seq.pages)
            while not self._make_room(need) and self._displace(seq, draft):
                pass  # under priority: a running sequence it outranks gives its pages back
            if not self.allocator.can_allocate(need):
                # Admission never over-commits: it waits for pages, holding none. Cached or leader's
                # pages taken above go back (else a sequence requeued before it could wait for them).
                if seq.pages:
                    self.allocator.free(seq.pages[seq.dropped_pages :])
                    seq.pages, seq.dropped_pages, seq.num_computed, seq.num_settled = [], 0, 0, 0
                break
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = min(seq.num_computed, len(seq.prompt_ids))
                self.prefix_queries += len(seq.prompt_ids)
                self.prefix_hits += seq.num_cached_tokens
            seq.pages += self.allocator.allocate(need)
            self.waiting.popleft()
            self.running.append(seq)
            draft.add(ScheduledChunk.next_for(seq, length))
        return Batch(tuple(draft.chunks))

    def _can_displace(self, seq: Sequence) -> bool:
        """Under priority: whether some running sequence ranks below waiting ``seq``."""
        return bool(self.running) and self.policy.outranks(seq, self.policy.victim(self.running))

    def _displace(self, seq: Sequence, draft: _Draft) -> bool:
        """Preempt the lowest-ranked running sequence if waiting ``seq`` outranks it."""
        if not self._can_displace(seq):
            return False
        self._preempt(self.policy.victim(self.running), draft)
        return True

    def _reuse_cached_prefix(self, seq: Sequence) -> bool:
        """Start ``seq`` after the longest prefix of its tokens found in the cache.

        Not for one that needs every prompt row computed (``Sequence.reuses_prefix``): its pages
        are cached when it ends, as any request's."""
        if self.prefix_cache is None or seq.pages or seq.num_computed or not seq.reuses_prefix:
            return False
        pages = self.prefix_cache.match(seq.token_ids(0, seq.num_tokens))
        if not pages:
            return False
        seq.pages = self.allocator.share(pages)
        seq.num_computed = seq.num_settled = len(pages) * self.page_size
        return True

    def _make_room(self, need: int) -> bool:
        """True when ``need`` pages can be allocated, evicting unreferenced cache if needed."""
        short = need - self.allocator.free_pages
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.can_allocate(need)

    def flush_cache(self) -> int:
        """Free every cached page no request holds (returns how many), and forget what earlier
        requests generated (speculation's ``suffix`` memory)."""
        if self.speculation is not None:
            self.speculation.clear()
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    @property
    def evictable_pages(self) -> int:
        return self.prefix_cache.evictable_pages if self.prefix_cache is not None else 0

    def _follow(self, seq: Sequence) -> bool:
        """Fork ``seq`` from its leader's prompt pages once they are computed.

        It shares every full page before the one holding the last prompt
        token and computes the rest itself (at most one page), so pages it
        writes are always its own. Returns False while it must wait.
        """
        leader = seq.leader
        assert leader is not None
        if leader in self.running and leader.dropped_pages:  # its first pages are gone: compute alone
            seq.leader = None
            return True
        if leader in self.running and leader.num_settled >= len(leader.prompt_ids):
            shared = (len(seq.prompt_ids) - 1) // self.page_size
            seq.pages = self.allocator.share(leader.pages[:shared])
            seq.num_computed = seq.num_settled = shared * self.page_size
            seq.leader = None
            return True
        if leader in self.running or leader in self.waiting:
            return False
        seq.leader = None  # the leader is gone: compute the prompt alone
        return True

    def _drop_passed_pages(self, seq: Sequence) -> None:
        """Give back the pages no query of ``seq`` will read again: its next query is at position
        ``num_computed`` (a step in flight reads before the next one writes: the steps run one
        after the other), and sees keys from ``num_computed - window + 1`` on. Pages in the prefix
        cache stay there (its reference), evictable as any unreferenced page."""
        if not self.window:
            return
        dead = max(0, seq.num_computed - self.window + 1) // self.page_size
        if dead > seq.dropped_pages:
            self.allocator.free(seq.pages[seq.dropped_pages : dead])
            seq.pages[seq.dropped_pages : dead] = [DROPPED_PAGE] * (dead - seq.dropped_pages)
            seq.dropped_pages = dead

    def _grow(self, seq: Sequence, num_tokens: int, draft: _Draft) -> bool:
        """Give ``seq`` pages for ``num_tokens``, preempting others if needed: under fcfs the
        newest not yet scheduled this step, under priority the lowest-ranked (its chunk in
        this step is dropped). Returns False when ``seq`` itself had to be preempted.
        """
        need = pages_needed(num_tokens, self.page_size) - len(seq.pages)
        while not self._make_room(need):
            victims = self.running if self.policy.by_priority else [s for s in self.running if not draft.holds(s)]
            victim = self.policy.victim(victims)
            self._preempt(victim, draft)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.allocator.allocate(need)
        return True

    def _preempt(self, seq: Sequence, draft: _Draft) -> None:
        """Back to the waiting queue, pages released (full computed ones stay in the prefix
        cache); it is recomputed later with its generated tokens kept."""
        draft.drop(seq)
        if self.policy.by_priority:
            rank = self.policy.rank(seq)
            draft.floor = rank if draft.floor is None else min(draft.floor, rank)
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = seq.num_settled = 0
        seq.leader = None
        seq.pooled, seq.num_pooled = None, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.requeue(self.waiting, seq)

    def launch(self, batch: Batch[Sequence]) -> None:
        """A step goes into flight: its sequences advance past its chunks, and each
        sampling chunk appends a ``PENDING`` token that ``resolve`` fills in."""
        sample = 0
        for chunk in batch.chunks:
            seq = chunk.seq
            if chunk.samples:
                sample += 1
            if seq.is_finished or chunk.generation != seq.num_preemptions:
                continue  # aborted (or preempted) since it was scheduled
            if chunk.draft:  # what it computes beyond its last token is known when the step returns
                seq.num_computed = chunk.start + 1
                seq.verifying = True
                continue
            seq.num_computed = chunk.end
            if chunk.samples:
                seq.output_ids.append(PENDING)
                seq.pending_sample = sample - 1

    def resolve(
        self, batch: Batch[Sequence], sampled: list[int], accepted: list[tuple[int, ...]] | None = None
    ) -> list[tuple[Sequence, int]]:
        """Apply a launched step that returned: settle its KV, put each sampled token
        in place of its ``PENDING`` and retire sequences that finished.

        ``sampled`` holds one token per chunk that samples, in batch order; ``accepted``, per
        such chunk, the proposals the sampler kept before that token (a verification's).
        Sequences aborted or finished while the step ran are skipped (their pages
        were freed once, then). A sequence preempted while the step ran keeps its
        token, for it is right, but not the step's KV. Returns each sequence that
        got a token with that token's index in its ``output_ids``, in order.
        """
        tokens = iter(sampled)
        kept_runs = iter(accepted or ())
        updated: list[tuple[Sequence, int]] = []
        for chunk in batch.chunks:
            seq = chunk.seq
            token = next(tokens) if chunk.samples else None
            kept = next(kept_runs, ()) if chunk.samples else ()
            if chunk.draft:
                seq.verifying = False
                if not seq.is_finished:
                    assert token is not None
                    self._settle_verification(seq, chunk, kept, token, updated)
                continue
            if seq.is_finished:
                continue
            if chunk.generation == seq.num_preemptions:
                seq.num_settled = max(seq.num_settled, chunk.end)
                if self.prefix_cache is not None and chunk.length > 1 and not seq.dropped_pages and seq.reuses_prefix:
                    # Full prompt pages are final once computed: share them with requests arriving
                    # now, not only after this one ends. Not the pages of one that computes its
                    # prefix again rather than reusing it: hung below the cached copies, they
                    # would keep those from eviction while it runs, and a preempted one's
                    # every restart would strand more, until it no longer fits.
                    self.prefix_cache.insert(seq.token_ids(0, seq.num_settled), seq.pages, seq.num_settled)
            if token is None:
                continue
            self._settle(seq, chunk.end - len(seq.prompt_ids), token, updated)
        return updated

    def _settle(self, seq: Sequence, index: int, token: int, updated: list[tuple[Sequence, int]]) -> bool:
        """``token`` becomes output ``index``; a sequence it ends is retired (pages freed).
        Returns whether it ended."""
        seq.settle_token(index, token)
        updated.append((seq, index))
        if seq.is_finished:
            queue = self.running if seq in self.running else self.waiting
            queue.remove(seq)
            self._release(seq)
        return seq.is_finished

    def wants_to_speculate(self) -> bool:
        """Whether the next step should wait for the one in flight (no overlap) so that its
        decodes can carry proposals (``SpeculationControl.wants``)."""
        return self.speculation is not None and self.speculation.wants(self.running)

    def _settle_verification(
        self,
        seq: Sequence,
        chunk: ScheduledChunk[Sequence],
        kept: tuple[int, ...],
        token: int,
        updated: list[tuple[Sequence, int]],
    ) -> None:
        """A verification returned: the kept proposals' K/V is valid (the rest is overwritten
        later, and pages wholly past the tokens go back now), and each kept token and the one
        after them is settled in order, until one ends the sequence."""
        if self.speculation is not None and seq.spec is not None:
            self.speculation.record(seq.spec, len(chunk.draft), len(kept), seq.spec.method)
        current = chunk.generation == seq.num_preemptions
        if current:
            seq.num_computed = seq.num_settled = chunk.start + 1 + len(kept)
        for t in (*kept, token):
            seq.output_ids.append(t)
            if self._settle(seq, len(seq.output_ids) - 1, t, updated):
                return
        if current:
            keep = max(pages_needed(seq.num_tokens, self.page_size), seq.dropped_pages)
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    def complete(self, batch: Batch[Sequence], sampled: list[int]) -> list[Sequence]:
        """Launch and resolve a step at once; returns the sequences that got a token."""
        self.launch(batch)
        return [seq for seq, _ in self.resolve(batch, sampled)]

    def _release(self, seq: Sequence) -> None:
        """Drop the sequence's pages; with a prefix cache its computed full pages stay cached
        (unless the window has taken its first ones: a cached prefix starts at the first page)."""
        if self.prefix_cache is not None and seq.pages and not seq.dropped_pages:
            self.prefix_cache.insert(seq.token_ids(0, seq.num_settled), seq.pages, seq.num_settled)
        if seq.is_finished and self.speculation is not None:
            self.speculation.learn(seq)
        self.allocator.free(seq.pages[seq.dropped_pages :])
        seq.pages, seq.dropped_pages = [], 0
