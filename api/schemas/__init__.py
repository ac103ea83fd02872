"""Request bodies, each field declared once as a pydantic model field.

From those declarations come parsing (``parse_*``), the 400s (``param`` is
the field's path, e.g. ``messages[2].content``), the request schemas of
``/openapi.json`` and the field tables of ``docs/api.md`` (``python -m
trillm.api.schemas.docs``). New fields and message kinds are new declarations
in ``generation.py``, ``chat.py``, ``completion.py`` or ``messages.py``.
"""

from trillm.api.schemas.anthropic import CountTokensBody, MessagesBody
from trillm.api.schemas.chat import ChatCompletionBody, ChatRequest, parse_chat_request
from trillm.api.schemas.completion import CompletionBody, CompletionRequest, parse_completion_request
from trillm.api.schemas.embeddings import EmbeddingsBody
from trillm.api.schemas.generation import CommonFields, GenerationBody
from trillm.api.schemas.rerank import RerankBody, ScoreBody
from trillm.api.schemas.responses import ResponsesBody, parse_responses_request
from trillm.api.schemas.tokenize import DetokenizeBody, TokenizeBody

# The names the bodies are published under in /openapi.json (``CompletionRequest`` is also the parsed record).
PUBLISHED = {
    "ChatCompletionRequest": ChatCompletionBody,
    "CompletionRequest": CompletionBody,
    "ResponsesRequest": ResponsesBody,
    "MessagesRequest": MessagesBody,
    "CountTokensRequest": CountTokensBody,
    "EmbeddingRequest": EmbeddingsBody,
    "RerankRequest": RerankBody,
    "ScoreRequest": ScoreBody,
    "TokenizeRequest": TokenizeBody,
    "DetokenizeRequest": DetokenizeBody,
}

__all__ = [
    "PUBLISHED",
    "ChatCompletionBody",
    "ChatRequest",
    "CommonFields",
    "CompletionBody",
    "CompletionRequest",
    "CountTokensBody",
    "DetokenizeBody",
    "EmbeddingsBody",
    "GenerationBody",
    "MessagesBody",
    "RerankBody",
    "ResponsesBody",
    "ScoreBody",
    "TokenizeBody",
    "parse_chat_request",
    "parse_completion_request",
    "parse_responses_request",
]
