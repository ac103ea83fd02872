"""Kept for the modules that import from here; the chat body is declared in ``schemas.chat``."""

from trillm.api.schemas.chat import ChatRequest, parse_chat_request

__all__ = ["ChatRequest", "parse_chat_request"]
