"""Kept for the modules that import from here; the completions body is declared in ``schemas.completion``."""

from trillm.api.schemas.completion import CompletionRequest, parse_completion_request

__all__ = ["CompletionRequest", "parse_completion_request"]
