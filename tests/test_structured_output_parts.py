"""The parts of constrained decoding on their own: the batched bitmask against a
bit-by-bit reading, the compiler's choice of backend, fallback and cache, each kind
of constraint on each backend, and the reasoning gate."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.config import StructuredOutputsConfig
from triollm.reasoning import ReasoningParser
from triollm.structured_output import StructuredOutputsParams
from triollm.structured_output.bitmask import allocate_bitmask, apply_bitmask
from triollm.structured_output.compiler import MAX_ERROR_CHARS, GrammarCompiler
from triollm.structured_output.params import MAX_JSON_DEPTH
from triollm.structured_output.reasoning_gate import ReasoningGate

if importlib.util.find_spec("xgrammar") is not None:
    from triollm.structured_output.xgrammar_backend import MAX_PATTERN_NESTING

HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
BACKENDS = ["guidance", pytest.param("xgrammar", marks=pytest.mark.skipif(
    not HAS_XGRAMMAR, reason="xgrammar is not installed"))]
VOCAB = 520  # wider than the tokenizer, as a model's logits often are
EOS = 2


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_the_bitmask_masks_exactly_the_clear_bits(data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 6))
    vocab = data.draw(st.integers(1, 200))
    constrained = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows))
    words = (vocab + 31) // 32
    bitmask = torch.tensor(data.draw(st.lists(
        st.lists(st.integers(-2**31, 2**31 - 1), min_size=words, max_size=words),
        min_size=len(constrained), max_size=len(constrained))), dtype=torch.int32
    ).reshape(len(constrained), words)
    logits = torch.randn(rows, vocab)
    expected = logits.clone()
    for i, row in enumerate(constrained):
        for token in range(vocab):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(logits, bitmask, constrained)
    assert torch.equal(logits, expected)


def compiler(tokenizer: Any, backend: str = "auto", **options: Any) -> GrammarCompiler:
    return GrammarCompiler(StructuredOutputsConfig(backend=backend, **options), tokenizer,
                           VOCAB, [EOS])


def walk(tokenizer: Any, grammar: Any, text: str) -> tuple[bool, list[int]]:
    """Feed ``text``'s tokens to a new matcher: whether all were accepted, and the
    tokens allowed after them."""
    matcher = grammar.matcher()
    accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text))
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(VOCAB) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    return accepted, allowed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("constraint", "good", "bad"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}},
               "required": ["a"]}}, '{"a": 12}', '{"b": 1}'),
    ({"json_object": True}, '{"x": [1, 2]}', '[1]'),
    ({"regex": r"\d{3}"}, "123", "12a"),
    ({"choice": ["red", "blue"]}, "blue", "green"),
    ({"grammar": 'root ::= "a"+ "b"'}, "aaab", "ba"),
    ({"structural_tag": json.dumps({
        "type": "structural_tag", "triggers": ["<fn="],
        "structures": [{"begin": "<fn=f>", "end": "</fn>",
                        "schema": {"type": "object", "properties": {
                            "x": {"type": "integer"}}, "required": ["x"]}}]})},
     'hi <fn=f>{"x": 1}</fn>', '<fn=f>{"y": 1}'),
], ids=["json", "json_object", "regex", "choice", "grammar", "structural_tag"])
def test_each_backend_compiles_each_kind(tokenizer: Any, backend: str,
                                         constraint: dict[str, Any], good: str,
                                         bad: str) -> None:
    grammar, cached = compiler(tokenizer, backend).compile(StructuredOutputsParams(**constraint))
    assert (grammar.backend, grammar.kind, cached) == (backend, next(iter(constraint)), False)
    accepted, allowed = walk(tokenizer, grammar, good)
    assert accepted
    if constraint.get("structural_tag") is None:
        assert EOS in allowed  # complete: the engine's EOS ends it
    assert not walk(tokenizer, grammar, bad)[0]


def test_auto_closes_objects_as_vllms_auto_and_guidance_by_name_does_not(tokenizer: Any
                                                                        ) -> None:
    schema = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}})
    extra, listed_only = '{"a": 1, "b": 2}', '{"a": 1}'
    auto = compiler(tokenizer).compile(schema)[0]
    assert walk(tokenizer, auto, listed_only)[0] and not walk(tokenizer, auto, extra)[0]
    assert walk(tokenizer, compiler(tokenizer, "guidance").compile(schema)[0], extra)[0]
    opened = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "additionalProperties": True})
    assert walk(tokenizer, compiler(tokenizer).compile(opened)[0], extra)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_options_close_objects_and_drop_whitespace(tokenizer: Any, backend: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed = compiler(tokenizer, backend, disable_additional_properties=True).compile(
        StructuredOutputsParams(json=schema))[0]
    assert not walk(tokenizer, closed, '{"a": 1, "b": 2}')[0]
    compact = compiler(tokenizer, backend).compile(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True))[0]
    assert not walk(tokenizer, compact, '{  "a": 1}')[0]


def test_auto_prefers_guidance_and_falls_back_to_xgrammar(tokenizer: Any) -> None:
    lark = compiler(tokenizer).compile(StructuredOutputsParams(grammar='start: "a"+'))[0]
    assert lark.backend == "guidance"
    plain = compiler(tokenizer).compile(StructuredOutputsParams(regex="a+"))[0]
    assert plain.backend == "guidance"
    # llguidance refuses uniqueItems; xgrammar compiles it (without enforcing it)
    unique = StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    if HAS_XGRAMMAR:
        assert compiler(tokenizer).compile(unique)[0].backend == "xgrammar"
    else:
        with pytest.raises(ValueError, match=r"^structured_outputs\.json: guidance: "):
            compiler(tokenizer).compile(unique)


@pytest.mark.skipif(not HAS_XGRAMMAR, reason="xgrammar is not installed")
def test_disable_fallback_refuses_what_the_first_backend_cannot_take(tokenizer: Any) -> None:
    unique = {"type": "array", "uniqueItems": True}
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: guidance: "):
        compiler(tokenizer).compile(StructuredOutputsParams(json=unique, disable_fallback=True))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: guidance: "):
        compiler(tokenizer, disable_fallback=True).compile(StructuredOutputsParams(json=unique))


def test_the_cache_is_keyed_by_the_constraint_and_bounded(tokenizer: Any) -> None:
    grammars = GrammarCompiler(StructuredOutputsConfig(backend="guidance"), tokenizer, VOCAB,
                               [EOS], cache_size=2)
    first, cached = grammars.compile(StructuredOutputsParams(regex="a"))
    assert not cached
    again, cached = grammars.compile(StructuredOutputsParams(regex="a"))
    assert cached and again is first
    # the same regex with other options is another grammar
    assert not grammars.compile(StructuredOutputsParams(regex="a",
                                                        disable_any_whitespace=True))[1]
    grammars.compile(StructuredOutputsParams(regex="b"))  # evicts the least recent
    assert not grammars.compile(StructuredOutputsParams(regex="a"))[1]
    stats = grammars.statistics()
    assert (stats.hits, stats.misses, stats.size) == (1, 4, 2)


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_too_deeply_is_a_value_error_naming_its_field() -> None:
    # each level is two JSON levels ({"properties": {"a": ...}})
    deep = nested_schema(MAX_JSON_DEPTH // 2)
    StructuredOutputsParams(json=nested_schema(MAX_JSON_DEPTH // 2 - 1))
    far_too_deep = '{"items": ' * 5000 + "{}" + "}" * 5000  # deeper than json parses
    for value in (deep, json.dumps(deep), far_too_deep):
        with pytest.raises(ValueError, match=r"^structured_outputs\.json: nests .* 128 deep"):
            StructuredOutputsParams(json=value)
    tag = {"structures": [{"begin": "<a>", "schema": deep, "end": "</a>"}],
           "triggers": ["<a>"]}
    with pytest.raises(ValueError, match=r"^structured_outputs\.structural_tag: nests"):
        StructuredOutputsParams(structural_tag=json.dumps(tag))


@pytest.mark.skipif(not HAS_XGRAMMAR, reason="xgrammar is not installed")
def test_a_pattern_nested_too_deeply_for_xgrammar_is_refused(tokenizer: Any) -> None:
    # xgrammar compiles a pattern recursively: far deeper ones kill the process, so
    # the backend refuses past its bound (llguidance refuses these itself)
    def schema(depth: int) -> dict[str, Any]:
        return {"type": "string", "pattern": "(" * depth + "a" + ")" * depth}

    ok = compiler(tokenizer, "xgrammar").compile(
        StructuredOutputsParams(json=schema(MAX_PATTERN_NESTING)))[0]
    assert ok.backend == "xgrammar"
    for params in (StructuredOutputsParams(json=schema(MAX_PATTERN_NESTING + 1)),
                   StructuredOutputsParams(json={"type": "object", "patternProperties": {
                       "(" * 300 + ")" * 300: {"type": "integer"}}})):
        for backend in ("xgrammar", "auto"):
            with pytest.raises(ValueError, match=r"(?s)^structured_outputs\.json: .*"
                                                 r"xgrammar: a pattern nests groups"):
                compiler(tokenizer, backend).compile(params)


def test_a_backends_complaint_is_cut_short(tokenizer: Any) -> None:
    huge = "(" * 100_000 + "a"
    with pytest.raises(ValueError) as raised:
        compiler(tokenizer).compile(StructuredOutputsParams(regex=huge))
    assert str(raised.value).startswith("structured_outputs.regex: guidance: ")
    assert len(str(raised.value)) < 2 * MAX_ERROR_CHARS + 200


def test_guidance_builds_a_grammars_lexer_when_it_compiles(tokenizer: Any) -> None:
    # llguidance builds a grammar's lexer lazily, at its first mask: for this regex about
    # a second, which the runner's step would otherwise spend
    grammar = compiler(tokenizer, "guidance").compile(
        StructuredOutputsParams(regex="((a{100}){100}){100}"))[0]
    bitmask = allocate_bitmask(1, VOCAB)
    started = time.perf_counter()
    grammar.matcher().fill_bitmask(bitmask, 0)
    assert time.perf_counter() - started < grammar.compile_seconds / 10


def test_an_unknown_backend_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="backend: must be one of"):
        compiler(tokenizer, "outlines")


class EndsWith9(ReasoningParser):
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return 9 in input_ids


def test_the_reasoning_gate_asks_the_prompt_once_then_each_new_token() -> None:
    parser = EndsWith9(None)
    assert not ReasoningGate(parser, [1, 2]).ended_in_prompt
    assert ReasoningGate(parser, [9, 1]).ended_in_prompt
    gate = ReasoningGate(parser, [1])
    assert [gate.ends_at([5] * n + [t]) for n, t in ((0, 3), (40, 4), (40, 9))] == [
        False, False, True]
    parser.end_token_id = 7  # type: ignore[attr-defined]
    by_id = ReasoningGate(parser, [1])
    assert (by_id.ends_at([9]), by_id.ends_at([1, 7])) == (False, True)


WALK_SCHEMA = {"type": "object", "additionalProperties": False,
               "properties": {"k": {"enum": ["a", "bc"]},
                              "v": {"type": "array", "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 0,
                                              "maximum": 50}}},
               "required": ["k", "v"]}


@pytest.mark.parametrize("backend", BACKENDS)
@given(choices=st.lists(st.integers(0, 2**16), min_size=80, max_size=80))
@settings(max_examples=15, deadline=None)
def test_every_token_a_mask_allows_is_accepted_and_eos_ends_a_valid_output(
        tokenizer: Any, backend: str, choices: list[int]) -> None:
    """A random walk through the grammar, one allowed token at a time: the matcher
    accepts each, and the walk that reaches EOS has written valid JSON."""
    import jsonschema

    grammar = _walk_grammars(tokenizer, backend)
    matcher = grammar.matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    tokens: list[int] = []
    for choice in choices:
        matcher.fill_bitmask(bitmask, 0)
        allowed = [t for t in range(VOCAB) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        assert allowed and all(t < len(tokenizer) for t in allowed)
        token = allowed[choice % len(allowed)]
        assert matcher.accept_token(token)
        if token == EOS:
            jsonschema.validate(json.loads(tokenizer.decode(tokens)), WALK_SCHEMA)
            assert matcher.is_terminated()
            return
        tokens.append(token)


_GRAMMARS: dict[str, Any] = {}


def _walk_grammars(tokenizer: Any, backend: str) -> Any:
    if backend not in _GRAMMARS:
        _GRAMMARS[backend] = compiler(tokenizer, backend).compile(StructuredOutputsParams(
            json=WALK_SCHEMA, disable_any_whitespace=True))[0]
    return _GRAMMARS[backend]


def test_the_engines_copy_owns_its_constraint_and_its_samples_share_it() -> None:
    from triollm import SamplingParams

    schema: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}}
    callers = SamplingParams(n=3, structured_outputs=StructuredOutputsParams(json=schema))
    engines = callers.clone()
    schema["properties"]["b"] = {"type": "string"}  # the caller reuses their dict
    assert engines.structured_outputs is not None
    assert engines.structured_outputs.json == {"type": "object", "properties": {
        "a": {"type": "integer"}}}
    samples = [engines.child(index) for index in range(3)]
    assert all(s.structured_outputs is engines.structured_outputs for s in samples)
