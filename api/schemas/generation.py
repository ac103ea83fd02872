"""The fields every generation request shares (chat and completions), declared once.

Each field's description is the user documentation: ``/openapi.json`` and the
tables of ``docs/api.md`` print it as is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import attrs
from pydantic import Field, model_validator

from trillm.api.errors import shown
from trillm.api.schemas.base import Not, RequestModel, invalid
from trillm.api.schemas.structured import StructuredFields
from trillm.engine import MAX_PRIORITY, SEED_MAX, SEED_MIN, GrammarSpec, SamplingParams

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 1024  # characters of one stop string: each is searched for in every output text
MAX_N = 32

TokenId = Annotated[int, Field(ge=0)]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
_TokenKey = Annotated[str, Field(pattern=r"^[0-9]+$")]
_Stop = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]


def left_truncated(ids: list[int], keep: int | None, max_model_len: int, room: int = 1) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens of ``ids`` (all for None); -1: as
    many as the context holds beside ``room`` tokens to generate (at least one)."""
    if keep == -1:
        keep = max(1, max_model_len - room)
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


@attrs.frozen
class CommonFields:
    """What the handlers need of the shared fields, in engine terms."""

    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int
    max_tokens_given: bool  # False: the default, clamped to the context instead of rejected
    grammar: tuple[GrammarSpec, str] | None = None  # the output constraint and the field that asked for it
    max_tokens_param: str = "max_tokens"  # the field a refused token budget is named by
    continuous_usage: bool = False  # every chunk carries its choice's usage so far (with include_usage)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: what the context holds)

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """``ids`` less what ``truncate_prompt_tokens`` cuts from the left."""
        room = self.params.max_tokens if self.max_tokens_given and self.params.max_tokens else 1
        return left_truncated(ids, self.truncate_prompt_tokens, max_model_len, room)

    def capped(self, cap: int | None) -> CommonFields:
        """The server's cap (``--default-max-tokens``) on the default of a request that set no limit:
        min(endpoint default, cap); a limit the client set is left alone."""
        if cap is None or self.max_tokens_given:
            return self
        default = self.params.max_tokens
        limit = cap if default is None else min(default, cap)
        return attrs.evolve(self, params=attrs.evolve(self.params, max_tokens=limit))


class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="add a final chunk with `choices: []` and the usage totals")
    continuous_usage_stats: bool = Field(
        False,
        description="vLLM's extension, with `include_usage`: every chunk also carries `usage` so far for its "
        "choice (its prompt's tokens, the tokens generated until then)",
    )


