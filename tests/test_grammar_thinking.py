"""A grammar after thinking: xgrammar masks free text up to ``</think>``, then the constraint."""

from __future__ import annotations

import pytest

from trillm.engine.structured import GrammarCompiler, GrammarSpec, Matcher
from trillm.engine.structured.matcher import advance

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def compiler(model_parts):
    model, tokenizer, stop_ids = model_parts
    return GrammarCompiler(tokenizer, len(tokenizer), stop_ids)


def _feed(compiler, tokenizer, spec: GrammarSpec, text: str, end: bool) -> Matcher:
    """A matcher after taking ``text`` token by token (and the EOS when ``end``)."""
    matcher = Matcher(compiler.compile_now(spec))
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if end else [])
    for token in tokens:
        advance([matcher], [token])
    return matcher


@pytest.mark.parametrize(
    ("mode", "text", "valid"),
    [
        ("required", 'I think {broken json, "a": [</think>\n\n{"a": 12}', True),
        ("required", '<think>one</think>{"a": 1}', True),
        ("required", '{"a": 1}', False),  # still thinking: the end is not allowed yet
        ("required", 'ok</think>{"a": "x"}', False),  # the answer breaks the schema
        ("optional", '{"a": 1}', True),
        ("optional", '\n<think>a {"</think>\n\n{"a": 3}', True),
        ("optional", 'Sure, {"a": 1}', False),  # not a think block, not the answer
        ("none", '<think>x</think>{"a": 1}', False),
    ],
)
def test_thinking_then_the_constraint(compiler, tokenizer, mode, text, valid):
    spec = GrammarSpec.json_schema(SCHEMA).after_thinking(mode)
    matcher = _feed(compiler, tokenizer, spec, text, end=True)
    assert (matcher.terminated and matcher.failed_at is None) == valid


def test_each_mode_compiles_apart(compiler):
    base = GrammarSpec.json_schema(SCHEMA)
    grammars = {id(compiler.compile_now(base.after_thinking(mode))) for mode in ("none", "required", "optional")}
    assert len(grammars) == 3 and compiler.compile_now(base) is compiler.compile_now(base.after_thinking("none"))
