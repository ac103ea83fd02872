"""Structured outputs: grammars that constrain what a request may generate.

``spec`` says what a request asks for (a JSON schema, a regex, ...), ``compiler``
turns it into token masks for this model's tokenizer (xgrammar, off the event
loop, cached), and ``matcher`` follows one sequence through its grammar and
masks the logits of its rows each step.
"""

from trillm.engine.structured.compiler import CompiledGrammar, GrammarCompiler
from trillm.engine.structured.limits import GrammarLimits
from trillm.engine.structured.matcher import GrammarMasks, Matcher
from trillm.engine.structured.spec import GrammarCompilerBusy, GrammarError, GrammarSpec

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarCompilerBusy",
    "GrammarError",
    "GrammarLimits",
    "GrammarMasks",
    "GrammarSpec",
    "Matcher",
]
