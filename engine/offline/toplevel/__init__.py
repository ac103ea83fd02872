"""The top-level ``trillm`` package (``pyproject.toml`` maps it to this folder): the offline API.

``from trillm import LLM, SamplingParams`` loads ``trillm.engine.offline`` on first use,
so importing ``trillm.api`` or ``trillm.kernels`` (a grammar worker, a rank) does not
pay for the engine. The folder lives here, beside what it exports, because nothing
but tooling sits at the repository's top level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trillm.engine.offline import LLM, CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from trillm.engine import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'trillm' has no attribute {name!r}")