class GenerationBody(StructuredFields):
    """The model, sampling parameters and streaming options of any generation request."""

    model: str = Field(
        min_length=1, description="must equal the served model id (see `/v1/models`), else 404 `model_not_found`"
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens to generate; by default, until an end-of-sequence token or the context limit (as "
        "OpenAI and vLLM; the server's `--default-max-tokens` may cap that default). If you set it and prompt + "
        '`max_tokens` exceeds the context, that is a 400 (`code: "context_length_exceeded"`, `param: "max_tokens"`, '
        "OpenAI's message: \"This model's maximum context length is N tokens. However, you requested M tokens "
        '..."); a default is clamped instead: generation stops at the context limit with `finish_reason: "length"`',
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="modern name of `max_tokens`; if both are given they must agree"
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 (or anything below 1e-5) is greedy")
    top_k: Annotated[int, Not(0)] = Field(-1, ge=-1, description="-1 is off; 1 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than `min_p` x the most likely one")
    ignore_eos: bool = Field(False, description="keep generating past the model's end-of-sequence tokens")
    skip_special_tokens: bool = Field(
        True,
        description="leave the tokenizer's special tokens out of the text (vLLM's extension); under the "
        "`gpt_oss` reasoning parser chat replies keep them for the parser, which takes the harmony markers out",
    )
    min_tokens: int = Field(0, ge=0, description="EOS and `stop_token_ids` cannot be sampled before this many tokens")
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None,
        description="generation ends when one appears; the stop text is not returned, `finish_reason` is "
        '`"stop"`. If several could match, the one that completes first wins. Streaming holds '
        "back only the characters that could still start a stop string",
    )
    stop_token_ids: list[TokenId] | None = Field(None, description='generation ends (`"stop"`) on any of these')
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI: subtracted once from every token already generated"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI: subtracted per occurrence of a token in the generated text"
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="vLLM semantics over prompt and generated tokens: positive logits divided, negative multiplied",
    )
    logit_bias: dict[_TokenKey, _Bias] | None = Field(
        None, description="token id (a string key) -> bias added to its logit; ids outside the vocabulary are a 400"
    )
    seed: int | None = Field(
        None,
        ge=SEED_MIN,
        le=SEED_MAX,
        description="per-request generator: same seed and parameters give the same text whatever else is in the batch",
    )
    n: int = Field(
        1,
        ge=1,
        le=MAX_N,
        description="choices per prompt, `index` 0 ... n-1; with a `seed`, choice j samples with seed + j. "
        "The prompt is prefilled once: the other choices share its full KV pages and compute "
        "only the last partial page themselves",
    )
    priority: int = Field(
        0,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="lower is sooner (vLLM's convention). Under `--scheduling-policy priority` waiting requests "
        "go by priority, then arrival, and one that finds no pages or no seat preempts the lowest-priority "
        "running request, which resumes later losing no tokens; aging (`--priority-aging-seconds`) bounds how "
        "long a low priority can wait. Under `fcfs` (the default) it is accepted and ignored",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="vLLM's: keep only the last N tokens of the prompt (left truncation, after the chat template); "
        "-1: as many as the context holds beside `max_tokens` (or one token); 0 is refused",
    )
    prompt_cache_key: str | None = Field(
        None,
        max_length=1024,
        description="OpenAI's cache key: under `--dp`, requests with the same key are routed to the same replica, "
        "whose prefix cache holds what they share; one engine caches every prefix anyway",
    )
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted; there is one tier here (`priority` is the field that orders requests)"
    )
    speculative: bool = Field(
        True,
        description="let speculative decoding (`--speculative`) propose tokens for this request; `false` opts out "
        "(the output is the same either way: greedy token for token, bit for bit while its batch stays on one "
        "side of the line where decode steps move to AMX tiles (`architecture.md`, Scoring); sampling in distribution)",
    )
    stream: bool = Field(False, description="Server-Sent Events")
    stream_options: StreamOptions | None = Field(
        None,
        description='`{"include_usage": true}` adds a usage chunk; with `"continuous_usage_stats": true` too '
        "(vLLM's), every chunk also carries its choice's usage so far; only with `stream: true`",
    )

    @model_validator(mode="after")
    def _check_common(self) -> GenerationBody:
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:  # choice j samples with seed + j
            raise invalid(f"must be at most {SEED_MAX - self.n + 1} with n = {self.n} (choice j uses seed + j)", "seed")
        if self.truncate_prompt_tokens == 0:
            raise invalid("must be -1 or at least 1", "truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise invalid("is only allowed when 'stream' is true", "stream_options")
        if "max_tokens" in self.model_fields_set and self.max_completion_tokens not in (None, self.max_tokens):
            raise invalid(
                f"disagrees with max_tokens ({shown(self.max_completion_tokens)} != {shown(self.max_tokens)})",
                "max_completion_tokens",
            )
        return self

    def common(self) -> CommonFields:
        """The shared fields in engine terms: ``SamplingParams`` plus what the handlers decide on."""
        given = "max_tokens" in self.model_fields_set or self.max_completion_tokens is not None
        limit = self.max_tokens
        if "max_tokens" not in self.model_fields_set and self.max_completion_tokens is not None:
            limit = self.max_completion_tokens
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        values: dict[str, Any] = {name: getattr(self, name) for name in _TO_SAMPLING}
        values.update(
            # 0 (completions' echo-only scoring) still samples one token, which that endpoint drops.
            max_tokens=None if limit is None else max(limit, 1),
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
        )
        options = self.stream_options or StreamOptions.model_validate({})
        return CommonFields(
            self.model,
            SamplingParams(**values),
            self.stream,
            options.include_usage,
            self.n,
            given,
            self.grammar(),
            continuous_usage=options.include_usage and options.continuous_usage_stats,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


# Every shared field named like a SamplingParams attribute goes straight into it.
_TO_SAMPLING = tuple(f.name for f in attrs.fields(SamplingParams) if f.name in GenerationBody.model_fields)
