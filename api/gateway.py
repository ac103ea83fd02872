"""What the HTTP handlers may use of the engine: a narrow, structural interface.

Handlers tokenize, check limits, submit and abort; they never reach the
scheduler, the runner or the engine's lifetime (``app.py`` owns that). ``Engine``
satisfies this protocol as it is, and a test double or a router over several
engines can too.
"""

from __future__ import annotations

from typing import Any, Protocol

from trillm.engine import CompiledGrammar, GrammarSpec, OutputMailbox, SamplingParams


class EngineHandle(Protocol):
    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_running(self) -> bool: ...

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise ``RequestRejected`` for a prompt that can never run."""

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``RequestRejected`` for sampling parameters the model cannot honour (``logit_bias`` ids)."""

    def check_capacity(self, count: int) -> None:
        """Raise ``EngineOverloaded`` if ``count`` more requests would overfill the queue."""

    def submit_many(self, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[str], OutputMailbox]:
        """Queue requests whose outputs share one mailbox; closing it cancels them."""

    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile a structured-output constraint; raises ``GrammarError``."""

    def abort(self, request_id: str) -> None:
        """Drop a request and free its pages; idempotent, synchronous."""
