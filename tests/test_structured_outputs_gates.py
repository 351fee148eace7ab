"""What decides when and whether a grammar constrains a sample: the reasoning gate
(constraints apply once the reasoning has ended), a matcher that rejects a token (its
request fails alone), and multi-LoRA batches (each sample keeps its own matcher)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from triollm import LLM, SamplingParams
from triollm.errors import RequestFailedError
from triollm.lora.request import LoRARequest
from triollm.reasoning import ReasoningParser, ReasoningParserManager
from triollm.structured_output import StructuredOutputsParams
from triollm.structured_output.llguidance_backend import GuidanceMatcher

PROMPT = "one two three"
YES = StructuredOutputsParams(choice=["yes"])
END: dict[str, int] = {}  # the end-of-reasoning token, chosen from the model's output


class EndTokenParser(ReasoningParser):
    """Names its end token, as vLLM's think-tag parsers do."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.end_token_id = END["id"]

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return self.end_token_id in input_ids


class TailParser(ReasoningParser):
    """Says only whether ids end the reasoning: the gate shows it the output's tail."""

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return END["id"] in input_ids


ReasoningParserManager.register_module("test_end_token", module=EndTokenParser)
ReasoningParserManager.register_module("test_tail", module=TailParser)


@pytest.fixture(scope="module")
def free_tokens(llama_llm: LLM) -> list[int]:
    out = llama_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    end = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    END["id"] = tokens[end]
    return tokens[:end + 1]


@pytest.mark.parametrize("parser", ["test_end_token", "test_tail"])
def test_the_constraint_waits_for_the_end_of_the_reasoning(
        llama_path: Path, free_tokens: list[int], parser: str) -> None:
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              structured_outputs_config={"backend": "guidance", "reasoning_parser": parser})
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=YES)
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    reasoning = len(free_tokens)
    assert completion.token_ids[:reasoning] == free_tokens  # unconstrained until the end
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(completion.token_ids[reasoning:], skip_special_tokens=True) == "yes"
    assert completion.finish_reason == "stop"
    # a prompt whose reasoning has ended already is constrained from the first token
    ended = {"prompt_token_ids": [*tokenizer.encode(PROMPT), END["id"]]}
    assert llm.generate(ended, params, use_tqdm=False)[0].outputs[0].text == "yes"


def test_a_reasoning_parser_the_tokenizer_cannot_serve_is_refused_at_start(
        llama_path: Path) -> None:
    # the test tokenizer has no <think> token: every request would fail on it
    with pytest.raises(ValueError, match=r"^reasoning_parser: .*'<think>'"):
        LLM(str(llama_path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
            structured_outputs_config={"reasoning_parser": "qwen3"})


def test_enable_in_reasoning_constrains_from_the_first_token(
        llama_path: Path, free_tokens: list[int]) -> None:
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              structured_outputs_config={"reasoning_parser": "test_end_token",
                                         "enable_in_reasoning": True})
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=YES)
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text == "yes"


def test_a_rejected_token_fails_its_request_alone(llama_llm: LLM,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    matchers: list[type] = [GuidanceMatcher]
    if importlib.util.find_spec("xgrammar") is not None:
        from triollm.structured_output.xgrammar_backend import XgrammarMatcher

        matchers.append(XgrammarMatcher)
    for matcher in matchers:
        monkeypatch.setattr(matcher, "accept_token", lambda self, token: False)
    core = llama_llm.engine
    core.add_request("bad", PROMPT, SamplingParams(max_tokens=5, structured_outputs=(
        StructuredOutputsParams(regex="[a-z]+"))))
    core.add_request("good", PROMPT, SamplingParams(max_tokens=5, temperature=0))
    finals = {}
    failures = []
    while core.has_unfinished_requests():
        finals.update({o.request_id: o for o in core.step() if o.finished})
        failures += core.take_failures()
    assert [f.request_id for f in failures] == ["bad"]
    assert re.search(r"grammar \(regex\) rejected token \d+", failures[0].error)
    assert list(finals) == ["good"] and len(finals["good"].outputs[0].token_ids) == 5
    with pytest.raises(RequestFailedError, match="rejected token"):
        llama_llm.generate(PROMPT, SamplingParams(max_tokens=3, structured_outputs=(
            StructuredOutputsParams(regex="[a-z]+"))), use_tqdm=False)


def test_constrained_samples_under_different_adapters_in_one_batch(
        lora_models: dict[str, Path]) -> None:
    llm = LLM(str(lora_models["llama"]), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, max_model_len=256, num_gpu_blocks_override=128)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9999}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    adapters = [None, LoRARequest("qv8", 1, str(lora_models["qv8"])),
                LoRARequest("all4", 2, str(lora_models["all4"]))]
    outputs = llm.generate([PROMPT] * 3, params, lora_request=adapters, use_tqdm=False)
    for output in outputs:
        assert set(json.loads(output.outputs[0].text)) == {"n"}
    alone = [llm.generate(PROMPT, params, lora_request=adapter, use_tqdm=False)[0]
             for adapter in adapters]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in alone]
