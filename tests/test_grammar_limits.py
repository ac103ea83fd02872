"""Grammar bounds without a server: the pre-compile limits, the cache's byte bound, and
matchers that end their sequence rather than let go of it."""

from __future__ import annotations

import json

import pytest

from trillm.engine.structured import GrammarCompiler, GrammarError, GrammarLimits, GrammarMasks, GrammarSpec, Matcher
from trillm.engine.structured.matcher import advance


@pytest.fixture(scope="module")
def compiler(model_parts):
    model, tokenizer, stop_ids = model_parts
    return GrammarCompiler(tokenizer, len(tokenizer), stop_ids)


def test_recursive_and_tool_schemas_pass_the_bounds_and_tool_sets_are_bounded_too():
    limits = GrammarLimits()
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "$ref": "#/$defs/node",
    }
    limits.check(GrammarSpec.json_schema(tree))  # recursion is a loop in the grammar, not a chain
    limits.check(GrammarSpec.json_schema({"$ref": "#"}))
    deep: dict = {"type": "string"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match="nests deeper than 64 levels"):
        limits.check(GrammarSpec.json_schema(deep))
    # A tool set's structural tag carries its tools' schemas: the same bounds hold inside it.
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"enum": list(range(1500))}}}
    with pytest.raises(GrammarError, match="an enum has 1500 values"):
        limits.check(GrammarSpec.structural_tag(json.dumps(tag)))
    many = {"type": "object", "properties": {f"p{i}": {"enum": list(range(1000))} for i in range(5)}}
    with pytest.raises(GrammarError, match="more than 4096 values together"):
        limits.check(GrammarSpec.json_schema(many))


def test_the_cache_is_bounded_in_bytes(model_parts):
    model, tokenizer, stop_ids = model_parts
    specs = [
        GrammarSpec.json_schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}) for i in range(4)
    ]
    probe = GrammarCompiler(tokenizer, len(tokenizer), stop_ids)
    size = max(probe.compile_now(spec).nbytes for spec in specs)
    assert 1_000 < size < 10_000_000  # xgrammar's count is real
    bounded = GrammarCompiler(tokenizer, len(tokenizer), stop_ids, cache_bytes=int(2.5 * size))
    for spec in specs:
        bounded.compile_now(spec)
        assert bounded.cached_bytes <= bounded.cache_bytes
    assert bounded.cached(specs[0]) is None and bounded.cached(specs[-1]) is not None  # the oldest went first
    tiny = GrammarCompiler(tokenizer, len(tokenizer), stop_ids, cache_bytes=10)
    assert tiny.compile_now(specs[0]) is not None and tiny.cached_bytes == 0  # used, never kept


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= [^\\x00-\\U0010FFFF]",
        'root ::= "a" [^\\x00-\\U0010FFFF]',
        'root ::= "a" b\nb ::= "x" [^\\x00-\\U0010FFFF] | "y" [^\\x00-\\U0010FFFF]',
    ],
)
def test_an_empty_language_does_not_compile(compiler, grammar):
    with pytest.raises(GrammarError, match="matches no output"):
        compiler.compile_now(GrammarSpec.ebnf(grammar))


@pytest.mark.parametrize(
    "grammar",
    ['root ::= "a" root', "root ::= [a-z]{0,3} [^\\x00-\\U0010FFFF]", 'root ::= "a" | "b" [^\\x00-\\U0010FFFF]'],
)
def test_what_the_search_cannot_prove_empty_compiles(compiler, grammar):
    assert compiler.compile_now(GrammarSpec.ebnf(grammar)) is not None


def test_a_token_outside_the_grammar_fails_the_matcher_instead_of_unconstraining_it(compiler, model_parts):
    """Regression: ``accepted(ok=False)`` used to stop masking ("the rest is unconstrained")."""
    tokenizer = model_parts[1]
    matcher = Matcher(compiler.compile_now(GrammarSpec.regex("[0-9]+")))
    letter = tokenizer("x", add_special_tokens=False)["input_ids"][0]
    digit = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    advance([matcher], [digit])
    assert matcher.active and matcher.num_accepted == 1
    advance([matcher], [letter])
    assert not matcher.active and matcher.failed_at == 1 and "outside the grammar" in matcher.reason


def test_a_state_that_allows_no_token_fails_its_row_only(compiler, model_parts):
    tokenizer = model_parts[1]
    dead_end = Matcher(compiler.compile_now(GrammarSpec.ebnf("root ::= [a-z]{0,3} [^\\x00-\\U0010FFFF]")))
    fine = Matcher(compiler.compile_now(GrammarSpec.regex("[0-9]+")))
    vocab = len(tokenizer)
    letters = tokenizer("abc", add_special_tokens=False)["input_ids"]
    digit = tokenizer("1", add_special_tokens=False)["input_ids"][0]
    for token in letters:
        masks = GrammarMasks.fill([dead_end, fine], vocab)
        assert masks is not None and masks.rows == [0, 1]
        advance([dead_end, fine], [token, digit])
    masks = GrammarMasks.fill([dead_end, fine], vocab)
    assert masks is not None and masks.rows == [1]  # the dead row is not masked (it is not sent either)
    assert dead_end.failed_at == len(letters) and not dead_end.active and fine.active
    assert GrammarMasks.fill([dead_end], vocab) is None
