"""Verifying proposed tokens: which of a chunk's proposals the model keeps, and the token after.

A verification chunk scored its sequence's last token and k proposals d_1..d_k in one step: row j
of its logits is the model's distribution p_j for the token after d_j (row 0: after the last
token). Greedy rows keep d_{j+1} while it is row j's argmax, then emit the argmax where it
differs (or after the last row): exactly what decoding one token at a time emits. Sampled rows
use rejection sampling with the proposal as a point mass (as draft-free proposers are): d_{j+1}
is kept with probability p_j(d_{j+1}); on rejection the token is drawn from p_j without d_{j+1},
renormalised, and the run stops. Each emitted token is then distributed exactly as p_j: kept with
p_j(d), any other x drawn with (1 - p_j(d)) * p_j(x) / (1 - p_j(d)). p_j is the sampler's own
distribution (bias, penalties over the history including the proposals before it, temperature,
min-p/top-k/top-p), so the output distribution is what sampling without speculation gives.
"""

from __future__ import annotations

import torch

from trillm.engine.execution.sampler import adjust, draw, greedy, token_logprobs, truncate, uniform
from trillm.engine.outputs import TokenLogprobs
from trillm.engine.step import Sampled, SampleRow


def verify(
    logits: torch.Tensor, rows: list[SampleRow], draft: tuple[int, ...]
) -> tuple[tuple[int, ...], int, tuple[TokenLogprobs | None, ...], TokenLogprobs | None]:
    """For a chunk's ``len(draft) + 1`` rows of float32 ``logits`` (and their ``rows``): the
    proposals kept, the token after them, and the logprobs of each (where asked for). A row
    with a grammar: each row is masked as the grammar stands after the proposals before it,
    proposals it refuses are not verified, and it takes the emitted tokens."""
    matcher = rows[0].matcher
    if matcher is not None and matcher.active:
        masks, taken = matcher.draft_masks(draft, logits.shape[-1])
        draft, logits, rows = draft[:taken], logits[: taken + 1], rows[: taken + 1]
        adjusted = adjust(logits, rows)
        if adjusted is logits:
            adjusted = logits.clone()
        masks.apply(adjusted)
    else:
        matcher = None
        adjusted = adjust(logits, rows)
    kept, token, kept_logprobs, token_logprobs = _decide(adjusted, rows, draft)
    if matcher is not None:
        matcher.take((*kept, token))
    return kept, token, kept_logprobs, token_logprobs


def _decide(
    adjusted: torch.Tensor, rows: list[SampleRow], draft: tuple[int, ...]
) -> tuple[tuple[int, ...], int, tuple[TokenLogprobs | None, ...], TokenLogprobs | None]:
    params = rows[0].params
    k = len(draft)
    if params.greedy:
        targets = greedy(adjusted).tolist()
        kept = 0
        while kept < k and targets[kept] == draft[kept]:
            kept += 1
        token = targets[kept]
    else:
        scaled = adjusted / params.temperature
        if params.top_k > 0 or params.top_p < 1 or params.min_p > 0:
            scaled = truncate(scaled, [params] * (k + 1))
        probs = torch.softmax(scaled.double(), dim=-1)
        generator = rows[0].generator
        kept = 0
        while kept < k and float(uniform(generator)) < float(probs[kept, draft[kept]]):
            kept += 1
        weights = probs[kept].clone()
        if kept < k:
            weights[draft[kept]] = 0.0  # rejected: the rest of the distribution, renormalised by the draw
        token = int(draw(weights.unsqueeze(0), uniform(generator)))
    emitted = (*draft[:kept], token)
    logprobs = tuple(token_logprobs(adjusted[j], rows[j].params, t) for j, t in enumerate(emitted))
    return draft[:kept], token, logprobs[:-1], logprobs[-1]


def chunk_rows(drafts: tuple[tuple[int, ...], ...]) -> list[int]:
    """The first sampling row of each sampling chunk (a verification has ``len(draft) + 1``)."""
    starts, row = [], 0
    for draft in drafts:
        starts.append(row)
        row += len(draft) + 1
    return starts


def with_verifications(
    plain: Sampled, logits: torch.Tensor, rows: tuple[SampleRow, ...], drafts: tuple[tuple[int, ...], ...]
) -> Sampled:
    """Every sampling chunk's result in batch order: ``plain``'s for the one-row chunks (in
    order), ``verify``'s for the verification chunks."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    accepted: list[tuple[int, ...]] = []
    accepted_logprobs: list[tuple[TokenLogprobs | None, ...]] = []
    plain_tokens, plain_logprobs = iter(plain.tokens), iter(plain.logprobs)
    for start, draft in zip(chunk_rows(drafts), drafts):
        if not draft:
            tokens.append(next(plain_tokens))
            logprobs.append(next(plain_logprobs))
            accepted.append(())
            accepted_logprobs.append(())
            continue
        end = start + len(draft) + 1
        kept, token, kept_logprobs, token_logprobs = verify(logits[start:end], list(rows[start:end]), draft)
        tokens.append(token)
        logprobs.append(token_logprobs)
        accepted.append(kept)
        accepted_logprobs.append(kept_logprobs)
    return Sampled(tokens, logprobs, accepted, accepted_logprobs)
