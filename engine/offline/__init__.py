"""The offline Python API: ``from trillm import LLM, SamplingParams``, the engine without HTTP.

``llm.LLM`` loads the model and keeps the engine running on a background thread
(``loop``); each ``generate`` or ``chat`` call runs its prompts there together
(``batch``) with the offline ``params.SamplingParams`` and returns ``results``'
``RequestOutput`` per prompt.
"""

from trillm.engine.offline.llm import LLM, engine_config
from trillm.engine.offline.params import SamplingParams
from trillm.engine.offline.results import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "engine_config"]
