"""A constraint turned into xgrammar's compiled grammar: the one step a compile worker runs.

Kept apart from ``compiler`` (which caches and schedules) so the worker process that
runs it imports nothing else of the engine's, and so the in-process path and the
worker build alike.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trillm.engine.structured.spec import GrammarError, GrammarSpec

# xgrammar's C++ errors start with "[12:00:00] /project/cpp/file.cc:123: "; clients need only the rest.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def build(compiler: Any, spec: GrammarSpec) -> Any:
    """``spec`` compiled by ``compiler`` (an ``xgrammar.GrammarCompiler``); raises ``GrammarError``
    for an invalid or unsupported grammar, and for one that no output of this model can match
    from its start (an empty language: a matcher of it would allow no token at all)."""
    try:
        compiled = _compile(compiler, spec)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar reports bad input as RuntimeError (C++), ValueError, ...
        raise GrammarError(_CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__) from None
    if proven_empty(compiled):
        raise GrammarError("it matches no output: no string of its language can be written in this model's tokens")
    return compiled


def proven_empty(compiled: Any, budget: int = 64) -> bool:
    """Whether no token sequence completes the grammar, proven by searching its tree of token
    paths up to ``budget`` states: True only when every path dead-ends (a state allows no
    token) without reaching a state where the grammar is complete. A grammar whose tree is
    larger than the budget is taken as non-empty (nearly all are: a JSON schema's second
    state already allows thousands of tokens); its dead ends, if any, end the output at run
    time (``Matcher.fail``). Costs at most ``budget`` mask fills (~0.1 ms each)."""
    import xgrammar

    vocab = compiled.tokenizer_info.vocab_size
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    stack = [xgrammar.GrammarMatcher(compiled)]
    seen = 0
    while stack:
        matcher = stack.pop()
        seen += 1
        if matcher.is_completed():
            return False
        matcher.fill_next_token_bitmask(bitmask)
        words = [(index, word) for index, word in enumerate(bitmask[0].tolist()) if word]
        allowed = [index * 32 + bit for index, word in words for bit in range(32) if word >> bit & 1]
        if seen + len(stack) + len(allowed) > budget:
            return False
        for token in allowed:
            child = matcher.fork()
            if child.accept_token(token):
                stack.append(child)
    return True


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.thinking == "none":
        return compiler.compile_grammar(_grammar(spec))
    return compiler.compile_grammar(_after_thinking(_grammar(spec), spec.thinking == "required"))


def _grammar(spec: GrammarSpec) -> Any:
    """xgrammar's ``Grammar`` of the constraint itself (compiled as is, or after thinking)."""
    import xgrammar

    if spec.kind == "json_object":
        return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "json_schema":
        # Compact JSON (single spaces after ',' and ':'): with any whitespace allowed, small
        # models can emit newlines until max_tokens. Strict: no properties beyond the schema's.
        return xgrammar.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.source)
    if spec.kind == "choice":
        return xgrammar.Grammar.from_ebnf(choice_grammar(spec.options))
    if spec.kind == "ebnf":
        return xgrammar.Grammar.from_ebnf(spec.source)
    if spec.kind == "structural_tag":
        return xgrammar.Grammar.from_structural_tag(spec.source)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


THINK_START, THINK_END = "<think>", "</think>"


def _after_thinking(answer: Any, required: bool) -> Any:
    """``answer`` preceded by free thinking up to ``</think>`` (``required``: always; the output
    may open with ``<think>`` or the template opened it) or by an optional ``<think>...</think>``
    block; a few blank characters are allowed around the block, as templates write them."""
    import xgrammar

    def thinking(begin: str) -> Any:
        tag = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_END}
        return xgrammar.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag}))

    blank = xgrammar.Grammar.from_ebnf("root ::= [ \\t\\r\\n]{0,4}")
    if required:
        return xgrammar.Grammar.concat(thinking(""), blank, answer)
    return xgrammar.Grammar.union(answer, xgrammar.Grammar.concat(blank, thinking(THINK_START), blank, answer))


def choice_grammar(options: list[str]) -> str:
    """GBNF accepting exactly one of ``options`` (JSON string escapes are GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options)
