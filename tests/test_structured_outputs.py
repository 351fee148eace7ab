"""Constrained decoding through ``LLM``: a random-weight model's outputs satisfy their
JSON schema, regex, choice or grammar, on both grammar backends, alongside everything
else a request may ask for (n > 1 with seeds, logprobs, stop strings, token masks,
min_tokens, preemption, chunked prefill, prefix caching, abort)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from triollm import LLM, SamplingParams
from triollm.structured_output import StructuredOutputsParams

SCHEMA: dict[str, Any] = {
    "$defs": {"point": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                       "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        # Printable text: with a random model's odd byte sequences xgrammar 0.2.8 lets
        # a raw control character into a free string, which JSON forbids.
        "name": {"type": "string", "pattern": "^[a-z ]{0,6}$"},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "where": {"$ref": "#/$defs/point"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"},
                 "maxItems": 3},
        "size": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                           {"type": "null"}]},
    },
    "required": ["name", "kind", "where", "tags", "size"],
    "additionalProperties": False,
}
PROMPTS = ["The cat", "Once upon a time", "JSON:", "one two three four"]
BACKENDS = ["guidance", "xgrammar"]


def json_params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 160), structured_outputs=(
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)), **kwargs)


def assert_valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request: pytest.FixtureRequest, llama_path: Path) -> LLM:
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar")
    return LLM(str(llama_path), dtype="float32", max_model_len=256,
               num_gpu_blocks_override=256, structured_outputs_config={"backend": request.param})


def test_json_schema_outputs_parse_and_validate(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, [json_params(temperature=0), json_params(seed=1),
                                     json_params(seed=2, top_p=0.9), json_params(seed=3)],
                           use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert_valid(completion.text)


def test_json_object_gives_an_object(llm: LLM) -> None:
    params = SamplingParams(max_tokens=200, temperature=0, structured_outputs=(
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True)))
    for output in llm.generate(PROMPTS[:2], params, use_tqdm=False):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # an unbounded object may run out of tokens: a prefix of one
            assert completion.text.startswith("{")


@pytest.mark.parametrize(("constraint", "check"), [
    ({"regex": r"[a-c]{3}-\d{2}"}, lambda text: re.fullmatch(r"[a-c]{3}-\d{2}", text)),
    ({"choice": ["yes", "no way", "maybe?"]}, lambda text: text in ("yes", "no way", "maybe?")),
], ids=["regex", "choice"])
def test_regex_and_choice_outputs_match(llm: LLM, constraint: dict[str, Any],
                                        check: Any) -> None:
    params = [SamplingParams(max_tokens=40, seed=seed,
                             structured_outputs=StructuredOutputsParams(**constraint))
              for seed in range(4)]
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and check(completion.text), completion.text


#: A list of small numbers, e.g. ``[1,22,3]``: EBNF for xgrammar (and llguidance's GBNF
#: reading), Lark for llguidance.
EBNF = 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'
LARK = 'start: "[" num ("," num)* "]"\nnum: /[1-9][0-9]?/'


@pytest.mark.parametrize("grammar", [EBNF, LARK], ids=["ebnf", "lark"])
def test_a_grammar_output_parses(llm: LLM, grammar: str) -> None:
    params = SamplingParams(max_tokens=60, temperature=0,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    if grammar is LARK and llm.engine.config.structured_outputs.backend == "xgrammar":
        with pytest.raises(ValueError, match=r"structured_outputs\.grammar: .*Lark"):
            llm.generate(PROMPTS[0], params, use_tqdm=False)
        return
    completion = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    if completion.finish_reason == "stop":
        numbers = json.loads(completion.text)
        assert numbers and all(1 <= n <= 99 for n in numbers)
    else:
        assert re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*,?", completion.text)


def test_n_samples_with_a_seed_are_each_valid_and_reproducible(llm: LLM) -> None:
    params = json_params(n=3, seed=7, temperature=1.0)
    first = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    again = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    texts = [c.text for c in first.outputs]
    assert texts == [c.text for c in again.outputs]
    assert len(set(texts)) > 1
    for text in texts:
        assert_valid(text)


def test_max_tokens_cuts_the_json_with_finish_reason_length(llm: LLM) -> None:
    completion = llm.generate(PROMPTS[0], json_params(max_tokens=4, temperature=0),
                              use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(completion.text)


@pytest.mark.parametrize(("constraint", "field"), [
    ({"json": {"type": "objec"}}, "json"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": 'root ::= ("a" undefined_rule'}, "grammar"),
])
def test_an_invalid_constraint_is_a_value_error_naming_its_field_before_the_engine(
        llm: LLM, constraint: dict[str, Any], field: str) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}: "):
        llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_logprobs_are_the_models_own_alongside_the_mask(llm: LLM) -> None:
    """Logprobs report the model's distribution before any mask (the grammar's
    included), as they do for every other mask; vLLM reports them after the grammar."""
    constrained = llm.generate(PROMPTS[0], SamplingParams(
        max_tokens=3, temperature=0, logprobs=2,
        structured_outputs=StructuredOutputsParams(choice=["zzzz"])), use_tqdm=False)[0]
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0, logprobs=2),
                        use_tqdm=False)[0].outputs[0]
    completion = constrained.outputs[0]
    assert completion.text == "zzzz"[:len(completion.text)]
    assert completion.logprobs is not None and free.logprobs is not None
    first = completion.logprobs[0]
    # the model's own top tokens, whatever the grammar allowed
    assert set(free.logprobs[0]) - {free.token_ids[0]} <= set(first)
    chosen = first[completion.token_ids[0]]
    assert chosen.rank is not None and chosen.rank >= 1


def test_stop_strings_cut_a_constrained_output(llm: LLM) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, stop=["b"],
                            structured_outputs=StructuredOutputsParams(regex="aaab{3}"))
    completion = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert completion.text == "aaa" and completion.finish_reason == "stop"


def test_token_masks_and_bias_work_with_the_grammar(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    eos = tokenizer.eos_token_id
    regex = StructuredOutputsParams(regex="[ab]{6}")
    out = llm.generate(PROMPTS, [
        SamplingParams(max_tokens=20, seed=1, structured_outputs=regex,
                       allowed_token_ids=[a, b, eos]),
        SamplingParams(max_tokens=20, seed=2, structured_outputs=regex, bad_words=["a"]),
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=regex,
                       logit_bias={b: 100.0}),
        SamplingParams(max_tokens=20, seed=4, structured_outputs=regex, min_tokens=3),
    ], use_tqdm=False)
    texts = [o.outputs[0].text for o in out]
    assert all(re.fullmatch("[ab]{6}", t) for t in texts), texts
    assert texts[2] == "bbbbbb"
    # min_tokens past the grammar's end: the grammar wins, the output ends with it
    held = llm.generate(PROMPTS[0], SamplingParams(
        max_tokens=20, temperature=0, min_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=["yes"])), use_tqdm=False)
    assert held[0].outputs[0].text == "yes"


def test_the_compile_cache_counts_hits_and_misses(llm: LLM) -> None:
    before = llm.engine.grammar_cache_statistics()
    unique = StructuredOutputsParams(regex=f"x{{{before.misses + 2}}}")
    params = SamplingParams(max_tokens=5, structured_outputs=unique)
    llm.generate([PROMPTS[0], PROMPTS[1]], params, use_tqdm=False)
    after = llm.engine.grammar_cache_statistics()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


def test_abort_mid_output_frees_the_blocks_and_the_runner_state(llm: LLM) -> None:
    core = llm.engine
    total = core.statistics().num_total_blocks
    core.add_request("a", PROMPTS[0], json_params(seed=1))
    core.add_request("b", PROMPTS[1], json_params(n=2, seed=2))
    for _ in range(5):
        core.step()
    runner: Any = core.runner
    assert len(runner._requests) == 3
    core.abort_requests(["a", "b"])
    core.step()  # the runner hears of finished requests with the next step
    assert not core.has_unfinished_requests()
    assert runner._requests == {}
    assert core.statistics().num_free_blocks == total


def test_preemption_mid_json_keeps_the_matcher_in_step(llama_path: Path) -> None:
    """A KV cache too small for every request at once preempts and recomputes some
    mid-output; their matchers keep their place (the output tokens are kept)."""
    llm = LLM(str(llama_path), dtype="float32", max_model_len=192, block_size=16,
              num_gpu_blocks_override=14, max_num_seqs=8)
    outputs = llm.generate([f"{p} {i}" for i in range(2) for p in PROMPTS],
                           [json_params(seed=i) for i in range(8)], use_tqdm=False)
    assert llm.engine.statistics().num_preemptions > 0
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        assert_valid(output.outputs[0].text)


def test_chunked_prefill_and_prefix_caching_give_the_same_constrained_output(
        llama_path: Path) -> None:
    prompt = " ".join(PROMPTS * 4)
    params = json_params(temperature=0)
    whole = LLM(str(llama_path), dtype="float32", max_model_len=256,
                num_gpu_blocks_override=64, enable_prefix_caching=False)
    expected = whole.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    assert_valid(expected)
    chunked = LLM(str(llama_path), dtype="float32", max_model_len=256,
                  num_gpu_blocks_override=64, max_num_batched_tokens=8)
    for _ in range(2):  # the second one starts from the cached prefix
        assert chunked.generate(prompt, params, use_tqdm=False)[0].outputs[0].text == expected
    assert chunked.engine.statistics().prefix_cache_hits > 0
