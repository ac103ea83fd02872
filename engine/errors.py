"""Why the engine refuses a request. The HTTP layer maps each to a status code in one place."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never be served (e.g. its prompt does not fit the context).

    ``param`` names the part of the request at fault, ``code`` a stable reason.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class PromptTooLong(RequestRejected):
    """The prompt leaves no room in the context for a generated token; the numbers travel
    with it so the HTTP layer can word the refusal as its clients expect."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens but this model's context is {max_model_len} tokens "
            "(the prompt must leave room for at least one generated token)",
            "prompt",
            "context_length_exceeded",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class EngineNotRunning(RuntimeError):
    """Raised by ``submit`` when the engine is not (or no longer) taking work."""


class EngineOverloaded(RuntimeError):
    """Raised by ``submit`` when the waiting queue is full; try again shortly."""
